"""Which int8 weight-only product is fastest for GPT-2's one-row decode products here?

One pass of one-row products over a whole model's distinct matrices (every layer's four
and the LM head), as `layout_bench.py` does for float layouts, comparing:

- fp32: the float32 product as `linear.Linear` runs it (the baseline);
- bf16: nn.Linear's product on bfloat16 weights and activations;
- int8pack bf16: `torch.ops.aten._weight_int8pack_mm` with bfloat16 activations
  (one scale per output channel; what `linear.Int8Linear` runs);
- int8pack fp32: the same kernel handed float32 activations;
- int8 dequant: the int8 weight turned back into float32 each call, then multiplied
  (what a product without an int8 kernel has to do);
- dynamic qint8: torch.ao's dynamic quantisation (fbgemm), which also rounds the
  activations to 8 bits: not weight-only, shown for scale.

Variants are interleaved pass by pass so a slow patch of a shared machine lands on all;
each figure is the median pass, in ms, with the effective GB/s of the bytes it reads.

    python scripts/int8_bench.py [--passes 9] [--model gpt2] [--threads 1,2]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

from kvcache_cli.models.gpt2 import PRESETS
from kvcache_cli.models.linear import Int8Linear, Linear


def _shapes(name: str) -> list[tuple[int, int]]:
    c = PRESETS[name]
    C = c.n_embd
    per_layer = [(C, 3 * C), (C, C), (C, 4 * C), (4 * C, C)]
    return per_layer * c.n_layer + [(C, c.vocab_size)]  # (in, out); the head last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--passes", type=int, default=9)
    parser.add_argument("--model", default="gpt2", choices=list(PRESETS))
    parser.add_argument("--threads", default="1,2")
    args = parser.parse_args()
    torch.manual_seed(0)
    shapes = _shapes(args.model)
    fp32 = []
    for k, n in shapes:
        layer = Linear(k, n)
        layer.weight.data = layer.weight.data.t().contiguous().t()  # (in, out), as arranged
        fp32.append(layer)
    bf16 = [torch.nn.Linear(k, n).to(torch.bfloat16) for k, n in shapes]
    int8 = [Int8Linear(layer) for layer in fp32]
    with warnings.catch_warnings():  # torch.ao's deprecation notices
        warnings.simplefilter("ignore")
        dynamic = torch.ao.quantization.quantize_dynamic(
            torch.nn.Sequential(*[torch.nn.Linear(k, n) for k, n in shapes]),
            {torch.nn.Linear}, dtype=torch.qint8)  # fmt: skip
    rows32 = [torch.randn(1, k) for k, _ in shapes]
    rows16 = [r.to(torch.bfloat16) for r in rows32]

    def int8pack_fp32() -> None:
        for q, x in zip(int8, rows32):
            torch.ops.aten._weight_int8pack_mm(x, q.weight, q.scales.float())

    def dequant() -> None:
        for q, x in zip(int8, rows32):
            F.linear(x, q.weight.float() * q.scales.float()[:, None])

    variants = {
        "fp32": (lambda: [m(x) for m, x in zip(fp32, rows32)], 4),
        "bf16": (lambda: [m(x) for m, x in zip(bf16, rows16)], 2),
        "int8pack bf16": (lambda: [m(x) for m, x in zip(int8, rows32)], 1),
        "int8pack fp32": (int8pack_fp32, 1),
        "int8 dequant": (dequant, 1),
        "dynamic qint8": (lambda: [m(x) for m, x in zip(dynamic, rows32)], 1),
    }
    params = sum(k * n for k, n in shapes)
    print(f"{args.model}: {len(shapes)} matrices, {params / 1e6:.1f}M weights; "
          f"median of {args.passes} passes, ms (GB/s of the weights' bytes)")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        times = {name: [] for name in variants}
        with torch.inference_mode():
            for run, _ in variants.values():
                run()  # first touch, kernel selection
            for _ in range(args.passes):
                for name, (run, _) in variants.items():
                    start = time.perf_counter()
                    run()
                    times[name].append(time.perf_counter() - start)
        cells = []
        for name, (_, element) in variants.items():
            ms = statistics.median(times[name]) * 1e3
            cells.append(f"{name} {ms:.1f} ({params * element / ms / 1e6:.1f})")
        print(f"{threads} thr: " + ", ".join(cells))


if __name__ == "__main__":
    main()
