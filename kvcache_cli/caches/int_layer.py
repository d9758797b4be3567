"""One layer of an integer cache (`quantized.QuantizedCache`): sinks, codes with their
scales and zero points, and the full-precision tail, each a tensor that grows along its
rows in place (`Rows`), laid out as the decoding call (`code_attention.decode_codes`) reads
them."""

from __future__ import annotations

import operator

import torch
from torch import Tensor

from kvcache_cli.caches import code_attention
from kvcache_cli.caches.affine import SCALE_DTYPE
from kvcache_cli.caches.base import nbytes


class Rows:
    """A (B, nkv, n, width) tensor that grows along its rows in place: the capacity
    doubles when full, so appending a token copies that token and not the history (a
    torch.cat of the codes copied all of them at every step). `t` is the filled part, a
    view; crop keeps the storage and forgets the rows past the cut."""

    def __init__(self, B: int, nkv: int, width: int, device, dtype, capacity: int = 0):
        self.buf = torch.empty(B, nkv, capacity, width, device=device, dtype=dtype)  # (.., cap, w)
        self.n = 0
        self.capacity = capacity  # buf.size(2), kept: a decoding step reads it at every layer
        self.row_bytes = B * nkv * width * self.buf.element_size()  # a token's, every (b, h)

    @property
    def t(self) -> Tensor:
        return self.buf[:, :, :self.n]  # (B, nkv, n, width)

    def grow(self, T: int) -> int:
        """Count T more rows as filled, for a writer that fills them in place at rows
        n - T .. n - 1 of `buf`; the bytes they and a growth of the capacity moved."""
        need, moved = self.n + T, 0
        if need > self.capacity:
            B, nkv, cap, width = self.buf.shape
            grown = self.buf.new_empty(B, nkv, max(need, 2 * cap, 64), width)
            grown[:, :, :self.n] = self.t
            moved += nbytes(self.t)
            self.buf, self.capacity = grown, grown.size(2)
        self.n = need
        return moved + T * self.row_bytes

    def claim(self, T: int) -> tuple[Tensor, int]:
        """The next T rows (B, nkv, T, width), counted as filled, for a writer to fill in
        place; and the bytes they and a growth of the capacity moved."""
        moved = self.grow(T)
        return self.buf[:, :, self.n - T:self.n], moved

    def append(self, x: Tensor) -> int:
        """Write x (B, nkv, T, width) after the filled rows; the bytes this moved."""
        rows, moved = self.claim(x.size(2))
        rows.copy_(x)
        return moved

    def crop(self, n: int) -> None:
        self.n = n

    def keep_last(self, m: int, capacity: int) -> int:
        """Forget all filled rows but the last m, which move to the front; a buffer grown
        past `capacity` rows (a prefill's) is given back for one of that size. The bytes
        moved."""
        rest = self.buf[:, :, self.n - m:self.n]  # (B, nkv, m, width)
        if self.capacity > capacity:
            B, nkv, _, width = self.buf.shape
            self.buf = self.buf.new_empty(B, nkv, max(capacity, m), width)
            self.capacity = self.buf.size(2)
        elif m:
            rest = rest.clone()  # it overlaps where it goes
        self.buf[:, :, :m] = rest
        self.n = m
        return nbytes(rest)


BUFFER = operator.attrgetter("buf")


class IntLayer:
    """One layer's store: sinks, quantised keys and values, the full-precision tail."""

    def __init__(self, B: int, nkv: int, hs: int, bits: int, G: int, per_channel: bool,
                 device, dtype, capacity: int, tail: int):
        fp = dict(device=device, dtype=dtype)
        width = hs * bits // 8
        self.sink_k = torch.empty(B, nkv, 0, hs, **fp)  # (B, nkv, s, hs)
        self.sink_v = torch.empty(B, nkv, 0, hs, **fp)
        # The buffers start with room for `capacity` tokens' codes and the `tail` a tail holds
        # between flushes (a prefill's tail grows past it, and is given back), so a decoding
        # call's memory stays put and a replayed step's calls read it.
        self.tails = {w: Rows(B, nkv, hs, device, dtype, tail) for w in "kv"}  # (B, nkv, t, hs)
        self.codes = {w: Rows(B, nkv, width, device, torch.uint8, capacity) for w in "kv"}
        # Keys per channel: (B, nkv, Tq/G, hs); per token, as values: (B, nkv, Tq, hs/G).
        key_width, key_rows = (hs, capacity // G) if per_channel else (hs // G, capacity)
        self.scales = {name: Rows(B, nkv, key_width if name[0] == "k" else hs // G, device,
                                   SCALE_DTYPE, key_rows if name[0] == "k" else capacity)
                       for name in ("k_scale", "k_zero", "v_scale", "v_zero")}
        # a decoding call's rows, in its order, and its arguments kept between steps
        self.code_rows = (self.codes["k"], self.scales["k_scale"], self.scales["k_zero"],
                          self.codes["v"], self.scales["v_scale"], self.scales["v_zero"])
        # each row's growth when a chunk of G tokens (per-channel keys) or of 1 is quantised
        chunk, key_scales = (G if per_channel else 1), self.code_rows[1:3]
        self.chunk_rows = [(r, 1 if per_channel and r in key_scales else chunk)
                           for r in self.code_rows]
        self.call = code_attention.DecodeCall()

    # The filled parts, as views: what bytes_held counts and attention reads.
    tail_k = property(lambda self: self.tails["k"].t)
    tail_v = property(lambda self: self.tails["v"].t)
    k_codes = property(lambda self: self.codes["k"].t)
    v_codes = property(lambda self: self.codes["v"].t)
    k_scale = property(lambda self: self.scales["k_scale"].t)
    k_zero = property(lambda self: self.scales["k_zero"].t)
    v_scale = property(lambda self: self.scales["v_scale"].t)
    v_zero = property(lambda self: self.scales["v_zero"].t)

    def tensors(self) -> list[Tensor]:
        return [self.sink_k, self.sink_v, self.tail_k, self.tail_v, self.k_codes,
                self.v_codes, self.k_scale, self.k_zero, self.v_scale, self.v_zero]

    @property
    def quantised(self) -> int:
        return self.codes["k"].n  # k_codes.size(2), without making the view
