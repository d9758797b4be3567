"""What a weight format costs in accuracy: the logits' error against float32 and whether
greedy decoding picks the same tokens, with the margin of any token that flips.

A format changes the function a little (int8 rounds each weight to 1/127 of its row's
largest; bf16 keeps 8 bits of mantissa), so greedy tokens may part from float32's where
float32's two best tokens were close: a near-tie. The margin says which: the float32
model's logit for its own choice minus its logit for the token the other picked, at the
first step they differ, against the logits' spread at that step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcache_cli.generate import stream_tokens
from kvcache_cli.models.base import FamilyModel
from kvcache_cli.models.linear import weights_format

# A flip is a near-tie when the reference's margin is within what the other side's
# rounding is known to do to a logit: twice the largest logit error measured for a weight
# format, or, where none was measured (another engine), this share of the step's logit
# range (max - min), about what 8-bit weights move logits by (1-4% in the tests).
NEAR_TIE_SHARE = 0.02


@dataclass(frozen=True)
class TokenMargin:
    step: int  # generated token index where the two first differ
    margin: float  # reference's logit for its token minus its logit for the other's
    share: float  # margin / the logits' range (max - min) at that step
    near_tie: bool  # margin within twice the measured logit error, else share < NEAR_TIE_SHARE


@dataclass(frozen=True)
class WeightCheck:
    """A model in one weight format against the same weights in float32."""

    weights: str  # the format checked: int8, bf16, fp16, or fp32
    dtype: str  # activations and cache
    logits_max_error: float  # max |logit - float32's| over the prompt and the tokens
    logits_rel_error: float  # the same over max |float32's logit|
    new_tokens: int
    same_tokens: bool
    first_difference: TokenMargin | None


@torch.inference_mode()
def token_margin(reference: FamilyModel, prompt_ids: Sequence[int], tokens: Sequence[int],
                 other: Sequence[int], logit_error: float | None = None) -> TokenMargin | None:
    """Where `other` first leaves `tokens` (the reference's greedy tokens), how close the
    reference's own choice was there; None when they agree. `logit_error`: the largest
    error measured for the other side's logits, where known."""
    step = next((i for i, (a, b) in enumerate(zip(tokens, other)) if a != b), None)
    if step is None:
        return None
    ids = torch.tensor([list(prompt_ids) + list(tokens[:step])], device=reference.device)
    logits = reference(ids, 0, None, last_only=True)[0, -1].float()  # (vocab,)
    margin = float(logits[tokens[step]] - logits[other[step]])
    spread = float(logits.max() - logits.min()) or 1.0
    near = margin <= 2 * logit_error if logit_error is not None else (
        margin / spread < NEAR_TIE_SHARE)
    return TokenMargin(step, margin, margin / spread, near)


@torch.inference_mode()
def check_weights(reference: FamilyModel, model: FamilyModel, prompt_ids: Sequence[int],
                  new_tokens: int) -> WeightCheck:  # fmt: skip
    """`model` (any weight format) against `reference` (float32, the same weights)."""
    ref_tokens = list(stream_tokens(reference, list(prompt_ids), new_tokens, "static"))
    tokens = list(stream_tokens(model, list(prompt_ids), new_tokens, "static"))
    # Both scored on the reference's path, so the error is the format's, not a new path's.
    ids = torch.tensor([list(prompt_ids) + ref_tokens[:-1]], device=reference.device)
    ref_logits = reference(ids, 0, None).float()  # (1, T, vocab)
    logits = model(ids.to(model.device), 0, None).float().to(ref_logits.device)
    error = float((logits - ref_logits).abs().max())
    return WeightCheck(
        weights=weights_format(model),
        dtype=str(model.dtype).removeprefix("torch."),
        logits_max_error=error,
        logits_rel_error=error / (float(ref_logits.abs().max()) or 1.0),
        new_tokens=new_tokens,
        same_tokens=tokens == ref_tokens,
        first_difference=token_margin(reference, prompt_ids, ref_tokens, tokens, error),
    )
