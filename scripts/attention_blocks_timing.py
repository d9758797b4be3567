"""The decoding call's attention (`attend_decode`) under the kernel as built from a git
revision and as built from the tree, interleaved in one process; medians, and the tree's
time over the revision's. Each case reads as many buffers as a step has layers of its kind
(Gemma 3's 15 rings of 512 slots, its 3 global layers, SmolLM2's 30), so rows come from
memory as in a step, not from the CPU's caches.

    PYTHONPATH=$PWD python scripts/attention_blocks_timing.py --before 7f981ed --threads 2
"""

import statistics
import time

import torch
from revision_source import builds, timing_arguments

from kvcache_cli.caches import code_attention as ca

parser = timing_arguments(repeats=15)
args = parser.parse_args()
torch.set_num_threads(args.threads)
tree, before = builds(args.before, ca, "SOURCE", ca.load)

gen = torch.Generator().manual_seed(0)
# name: (layers, KV heads, query heads, head size, slots, stored dtype, position)
cases = {
    "Gemma 3 rings, float32": (15, 1, 4, 256, 512, torch.float32, 8176),
    "Gemma 3 rings, float16": (15, 1, 4, 256, 512, torch.float16, 8176),
    "Gemma 3 global, float16, 8k": (3, 1, 4, 256, 8192, torch.float16, 8176),
    "SmolLM2, float16, 8k": (30, 3, 9, 64, 8192, torch.float16, 8176),
    "SmolLM2, float16, 96 tokens": (30, 3, 9, 64, 8192, torch.float16, 95),
}
print(f"{args.threads} threads, medians of {args.repeats} rounds, ms a layer")
for name, (layers, nkv, nh, hs, slots, dtype, at) in cases.items():
    buffers = [tuple(torch.randn(1, nkv, slots, hs, generator=gen).to(dtype) for _ in "kv")
               for _ in range(layers)]
    q, k, v = (torch.randn(1, heads, 1, hs, generator=gen) for heads in (nh, nkv, nkv))
    position, ring = torch.tensor([at]), slots == 512
    times = {"before": [], "tree": []}
    for _ in range(args.repeats):
        for label, lib in (("before", before), ("tree", tree)):
            ca.kernel = lambda lib=lib: lib
            start = time.perf_counter()
            for _ in range(20):
                for K, V in buffers:
                    ca.attend_decode(q, k, v, K, V, position, ring=ring)
            times[label].append((time.perf_counter() - start) / 20 / layers * 1e3)
    was, now = (statistics.median(times[label]) for label in ("before", "tree"))
    print(f"{name}: {args.before} {was:.4f}, tree {now:.4f}, tree / {args.before} "
          f"{now / was:.2f}")
