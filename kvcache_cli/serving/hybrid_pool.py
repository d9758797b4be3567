"""`HybridPool`: serve's pool for a model with sliding layers, one page size for every kind.

A page holds `block_size` tokens of one group of layers (`hybrid_blocks.kv_groups`: the
layers of a kind in groups of one size), so the pool is `PagedCache`'s tensors with a
group's layer count in place of the model's: (G, nkv, n_blocks, bs, hs). Each group has
its own block table per row, bound as (groups, B, max blocks); layer l of the model reads
and writes layer j of the pages of its group g. A sliding group's table holds `NULL` (read
as block 0) where the block manager gave a block back, and its attention sees only its
window (`caches.paged.attend_in_window`), so those slots are never read.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from kvcache_cli.caches.paged import PagedCache, attend_in_window
from kvcache_cli.caches.step import Step
from kvcache_cli.serving.hybrid_blocks import Group


class HybridPool(PagedCache):
    def __init__(self, shape, groups: tuple[Group, ...], n_blocks: int, block_size: int,
                 device, dtype: torch.dtype):
        size = len(groups[0].layers)
        super().__init__(replace(shape, n_layer=size, layer_types=()), n_blocks, block_size,
                         device, dtype)
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

    def gather(self, layer: int) -> tuple[Tensor, Tensor]:
        g, j = self._route[layer]
        table = self.block_tables[g]  # (B, max blocks)
        return self._gather(self.k[j], table, 0), self._gather(self.v[j], table, 1)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, step: Step) -> Tensor:
        keys, values = self.update(layer, step.start, k, v)  # (B, nkv, S, hs), key j at j
        window = self.window_of(layer)
        if window is None:
            return step.in_order(q, keys, values)
        pos = step.pos if step.pos.dim() == 2 else step.pos[None]  # (B|1, T)
        return attend_in_window(q, keys, values, pos, window)
