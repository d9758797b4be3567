"""The code caches' decoding call against fp16's, kernels alone: one layer (rows in the CPU's
caches) or 30 (rows from memory) at 8,176 tokens (`--context`) in SmolLM2's shape (9 query
heads on 3 KV heads of 64), fp16's `attend_decode` and int8's (per-token keys, written by the
call) and int4's (per-channel keys, a 144-token float32 tail) `decode_codes`, interleaved in one
process; medians, as ratios to fp16's. On 1 thread the clock is the thread's CPU time (the
most robust on a busy machine), on more the wall clock.

    PYTHONPATH=$PWD python scripts/code_decode_timing.py --threads 1 --layers 30 --repeats 11
"""

import argparse
import statistics
import time

import torch

from kvcache_cli.caches import code_attention as ca

parser = argparse.ArgumentParser()
parser.add_argument("--threads", type=int, default=1)
parser.add_argument("--layers", type=int, default=30)
parser.add_argument("--repeats", type=int, default=11)
parser.add_argument("--context", type=int, default=8176, help="tokens held (at least 145)")
args = parser.parse_args()
torch.set_num_threads(args.threads)
n, B, nkv, hs, G, tail = args.context, 1, 3, 64, 32, 144
slots = (n + 16) // 16 * 16
gen = torch.Generator().manual_seed(0)
qkv = torch.randn(B, 1, 15, hs, generator=gen).transpose(1, 2)  # (B, 15, 1, hs)
q, k, v = qkv[:, :9], qkv[:, 9:12], qkv[:, 12:]


def half_rows():
    return tuple(torch.randn(B, nkv, slots, hs, generator=gen).half() for _ in range(2))


def code_rows(bits: int, per_channel: bool):
    """Codes, scales and zero points (B, nkv, slots or slots / G, width) of random content."""
    def codes():
        return torch.randint(0, 256, (B, nkv, slots, hs * bits // 8), dtype=torch.uint8,
                             generator=gen)

    def halves(rows: int, width: int, sign: float):
        return (sign * torch.rand(B, nkv, rows, width, generator=gen) / 50).half()

    key_rows, key_width = (slots // G, hs) if per_channel else (slots, hs // G)
    return (codes(), halves(key_rows, key_width, 1), halves(key_rows, key_width, -1),
            codes(), halves(slots, hs // G, 1), halves(slots, hs // G, -1))


layers = range(args.layers)
fp16 = [half_rows() for _ in layers]
int8 = [code_rows(8, False) for _ in layers]
int4 = [code_rows(4, True) for _ in layers]
none = torch.empty(B, nkv, 0, hs)
tails = [(none, none, torch.randn(B, nkv, tail, hs, generator=gen),
          torch.randn(B, nkv, tail, hs, generator=gen)) for _ in layers]
position = torch.tensor([n - 1])  # the kernel reads the step's position from memory
prepared = {kind: [ca.DecodeCall() for _ in layers] for kind in ("int8", "int4")}  # a layer's
runs = {
    "fp16": lambda: [ca.attend_decode(q, k, v, K, V, position) for K, V in fp16],
    "int8": lambda: [ca.decode_codes(q, k, v, r, 0, 8, G, False, "at", (none,) * 4, 0, c,
                                     (position, 0, 1)) for r, c in zip(int8, prepared["int8"])],
    "int4": lambda: [ca.decode_codes(q, k, v, r, n - tail, 4, G, True, None, f, tail, c)
                     for r, f, c in zip(int4, tails, prepared["int4"])],
}
clock = time.thread_time if args.threads == 1 else time.perf_counter
times = {name: [] for name in runs}
for repeat in range(args.repeats + 2):  # the first two warm up
    for name, run in runs.items():
        start = clock()
        run()
        if repeat >= 2:
            times[name].append(clock() - start)
fp16_time = statistics.median(times["fp16"])
print(f"{args.layers} layers, {args.threads} threads: fp16 {fp16_time * 1e3:.2f} ms, " + ", ".join(
    f"{name} {statistics.median(t) / fp16_time:.2f}x" for name, t in times.items()
    if name != "fp16") + " fp16's call")
