"""The exact caches: every position kept at the model's precision.

- `ConcatCache` appends with `torch.cat`: simple, and it copies the whole history at
  every step (quadratic bytes moved over a generation);
- `StaticCache` allocates two buffers once for the longest sequence and writes each
  step in place at its position; attention reads the filled prefix only (gpt-fast).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvcache_cli.caches import code_attention
from kvcache_cli.caches.base import KVCache, RollbackError, nbytes
from kvcache_cli.caches.step import Step


def _check_crop(cache: KVCache, length: int) -> None:
    if not 0 <= length <= cache.length:
        raise RollbackError(f"cannot crop to {length} positions: the cache holds "
                            f"{cache.length}; expected 0..{cache.length}")


def decodes_natively(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether `code_attention.attend_decode` takes these: float32 on the CPU, each head's
    numbers contiguous, no gradient to keep (the call writes and reads raw memory), the
    kernel built (not KVCACHE_CODE_ATTENTION=torch)."""
    return q.dtype == k.dtype == v.dtype == torch.float32 and q.device.type == "cpu" and \
        q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and \
        not (q.requires_grad or k.requires_grad or v.requires_grad) and \
        code_attention.kernel() is not None


class ConcatCache(KVCache):
    """Append with torch.cat, as the article's first cache does.

    It can only append: new tokens go after whatever it holds, whatever `start_pos`
    says, so keeping positions and contents in step is the caller's job (the
    `position-offset` and `stale-cache` breaks are what happens when they drift).
    """

    def __init__(self, shape, batch: int, device, dtype: torch.dtype):
        self.shape, self.batch, self.device, self.dtype = shape, batch, device, dtype
        self.reset()

    @classmethod
    def build(cls, spec, shape, *, max_len: int, batch: int, device, dtype, whole: bool):
        return cls(shape, batch, device, dtype)

    def reset(self) -> None:
        c = self.shape
        empty = (self.batch, c.n_kv_head, 0, c.head_size)  # (B, nkv, 0, hs)
        new = dict(device=self.device, dtype=self.dtype)
        self.k = [torch.empty(empty, **new) for _ in range(c.n_layer)]
        self.v = [torch.empty(empty, **new) for _ in range(c.n_layer)]
        self.bytes_copied = 0

    def update(self, layer: int, start_pos: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        # torch.cat allocates a new tensor and copies the whole history into it: step n
        # moves n positions' worth of bytes, a generation of n tokens O(n^2).
        self.k[layer] = torch.cat([self.k[layer], k], dim=2)  # (B, nkv, S, hs)
        self.v[layer] = torch.cat([self.v[layer], v], dim=2)
        self.bytes_copied += nbytes(self.k[layer]) + nbytes(self.v[layer])
        return self.k[layer], self.v[layer]

    def crop(self, length: int) -> None:
        _check_crop(self, length)
        # Views of the kept prefix: nothing is copied until the next append's cat.
        self.k = [k[:, :, :length] for k in self.k]
        self.v = [v[:, :, :length] for v in self.v]

    @property
    def length(self) -> int:
        return self.k[0].size(2)

    @property
    def bytes_held(self) -> int:
        return sum(nbytes(t) for t in self.k + self.v)


def layer_buffers(n_layer: int, dims: tuple[int, ...], device, dtype: torch.dtype,
                  compiled: bool) -> tuple[list[Tensor], list[Tensor]]:
    """Zeroed key and value buffers of shape `dims` for each layer: one a layer, since a
    compiled write into one layer's slice of a buffer for every layer copies them all.
    `compiled` ones on CUDA are marked as static addresses: a compiled step writes them in
    place, and CUDA graphs refuse a graph that mutates unmarked inputs, so the step would
    run kernel by kernel (transformers marks its StaticCache's buffers the same way)."""
    k = [torch.zeros(dims, device=device, dtype=dtype) for _ in range(n_layer)]
    v = [torch.zeros(dims, device=device, dtype=dtype) for _ in range(n_layer)]
    if compiled and torch.device(device).type == "cuda":
        for buffer in k + v:
            torch._dynamo.mark_static_address(buffer)
    return k, v


class StaticCache(KVCache):
    """Two buffers allocated once for `max_len` positions, written in place (gpt-fast).

    A step copies only its own tokens' keys and values; attention reads the filled
    prefix [0, start_pos + T), so whatever lies beyond it is never seen. With
    `whole=True` attention reads all max_len slots under a mask instead: more work per
    step, but the same shapes at every step, which is what torch.compile needs to run
    one static graph (and CUDA graphs to replay one), as in gpt-fast. Each layer has
    buffers of its own, as in gpt-fast: in one tensor for every layer, a compiled step's
    in-place write into one layer's slice becomes a copy of all of them (measured: a
    compiled GPT-2 step at 52 ms against 26 ms with a buffer per layer, 2 CPU threads).
    """

    def __init__(self, shape, max_len: int, batch: int, device, dtype: torch.dtype,
                 whole: bool = False):
        if not 0 < max_len <= shape.context:
            raise ValueError(f"max_len {max_len} outside the context window 1..{shape.context}")
        self.max_len = max_len
        self.whole = whole
        # per layer: (B, nkv, max_len, hs)
        self.k, self.v = layer_buffers(shape.n_layer, (batch, shape.n_kv_head, max_len,
                                                       shape.head_size), device, dtype, whole)
        self.reset()

    @classmethod
    def build(cls, spec, shape, *, max_len: int, batch: int, device, dtype, whole: bool):
        return cls(shape, max_len, batch, device, dtype, whole)

    def reset(self) -> None:
        # No need to clear the buffers: nothing past the filled prefix is ever read.
        self.length = 0
        self.bytes_copied = 0

    def update(self, layer: int, start_pos: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        end = start_pos + k.size(2)
        if end > self.max_len:
            raise IndexError(f"position {end - 1} past the static cache's {self.max_len} slots")
        self.k[layer][:, :, start_pos:end] = k  # cast to the buffers' dtype (`caches.half`)
        self.v[layer][:, :, start_pos:end] = v
        self.bytes_copied += 2 * k.numel() * self.k[layer].element_size()  # as stored
        self.length = end
        if self.whole:
            return self.k[layer], self.v[layer]  # (B, nkv, max_len, hs); attention masks
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]  # (B, nkv, end, hs)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, step: Step) -> Tensor:
        """gpt-fast's: the write, then SDPA over the filled prefix, or over the whole buffer
        under a mask; a compiled step's position is a tensor (`write_at`). A float32
        decoding token on the CPU: the write and the attention in one native call
        (`decode`)."""
        if q.size(2) == 1 and not isinstance(step.start, Tensor) and not self.whole and \
                self.k[layer].dtype in code_attention.FULL_FLAGS and decodes_natively(q, k, v) and \
                not torch.compiler.is_compiling():
            return self.decode(layer, q, k, v, step)
        if isinstance(step.start, Tensor):  # the position as data: `generate.CompiledDecode`
            keys, values = self.write_at(layer, step.pos, k, v)  # (B, nkv, max_len, hs)
            return step.in_order(q, keys, values)
        keys, values = self.update(layer, step.start, k, v)  # (B, nkv, S, hs)
        return step.whole(q, keys, values) if self.whole else step.in_order(q, keys, values)

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor, step: Step) -> Tensor:
        """`update`'s write of one token a row at slot start = step.start and the attention
        (B, nh, 1, hs) of q over slots 0..start, in one call (`code_attention.attend_decode`,
        which reads the position from step.pos): the 28 torch ops a layer of the slice
        writes, slices and SDPA (26 of a half cache's) become one. The same arithmetic as
        SDPA's, its sums in another order."""
        start = step.start
        if start + 1 > self.max_len:
            raise IndexError(f"position {start} past the static cache's {self.max_len} slots")
        y = code_attention.attend_decode(q, k, v, self.k[layer], self.v[layer], step.pos)
        self.bytes_copied += 2 * k.numel() * self.k[layer].element_size()  # as stored
        self.length = start + 1
        return y  # (B, nh, 1, hs)

    def write_at(self, layer: int, pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v (B, nkv, T, hs) at positions pos (T,), a tensor, and return the whole
        buffers (B, nkv, max_len, hs): a compiled decode step's write (`generate.
        CompiledDecode`). It reads and changes no Python number, since inside a compiled
        graph a number read is a guard and each new value a recompile; the caller
        records the write afterwards (`advance`)."""
        self.k[layer].index_copy_(2, pos, k)
        self.v[layer].index_copy_(2, pos, v)
        return self.k[layer], self.v[layer]

    def advance(self, start_pos: int, T: int) -> None:
        """Record what `write_at` wrote at every layer: T positions from start_pos."""
        if start_pos + T > self.max_len:
            raise IndexError(f"position {start_pos + T - 1} past the static cache's "
                             f"{self.max_len} slots")
        self.length = start_pos + T
        self.bytes_copied += self.bytes_held // self.max_len * T

    def crop(self, length: int) -> None:
        _check_crop(self, length)
        # Nothing moves: the slots past `length` are never read again before the next
        # write covers them (gpt-fast's speculative decoding rolls back the same way).
        self.length = length

    @property
    def bytes_held(self) -> int:
        return sum(nbytes(t) for t in self.k + self.v)

    def buffers(self) -> list[Tensor]:
        """Every layer's key buffer, then every layer's value buffer (`KVCache.buffers`)."""
        return [*self.k, *self.v]
