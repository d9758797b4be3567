"""`PooledSequence`: one sequence's cache in serve's shared pool, as a `KVCache`.

The pool (`PagedCache`) holds every sequence's blocks; the `BlockManager` says which are
whose. Serve's engine binds a whole batch's block tables each step; one sequence decoded
on its own (speculative decoding against the pool, its tests, the `rollback-shared`
break) needs the same bookkeeping per call: blocks taken as its positions grow, the tail
blocks handed back when it rolls back (`crop` -> `BlockManager.trim`), never one that
another sequence still holds.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvcache_cli.caches.base import KVCache, nbytes
from kvcache_cli.caches.paged import PagedCache, block_bytes
from kvcache_cli.serving.block_manager import BlockManager
from kvcache_cli.serving.sequence import Sequence


class PooledSequence(KVCache):
    def __init__(self, pool: PagedCache, manager: BlockManager, seq: Sequence, config):
        if pool.block_size != manager.block_size:
            raise ValueError(f"pool blocks of {pool.block_size} tokens, manager blocks of "
                             f"{manager.block_size}: expected the same size")
        self.pool, self.manager, self.seq = pool, manager, seq
        self._block_bytes = block_bytes(config.cache_shape, pool.block_size, pool.k.dtype)
        self.bytes_copied = 0

    @property
    def length(self) -> int:
        return self.seq.num_cached

    def update(self, layer: int, start_pos: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if layer == 0:  # once per forward: blocks for this call's positions, then its table
            end = start_pos + k.size(2)
            self.manager.reserve(self.seq, end)
            table = torch.tensor([self.seq.block_table], device=k.device)  # (1, blocks)
            self.pool.bind(table)
            self.seq.num_cached = end
        self.bytes_copied += nbytes(k) + nbytes(v)
        return self.pool.update(layer, start_pos, k, v)

    def crop(self, length: int) -> None:
        # The pool's slots are left as they are: the tail blocks go back to the free list
        # and whoever takes one next overwrites it; the cut block's rejected slots are
        # overwritten by this sequence's next tokens before anything reads them.
        self.manager.trim(self.seq, length)

    @property
    def bytes_held(self) -> int:
        return len(self.seq.block_table) * self._block_bytes

    def reset(self) -> None:
        self.manager.free(self.seq)
        self.bytes_copied = 0
