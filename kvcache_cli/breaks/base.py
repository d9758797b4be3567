"""What every break shares: its default prompts, its result, and the side-by-side run of a
correct and a broken loop with a full recompute as the control.

A break is a bug planted on purpose; its runner (`registry` names each) makes a correct
and a broken token stream, and `side_by_side` compares them a step at a time: the tokens,
the first step they differ, the logit gaps until then, and the correct loop against a full
recompute, which says its own gaps are rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from kvcache_cli.models.base import FamilyModel
from kvcache_cli.models.tokenizer import encoding_for

# "The quick brown fox jumps over the lazy dog" and "Once upon a time" in GPT-2's BPE,
# so the breaks have prompts even where tiktoken's files cannot be fetched.
DEFAULT_PROMPT_IDS = (464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290)
OTHER_PROMPT_IDS = (7454, 2402, 257, 640)
DEFAULT_PROMPT_TEXTS = ("The quick brown fox jumps over the lazy dog", "Once upon a time")


@dataclass(frozen=True)
class BreakResult:
    name: str
    bug: str  # what the broken loop does differently
    mode: str  # the cache both loops use
    prompt_ids: tuple[int, ...]
    earlier_ids: tuple[int, ...]  # stale-cache: the request whose cache is reused
    correct: tuple[int, ...]  # tokens from the correct loop
    broken: tuple[int, ...]  # tokens from the broken loop
    first_divergence: int | None  # first step whose tokens differ (0: the first new token)
    max_logit_diff: float  # largest |broken - correct| logit while both saw the same tokens
    step_logit_diff: tuple[float, ...]  # per step, up to and including the divergence
    naive_logit_diff: float  # the correct loop against a full recompute: rounding noise
    max_abs_logit: float  # the scale that noise is relative to
    naive_agrees: bool  # ... and its tokens equal the full recompute's


class StepDiff:
    """Two runs step by step: their tokens, the first differing step, the logit gaps.

    Logits are compared up to and including the first differing step: after it the
    two loops are fed different tokens, so later gaps say nothing about the bug.
    """

    def __init__(self) -> None:
        self.a: list[int] = []
        self.b: list[int] = []
        self.first: int | None = None
        self.gaps: list[float] = []
        self.scale = 0.0

    def add(self, ta: int, la: Tensor, tb: int, lb: Tensor) -> None:
        if self.first is None:
            self.gaps.append((la - lb).abs().max().item())
            self.scale = max(self.scale, la.abs().max().item())
            if ta != tb:
                self.first = len(self.a)
        self.a.append(ta)
        self.b.append(tb)


# A break's progress: (which run, tokens done in all, tokens in all).
BreakProgress = Callable[[str, int, int], None]


def compared(bug: StepDiff, control: StepDiff) -> dict:
    """The fields every break's result takes from its two comparisons (`side_by_side`)."""
    return dict(correct=tuple(bug.a), broken=tuple(bug.b), first_divergence=bug.first,
                max_logit_diff=max(bug.gaps), step_logit_diff=tuple(bug.gaps),
                naive_logit_diff=max(control.gaps), max_abs_logit=control.scale,
                naive_agrees=control.first is None)


def side_by_side(model: FamilyModel, prompt: list[int], correct: Iterator[tuple[int, Tensor]],
                 broken: Iterator[tuple[int, Tensor]]) -> tuple[StepDiff, StepDiff]:
    """(correct against broken, correct against a full recompute): the two loops a step of
    each in turn, then the control that says the correct loop's gaps are rounding."""
    control, bug = StepDiff(), StepDiff()
    correct_logits = []  # each (1, vocab): compared with the full recompute below
    for (tc, lc), (tb, lb) in zip(correct, broken, strict=True):
        bug.add(tc, lc, tb, lb)
        correct_logits.append(lc)
    recomputed = _full_recompute(model, prompt, bug.a)  # (max_new_tokens, vocab)
    for i, (tc, lc) in enumerate(zip(bug.a, correct_logits)):
        ln = recomputed[i : i + 1]  # (1, vocab)
        control.add(tc, lc, int(ln.argmax()), ln)
    return bug, control


def greedy(logits: Tensor) -> Tensor:
    return logits.argmax(dim=-1)


@torch.inference_mode()
def _full_recompute(model: FamilyModel, prompt: list[int], tokens: list[int]) -> Tensor:
    """The logits a full recompute (the naive loop) chooses each token from, all in one
    forward: causal attention makes row t of a forward over the whole sequence exactly the
    last row of a fresh forward over its first t + 1 tokens. One forward, not one per token:
    the naive loop's cost grows with the square of the length (minutes at 1,000 tokens)."""
    ids = torch.tensor([prompt + tokens[:-1]], dtype=torch.long, device=model.device)  # (1, T)
    return model(ids, 0, None)[0, len(prompt) - 1 :]  # (len(tokens), vocab)


class BreakCounter:
    """Counts the tokens of a break's runs for `progress` (which may be None)."""

    def __init__(self, progress: BreakProgress | None, total: int):
        self.progress, self.total, self.done = progress, total, 0

    def count(self, label: str, steps: Iterator[tuple[int, Tensor]]):
        for step in steps:
            self.done += 1
            if self.progress is not None:
                self.progress(label, self.done, self.total)
            yield step


def default_prompt(model: FamilyModel) -> list[int]:
    """The breaks' prompt in the model's own tokenizer; a model without one (a test's,
    random weights) wraps GPT-2's ids into its vocabulary."""
    if model.config.tokenizer.startswith("file:"):
        encoding, _ = encoding_for(model.config.tokenizer)
        if encoding is not None:
            return encoding.encode(DEFAULT_PROMPT_TEXTS[0])
    return [t % model.config.vocab_size for t in DEFAULT_PROMPT_IDS]
