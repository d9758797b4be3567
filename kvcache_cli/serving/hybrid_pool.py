"""`HybridPool`: serve's pool for a model with sliding layers, one page size for every kind.

A page holds `block_size` tokens of one group of layers (`hybrid_blocks.kv_groups`: the
layers of a kind in groups of one size), so the pool is `PagedCache`'s tensors with a
group's layer count in place of the model's: (G, nkv, n_blocks, bs, hs). Each group has
its own block table per row, bound as (groups, B, max blocks); layer l of the model reads
and writes layer j of the pages of its group g. A sliding group's table holds `NULL` (read
as block 0) where the block manager gave a block back, and its attention sees only its
window (`caches.paged.attend_in_window`), so those slots are never read.

`HybridQuantPool` is the same routing over `QuantPagedCache`'s pages (`--kv-dtype`): every
group, sliding or global, holds its tokens as int8/int4/fp8 codes, quantised per token as
they are written, so a ring's worth of codes is exactly what the solo quantised cache of
that kind would have read for the same window.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from kvcache_cli.caches.paged import PagedCache
from kvcache_cli.caches.quantized_pool import QuantPagedCache, pool_block_bytes
from kvcache_cli.caches.spec_quantized import check_head_dim
from kvcache_cli.serving.hybrid_blocks import Group


class HybridPool(PagedCache):
    """Pages of one group of layers, in full precision (`HybridQuantPool`: in codes); each
    model layer routed to its group's pages: the group's table, the layer's index among
    the group's. `fmt` goes on to a quantised pool's constructor."""

    def __init__(self, shape, groups: tuple[Group, ...], n_blocks: int, block_size: int,
                 device, dtype: torch.dtype, *fmt: str):
        size = len(groups[0].layers)
        super().__init__(replace(shape, n_layer=size, layer_types=()), n_blocks, block_size,
                         device, dtype, *fmt)
        self.groups = groups
        self._route = {layer: (g, j) for g, group in enumerate(groups)
                       for j, layer in enumerate(group.layers)}  # layer -> group, its index

    def locate(self, rows: Tensor, positions: Tensor) -> Tensor:
        """Every group's pool block of each position of each row, (groups, *broadcast)."""
        return self.block_tables[:, rows, positions // self.block_size]

    def window_of(self, layer: int) -> int | None:
        return self.groups[self._route[layer][0]].window

    def write(self, layer: int, blocks: Tensor, slots: Tensor, k: Tensor, v: Tensor) -> None:
        g, j = self._route[layer]
        super().write(j, blocks[g], slots, k, v)

    def pages(self, layer: int) -> tuple[int, Tensor]:
        g, j = self._route[layer]
        return j, self.block_tables[g]  # group g's table, (B, max blocks)


class HybridQuantPool(HybridPool, QuantPagedCache):
    """int8/int4/fp8 pages (`fmt`, the last constructor argument): `HybridPool`'s routing
    over `QuantPagedCache`'s write and read (the method order puts the routing first)."""


def make_hybrid_pool(kind: str, shape, groups: tuple[Group, ...], kv_mem: int,
                     block_size: int, device, dtype: torch.dtype) -> PagedCache:
    """serve's hybrid pool of kind `kind` ('paged', 'paged-int8', ...): as many pages of
    one group's layers as kv_mem holds (`quantized_pool.make_pool`, per group)."""
    page = replace(shape, n_layer=len(groups[0].layers), layer_types=())
    n_pages = kv_mem // pool_block_bytes(kind, page, block_size, dtype)
    if kind == "paged":
        return HybridPool(shape, groups, n_pages, block_size, device, dtype)
    check_head_dim(kind, {"bits": 4 if kind == "paged-int4" else 8}, shape.head_size)
    return HybridQuantPool(shape, groups, n_pages, block_size, device, dtype,
                           kind.removeprefix("paged-"))
