"""serve's block pool quantised (`--kv-dtype int8|int4|fp8`): every token quantised as
it is written, one scale per head and token, and the pool's size in blocks for a budget."""

from __future__ import annotations

import torch
from torch import Tensor

from kvcache_cli.caches.affine import SCALE_DTYPE, _Tokens
from kvcache_cli.caches.base import nbytes
from kvcache_cli.caches.fp8 import fp8_range
from kvcache_cli.caches.paged import PagedCache
from kvcache_cli.caches.spec_quantized import check_head_dim


class QuantPagedCache(PagedCache):
    """serve's block pool holding int8/int4 codes (one scale and zero point per head and
    token, float16) or fp8 e4m3 (scale 1.0): `PagedCache` with its write and gather in
    codes, so bind, update, crop and the serving step's writes are the same."""

    def __init__(self, shape, n_blocks: int, block_size: int, device, dtype: torch.dtype,
                 fmt: str):
        self.block_size, self.fmt, self.dtype = block_size, fmt, dtype
        nkv, hs = shape.n_kv_head, shape.head_size
        base = (shape.n_layer, nkv, n_blocks, block_size)
        # Every pool is (L, nkv, n_blocks, bs, X), so PagedCache's gather reads each alike.
        if fmt == "fp8":
            self.bits = 8
            store, width = torch.float8_e4m3fn, hs
            self.max = fp8_range(store)
        else:
            self.bits = int(fmt.removeprefix("int"))
            store, width = torch.uint8, hs * self.bits // 8
        self.pools = {"k": torch.zeros(*base, width, device=device, dtype=store),
                      "v": torch.zeros(*base, width, device=device, dtype=store)}
        if fmt != "fp8":
            for name in ("k_scale", "k_zero", "v_scale", "v_zero"):
                self.pools[name] = torch.zeros(*base, 1, device=device, dtype=SCALE_DTYPE)
        # (L, nkv, n_blocks, bs, X), as PagedCache
        self.k, self.v = self.pools["k"], self.pools["v"]
        self.block_tables = None
        self._scratch = {name: torch.empty(0, device=device, dtype=p.dtype)
                         for name, p in self.pools.items()}
        self.saturated = 0
        self.reset()

    @classmethod
    def build(cls, spec, shape, *, max_len: int, batch: int, device, dtype, whole: bool):
        block_size = spec["block_size"]
        per_row = -(-max_len // block_size)  # blocks for max_len positions, rounded up
        cache = cls(shape, batch * per_row, block_size, device, dtype,
                    spec.kind.removeprefix("paged-"))
        cache.bind(torch.arange(batch * per_row, device=device).view(batch, per_row))
        return cache

    def _encode(self, x: Tensor, which: str) -> dict[str, Tensor]:
        """x (B, nkv, T, hs) -> the parts each pool stores, (B, nkv, T, X)."""
        if self.fmt == "fp8":
            self.saturated += int((x.abs() > self.max).sum())
            return {which: x.float().clamp(-self.max, self.max).to(self.pools[which].dtype)}
        codes, scale, zero = _Tokens.encode(x, self.bits, x.size(-1))  # one group per head
        return {which: codes, f"{which}_scale": scale, f"{which}_zero": zero}

    def _read(self, layer: int, table: Tensor, which: str) -> Tensor:
        got = {name: self._gather(self.pools[name][layer], table, name)
               for name in self.pools if name.startswith(which)}  # each (B, nkv, S, X)
        if self.fmt == "fp8":
            return got[which].to(self.dtype)
        hs = got[which].size(-1) * 8 // self.bits
        return _Tokens.decode(got[which], got[f"{which}_scale"], got[f"{which}_zero"],
                              self.bits, hs, self.dtype)

    def write(self, layer: int, blocks: Tensor, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """`PagedCache.write` in codes: each token quantised as it is stored, k and v
        (nkv, *idx, hs) at pool blocks `blocks` and slots `slots` (both *idx)."""
        nkv, hs, idx = k.size(0), k.size(-1), blocks.shape
        parts = self._encode(k.reshape(1, nkv, -1, hs), "k") | self._encode(
            v.reshape(1, nkv, -1, hs), "v")  # each (1, nkv, N, X)
        for name, part in parts.items():
            part = part.reshape(nkv, *idx, part.size(-1))  # (nkv, *idx, X)
            self.pools[name][layer][:, blocks, slots] = part
            self.bytes_copied += nbytes(part)

    def read(self, layer: int, table: Tensor) -> tuple[Tensor, Tensor]:
        """`PagedCache.read` decoded: (B, nkv, S, hs) each, key j at slot j."""
        return self._read(layer, table, "k"), self._read(layer, table, "v")

    @property
    def bytes_held(self) -> int:
        return sum(nbytes(p) for p in self.pools.values())


# The pools serve can hold, by engine name: the full-precision one and the quantised ones.
POOLS = ("paged", "paged-int8", "paged-int4", "paged-fp8")


def pool_block_bytes(kind: str, shape, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block of the pool `kind` (every layer, K and V, scales included),
    from the spec registry's formula, which `bytes_held` is tested against."""
    from kvcache_cli.caches.spec import layer_bytes, parse_cache_spec

    element = torch.empty((), dtype=dtype).element_size()
    spec = parse_cache_spec(f"{kind}:b{block_size}")
    return shape.n_layer * layer_bytes(spec, block_size, shape.n_kv_head, shape.head_size,
                                        element)


def make_pool(kind: str, shape, kv_mem: int, block_size: int, device,
              dtype: torch.dtype) -> PagedCache:
    """serve's pool of kind `kind` ('paged', 'paged-int8', ...): as many blocks as kv_mem
    holds. The engines choose the kind; the block manager and scheduler are the same."""
    n_blocks = kv_mem // pool_block_bytes(kind, shape, block_size, dtype)
    if kind == "paged":
        return PagedCache(shape, n_blocks, block_size, device, dtype)
    check_head_dim(kind, {"bits": 4 if kind == "paged-int4" else 8}, shape.head_size)
    return QuantPagedCache(shape, n_blocks, block_size, device, dtype,
                           kind.removeprefix("paged-"))
