"""Where a decode step's time goes, per kind of op, in each weight format.

Runs the static loop on a random GPT-2 (or the trained SmolLM2) under torch.profiler and
sums each op's own (exclusive) time per decode step into products, attention, norms,
activations, cache writes, other tensor ops and the rest: the step's wall time minus every
op's, which is Python and dispatch between the ops. The products are what a step must
spend streaming the weights; everything else is what fewer or fused ops could close. It
also counts the ops a step dispatches, each a few microseconds of the CPU's time.

    python scripts/step_profile.py [--model gpt2] [--steps 32] [--threads 2]
        [--formats fp32,bf16,int8,bf16+int8]
    python scripts/step_profile.py --model smollm2 --formats fp32,fp16,bf16,int8,q4

A format is `WEIGHTS` (float32 activations and cache, the products' matrices in WEIGHTS)
or `DTYPE+WEIGHTS` (activations and cache in DTYPE too). Llama's RMSNorm and rotary
positions are built of elementwise ops (pow, mean, rsqrt, mul; cat, neg), which land in
"other ops".
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from kvcache_cli.caches import make_cache
from kvcache_cli.generate import stream_tokens
from kvcache_cli.models import family_of, load_model, set_weights_dtype

KINDS = {
    "products": ("aten::bmm", "aten::mm", "aten::addmm", "aten::_weight_int8pack_mm",
                 "aten::_weight_int4pack_mm_for_cpu", "aten::baddbmm", "aten::linear",
                 "aten::matmul"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                  "aten::scaled_dot_product_attention", "aten::_softmax",
                  "aten::_scaled_dot_product_attention_math"),
    "norms": ("aten::native_layer_norm", "aten::layer_norm"),
    "activations": ("aten::gelu", "aten::silu"),
    "cache writes": ("aten::index_copy_", "aten::index_put_", "aten::copy_", "aten::slice_scatter",
                     "aten::cat"),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _kind(name: str) -> str:
    for kind, names in KINDS.items():
        if name in names:
            return kind
    return "other ops"


def profile(model, steps: int, prompt_len: int = 32) -> tuple[float, dict[str, float], float]:
    """(ms a decode step, {kind: ms a step}, ops a step) over `steps` decode steps after a
    warm-up."""
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
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
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
    return wall, dict(per_kind), ops / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--formats", default="fp32,bf16,int8,bf16+int8")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    order = ["products", "attention", "norms", "activations", "cache writes", "other ops",
             "Python and dispatch"]
    print(f"{args.model}, {args.threads} threads, ms a decode step (share), "
          f"{args.steps} steps profiled")
    for fmt in args.formats.split(","):
        dtype, _, weights = fmt.rpartition("+")
        dtype = dtype or ("fp32" if weights in ("int8", "q4") else weights)
        # GPT-2's speed depends on its shape only; SmolLM2 is read with its own weights
        # (q4 needs its GGUF blocks).
        weights_kind = "random" if family_of(args.model) == "gpt2" else "pretrained"
        model = load_model(args.model, weights_kind, "cpu", DTYPES[dtype]).model
        set_weights_dtype(model, weights)
        wall, kinds, ops = profile(model, args.steps)
        cells = ", ".join(f"{k} {kinds.get(k, 0):.2f} ({kinds.get(k, 0) / wall:.0%})"
                          for k in order)
        print(f"{fmt}: step {wall:.2f} ms, {ops:.0f} ops: {cells}")


if __name__ == "__main__":
    main()
