"""`PooledSequence`: one sequence's cache in serve's shared pool, as a `KVCache`.

The pool (`PagedCache`, or a hybrid model's `HybridPool`) holds every sequence's blocks; the
block manager says which are whose. Serve's engine binds a whole batch's block tables each
step; one sequence decoded on its own (speculative decoding against the pool, its tests,
the `rollback-shared` break) needs the same bookkeeping per call: a sliding group's blocks
that left the window given back before a forward (`before_compute`), blocks taken as its
positions grow, the tail blocks handed back when it rolls back (`crop` ->
`BlockManager.trim`), never one that another sequence still holds.
"""

from __future__ import annotations

from torch import Tensor

from kvcache_cli.caches.base import KVCache, nbytes
from kvcache_cli.caches.paged import PagedCache
from kvcache_cli.caches.step import Step
from kvcache_cli.serving.block_manager import NULL, BlockManager
from kvcache_cli.serving.model_runner import block_tables
from kvcache_cli.serving.sequence import Sequence


class PooledSequence(KVCache):
    def __init__(self, pool: PagedCache, manager: BlockManager, seq: Sequence):
        if pool.block_size != manager.block_size:
            raise ValueError(f"pool blocks of {pool.block_size} tokens, manager blocks of "
                             f"{manager.block_size}: expected the same size")
        self.pool, self.manager, self.seq = pool, manager, seq
        self._page_bytes = pool.bytes_held // pool.k.size(2)  # a block of the pool's layers
        self.bytes_copied = 0

    @property
    def length(self) -> int:
        return self.seq.num_cached

    def _store(self, layer: int, start_pos: int, k: Tensor, v: Tensor) -> None:
        if layer == 0:  # once per forward: blocks for this call's positions, then its table
            end = start_pos + k.size(2)
            self.manager.before_compute(self.seq)
            self.manager.reserve(self.seq, end)
            self.pool.bind(block_tables([self.seq], k.device))
            self.seq.num_cached = end
        self.bytes_copied += nbytes(k) + nbytes(v)

    def update(self, layer: int, start_pos: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self._store(layer, start_pos, k, v)
        return self.pool.update(layer, start_pos, k, v)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, step: Step) -> Tensor:
        # The pool's own attention: a sliding layer's sees only its window.
        self._store(layer, step.start, k, v)
        return self.pool.attend(layer, q, k, v, step)

    def crop(self, length: int) -> None:
        # The pool's slots are left as they are: the tail blocks go back to the free list
        # and whoever takes one next overwrites it; the cut block's rejected slots are
        # overwritten by this sequence's next tokens before anything reads them.
        self.manager.trim(self.seq, length)

    @property
    def bytes_held(self) -> int:
        held = self.manager.tables(self.seq)
        return sum(b != NULL for table in held for b in table) * self._page_bytes

    def reset(self) -> None:
        self.manager.free(self.seq)
        self.bytes_copied = 0
