"""A step's sequences as tensors (tokens, positions, block tables) through the model.

The model never sees the scheduler: it gets token ids, the position of each row and
a `PagedCache` bound to the rows' block tables. Greedy choice, as the bench's solo
runs make, so every request can be checked against its solo generation.

Every call is the model's one forward (`FamilyModel.forward`). `prefill` and `decode` serve
the prefill-first policy with the pool itself as the cache. `step` serves decode-first,
whose one forward mixes one-token decodes with prompt chunks of hundreds: rows at
different positions with different numbers of new tokens, in one of two layouts, measured
against each other (one step of each, interleaved, GPT-2 small's shape):
- `packed` (vLLM's varlen layout): every row's tokens one after another as a single
  sequence of N tokens (`caches.paged.PackedRows`);
- `padded`: a (B, T) batch, every row padded to the longest (`caches.paged.PaddedRows`).
The runner builds the step's positions (a `Step`, with each sequence's last token) and a
view of the pool bound to the layout; the view's `attend` writes and reads the pool, for
any family, GPT-2's heads or Llama's rotated, grouped ones (the pool holds the KV heads;
SDPA expands them to the query heads).
"""

from __future__ import annotations

from collections.abc import Sequence as Seqs

import torch
from torch import Tensor

from kvcache_cli.caches.paged import PackedRows, PaddedRows, PagedCache
from kvcache_cli.caches.step import Step
from kvcache_cli.models.base import FamilyModel
from kvcache_cli.serving.scheduler import Chunk
from kvcache_cli.serving.sequence import Sequence

LAYOUTS = ("packed", "padded")


def block_tables(seqs: Seqs[Sequence], device) -> Tensor:
    """The rows' block tables as the pool binds them, each padded to the longest."""
    width = max(len(s.block_table) for s in seqs)
    if seqs[0].group_tables:  # a hybrid pool: a table per group
        # A block given back (NULL) reads block 0, outside every query's window.
        groups = [[[max(b, 0) for b in s.group_tables[g]] + [0] * (width - len(
            s.group_tables[g])) for s in seqs] for g in range(len(seqs[0].group_tables))]
        return torch.tensor(groups, dtype=torch.long, device=device)  # (groups, B, max blocks)
    # Padding with block 0 is safe: the mask hides whatever it holds.
    rows = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
    return torch.tensor(rows, dtype=torch.long, device=device)  # (B, max blocks)


class ModelRunner:
    def __init__(self, model: FamilyModel, cache: PagedCache, layout: str = "packed"):
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; valid layouts: {', '.join(LAYOUTS)}")
        self.model, self.cache, self.layout = model, cache, layout
        self.device = model.device

    @torch.inference_mode()
    def prefill(self, seq: Sequence) -> int:
        """Compute every token past the cached prefix; the next token's id."""
        idx = torch.tensor([seq.tokens[seq.num_cached :]], device=self.device)  # (1, T)
        self.cache.bind(block_tables([seq], self.device))
        logits = self.model(idx, seq.num_cached, self.cache, last_only=True)  # (1, 1, vocab)
        seq.num_cached = len(seq.tokens)
        return int(logits[0, -1].argmax())

    @torch.inference_mode()
    def decode(self, seqs: tuple[Sequence, ...]) -> list[int]:
        """One token for every row, each at its own position; the next token ids."""
        idx = torch.tensor([[s.tokens[-1]] for s in seqs], device=self.device)  # (B, 1)
        start = torch.tensor([s.num_cached for s in seqs], device=self.device)  # (B,)
        self.cache.bind(block_tables(seqs, self.device))
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
        self.cache.bind(block_tables([c.seq for c in chunks], self.device))
        forward = self._packed if self.layout == "packed" else self._padded
        logits = forward(chunks)  # (B, vocab): each row's last token
        for c in chunks:
            c.seq.num_cached = c.start + c.length
        ids = logits.argmax(dim=-1).tolist()
        return [i if c.samples else None for c, i in zip(chunks, ids, strict=True)]

    def _packed(self, chunks: Seqs[Chunk]) -> Tensor:
        tokens = [t for c in chunks for t in c.seq.tokens[c.start : c.start + c.length]]
        positions = [p for c in chunks for p in range(c.start, c.start + c.length)]
        idx = torch.tensor([tokens], device=self.device)  # (1, N)
        pos = torch.tensor([positions], device=self.device)  # (1, N)
        view = PackedRows(self.cache, [c.start for c in chunks], [c.length for c in chunks],
                          pos[0])
        step = Step(pos[:, 0], pos, view.last)
        return self.model(idx, step, view, last_only=True)[:, -1]  # (B, vocab)

    def _padded(self, chunks: Seqs[Chunk]) -> Tensor:
        dev = self.device
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
        last = torch.arange(B, device=dev) * T + lengths - 1  # (B,) flat indices
        view = PaddedRows(self.cache, pos, real)
        return self.model(idx, Step(start, pos, last), view, last_only=True)[:, -1]  # (B, vocab)
