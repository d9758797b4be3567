"""The model contract: what serving, speculative decoding, bench, eval and the breaks may ask
of any family's model and config, so none of them needs to know GPT-2 from Llama.

A family's config meets `FamilyConfig` (the shape a cache is built from, and the model's
vocabulary and context); its model derives from `FamilyModel` (one forward over new tokens
at a position with a cache, the residual stream with attention handed in, the head, a
shallower copy for self-drafting). `LoadedModel` is what every loader returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn as nn
from torch import Tensor

if TYPE_CHECKING:
    from kvcache_cli.caches.base import CacheShape, KVCache
    from kvcache_cli.models.attention import AttendFn


class FamilyConfig(Protocol):
    """The shape every family's config exposes (GPTConfig, LlamaConfig)."""

    n_layer: int
    n_head: int  # query heads
    n_embd: int  # the hidden size
    vocab_size: int
    tokenizer: str  # how text becomes ids ("gpt2", "bytes", "file:<tokenizer.json>")

    @property
    def n_kv_head(self) -> int: ...  # key/value heads (n_head for multi-head attention)

    @property
    def head_size(self) -> int: ...

    @property
    def context(self) -> int: ...  # positions the model attends over

    @property
    def cache_shape(self) -> CacheShape: ...  # all a cache is built from

    def param_count(self) -> int: ...


def merge_heads(y: Tensor) -> Tensor:
    """Attention's output (B, nh, T, hs) as the rows its output projection reads, (B, T, C)."""
    B, nh, T, hs = y.shape
    return y.transpose(1, 2).reshape(B, T, nh * hs)


class FamilyModel(nn.Module):
    """What every model family derives from its token embedding (`embedding`, which each
    family names its own way): where it runs, its activations' dtype, its size; and the
    methods each family defines, which is all that callers outside `models/` use."""

    config: FamilyConfig
    embedding: nn.Embedding
    lm_head: nn.Module

    def forward(self, idx: Tensor, start_pos: int | Tensor, cache: KVCache | None = None, *,
                last_only: bool = False, force_is_causal: bool = False) -> Tensor:
        """Logits (B, T, vocab) for tokens idx (B, T) at positions start_pos ... (an int, or
        (B,) per row), attention also reading what `cache` holds; (B, 1, vocab) with
        last_only. force_is_causal reproduces `kvcache break causal-decode`."""
        raise NotImplementedError

    def hidden(self, idx: Tensor, pos: Tensor, attend: AttendFn) -> Tensor:
        """The residual stream after every block, (B, T, C), attention's core handed in:
        how the serving engine runs any family over its own paged layout."""
        raise NotImplementedError

    def head(self, x: Tensor) -> Tensor:
        """Logits (..., vocab) of residual-stream rows (..., C)."""
        raise NotImplementedError

    def first_layers(self, n_layer: int) -> FamilyModel:
        """The first n_layer blocks, the final norm and the head, sharing these weights."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return self.embedding.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Activations' and the cache's; the products' matrices may differ (weights_format)."""
        return self.embedding.weight.dtype

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # tied weights counted once

    def checkpoint_names(self, state: dict[str, Tensor]) -> None:
        """Weights named as the model holds them renamed, in place, as its checkpoints
        name them (a family that fuses products splits them here)."""


@dataclass(frozen=True)
class LoadedModel:
    model: FamilyModel
    source: str  # "pretrained gpt2 (cached)", "checkpoint /path", "random weights (gpt2 ...)"
    note: str | None = None  # one line when `auto` fell back to random weights
