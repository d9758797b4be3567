"""The code caches' decoding call, kernels alone, in SmolLM2's shape (30 layers of 9 query
heads on 3 KV heads of 64) or Gemma 3's global layers' (`--shape gemma3`: 3 layers of 4
query heads on one KV head of 256), at 8,176 tokens (`--context`), rows from memory as in a
step: int8's call (per-token keys) and int4's (per-channel keys, a 144-token float32 tail)
`decode_codes`, interleaved in one process, medians. Against fp16's `attend_decode` (ratios
to its time), or with `--before REV` against the same calls built from a git revision (the
tree's time over the revision's, and how far their outputs part). On 1 thread the clock is
the thread's CPU time (the most robust on a busy machine), on more the wall clock.

    PYTHONPATH=$PWD python scripts/code_decode_timing.py --threads 2 --repeats 11
    PYTHONPATH=$PWD python scripts/code_decode_timing.py --shape gemma3 --before d629ccf
"""

import argparse
import statistics
import time

import torch
from revision_source import builds

from kvcache_cli.caches import code_attention as ca

SHAPES = {"smollm2": (30, 3, 9, 64), "gemma3": (3, 1, 4, 256)}  # layers, KV heads, heads, size
parser = argparse.ArgumentParser()
parser.add_argument("--shape", choices=SHAPES, default="smollm2")
parser.add_argument("--threads", type=int, default=1)
parser.add_argument("--repeats", type=int, default=11)
parser.add_argument("--layers", type=int, help="layers of calls (default: the shape's; 1: the "
                    "rows in the CPU's caches)")
parser.add_argument("--context", type=int, default=8176, help="tokens held (at least 145)")
parser.add_argument("--before", help="a git revision whose kernel to time beside the tree's")
args = parser.parse_args()
torch.set_num_threads(args.threads)
layers, nkv, nh, hs = SHAPES[args.shape]
layers = args.layers or layers
n, B, G, tail = args.context, 1, 32, 144
slots = (n + 16) // 16 * 16
gen = torch.Generator().manual_seed(0)
qkv = torch.randn(B, 1, nh + 2 * nkv, hs, generator=gen).transpose(1, 2)  # (B, heads, 1, hs)
q, k, v = qkv[:, :nh], qkv[:, nh:nh + nkv], qkv[:, nh + nkv:]


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


fp16 = [half_rows() for _ in range(layers)]
int8 = [code_rows(8, False) for _ in range(layers)]
int4 = [code_rows(4, True) for _ in range(layers)]
none = torch.empty(B, nkv, 0, hs)
tails = [(none, none, torch.randn(B, nkv, tail, hs, generator=gen),
          torch.randn(B, nkv, tail, hs, generator=gen)) for _ in range(layers)]
position = torch.tensor([n - 1])  # the kernel reads the step's position from memory


def code_runs(int8_write: bool) -> dict:
    """The two calls over every layer, each with its arguments kept a layer (`DecodeCall`).
    int8's writes the step's token into code row n - 1 where `int8_write` (the step's own
    call); against another revision's kernel nothing is written, so both read alike."""
    kept = {kind: [ca.DecodeCall() for _ in range(layers)] for kind in ("int8", "int4")}
    if int8_write:
        def int8_call(rows, call):
            return ca.decode_codes(q, k, v, rows, 0, 8, G, False, "at", (none,) * 4, 0, call,
                                   (position, 0, 1))
    else:
        def int8_call(rows, call):
            return ca.decode_codes(q, k, v, rows, n, 8, G, False, None, (none,) * 4, 0, call)
    return {
        "int8": lambda: [int8_call(r, c) for r, c in zip(int8, kept["int8"])],
        "int4": lambda: [ca.decode_codes(q, k, v, r, n - tail, 4, G, True, None, f, tail, c)
                         for r, f, c in zip(int4, tails, kept["int4"])],
    }


def timed(runs: dict, libraries: dict) -> dict:
    """{(run, library): [seconds a round]}, every pair in turn each round, two rounds of
    warm-up; and the last output of each pair."""
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    times, outputs = {}, {}
    for repeat in range(args.repeats + 2):
        for name, run in runs.items():
            for label, library in libraries.items():
                ca.kernel = lambda library=library: library
                start = clock()
                outputs[name, label] = run()[0]
                if repeat >= 2:
                    times.setdefault((name, label), []).append(clock() - start)
    return {key: statistics.median(t) for key, t in times.items()}, outputs


where = f"{layers} layers of {args.shape}'s shape at {n:,} tokens, {args.threads} threads"
if args.before is None:
    runs = {"fp16": lambda: [ca.attend_decode(q, k, v, K, V, position) for K, V in fp16],
            **code_runs(int8_write=True)}
    median, _ = timed(runs, {"tree": ca.kernel()})
    base = median["fp16", "tree"]
    print(f"{where}: fp16 {base * 1e3:.2f} ms, " + ", ".join(
        f"{name} {median[name, 'tree'] / base:.2f}x" for name in ("int8", "int4")) +
        " fp16's call")
else:
    tree, before = builds(args.before, ca, "SOURCE", ca.load)
    median, outputs = timed(code_runs(int8_write=False), {"before": before, "tree": tree})
    print(f"{where}, medians of {args.repeats} rounds:")
    for name in ("int8", "int4"):
        was, now = median[name, "before"], median[name, "tree"]
        mine, theirs = outputs[name, "tree"], outputs[name, "before"]
        parted = ((mine - theirs).abs().max() / theirs.abs().max()).item()
        print(f"  {name}: {args.before} {was * 1e3:.3f} ms, tree {now * 1e3:.3f} ms, "
              f"tree / {args.before} {now / was:.2f} (outputs part by {parted:.1e} of the "
              "largest)")
