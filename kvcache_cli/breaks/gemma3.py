"""Gemma 3's three breaks: its sliding window and its two rotary bases done wrong.

Gemma 3 attends over a sliding window on five layers of six, with rotary base 10,000 there
and 1,000,000 on the global layers. The window is part of the model's math, like the
rotation and unlike the causal mask (which only hides what a cache has not yet written):
a sliding layer that sees past its window computes another function. Each break is a
correct loop and a broken one, greedily, side by side on the same weights
(`breaks.base.side_by_side`), with the correct loop against a full recompute as the
control; the broken loop reads through a cache chosen wrong, or through a copy of the
model whose two rotary tables trade places (the blocks and weights shared). Nothing on
the model's own path knows of the break.

- `sliding-unbanded`: the sliding layers given a full cache without their band: they
  attend to every position, past the window. Nothing differs while the text fits in the
  window; from the first query at position `window` on, the logits move;
- `rope-bases-swapped`: each layer rotates with the other kind's base: the sliding layers'
  angles at 1,000,000 barely turn over their window, the global layers' at 10,000 turn
  fast. Every relative distance reads wrong, the prompt's included;
- `global-windowed`: the global layers bounded like the sliding ones, a ring of the
  window: the same until position `window`, then the only layers that see the whole
  context lose its start. This is what `--cache window:W` does on purpose (a cut), and
  why a window is a cut on the global layers only.

The prompt is the first tokens of the held-out text shipped with the trained checkpoint
(Python sources), `window - max_new_tokens // 2` of them, so the run crosses the window
halfway, as the bounded breaks' rings wrap halfway.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch.nn as nn

from kvcache_cli.breaks.base import (
    BreakCounter,
    BreakProgress,
    BreakResult,
    compared,
    greedy,
    side_by_side,
)
from kvcache_cli.caches import cache_class, make_cache, parse_cache_spec
from kvcache_cli.caches.base import LayerType
from kvcache_cli.caches.hybrid import HybridCache
from kvcache_cli.generate import check_request, token_steps
from kvcache_cli.models.base import FamilyModel

GEMMA3_BREAKS = {
    "sliding-unbanded": "the sliding layers given a full cache without their band: they "
                        "attend past the window",
    "rope-bases-swapped": "the rotary bases swapped: 1,000,000 on the sliding layers, 10,000 "
                          "on the global ones",
    "global-windowed": "the global layers bounded like the sliding ones: a ring of the "
                       "window on every layer",
}
SPEC = "static"  # the correct loop's kind on the global layers (rings on the sliding ones)


@dataclass(frozen=True)
class WindowBreakResult(BreakResult):
    """A BreakResult with where the window lies in the run and what each cache held."""

    window: int  # the sliding layers' window, in positions
    window_step: int  # the first step whose query sits at position `window`: a key falls out
    first_wrong_step: int | None  # the first step whose logits move past the control's noise
    bytes_by_kind: dict[str, int]  # the correct loop's cache at the end, per layer kind
    broken_bytes_by_kind: dict[str, int]  # ... and the broken loop's


def swapped_bases(model: FamilyModel) -> FamilyModel:
    """A shallow copy of a Gemma 3 whose rotary tables trade places: the sliding layers
    read the global base's angles and the global layers the sliding base's. The blocks,
    weights and config are the original's (nothing is copied but the module's dicts)."""
    broken = copy.copy(model)
    rotary = model.rotary
    broken._modules = {**model._modules, "rotary": nn.ModuleDict(
        {"full": rotary["sliding"], "sliding": rotary["full"]})}
    return broken


def unbanded(model: FamilyModel, spec: str, max_len: int) -> HybridCache:
    """The hybrid cache of `sliding="full"` without its band: every layer in `spec`'s kind,
    read with plain causal attention, so a sliding layer attends past its window. The
    layers keep their kinds in the shape, so `bytes_by_kind` still splits them."""
    shape = model.config.cache_shape
    kind = parse_cache_spec(spec)
    flat = replace(shape, layer_types=tuple(LayerType(None, t.rope_theta)
                                            for t in shape.layer_types))
    inner = cache_class(kind).build(kind, flat, max_len=max_len, batch=1, device=model.device,
                                    dtype=model.dtype, whole=False)
    return HybridCache(shape, {None: inner}, {None: list(range(shape.n_layer))})


def window_prompt(model: FamilyModel, length: int) -> list[int]:
    """The first `length` tokens of the held-out text in the model's own tokenizer; a model
    without one (a test's, random weights) reads its UTF-8 bytes wrapped into its vocabulary."""
    from kvcache_cli.checkpoints import heldout_bytes
    from kvcache_cli.models.tokenizer import encoding_for

    text = heldout_bytes()[: 16 * length]  # more than `length` tokens of any tokenizer
    if model.config.tokenizer.startswith("file:"):
        encoding, _ = encoding_for(model.config.tokenizer)
        if encoding is not None:
            return encoding.encode(text.decode("utf-8", errors="ignore"))[:length]
    return [b % model.config.vocab_size for b in text[:length]]


def run_gemma3_break(name: str, model: FamilyModel, max_new_tokens: int = 16, *,
                     progress: BreakProgress | None = None) -> WindowBreakResult:
    """The correct and the broken loop of one Gemma 3 break, greedily, on one model with
    sliding layers (a ValueError for one without)."""
    if name not in GEMMA3_BREAKS:
        raise ValueError(f"unknown break {name!r}: expected {', '.join(GEMMA3_BREAKS)}")
    from kvcache_cli.models.gemma3 import Gemma3

    layer_types = model.config.cache_shape.layer_types
    kinds = {t.kind for t in layer_types}
    if not isinstance(model, Gemma3) or kinds != {"sliding", "full"}:
        raise ValueError(f"{name} runs on the Gemma 3 family, sliding and global layers "
                         "together: expected -m gemma3")
    window = min(t.window for t in layer_types if t.sliding)
    prompt = window_prompt(model, max(1, window - max_new_tokens // 2))
    check_request(model, prompt, max_new_tokens)
    n = len(prompt) + max_new_tokens
    correct_cache = make_cache(SPEC, model, n)
    broken_model = swapped_bases(model) if name == "rope-bases-swapped" else model
    broken_cache = {"sliding-unbanded": lambda: unbanded(model, SPEC, n),
                    "global-windowed": lambda: make_cache(f"window:{window}", model, n),
                    "rope-bases-swapped": lambda: make_cache(SPEC, model, n)}[name]()
    counter = BreakCounter(progress, 2 * max_new_tokens)
    correct = counter.count("correct loop", token_steps(
        model, prompt, max_new_tokens, SPEC, correct_cache, greedy))
    broken = counter.count("broken loop", token_steps(
        model, prompt, max_new_tokens, SPEC, broken_cache, greedy, forward=broken_model))
    bug, control = side_by_side(model, prompt, correct, broken)
    noise = max(10 * max(control.gaps), 1e-4 * control.scale)
    return WindowBreakResult(
        name=name, bug=GEMMA3_BREAKS[name], mode=f"{SPEC} (rings of {window} on the sliding "
        "layers)", prompt_ids=tuple(prompt), earlier_ids=(), **compared(bug, control),
        window=window, window_step=window - len(prompt) + 1,
        first_wrong_step=next((i for i, g in enumerate(bug.gaps) if g > noise), None),
        bytes_by_kind=correct_cache.bytes_by_kind(),
        broken_bytes_by_kind=broken_cache.bytes_by_kind())
