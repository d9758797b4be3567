"""Packed or padded: which layout runs a decode-first step faster on this CPU?

A decode-first step mixes one-token decodes with prompt chunks. `ModelRunner.step`
can lay its rows out packed (every row's tokens one after another: the matmuls do
exactly the real tokens, attention runs per row) or padded (a (B, T) batch, every
row padded to the longest chunk: one attention call, but the matmuls do B x T rows).
This times one step of each, for `--decodes` decoding rows at `--context` tokens
plus one prompt chunk of each `--chunks` size, on GPT-2 small's shape with random
weights (speed does not depend on the values). Layouts are interleaved repeat by
repeat, so a slow patch of a shared machine lands on both; each figure is the median.

    python scripts/serve_layouts.py [--decodes 16] [--context 128] [--chunks 1,16,64,256]
                                    [--threads N]

The choice made from these figures is `ModelRunner`'s default layout.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvcache_cli.caches.paged import PagedCache
from kvcache_cli.models.gpt2 import GPT, PRESETS
from kvcache_cli.models.linear import arrange_weights
from kvcache_cli.serving.model_runner import LAYOUTS, ModelRunner
from kvcache_cli.serving.scheduler import Chunk
from kvcache_cli.serving.sequence import Request, Sequence

BLOCK = 16


def _step(decodes: int, context: int, chunk: int) -> tuple[list[Chunk], int]:
    """The step's chunks over sequences with disjoint blocks; the blocks needed."""
    rows, next_block = [], 0
    lengths = [(context + 1, context)] * decodes + ([(context + chunk, context)] if chunk > 1
                                                    else [])
    for i, (n, start) in enumerate(lengths):
        blocks = -(-n // BLOCK)
        seq = Sequence(Request(i, tuple(range(n)), 1, 0.0),
                       block_table=list(range(next_block, next_block + blocks)),
                       num_cached=start)
        next_block += blocks
        rows.append(Chunk(seq, start, n - start))
    return rows, next_block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decodes", type=int, default=16)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--chunks", default="1,16,64,256")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default="gpt2", choices=sorted(PRESETS))
    parser.add_argument("--threads", type=int, default=None, help="default: torch's own")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = arrange_weights(GPT(PRESETS[args.model]).eval())
    print(f"{args.model}, {torch.get_num_threads()} threads, {args.decodes} decodes at "
          f"context {args.context}; ms per step, median of {args.repeats}")
    print(f"{'chunk':>6} " + " ".join(f"{name:>8}" for name in LAYOUTS))
    for chunk in (int(c) for c in args.chunks.split(",")):
        chunks, n_blocks = _step(args.decodes, args.context, chunk)
        cache = PagedCache(model.config.cache_shape, n_blocks, BLOCK, "cpu", torch.float32)
        runners = {name: ModelRunner(model, cache, name) for name in LAYOUTS}
        times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
        for _ in range(args.repeats + 1):  # the first round warms up, untimed
            for name, runner in runners.items():
                for c in chunks:
                    c.seq.num_cached = c.start
                start = time.perf_counter()
                runner.step(chunks)
                times[name].append((time.perf_counter() - start) * 1e3)
        print(f"{chunk:>6} " + " ".join(f"{statistics.median(times[n][1:]):8.1f}"
                                        for n in LAYOUTS))


if __name__ == "__main__":
    main()
