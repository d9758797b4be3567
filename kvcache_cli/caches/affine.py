"""The integer kinds' affine codes (`quantized`'s design, its docstring): a group of numbers
to codes, a float16 scale and a zero point, and back; codes bit-packed along the head
dimension; per-token groups (`_Tokens`) and per-channel groups of G tokens (`_Channels`).
Shared by `QuantizedCache` and serve's quantised pool (`quantized_pool`)."""

from __future__ import annotations

import torch
from torch import Tensor

# Scales and zero points of the integer kinds.
SCALE_DTYPE = torch.float16

# ---------------------------------------------------------------------------- packing


def pack(codes: Tensor, bits: int) -> Tensor:
    """uint8 codes < 2^bits (..., D) -> (..., D * bits / 8): 8 / bits codes per byte,
    the first in the lowest bits."""
    per = 8 // bits
    if per == 1:
        return codes
    grouped = codes.view(*codes.shape[:-1], -1, per)  # (..., D / per, per)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)  # (per,)
    return (grouped << shifts).sum(-1, dtype=torch.uint8)  # disjoint bits: sum == or


def unpack(packed: Tensor, bits: int) -> Tensor:
    """The inverse of `pack`: (..., D * bits / 8) -> uint8 codes (..., D)."""
    per = 8 // bits
    if per == 1:
        return packed
    mask = (1 << bits) - 1
    # One shift by a scalar per position in the byte: 3x faster on the CPU than one
    # shift by a broadcast tensor of shifts (timed on 1,000 tokens x 3 heads of 64).
    codes = torch.stack([(packed >> shift) & mask for shift in range(0, 8, bits)], dim=-1)
    return codes.flatten(-2)  # (..., D)


# ---------------------------------------------------------------------------- affine


def quantise(x: Tensor, bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """Affine codes over the last dimension, one group: x (..., G) -> codes (..., G)
    uint8, scale (..., 1) and zero (..., 1) in float16, with |x - deq| <= scale / 2."""
    x = x.float()
    levels = (1 << bits) - 1
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)  # (..., 1)
    # float16 rounds to nearest: nudge the zero down and the scale up where rounding
    # went the other way, so the grid zero .. zero + levels * scale covers [lo, hi].
    zero = lo.to(SCALE_DTYPE)
    zero = torch.where(zero.float() > lo, torch.nextafter(zero, zero.new_tensor(-65504)), zero)
    span = ((hi - zero.float()) / levels).clamp_min(2.0**-24)  # float16's smallest step
    scale = span.to(SCALE_DTYPE)
    scale = torch.where(scale.float() < span, torch.nextafter(scale, scale.new_tensor(65504)),
                        scale)
    q = ((x - zero.float()) / scale.float()).round_().clamp_(0, levels)
    return q.to(torch.uint8), scale, zero


def dequantise(codes: Tensor, scale: Tensor, zero: Tensor, dtype: torch.dtype) -> Tensor:
    return (codes.float() * scale.float() + zero.float()).to(dtype)


class _Tokens:
    """Per-token groups: codes (B, nkv, T, hs * bits / 8), scale and zero (B, nkv, T, hs / G)."""

    @staticmethod
    def encode(x: Tensor, bits: int, G: int) -> tuple[Tensor, Tensor, Tensor]:
        B, nkv, T, hs = x.shape
        q, scale, zero = quantise(x.reshape(B, nkv, T, hs // G, G), bits)  # (B, nkv, T, hs/G, G)
        return pack(q.view(B, nkv, T, hs), bits), scale[..., 0], zero[..., 0]

    @staticmethod
    def decode(codes, scale, zero, bits: int, G: int, dtype) -> Tensor:
        B, nkv, T, _ = codes.shape
        q = unpack(codes, bits).view(B, nkv, T, -1, G)  # (B, nkv, T, hs/G, G)
        return dequantise(q, scale[..., None], zero[..., None], dtype).view(B, nkv, T, -1)

    @staticmethod
    def decode_into(out: Tensor, codes, scale, zero, bits: int, G: int) -> None:
        """Dequantise into `out` (B, nkv, T, hs), a slice of what attention reads: one fused
        multiply-add into place, 3x faster on the CPU than dequantising and then concatenating."""
        B, nkv, T, hs = out.shape
        q = unpack(codes, bits).view(B, nkv, T, hs // G, G)  # (B, nkv, T, hs/G, G)
        torch.addcmul(zero[..., None].float(), q.float(), scale[..., None].float(),
                      out=out.view(B, nkv, T, hs // G, G))


class _Channels:
    """Per-channel groups of G tokens (KIVI's keys): codes (B, nkv, T, hs * bits / 8),
    scale and zero (B, nkv, T / G, hs)."""

    @staticmethod
    def encode(x: Tensor, bits: int, G: int) -> tuple[Tensor, Tensor, Tensor]:
        B, nkv, T, hs = x.shape  # T a multiple of G
        groups = x.reshape(B, nkv, T // G, G, hs).transpose(-1, -2)  # (B, nkv, T/G, hs, G)
        q, scale, zero = quantise(groups, bits)
        q = q.transpose(-1, -2).reshape(B, nkv, T, hs)
        return pack(q, bits), scale[..., 0], zero[..., 0]  # scales (B, nkv, T/G, hs)

    @staticmethod
    def decode_into(out: Tensor, codes, scale, zero, bits: int, G: int) -> None:
        """Dequantise into `out` (B, nkv, T, hs), a slice of what attention reads."""
        B, nkv, T, hs = out.shape
        q = unpack(codes, bits).view(B, nkv, T // G, G, hs)  # (B, nkv, T/G, G, hs)
        torch.addcmul(zero[:, :, :, None].float(), q.float(), scale[:, :, :, None].float(),
                      out=out.view(B, nkv, T // G, G, hs))
