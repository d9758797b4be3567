"""Which weight layout makes GPT-2's one-row products fastest on this CPU?

A decode step multiplies one row by every weight matrix of the model, each once, so
the weights stream from memory, not from a cache. This times exactly that: one
pass of one-row products over a whole model's distinct weights (every layer's four
matrices and the LM head), for each way of storing and calling a weight, at 1 and 2
threads, in float32 and bfloat16. Variants are interleaved pass by pass, so a slow
patch of a shared machine lands on all of them; each figure is the median pass.

    python scripts/layout_bench.py [--passes 15] [--model gpt2]

The choice made from these figures is written where it is made, in `linear.Linear`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kvcache_cli.models.gpt2 import PRESETS


def _split_out_in(x, w_out_in):
    """One block of output rows per thread, run as one bmm (linear.Linear before issue 11)."""
    n = torch.get_num_threads()
    N, K = w_out_in.shape
    rows = N // n * n
    w = w_out_in[:rows].view(n, rows // n, K)  # (n, N/n, K)
    y = torch.bmm(x.reshape(1, 1, K).expand(n, 1, K), w.transpose(1, 2)).view(1, rows)
    if rows < N:
        y = torch.cat([y, F.linear(x, w_out_in[rows:])], dim=-1)
    return y


def _split_in_out(x, w_in_out):
    """One block of output columns per thread over the (in, out) layout, one bmm."""
    n = torch.get_num_threads()
    K, N = w_in_out.shape
    cols = N // n * n
    w = w_in_out[:, :cols].view(K, n, cols // n).transpose(0, 1)  # (n, K, N/n), strided
    y = torch.bmm(x.reshape(1, 1, K).expand(n, 1, K), w).view(1, cols)
    if cols < N:
        y = torch.cat([y, x @ w_in_out[:, cols:]], dim=-1)
    return y


# name -> (layout, product): "oi" is (out, in) as nn.Linear keeps it, "io" (in, out)
# as Hugging Face's Conv1D keeps it.
VARIANTS = {
    "F.linear (out,in)": ("oi", lambda x, w: F.linear(x, w)),
    "split bmm (out,in)": ("oi", _split_out_in),
    "x @ W (in,out)": ("io", lambda x, w: x @ w),
    "F.linear on W.t() (in,out)": ("io", lambda x, w: F.linear(x, w.t())),
    "split bmm (in,out)": ("io", _split_in_out),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--passes", type=int, default=15)
    parser.add_argument("--model", default="gpt2", choices=list(PRESETS))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", default="1,2")
    args = parser.parse_args()
    c = PRESETS[args.model]
    C = c.n_embd
    layer = [(C, 3 * C), (C, C), (C, 4 * C), (4 * C, C)]  # (in, out): attn, proj, fc, proj
    shapes = layer * c.n_layer + [(C, c.vocab_size)]  # and the LM head
    print(f"torch {torch.__version__}, {args.model}; ms per pass of one-row products over "
          f"every weight, median of {args.passes} interleaved passes (GB/s of weights read)")
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        g = torch.Generator().manual_seed(0)
        io = [torch.randn(K, N, generator=g).to(dtype) for K, N in shapes]  # (in, out)
        oi = [w.t().contiguous() for w in io]  # (out, in)
        xs = {K: torch.randn(1, K, generator=g).to(dtype) for K, _ in shapes}
        nbytes = sum(w.numel() * w.element_size() for w in io)
        for threads in (int(n) for n in args.threads.split(",")):
            torch.set_num_threads(threads)
            times = {v: [] for v in VARIANTS}
            with torch.inference_mode():
                for p in range(args.passes + 1):  # the first pass is a warm-up
                    for v, (layout, f) in VARIANTS.items():
                        weights = io if layout == "io" else oi
                        start = time.perf_counter()
                        for w in weights:
                            f(xs[w.shape[0] if layout == "io" else w.shape[1]], w)
                        if p:
                            times[v].append(time.perf_counter() - start)
            medians = {v: statistics.median(t) for v, t in times.items()}
            cells = "  ".join(f"{v}: {s * 1e3:5.1f} ms ({nbytes / s / 1e9:4.1f})"
                              for v, s in medians.items())
            print(f"{str(dtype).removeprefix('torch.'):9s} {threads} thread(s)  {cells}")


if __name__ == "__main__":
    main()
