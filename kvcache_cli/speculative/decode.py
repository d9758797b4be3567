"""Speculative decoding: a draft proposes k tokens, the target checks them in one forward.

The target runs one forward over its pending token and the k drafted ones, which gives
its own choice at each of the k + 1 positions. Greedy verification keeps the drafted
tokens up to the first one the target would not have picked, then the target's own
token there (or, when all k agree, its next one: the bonus token), so the output is
exactly plain greedy decoding's. Sampling uses the standard rule (Leviathan et al. 2023,
Chen et al. 2023): accept drafted token d with probability min(1, p(d) / q(d)); on a
rejection draw from norm(max(0, p - q)); so the output follows the target's p exactly.

Every rejected token's keys and values must then be forgotten: the target's cache
rolls back with `KVCache.crop`, which every cache kind implements or refuses in one
line (`caches.spec.KINDS[...].rollback` says how). The drafts:

- a smaller GPT-2 with its own cache (`gpt2` drafting for `gpt2-medium`);
- `layers:N`: the target's first N layers with its own final LayerNorm and head
  (self-speculation, as in LayerSkip), sharing the target's weights;
- `lookup[:n]`: prompt lookup decoding, no model: the last n-gram of the context
  found earlier in it, and the tokens that followed it there (transformers'
  `prompt_lookup_num_tokens`).

Everything returns data (`Speculation`, `SpecRun`, the two breaks' results); the CLI prints.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kvcache_cli import numbers
from kvcache_cli.caches import KVCache, RollbackError, make_cache, parse_cache_spec
from kvcache_cli.generate import check_request, token_steps
from kvcache_cli.models.base import FamilyConfig, FamilyModel
from kvcache_cli.speculative.drafts import Draft, DraftSpec, Sampling

# ---------------------------------------------------------------------------- draft specs


def check_speculation(target: FamilyConfig, draft: DraftSpec, draft_config: FamilyConfig | None,
                      k: int | Sequence[int], cache: str, draft_name: str = "",
                      positions: int | None = None) -> str | None:
    """Refuse, before any weights load, what cannot run; a one-line note for what can but
    should not be expected to pay (a draft as large as its target). Raises ValueError.
    `positions`: prompt + new tokens, when known, for a bounded cache's room to roll back."""
    ks = [k] if isinstance(k, int) else list(k)
    for kk in ks:
        if not 1 <= kk < target.context:
            raise ValueError(f"--speculate {kk}: expected K from 1 to {target.context - 1} "
                             f"(draft tokens a step, within the context window "
                             f"{target.context})")
    spec = parse_cache_spec(cache)
    if not spec.info.rollback:
        raise RollbackError(f"cache {spec} cannot roll back, which speculative decoding needs: "
                            f"expected one of {', '.join(rollback_kinds())}")
    if positions is not None:
        check_room(spec, positions, max(ks))
    if draft.kind == "layers" and not draft.n < target.n_layer:
        fits = (f"layers:N with N {numbers.span(1, target.n_layer - 1)}" if target.n_layer > 1
                else "lookup or a model draft (a one-layer target has no smaller layers:N)")
        raise ValueError(f"draft {draft}: the target has {target.n_layer:,} layer"
                         f"{'s' if target.n_layer != 1 else ''}; expected {fits}")
    if draft.kind != "model" or draft_config is None:
        return None
    if draft_config.vocab_size != target.vocab_size:
        raise ValueError(f"draft {draft_name or draft} has a vocabulary of "
                         f"{draft_config.vocab_size:,} tokens, the target {target.vocab_size:,}:"
                         " expected a draft with the target's tokenizer")
    mine_tok, theirs_tok = (getattr(c, "tokenizer", "gpt2") for c in (draft_config, target))
    if mine_tok != theirs_tok:
        raise ValueError(f"draft {draft_name or draft} reads {mine_tok} tokens, the target "
                         f"{theirs_tok}: expected a draft with the target's tokenizer")
    if draft_config.context < target.context:
        raise ValueError(f"draft {draft_name or draft} has a context window of "
                         f"{draft_config.context}, the target {target.context}: expected "
                         "at least the target's")
    mine, theirs = draft_config.param_count(), target.param_count()
    if mine >= theirs:
        return (f"the draft (~{mine / 1e6:.0f}M parameters) is not smaller than the target "
                f"(~{theirs / 1e6:.0f}M): expect it to be slower than plain decoding")
    return None


def check_room(spec, positions: int, k: int) -> None:
    """A bounded cache rolls back exactly only while it holds what the next token attends:
    before its ring wraps, and spare + 1 positions once it has (`window:W:kN`). Refuse a K
    above that past that point."""
    budget = spec.info.budget
    held = budget(dict(spec.params)) if budget is not None else None
    back = dict(spec.params).get("spare", 0) + 1
    if held is not None and positions > held and k > back:
        reach = "one position" if back == 1 else f"{back} positions"
        raise RollbackError(
            f"cache {spec} holds {held} positions and this request writes {positions}: once "
            f"it wraps it rolls back {reach} at most, and --speculate {k} may reject {k}; "
            f"expected --speculate {back} or less, spare slots ({spec.kind}:...:k{k}), a "
            f"cache holding {positions} positions, or static")


def rollback_kinds() -> list[str]:
    from kvcache_cli.caches.spec import KINDS

    return [name for name, kind in KINDS.items() if kind.rollback]


# ---------------------------------------------------------------------------- verification


def _verify_greedy(logits: Tensor, drafted: list[int]) -> tuple[int, int]:
    """(drafted tokens accepted, the target's token after them) for logits (m + 1, vocab)."""
    choice = logits.argmax(dim=-1).tolist()  # the target's greedy token at each position
    n = 0
    while n < len(drafted) and drafted[n] == choice[n]:
        n += 1
    return n, choice[n]


def _verify_sampled(logits: Tensor, drafted: list[int], q: Tensor | None, sampling: Sampling,
                    generator: torch.Generator | None) -> tuple[int, int]:
    """The standard acceptance rule: accept d with probability min(1, p(d) / q(d)); at the
    first rejection draw from norm(max(0, p - q)); after k acceptances the bonus from p."""
    p = sampling.probs(logits)  # (m + 1, vocab)
    for i, d in enumerate(drafted):
        if q is None:  # a deterministic proposal: q is one-hot on d
            qi = torch.zeros_like(p[i])
            qi[d] = 1.0
        else:
            qi = q[i].to(p.dtype)
        r = torch.rand((), generator=generator, dtype=torch.float64, device=p.device)
        if r * qi[d] < p[i, d]:  # r < p / q, without dividing by a q of 0
            continue
        residual = (p[i] - qi).clamp(min=0.0)
        total = residual.sum()
        # p == q exactly leaves nothing to redraw from; p itself is then the right law.
        residual = residual / total if total > 0 else p[i]
        return i, int(torch.multinomial(residual, 1, generator=generator))
    return len(drafted), int(torch.multinomial(p[len(drafted)], 1, generator=generator))


@dataclass(frozen=True)
class Speculation:
    """One speculative generation."""

    draft: str
    k: int  # the most draft tokens checked per step
    cache: str
    tokens: tuple[int, ...]  # the new tokens
    proposed: int  # draft tokens the target checked
    accepted: int
    acceptance_rate: float  # accepted / proposed (nan when nothing was proposed)
    histogram: tuple[int, ...]  # steps that accepted 0, 1, ..., k draft tokens
    empty_steps: int  # steps where the draft had nothing to propose (lookup: no match)
    target_forwards: int  # the prefill and one verification a step
    forwards_per_token: float
    seconds: float  # prefill to last token, the draft's work included
    tokens_per_s: float
    cache_bytes_copied: int  # by the target's cache


def speculate(
    model: FamilyModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    draft: Draft,
    k: int,
    *,
    cache: str | KVCache = "static",
    sampling: Sampling = Sampling(),
    generator: torch.Generator | None = None,
    rollback: bool = True,
) -> Speculation:
    """Generate max_new_tokens with `draft` proposing up to k tokens a step.

    `cache`: a spec (a fresh cache for the request) or a cache to use. `rollback=False`
    is the `no-rollback` break: the target keeps its rejected keys and values.
    """
    check_request(model, prompt_ids, max_new_tokens)
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    P = len(prompt_ids)
    name = cache if isinstance(cache, str) else type(cache).__name__
    if isinstance(cache, str):
        if rollback:
            check_room(parse_cache_spec(cache), P + max_new_tokens, k)
        # A sliding layer's ring (a hybrid model's) keeps k - 1 slots past its window: a
        # step writes its pending token and up to k drafted ones and may reject all k.
        cache = make_cache(cache, model, P + max_new_tokens, spare=k - 1)
    draft.reset()
    tokens = list(prompt_ids)
    histogram = [0] * (k + 1)
    proposed = accepted = empty = 0
    start = time.perf_counter()
    with torch.inference_mode():
        idx = torch.tensor([tokens], device=model.device)  # (1, P)
        logits = model(idx, 0, cache, last_only=True)[0]  # (1, vocab): the prefill
        forwards = 1
        if sampling.greedy:
            tokens.append(int(logits[-1].argmax()))
        else:
            tokens.append(int(torch.multinomial(sampling.probs(logits)[-1], 1,
                                                generator=generator)))
        while len(tokens) - P < max_new_tokens:
            L = len(tokens)  # the cache holds tokens[:L - 1]; tokens[L - 1] is pending
            # Never draft past the tokens asked for: the last step may check fewer.
            room = min(k, max_new_tokens - (L - P) - 1)
            drafted, q = draft.propose(tokens, room, sampling, generator) if room else ([], None)
            idx = torch.tensor([[tokens[-1], *drafted]], device=model.device)  # (1, m + 1)
            logits = model(idx, L - 1, cache)[0]  # (m + 1, vocab): one verification
            forwards += 1
            if sampling.greedy:
                n, nxt = _verify_greedy(logits, drafted)
            else:
                n, nxt = _verify_sampled(logits, drafted, q, sampling, generator)
            if rollback:
                cache.crop(L + n)  # keep tokens[:L] and the n accepted; forget the rest
            draft.rollback(L + n)
            tokens += [*drafted[:n], nxt]
            proposed += len(drafted)
            accepted += n
            empty += not drafted
            histogram[n] += 1
    seconds = time.perf_counter() - start
    new = tuple(tokens[P:P + max_new_tokens])
    return Speculation(
        draft=draft.name, k=k, cache=name, tokens=new,
        proposed=proposed, accepted=accepted,
        acceptance_rate=accepted / proposed if proposed else float("nan"),
        histogram=tuple(histogram), empty_steps=empty,
        target_forwards=forwards, forwards_per_token=forwards / len(new),
        seconds=seconds, tokens_per_s=len(new) / seconds,
        cache_bytes_copied=cache.bytes_copied,
    )


def plain_greedy(model: FamilyModel, prompt_ids: list[int], max_new_tokens: int,
                 cache: str = "static") -> tuple[tuple[int, ...], float]:
    """(plain greedy tokens, seconds): one forward a token, the reference for both."""
    check_request(model, prompt_ids, max_new_tokens)
    kv = make_cache(cache, model, len(prompt_ids) + max_new_tokens)
    start = time.perf_counter()
    tokens = tuple(t for t, _ in token_steps(model, list(prompt_ids), max_new_tokens, cache, kv,
                                        lambda logits: logits.argmax(dim=-1)))
    return tokens, time.perf_counter() - start


# ---------------------------------------------------------------------------- a run


@dataclass(frozen=True)
class SpecRun:
    """Plain greedy and speculative decoding of one prompt, K swept, in one process."""

    target: str
    draft: str
    cache: str
    greedy: bool
    prompt_tokens: int
    new_tokens: int
    repeats: int  # each figure is the median of this many runs
    plain_tokens_per_s: float
    runs: tuple[Speculation, ...]  # one per K, the median run's figures
    speedups: tuple[float, ...]  # tokens/s over plain's, per K
    identical: tuple[bool, ...]  # greedy: the tokens equal plain greedy's, per K; () sampled
    best_k: int
    best_speedup: float
    note: str | None = None


def compare(
    model: FamilyModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    draft: Draft,
    ks: Sequence[int],
    *,
    cache: str = "static",
    sampling: Sampling = Sampling(),
    seed: int = 0,
    repeats: int = 1,
    target: str = "",
    note: str | None = None,
    on_progress: Callable[[str], None] | None = None,
) -> SpecRun:
    """Plain decoding and speculative decoding at each K, interleaved, `repeats` times.

    A warm-up generation runs first and is dropped (first-call allocations and kernel
    selection); then each round times plain, then every K, so a busy machine slows all
    alike. Greedy runs must give plain greedy's tokens exactly, which `identical` records
    (sampled runs follow the target's distribution, not its greedy tokens).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    warm = min(max_new_tokens, 8)  # dropped: first-call allocations, kernel selection
    plain_greedy(model, prompt_ids, warm, cache)
    speculate(model, prompt_ids, warm, draft, max(ks), cache=cache, sampling=sampling,
              generator=torch.Generator(device=model.device).manual_seed(seed))
    plain_s: list[float] = []
    per_k: dict[int, list[Speculation]] = {k: [] for k in ks}
    for r in range(repeats):
        plain, seconds = plain_greedy(model, prompt_ids, max_new_tokens, cache)
        plain_s.append(seconds)
        for k in ks:
            if on_progress is not None:
                on_progress(f"round {r + 1}/{repeats}: K={k}")
            g = torch.Generator(device=model.device).manual_seed(seed)
            per_k[k].append(speculate(model, prompt_ids, max_new_tokens, draft, k, cache=cache,
                                      sampling=sampling, generator=g))
    plain_rate = max_new_tokens / statistics.median(plain_s)
    runs = tuple(sorted(per_k[k], key=lambda s: s.seconds)[len(per_k[k]) // 2] for k in ks)
    speedups = tuple(s.tokens_per_s / plain_rate for s in runs)
    best = max(range(len(runs)), key=lambda i: speedups[i])
    return SpecRun(
        target=target, draft=draft.name, cache=cache, greedy=sampling.greedy,
        prompt_tokens=len(prompt_ids), new_tokens=max_new_tokens, repeats=repeats,
        plain_tokens_per_s=plain_rate, runs=runs, speedups=speedups,
        identical=tuple(s.tokens == plain for s in runs) if sampling.greedy else (),
        best_k=runs[best].k, best_speedup=speedups[best], note=note,
    )


# ---------------------------------------------------------------------------- breaks


