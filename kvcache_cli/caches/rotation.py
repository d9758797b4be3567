"""The Hadamard rotation of a quantised cache (`:rot`): spread outlier channels before rounding.

A few channels of a trained model's keys are much larger than the rest; a per-token
group that holds one gets a scale set by the outlier, and its other numbers round to a
handful of levels. An orthogonal rotation H (H @ H.T = I) mixes every channel into every
other, so each rotated channel carries 1/sqrt(hs) of the outlier and the group's range
shrinks, while dot products are unchanged: (q H) . (k H) = q . k (QuaRot; llama.cpp since
April 2026 whenever the cache is quantised and the head size is a multiple of 64).

The normalised Sylvester matrix: H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]] / sqrt(2),
defined for powers of two (`spec.check_head_dim` refuses other head sizes before a model
loads). It is symmetric as well as orthogonal, so it is its own inverse.

Where it is undone: llama.cpp rotates q as well and never un-rotates K, which saves a
matmul per read but needs the model's attention to know about the cache. Here the cache
rotates what it quantises and un-rotates what it dequantises, k ~ dequant(quant(k H)) H.T,
so attention reads keys and values in the model's own basis and no model changes; the
two are the same arithmetic up to rounding.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def hadamard(n: int, device=None, dtype: torch.dtype = torch.float32) -> Tensor:
    """The normalised n x n Sylvester-Hadamard matrix, n a power of two: entries
    +-1/sqrt(n), H @ H.T = I."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester-Hadamard matrix is {n} wide: expected a power of two")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.size(0) < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    # Built in float64 from +-1 and scaled once: every entry is exactly +-1/sqrt(n) rounded.
    return (h / math.sqrt(n)).to(device=device, dtype=dtype)  # (n, n)


class Rotation:
    """What a quantised cache applies before encoding and undoes after decoding; None
    stands for no rotation. Both run in float32 whatever the model's dtype, so a
    bfloat16 model's keys are not rounded twice on the way."""

    def __init__(self, head_size: int, device):
        self.h = hadamard(head_size, device=device)  # (hs, hs): a constant, not per token

    def rotate(self, x: Tensor) -> Tensor:
        """x (..., hs) -> x H, float32."""
        return x.float() @ self.h

    def unrotate(self, y: Tensor) -> Tensor:
        """y (..., hs) float32 -> y H.T (= y H^-1), float32."""
        return y.float() @ self.h.T
