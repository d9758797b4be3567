"""One forward's facts, made once and handed to every layer's `cache.attend`: where the new
tokens sit, and attention over keys by those positions.

A model turns its `step` argument (an int, a (B,) tensor of each row's start, or a `Step`
a caller built) into a `Step` once per forward (`Step.at`: the positions, and the check
against the context window); every layer then reads the same one. The masks come from
the positions, never from slot numbers:

- keys in position order, key j the token at position j (`in_order`): the ordinary
  causal mask, aligned bottom right when T new tokens follow S - T cached ones;
- every slot of a fixed buffer (`whole`): the slots past each query's position hidden;
- keys out of order (a ring, kept sinks, evictions: `by_position`): the query at
  position p sees exactly the keys holding positions 0..p, within a window and its sinks;
- explicit weights for a cache that ranks keys by the attention they draw (`weighted`).

KV heads meet their query heads only here, after the cache: query head h reads KV head
h // (nh / nkv), the blocked grouping Llama was trained with (transformers' repeat_kv);
a cache that ranks keys receives the weights folded onto its KV heads, the mean over the
query heads that share each one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class Step:
    """Where one forward's T new tokens sit."""

    start: int | Tensor  # the first new token's position: one int, or (B,) per row
    pos: Tensor  # every new token's position: (T,) for every row, or (B, T) per row
    # Flat indices (B,) into the (R * T) token rows of the sequences' last tokens, where a
    # row holds several sequences or padding (serve's packed and padded layouts); None:
    # each row's last token is its sequence's.
    last: Tensor | None = None
    # `visible`'s masks made this forward, by the held positions' tensor (kept here, so
    # that its id names it for the whole forward), window and sinks: a ring hands every
    # layer the same tensor, and Gemma 3's 15 sliding layers built the same mask 15 times,
    # about 20 small ops each.
    _masks: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    @classmethod
    def at(cls, start: int | Tensor, T: int, context: int, device) -> Step:
        """T tokens from start (an int, or (B,) per row); an IndexError past the context
        the model was trained for."""
        if isinstance(start, Tensor):
            first, last = int(start.min()), int(start.max()) + T - 1
            pos = start[:, None] + torch.arange(T, device=device)  # (B, T)
        else:
            first, last = start, start + T - 1
            pos = torch.arange(start, start + T, device=device)  # (T,)
        if first < 0 or last >= context:
            raise IndexError(f"position {last} past context window {context}")
        return cls(start, pos)

    def last_rows(self, x: Tensor) -> Tensor:
        """Each sequence's last token of x (R, T, C), as (B, 1, C): all generation reads,
        and the LM head is the largest matmul."""
        if self.last is None:
            return x[:, -1:, :]  # (B, 1, C)
        return x.flatten(0, 1)[self.last][:, None]  # (B, 1, C)

    def in_order(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Attention (B, nh, T, hs) of queries q (B, nh, T, hs) over keys and values
        (B, nkv, S, hs) held in position order, key j at slot j: the query at position p
        sees slots 0..p."""
        T, S = q.size(2), k.size(2)
        if isinstance(self.start, Tensor):  # rows at different positions
            return attend_in_order(q, k, v, self.pos if self.pos.dim() == 2 else self.pos[None])
        if T == S:
            return sdpa(q, k, v, None, is_causal=True)  # square scores: the causal mask
        if T > 1:
            # T new tokens after S - T cached ones: query i sits at position S - T + i and
            # may see keys 0 .. S - T + i (the mask aligned bottom right).
            return sdpa(q, k, v, torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T))
        return sdpa(q, k, v, None)  # one query, the newest token: every key is in its past

    def whole(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """`in_order` over every slot of a fixed buffer (B, nkv, max_len, hs): query i sits
        at pos[i] and may see slots 0 .. pos[i]; the rest are not written yet, or hold an
        older request."""
        slots = torch.arange(k.size(2), device=q.device)  # (S,)
        return sdpa(q, k, v, slots <= self.pos[:, None])  # (T, S)

    def visible(self, held: Tensor, window: int | None = None, sinks: int = 0) -> Tensor:
        """Which keys each query may see, (B|1, nkv|1, T, S), for keys holding the positions
        `held`: (S,), (B, S) or (B, nkv, S), -1 for an empty slot. With a window, the band:
        positions p - window + 1 .. p, and the first `sinks` whatever their age (a chunk's
        early queries must not see what the window has moved past for its later ones).
        Made once a forward for each tensor of held positions (`_masks`); in a compiled
        graph, where a tensor has no lasting id, the compiler shares the equal masks."""
        if torch.compiler.is_compiling():
            return self._visible(held, window, sinks)
        key = (id(held), window, sinks)
        if key not in self._masks:
            self._masks[key] = (held, self._visible(held, window, sinks))
        return self._masks[key][1]

    def _visible(self, held: Tensor, window: int | None, sinks: int) -> Tensor:
        rows = self.pos if self.pos.dim() == 2 else self.pos[None]  # (B|1, T)
        if held.dim() == 1:  # (S,): the same for every row and head
            held = held[None, None]
        elif held.dim() == 2:  # (B, S): per row
            held = held[:, None]
        keys = held[:, :, None, :]  # (B|1, nkv|1, 1, S)
        query = rows[:, None, :, None]  # (B|1, 1, T, 1)
        seen = (keys >= 0) & (keys <= query)  # (B, nkv, T, S)
        if window is not None:
            seen &= (keys > query - window) | (keys < sinks)
        return seen

    def by_position(self, q: Tensor, k: Tensor, v: Tensor, held: Tensor,
                    window: int | None = None, sinks: int = 0) -> Tensor:
        """Attention (B, nh, T, hs) over keys and values (B, nkv, S, hs) out of order, key
        j holding position held[..., j] (`visible`)."""
        return sdpa(q, k, v, self.visible(held, window, sinks))

    def causal_mask(self, T: int, S: int, device) -> Tensor | None:
        """`in_order`'s mask written out, (T, S), for explicit weights; None: every key is
        in the past of the one query."""
        if T == 1 and S > 1:
            return None
        return torch.ones(T, S, dtype=torch.bool, device=device).tril(S - T)

    def weighted(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None
                 ) -> tuple[Tensor, Tensor]:
        """(attention (B, nh, T, hs), its weights (B, nkv, T, S) folded onto the KV heads)
        over keys and values (B, nkv, S, hs) under `mask` (`visible` or `causal_mask`).
        SDPA never returns its weights: an eviction policy that ranks keys by the attention
        they draw pays for the scores written out and a softmax of its own."""
        B, nh, T, hs = q.shape
        nkv = k.size(1)
        qg = q.view(B, nkv, nh // nkv, T, hs)  # (B, nkv, g, T, hs): each KV head's queries
        scores = (qg @ k[:, :, None].transpose(-2, -1)) / math.sqrt(hs)  # (B, nkv, g, T, S)
        if mask is not None:
            # (B|1, nkv|1, T, S), or (T, S): one more axis for the group
            scores = scores.masked_fill(~(mask[:, :, None] if mask.dim() == 4 else mask),
                                        float("-inf"))
        weights = scores.softmax(dim=-1)  # (B, nkv, g, T, S)
        return (weights @ v[:, :, None]).view(B, nh, T, hs), weights.mean(dim=2)


def attend_in_order(q: Tensor, k: Tensor, v: Tensor, positions: Tensor) -> Tensor:
    """Attention (B, nh, T, hs) for queries q (B, nh, T, hs) at `positions` (B|1, T) over
    keys and values (B, nkv, S, hs) held in position order, each row's padded to the
    longest: query i of row b may see exactly the slots 0 .. positions[b, i]. How a paged
    pool, gathered per row, is read."""
    slots = torch.arange(k.size(2), device=q.device)  # (S,)
    return sdpa(q, k, v, (slots <= positions[:, :, None]).unsqueeze(1))  # (B|1, 1, T, S)


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool = False
         ) -> Tensor:
    """SDPA (B, nh, T, hs) of q (B, nh, T, hs) over k, v (B, nkv, S, hs) under a boolean
    mask (True: may attend), its KV heads expanded to the query heads inside the kernel."""
    nh, nkv = q.size(1), k.size(1)
    # A mask per KV head is one per query head; one KV head's (B, 1, T, S) broadcasts as is.
    if mask is not None and mask.dim() == 4 and mask.size(1) == nkv and 1 < nkv < nh:
        mask = mask.repeat_interleave(nh // nkv, dim=1)  # (B, nh, T, S): per query head
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                          enable_gqa=nkv < nh)
