"""A step's sequences as tensors (tokens, positions, block tables) through the model.

The model never sees the scheduler: it gets token ids, the position of each row and
a `PagedCache` bound to the rows' block tables. Greedy choice, as the bench's solo
runs make, so every request can be checked against its solo generation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvcache_cli.caches.paged import PagedCache
from kvcache_cli.gpt2 import GPT
from kvcache_cli.serving.sequence import Sequence


class ModelRunner:
    def __init__(self, model: GPT, cache: PagedCache):
        self.model, self.cache = model, cache
        self.device = model.device

    def _tables(self, seqs: tuple[Sequence, ...] | list[Sequence]) -> Tensor:
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
