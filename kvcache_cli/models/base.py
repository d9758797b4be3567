"""The model contract: what serving, speculative decoding, bench, eval and the breaks may ask
of any family's model and config, so none of them needs to know GPT-2 from Llama.

A family's config meets `FamilyConfig` (the shape a cache is built from, and the model's
vocabulary and context); its model derives from `FamilyModel` (one forward over new tokens
where a `Step` puts them, with a cache; a shallower copy for self-drafting). Every layer's
attention is `cache.attend(layer, q, k, v, step)` (`caches.base.KVCache`), or with no cache
plain causal attention (`causal_attention`). `LoadedModel` is what every loader returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from kvcache_cli.caches.base import CacheShape, KVCache
    from kvcache_cli.caches.step import Step


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


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Attention (B, nh, T, hs) of a whole sequence with no cache (the naive loop): q
    (B, nh, T, hs) over its own k, v (B, nkv, T, hs) under the causal mask."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                          enable_gqa=k.size(1) < q.size(1))


def heads(qkv: Tensor, first: int, count: int, hs: int) -> Tensor:
    """Heads first to first + count - 1 of a q|k|v product's rows qkv (B, T, H * hs), last
    axis contiguous, as attention takes them, (B, count, T, hs): one view op, where a view
    to heads, a transpose and a slice are three (two with an as_strided of their own)."""
    if torch.compiler.is_compiling():  # a graph has no dispatch to save (nor storage_offset)
        return qkv.unflatten(-1, (-1, hs)).transpose(1, 2)[:, first:first + count]
    B, T, _ = qkv.shape
    sB, sT, _ = qkv.stride()
    return qkv.as_strided((B, count, T, hs), (sB, hs, sT, 1), qkv.storage_offset() + first * hs)


def merge_heads(y: Tensor) -> Tensor:
    """Attention's output (B, nh, T, hs) as the rows its output projection reads, (B, T, C):
    a decode's one token, contiguous, is already those rows (one view op, not a transpose
    and a reshape)."""
    B, nh, T, hs = y.shape
    if T == 1 and y.is_contiguous():
        return y.view(B, T, nh * hs)
    return y.transpose(1, 2).reshape(B, T, nh * hs)


class FamilyModel(nn.Module):
    """What every model family derives from its token embedding (`embedding`, which each
    family names its own way): where it runs, its activations' dtype, its size; and the
    methods each family defines, which is all that callers outside `models/` use."""

    config: FamilyConfig
    embedding: nn.Embedding
    lm_head: nn.Module

    def forward(self, idx: Tensor, step: int | Tensor | Step, cache: KVCache | None = None,
                *, last_only: bool = False) -> Tensor:
        """Logits (B, T, vocab) for tokens idx (B, T) where `step` puts them: the first
        one's position (an int, or (B,) per row), or a `Step` a caller built (serve's
        layouts, a compiled step); every layer's attention is `cache.attend`, which also
        reads what the cache holds. With last_only, each sequence's last token's logits,
        (B, 1, vocab). The one route for generate, serve, speculative verification, eval
        and the compiled step."""
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
        """The model's parameters, a tied head counted once: its config's count, since a
        product stored in another format (int8, q4, a GGUF's blocks) holds buffers, not
        parameters, and would drop out of a count of `parameters()`."""
        return self.config.param_count()

    def checkpoint_names(self, state: dict[str, Tensor]) -> None:
        """Weights named as the model holds them renamed, in place, as its checkpoints
        name them (a family that fuses products splits them here)."""


@dataclass(frozen=True)
class LoadedModel:
    model: FamilyModel
    source: str  # "pretrained gpt2 (cached)", "checkpoint /path", "random weights (gpt2 ...)"
    note: str | None = None  # one line when `auto` fell back to random weights
