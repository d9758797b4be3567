"""`kvcache serve --target URL`: the same seeded workload sent to a running OpenAI-compatible
server (vLLM, SGLang, llama.cpp's server), timed as `vllm bench serve` times it.

The client is vLLM's benchmark client (`vllm/benchmarks/lib/endpoint_request_func.py`,
its `openai` backend) on httpx: one streamed POST /v1/completions per request, the
prompt sent as token ids (the very tokens kvcache's engines get), greedy (temperature 0),
`max_tokens` the request's cap, `stream_options.include_usage` so the server counts the
tokens it streamed. A random workload asks for `ignore_eos` (every reply its drawn length,
as vLLM's random dataset does); a chat one for `stop_token_ids` (the reply ends at the
end-of-turn token, as kvcache's engines end it). The clock is vLLM's: a request's time
starts when it is sent (its arrival, or under `--max-concurrency` the moment a slot
frees); every server-sent event with choices is a timestamp (TTFT the first, ITL the gaps
between them, E2E the last); TPOT divides by the server's own token count.
`metrics.summarise` turns the timelines into the figures kvcache's engines report, so the
rows sit in one table.

The server's Prometheus /metrics, where it has one, is read before and after the run and
sampled during it: vLLM's `vllm:kv_cache_usage_perc` (peak), `vllm:num_preemptions_total`,
`vllm:prefix_cache_queries_total`/`hits_total` (the run's difference) and
`vllm:cache_config_info` (the blocks it allocated).

A run is whole or not shown: an unreachable URL, a server that is not OpenAI-compatible,
an HTTP error, a stream cut before `data: [DONE]`, a request slower than `--timeout`
raise `TargetError` (one line, exit 1) naming the request, and the requests still in
flight are cut. A model name the server does not serve is bad input (ValueError).
One asyncio loop, as vLLM's client runs: a task per request in flight, and cancelling
them is what cuts them. httpx carries HTTP, httpx-sse reads the event stream and
prometheus_client reads /metrics (all three in the torch extra, which serve needs).
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import json
import ssl
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
from httpx_sse import SSEError, aconnect_sse
from prometheus_client.parser import text_string_to_metric_families

from kvcache_cli.serving.metrics import RequestTimes, summarise
from kvcache_cli.serving.results import EngineResult, Remote, ServerMetrics
from kvcache_cli.serving.sequence import Request
from kvcache_cli.serving.workload import WorkloadSpec

ENDPOINT = "/v1/completions"
# What a request may take, sent to [DONE], unless --timeout says otherwise: a CPU
# server's long reply under load takes minutes, a hung one never ends.
DEFAULT_TIMEOUT_S = 300.0
# /v1/models, /version and /metrics answer at once on any server that is up.
PROBE_TIMEOUT_S = 10.0
# /metrics read during the run: twice a second sees a peak of KV use that lasts a
# second, and costs a server less than one decode step.
SAMPLE_EVERY_S = 0.5
# Requests, and connections, the client holds at once: past this the client, not the
# server, is what limits the run (vLLM's aiohttp client holds no more by default).
MAX_IN_FLIGHT = 1024
# What a GET's body (or an error's) is read to: /metrics is tens of kilobytes.
MAX_BODY = 16 << 20
# The progress line's resolution: how often the requests waiting for a slot are counted.
PROGRESS_EVERY_S = 0.05


class TargetError(RuntimeError):
    """The server failed, or answered what an OpenAI-compatible server would not."""


@dataclass(frozen=True)
class Target:
    url: str  # scheme://host:port[/prefix], as shown and as asked; the prefix a proxy's


def parse_target(text: str) -> Target:
    """`http://127.0.0.1:8000` (a trailing /v1 is the API's, not the server's) -> Target."""
    expected = "expected a server's URL such as http://127.0.0.1:8000"
    try:
        parts = urlsplit(text.strip())
        port = parts.port
    except ValueError:
        raise ValueError(f"--target {text!r}: {expected}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query \
            or parts.fragment:
        raise ValueError(f"--target {text!r}: {expected}")
    port = port or (443 if parts.scheme == "https" else 80)
    prefix = parts.path.rstrip("/").removesuffix("/v1")
    host = parts.hostname
    shown = f"[{host}]" if ":" in host else host  # an IPv6 address, bracketed as in a URL
    return Target(f"{parts.scheme}://{shown}:{port}{prefix}")


def _client() -> httpx.AsyncClient:
    """One run's (or one probe's) connections. trust_env=False: no proxy or .netrc from
    the environment, the URL given is the server asked; https checks the system's CAs."""
    return httpx.AsyncClient(trust_env=False, verify=ssl.create_default_context(),
                             limits=httpx.Limits(max_connections=MAX_IN_FLIGHT + 1))


async def _read_at_most(response: httpx.Response, limit: int) -> bytes:
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) >= limit:
            break
    return bytes(body[:limit])


def _chain(err: BaseException | None) -> Iterator[BaseException]:
    """An exception and what raised it, outermost first (httpx wraps the socket's error)."""
    while err is not None:
        yield err
        err = err.__cause__ or err.__context__


async def _get(client: httpx.AsyncClient, target: Target, path: str,
               timeout: float = PROBE_TIMEOUT_S) -> tuple[int, bytes]:
    """(status, body) of GET path; TargetError in one line when nothing sensible answers."""
    where = f"--target {target.url}"
    try:
        async with client.stream("GET", target.url + path, timeout=timeout) as response:
            return response.status_code, await _read_at_most(response, MAX_BODY)
    except httpx.TimeoutException:
        raise TargetError(f"{where}: no answer to GET {path} within {timeout:g} s") from None
    except httpx.ProtocolError as err:
        raise TargetError(f"{where}: does not speak HTTP ({type(err).__name__})") from None
    except httpx.TransportError as err:
        if any(isinstance(e, ConnectionRefusedError) for e in _chain(err)):
            raise TargetError(f"{where}: nothing answers (connection refused); expected a "
                              "running server there") from None
        reason = next((e.strerror for e in _chain(err) if isinstance(e, OSError) and e.strerror),
                      str(err) or type(err).__name__)
        raise TargetError(f"{where}: cannot be reached ({reason})") from None


# ---------------------------------------------------------------------------- the server


@dataclass(frozen=True)
class Server:
    """What a server said of itself before the run."""

    target: Target
    model: str  # the served model the requests name
    models: tuple[str, ...]  # every model it serves
    owner: str | None  # /v1/models' owned_by: vllm, sglang, llamacpp
    version: str | None  # /version's (vLLM's, SGLang's)
    metrics: bool  # /metrics answers in Prometheus text
    probe_s: float  # the three GETs

    @property
    def name(self) -> str:
        """The row's name in the tables: who serves it, e.g. `vllm`."""
        return (self.owner or "target").strip().lower().replace(" ", "-")[:20]

    @property
    def described(self) -> str | None:
        words = " ".join(x for x in (self.owner, self.version) if x)
        return words or None


def probe(target: Target, model: str | None, timeout: float = PROBE_TIMEOUT_S) -> Server:
    """The server's models, name and metrics; ValueError when `model` is not among them."""
    return asyncio.run(_probe(target, model, timeout))


async def _probe(target: Target, model: str | None, timeout: float) -> Server:
    start = time.perf_counter()
    where = f"--target {target.url}"
    async with _client() as client:
        status, body = await _get(client, target, "/v1/models", timeout)
        if status != 200:
            raise TargetError(f"{where}: GET /v1/models answered HTTP {status}; expected an "
                              "OpenAI-compatible server's list of models")
        try:
            data = json.loads(body)
            entries = data["data"]
            ids = tuple(str(e["id"]) for e in entries)
        except (ValueError, KeyError, TypeError):
            raise TargetError(f"{where}: GET /v1/models did not answer OpenAI's JSON list "
                              "({\"data\": [{\"id\": ...}]}); expected an OpenAI-compatible "
                              "server") from None
        if not ids:
            raise TargetError(f"{where}: serves no model (GET /v1/models is empty)")
        if model is None and len(ids) > 1:
            raise ValueError(f"--target-model: {target.url} serves {len(ids)} models "
                             f"({', '.join(ids[:5])}); expected one of them named")
        if model is not None and model not in ids:
            raise ValueError(f"--target-model {model!r}: {target.url} serves "
                             f"{', '.join(ids[:5])}; expected one of them")
        chosen = model if model is not None else ids[0]
        entry = next(e for e in entries if str(e.get("id")) == chosen)
        owner = entry.get("owned_by") if isinstance(entry.get("owned_by"), str) else None
        version = None
        status, body = await _get(client, target, "/version", timeout)
        if status == 200:
            try:
                version = str(json.loads(body)["version"])[:40]
            except (ValueError, KeyError, TypeError):
                version = None
        status, body = await _get(client, target, "/metrics", timeout)
    has_metrics = status == 200 and bool(parse_prometheus(body.decode("utf-8", "replace")))
    return Server(target, chosen, ids, owner, version, has_metrics,
                  time.perf_counter() - start)


# ---------------------------------------------------------------------------- /metrics


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus' text format -> {sample name: [(labels, value), ...]}, by
    prometheus_client's parser. A line at a time: the parser refuses a whole text at its
    first bad line, and one line it cannot read should cost that line, not the rest."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue  # HELP and TYPE: the samples' names are what is looked up
        try:
            families = list(text_string_to_metric_families(line))
        except ValueError:
            continue
        for family in families:
            for s in family.samples:
                out.setdefault(s.name, []).append((s.labels, s.value))
    return out


@dataclass(frozen=True)
class Snapshot:
    """The figures of one /metrics read (vLLM's names), None where absent."""

    kv_usage: float | None
    running: float | None
    preemptions: float | None
    prefix_queries: float | None
    prefix_hits: float | None
    num_blocks: int | None
    block_size: int | None
    kv_cache_tokens: int | None


def snapshot(samples: dict[str, list[tuple[dict[str, str], float]]]) -> Snapshot:
    def total(*names: str) -> float | None:
        for name in names:  # the first spelling the server has
            if name in samples:
                return sum(v for _, v in samples[name])
        return None

    def peak(*names: str) -> float | None:
        for name in names:
            if name in samples:  # one value per engine (data parallel): the fullest
                return max(v for _, v in samples[name])
        return None

    info = samples.get("vllm:cache_config_info", [({}, 0.0)])[0][0]

    def label(key: str) -> int | None:
        text = info.get(key, "")
        return int(text) if text.isdigit() else None

    return Snapshot(
        # vLLM's name; before v0.10 it was gpu_cache_usage_perc.
        kv_usage=peak("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        running=total("vllm:num_requests_running"),
        preemptions=total("vllm:num_preemptions_total"),
        prefix_queries=total("vllm:prefix_cache_queries_total"),
        prefix_hits=total("vllm:prefix_cache_hits_total"),
        num_blocks=label("num_gpu_blocks"), block_size=label("block_size"),
        kv_cache_tokens=label("kv_cache_size_tokens"))


async def _read_metrics(client: httpx.AsyncClient, target: Target,
                        timeout: float = PROBE_TIMEOUT_S) -> Snapshot:
    status, body = await _get(client, target, "/metrics", timeout)
    if status != 200:
        raise TargetError(f"--target {target.url}: GET /metrics answered HTTP {status}")
    return snapshot(parse_prometheus(body.decode("utf-8", "replace")))


def server_metrics(before: Snapshot, during: Sequence[Snapshot], after: Snapshot
                   ) -> ServerMetrics:
    def delta(name: str) -> int | None:
        a, b = getattr(before, name), getattr(after, name)
        return None if a is None or b is None else round(b - a)

    # Only what was seen while requests ran: after the run the blocks are free again.
    usages = [s.kv_usage for s in during if s.kv_usage is not None]
    running = [s.running for s in during if s.running is not None]
    return ServerMetrics(
        kv_usage_before=before.kv_usage, kv_usage_peak=max(usages) if usages else None,
        kv_usage_after=after.kv_usage,
        running_peak=round(max(running)) if running else None,
        preemptions=delta("preemptions"), prefix_queries=delta("prefix_queries"),
        prefix_hits=delta("prefix_hits"), num_blocks=after.num_blocks,
        block_size=after.block_size, kv_cache_tokens=after.kv_cache_tokens,
        samples=len(during))


def shared_prompt_tokens(prompts: Sequence[Sequence[int]], block_size: int) -> int:
    """The prompt tokens a prefix cache can serve from the prompts' own blocks: each whole
    block of `block_size` tokens whose tokens and prefix an earlier prompt holds (vLLM keys a
    block by its tokens and its prefix's key), whatever order they ran in."""
    seen: set[int] = set()
    shared = 0
    for prompt in prompts:
        key = 0
        for end in range(block_size, len(prompt) + 1, block_size):
            key = hash((key, tuple(prompt[end - block_size:end])))
            shared += block_size if key in seen else 0
            seen.add(key)
    return shared


# ---------------------------------------------------------------------------- the run

# (engine, requests done, requests in all, in flight, arrived and waiting for a slot)
TargetProgress = Callable[[str, int, int, int, int], None]


@dataclass
class _Reply:
    sent: float | None = None
    times: list[float] = field(default_factory=list)  # each chunk with choices
    prompt_tokens: int | None = None  # the server's counts (usage)
    completion_tokens: int | None = None
    finish: str | None = None
    text: list[str] = field(default_factory=list)  # the reply's text, chunk by chunk


PROMPT_FORMS = ("ids", "text")


def payload(server: Server, r: Request, spec: WorkloadSpec, text: str | None = None) -> dict:
    """One request's body, as vLLM's client builds it, greedy as kvcache's engines decode:
    the prompt's token ids, or `text` (for a server that takes only text, such as
    llama-cpp-python's: it tokenizes it again)."""
    body = {"model": server.model, "prompt": list(r.prompt) if text is None else text,
            "max_tokens": r.max_new_tokens, "temperature": 0.0,
            # No penalty, as vLLM's client asks (llama.cpp's servers default to 1.1 under
            # their own name): greedy means the argmax of the model's logits.
            "repetition_penalty": 1.0, "repeat_penalty": 1.0,
            "stream": True, "stream_options": {"include_usage": True}}
    if r.stop_ids:
        body["stop_token_ids"] = list(r.stop_ids)  # the end-of-turn token, as ours stop
    elif spec.kind == "random":
        body["ignore_eos"] = True  # the drawn length, not wherever EOS happens to fall
    return body


def _error_detail(body: str) -> str:
    """An error body's message, one line: OpenAI's {"error": {"message"}} or text."""
    try:
        data = json.loads(body)
        error = data.get("error", data) if isinstance(data, dict) else data
        message = error.get("message", error) if isinstance(error, dict) else error
    except ValueError:
        message = body
    text = " ".join(str(message).split())
    return f": {text[:200]}" if text else ""


class _Run:
    """One workload against the server on one event loop: the dispatcher, a task per
    request in flight, the /metrics sampler and the progress line. The first failure
    cancels the dispatcher, and with it every request in flight."""

    def __init__(self, server: Server, requests: Sequence[Request], spec: WorkloadSpec,
                 timeout: float, texts: dict[int, str] | None = None):
        self.server, self.requests, self.spec, self.timeout = server, requests, spec, timeout
        self.texts = texts or {}
        self.replies = {r.id: _Reply() for r in requests}
        self.sent = self.in_flight = self.finished = 0
        self.failure: str | None = None
        self.snapshots: list[Snapshot] = []
        self.dispatcher: asyncio.Task | None = None
        self.t0 = time.perf_counter()

    def clock(self) -> float:
        return time.perf_counter() - self.t0

    def fail(self, message: str) -> None:
        """Record the first failure and cut every request in flight."""
        if self.failure is None:
            self.failure = message
            self.dispatcher.cancel()

    async def main(self, progress: TargetProgress | None
                   ) -> tuple[Snapshot | None, Snapshot | None]:
        """The run, with /metrics read before and after it where the server has one."""
        target = self.server.target
        async with _client() as client:
            before = await _read_metrics(client, target) if self.server.metrics else None
            self.t0 = time.perf_counter()  # the arrivals count from here
            helpers = []
            if before is not None:
                helpers.append(asyncio.create_task(self._sample(client)))
            if progress is not None:
                helpers.append(asyncio.create_task(self._watch(progress)))
            self.dispatcher = asyncio.create_task(self._dispatch(client))
            await asyncio.wait([self.dispatcher])  # its end, or fail()'s cancel
            for task in helpers:
                task.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            if self.failure is not None:
                return before, None
            self.dispatcher.result()  # an exception nobody caught is a bug: let it show
            after = await _read_metrics(client, target) if before is not None else None
        return before, after

    async def _dispatch(self, client: httpx.AsyncClient) -> None:
        """Send each request when it has arrived and a slot is free."""
        slots = asyncio.Semaphore(min(self.spec.max_concurrency or MAX_IN_FLIGHT,
                                      MAX_IN_FLIGHT))
        tasks = []
        try:
            for r in self.requests:  # in arrival order
                await asyncio.sleep(max(0.0, r.arrival_s - self.clock()))
                await slots.acquire()
                self.sent += 1
                self.in_flight += 1
                tasks.append(asyncio.create_task(self._request(client, r, slots)))
            await asyncio.gather(*tasks)
        finally:  # cancelled by a failure: the requests still in flight are cut
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _request(self, client: httpx.AsyncClient, r: Request,
                       slots: asyncio.Semaphore) -> None:
        """One request, sent to [DONE] within --timeout; any failure ends the run."""
        reply, ok = self.replies[r.id], False
        try:
            await asyncio.wait_for(self._send(client, r, reply), self.timeout)
            ok = True
        except TargetError as err:
            self.fail(str(err))
        except asyncio.TimeoutError:
            self.fail(f"request {r.id}: no whole reply within --timeout {self.timeout:g} s")
        except httpx.TransportError as err:
            self.fail(f"request {r.id}: the connection broke after {len(reply.times)} chunks "
                      f"({type(err).__name__}): the reply was cut")
        except Exception as err:  # noqa: BLE001 - any other surprise ends the run in one line
            self.fail(f"request {r.id}: {type(err).__name__} reading the reply")
        finally:
            self.in_flight -= 1
            self.finished += ok
            slots.release()

    async def _send(self, client: httpx.AsyncClient, r: Request, reply: _Reply) -> None:
        body = payload(self.server, r, self.spec, self.texts.get(r.id))
        reply.sent = self.clock()
        # timeout=None: the request's one clock is _request's --timeout, sent to [DONE].
        async with aconnect_sse(client, "POST", self.server.target.url + ENDPOINT,
                                json=body, timeout=None) as source:
            response = source.response
            if response.status_code != 200:
                detail = _error_detail(
                    (await _read_at_most(response, 4096)).decode("utf-8", "replace"))
                raise TargetError(f"request {r.id}: HTTP {response.status_code} "
                                  f"{response.reason_phrase}{detail}")
            try:
                async with aclosing(source.aiter_sse()) as events:
                    done = await self._read(r, reply, events)
            except SSEError:  # its Content-Type is not text/event-stream
                raise TargetError(
                    f"request {r.id}: the reply is not server-sent events (Content-Type "
                    f"{response.headers.get('content-type', 'none')!r}); expected an "
                    "OpenAI-compatible completion stream") from None
        if not done:
            raise TargetError(f"request {r.id}: the stream ended after {len(reply.times)} "
                              "chunks without data: [DONE]: the reply was cut")
        if not reply.times:
            raise TargetError(f"request {r.id}: the server streamed no tokens")

    async def _read(self, r: Request, reply: _Reply, events) -> bool:
        """Read the server-sent events to [DONE] (True) or the end of the stream (False)."""
        async for event in events:
            if event.data == "[DONE]":
                return True
            try:
                data = json.loads(event.data)
            except ValueError:
                raise TargetError(f"request {r.id}: a stream event is not JSON "
                                  f"({event.data[:40]!r}); expected an OpenAI-compatible "
                                  "completion stream") from None
            if not isinstance(data, dict):
                raise TargetError(f"request {r.id}: a stream event is not a JSON object")
            if "error" in data:
                raise TargetError(f"request {r.id}: the server reported an error mid-reply"
                                  f"{_error_detail(event.data)}")
            if choices := data.get("choices"):
                reply.times.append(self.clock())  # vLLM's client: every chunk with choices
                choice = choices[0] if isinstance(choices[0], dict) else {}
                reply.finish = choice.get("finish_reason") or reply.finish
                if isinstance(text := choice.get("text"), str):
                    reply.text.append(text)
            elif isinstance(usage := data.get("usage"), dict):
                reply.completion_tokens = _count(usage.get("completion_tokens"))
                reply.prompt_tokens = _count(usage.get("prompt_tokens"))
        return False

    async def _sample(self, client: httpx.AsyncClient) -> None:
        """/metrics read every SAMPLE_EVERY_S while the run lasts (cancelled at its end)."""
        while True:
            await asyncio.sleep(SAMPLE_EVERY_S)
            try:
                self.snapshots.append(await _read_metrics(client, self.server.target, 5.0))
            except TargetError:  # a missed sample is not a failed run
                continue

    async def _watch(self, progress: TargetProgress) -> None:
        """The progress line, told whenever what it shows has changed."""
        arrivals = [r.arrival_s for r in self.requests]  # in order
        n, shown = len(self.requests), None
        while True:
            arrived = bisect.bisect_right(arrivals, self.clock()) - self.sent
            state = (self.finished, self.in_flight, arrived)
            if state != shown:
                progress(self.server.name, self.finished, n, self.in_flight, arrived)
                shown = state
            await asyncio.sleep(PROGRESS_EVERY_S)


def _count(x) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) and x >= 0 else None


def run(server: Server, requests: Sequence[Request], spec: WorkloadSpec,
        rate: float | None, timeout: float = DEFAULT_TIMEOUT_S,
        targets: dict[str, float] | None = None,
        progress: TargetProgress | None = None,
        texts: dict[int, str] | None = None) -> EngineResult:
    """The workload against the server once: its row beside kvcache's engines. `texts`:
    each request's prompt as text, sent instead of its ids."""
    state = _Run(server, requests, spec, timeout, texts)
    before, after = asyncio.run(state.main(progress))
    if state.failure is not None:
        raise TargetError(f"--target {server.target.url}: {state.failure}; "
                          f"{state.finished} of {len(requests)} requests had finished, and a "
                          "partial run is not shown")
    metrics = None if before is None else server_metrics(before, state.snapshots, after)
    if metrics is not None and metrics.block_size and not texts:  # the server has our ids
        metrics = dataclasses.replace(metrics, prefix_shared=shared_prompt_tokens(
            [r.prompt for r in requests], metrics.block_size))
    result = _result(server, requests, state.replies, rate, targets, metrics)
    if texts:
        result = dataclasses.replace(
            result, remote=dataclasses.replace(result.remote, prompt_form="text"))
    return result


def _result(server: Server, requests: Sequence[Request], replies: dict[int, _Reply],
            rate: float | None, targets: dict[str, float] | None,
            metrics: ServerMetrics | None) -> EngineResult:
    times = [RequestTimes(replies[r.id].sent, tuple(replies[r.id].times),
                          replies[r.id].prompt_tokens or len(r.prompt),
                          replies[r.id].completion_tokens) for r in requests]
    total = max(t.tokens[-1] for t in times)  # first arrival to the last token
    latency = summarise(times, total, targets)
    n_out = sum(t.n_out for t in times)
    finishes = [replies[r.id].finish for r in requests]
    remote = Remote(
        url=server.target.url, model=server.model, server=server.described, endpoint=ENDPOINT,
        stopped=finishes.count("stop"), capped=finishes.count("length"),
        prompt_tokens_differ=sum(1 for r in requests if replies[r.id].prompt_tokens
                                 not in (None, len(r.prompt))),
        chunked=any(t.n_out != len(t.tokens) for t in times), metrics=metrics,
        texts=tuple("".join(replies[r.id].text) for r in requests))
    pool = None
    if metrics is not None:
        pool = metrics.kv_cache_tokens or (
            metrics.num_blocks * metrics.block_size
            if metrics.num_blocks and metrics.block_size else None)
    return EngineResult(
        engine=server.name, setup_s=server.probe_s, total_s=total, output_tokens=n_out,
        tokens_per_s=n_out / total, latency=latency, kv_reserved_bytes=None,
        kv_peak_used_bytes=None, kv_utilisation=None,
        peak_running=None if metrics is None else metrics.running_peak,
        prefix_blocks_hit=None, preemptions=None if metrics is None else metrics.preemptions,
        requests_exact=None, mismatches=(), timeline=(), pool_tokens=pool, rate=rate,
        remote=remote)
