"""The cached attention every family calls: GPT-2's, Llama's, and the serving engine's masks.

A family projects its queries, keys and values and applies its positions (GPT-2 adds them
to the input; Llama rotates q and k); from there attention is the same for all of them:

1. the cache stores this call's keys and values and hands back what to attend over,
   (B, nkv, S, hs): under grouped-query attention the cache holds the KV heads only,
   so SmolLM2's cache is a third of what its 9 query heads would take;
2. the mask comes from the positions the cache's keys hold (`key_positions`), its window
   and its sinks, never from slot numbers;
3. KV heads meet their query heads only here, after the cache: query head h reads KV head
   h // (nh / nkv), the blocked grouping Llama was trained with (transformers' repeat_kv);
4. a cache that ranks keys by the attention they draw receives the weights folded onto
   its KV heads: the mean over the query heads that share each one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from kvcache_cli.caches.base import KVCache

# Attention's core as a family's `hidden` calls it: (layer, q (B, nh, T, hs), k and v
# (B, nkv, T, hs)) -> the output (B, nh, T, hs). The serving engine passes its own.
AttendFn = Callable[[int, Tensor, Tensor, Tensor], Tensor]


def cached_attention(q: Tensor, k: Tensor, v: Tensor, layer: int, start_pos: int | Tensor,
                     cache: KVCache | None, force_is_causal: bool = False) -> Tensor:
    """Attention output (B, nh, T, hs) for queries q (B, nh, T, hs) and this call's keys
    and values k, v (B, nkv, T, hs), at positions start_pos ... (an int, or (B,) per row).

    `force_is_causal` exists only for the article's bug 2 (`kvcache break causal-decode`).
    """
    B, nh, T, hs = q.shape
    if cache is not None and not cache.wants_attention and not force_is_causal:
        y = cache.attend(layer, start_pos, q, k, v)  # a cache's own reading of its store
        if y is not None:
            return y  # (B, nh, T, hs)
    if cache is not None:
        k, v = cache.update(layer, start_pos, k, v)  # (B, nkv, S, hs), ours included
    nkv, S = k.size(1), k.size(2)
    mask, is_causal = attention_mask(start_pos, T, S, cache, layer, q.device, force_is_causal)
    if cache is not None and cache.wants_attention:
        # SDPA never returns its weights: an eviction policy that ranks keys by the
        # attention they draw pays for the scores written out and a softmax of its own.
        g = nh // nkv
        qg = q.view(B, nkv, g, T, hs)  # (B, nkv, g, T, hs): each KV head's query heads
        scores = (qg @ k[:, :, None].transpose(-2, -1)) / math.sqrt(hs)  # (B, nkv, g, T, S)
        if mask is not None:
            # (B|1, nkv|1, T, S), or (T, S): one more axis for the group
            scores = scores.masked_fill(~(mask[:, :, None] if mask.dim() == 4 else mask),
                                        float("-inf"))
        weights = scores.softmax(dim=-1)  # (B, nkv, g, T, S)
        cache.observe(layer, weights.mean(dim=2))  # (B, nkv, T, S)
        return (weights @ v[:, :, None]).view(B, nh, T, hs)  # (B, nh, T, hs)
    if mask is not None and mask.dim() == 4 and mask.size(1) == nkv < nh:
        mask = mask.repeat_interleave(nh // nkv, dim=1)  # (B, nh, T, S): per query head
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                          enable_gqa=nkv < nh)


def attention_mask(start_pos: int | Tensor, T: int, S: int, cache: KVCache | None, layer: int,
                   device, force_is_causal: bool = False) -> tuple[Tensor | None, bool]:
    """(boolean mask, is_causal) for T queries from start_pos against S keys: True where a
    query may attend. None with is_causal=False means every key is visible."""
    held = cache.key_positions(layer) if cache is not None else None
    if held is not None:
        # Keys out of order (a ring, kept sinks, evictions): the query at position p
        # sees exactly the keys holding positions 0..p; -1 marks an empty slot.
        if isinstance(start_pos, Tensor):
            positions = start_pos[:, None] + torch.arange(T, device=device)  # (B, T)
        else:
            positions = (start_pos + torch.arange(T, device=device))[None]  # (1, T)
        if held.dim() == 1:  # (S,): the same for every row and head
            held = held[None, None]
        elif held.dim() == 2:  # (B, S): per row
            held = held[:, None]
        keys = held[:, :, None, :]  # (B|1, nkv|1, 1, S)
        query = positions[:, None, :, None]  # (B|1, 1, T, 1)
        visible = (keys >= 0) & (keys <= query)  # (B, nkv, T, S)
        if cache.window is not None:  # a band: the window, and the sinks before it
            visible &= (keys > query - cache.window) | (keys < cache.sinks)
        return visible, False
    if isinstance(start_pos, Tensor):
        # Rows at different positions: the cache returns key j at slot j of every
        # row, padded to the longest, and query i of row b sits at start_pos[b] + i,
        # so it may see exactly the keys at slots 0 .. start_pos[b] + i.
        positions = start_pos[:, None] + torch.arange(T, device=device)  # (B, T)
        slots = torch.arange(S, device=device)  # (S,)
        return (slots <= positions[:, :, None]).unsqueeze(1), False  # (B, 1, T, S)
    if cache is not None and cache.whole:
        # Every slot of the buffer: query i sits at start_pos + i and may see slots
        # 0 .. start_pos + i; the rest are not written yet, or hold an older request.
        positions = start_pos + torch.arange(T, device=device)  # (T,)
        return torch.arange(S, device=device) <= positions[:, None], False  # (T, S)
    if T == S or force_is_causal:
        # Square scores: the ordinary causal mask. SDPA aligns is_causal to the top
        # left, so forced onto a one-row query against S keys (the article's bug 2)
        # it lets the newest token see key 0 and nothing else.
        if cache is not None and cache.wants_attention:  # no SDPA to apply it
            return torch.ones(T, S, dtype=torch.bool, device=device).tril(), False
        return None, True
    if T > 1:
        # T new tokens after S - T cached ones: query i sits at position S - T + i
        # and may see keys 0 .. S - T + i (the mask aligned bottom right).
        return torch.ones(T, S, dtype=torch.bool, device=device).tril(S - T), False
    return None, False  # one query, the newest token: every cached key is in its past


def attend_in_order(q: Tensor, k: Tensor, v: Tensor, positions: Tensor) -> Tensor:
    """Attention (B, nh, T, hs) for queries q (B, nh, T, hs) at `positions` (B, T) over
    keys and values (B, nkv, S, hs) held in position order, key j at slot j: the query at
    position p sees slots 0 .. p. How a paged pool, gathered per row, is read."""
    slots = torch.arange(k.size(2), device=q.device)  # (S,)
    mask = slots <= positions[:, :, None]  # (B, T, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None],
                                          enable_gqa=k.size(1) < q.size(1))
