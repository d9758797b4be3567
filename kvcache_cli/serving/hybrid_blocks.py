"""The block manager of a hybrid model's pool: a block table per group of layers, and the
sliding groups' blocks that fall out of the window handed back. No tensors here.

vLLM's hybrid KV-cache manager (`v1/core/kv_cache_coordinator.py`, with
`single_type_kv_cache_manager.py`'s `FullAttentionManager` and `SlidingWindowManager`):

- **groups.** The layers of each kind (full attention, a sliding window of W) are split
  into groups of one size, the largest that divides every kind's count (Gemma 3 270M: 3
  full and 15 sliding layers, so 6 groups of 3). A page of the pool holds `block_size`
  tokens of one group's layers, so every page costs the same bytes and one free list
  serves every kind; each sequence has a block table per group.
- **window.** Before a sliding group computes tokens from position p, the blocks wholly
  before p - W + 1 are read by no query again: they go back to the free list (their hash
  kept, so a later request can still hit them until the list hands them out). An entry
  given back reads `NULL` in the table; attention masks it (`caches.paged.attend_in_window`).
- **prefix cache.** A hit of n blocks needs every full group's blocks 0 .. n-1, but a
  sliding group only the ceil((W - 1) / block_size) blocks before n, the window of the
  first token computed (`SlidingWindowManager.find_longest_cache_hit`). A shared prefix
  whose window blocks were handed out again hits only as far back as a window is still
  cached: the rest is recomputed (llama.cpp: "forcing full prompt re-processing due to
  lack of cache data").
- **keeping what a hit needs.** `keep_every` N: a sliding group does not give back the
  window's blocks before each N-th token (checkpoints, as llama.cpp's `--ctx-checkpoints`
  keep its sliding state), so a later request branching at a checkpoint finds them, for the
  bytes they hold meanwhile. 0 gives every block back as it leaves the window (vLLM's).

- **rolling back** (speculative decoding against the pool, `serving.pooled`): `reserve`
  takes pages in every group for a step's drafted tokens, `trim` gives back every group's
  tail. The blocks a sliding group gives back are those before the window of the first
  token a forward computes, so they stay held until the step's tokens are accepted: a
  rollback to any of them finds its window whole. One further back is refused.

On a model with one kind of layer `kv_groups` gives one group, and serve uses the plain
`BlockManager`.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

from kvcache_cli.caches.base import RollbackError
from kvcache_cli.serving.block_manager import NULL, BlockManager, chain_hashes
from kvcache_cli.serving.sequence import Sequence


@dataclass(frozen=True)
class Group:
    window: int | None  # None: full attention
    layers: tuple[int, ...]

    @property
    def kind(self) -> str:
        return "full" if self.window is None else "sliding"


def kv_groups(shape) -> tuple[Group, ...]:
    """The layers of each kind (by window) in groups of one size, in layer order."""
    kinds: dict[int | None, list[int]] = {}
    for i, t in enumerate(shape.layer_types):
        # A window as long as the context never slides: a full layer then.
        window = t.window if t.window is not None and t.window < shape.context else None
        kinds.setdefault(window, []).append(i)
    size = gcd(*(len(layers) for layers in kinds.values()))
    return tuple(Group(w, tuple(layers[i : i + size])) for w, layers in kinds.items()
                 for i in range(0, len(layers), size))


@dataclass(frozen=True)
class _Hit:
    blocks: int  # the prefix blocks every group finds cached
    full: int  # the blocks the full-attention groups alone find
    cached: tuple[tuple[int | None, ...], ...]  # per group, the cached block of each index


class HybridBlockManager(BlockManager):
    """`BlockManager`'s free list, reference counts and hashes over pages; a table per group.

    `seq.group_tables[g]` is group g's table; `seq.block_table` is group 0's (the scheduler
    asks only the manager). Figures: `prefix_hits` (blocks taken by reference, per
    request, as the plain manager counts them), `window_misses` (admissions whose full
    groups' hit a missing window cut short), `recomputed_tokens` (what those recomputed),
    `peak_pages` (per kind, the most pages in use at once).
    """

    def __init__(self, n_blocks: int, block_size: int, groups: tuple[Group, ...],
                 prefix_sharing: bool = True, keep_every: int = 0):
        super().__init__(n_blocks, block_size, prefix_sharing)
        if keep_every < 0 or keep_every % block_size:
            raise ValueError(f"--keep-windows {keep_every}: expected 0 or a multiple of the "
                             f"block size ({block_size})")
        self.groups, self.keep_every = groups, keep_every
        self.window_misses = self.recomputed_tokens = 0
        self.in_use = dict.fromkeys((g.kind for g in groups), 0)  # pages held, per kind
        self.peak_pages = dict(self.in_use)
        self.page_kind: list[str | None] = [None] * n_blocks

    # -- the prefix cache

    def _span(self, window: int) -> int:
        """Blocks before a hit's end that its first computed token reads."""
        return -(-(window - 1) // self.block_size)

    def _hit(self, seq: Sequence) -> _Hit:
        n = (len(seq.tokens) - 1) // self.block_size if self.prefix_sharing else 0
        hashes = chain_hashes(seq.tokens, n, self.block_size)
        cached = tuple(tuple(self.hash_to_block.get(hash((g, h))) for h in hashes)
                       for g in range(len(self.groups)))
        full = n
        for group, found in zip(self.groups, cached):
            if group.window is None:
                full = next((i for i, b in enumerate(found[:full]) if b is None), full)
        # The longest hit no longer than the full groups' at which every sliding group still
        # has the window before it (0 always qualifies).
        hit = next(h for h in range(full, -1, -1) if all(
            all(b is not None for b in found[max(0, h - self._span(group.window)) : h])
            for group, found in zip(self.groups, cached) if group.window is not None))
        if not any(g.window is None for g in self.groups):
            full = hit  # no layer holds more than its window: nothing is recomputed for one
        return _Hit(hit, full, cached)

    def _reads(self, group: Group, hit: int) -> range:
        """The hit's blocks a group takes by reference: all, or a sliding group's window."""
        return range(0 if group.window is None else max(0, hit - self._span(group.window)),
                     hit)

    def can_allocate(self, seq: Sequence) -> bool:
        hit = self._hit(seq)
        total = self.blocks_for(len(seq.tokens))
        needed = 0
        for g, group in enumerate(self.groups):
            needed += total - hit.blocks
            needed += sum(1 for i in self._reads(group, hit.blocks)
                          if self.refcount[hit.cached[g][i]] == 0)
        return needed <= len(self.free_blocks)

    def allocate(self, seq: Sequence, whole: bool = True) -> None:
        hit = self._hit(seq)
        total = self.blocks_for(len(seq.tokens))
        # Every group's hits claimed before any fresh page is taken: a fresh page comes off
        # the free list's front, where another group's hit may still lie.
        seq.group_tables = [[self._hold(group, hit.cached[g][i])
                             if i in self._reads(group, hit.blocks) else NULL
                             for i in range(hit.blocks)] for g, group in enumerate(self.groups)]
        for group, table in zip(self.groups, seq.group_tables):
            table += [self._hold(group) for _ in range(total - hit.blocks)]
        seq.block_table = seq.group_tables[0]
        self.prefix_hits += hit.blocks
        if seq.admitted_hits is None:
            seq.admitted_hits = hit.blocks
        if hit.blocks < hit.full:
            self.window_misses += 1
            self.recomputed_tokens += (hit.full - hit.blocks) * self.block_size
        seq.num_cached = hit.blocks * self.block_size
        if whole:
            self.register_full_blocks(seq, len(seq.tokens))

    def register_full_blocks(self, seq: Sequence, n_tokens: int) -> None:
        if not self.prefix_sharing:
            return
        n_full = n_tokens // self.block_size
        hashes = chain_hashes(seq.tokens, n_full, self.block_size)
        for g, table in enumerate(seq.group_tables):
            for block, h in zip(table[:n_full], hashes):
                key = hash((g, h))  # a page holds one group's layers: hit per group
                if block != NULL and self.block_hash[block] is None \
                        and key not in self.hash_to_block:
                    self.block_hash[block] = key
                    self.hash_to_block[key] = block

    # -- growing and sliding

    def can_append(self, seq: Sequence) -> bool:
        has_slot = seq.num_cached < len(seq.block_table) * self.block_size
        return has_slot or len(self.free_blocks) >= len(self.groups)

    def append_slot(self, seq: Sequence) -> None:
        if seq.num_cached == len(seq.block_table) * self.block_size:
            for group, table in zip(self.groups, seq.group_tables):
                table.append(self._hold(group))

    def before_compute(self, seq: Sequence) -> None:
        """Give back each sliding group's blocks that no token from seq.num_cached on reads
        (wholly before its window), but those a checkpoint keeps."""
        for group, table in zip(self.groups, seq.group_tables):
            if group.window is None:
                continue
            first = max(0, seq.num_cached - group.window + 1) // self.block_size
            for i in range(first):
                if table[i] != NULL and not self._kept(i, group.window):
                    self.release(table[i])
                    table[i] = NULL

    def _kept(self, i: int, window: int) -> bool:
        """Whether block i lies in the window before a checkpoint (every keep_every tokens)."""
        if not self.keep_every:
            return False
        bs, every = self.block_size, self.keep_every
        checkpoint = -(-(i + 1) * bs // every) * every  # the first ending past block i
        return max(0, checkpoint - window + 1) // bs <= i

    # -- letting go

    def free(self, seq: Sequence) -> None:
        # The tail first, every group's block at a position before the one before it: the
        # prefix, and a window kept at a checkpoint, stay on the free list longest.
        for i in reversed(range(len(seq.block_table))):
            for table in seq.group_tables:
                if table[i] != NULL:
                    self.release(table[i])
        seq.group_tables, seq.block_table, seq.num_cached = [], [], 0

    def tables(self, seq: Sequence) -> list[list[int]]:
        return seq.group_tables

    def reserve(self, seq: Sequence, n_tokens: int) -> None:
        """Pages in every group for positions 0 .. n_tokens-1 (a speculative step writes
        several); a sequence never allocated gets its tables here."""
        if not seq.group_tables:
            seq.group_tables = [[] for _ in self.groups]
            seq.block_table = seq.group_tables[0]
        while len(seq.block_table) * self.block_size < n_tokens:
            for group, table in zip(self.groups, seq.group_tables):
                table.append(self._hold(group))

    def trim(self, seq: Sequence, n_tokens: int) -> None:
        """`BlockManager.trim` in every group, once every sliding group still holds the
        window of the token at n_tokens. A speculative step's rollback always does: the
        blocks that leave the window during its drafted tokens are given back only before
        the next forward (`before_compute`), once its tokens are accepted, and a rollback
        keeps at least the tokens before that step. A deeper one is refused: those blocks
        may already hold another sequence's keys."""
        bs = self.block_size
        for group, table in zip(self.groups, seq.group_tables):
            if group.window is None or not 0 < n_tokens <= seq.num_cached:
                continue
            first = max(0, n_tokens - group.window + 1) // bs
            if NULL in table[first : self.blocks_for(n_tokens)]:
                raise RollbackError(
                    f"cannot roll back to {n_tokens} positions: the sliding layers gave back "
                    f"blocks of the window before it (positions from {first * bs:,}) when "
                    "the window moved past them; expected a rollback to the tokens of the "
                    "last forward")
        super().trim(seq, n_tokens)

    # -- figures

    def _hold(self, group: Group, block: int | None = None) -> int:
        """A page for `group`: `block` taken by reference (a hit), else a fresh one."""
        if block is None:
            block = self._take()
        else:
            self.claim(block)
        if self.refcount[block] == 1:  # newly held: counted under its group's kind
            self.page_kind[block] = group.kind
            self.in_use[group.kind] += 1
            self.peak_pages[group.kind] = max(self.peak_pages[group.kind],
                                              self.in_use[group.kind])
        return block

    def release(self, block: int) -> None:
        super().release(block)
        if self.refcount[block] == 0 and self.page_kind[block] is not None:
            self.in_use[self.page_kind[block]] -= 1
            self.page_kind[block] = None

    def tokens_stored(self, running: list[Sequence]) -> int:
        """Token slots holding a real token's K/V, over every group's pages in use (a shared
        page counted once): times a page's bytes per token, the bytes really held."""
        full, partial = set(), 0
        for seq in running:
            n_full = seq.num_cached // self.block_size
            for table in seq.group_tables:
                full.update(b for b in table[:n_full] if b != NULL)
                if len(table) > n_full:
                    partial += seq.num_cached - n_full * self.block_size
        return len(full) * self.block_size + partial
