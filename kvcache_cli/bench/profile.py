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
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from kvcache_cli.caches import make_cache
from kvcache_cli.generate import stream_tokens
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
class StepProfile:
    model: str
    weights: str  # the products' format: fp32, bf16, int8, q4, ...
    dtype: str  # activations and cache
    threads: int
    steps: int  # decode steps profiled, after the prefill and a dropped warm-up
    step_ms: float  # wall time a decode step
    ops_per_step: float
    split_ms: tuple[tuple[str, float], ...]  # (kind, ms a step) in ORDER


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
        def run(*args):
            with torch.profiler.record_function(op):
                return call(*args)
        return run

    for (module, name, op), call in zip(calls, kept, strict=True):
        setattr(module, name, named(call, op))
    try:
        yield
    finally:
        for (module, name, _), call in zip(calls, kept, strict=True):
            setattr(module, name, call)


def profile_step(model: FamilyModel, steps: int, model_name: str, dtype: str,
                 prompt_len: int = 32) -> StepProfile:
    """The split of a decode step over `steps` steps of the static loop after a warm-up,
    a seeded random prompt of `prompt_len` tokens prefilled first (not profiled). `dtype`:
    the activations' and the cache's, as named on the command line."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    prompt = torch.randint(0, model.config.vocab_size, (prompt_len,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    max_len = prompt_len + steps + 1
    with torch.inference_mode():
        list(stream_tokens(model, prompt, 8, "static"))  # warm-up
        cache = make_cache("static", model, max_len=max_len, batch=1)
        tokens = stream_tokens(model, prompt, steps + 1, "static", cache=cache)
        next(tokens)  # the prefill, not profiled
        with _named_native_products(), torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in tokens:
                pass
            wall = (time.perf_counter() - start) * 1e3 / steps
    per_kind: dict[str, float] = defaultdict(float)
    ops = 0
    for event in prof.key_averages():
        per_kind[_kind(event.key)] += event.self_cpu_time_total / 1e3 / steps
        ops += event.count
    per_kind["Python and dispatch"] = max(0.0, wall - sum(per_kind.values()))
    return StepProfile(model_name, linear.weights_format(model), dtype,
                       torch.get_num_threads(), steps, wall, ops / steps,
                       tuple((k, per_kind.get(k, 0.0)) for k in ORDER))
