"""`PagedCache`: one pool of fixed-size blocks per layer, read through block tables.

One more `KVCache`, beside the exact `ConcatCache` and `StaticCache`. Keys and values
live in a pool allocated once (`n_blocks` blocks of `block_size` positions, every
layer); a sequence's position p sits in block block_table[p // block_size], slot
p % block_size. Which blocks a sequence owns is the `BlockManager`'s business; the
model runner hands this cache the step's block tables (`bind`) before each forward.

Attention reads a sequence's keys by gathering its blocks into one contiguous
(B, nkv, S, hs) tensor, key j at slot j, each row padded to the longest table; the
per-row mask (`Step.in_order`) hides the padding. A serving step whose rows hold
different numbers of new tokens reads the pool through a view bound to its layout
(`PackedRows`, `PaddedRows`): attention is still the cache's, the model never sees the
layout. Built from a spec
(`paged:b16`, for generate, bench and eval) it owns its blocks alone: each row gets
the blocks its longest sequence needs, in order, as a block manager would hand out.
A gather in plain torch runs on CPU and CUDA alike; it is not vLLM's fused kernel, which reads the
blocks in place (the gather copies every key once more per step).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvcache_cli.caches.base import KVCache, RollbackError, nbytes
from kvcache_cli.caches.step import Step, attend_in_order, sdpa


def block_bytes(shape, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block: K and V, every layer, block_size positions."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * shape.n_layer * block_size * shape.n_kv_head * shape.head_size * element


class PagedCache(KVCache):
    def __init__(self, shape, n_blocks: int, block_size: int, device,
                 dtype: torch.dtype):
        self.block_size = block_size
        # Heads before blocks: a gather of blocks then reads as (B, nkv, S, hs) without a
        # second copy, since one head's blocks lie back to back in the gathered tensor.
        dims = (shape.n_layer, shape.n_kv_head, n_blocks, block_size, shape.head_size)
        self.k = torch.zeros(dims, device=device, dtype=dtype)  # (L, nkv, n_blocks, bs, hs)
        self.v = torch.zeros(dims, device=device, dtype=dtype)
        self.block_tables: Tensor | None = None  # (B, max blocks), set by bind
        empty = torch.empty(0, device=device, dtype=dtype)
        self._scratch = [empty, empty]  # the gathered K and V, grown as batches grow
        self.reset()

    @classmethod
    def build(cls, spec, shape, *, max_len: int, batch: int, device, dtype, whole: bool):
        block_size = spec["block_size"]
        per_row = -(-max_len // block_size)  # blocks for max_len positions, rounded up
        cache = cls(shape, batch * per_row, block_size, device, dtype)
        rows = torch.arange(batch * per_row, device=device).view(batch, per_row)  # (B, blocks)
        cache.bind(rows)
        return cache

    def reset(self) -> None:
        # Nothing to clear: a slot is read only after its sequence wrote it.
        self.length = 0
        self.bytes_copied = 0

    def bind(self, block_tables: Tensor) -> None:
        """The block table of each row of the next forward, (B, max blocks), padded
        with any valid block id (the mask hides what padding reads)."""
        self.block_tables = block_tables

    def update(self, layer: int, start_pos: int | Tensor, k: Tensor, v: Tensor
               ) -> tuple[Tensor, Tensor]:
        B, nkv, T, hs = k.shape
        table = self.block_tables
        if table is None or table.size(-2) != B:
            raise ValueError(f"bind a block table per row first ({B} rows)")
        start = start_pos if isinstance(start_pos, Tensor) else torch.full(
            (B,), start_pos, device=k.device)  # (B,)
        positions = start[:, None] + torch.arange(T, device=k.device)  # (B, T)
        blocks = self.locate(torch.arange(B, device=k.device)[:, None], positions)  # (B, T)
        slots = positions % self.block_size  # (B, T)
        self.write(layer, blocks, slots, k.transpose(0, 1), v.transpose(0, 1))
        n = table.size(-1) * self.block_size
        keys, values = self.gather(layer)
        if isinstance(start_pos, Tensor):
            # Rows of different lengths: `length` is the padded width (reading the
            # longest row's length would wait for the device every layer).
            self.length = n
            return keys, values  # every row's own keys, padded; the mask hides the rest
        self.length = start_pos + T
        return keys[:, :, : self.length], values[:, :, : self.length]  # the filled prefix

    def locate(self, rows: Tensor, positions: Tensor) -> Tensor:
        """The pool block of each position of each row (rows and positions broadcast
        together), as `write` takes it."""
        return self.block_tables[rows, positions // self.block_size]

    def window_of(self, layer: int) -> int | None:
        """The sliding window `layer` attends over; None: every earlier position."""
        return None

    def write(self, layer: int, blocks: Tensor, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Store k, v (nkv, *idx, hs) at pool blocks `blocks` and slots `slots` (both *idx):
        one layer's keys and values of any set of tokens, each at its own slot (a
        serving step writes only its real tokens, never a padding row's)."""
        # Two adjacent advanced indices keep their place: the slots are (nkv, *idx, hs).
        self.k[layer][:, blocks, slots] = k
        self.v[layer][:, blocks, slots] = v
        self.bytes_copied += nbytes(k) + nbytes(v)

    def gather(self, layer: int) -> tuple[Tensor, Tensor]:
        """Every bound row's keys and values, (B, nkv, S, hs) with key j at slot j."""
        return self.read(layer, self.block_tables)

    def read(self, layer: int, table: Tensor) -> tuple[Tensor, Tensor]:
        """The keys and values of pool layer `layer` through `table` (B, max blocks),
        (B, nkv, S, hs) with key j at slot j."""
        return self._gather(self.k[layer], table, 0), self._gather(self.v[layer], table, 1)

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise RollbackError(f"cannot crop to {length} positions: the cache holds "
                                f"{self.length}; expected 0..{self.length}")
        # The blocks stay bound: the slots past `length` are overwritten before they are
        # read again. Returning whole tail blocks to a pool is the block manager's job.
        self.length = length

    def _gather(self, pool: Tensor, table: Tensor, which: int) -> Tensor:
        """Every row's blocks in table order, as (B, nkv, S, hs) with key j at slot j.

        Written into a scratch buffer kept across calls (one for K, one for V; a layer's
        keys are done with before the next layer gathers): a fresh multi-MB tensor per
        layer cost more in page faults than the copy itself.
        """
        nkv, n_blocks, bs, hs = pool.shape
        B, width = table.shape
        need = nkv * B * width * bs * hs
        if self._scratch[which].numel() < need:
            self._scratch[which] = torch.empty(need, device=pool.device, dtype=pool.dtype)
        rows = self._scratch[which][:need].view(nkv, B * width, bs * hs)
        # index_select over whole blocks (bs * hs contiguous values) copies at memcpy
        # speed; the same gather by advanced indexing ran 15x slower on the CPU.
        torch.index_select(pool.view(nkv, n_blocks, bs * hs), 1, table.flatten(), out=rows)
        return rows.view(nkv, B, width * bs, hs).transpose(0, 1)  # (B, nkv, S, hs)

    @property
    def bytes_held(self) -> int:
        return nbytes(self.k) + nbytes(self.v)


class PackedRows(KVCache):
    """The pool as one serving step reads it in vLLM's varlen layout: every row's new
    tokens one after another as a single sequence of N tokens, so the matmuls (most of a
    step) do exactly N rows; attention alone is per row: the one-token rows in one batched
    call, each chunk in its own. Only real tokens are written."""

    def __init__(self, pool: PagedCache, starts: list[int], lengths: list[int], pos: Tensor):
        """Rows of `lengths` new tokens from positions `starts`, bound to the pool's block
        tables; pos (N,) every packed token's position."""
        dev, bs = pos.device, pool.block_size
        self.pool, self.starts, self.lengths = pool, starts, lengths
        counts = torch.tensor(lengths, device=dev)  # (B,)
        row = torch.repeat_interleave(torch.arange(len(lengths), device=dev), counts)  # (N,)
        self.blocks = pool.locate(row, pos)  # (N,), or (groups, N) for a `HybridPool`
        self.slots = pos % bs  # (N,)
        self.offsets, n = [], 0  # where each row's tokens start in the packed sequence
        for length in lengths:
            self.offsets.append(n)
            n += length
        # Flat indices (B,) of each row's last token: the logits a step keeps (`Step.last`).
        self.last = torch.tensor([o + t - 1 for o, t in zip(self.offsets, lengths)], device=dev)
        self.singles = [b for b, t in enumerate(lengths) if t == 1]
        # The scheduler puts decodes first: rows 0 .. B1-1 are tokens 0 .. B1-1, and their
        # queries and keys are slices, not copies.
        if self.singles == list(range(len(self.singles))):
            self.single_at = self.single_rows = slice(len(self.singles))
        else:
            self.single_at = torch.tensor([self.offsets[b] for b in self.singles],
                                          device=dev)  # (B1,)
            self.single_rows = torch.tensor(self.singles, device=dev)  # (B1,)
        self.single_pos = torch.tensor([starts[b] for b in self.singles], device=dev)  # (B1,)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, step: Step) -> Tensor:
        q, k, v = q[0], k[0], v[0]  # (nh, N, hs), and (nkv, N, hs): the one packed row
        window = self.pool.window_of(layer)
        self.pool.write(layer, self.blocks, self.slots, k, v)
        keys, values = self.pool.gather(layer)  # (B, nkv, S, hs), every row's own
        y = torch.empty_like(q)  # (nh, N, hs)
        if self.singles:
            # One query a row, at position start: it may see slots 0 .. start.
            qs = q[:, self.single_at].transpose(0, 1)[:, :, None]  # (B1, nh, 1, hs)
            ys = attend_in_window(qs, keys[self.single_rows], values[self.single_rows],
                                  self.single_pos[:, None], window)  # (B1, nh, 1, hs)
            y[:, self.single_at] = ys[:, :, 0].transpose(0, 1)  # (nh, B1, hs)
        for b, (start, length) in enumerate(zip(self.starts, self.lengths)):
            if length == 1:
                continue
            end, at = start + length, self.offsets[b]  # the chunk's queries see keys 0 .. end - 1
            qc = q[None, :, at : at + length]  # (1, nh, T, hs)
            kc, vc = keys[b : b + 1, :, :end], values[b : b + 1, :, :end]  # (1, nkv, end, hs)
            pos = torch.arange(start, end, device=q.device)[None]  # (1, T): query i at start + i
            y[:, at : at + length] = attend_in_window(qc, kc, vc, pos, window)[0]
        return y[None]  # (1, nh, N, hs)


class PaddedRows(KVCache):
    """The pool as one serving step reads it in a padded (B, T) batch: every row padded to
    the longest, through one attention call under a per-row mask; the matmuls do B x T
    rows, padding included. Only real tokens write the pool, so padding never lands on a
    live slot."""

    def __init__(self, pool: PagedCache, pos: Tensor, real: Tensor):
        """pos (B, T) every token's position, padding included; real (B, T) which are not
        padding."""
        self.pool, self.real = pool, real
        rows = torch.arange(pos.size(0), device=pos.device)[:, None]  # (B, 1)
        self.blocks = pool.locate(rows, pos)[..., real]  # (N,), or (groups, N)
        self.slots = (pos % pool.block_size)[real]  # (N,)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, step: Step) -> Tensor:
        # q (B, nh, T, hs); k, v (B, nkv, T, hs), of which the real tokens are written
        self.pool.write(layer, self.blocks, self.slots, k.transpose(0, 1)[:, self.real],
                        v.transpose(0, 1)[:, self.real])  # (nkv, N, hs) each
        keys, values = self.pool.gather(layer)  # (B, nkv, S, hs)
        window = self.pool.window_of(layer)
        if window is None:
            return step.in_order(q, keys, values)
        return attend_in_window(q, keys, values, step.pos, window)


def attend_in_window(q: Tensor, k: Tensor, v: Tensor, positions: Tensor,
                     window: int | None) -> Tensor:
    """`attend_in_order` (keys in position order, each row's padded), a sliding layer's
    query at p seeing only slots p - window + 1 .. p: the slots before them may hold
    blocks the pool has taken back (read as any block, hidden here)."""
    if window is None:
        return attend_in_order(q, k, v, positions)
    slots = torch.arange(k.size(2), device=q.device)  # (S,)
    p = positions[:, :, None]  # (B|1, T, 1)
    return sdpa(q, k, v, ((slots <= p) & (slots > p - window)).unsqueeze(1))  # (B|1, 1, T, S)
