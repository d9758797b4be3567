"""One workload through several engines, each timed and checked against solo runs.

- `sequential`: one request at a time with today's static cache (`generate`); its
  tokens are every request's solo generation, the reference for the others;
- `padded`: what a plain batched `generate()` does: fixed groups, every row decoded
  until the group's longest request is done (finished rows keep computing), each
  row in a contiguous slab long enough for the longest request;
- `paged`: ours: `PagedCache` + continuous batching + prefix sharing, under each
  scheduler policy asked for (prefill-first; decode-first at each token budget), each
  a row of its own (`Variant`);
- `paged-int8`, `paged-int4`, `paged-fp8` (serve's --kv-dtype): the same engine on a pool
  of quantised blocks (`caches.quantized`), as many as the same kv_mem holds;
- `hf`: transformers' continuous batching (the manager behind
  `model.generate_batch`, with its own paged cache), on the same weights.

A request with stop ids (a chat workload's end-of-turn token) ends at the first one it
makes, in every engine and in its solo reference; else at its count.

`kv_mem` bounds every engine's KV memory alike: the paged pool, the padded slabs
(so it decides how many rows a group has), transformers' block count. One-time
set-up (pools, transformers' manager, a short untimed warm-up request) is timed
apart from the run. The clock starts when the first request may arrive; a request
that has not arrived yet cannot be served. Every output token's time is kept, and
`metrics` turns the timelines into vLLM's latency figures; with several `rates`
the whole comparison runs once per rate (the curve).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from kvcache_cli import numbers
from kvcache_cli.caches.exact import StaticCache
from kvcache_cli.caches.paged import PagedCache, block_bytes
from kvcache_cli.caches.quantized import POOLS, make_pool
from kvcache_cli.models.base import FamilyModel
from kvcache_cli.serving.block_manager import BlockManager
from kvcache_cli.serving.gqa_pool import PoolFigures
from kvcache_cli.serving.metrics import Latency, RequestTimes, summarise
from kvcache_cli.serving.model_runner import ModelRunner
from kvcache_cli.serving.scheduler import Scheduler, Step
from kvcache_cli.serving.sequence import Request
from kvcache_cli.serving.sequence import Sequence as Seq
from kvcache_cli.serving.workload import WorkloadSpec, make_requests

ENGINES = ("sequential", "padded", "paged", "hf")
BLOCK_SIZE = 16  # vLLM's default block: a short sequence wastes at most 15 slots
# One decode step of GPT-2 small in a batch of 4 against the same row alone (a GEMM
# against the one-row product, summing in another order): logits differed by up to
# 5e-5 of the largest, and the difference grows along a generation as the cached keys
# drift apart too. A top-2 gap under 1e-3 of the largest logit is within that noise.
NEAR_TIE = 1e-3

# A progress callback: (engine, requests done, requests in all, running, waiting,
# KV bytes in use, KV bytes reserved).
ProgressFn = Callable[[str, int, int, int, int, int, int], None]


@dataclass(frozen=True)
class Mismatch:
    """A request whose tokens left its solo generation's."""

    request: int
    step: int  # the first differing new token
    top2_gap: float  # the solo run's top-1 minus top-2 logit there
    logit_scale: float  # the largest |logit| there: float32 noise grows with it

    @property
    def near_tie(self) -> bool:
        """A gap within float32 noise of the logits' size: batched matmuls sum in another
        order than one row's, and a flipped near-tie sends greedy decoding elsewhere."""
        return self.top2_gap <= NEAR_TIE * self.logit_scale


@dataclass(frozen=True)
class Sample:
    t_s: float  # seconds since the run started
    running: int
    waiting: int  # arrived, not running
    kv_used_bytes: int  # blocks (or slabs) in use
    kv_real_bytes: int  # the part of them holding a real token's K and V


@dataclass(frozen=True)
class Variant:
    """An engine, and for paged its scheduler policy and token budget."""

    engine: str
    policy: str | None = None  # paged only
    token_budget: int | None = None  # decode-first only

    @property
    def name(self) -> str:
        """`paged pf` (prefill-first), `paged df 256` (decode-first, 256 tokens a forward):
        short enough for a table's first column beside seven figures."""
        if self.policy is None:
            return self.engine
        if self.policy == "prefill-first":
            return f"{self.engine} pf"
        return f"{self.engine} df {self.token_budget}"


def variants(engines: Sequence[str], policies: Sequence[str] = ("prefill-first",),
             budgets: Sequence[int] = ()) -> tuple[Variant, ...]:
    """Every engine once; paged once per policy, decode-first once per budget."""
    out = []
    for engine in engines:
        if engine not in POOLS:  # the paged engine on any pool runs each policy
            out.append(Variant(engine))
            continue
        for policy in policies:
            if policy == "decode-first":
                out += [Variant(engine, policy, b) for b in budgets]
            else:
                out.append(Variant(engine, policy))
    return tuple(out)


@dataclass(frozen=True)
class StepStats:
    """What the paged engine's forwards carried."""

    forwards: int
    prompt_tokens: int  # computed, recomputations included
    decode_tokens: int
    stalled: int  # sequence-forwards a sequence ready to decode waited while prompts ran
    tokens_per_forward: float  # mean
    budget_fill: float | None  # mean tokens / budget; None without a budget
    # Where the run's time went: scheduling (block tables, admission, preemption), forwards
    # that computed prompt tokens (mixed ones under decode-first), decode-only forwards.
    schedule_s: float = 0.0
    prompt_forward_s: float = 0.0
    decode_forward_s: float = 0.0


@dataclass(frozen=True)
class EngineResult:
    engine: str  # the variant's name: "paged df 256" (`Variant.name`)
    setup_s: float  # one-time: pools, transformers' manager, a warm-up request
    total_s: float  # first arrival to last token
    output_tokens: int
    tokens_per_s: float  # output tokens / total_s
    latency: Latency  # vLLM's figures: TTFT, TPOT, ITL, E2E, throughputs, goodput
    kv_reserved_bytes: int | None  # what the engine holds for KV (pool, slabs)
    kv_peak_used_bytes: int | None  # blocks or slabs in use at the peak
    kv_utilisation: float | None  # real / in use, averaged over the run's time
    peak_running: int | None
    prefix_blocks_hit: int | None
    preemptions: int | None
    requests_exact: int  # requests whose tokens equal their solo generation's
    mismatches: tuple[Mismatch, ...]
    timeline: tuple[Sample, ...]
    pool_tokens: int | None = None  # tokens the paged pool holds at once (its blocks x size)
    rate: float | None = None  # requests/s this run's arrivals came at; None: all at once
    policy: str | None = None
    token_budget: int | None = None
    steps: StepStats | None = None  # paged only
    over_sequential: float | None = None  # tokens/s ratios, filled in by run_serve
    over_padded: float | None = None
    over_hf: float | None = None
    # paged: the share of the shared prefix's full blocks served from the prefix cache to
    # every request after the first (the system prompt's, in a chat workload)
    shared_hit_rate: float | None = None


@dataclass(frozen=True)
class Replies:
    """A chat workload's replies, as every request made alone made them."""

    stop_names: tuple[str, ...]  # the end-of-turn token(s), e.g. <|im_end|>
    cap: int
    shortest: int
    median: float
    longest: int
    stopped: int  # replies that ended at a stop token
    capped: int  # replies cut at the cap


def replies_of(requests: Sequence[Request], tokens: dict[int, list[int]],
               stop_names: Sequence[str]) -> Replies:
    import statistics

    lengths = [len(tokens[r.id]) for r in requests]
    stopped = sum(1 for r in requests if tokens[r.id] and tokens[r.id][-1] in r.stop_ids)
    return Replies(tuple(stop_names), max(r.max_new_tokens for r in requests), min(lengths),
                   statistics.median(lengths), max(lengths), stopped, len(requests) - stopped)


@dataclass(frozen=True)
class ServeResult:
    model: str
    weights_note: str | None
    device: str
    device_name: str
    cpus: int
    threads: int
    others_cpu_share: float | None  # other processes' share of CPU time during the run
    dtype: str
    torch_version: str
    transformers_version: str | None
    workload: WorkloadSpec
    prompt_tokens: int
    output_tokens: int
    kv_mem_bytes: int
    block_size: int
    n_blocks: int
    bytes_per_token: int  # K and V, every layer
    padded_rows: int  # rows of a padded group under kv_mem
    slab_len: int  # positions of one padded row
    max_batch: int
    prefix_sharing: bool
    engines: tuple[EngineResult, ...]  # every variant at every rate, rate by rate
    rates: tuple[float | None, ...] = (None,)
    goodput: dict[str, float] | None = None  # targets, ms
    replies: Replies | None = None  # a chat workload's reply lengths and stops
    pool: PoolFigures | None = None  # the pool under GQA, beside GPT-2 small's

    def at(self, rate: float | None) -> tuple[EngineResult, ...]:
        return tuple(e for e in self.engines if e.rate == rate)


# ---------------------------------------------------------------------------- inputs


def parse_engines(text: str) -> tuple[str, ...]:
    names = tuple(part.strip().lower() for part in text.split(",") if part.strip())
    unknown = [n for n in names if n not in ENGINES and n not in POOLS]
    if unknown or not names:
        what = f"unknown engine {', '.join(map(repr, unknown))}" if unknown else "no engines"
        raise ValueError(f"--engines: {what}; valid engines: {', '.join(ENGINES)}")
    if len(set(names)) < len(names):
        raise ValueError(f"--engines {text!r}: an engine given twice")
    if "hf" in names:
        _check_hf_engine()
    return names


# transformers' continuous batching refuses pages smaller than this (its BOUNDS["page_size"]),
# in its own words and only once its engine starts, after the others have run.
HF_MIN_PAGE = 4


def check_hf_block_size(engines: Sequence[str], block_size: int) -> None:
    """Refuse, before any engine runs, a --block-size the hf engine cannot page."""
    if "hf" in engines and block_size < HF_MIN_PAGE:
        raise ValueError(f"--block-size {block_size:,}: the hf engine (transformers' "
                         f"continuous batching) pages at least {HF_MIN_PAGE} tokens a block; "
                         f"expected {HF_MIN_PAGE} or more, or --engines without hf")


def parse_budgets(text: str, block_size: int) -> tuple[int, ...]:
    """`"64,256,1024"` -> (64, 256, 1024): decode-first's token budgets, each at least a block."""
    from kvcache_cli.serving.scheduler import check_budget

    parts = [part.strip() for part in text.split(",")]
    if not all(numbers.is_whole(part) for part in parts):
        raise ValueError(f"--token-budget {text!r}: expected tokens per forward, "
                         "comma-separated, e.g. 64,256,1024")
    budgets = tuple(int(part) for part in parts)
    for b in budgets:
        check_budget(b, block_size)
    if len(set(budgets)) < len(budgets):
        raise ValueError(f"--token-budget {text!r}: a budget given twice")
    return budgets


def _check_hf_engine() -> None:
    """The hf engine drives transformers' continuous batching, which older releases lack."""
    try:
        from transformers.generation.configuration_utils import (  # noqa: F401
            ContinuousBatchingConfig,
        )
    except ImportError:
        import transformers

        raise ValueError(
            f"--engines hf: transformers {transformers.__version__} has no continuous batching "
            "(generate_batch): upgrade transformers, or leave hf out of --engines") from None


@dataclass(frozen=True)
class Plan:
    """How kv_mem is shared out: paged blocks, padded rows."""

    n_blocks: int
    padded_rows: int
    slab_len: int
    kv_mem: int = 0  # what a quantised pool's blocks are counted from


def plan_memory(config, dtype: torch.dtype, spec: WorkloadSpec, kv_mem: int, block_size: int,
                max_batch: int) -> Plan:
    """Refuse a budget that cannot hold even the longest request."""
    if block_size < 1:
        raise ValueError(f"--block-size {block_size}: expected at least 1 token")
    if max_batch < 1:
        raise ValueError(f"--max-batch {max_batch}: expected at least 1")
    per_token = block_bytes(config.cache_shape, 1, dtype)
    n_blocks = kv_mem // block_bytes(config.cache_shape, block_size, dtype)
    need = -(-spec.longest // block_size)
    if n_blocks < need:
        raise ValueError(
            f"--kv-mem {kv_mem:,} bytes holds {n_blocks} blocks of {block_size} tokens "
            f"({per_token:,} bytes a token); the longest request ({spec.longest} tokens) "
            f"needs {need}")
    rows = min(max_batch, kv_mem // (spec.longest * per_token))
    return Plan(n_blocks, rows, spec.longest, kv_mem)


def fit_padded(plan: Plan, requests: Sequence[Request], config, dtype: torch.dtype,
               kv_mem: int, max_batch: int) -> Plan:
    """The padded engine sized to the workload, as a batched generate() is sized to its batch:
    rows for no more requests than there are, each as long as the longest prompt there is
    plus the longest output (every row decodes until the group's longest is done), not as
    long as the ranges allow, within kv_mem. Reserving rows for the whole budget would
    charge it for memory no request asked for."""
    longest = max(len(r.prompt) for r in requests) + max(r.max_new_tokens for r in requests)
    row_bytes = longest * block_bytes(config.cache_shape, 1, dtype)
    rows = min(max_batch, len(requests), kv_mem // row_bytes)
    return dataclasses.replace(plan, padded_rows=rows, slab_len=longest)


# ---------------------------------------------------------------------------- clocks


class _Recorder:
    """Arrivals, token times and memory samples of one engine's run.

    A request is sent when it has arrived and, under a concurrency cap, a slot is
    free: request i waits for the (i - cap + 1)-th finish, and counts its latency
    from then (vLLM's client waits on a semaphore before it sends).
    """

    def __init__(self, engine: str, requests: Sequence[Request], device,
                 progress: ProgressFn | None, max_concurrency: int | None = None):
        self.engine, self.requests, self.device, self.progress = engine, requests, device, progress
        self.max_concurrency = max_concurrency
        self.tokens: dict[int, list[int]] = {}
        self.times: dict[int, list[float]] = {}  # when each output token appeared
        self.sent: dict[int, float] = {}
        self.finish: dict[int, float] = {}
        self.finished_at: list[float] = []  # finish times in the order requests finished
        self.samples: list[Sample] = []
        self.next_arrival = 0  # index of the first request not yet handed in
        self.reserved = 0  # KV bytes the engine holds, for the progress display
        self.t0 = time.perf_counter()

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self.t0

    def _slot_free_at(self, i: int) -> float | None:
        """When request i may be sent under the cap; None: not yet."""
        if self.max_concurrency is None or i < self.max_concurrency:
            return 0.0
        k = i - self.max_concurrency  # the (k + 1)-th finish frees its slot
        return self.finished_at[k] if k < len(self.finished_at) else None

    def arrivals(self) -> Iterator[Request]:
        """Requests sent since the last call, in arrival order."""
        now = time.perf_counter() - self.t0
        while self.next_arrival < len(self.requests):
            r = self.requests[self.next_arrival]
            free = self._slot_free_at(self.next_arrival)
            if r.arrival_s > now or free is None:
                break
            self.sent[r.id] = max(r.arrival_s, free)
            self.next_arrival += 1
            yield r

    def wait_for_arrival(self) -> None:
        """Sleep until the next request arrives (only when nothing else can run)."""
        if self.next_arrival < len(self.requests):
            ahead = self.requests[self.next_arrival].arrival_s - (time.perf_counter() - self.t0)
            time.sleep(max(0.0, ahead))

    def token(self, rid: int, t: float) -> None:
        self.times.setdefault(rid, []).append(t)

    def done(self, rid: int, t: float) -> None:
        self.finish[rid] = t
        self.finished_at.append(t)

    @property
    def arrived(self) -> int:
        return self.next_arrival

    def sample(self, running: int, waiting: int, used: int, real: int) -> None:
        self.samples.append(Sample(self.now(), running, waiting, used, real))
        if self.progress is not None:
            self.progress(self.engine, len(self.finish), len(self.requests), running, waiting,
                          used, self.reserved)


# ---------------------------------------------------------------------------- engines


def _run_sequential(model: FamilyModel, requests, rec: _Recorder) -> None:
    from kvcache_cli.generate import stream_tokens

    per_token = block_bytes(model.config.cache_shape, 1, model.dtype)
    for i, r in enumerate(requests):
        while rec.arrived <= i:  # one at a time, in arrival order
            if not list(rec.arrivals()):
                rec.wait_for_arrival()
        cache = StaticCache(model.config.cache_shape, len(r.prompt) + r.max_new_tokens, 1,
                            model.device, model.dtype)
        rec.reserved = max(rec.reserved, cache.bytes_held)  # the largest it ever held
        tokens = rec.tokens[r.id] = []
        for token in stream_tokens(model, list(r.prompt), r.max_new_tokens, "static",
                                   cache=cache):
            tokens.append(token)
            rec.token(r.id, rec.now())
            rec.sample(1, rec.arrived - len(rec.finish) - 1, cache.bytes_held,
                       cache.length * per_token)
            if r.finished(tokens):  # a stop token: the reply is over
                break
        rec.done(r.id, rec.now())


def _run_padded(model: FamilyModel, requests, rec: _Recorder, plan: Plan) -> None:
    cache = PagedCache(model.config.cache_shape, plan.padded_rows, plan.slab_len, model.device,
                       model.dtype)
    runner = ModelRunner(model, cache)  # one block per row: a contiguous slab
    per_token = block_bytes(model.config.cache_shape, 1, model.dtype)
    rec.reserved = cache.bytes_held
    queue: list[Request] = []
    while len(rec.finish) < len(requests):
        queue += rec.arrivals()
        if not queue:
            rec.wait_for_arrival()
            continue
        group, queue = queue[: plan.padded_rows], queue[plan.padded_rows :]
        seqs = [Seq(r, block_table=[row]) for row, r in enumerate(group)]
        replies: dict[int, list[int]] = {}  # each row's reply, to its cap or stop token
        for s in seqs:
            s.tokens.append(runner.prefill(s))
            rec.token(s.request.id, rec.now())
            if s.done:
                replies[s.request.id] = s.generated
                rec.done(s.request.id, rec.times[s.request.id][0])
        while len(replies) < len(seqs):
            # Every row, done or not, as a padded batch does: the group's shape is fixed.
            tokens = runner.decode(tuple(seqs))
            t = rec.now()
            for s, token in zip(seqs, tokens, strict=True):
                s.tokens.append(token)
                if s.request.id not in replies:
                    rec.token(s.request.id, t)
                    if s.done:
                        replies[s.request.id] = s.generated
                        rec.done(s.request.id, t)
            queue += rec.arrivals()
            real = sum(min(s.num_cached, len(s.request.prompt) + len(replies.get(
                s.request.id, s.generated))) for s in seqs)
            rec.sample(len(seqs), len(queue), cache.bytes_held, real * per_token)
        rec.tokens.update(replies)


@dataclass
class _PagedState:
    blocks: BlockManager
    scheduler: Scheduler
    steps: list[Step]
    times: list[tuple[float, float]]  # per step: (scheduling s, forwards s)
    seqs: list[Seq]  # in arrival order


def shared_hit_rate(seqs: Sequence[Seq], shared_prefix: int, block_size: int) -> float | None:
    """The share of the shared prefix's full blocks that every request admitted after the
    first took from the prefix cache; None without a full block to share or a second one."""
    full = shared_prefix // block_size
    later = sorted((s for s in seqs if s.admitted_hits is not None),
                   key=lambda s: s.request.arrival_s)[1:]
    if not full or not later:
        return None
    return sum(min(s.admitted_hits, full) for s in later) / (full * len(later))


def _step_stats(steps: Sequence[Step], times: Sequence[tuple[float, float]],
                budget: int | None) -> StepStats:
    tokens = sum(st.tokens for st in steps)
    # A prefill-first prefill runs each admitted prompt in a forward of its own.
    forwards = sum(len(st.prefill) + bool(st.decode) + bool(st.chunks) for st in steps)
    return StepStats(
        forwards=forwards, prompt_tokens=sum(st.prompt_tokens for st in steps),
        decode_tokens=sum(st.decode_tokens for st in steps),
        stalled=sum(st.stalled for st in steps), tokens_per_forward=tokens / max(1, forwards),
        budget_fill=None if budget is None or not steps else tokens / (len(steps) * budget),
        schedule_s=sum(t for t, _ in times),
        prompt_forward_s=sum(f for st, (_, f) in zip(steps, times) if st.prompt_tokens),
        decode_forward_s=sum(f for st, (_, f) in zip(steps, times) if not st.prompt_tokens))


def _run_paged(model: FamilyModel, requests, rec: _Recorder, plan: Plan, block_size: int,
               max_batch: int, prefix_sharing: bool, cache: PagedCache,
               policy: str = "prefill-first", token_budget: int | None = None,
               layout: str = "packed") -> _PagedState:
    blocks = BlockManager(plan.n_blocks, block_size, prefix_sharing)
    scheduler = Scheduler(blocks, max_batch, policy, token_budget)
    state = _PagedState(blocks, scheduler, [], [], [])
    runner = ModelRunner(model, cache, layout)
    one_block = cache.bytes_held // plan.n_blocks  # full-precision or quantised blocks
    per_token = one_block // block_size
    rec.reserved = cache.bytes_held
    while len(rec.finish) < len(requests):
        for r in rec.arrivals():
            state.seqs.append(Seq(r))
            scheduler.add(state.seqs[-1])
        if scheduler.idle:
            rec.wait_for_arrival()
            continue
        started = rec.now()
        step = scheduler.schedule()
        if step.empty:
            raise RuntimeError("the scheduler found nothing to run: the pool is too small")
        scheduled = rec.now()
        state.steps.append(step)
        sampled: list[Seq] = []  # sequences that got a token this step
        for s in step.prefill:
            s.tokens.append(runner.prefill(s))
            rec.token(s.request.id, rec.now())
        if step.decode:
            for s, token in zip(step.decode, runner.decode(step.decode), strict=True):
                s.tokens.append(token)
                sampled.append(s)
        if step.chunks:
            for c, token in zip(step.chunks, runner.step(step.chunks), strict=True):
                if token is not None:
                    c.seq.tokens.append(token)
                    sampled.append(c.seq)
        t = rec.now()
        state.times.append((scheduled - started, t - scheduled))
        for s in sampled:
            rec.token(s.request.id, t)
            if s.num_cached % block_size == 0:  # a block just filled
                blocks.register_full_blocks(s, s.num_cached)
        rec.sample(len(scheduler.running), len(scheduler.waiting),
                   blocks.blocks_in_use * one_block,
                   blocks.tokens_stored(scheduler.running) * per_token)
        for s in [s for s in scheduler.running if s.done]:
            scheduler.finish(s)
            rec.done(s.request.id, rec.times[s.request.id][-1])
            rec.tokens[s.request.id] = s.generated
    return state


def _hf_manager(model: FamilyModel, plan: Plan, block_size: int, max_batch: int, spec: WorkloadSpec,
                prefix_sharing: bool):
    """transformers' continuous-batching manager on our weights, started and warmed up."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from kvcache_cli.models import to_hf

    hf = to_hf(model)
    hf.generation_config.eos_token_id = None  # ours never stop early; neither may it
    generation = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                                  max_new_tokens=spec.output_len[1])
    batching = ContinuousBatchingConfig(
        page_size=block_size,
        num_blocks=plan.n_blocks,  # the same memory as our pool
        max_requests_per_batch=max_batch,
        allow_block_sharing=prefix_sharing,  # its prefix caching, on or off as ours is
        # Tokens one forward may take: a whole prompt, as our prefill does.
        max_batch_tokens=max(spec.shared_prefix + spec.prompt_len[1], max_batch),
    )
    manager = hf.init_continuous_batching(generation, batching)
    manager.warmup()
    manager.start()
    _hf_collect(manager, [_warmup_request(plan.slab_len)], None)
    return manager


def _hf_collect(manager, requests, rec: _Recorder | None) -> None:
    """Hand requests in at their arrival times; wait for every result."""
    pending = {}
    added = 0
    while added < len(requests) or pending:
        if rec is None:
            due = requests[added:]
        else:
            due = list(rec.arrivals())
        for r in due:
            # -1: no stop (transformers' "disabled"), so a random-ids reply runs to its count.
            stop = list(r.stop_ids) if r.stop_ids else -1
            pending[manager.add_request(list(r.prompt), request_id=f"r{r.id}",
                                        max_new_tokens=r.max_new_tokens,
                                        record_timestamps=True, eos_token_id=stop)] = r
        added += len(due)
        result = manager.get_result(timeout=0.01 if added < len(requests) else 1.0)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' batching thread stopped before finishing")
            continue
        if not result.is_finished():
            continue
        if result.error:
            raise RuntimeError(f"transformers' generate_batch failed: {result.error}")
        r = pending.pop(result.request_id)
        if rec is not None:
            rec.tokens[r.id] = list(result.generated_tokens)
            # One time per token when it keeps them; else the finish for every token.
            stamps = list(result.timestamps or [])
            if len(stamps) != len(result.generated_tokens):
                stamps = [result.lifespan[1]] * len(result.generated_tokens)
            rec.times[r.id] = [t - rec.t0 for t in stamps]
            rec.done(r.id, stamps[-1] - rec.t0)
            if rec.progress is not None:
                rec.progress(rec.engine, len(rec.finish), len(rec.requests), 0, 0, 0, 0)


# ---------------------------------------------------------------------------- summary


def _mismatches(model: FamilyModel, requests, tokens: dict[int, list[int]],
                reference: dict[int, list[int]]) -> tuple[Mismatch, ...]:
    out = []
    for r in requests:
        got, ref = tokens[r.id], reference[r.id]
        if got == ref:
            continue
        differ = (i for i, (a, b) in enumerate(zip(got, ref)) if a != b)
        step = next(differ, min(len(got), len(ref)))  # else one stopped early
        gap = scale = float("nan")
        if step < len(ref):
            idx = torch.tensor([list(r.prompt) + ref[:step]], device=model.device)  # (1, T)
            with torch.inference_mode():
                logits = model(idx, 0, None, last_only=True)[0, -1]  # (vocab,)
            top2 = logits.topk(2).values
            gap, scale = float(top2[0] - top2[1]), float(logits.abs().max())
        out.append(Mismatch(r.id, step, gap, scale))
    return tuple(out)


def _summarise(engine: str, setup_s: float, rec: _Recorder, model: FamilyModel,
               reference: dict[int, list[int]], targets: dict[str, float] | None,
               **memory) -> EngineResult:
    total = max(rec.finish.values())
    n_out = sum(len(t) for t in rec.tokens.values())
    times = [RequestTimes(rec.sent[r.id], tuple(rec.times[r.id]), len(r.prompt))
             for r in rec.requests]
    samples = rec.samples
    utilisation = None
    if samples:
        # Weighted by how long each state lasted: a step's sample holds until the next.
        ends = [s.t_s for s in samples[1:]] + [total]
        spans = [max(0.0, e - s.t_s) for s, e in zip(samples, ends, strict=True)]
        used = sum(s.kv_used_bytes * d for s, d in zip(samples, spans, strict=True))
        real = sum(s.kv_real_bytes * d for s, d in zip(samples, spans, strict=True))
        utilisation = real / used if used else None
    mismatches = _mismatches(model, rec.requests, rec.tokens, reference)
    return EngineResult(
        engine=engine, setup_s=setup_s, total_s=total, output_tokens=n_out,
        tokens_per_s=n_out / total, latency=summarise(times, total, targets),
        kv_reserved_bytes=memory.get("reserved"),
        kv_peak_used_bytes=max((s.kv_used_bytes for s in samples), default=None),
        kv_utilisation=utilisation,
        peak_running=max((s.running for s in samples), default=None),
        prefix_blocks_hit=memory.get("prefix_hits"),
        shared_hit_rate=memory.get("shared_hit_rate"),
        preemptions=memory.get("preemptions"),
        pool_tokens=memory.get("pool_tokens"),
        requests_exact=len(rec.requests) - len(mismatches),
        mismatches=mismatches,
        timeline=tuple(samples),
        steps=memory.get("steps"),
    )


def _warmup_request(longest: int) -> Request:
    """A short untimed request that fits wherever the workload's longest does."""
    prompt = max(1, min(8, longest - 1))
    return Request(-1, (0,) * prompt, max(1, min(4, longest - prompt)), 0.0)


def _prepare(variant: Variant, model: FamilyModel, spec: WorkloadSpec, plan: Plan, block_size: int,
             max_batch: int, prefix_sharing: bool, stack: contextlib.ExitStack,
             layout: str = "packed") -> Callable[[Sequence[Request], _Recorder], dict]:
    """The engine's one-time set-up, warm-up included; returns how to run it."""
    device, warmup, engine = model.device, [_warmup_request(plan.slab_len)], variant.engine

    def recorder() -> _Recorder:
        return _Recorder(engine, warmup, device, None)

    if engine == "sequential":
        _run_sequential(model, warmup, recorder())
        return lambda requests, rec: _run_sequential(model, requests, rec) or {}
    if engine == "padded":
        _run_padded(model, warmup, recorder(), Plan(plan.n_blocks, 1, plan.slab_len))
        return lambda requests, rec: _run_padded(model, requests, rec, plan) or {}
    if engine in POOLS:
        cache = make_pool(engine, model.config.cache_shape, plan.kv_mem, block_size, device,
                          model.dtype)
        plan = dataclasses.replace(plan, n_blocks=cache.k.size(2))
        policy = dict(policy=variant.policy or "prefill-first",
                      token_budget=variant.token_budget, layout=layout)
        _run_paged(model, warmup, recorder(), plan, block_size, max_batch, False, cache,
                   **policy)

        def run_paged(requests, rec) -> dict:
            state = _run_paged(model, requests, rec, plan, block_size, max_batch,
                               prefix_sharing, cache, **policy)
            return dict(prefix_hits=state.blocks.prefix_hits,
                        shared_hit_rate=shared_hit_rate(state.seqs, spec.shared_prefix,
                                                        block_size),
                        preemptions=state.scheduler.preemptions,
                        pool_tokens=plan.n_blocks * block_size,
                        steps=_step_stats(state.steps, state.times, variant.token_budget))

        return run_paged
    from kvcache_cli.measure import quiet_transformers

    stack.enter_context(quiet_transformers())
    manager = _hf_manager(model, plan, block_size, max_batch, spec, prefix_sharing)
    stack.callback(manager.stop, block=True, timeout=5)
    reserved = plan.n_blocks * block_bytes(model.config.cache_shape, block_size, model.dtype)
    return lambda requests, rec: _hf_collect(manager, requests, rec) or dict(reserved=reserved)


def run_variant(variant: Variant | str, model: FamilyModel,
                workloads: Sequence[tuple[float | None, Sequence[Request]]], spec: WorkloadSpec,
                plan: Plan, block_size: int, max_batch: int, prefix_sharing: bool,
                reference: dict[int, list[int]] | None, progress: ProgressFn | None = None,
                targets: dict[str, float] | None = None, layout: str = "packed",
                done: Callable[[EngineResult], None] | None = None,
                ) -> list[tuple[EngineResult, dict[int, list[int]]]]:
    """One engine, set up once, over each (rate, requests): its results and tokens.

    Without a `reference` (the sequential engine's own run), the tokens of its first
    run are the reference: every request generated alone.
    """
    import dataclasses

    variant = variant if isinstance(variant, Variant) else Variant(variant)
    out = []
    with contextlib.ExitStack() as stack:
        start = time.perf_counter()
        run = _prepare(variant, model, spec, plan, block_size, max_batch, prefix_sharing,
                       stack, layout)
        setup_s = time.perf_counter() - start
        for rate, requests in workloads:
            rec = _Recorder(variant.name, requests, model.device, progress,
                            spec.max_concurrency)
            memory = run(requests, rec)
            memory.setdefault("reserved", rec.reserved)
            reference = rec.tokens if reference is None else reference
            result = dataclasses.replace(
                _summarise(variant.name, setup_s, rec, model, reference, targets, **memory),
                rate=rate, policy=variant.policy, token_budget=variant.token_budget)
            if done is not None:
                done(result)
            out.append((result, rec.tokens))
    return out


def run_engine(engine: Variant | str, model: FamilyModel, requests: Sequence[Request],
               spec: WorkloadSpec, plan: Plan, block_size: int, max_batch: int,
               prefix_sharing: bool, reference: dict[int, list[int]] | None,
               progress: ProgressFn | None = None, targets: dict[str, float] | None = None,
               layout: str = "packed") -> tuple[EngineResult, dict[int, list[int]]]:
    """One engine over one workload: (its result, each request's tokens)."""
    return run_variant(engine, model, [(spec.rate, requests)], spec, plan, block_size,
                       max_batch, prefix_sharing, reference, progress, targets, layout)[0]


def solo_tokens(model: FamilyModel, requests: Sequence[Request]) -> dict[int, list[int]]:
    """Every request generated alone with the static cache: the reference, untimed."""
    from kvcache_cli.generate import stream_tokens

    out: dict[int, list[int]] = {}
    for r in requests:
        tokens = out[r.id] = []
        for token in stream_tokens(model, list(r.prompt), r.max_new_tokens, "static"):
            tokens.append(token)
            if r.finished(tokens):
                break
    return out


def run_serve(model: FamilyModel, spec: WorkloadSpec, engines: Sequence[str | Variant], kv_mem: int,
              block_size: int = BLOCK_SIZE, max_batch: int = 256, prefix_sharing: bool = True,
              threads: int | None = None, model_name: str = "", weights_note: str | None = None,
              progress: ProgressFn | None = None, rates: Sequence[float | None] | None = None,
              targets: dict[str, float] | None = None, layout: str = "packed",
              done: Callable[[EngineResult], None] | None = None,
              prompts: Sequence[Request] | None = None,
              stop_names: Sequence[str] = ()) -> ServeResult:
    """The workload through each engine in turn, at each rate; one comparison.

    `rates` (requests/s, None for all at once) replace the spec's own rate; the
    workload is otherwise the same seeded one at every rate. `done` hears of each
    engine's result at each rate as it finishes. `prompts`: a chat workload's requests
    (`serving.chat`) instead of random ids; `stop_names` their stop tokens' text.
    """
    import dataclasses

    from kvcache_cli.measure import OtherProcesses, device_name, transformers_version

    rates = tuple(rates) if rates else (spec.rate,)
    plan = plan_memory(model.config, model.dtype, spec, kv_mem, block_size, max_batch)
    workloads = [(rate, make_requests(dataclasses.replace(spec, rate=rate),
                                      model.config.vocab_size, prompts)) for rate in rates]
    requests = workloads[0][1]
    chosen = [v if isinstance(v, Variant) else Variant(v) for v in engines]
    plan = fit_padded(plan, requests, model.config, model.dtype, kv_mem, max_batch)
    others = OtherProcesses()
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        results: dict[str, list[EngineResult]] = {}
        reference = None
        # The sequential run is every request alone: run first, it is the reference.
        for v in sorted(chosen, key=lambda v: v.engine != "sequential"):
            if reference is None and v.engine != "sequential":
                reference = solo_tokens(model, requests)
            runs = run_variant(v, model, workloads, spec, plan, block_size, max_batch,
                               prefix_sharing, reference, progress, targets, layout, done)
            results[v.name] = [r for r, _ in runs]
            reference = runs[0][1] if reference is None else reference
        used_threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(previous_threads)

    def ratio(e: EngineResult, base: str) -> float | None:
        if base not in results:
            return None
        other = next(b for b in results[base] if b.rate == e.rate)
        return e.tokens_per_s / other.tokens_per_s

    ordered = tuple(dataclasses.replace(
        e, over_sequential=ratio(e, "sequential"), over_padded=ratio(e, "padded"),
        over_hf=ratio(e, "hf"))
        for rate in rates for v in chosen for e in results[v.name] if e.rate == rate)
    return ServeResult(
        model=model_name, weights_note=weights_note, device=model.device.type,
        device_name=device_name(model.device), cpus=os.cpu_count() or 1,
        threads=used_threads, others_cpu_share=others.share(),
        dtype=str(model.dtype).removeprefix("torch."), torch_version=torch.__version__,
        transformers_version=(transformers_version()
                              if any(v.engine == "hf" for v in chosen) else None),
        workload=dataclasses.replace(spec, rate=rates[0]),
        prompt_tokens=sum(len(r.prompt) for r in requests),
        output_tokens=sum(len(reference[r.id]) for r in requests), kv_mem_bytes=kv_mem,
        block_size=block_size, n_blocks=plan.n_blocks,
        bytes_per_token=block_bytes(model.config.cache_shape, 1, model.dtype),
        padded_rows=plan.padded_rows, slab_len=plan.slab_len, max_batch=max_batch,
        prefix_sharing=prefix_sharing, engines=ordered, rates=rates,
        goodput=dict(targets) if targets else None,
        replies=replies_of(requests, reference, stop_names) if spec.kind == "chat" else None,
        pool=_pool_figures(model, requests, reference, kv_mem, block_size, max_batch),
    )


def _pool_figures(model: FamilyModel, requests, replies, kv_mem: int, block_size: int,
                  max_batch: int) -> PoolFigures:
    from kvcache_cli.models import model_config
    from kvcache_cli.serving import gqa_pool

    gpt2 = block_bytes(model_config("gpt2").cache_shape, 1, model.dtype)
    return gqa_pool.figures(requests, replies, block_bytes(model.config.cache_shape, 1,
                                                           model.dtype),
                            gpt2, kv_mem, block_size, max_batch)
