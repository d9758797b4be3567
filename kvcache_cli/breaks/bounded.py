"""The bounded caches' four breaks, each a correct loop and a loop with one thing wrong.

- `evict-sink`: a window of W that evicts the first tokens, against StreamingLLM's fix,
  4 sinks + a window of W - 4 (the same budget);
- `ring-mask`: the ring masked by slot index, as a buffer that never wraps would be:
  once it wraps, the query in slot p mod W hides every later slot, which holds the
  older half of its window;
- `ring-off-by-one`: decode writes the newest token one slot late, into the slot of the
  oldest key the query still needs;
- `evict-rope-slot` (a rotary model): a sink ring that evicts without deciding which
  position a kept key has: each key handed to attention is read at its slot index, as a
  cache that stores keys unrotated and rotates them by their index would, against the
  same ring keeping every key at its text position (`:text`). Until the ring wraps the
  slot index is the position and nothing differs; after, the window's keys are rotated
  out of order, by up to W positions.

Both loops decode greedily on the same model (`generate.token_steps`); the control is the
correct loop against a recompute that holds every position and hides the ones out of the
band by mask alone (no ring). The damage is measured twice: the first step whose logits
move (and whose token changes), and, teacher-forced on the correct loop's text, the mean
KL divergence from the full cache over the positions past the budget, fix against break
(the prompt in one forward, then a token a step, as the loops ran).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvcache_cli.breaks.base import (
    BreakCounter,
    BreakProgress,
    BreakResult,
    StepDiff,
    compared,
    greedy,
)
from kvcache_cli.caches import make_cache
from kvcache_cli.caches.base import PositionedCache
from kvcache_cli.caches.bounded import RingCache
from kvcache_cli.caches.exact import ConcatCache
from kvcache_cli.generate import check_request, token_steps
from kvcache_cli.models.base import FamilyModel

BOUNDED_BREAKS = {
    "evict-sink": "a window that evicts the first tokens, against 4 sinks + a window at "
                  "the same budget (StreamingLLM's fix)",
    "ring-mask": "the ring masked by slot index: once it wraps, the query hides the slots "
                 "after its own, the older half of its window",
    "ring-off-by-one": "decode writes the newest token one slot late, over the oldest key "
                       "the query still needs",
    "evict-rope-slot": "a sink ring under rotary positions that never decides a kept key's "
                       "position: each key is read at its slot index, against its text "
                       "position (:text)",
}
SINKS = 4  # StreamingLLM's


@dataclass(frozen=True)
class BoundedBreakResult(BreakResult):
    budget: int  # positions each loop's cache holds
    first_wrong_step: int | None  # first step whose logits moved past rounding noise
    kl_fix: float  # mean KL(full || fix) per position past the budget, teacher-forced
    kl_broken: float  # the same for the broken loop


class SlotMaskedRing(RingCache):
    """`ring-mask`: reports slot s as position (p - p mod W) + s, the slot's index
    counted from the start of the newest token's lap. Before the ring wraps that is
    the truth; after, every slot past the newest looks like a future position."""

    decodes_in_one_call = False  # its bug lives in the torch path's slots and mask

    def key_positions(self, layer: int) -> Tensor | None:
        held = super().key_positions(layer)
        newest = self.length - 1
        lap = newest - newest % self.window
        return lap + torch.arange(held.numel(), device=held.device)


class LateRing(RingCache):
    """`ring-off-by-one`: a decode step writes position p into slot (p + 1) mod W. It
    records which position each slot holds, so its mask is right for what it holds;
    what it loses is the key that slot held, still in the query's window."""

    decodes_in_one_call = False  # its bug lives in the torch path's slots and mask

    def reset(self) -> None:
        super().reset()
        self.slot_pos = torch.full((self.slots,), -1, device=self.device)  # (slots,)

    def update(self, layer: int, start_pos: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if k.size(2) > 1:  # the prompt goes in right: the bug is in the decode step
            keys, values = super().update(layer, start_pos, k, v)
            self.slot_pos = self.positions()
            return keys, values
        i = (start_pos + 1) % self.window  # one slot late
        self.k[layer][:, :, i] = k[:, :, 0]
        self.v[layer][:, :, i] = v[:, :, 0]
        if layer == 0:
            self.length = start_pos + 1
            self.slot_pos[i] = start_pos
            self._held = self.slot_pos.clone()
        return self.k[layer], self.v[layer]  # every slot; -1 marks an empty one


class SlotRotatedRing(RingCache):
    """`evict-rope-slot`: a ring whose keys are read at their slot index. The model
    rotates a key by its text position before `update`; this ring hands attention each
    key rotated on by (slot index - text position), so the key at slot i reads as
    position i, as it would from a cache that kept keys unrotated and rotated them by where
    they sit. The mask still bands by text position: only the rotation is wrong."""

    decodes_in_one_call = False  # its bug lives in the torch path's slots and mask

    def __init__(self, shape, sinks: int, window: int, max_len: int, batch: int, device,
                 dtype, name: str):
        if shape.rope is None:
            raise ValueError("evict-rope-slot needs rotary positions (a Llama); this "
                             "model's are learned embeddings")
        super().__init__(shape, sinks, window, max_len, batch, device, dtype, name)
        self.turn = shape.rope

    def update(self, layer: int, start_pos: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        keys, values = super().update(layer, start_pos, k, v)  # (B, nkv, n, hs)
        held = self._held  # (n,) each returned key's text position, -1 an empty slot
        index = torch.arange(held.numel(), device=held.device)
        by = torch.where(held >= 0, index - held, 0)  # (n,): an empty slot is masked anyway
        return self.turn.rotate(keys, by), values


class BandedFull(PositionedCache, ConcatCache):
    """The control: every position kept, the band applied by the mask alone."""

    def __init__(self, model: FamilyModel, window: int, sinks: int):
        super().__init__(model.config, 1, model.device, model.dtype)
        self.window, self.sinks = window, sinks

    def key_positions(self, layer: int) -> Tensor | None:
        return torch.arange(self.k[layer].size(2), device=self.device)


def run_bounded_break(name: str, model: FamilyModel, prompt_ids: list[int] | None = None,
                      max_new_tokens: int = 24, *, progress: BreakProgress | None = None
                      ) -> BoundedBreakResult:
    """The correct and the broken loop of one bounded break, greedily, on one model.

    The budget is half the positions the run writes (at least 8), so the window fills
    and wraps in the middle of the generation. `progress` hears of every step made (the
    band, the fix and the break a token each).
    """
    if name not in BOUNDED_BREAKS:
        raise ValueError(f"unknown break {name!r}: expected {', '.join(BOUNDED_BREAKS)}")
    from kvcache_cli.breaks.base import default_prompt

    # The model's own tokenizer's prompt where it has one (SmolLM2): a real text, whose
    # continuation a sink or a wrong rotation can spoil; GPT-2's ids otherwise.
    prompt = list(prompt_ids) if prompt_ids is not None else default_prompt(model)
    check_request(model, prompt, max_new_tokens)
    n = len(prompt) + max_new_tokens
    W = max(2 * SINKS, n // 2)
    shape = model.config.cache_shape
    if name in ("evict-sink", "evict-rope-slot"):
        fix_spec, window, sinks = f"sink:{SINKS}+{W - SINKS}", W - SINKS, SINKS
    else:
        fix_spec, window, sinks = f"window:{W}", W, 0

    def make_broken():
        if name == "evict-sink":
            return make_cache(f"window:{W}", model, n)
        if name == "evict-rope-slot":
            return SlotRotatedRing(shape, SINKS, W - SINKS, n, 1, model.device, model.dtype,
                                   fix_spec)
        bug = SlotMaskedRing if name == "ring-mask" else LateRing
        return bug(shape, 0, W, n, 1, model.device, model.dtype, f"window:{W}")

    fix, broken = make_cache(fix_spec, model, n), make_broken()

    def run(cache):
        return token_steps(model, prompt, max_new_tokens, "bounded", cache, greedy)

    control, diff = StepDiff(), StepDiff()
    counter = BreakCounter(progress, max_new_tokens)
    steps = zip(run(BandedFull(model, window, sinks)), run(fix), run(broken), strict=True)
    for (tn, ln), (tc, lc), (tb, lb) in counter.count("band, fixed and broken loops", steps):
        control.add(tc, lc, tn, ln)
        diff.add(tc, lc, tb, lb)
    # A logit moves by more than the control's rounding: the first wrong step.
    noise = max(10 * max(control.gaps), 1e-4 * control.scale)
    wrong = next((i for i, g in enumerate(diff.gaps) if g > noise), None)
    text = torch.tensor([prompt + list(diff.a)], device=model.device)  # (1, n)
    full = _forced(model, None, text, len(prompt))
    fixed = _forced(model, make_cache(fix_spec, model, n), text, len(prompt))
    spoiled = _forced(model, make_broken(), text, len(prompt))
    return BoundedBreakResult(
        name=name, bug=BOUNDED_BREAKS[name], mode=fix_spec, prompt_ids=tuple(prompt),
        earlier_ids=(), **compared(diff, control),
        budget=W, first_wrong_step=wrong,
        kl_fix=_mean_kl(full, fixed, W), kl_broken=_mean_kl(full, spoiled, W),
    )


@torch.inference_mode()
def _forced(model: FamilyModel, cache, text: Tensor, prompt: int) -> Tensor:
    """Logits (n, vocab) of every position of `text` as the loops ran it: the prompt
    in one forward, then one token a step (all at once without a cache)."""
    if cache is None:
        return model(text, 0)[0].float()
    steps = [model(text[:, :prompt], 0, cache)[0]]
    steps += [model(text[:, p:p + 1], p, cache)[0] for p in range(prompt, text.size(1))]
    return torch.cat(steps).float()  # (n, vocab)


def _mean_kl(full: Tensor, other: Tensor, budget: int) -> float:
    """Mean KL(full || other) over the positions past the budget, in nats."""
    p = full[budget:].log_softmax(-1)  # (n - budget, vocab)
    q = other[budget:].log_softmax(-1)
    return float((p.exp() * (p - q)).sum(-1).mean())
