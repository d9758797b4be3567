"""The Llama family's four breaks: rotary positions and grouped-query attention done wrong.

Each is a correct loop and a broken one, greedily, side by side on the same weights
(`breaks.base.side_by_side`), shown as the GPT-2 breaks are: the first step whose tokens
differ and the largest logit gap up to there, with the correct loop against a full
recompute as the control. Nothing here touches the model's own code path: the broken loop
runs a copy of the model whose attention modules are broken subclasses, sharing every
weight with the original (a deep copy whose memo holds the parameters and buffers), or
reads through a broken cache wrapped around a normal one.

- `rope-decode`: decode rotates the new token's query and key as position 0 (the
  position forgotten, as GPT-2's `position-offset`); the cache slot is still right, so
  the key is stored where it belongs but carries the wrong angle for ever;
- `kv-expand-early`: the KV heads copied out to the query heads before the cache, which
  then holds 9 heads where 3 do: the same tokens (the arithmetic is unchanged), 3x the
  bytes, the symptom the toy's `cache-q` has;
- `gqa-interleave`: query head h reads KV head h % nkv instead of h // (nh / nkv), the
  blocked grouping Llama was trained with (transformers' repeat_kv);
- `rope-twice`: the keys handed to attention rotated once more by their position when read
  from the cache: a key at position j carries angle 2j, so every query sees its keys at the
  wrong distances, the prompt's included.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from kvcache_cli.breaks.base import (
    BreakCounter,
    BreakProgress,
    BreakResult,
    compared,
    default_prompt,
    greedy,
    side_by_side,
)
from kvcache_cli.caches import make_cache
from kvcache_cli.caches.base import ForwardingCache, KVCache
from kvcache_cli.generate import check_request, token_steps
from kvcache_cli.models.llama import Llama, LlamaAttention, Rotary

LLAMA_BREAKS = {
    "rope-decode": "decode rotates each new query and key as position 0: the cache slot is "
                   "right, the angle is not",
    "kv-expand-early": "the KV heads expanded to the query heads before the cache, not "
                       "after: the cache holds every query head's copy",
    "gqa-interleave": "query head h reads KV head h % nkv (interleaved) instead of "
                      "h // (nh / nkv) (blocked, as trained)",
    "rope-twice": "the cache hands attention each key rotated again by its position: "
                  "a key at position j carries angle 2j",
}


@dataclass(frozen=True)
class LlamaBreakResult(BreakResult):
    """A BreakResult with what each loop's cache held at the end: a break can cost bytes
    and leave the tokens alone (`kv-expand-early`)."""

    kv_heads: int  # KV heads per layer the correct loop's cache holds
    broken_kv_heads: int  # ... and the broken loop's
    tokens_held: int  # positions in each cache at the end
    bytes_held: int  # the correct loop's cache at the end
    broken_bytes_held: int  # the broken loop's


class RopeAtZeroOnDecode(LlamaAttention):
    """`rope-decode`: a one-token call (decode) rotates q and k to position 0."""

    def forward(self, x, step, rope, cache):
        if x.size(1) == 1:
            rope = rope.moved_to(torch.zeros_like(rope.pos))  # the bug: position forgotten
        return super().forward(x, step, rope, cache)


class ExpandBeforeCache(LlamaAttention):
    """`kv-expand-early`: each KV head copied to its query heads, then cached."""

    def forward(self, x, step, rope, cache):
        B, T, _ = x.shape
        q, k, v = self.project(x, rope)  # q (B, nh, T, hs); k, v (B, nkv, T, hs)
        g = self.n_head // self.n_kv_head
        k = k.repeat_interleave(g, dim=1)  # (B, nh, T, hs): the bug, before the cache
        v = v.repeat_interleave(g, dim=1)  # (B, nh, T, hs)
        y = cache.attend(self.layer, q, k, v, step)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, C)


class InterleavedGroups(LlamaAttention):
    """`gqa-interleave`: attention gives query slot s KV head s // g; the query
    heads are put in the slots so that head h lands on KV head h % nkv, and the outputs
    put back in head order for o_proj."""

    def forward(self, x, step, rope, cache):
        B, T, _ = x.shape
        q, k, v = self.project(x, rope)
        nh, nkv = self.n_head, self.n_kv_head
        # Slot s holds the head order[s], whose h % nkv is s // g.
        order = torch.tensor(sorted(range(nh), key=lambda h: (h % nkv, h // nkv)),
                             device=q.device)  # (nh,)
        y = cache.attend(self.layer, q[:, order], k, v, step)  # (B, nh, T, hs), slot order
        y = y[:, torch.argsort(order)]  # (B, nh, T, hs), in head order
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, C)


class RotatedOnRead(ForwardingCache):
    """`rope-twice`: a cache that stores what it is given (keys already rotated to their
    positions) and hands attention every key rotated once more by its position."""

    def __init__(self, inner: KVCache, rotary: Rotary):
        if inner.key_positions(0) is not None or inner.whole:
            raise ValueError("rope-twice wraps a cache whose key j is position j: "
                             "expected mode concat or static")
        super().__init__(inner)
        self.rotary = rotary

    def update(self, layer: int, start_pos, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        keys, values = self.inner.update(layer, start_pos, k, v)  # (B, nkv, S, hs)
        pos = torch.arange(keys.size(2), device=keys.device)  # (S,): key j is position j
        return self.rotary(keys, pos), values  # the bug: rotated a second time

    # Attention reads what this `update` hands it, not the wrapped cache's own reading.
    attend = KVCache.attend


_ATTENTION = {"rope-decode": RopeAtZeroOnDecode, "kv-expand-early": ExpandBeforeCache,
              "gqa-interleave": InterleavedGroups}


def broken_copy(model: Llama, attention: type[LlamaAttention]) -> Llama:
    """A copy of `model` over the same weights whose attention modules are `attention`:
    the memo maps every parameter and buffer to itself, so nothing is copied but modules."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    broken = copy.deepcopy(model, memo=shared)
    for block in broken.model.layers:
        block.self_attn.__class__ = attention
    if attention is ExpandBeforeCache:  # its caches are built for every query head
        broken.config = dataclasses.replace(model.config, n_kv_head=model.config.n_head)
    return broken


def run_llama_break(name: str, model, max_new_tokens: int = 24,
                    progress: BreakProgress | None = None, *, prompt_ids: list[int] | None = None,
                    spec: str = "concat") -> LlamaBreakResult:
    """The correct and the broken loop of one Llama break on the same weights, greedily."""
    if name not in LLAMA_BREAKS:
        raise ValueError(f"unknown break {name!r}: expected {', '.join(LLAMA_BREAKS)}")
    if not isinstance(model, Llama):
        raise ValueError(f"break {name} runs on the Llama family (rotary positions, grouped "
                         f"KV heads), not on {type(model).__name__}: expected -m smollm2")
    if spec not in ("concat", "static"):
        raise ValueError(f"breaks need a cache: mode concat or static, got {spec!r}")
    prompt = list(prompt_ids) if prompt_ids is not None else default_prompt(model)
    check_request(model, prompt, max_new_tokens)
    n = len(prompt) + max_new_tokens
    broken_model = broken_copy(model, _ATTENTION[name]) if name in _ATTENTION else model
    correct_cache = make_cache(spec, model, n)
    broken_cache = make_cache(spec, broken_model, n)  # 9 KV heads for kv-expand-early
    if name == "rope-twice":
        broken_cache = RotatedOnRead(broken_cache, model.rotary)
    counter = BreakCounter(progress, 2 * max_new_tokens)
    both = "correct and broken loops"  # side by side, a token of each in turn
    correct = counter.count(both, token_steps(model, prompt, max_new_tokens, spec, correct_cache,
                                         greedy))
    broken = counter.count(both, token_steps(model, prompt, max_new_tokens, spec, broken_cache,
                                        greedy, broken_model))
    bug, control = side_by_side(model, prompt, correct, broken)
    return LlamaBreakResult(
        name=name, bug=LLAMA_BREAKS[name], mode=spec, prompt_ids=tuple(prompt),
        earlier_ids=(), **compared(bug, control),
        kv_heads=model.config.n_kv_head, broken_kv_heads=broken_model.config.n_kv_head,
        tokens_held=correct_cache.length, bytes_held=correct_cache.bytes_held,
        broken_bytes_held=broken_cache.bytes_held,
    )
