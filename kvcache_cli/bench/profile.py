"""Where a decode step's time goes, per kind of op (`kvcache bench --profile`).

Runs the static loop under torch.profiler and sums each op's own (exclusive) time per
decode step into products, attention, norms, activations, cache writes, other tensor ops
and the rest: the step's wall time minus every op's, which is Python and dispatch between
the ops. The products are what a step must spend streaming the weights; everything else
is what fewer or fused ops could close. It also counts the ops a step dispatches, each a
few microseconds of the CPU's time. On a decode's float32 rows the Llama family's norms,
residual adds, QK-norm and rotation, and gated activations are fused calls (`models.fused`):
the norms and the adds land in "norms", q's and k's norm and rotation in "rotary", SwiGLU
and GeGLU in "activations". Where they run in torch (bf16, fp16 activations, a machine
that cannot build the kernels) RMSNorm and the rotation are elementwise ops (pow, mean,
rsqrt, mul; cat, neg), which land in "other ops".

What the profiler cannot tell, the step against its parts alone (`StepParts`): whole decode
steps timed with no profiler, then one step's product calls (each module and the row it was
handed) replayed back to back, then its attention calls (`cache.attend`, the same arguments)
the same way, interleaved repeat by repeat in one process, medians. Products alone slower
than a peer's whole step say the products are the gap; if not, it lies between them.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from kvcache_cli.bench.bandwidth import copy_probe, measure_read
from kvcache_cli.caches import make_cache
from kvcache_cli.generate import RECORDINGS, ReplayedDecode, stream_tokens
from kvcache_cli.measure import linears, measure_bandwidth
from kvcache_cli.models import linear
from kvcache_cli.models.base import FamilyModel

KINDS = {
    "products": ("aten::bmm", "aten::mm", "aten::addmm", "aten::_weight_int8pack_mm",
                 "aten::_weight_int4pack_mm_for_cpu", "aten::baddbmm", "aten::linear",
                 "aten::matmul", "kvcache::native_product", "kvcache::blocked_product",
                 "kvcache::block_product"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                  "aten::scaled_dot_product_attention", "aten::_softmax",
                  "aten::_scaled_dot_product_attention_math", "kvcache::attend_decode"),
    "norms": ("aten::native_layer_norm", "aten::layer_norm", "kvcache::rms_norm",
              "kvcache::add_rms_norm", "kvcache::add_normed"),
    "rotary": ("kvcache::qk_rotary",),
    "activations": ("aten::gelu", "aten::silu", "kvcache::glu"),
    "cache writes": ("aten::index_copy_", "aten::index_put_", "aten::copy_", "aten::slice_scatter",
                     "aten::cat"),
}
# The split's order as printed: the ops a step must run first, the overhead last.
ORDER = (*KINDS, "other ops", "Python and dispatch")


@dataclass(frozen=True)
class StepParts:
    """A decode step against its products alone and its attention alone, each the median
    of `repeats` interleaved timings in one process (no profiler)."""

    repeats: int
    step_ms: float  # a whole decode step
    products_ms: float  # one step's product calls replayed back to back
    attention_ms: float  # one step's attention calls (`cache.attend`) replayed
    rest_ms: float  # step - products - attention: norms, rotary, Python, dispatch, sampling
    product_calls: int
    attention_calls: int
    product_bytes: int  # the matrices those calls read (weights, scales, biases)
    product_gbps: float  # product_bytes over products_ms
    limit_gbps: float  # the best of the read and copy probes (bench/bandwidth.py)
    limit_probe: str  # which probe set it
    product_share: float  # product_gbps / limit_gbps
    # The same step replayed (`generate.ReplayedDecode`), interleaved with the others: its
    # calls without the Python between them; None, with the reason, where it runs eager.
    replayed_step_ms: float | None = None
    not_replayed: str | None = None


@dataclass(frozen=True)
class StepProfile:
    model: str
    weights: str  # the products' format: fp32, bf16, int8, q4, ...
    dtype: str  # activations and cache
    threads: int
    steps: int  # decode steps profiled, after the prefill and a dropped warm-up
    step_ms: float  # wall time a decode step
    ops_per_step: float
    split_ms: tuple[tuple[str, float], ...]  # (kind, ms a step) in ORDER
    parts: StepParts


def _kind(name: str) -> str:
    for kind, names in KINDS.items():
        if name in names:
            return kind
    return "other ops"


@contextlib.contextmanager
def _named_native_products():
    """Eager calls of the native products, the fused ops and a decoding token's attention
    skip the dispatcher (`linear.native_product`, `gguf.blocks.block_product`,
    `models.fused`, `code_attention.attend_decode`: tens of µs a call), so the profiler
    would see no op and count their time as Python's; while profiling, each call is a
    named range instead."""
    from kvcache_cli.caches import code_attention
    from kvcache_cli.models import fused
    from kvcache_cli.models.gguf import blocks

    calls = [(linear, "_native_call", "kvcache::native_product"),
             (blocks, "_product", "kvcache::block_product"),
             (code_attention, "attend_decode", "kvcache::attend_decode"),
             *((fused, f"_{name}_call", f"kvcache::{name}") for name in
               ("rms_norm", "add_rms_norm", "add_normed", "qk_rotary", "glu"))]
    kept = [getattr(module, name) for module, name, _ in calls]

    def named(call, op):
        def run(*args, **options):
            with torch.profiler.record_function(op):
                return call(*args, **options)
        return run

    for (module, name, op), call in zip(calls, kept, strict=True):
        setattr(module, name, named(call, op))
    try:
        yield
    finally:
        for (module, name, _), call in zip(calls, kept, strict=True):
            setattr(module, name, call)


@dataclass(frozen=True)
class Call:
    """One call a decode step made, to replay: the function, a copy of its arguments as
    they were handed in (tensors with their strides), and what it returned."""

    run: Callable
    args: tuple
    output: Tensor


def _kept(arg):
    """A tensor argument copied with its sizes and strides (a view of the q|k|v product
    stays a strided view, so the replay reads memory as the step did); anything else as is."""
    if not isinstance(arg, Tensor):
        return arg
    return torch.empty_strided(arg.size(), arg.stride(), dtype=arg.dtype,
                               device=arg.device).copy_(arg)


def _recorder(run: Callable, calls: list[Call]) -> Callable:
    """`run`, recording each outermost call into `calls` (a product that casts its row and
    calls its own forward again is one call)."""
    depth = [0]

    def recorded(*args):
        outer = depth[0] == 0
        kept = tuple(_kept(a) for a in args) if outer else ()  # before the call can write
        depth[0] += 1
        try:
            output = run(*args)
        finally:
            depth[0] -= 1
        if outer:
            calls.append(Call(run, kept, output.clone()))
        return output
    return recorded


@contextlib.contextmanager
def recording(model: FamilyModel, cache) -> Iterator[tuple[list[Call], list[Call]]]:
    """(product calls, attention calls) of the forwards run inside: each product module's
    forward and the cache's `attend`, as instance attributes that shadow the class's."""
    products: list[Call] = []
    attention: list[Call] = []
    modules = linears(model)
    for module in modules:
        module.forward = _recorder(module.forward, products)
    cache.attend = _recorder(cache.attend, attention)
    try:
        yield products, attention
    finally:
        for module in modules:
            del module.forward
        del cache.attend


def on_cache(calls: list[Call], cache) -> list[Call]:
    """Attention calls made to run on `cache`: a copy of the cache as the recorded step met
    it, since a cache that writes positions in order (a sliding layer's window) refuses the
    recorded token's slot once it holds the next."""
    return [Call(cache.attend, call.args, call.output) for call in calls]


def replay(calls: list[Call]) -> list[Tensor]:
    """The recorded calls again, back to back: their outputs."""
    return [call.run(*call.args) for call in calls]


def _replay_ms(calls: list[Call]) -> float:
    start = time.perf_counter()
    for call in calls:
        call.run(*call.args)
    return (time.perf_counter() - start) * 1e3


def _product_bytes(calls: list[Call]) -> int:
    """The bytes of the matrices the product calls read, each module's once a call."""
    return sum(t.numel() * t.element_size() for call in calls
               for t in (*call.run.__self__.parameters(), *call.run.__self__.buffers()))


def _limit(device: torch.device) -> tuple[float, str]:
    """(GB/s, probe): the best of the read and copy probes. The product probe is left out:
    it is our products themselves, the thing measured against the limit."""
    probes = [measure_read(device), copy_probe(measure_bandwidth(device))]
    best = max(probes, key=lambda probe: probe.median_gbps)
    return best.median_gbps, best.name


def time_parts(tokens: Iterator[int], model: FamilyModel, cache, repeats: int,
               replayed: tuple[Iterator[int], ReplayedDecode] | None = None) -> StepParts:
    """One step of `tokens` recorded, then `repeats` times: a whole step (the cache moves on
    one token), the recorded products, the recorded attention, and a step of `replayed`'s
    tokens (its own cache, its steps already recorded). The attention replays run on a
    fresh copy of the cache as the recorded step met it (copied outside the clock): each
    writes the recorded token's key and value and attends what that step attended."""
    before = copy.deepcopy(cache)
    with recording(model, cache) as (products, attention):
        next(tokens)
    step, prods, attn, again = [], [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        next(tokens)
        step.append((time.perf_counter() - start) * 1e3)
        prods.append(_replay_ms(products))
        attn.append(_replay_ms(on_cache(attention, copy.deepcopy(before))))
        if replayed is not None:
            start = time.perf_counter()
            next(replayed[0])
            again.append((time.perf_counter() - start) * 1e3)
    step_ms, products_ms, attention_ms = (statistics.median(t) for t in (step, prods, attn))
    replay = replayed is not None and replayed[1].steps_replayed >= repeats
    nbytes = _product_bytes(products)
    gbps = nbytes / products_ms / 1e6
    limit, probe = _limit(next(model.parameters()).device)
    return StepParts(repeats, step_ms, products_ms, attention_ms,
                     step_ms - products_ms - attention_ms, len(products), len(attention),
                     nbytes, gbps, limit, probe, gbps / limit,
                     statistics.median(again) if replay else None,
                     None if replay or replayed is None else replayed[1].why_not)


def profile_step(model: FamilyModel, steps: int, model_name: str, dtype: str,
                 prompt_len: int = 32) -> StepProfile:
    """The split of a decode step over `steps` steps of the static loop after a warm-up,
    a seeded random prompt of `prompt_len` tokens prefilled first (not profiled), then the
    step against its parts alone (`time_parts`), `steps` repeats on the same cache.
    `dtype`: the activations' and the cache's, as named on the command line."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    prompt = torch.randint(0, model.config.vocab_size, (prompt_len,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    new_tokens = parts_tokens(steps)
    with torch.inference_mode():
        list(stream_tokens(model, prompt, 8, "static"))  # warm-up
        cache = make_cache("static", model, max_len=prompt_len + new_tokens, batch=1)
        tokens = stream_tokens(model, prompt, new_tokens, "static", cache=cache)
        next(tokens)  # the prefill, not profiled
        with _named_native_products(), torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in itertools.islice(tokens, steps):
                pass
            wall = (time.perf_counter() - start) * 1e3 / steps
        replayed = ReplayedDecode(model)
        n = 1 + RECORDINGS + steps  # the prefill's token, the recorded steps', the timed
        again = stream_tokens(model, prompt, n, "static", forward=replayed,
                              cache=make_cache("static", model, prompt_len + n, batch=1))
        for _ in range(1 + RECORDINGS):  # the prefill, and the steps it records
            next(again)
        parts = time_parts(tokens, model, cache, steps, (again, replayed))
    per_kind: dict[str, float] = defaultdict(float)
    ops = 0
    for event in prof.key_averages():
        per_kind[_kind(event.key)] += event.self_cpu_time_total / 1e3 / steps
        ops += event.count
    per_kind["Python and dispatch"] = max(0.0, wall - sum(per_kind.values()))
    return StepProfile(model_name, linear.weights_format(model), dtype,
                       torch.get_num_threads(), steps, wall, ops / steps,
                       tuple((k, per_kind.get(k, 0.0)) for k in ORDER), parts)


def parts_tokens(steps: int) -> int:
    """The tokens `profile_step` generates after the prompt, in the longer of its two runs:
    the first (the prefill's), `steps` profiled, one recorded and `steps` timed against
    their parts; or the first, those the replay records and `steps` replayed."""
    return max(2 * steps + 2, 1 + RECORDINGS + steps)
