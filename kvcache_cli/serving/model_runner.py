"""A step's sequences as tensors (tokens, positions, block tables) through the model.

The model never sees the scheduler: it gets token ids, the position of each row and
a `PagedCache` bound to the rows' block tables. Greedy choice, as the bench's solo
runs make, so every request can be checked against its solo generation.

`prefill` and `decode` serve the prefill-first policy through `FamilyModel.forward`. `step`
serves decode-first, whose one forward mixes one-token decodes with prompt chunks of
hundreds: rows at different positions with different numbers of new tokens. Two
layouts, measured against each other (one step of each, interleaved, GPT-2 small's shape):
- `packed` (vLLM's varlen layout): every row's tokens one after another as a single
  sequence of N tokens, so the matmuls (most of a step) do exactly N rows; attention
  alone is per row: the one-token rows in one batched call, each chunk in its own;
- `padded`: a (B, T) batch, every row padded to the longest, through one attention
  call under a per-row mask; the matmuls do B x T rows, padding included.
Both run the model's own layers through its `hidden` (`FamilyModel.forward` takes rows of one
length), which hands each layer's q, k, v to the runner's attention: any family, GPT-2's
heads or Llama's rotated, grouped ones (the pool holds the KV heads; SDPA expands them to
the query heads). Only real tokens write the cache, so padding never lands on a live slot.
"""

from __future__ import annotations

from collections.abc import Sequence as Seqs

import torch
from torch import Tensor

from kvcache_cli.caches.paged import PagedCache
from kvcache_cli.models.attention import AttendFn, attend_in_order
from kvcache_cli.models.base import FamilyModel
from kvcache_cli.serving.scheduler import Chunk
from kvcache_cli.serving.sequence import Sequence

LAYOUTS = ("packed", "padded")


class ModelRunner:
    def __init__(self, model: FamilyModel, cache: PagedCache, layout: str = "packed"):
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; valid layouts: {', '.join(LAYOUTS)}")
        self.model, self.cache, self.layout = model, cache, layout
        self.device = model.device

    def _tables(self, seqs: Seqs[Sequence]) -> Tensor:
        width = max(len(s.block_table) for s in seqs)
        # Padding with block 0 is safe: the mask hides whatever it holds.
        rows = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
        return torch.tensor(rows, dtype=torch.long, device=self.device)  # (B, max blocks)

    @torch.inference_mode()
    def prefill(self, seq: Sequence) -> int:
        """Compute every token past the cached prefix; the next token's id."""
        idx = torch.tensor([seq.tokens[seq.num_cached :]], device=self.device)  # (1, T)
        self.cache.bind(self._tables([seq]))
        logits = self.model(idx, seq.num_cached, self.cache, last_only=True)  # (1, 1, vocab)
        seq.num_cached = len(seq.tokens)
        return int(logits[0, -1].argmax())

    @torch.inference_mode()
    def decode(self, seqs: tuple[Sequence, ...]) -> list[int]:
        """One token for every row, each at its own position; the next token ids."""
        idx = torch.tensor([[s.tokens[-1]] for s in seqs], device=self.device)  # (B, 1)
        start = torch.tensor([s.num_cached for s in seqs], device=self.device)  # (B,)
        self.cache.bind(self._tables(seqs))
        logits = self.model(idx, start, self.cache, last_only=True)  # (B, 1, vocab)
        for s in seqs:
            s.num_cached += 1
        return logits[:, -1].argmax(dim=-1).tolist()

    @torch.inference_mode()
    def step(self, chunks: Seqs[Chunk]) -> list[int | None]:
        """Every chunk in one forward; per chunk the next token's id where the chunk
        reaches its sequence's last token (a decode, a prompt's last chunk), else None."""
        if not chunks:
            return []
        self.cache.bind(self._tables([c.seq for c in chunks]))
        forward = self._packed if self.layout == "packed" else self._padded
        logits = forward(chunks)  # (B, vocab): each row's last token
        for c in chunks:
            c.seq.num_cached = c.start + c.length
        ids = logits.argmax(dim=-1).tolist()
        return [i if c.samples else None for c, i in zip(chunks, ids, strict=True)]

    def _run(self, idx: Tensor, pos: Tensor, attend: AttendFn, last: Tensor) -> Tensor:
        """The model over idx at positions pos, attention by `attend`; the logits
        (B, vocab) of the flat token indices `last`."""
        x = self.model.hidden(idx, pos, attend)  # (R, T, C)
        return self.model.head(x.flatten(0, 1)[last])  # (B, vocab)

    def _packed(self, chunks: Seqs[Chunk]) -> Tensor:
        dev, bs = self.device, self.cache.block_size
        tokens = [t for c in chunks for t in c.seq.tokens[c.start : c.start + c.length]]
        positions = [p for c in chunks for p in range(c.start, c.start + c.length)]
        idx = torch.tensor([tokens], device=dev)  # (1, N)
        pos = torch.tensor([positions], device=dev)  # (1, N)
        lengths = torch.tensor([c.length for c in chunks], device=dev)  # (B,)
        row = torch.repeat_interleave(torch.arange(len(chunks), device=dev), lengths)  # (N,)
        blocks = self.cache.block_tables[row, pos[0] // bs]  # (N,)
        slots = pos[0] % bs  # (N,)
        offsets, n = [], 0  # where each row's tokens start in the packed sequence
        for c in chunks:
            offsets.append(n)
            n += c.length
        singles = [b for b, c in enumerate(chunks) if c.length == 1]
        # The scheduler puts decodes first: rows 0 .. B1-1 are tokens 0 .. B1-1, and their
        # queries and keys are slices, not copies.
        if singles == list(range(len(singles))):
            single_at = single_rows = slice(len(singles))
        else:
            single_at = torch.tensor([offsets[b] for b in singles], device=dev)  # (B1,)
            single_rows = torch.tensor(singles, device=dev)  # (B1,)
        single_pos = torch.tensor([chunks[b].start for b in singles], device=dev)  # (B1,)

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            q, k, v = q[0], k[0], v[0]  # (nh, N, hs), and (nkv, N, hs): the one packed row
            self.cache.write(layer, blocks, slots, k, v)
            keys, values = self.cache.gather(layer)  # (B, nkv, S, hs), every row's own
            y = torch.empty_like(q)  # (nh, N, hs)
            if singles:
                # One query a row, at position start: it may see slots 0 .. start.
                qs = q[:, single_at].transpose(0, 1)[:, :, None]  # (B1, nh, 1, hs)
                ys = attend_in_order(qs, keys[single_rows], values[single_rows],
                                     single_pos[:, None])  # (B1, nh, 1, hs)
                y[:, single_at] = ys[:, :, 0].transpose(0, 1)  # (nh, B1, hs)
            for b, c in enumerate(chunks):
                if c.length == 1:
                    continue
                end = c.start + c.length  # the chunk's queries see keys 0 .. end - 1
                qc = q[None, :, offsets[b] : offsets[b] + c.length]  # (1, nh, T, hs)
                kc, vc = keys[b : b + 1, :, :end], values[b : b + 1, :, :end]  # (1, nkv, end, hs)
                at = torch.arange(c.start, end, device=dev)[None]  # (1, T): query i at start + i
                y[:, offsets[b] : offsets[b] + c.length] = attend_in_order(qc, kc, vc, at)[0]
            return y[None]  # (1, nh, N, hs)

        last = torch.tensor([o + c.length - 1 for o, c in zip(offsets, chunks)], device=dev)
        return self._run(idx, pos, attend, last)

    def _padded(self, chunks: Seqs[Chunk]) -> Tensor:
        dev, bs = self.device, self.cache.block_size
        B, T = len(chunks), max(c.length for c in chunks)
        # Padding repeats a row's last token at its last position: a valid embedding
        # whose output is dropped and whose keys are never written.
        idx = torch.tensor([c.seq.tokens[c.start : c.start + c.length]
                            + [c.seq.tokens[c.start + c.length - 1]] * (T - c.length)
                            for c in chunks], device=dev)  # (B, T)
        start = torch.tensor([c.start for c in chunks], device=dev)  # (B,)
        lengths = torch.tensor([c.length for c in chunks], device=dev)  # (B,)
        steps = torch.arange(T, device=dev)  # (T,)
        real = steps < lengths[:, None]  # (B, T)
        pos = start[:, None] + torch.minimum(steps, lengths[:, None] - 1)  # (B, T)
        blocks = self.cache.block_tables.gather(1, pos // bs)[real]  # (N,)
        slots = (pos % bs)[real]  # (N,)

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            # q (B, nh, T, hs); k, v (B, nkv, T, hs), of which the real tokens are written
            self.cache.write(layer, blocks, slots, k.transpose(0, 1)[:, real],
                             v.transpose(0, 1)[:, real])  # (nkv, N, hs) each
            keys, values = self.cache.gather(layer)  # (B, nkv, S, hs)
            return attend_in_order(q, keys, values, pos)

        last = torch.arange(B, device=dev) * T + lengths - 1  # (B,) flat indices
        return self._run(idx, pos, attend, last)
