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

The gather copies every key once more a layer and step. A row of one new token (a decode
step through `PagedCache.attend`, for generate, bench, eval and serve's prefill-first; a
`PackedRows` or `PaddedRows` one-token row) reads its blocks in place instead, as vLLM's
paged attention does (`attend_in_place`, shared by all three): a C++ kernel
(`paged_attention.cpp`, built at first use by `caches.native`) walks each row's block table
straight through the pool, on the CPU, for float32 queries over a float32, float16 or
bfloat16 pool; only the prompt chunks' rows are gathered. Elsewhere (CUDA, no compiler, a
quantised pool, `KVCACHE_PAGED_ATTENTION=torch` to time one against the other) every row is
gathered, in plain torch.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

from kvcache_cli.caches import native
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
        self._decode = None  # `_decoding`'s: (the step, its blocks, slots and rows)

    def bind(self, block_tables: Tensor) -> None:
        """The block table of each row of the next forward, (B, max blocks), padded
        with any valid block id (the mask hides what padding reads)."""
        self.block_tables = block_tables
        self._decode = None

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, step: Step) -> Tensor:
        """`KVCache.attend`, a sliding layer's window kept (`window_of`); a decode step (one
        new token a row) reads each row's blocks in place (`attend_in_place`) where the kernel
        runs, every key gathered elsewhere."""
        if q.size(2) == 1 and reads_in_place(self, q):
            blocks, slots, decode = self._decoding(step, q.size(0))
            self.write(layer, blocks, slots, k.transpose(0, 1), v.transpose(0, 1))
            self._grown(step.start, 1)
            y = torch.empty_like(q)  # (B, nh, 1, hs)
            attend_in_place(self, layer, q[:, :, 0].transpose(0, 1), *decode,
                            y[:, :, 0].transpose(0, 1))  # both (nh, B, hs) views
            return y
        keys, values = self.update(layer, step.start, k, v)  # (B, nkv, S, hs), key j at j
        window = self.window_of(layer)
        if window is None:
            return step.in_order(q, keys, values)
        pos = step.pos if step.pos.dim() == 2 else step.pos[None]  # (B|1, T)
        return attend_in_window(q, keys, values, pos, window)

    def update(self, layer: int, start_pos: int | Tensor, k: Tensor, v: Tensor
               ) -> tuple[Tensor, Tensor]:
        B, nkv, T, hs = k.shape
        blocks, slots = self._where(start_pos, B, T, k.device)
        self.write(layer, blocks, slots, k.transpose(0, 1), v.transpose(0, 1))
        keys, values = self.gather(layer)
        if self._grown(start_pos, T):
            return keys, values  # every row's own keys, padded; the mask hides the rest
        return keys[:, :, : self.length], values[:, :, : self.length]  # the filled prefix

    def _where(self, start_pos: int | Tensor, B: int, T: int, device) -> tuple[Tensor, Tensor]:
        """The pool blocks and slots (B, T) of T new tokens a row from start_pos."""
        table = self.block_tables
        if table is None or table.size(-2) != B:
            raise ValueError(f"bind a block table per row first ({B} rows)")
        start = start_pos if isinstance(start_pos, Tensor) else torch.full(
            (B,), start_pos, device=device)  # (B,)
        positions = start[:, None] + torch.arange(T, device=device)  # (B, T)
        blocks = self.locate(torch.arange(B, device=device)[:, None], positions)  # (B, T)
        return blocks, positions % self.block_size

    def _grown(self, start_pos: int | Tensor, T: int) -> bool:
        """Set `length` after T new tokens a row from start_pos; whether the rows were at
        different positions (`length` then the padded width: reading the longest row's
        length would wait for the device every layer)."""
        if isinstance(start_pos, Tensor):
            self.length = self.block_tables.size(-1) * self.block_size
            return True
        self.length = start_pos + T
        return False

    def _decoding(self, step: Step, B: int) -> tuple[Tensor, Tensor, tuple]:
        """A decode step's blocks and slots (B, 1) and `attend_in_place`'s rows, positions
        and first slots: made at its first layer, the same for every other."""
        if self._decode is None or self._decode[0] is not step:
            blocks, slots = self._where(step.start, B, 1, step.pos.device)
            last = step.pos.reshape(-1).expand(B) if step.pos.dim() == 1 else step.pos[:, 0]
            self._decode = step, (blocks, slots, (slice(None), last.contiguous(), {}))
        return self._decode[1]

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
        return self.read(*self.pages(layer))

    def pages(self, layer: int) -> tuple[int, Tensor]:
        """The pool layer holding model layer `layer`, and the block tables it is read
        through, (B, max blocks)."""
        return layer, self.block_tables

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
    step) do exactly N rows; attention alone is per row: the one-token rows in one call
    (`attend_paged`, over their blocks in place, where it runs), each chunk in its own
    (gathered, SDPA). Only real tokens are written."""

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
        self._first: dict[int | None, Tensor] = {}  # `attend_in_place`'s, by window
        self.chunks = [b for b, t in enumerate(lengths) if t > 1]  # the prompt chunks' rows
        self.chunk_rows = torch.tensor(self.chunks, device=dev, dtype=torch.long)  # (B2,)
        self.chunk_width = max((-(-(starts[b] + lengths[b]) // bs) for b in self.chunks),
                               default=0)  # the blocks the longest chunk row reads

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, step: Step) -> Tensor:
        q, k, v = q[0], k[0], v[0]  # (nh, N, hs), and (nkv, N, hs): the one packed row
        window = self.pool.window_of(layer)
        self.pool.write(layer, self.blocks, self.slots, k, v)
        j, table = self.pool.pages(layer)  # the pool layer, (B, max blocks)
        y = torch.empty_like(q)  # (nh, N, hs)
        in_place = bool(self.singles) and reads_in_place(self.pool, q)
        if in_place:
            ys = y[:, self.single_at] if isinstance(self.single_at, slice) else \
                q.new_empty(q.size(0), len(self.singles), q.size(2))  # (nh, B1, hs)
            attend_in_place(self.pool, layer, q[:, self.single_at], self.single_rows,
                            self.single_pos, self._first, ys)
            if not isinstance(self.single_at, slice):
                y[:, self.single_at] = ys
        if self.chunks or not in_place:
            # SDPA's rows gathered: the chunks' alone, as wide as the longest needs; or all
            keys, values = self.pool.read(j, table[self.chunk_rows, : self.chunk_width]
                                          if in_place else table)  # (B2|B, nkv, S, hs)
        if self.singles and not in_place:
            # One query a row, at position start: it may see slots 0 .. start.
            qs = q[:, self.single_at].transpose(0, 1)[:, :, None]  # (B1, nh, 1, hs)
            ys = attend_in_window(qs, keys[self.single_rows], values[self.single_rows],
                                  self.single_pos[:, None], window)  # (B1, nh, 1, hs)
            y[:, self.single_at] = ys[:, :, 0].transpose(0, 1)  # (nh, B1, hs)
        for i, b in enumerate(self.chunks):
            start, length, at = self.starts[b], self.lengths[b], self.offsets[b]
            end, r = start + length, i if in_place else b  # the chunk sees keys 0 .. end - 1
            qc = q[None, :, at : at + length]  # (1, nh, T, hs)
            kc, vc = keys[r : r + 1, :, :end], values[r : r + 1, :, :end]  # (1, nkv, end, hs)
            pos = torch.arange(start, end, device=q.device)[None]  # (1, T): query i at start + i
            y[:, at : at + length] = attend_in_window(qc, kc, vc, pos, window)[0]
        return y[None]  # (1, nh, N, hs)


class PaddedRows(KVCache):
    """The pool as one serving step reads it in a padded (B, T) batch: every row padded to
    the longest, through one attention call under a per-row mask; the matmuls do B x T
    rows, padding included. Only real tokens write the pool, so padding never lands on a
    live slot. A row of one real token (a decode) reads its blocks in place where the
    kernel runs (`attend_in_place`), the others gathered."""

    def __init__(self, pool: PagedCache, pos: Tensor, real: Tensor):
        """pos (B, T) every token's position, padding included; real (B, T) which are not
        padding (a row's first tokens)."""
        self.pool, self.real = pool, real
        dev = pos.device
        rows = torch.arange(pos.size(0), device=dev)[:, None]  # (B, 1)
        self.blocks = pool.locate(rows, pos)[..., real]  # (N,), or (groups, N)
        self.slots = (pos % pool.block_size)[real]  # (N,)
        counts = real.sum(1).tolist()
        singles = [b for b, n in enumerate(counts) if n == 1]
        self.n_singles = len(singles)
        self.singles = slice(len(singles)) if singles == list(range(len(singles))) else \
            torch.tensor(singles, device=dev, dtype=torch.long)  # (B1,)
        self.single_pos = pos[self.singles, 0].contiguous()  # (B1,)
        self.chunks = torch.tensor([b for b, n in enumerate(counts) if n > 1], device=dev,
                                   dtype=torch.long)  # (B2,)
        self._first: dict[int | None, Tensor] = {}  # `attend_in_place`'s, by window

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, step: Step) -> Tensor:
        # q (B, nh, T, hs); k, v (B, nkv, T, hs), of which the real tokens are written
        self.pool.write(layer, self.blocks, self.slots, k.transpose(0, 1)[:, self.real],
                        v.transpose(0, 1)[:, self.real])  # (nkv, N, hs) each
        window = self.pool.window_of(layer)
        if not (self.n_singles and reads_in_place(self.pool, q)):
            keys, values = self.pool.gather(layer)  # (B, nkv, S, hs)
            return attend_in_window(q, keys, values, step.pos, window)
        y = torch.empty_like(q)  # (B, nh, T, hs)
        ys = q.new_empty(q.size(1), self.n_singles, q.size(3))  # (nh, B1, hs)
        attend_in_place(self.pool, layer, q[self.singles, :, 0].transpose(0, 1), self.singles,
                        self.single_pos, self._first, ys)
        # A decode's padding repeats its token at its position: the same output.
        y[self.singles] = ys.transpose(0, 1)[:, :, None]  # (B1, nh, T, hs)
        if self.chunks.numel():
            j, table = self.pool.pages(layer)
            keys, values = self.pool.read(j, table[self.chunks])  # (B2, nkv, S, hs)
            y[self.chunks] = attend_in_window(q[self.chunks], keys, values,
                                              step.pos[self.chunks], window)
        return y


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


SOURCE = Path(__file__).with_name("paged_attention.cpp")
# The pool dtypes the kernel reads, by the flag it takes.
POOL_FLAGS = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


@cache
def kernel() -> ctypes.CDLL | None:
    """The built kernel, or None where it cannot be built here (every row then gathered)."""
    return load()[0]


def load(defines: tuple[str, ...] = ()) -> tuple[ctypes.CDLL | None, str | None]:
    """(the kernel built with `defines`, None), or (None, why not).
    `-DCODE_ATTENTION_SCALAR` builds its plain loops, which a CPU without AVX2 runs,
    `-DCODE_ATTENTION_AVX2` AVX2's lanes on an AVX-512 CPU."""
    lib, why = native.build(SOURCE, off="KVCACHE_PAGED_ATTENTION", defines=defines)
    if lib is None:
        return None, why
    lib.attend_paged.restype = ctypes.c_int
    lib.attend_paged.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 2 + \
        [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 6 + [ctypes.c_void_p] + \
        [ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + \
        [ctypes.c_void_p] + [ctypes.c_int64] * 2
    return lib, None


def reads_in_place(pool: PagedCache, q: Tensor) -> bool:
    """Whether `attend_paged` reads this pool for these queries: float32 queries on the CPU,
    a float32/float16/bfloat16 pool (not a quantised one's codes), the kernel built."""
    return q.device.type == "cpu" and q.dtype == torch.float32 and \
        pool.k.dtype in POOL_FLAGS and kernel() is not None


def attend_in_place(pool: PagedCache, layer: int, q: Tensor, rows: slice | Tensor,
                    last: Tensor, firsts: dict, out: Tensor) -> None:
    """Model layer `layer`'s attention for one query a row over the row's blocks in place
    (`attend_paged`), into out (nh, B1, hs): queries q (nh, B1, hs) of the bound rows `rows`
    (a slice or (B1,)) at positions last (B1,), each seeing slots 0 .. last, or a sliding
    layer's window. `firsts` keeps each window's first slots (B1,), made once a step."""
    j, table = pool.pages(layer)  # the pool layer, (B, max blocks)
    window = pool.window_of(layer)
    if window not in firsts:
        firsts[window] = torch.zeros_like(last) if window is None else \
            (last - window + 1).clamp(min=0)
    attend_paged(q, pool.k[j], pool.v[j], table[rows], firsts[window], last, out)


def attend_paged(q: Tensor, k: Tensor, v: Tensor, table: Tensor, first: Tensor, last: Tensor,
                 out: Tensor) -> None:
    """One query a row, each over its own blocks in place, into out (nh, B1, hs): queries q
    (nh, B1, hs) float32, scaled by 1 / sqrt(hs) here as SDPA does; k, v one pool layer
    (nkv, n_blocks, bs, hs); table (B1, max blocks) block ids; row r sees slots first[r] ..
    last[r] (B1,). GQA: query head i reads KV head i // (nh / nkv)."""
    nh, rows, hs = q.shape
    nkv, n_blocks, bs, _ = k.shape
    q = q if q.stride(-1) == 1 else q.contiguous()
    table = table.contiguous()  # (B1, width): row r at r * width
    assert k.is_contiguous() and v.is_contiguous() and v.dtype == k.dtype, (k.stride(), v.dtype)
    assert out.stride(-1) == 1 and first.dtype == last.dtype == table.dtype == torch.long
    status = kernel().attend_paged(
        q.data_ptr(), q.stride(1), q.stride(0), k.data_ptr(), v.data_ptr(), POOL_FLAGS[k.dtype],
        n_blocks, bs, nkv, hs, nh // nkv, table.data_ptr(), table.size(1), first.data_ptr(),
        last.data_ptr(), rows, torch.get_num_threads(), out.data_ptr(), out.stride(1),
        out.stride(0))
    if status:
        raise ValueError("paged attention: a row's slots run past its block table, or a "
                         f"block id lies outside the pool's {n_blocks} blocks")
