"""The pool's bookkeeping: a free list, reference counts, and prefix hashes.

vLLM's block manager (nano-vllm's `block_manager.py`): blocks of `block_size`
tokens handed out on demand, freed when their last holder lets go. With prefix
sharing, every full block is entered under a hash chained over all tokens up to
its end (the hash of the block before it and its own tokens), so a new sequence
whose first blocks hold the same tokens at the same positions takes them by
reference instead of computing them again. Only full blocks are shared and a full
block is never written again, so sharing needs no copy on write. A freed block
keeps its hash until the free list hands it out again: a later request can still
hit it (vLLM's prefix cache). No tensors here: `PagedCache` holds the pool.
"""

from __future__ import annotations

from collections import deque

from kvcache_cli.caches.base import RollbackError
from kvcache_cli.serving.sequence import Sequence

NULL = -1  # a block table entry given back (a hybrid pool's sliding group): no block behind it


def chain_hashes(tokens: list[int], n_blocks: int, block_size: int) -> list[int]:
    """The chained hash of each of the first n_blocks full blocks of tokens."""
    hashes, h, bs = [], 0, block_size
    for i in range(n_blocks):
        h = hash((h, tuple(tokens[i * bs : (i + 1) * bs])))
        hashes.append(h)
    return hashes


class BlockManager:
    def __init__(self, n_blocks: int, block_size: int, prefix_sharing: bool = True):
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got "
                             f"{n_blocks} blocks of {block_size}")
        self.n_blocks, self.block_size, self.prefix_sharing = n_blocks, block_size, prefix_sharing
        self.refcount = [0] * n_blocks
        # Freed blocks go to the back, new ones come from the front: a block freed
        # recently, whose prefix a next request may hit, is reused last.
        self.free_blocks: deque[int] = deque(range(n_blocks))
        self.block_hash: list[int | None] = [None] * n_blocks
        self.hash_to_block: dict[int, int] = {}
        self.prefix_hits = 0  # blocks taken by reference instead of computed

    # -- queries

    @property
    def blocks_in_use(self) -> int:
        return self.n_blocks - len(self.free_blocks)

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def _chain(self, tokens: list[int], n_blocks: int) -> list[int]:
        return chain_hashes(tokens, n_blocks, self.block_size)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks that already hold this sequence's first full blocks.

        At most the full blocks before the last token: a prefill must compute at
        least one token, the one whose logits choose the next.
        """
        if not self.prefix_sharing:
            return []
        hits = []
        for h in self._chain(seq.tokens, (len(seq.tokens) - 1) // self.block_size):
            block = self.hash_to_block.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._cached_prefix(seq)
        # A hit on a freed block still takes it off the free list.
        needed = self.blocks_for(len(seq.tokens)) - len(hits)
        needed += sum(1 for b in hits if self.refcount[b] == 0)
        return needed <= len(self.free_blocks)

    def can_append(self, seq: Sequence) -> bool:
        """Whether the next token (at position num_cached) has a slot."""
        return seq.num_cached < len(seq.block_table) * self.block_size or bool(self.free_blocks)

    # -- changes

    def claim(self, block: int) -> None:
        """One more holder of a cached block (off the free list if it was freed)."""
        if self.refcount[block] == 0:
            self.free_blocks.remove(block)
        self.refcount[block] += 1

    def release(self, block: int) -> None:
        """One holder fewer; back to the free list (its hash kept) when none is left."""
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self.free_blocks.append(block)

    def _take(self) -> int:
        if not self.free_blocks:
            raise MemoryError(f"all {self.n_blocks} KV blocks are in use")
        block = self.free_blocks.popleft()
        if self.block_hash[block] is not None:  # its old contents are about to go
            self.hash_to_block.pop(self.block_hash[block], None)
            self.block_hash[block] = None
        self.refcount[block] = 1
        return block

    def allocate(self, seq: Sequence, whole: bool = True) -> None:
        """A block table for every token of seq: shared prefix blocks, then new ones.

        `whole`: this step computes every token (a prefill-first prefill), so its full
        blocks are entered now; a chunked prefill enters them chunk by chunk.
        """
        hits = self._cached_prefix(seq)
        for block in hits:
            self.claim(block)
        self.prefix_hits += len(hits)
        if seq.admitted_hits is None:
            seq.admitted_hits = len(hits)
        seq.block_table = hits + [self._take() for _ in
                                  range(self.blocks_for(len(seq.tokens)) - len(hits))]
        seq.num_cached = len(hits) * self.block_size
        if whole:
            self.register_full_blocks(seq, len(seq.tokens))

    def before_compute(self, seq: Sequence) -> None:
        """Nothing to give back before seq computes more: every layer reads every block
        (`HybridBlockManager` gives back what fell out of a sliding window)."""

    def append_slot(self, seq: Sequence) -> None:
        """Make room for the token at position num_cached (a new block when the last is full)."""
        if seq.num_cached == len(seq.block_table) * self.block_size:
            seq.block_table.append(self._take())

    def reserve(self, seq: Sequence, n_tokens: int) -> None:
        """Make room for positions 0 .. n_tokens-1 (a speculative step writes several)."""
        while len(seq.block_table) * self.block_size < n_tokens:
            seq.block_table.append(self._take())

    def trim(self, seq: Sequence, n_tokens: int) -> None:
        """Roll seq back to its first n_tokens positions: speculative decoding's rollback.

        Every block past them goes back, the tail first: its reference is dropped, and it
        returns to the free list only when no other sequence holds it. Nothing is copied.
        The block the new end falls in is kept; the next token will overwrite its slots
        from there on, so its prefix hash (which named the old contents) is dropped, and a
        block another sequence shares is never cut into: that would overwrite keys it reads.
        A hybrid pool does so in every group's table.
        """
        if not 0 <= n_tokens <= seq.num_cached:
            raise RollbackError(f"cannot roll back to {n_tokens} positions: the sequence "
                                f"holds {seq.num_cached}; expected 0..{seq.num_cached}")
        keep = self.blocks_for(n_tokens)
        tables = self.tables(seq)
        cut = n_tokens % self.block_size != 0
        for block in (t[keep - 1] for t in tables if cut and n_tokens < seq.num_cached
                      and t[keep - 1] != NULL):
            if self.refcount[block] > 1:
                raise RollbackError(
                    f"cannot roll back to {n_tokens} positions: block {block} is shared with "
                    f"{self.refcount[block] - 1} other sequence(s), and the next token would "
                    "overwrite keys they read")
            if self.block_hash[block] is not None:
                self.hash_to_block.pop(self.block_hash[block], None)
                self.block_hash[block] = None
        for i in reversed(range(keep, len(tables[0]))):
            for table in tables:
                if table[i] != NULL:
                    self.release(table[i])
        for table in tables:
            del table[keep:]
        seq.num_cached = n_tokens

    def tables(self, seq: Sequence) -> list[list[int]]:
        """The block tables seq holds: its one (a hybrid pool's: one per group)."""
        return [seq.block_table]

    def register_full_blocks(self, seq: Sequence, n_tokens: int) -> None:
        """Enter every full block of seq's first n_tokens under its hash.

        The scheduler enters a block as soon as a step is to compute it, before the
        forward runs: a request that hits it later in the same step is computed in a
        later forward (prefill-first) or in the same one, where every layer writes all
        rows' keys before any row reads them (decode-first).
        """
        if not self.prefix_sharing:
            return
        n_full = n_tokens // self.block_size
        for block, h in zip(seq.block_table[:n_full], self._chain(seq.tokens, n_full)):
            if self.block_hash[block] is None and h not in self.hash_to_block:
                self.block_hash[block] = h
                self.hash_to_block[h] = block

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):  # the tail first: the prefix stays longest
            self.release(block)
        seq.block_table, seq.num_cached = [], 0

    def tokens_stored(self, running: list[Sequence]) -> int:
        """Tokens whose K/V the blocks in use hold, a shared block counted once."""
        full = set()
        partial = 0
        for seq in running:
            n_full = seq.num_cached // self.block_size
            full.update(seq.block_table[:n_full])
            partial += seq.num_cached - n_full * self.block_size
        return len(full) * self.block_size + partial
