"""Does torch.compile make attention over int8 codes cheaper than SDPA over float32?

One layer of SmolLM2's shape (3 KV heads of 64, 3 query heads each, one decoding query)
over n cached tokens: SDPA on float32 keys and values, against one function that scores
the int8 per-token codes (groups of 32 channels, a float16 scale and zero each) and sums
the values, written as elementwise ops and sums so inductor fuses the dequantisation into
both reductions: no float copy of the history is made. Median of 30 calls, ms.

    python scripts/compiled_attend.py [--threads 2] [--lengths 1024,4096,8176]
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
import torch.nn.functional as F

NKV, GROUPS, HS, G = 3, 3, 64, 32  # KV heads, query heads per KV head, head size, group


def attend_codes(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero):
    """q (nkv, g, hs) already scaled by 1/sqrt(hs); codes (nkv, n, hs) uint8; scales and
    zeros (nkv, n, hs/G) float16 -> (nkv, g, hs)."""
    nkv, n, hs = k_codes.shape
    J = hs // G

    def dequantised(codes, scale, zero):  # (nkv, 1, n, hs): fused into the sums, not stored
        x = codes.view(nkv, n, J, G).float() * scale.float()[..., None] + zero.float()[..., None]
        return x.view(nkv, 1, n, hs)

    scores = (q[:, :, None, :] * dequantised(k_codes, k_scale, k_zero)).sum(-1)  # (nkv, g, n)
    p = scores.softmax(-1)
    return (p[..., None] * dequantised(v_codes, v_scale, v_zero)).sum(-2)  # (nkv, g, hs)


def median_ms(fn, *args, calls: int = 30) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", default="1024,4096,8176")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    compiled = torch.compile(attend_codes, dynamic=True)
    print(f"one layer ({NKV} KV heads x {GROUPS} queries, head {HS}), {args.threads} threads, "
          "ms, median of 30 calls")
    print(f"{'tokens':>7} {'SDPA float32':>13} {'int8 codes, compiled':>21} {'max error':>10}")
    with torch.inference_mode():
        for n in (int(x) for x in args.lengths.split(",")):
            q = torch.randn(NKV, GROUPS, HS, generator=g) / HS**0.5
            codes = [torch.randint(0, 256, (NKV, n, HS), generator=g, dtype=torch.uint8)
                     for _ in range(2)]
            scales = [(torch.rand(NKV, n, HS // G, generator=g) / 50).half() for _ in range(2)]
            zeros = [(-torch.rand(NKV, n, HS // G, generator=g) * 2).half() for _ in range(2)]
            k, v = ((c.view(NKV, n, -1, G).float() * s.float()[..., None]
                     + z.float()[..., None]).view(NKV, n, HS)
                    for c, s, z in zip(codes, scales, zeros))  # the float32 copy SDPA reads
            inputs = (q, codes[0], scales[0], zeros[0], codes[1], scales[1], zeros[1])
            sdpa = partial(F.scaled_dot_product_attention, scale=1.0)  # q is scaled already
            error = (compiled(*inputs) - sdpa(q[:, :, None], k[:, None], v[:, None])[:, :, 0]
                     ).abs().max().item()
            sdpa_ms = median_ms(partial(sdpa, enable_gqa=True),
                                q.view(1, NKV * GROUPS, 1, HS), k[None], v[None])
            print(f"{n:7,} {sdpa_ms:13.3f} {median_ms(compiled, *inputs):21.3f} {error:10.1e}")


if __name__ == "__main__":
    main()
