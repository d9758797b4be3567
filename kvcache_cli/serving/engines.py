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
  of quantised blocks (`caches.quantized`), as many as the same kv_mem holds (on a hybrid
  model quantised pages per group, sliding and global alike);
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvcache_cli.caches.exact import StaticCache
from kvcache_cli.caches.paged import PagedCache, block_bytes
from kvcache_cli.caches.quantized_pool import POOLS, make_pool
from kvcache_cli.models.base import FamilyModel
from kvcache_cli.serving.block_manager import BlockManager
from kvcache_cli.serving.gqa_pool import PoolFigures
from kvcache_cli.serving.hf_engine import hf_collect, hf_manager
from kvcache_cli.serving.hybrid_blocks import HybridBlockManager, kv_groups
from kvcache_cli.serving.hybrid_pool import HybridPool, make_hybrid_pool
from kvcache_cli.serving.metrics import RequestTimes, shared_hit_rate, summarise
from kvcache_cli.serving.model_runner import ModelRunner
from kvcache_cli.serving.plan import (
    BLOCK_SIZE,
    Plan,
    Variant,
    fit_padded,
    plan_memory,
    warmup_request,
)
from kvcache_cli.serving.recorder import ProgressFn, Recorder
from kvcache_cli.serving.results import (
    EngineResult,
    HybridFigures,
    Mismatch,
    ServeResult,
    StepStats,
    replies_of,
)
from kvcache_cli.serving.scheduler import Scheduler, Step
from kvcache_cli.serving.sequence import Request
from kvcache_cli.serving.sequence import Sequence as Seq
from kvcache_cli.serving.workload import WorkloadSpec, make_requests

# ---------------------------------------------------------------------------- engines


def _run_sequential(model: FamilyModel, requests, rec: Recorder) -> None:
    from kvcache_cli.generate import stream_tokens

    per_token = block_bytes(model.config.cache_shape, 1, model.dtype)
    for i, r in enumerate(requests):
        while rec.arrived <= i:  # one at a time, in arrival order
            if not list(rec.arrivals()):
                rec.wait_for_arrival()
        cache = _solo_cache(model, len(r.prompt) + r.max_new_tokens)
        rec.reserved = max(rec.reserved, cache.bytes_held)  # the largest it ever held
        tokens = rec.tokens[r.id] = []
        for token in stream_tokens(model, list(r.prompt), r.max_new_tokens, "static",
                                   cache=cache):
            tokens.append(token)
            rec.token(r.id, rec.now())
            rec.sample(1, rec.arrived - len(rec.finish) - 1, cache.bytes_held,
                       _real_bytes(model, cache.length, per_token))
            if r.finished(tokens):  # a stop token: the reply is over
                break
        rec.done(r.id, rec.now())


def _real_bytes(model: FamilyModel, length: int, per_token: int) -> int:
    """The bytes of `length` tokens' K and V a solo cache holds: on a hybrid model a
    sliding layer's ring holds at most its window of them."""
    shape = model.config.cache_shape
    if not shape.hybrid:
        return length * per_token
    per_layer = per_token // shape.n_layer
    return sum(min(length, t.window or length) for t in shape.layer_types) * per_layer


def _solo_cache(model: FamilyModel, max_len: int):
    """One request's static cache; on a hybrid model, rings of the window on its sliding
    layers (`caches.make_cache`), which it must attend over only."""
    if model.config.cache_shape.hybrid:
        from kvcache_cli.caches import make_cache

        return make_cache("static", model, max_len)
    return StaticCache(model.config.cache_shape, max_len, 1, model.device, model.dtype)


def _slabs(group: list[Request], rows: int, groups) -> list[Seq]:
    """A sequence per request, bound to its row's slab: on a hybrid pool a slab per row and
    group of layers (group g's rows after the groups before it)."""
    if groups is None:
        return [Seq(r, block_table=[row]) for row, r in enumerate(group)]
    return [Seq(r, block_table=[row], group_tables=[[g * rows + row]
                                                    for g in range(len(groups))])
            for row, r in enumerate(group)]


def _run_padded(model: FamilyModel, requests, rec: Recorder, plan: Plan) -> None:
    shape = model.config.cache_shape
    groups = kv_groups(shape) if shape.hybrid else None
    if groups is None:
        cache = PagedCache(shape, plan.padded_rows, plan.slab_len, model.device, model.dtype)
    else:
        cache = HybridPool(shape, groups, plan.padded_rows * len(groups), plan.slab_len,
                           model.device, model.dtype)
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
        seqs = _slabs(group, plan.padded_rows, groups)
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


def _run_paged(model: FamilyModel, requests, rec: Recorder, plan: Plan, block_size: int,
               max_batch: int, prefix_sharing: bool, cache: PagedCache,
               policy: str = "prefill-first", token_budget: int | None = None,
               layout: str = "packed", keep: int = 0) -> _PagedState:
    if isinstance(cache, HybridPool):
        blocks = HybridBlockManager(plan.n_blocks, block_size, cache.groups, prefix_sharing,
                                    keep)
    else:
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


def _pool(engine: str, model: FamilyModel, kv_mem: int, block_size: int) -> PagedCache:
    """The paged engine's pool: on a hybrid model a page per group of layers (`HybridPool`,
    quantised or not), as many as kv_mem holds."""
    shape = model.config.cache_shape
    if not shape.hybrid:
        return make_pool(engine, shape, kv_mem, block_size, model.device, model.dtype)
    return make_hybrid_pool(engine, shape, kv_groups(shape), kv_mem, block_size, model.device,
                            model.dtype)


def _hybrid_figures(blocks: BlockManager, cache: PagedCache) -> HybridFigures | None:
    if not isinstance(blocks, HybridBlockManager):
        return None
    page = cache.bytes_held // blocks.n_blocks
    groups: dict[str, int] = {}
    for g in blocks.groups:
        groups[g.kind] = groups.get(g.kind, 0) + 1
    return HybridFigures(
        keep_every=blocks.keep_every, page_bytes=page, groups=groups,
        peak_bytes={kind: n * page for kind, n in blocks.peak_pages.items()},
        window_misses=blocks.window_misses, recomputed_tokens=blocks.recomputed_tokens)


# ---------------------------------------------------------------------------- summary


def mismatches(model: FamilyModel, requests, tokens: dict[int, list[int]],
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


def _summarise(engine: str, setup_s: float, rec: Recorder, model: FamilyModel,
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
    differ = mismatches(model, rec.requests, rec.tokens, reference)
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
        requests_exact=len(rec.requests) - len(differ),
        mismatches=differ,
        timeline=tuple(samples),
        steps=memory.get("steps"),
        hybrid=memory.get("hybrid"),
    )


def _prepare(variant: Variant, model: FamilyModel, spec: WorkloadSpec, plan: Plan, block_size: int,
             max_batch: int, prefix_sharing: bool, stack: contextlib.ExitStack,
             layout: str = "packed") -> Callable[[Sequence[Request], Recorder], dict]:
    """The engine's one-time set-up, warm-up included; returns how to run it."""
    device, warmup, engine = model.device, [warmup_request(plan.slab_len)], variant.engine

    def recorder() -> Recorder:
        return Recorder(engine, warmup, device, None)

    if engine == "sequential":
        _run_sequential(model, warmup, recorder())
        return lambda requests, rec: _run_sequential(model, requests, rec) or {}
    if engine == "padded":
        _run_padded(model, warmup, recorder(), Plan(plan.n_blocks, 1, plan.slab_len))
        return lambda requests, rec: _run_padded(model, requests, rec, plan) or {}
    if engine in POOLS:
        cache = _pool(engine, model, plan.kv_mem, block_size)
        plan = dataclasses.replace(plan, n_blocks=cache.k.size(2))
        policy = dict(policy=variant.policy or "prefill-first",
                      token_budget=variant.token_budget, layout=layout)
        if variant.keep is not None:
            policy["keep"] = variant.keep
        _run_paged(model, warmup, recorder(), plan, block_size, max_batch, False, cache,
                   **policy)

        def run_paged(requests, rec) -> dict:
            state = _run_paged(model, requests, rec, plan, block_size, max_batch,
                               prefix_sharing, cache, **policy)
            hybrid = _hybrid_figures(state.blocks, cache)
            return dict(prefix_hits=state.blocks.prefix_hits,
                        **({} if hybrid is None else dict(hybrid=hybrid)),
                        shared_hit_rate=shared_hit_rate(state.seqs, spec.shared_prefix,
                                                        block_size),
                        preemptions=state.scheduler.preemptions,
                        # a token takes a page in every group of a hybrid pool
                        pool_tokens=plan.n_blocks * block_size // (
                            len(cache.groups) if isinstance(cache, HybridPool) else 1),
                        steps=_step_stats(state.steps, state.times, variant.token_budget))

        return run_paged
    from kvcache_cli.measure import quiet_transformers

    stack.enter_context(quiet_transformers())
    manager = hf_manager(model, plan, block_size, max_batch, spec, prefix_sharing)
    stack.callback(manager.stop, block=True, timeout=5)
    reserved = plan.n_blocks * block_bytes(model.config.cache_shape, block_size, model.dtype)
    return lambda requests, rec: hf_collect(manager, requests, rec) or dict(reserved=reserved)


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
            rec = Recorder(variant.name, requests, model.device, progress,
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
        solo_tokens=tuple(tuple(reference[r.id]) for r in requests),
    )


def _pool_figures(model: FamilyModel, requests, replies, kv_mem: int, block_size: int,
                  max_batch: int) -> PoolFigures:
    from kvcache_cli.models import model_config
    from kvcache_cli.serving import gqa_pool

    gpt2 = block_bytes(model_config("gpt2").cache_shape, 1, model.dtype)
    return gqa_pool.figures(requests, replies, block_bytes(model.config.cache_shape, 1,
                                                           model.dtype),
                            gpt2, kv_mem, block_size, max_batch)
