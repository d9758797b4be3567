"""The half-precision caches (`fp16`, `bf16`): every position kept, each key and value stored
in 2 bytes, attention computed in float32.

What engines deploy as their float cache: llama.cpp's default `f16` cache, vLLM's `auto`
under a half-precision model. The model runs in float32 (or whatever `--dtype` says); only
what the cache holds is rounded, once, as it is written (round to nearest), so a key or
value comes back within a relative 2^-11 (fp16) or 2^-8 (bf16) of itself, and every
product and sum of attention is float32. Half of `static`'s bytes under a float32 model.

A decoding token's step on the CPU is `StaticCache.decode`'s one native call
(`code_attention.attend_decode`): the new key and value rounded into the buffers as torch's
cast rounds them, then the stored numbers read in place by the kernel the quantised caches
use, each row widened to float32 as it is read, no float32 copy of the history made. A
prefill or a chunk of draft tokens, another device, or a machine where the kernel cannot be
built reads `update`'s float32 copy of the window it attends (SDPA), the same arithmetic up
to the order of sums.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvcache_cli.caches.exact import StaticCache

HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class HalfCache(StaticCache):
    """`StaticCache`'s buffers in float16 or bfloat16: written in place at each position,
    read back at the model's dtype (`update`), or in place by the kernel (`decode`)."""

    def __init__(self, shape, max_len: int, batch: int, device, dtype: torch.dtype, *,
                 store: torch.dtype, whole: bool = False):
        super().__init__(shape, max_len, batch, device, store, whole)
        self.dtype = dtype  # the model's: what attention computes in

    @classmethod
    def build(cls, spec, shape, *, max_len: int, batch: int, device, dtype, whole: bool):
        return cls(shape, max_len, batch, device, dtype, store=HALF_DTYPES[spec.kind],
                   whole=whole)

    def update(self, layer: int, start_pos: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        keys, values = super().update(layer, start_pos, k, v)  # (B, nkv, S, hs), half
        return keys.to(self.dtype), values.to(self.dtype)  # the window attended, widened

    def write_at(self, layer: int, pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        store = self.k[layer].dtype
        keys, values = super().write_at(layer, pos, k.to(store), v.to(store))
        return keys.to(self.dtype), values.to(self.dtype)  # (B, nkv, max_len, hs)
