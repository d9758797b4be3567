"""What drafts for speculative decoding: a smaller model of the same vocabulary, the
target's own first layers (a self-draft sharing its weights), or prompt lookup (n-grams
copied from the context, no model at all); the `--draft` grammar, and sampling settings."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from kvcache_cli import numbers
from kvcache_cli.caches import make_cache
from kvcache_cli.generate import probabilities
from kvcache_cli.models.base import FamilyModel

# transformers' prompt lookup matches up to 3-grams by default (max_matching_ngram_size=2
# in its docs' example; 3 catches more repeated code without many false starts).
DEFAULT_NGRAM = 3
MAX_NGRAM = 16
DRAFT_GRAMMAR = ("a GPT-2 preset or checkpoint directory (e.g. gpt2), layers:N (the "
                 "target's first N layers), or lookup[:n] (n-gram matches in the context)")


@dataclass(frozen=True)
class DraftSpec:
    kind: str  # "model", "layers" or "lookup"
    model: str = ""  # the preset or checkpoint directory of a model draft
    n: int = 0  # layers: how many of the target's; lookup: the longest n-gram matched

    def __str__(self) -> str:
        if self.kind == "model":
            return self.model
        return f"{self.kind}:{self.n}"


def parse_draft(text: str) -> DraftSpec:
    """'lookup:3', 'layers:4', 'gpt2', a checkpoint dir -> DraftSpec, or a one-line ValueError."""
    name, _, field = text.strip().partition(":")
    if name in ("lookup", "layers"):
        if name == "lookup" and not field:
            return DraftSpec("lookup", n=DEFAULT_NGRAM)
        high = MAX_NGRAM if name == "lookup" else 1000
        what = "the longest n-gram" if name == "lookup" else "the number of layers"
        try:
            n = numbers.whole(field, what, 1, high)
        except numbers.NumberError as err:
            raise ValueError(f"draft {text!r}: {err}; expected {name}:N") from None
        return DraftSpec(name, n=n)
    if not text.strip():
        raise ValueError(f"empty draft: expected {DRAFT_GRAMMAR}")
    return DraftSpec("model", model=text.strip())


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def probs(self, logits: Tensor) -> Tensor:
        """(n, vocab) logits -> (n, vocab) probabilities, in float64 so p / q stays exact."""
        return probabilities(logits.double(), self.temperature, self.top_k)


class Draft:
    """Proposes up to k next tokens for a context; forgets what verification rejected."""

    name: str

    def propose(self, tokens: list[int], k: int, sampling: Sampling,
                generator: torch.Generator | None) -> tuple[list[int], Tensor | None]:
        """(up to k tokens, their draft probabilities (m, vocab) or None when the draft
        is deterministic: a proposal with q = 1 for its own token)."""
        raise NotImplementedError

    def rollback(self, valid: int) -> None:
        """Only the first `valid` tokens of the context stand."""

    def reset(self) -> None:
        """A new request."""


class ModelDraft(Draft):
    """A model (a smaller one, or the target's first layers) decoding k tokens ahead."""

    def __init__(self, model: FamilyModel, max_len: int, name: str):
        self.model, self.name = model, name
        # Every position held (a hybrid model's sliding layers too, under their band): a
        # draft rolls back up to k - 1 proposals, and k is known only when it proposes.
        self.cache = make_cache("static", model, max_len, sliding="full")

    def reset(self) -> None:
        self.cache.reset()

    @torch.inference_mode()
    def propose(self, tokens, k, sampling, generator):
        fed = self.cache.length  # the draft has seen tokens[:fed]; catch up on the rest
        idx = torch.tensor([tokens[fed:]], device=self.model.device)  # (1, T)
        logits = self.model(idx, fed, self.cache, last_only=True)[:, -1]  # (1, vocab)
        out, qs = [], []
        for i in range(k):
            if sampling.greedy:
                nxt = logits.argmax(dim=-1)  # (1,)
            else:
                q = sampling.probs(logits)  # (1, vocab)
                nxt = torch.multinomial(q, 1, generator=generator)[:, 0]  # (1,)
                qs.append(q[0])
            out.append(int(nxt))
            if i + 1 < k:  # the last proposal is never fed: verification decides on it
                logits = self.model(nxt.view(1, 1), len(tokens) + i, self.cache,
                                    last_only=True)[:, -1]
        return out, (torch.stack(qs) if qs else None)

    def rollback(self, valid: int) -> None:
        if self.cache.length > valid:
            self.cache.crop(valid)


class LookupDraft(Draft):
    """Prompt lookup: the longest of the last n..1 tokens seen earlier in the context,
    and the (up to) k tokens that followed it there, from its latest occurrence with the
    most of them. No model, no cache."""

    def __init__(self, max_ngram: int = DEFAULT_NGRAM):
        self.max_ngram = max_ngram
        self.name = f"lookup:{max_ngram}"

    def propose(self, tokens, k, sampling, generator):
        a = np.asarray(tokens)
        L = len(a)
        for n in range(min(self.max_ngram, L - 1), 0, -1):
            # Every n-gram that ends before the last token (so a continuation follows it).
            windows = np.lib.stride_tricks.sliding_window_view(a[: L - 1], n)  # (L - n, n)
            hits = np.flatnonzero((windows == a[L - n:]).all(axis=1))
            if hits.size:
                # The latest match with the longest continuation: in a run ("    ") the
                # latest match sits one token back and has a single token after it.
                ahead = np.minimum(k, L - (hits + n))
                start = int(hits[ahead == ahead.max()][-1]) + n
                return a[start:start + k].tolist(), None
        return [], None


def layer_draft(model: FamilyModel, n_layer: int) -> FamilyModel:
    """The target's first n_layer blocks, its final LayerNorm and its head: no copy."""
    if not 1 <= n_layer < model.config.n_layer:
        raise ValueError(f"layers:{n_layer}: expected 1 to {model.config.n_layer - 1}")
    return model.first_layers(n_layer).eval()


def make_draft(spec: DraftSpec, target: FamilyModel, max_len: int,
               draft_model: FamilyModel | None = None) -> Draft:
    """The draft a spec names; a model draft's weights are loaded by the caller."""
    if spec.kind == "lookup":
        return LookupDraft(spec.n)
    if spec.kind == "layers":
        return ModelDraft(layer_draft(target, spec.n), max_len, str(spec))
    if draft_model is None:
        raise ValueError(f"draft {spec}: load its model first")
    if draft_model.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"draft {spec} has a vocabulary of {draft_model.config.vocab_size:,} "
                         f"tokens, the target {target.config.vocab_size:,}")
    return ModelDraft(draft_model, max_len, str(spec))
