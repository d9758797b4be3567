"""`kvcache serve --target URL`: the same seeded workload sent to a running OpenAI-compatible
server (vLLM, SGLang, llama.cpp's server), timed as `vllm bench serve` times it.

The client is vLLM's benchmark client (`vllm/benchmarks/lib/endpoint_request_func.py`,
its `openai` backend) in the standard library: one streamed POST /v1/completions per
request, the prompt sent as token ids (the very tokens kvcache's engines get), greedy
(temperature 0), `max_tokens` the request's cap, `stream_options.include_usage` so the
server counts the tokens it streamed. A random workload asks for `ignore_eos` (every
reply its drawn length, as vLLM's random dataset does); a chat one for `stop_token_ids`
(the reply ends at the end-of-turn token, as kvcache's engines end it). The clock is
vLLM's: a request's time starts when it is sent (its arrival, or under
`--max-concurrency` the moment a slot frees); every server-sent event with choices is a
timestamp (TTFT the first, ITL the gaps between them, E2E the last); TPOT divides by the
server's own token count. `metrics.summarise` turns the timelines into the figures
kvcache's engines report, so the rows sit in one table.

The server's Prometheus /metrics, where it has one, is read before and after the run and
sampled during it: vLLM's `vllm:kv_cache_usage_perc` (peak), `vllm:num_preemptions_total`,
`vllm:prefix_cache_queries_total`/`hits_total` (the run's difference) and
`vllm:cache_config_info` (the blocks it allocated).

A run is whole or not shown: an unreachable URL, a server that is not OpenAI-compatible,
an HTTP error, a stream cut before `data: [DONE]`, a request slower than `--timeout`
raise `TargetError` (one line, exit 1) naming the request, and the requests still in
flight are cut. A model name the server does not serve is bad input (ValueError).
Threads and `http.client` only: no asyncio loop, no new dependency.
"""

from __future__ import annotations

import bisect
import http.client
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvcache_cli.serving.metrics import RequestTimes, summarise
from kvcache_cli.serving.results import EngineResult, Remote, ServerMetrics
from kvcache_cli.serving.sequence import Request
from kvcache_cli.serving.workload import WorkloadSpec

ENDPOINT = "/v1/completions"
# What a request may take, first byte to [DONE], unless --timeout says otherwise: a CPU
# server's long reply under load takes minutes, a hung one never ends.
DEFAULT_TIMEOUT_S = 300.0
# /v1/models, /version and /metrics answer at once on any server that is up.
PROBE_TIMEOUT_S = 10.0
# /metrics read during the run: twice a second sees a peak of KV use that lasts a
# second, and costs a server less than one decode step.
SAMPLE_EVERY_S = 0.5
# Threads, and sockets, the client holds at once: past this the client, not the server,
# is what limits the run (vLLM's aiohttp client holds no more by default).
MAX_IN_FLIGHT = 1024
# A server-sent event of a completion is a few hundred bytes; a line past this is not one.
MAX_LINE = 1 << 20
MAX_BODY = 16 << 20


class TargetError(RuntimeError):
    """The server failed, or answered what an OpenAI-compatible server would not."""


@dataclass(frozen=True)
class Target:
    url: str  # as shown: scheme://host:port
    scheme: str
    host: str
    port: int
    prefix: str  # a path before /v1 (a proxy's), usually ''


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
    return Target(f"{parts.scheme}://{shown}:{port}{prefix}", parts.scheme, host, port, prefix)


def _connection(target: Target, timeout: float) -> http.client.HTTPConnection:
    cls = http.client.HTTPSConnection if target.scheme == "https" else http.client.HTTPConnection
    return cls(target.host, target.port, timeout=timeout)


def _get(target: Target, path: str, timeout: float = PROBE_TIMEOUT_S) -> tuple[int, bytes]:
    """(status, body) of GET path; TargetError in one line when nothing sensible answers."""
    conn = _connection(target, timeout)
    try:
        conn.request("GET", target.prefix + path, headers={"Accept": "*/*"})
        response = conn.getresponse()
        return response.status, response.read(MAX_BODY)
    except ConnectionRefusedError:
        raise TargetError(f"--target {target.url}: nothing answers (connection refused); "
                          "expected a running server there") from None
    except TimeoutError:
        raise TargetError(f"--target {target.url}: no answer to GET {path} within "
                          f"{timeout:g} s") from None
    except http.client.HTTPException as err:
        raise TargetError(f"--target {target.url}: does not speak HTTP ({type(err).__name__})"
                          ) from None
    except OSError as err:
        raise TargetError(f"--target {target.url}: cannot be reached "
                          f"({err.strerror or type(err).__name__})") from None
    finally:
        conn.close()


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
    start = time.perf_counter()
    where = f"--target {target.url}"
    status, body = _get(target, "/v1/models", timeout)
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
        raise ValueError(f"--target-model {model!r}: {target.url} serves {', '.join(ids[:5])}; "
                         "expected one of them")
    chosen = model if model is not None else ids[0]
    entry = next(e for e in entries if str(e.get("id")) == chosen)
    owner = entry.get("owned_by") if isinstance(entry.get("owned_by"), str) else None
    version = None
    status, body = _get(target, "/version", timeout)
    if status == 200:
        try:
            version = str(json.loads(body)["version"])[:40]
        except (ValueError, KeyError, TypeError):
            version = None
    status, body = _get(target, "/metrics", timeout)
    has_metrics = status == 200 and bool(parse_prometheus(body.decode("utf-8", "replace")))
    return Server(target, chosen, ids, owner, version, has_metrics,
                  time.perf_counter() - start)


# ---------------------------------------------------------------------------- /metrics

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus' text format -> {metric name: [(labels, value), ...]}; comments skipped."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        line = line.strip()
        m = None if not line or line.startswith("#") else _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m[3])
        except ValueError:
            continue
        out.setdefault(m[1], []).append((dict(_LABEL.findall(m[2] or "")), value))
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


def read_metrics(target: Target, timeout: float = PROBE_TIMEOUT_S) -> Snapshot:
    status, body = _get(target, "/metrics", timeout)
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


class _Sampler:
    """/metrics read every SAMPLE_EVERY_S on a thread of its own while the run lasts."""

    def __init__(self, target: Target):
        self.target, self.snapshots = target, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="kvcache-metrics")

    def _loop(self) -> None:
        while not self.stop.wait(SAMPLE_EVERY_S):
            try:
                self.snapshots.append(read_metrics(self.target, 5.0))
            except TargetError:  # a missed sample is not a failed run
                continue

    def __enter__(self) -> _Sampler:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


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


def _error_detail(body: bytes) -> str:
    """An error body's message, one line: OpenAI's {"error": {"message"}} or text."""
    try:
        data = json.loads(body)
        error = data.get("error", data) if isinstance(data, dict) else data
        message = error.get("message", error) if isinstance(error, dict) else error
    except ValueError:
        message = body.decode("utf-8", "replace")
    text = " ".join(str(message).split())
    return f": {text[:200]}" if text else ""


class _Run:
    """One workload against the server: the dispatcher (the caller's thread), a thread per
    request in flight, and what they share under one lock."""

    def __init__(self, server: Server, requests: Sequence[Request], spec: WorkloadSpec,
                 timeout: float, texts: dict[int, str] | None = None):
        self.server, self.requests, self.spec, self.timeout = server, requests, spec, timeout
        self.texts = texts or {}
        self.cond = threading.Condition()
        self.replies = {r.id: _Reply() for r in requests}
        self.socks: dict[int, socket.socket] = {}
        self.deadlines: dict[int, float] = {}
        self.in_flight = self.finished = 0
        self.failure: str | None = None
        self.t0 = time.perf_counter()

    def clock(self) -> float:
        return time.perf_counter() - self.t0

    def fail(self, message: str) -> None:
        """Record the first failure and cut every request in flight."""
        with self.cond:
            if self.failure is None:
                self.failure = message
            for sock in self.socks.values():
                _cut(sock)
            self.cond.notify_all()

    def send(self, r: Request) -> None:
        """A request's thread: send, read the stream, record; any failure ends the run."""
        reply, ok = self.replies[r.id], False
        conn = _connection(self.server.target, self.timeout)
        with self.cond:
            self.deadlines[r.id] = self.clock() + self.timeout
        body = json.dumps(payload(self.server, r, self.spec, self.texts.get(r.id))).encode()
        try:
            reply.sent = self.clock()
            conn.connect()
            with self.cond:
                # The socket itself: a response that closes the connection when it ends
                # takes it over from `conn`, which forgets it.
                self.socks[r.id] = conn.sock
                if self.failure is not None:
                    _cut(conn.sock)
            conn.request("POST", self.server.target.prefix + ENDPOINT, body=body,
                         headers={"Content-Type": "application/json",
                                  "Accept": "text/event-stream"})
            response = conn.getresponse()
            if response.status != 200:
                raise TargetError(f"request {r.id}: HTTP {response.status} {response.reason}"
                                  f"{_error_detail(response.read(4096))}")
            if not self._read(r, reply, response):
                raise TargetError(f"request {r.id}: the stream ended after "
                                  f"{len(reply.times)} chunks without data: [DONE]: the "
                                  "reply was cut")
            if not reply.times:
                raise TargetError(f"request {r.id}: the server streamed no tokens")
            ok = True
        except TargetError as err:
            self.fail(str(err))
        except TimeoutError:
            self.fail(f"request {r.id}: no byte from the server for --timeout "
                      f"{self.timeout:g} s")
        except (OSError, http.client.HTTPException) as err:
            # A connection this run cut itself after another failure is not news.
            self.fail(f"request {r.id}: the connection broke after {len(reply.times)} chunks "
                      f"({type(err).__name__}): the reply was cut")
        except Exception as err:  # noqa: BLE001 - any other surprise ends the run in one line
            self.fail(f"request {r.id}: {type(err).__name__} reading the reply")
        finally:
            conn.close()
            with self.cond:
                self.socks.pop(r.id, None)
                self.deadlines.pop(r.id, None)
                self.in_flight -= 1
                self.finished += ok
                self.cond.notify_all()

    def _read(self, r: Request, reply: _Reply, response) -> bool:
        """Read the server-sent events to [DONE] (True) or the end of the stream (False)."""
        while True:
            line = response.readline(MAX_LINE + 1)
            if not line:
                return False
            if len(line) > MAX_LINE:
                raise TargetError(f"request {r.id}: a stream line past {MAX_LINE:,} bytes: "
                                  "not a completion's server-sent events")
            line = line.strip()
            if not line.startswith(b"data:"):
                continue  # blank separators, ': ping' comments, event: lines
            chunk = line[5:].strip()
            if chunk == b"[DONE]":
                return True
            try:
                data = json.loads(chunk)
            except ValueError:
                raise TargetError(f"request {r.id}: a stream event is not JSON "
                                  f"({chunk[:40]!r}); expected an OpenAI-compatible "
                                  "completion stream") from None
            if not isinstance(data, dict):
                raise TargetError(f"request {r.id}: a stream event is not a JSON object")
            if "error" in data:
                raise TargetError(f"request {r.id}: the server reported an error mid-reply"
                                  f"{_error_detail(chunk)}")
            if choices := data.get("choices"):
                reply.times.append(self.clock())  # vLLM's client: every chunk with choices
                choice = choices[0] if isinstance(choices[0], dict) else {}
                reply.finish = choice.get("finish_reason") or reply.finish
                if isinstance(text := choice.get("text"), str):
                    reply.text.append(text)
            elif isinstance(usage := data.get("usage"), dict):
                reply.completion_tokens = _count(usage.get("completion_tokens"))
                reply.prompt_tokens = _count(usage.get("prompt_tokens"))

    def dispatch(self, progress: TargetProgress | None) -> None:
        """Send each request when it has arrived and a slot is free; watch the deadlines."""
        cap = min(self.spec.max_concurrency or MAX_IN_FLIGHT, MAX_IN_FLIGHT)
        n, i, shown = len(self.requests), 0, None
        arrivals = [r.arrival_s for r in self.requests]
        threads = []
        with self.cond:
            while self.failure is None and self.finished < n:
                now = self.clock()
                while i < n and self.requests[i].arrival_s <= now and self.in_flight < cap:
                    self.in_flight += 1
                    t = threading.Thread(target=self.send, args=(self.requests[i],),
                                         daemon=True, name=f"kvcache-request-{i}")
                    t.start()
                    threads.append(t)
                    i += 1
                late = [rid for rid, d in self.deadlines.items() if now > d]
                if late:  # the lock is re-entrant: fail() takes it again
                    self.fail(f"request {late[0]}: no whole reply within --timeout "
                              f"{self.timeout:g} s")
                    break
                arrived = bisect.bisect_right(arrivals, now) - i  # arrivals are in order
                state = (self.finished, self.in_flight, arrived)
                if progress is not None and state != shown:
                    progress(self.server.name, self.finished, n, self.in_flight, arrived)
                    shown = state
                wait = 0.05  # the deadlines' resolution
                if i < n and self.in_flight < cap:
                    wait = min(wait, max(0.0, self.requests[i].arrival_s - now))
                self.cond.wait(wait)
        for t in threads:  # every connection is closed or cut: they end at once
            t.join(timeout=5)


def _cut(sock: socket.socket | None) -> None:
    """End a request another thread is reading: shutdown wakes a blocked recv, close
    alone does not."""
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _count(x) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) and x >= 0 else None


def run(server: Server, requests: Sequence[Request], spec: WorkloadSpec,
        rate: float | None, timeout: float = DEFAULT_TIMEOUT_S,
        targets: dict[str, float] | None = None,
        progress: TargetProgress | None = None,
        texts: dict[int, str] | None = None) -> EngineResult:
    """The workload against the server once: its row beside kvcache's engines. `texts`:
    each request's prompt as text, sent instead of its ids."""
    before = read_metrics(server.target) if server.metrics else None
    state = _Run(server, requests, spec, timeout, texts)
    if before is not None:
        with _Sampler(server.target) as sampler:
            state.dispatch(progress)
    else:
        sampler = None
        state.dispatch(progress)
    if state.failure is not None:
        raise TargetError(f"--target {server.target.url}: {state.failure}; "
                          f"{state.finished} of {len(requests)} requests had finished, and a "
                          "partial run is not shown")
    after = read_metrics(server.target) if before is not None else None
    metrics = None if before is None else server_metrics(before, sampler.snapshots, after)
    result = _result(server, requests, state.replies, rate, targets, metrics)
    if texts:
        import dataclasses

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
