"""Generation with GPT-2: prefill, decode, three cache modes, and the three torch breaks.

Modes: `naive` runs the full forward over the whole sequence for every token;
`concat` and `static` prefill the prompt once and then decode one token per forward
against a cache (`caches.ConcatCache`, `caches.StaticCache`). All three pick the same
greedy tokens; the breaks are the article's three bugs, each a correct loop with one
call changed, run side by side with the correct loop on the same model.
Reference: the GPT-2 KV-cache article in `seeds/003_*`, section 5.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from kvcache_cli.caches import KVCache, make_cache
from kvcache_cli.models.gpt2 import GPT, GPTConfig

MODES = ("naive", "concat", "static")

# "The quick brown fox jumps over the lazy dog" and "Once upon a time" in GPT-2's BPE,
# so the breaks have prompts even where tiktoken's files cannot be fetched.
DEFAULT_PROMPT_IDS = (464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290)
OTHER_PROMPT_IDS = (7454, 2402, 257, 640)
DEFAULT_PROMPT_TEXTS = ("The quick brown fox jumps over the lazy dog", "Once upon a time")

# A step's forward: (tokens (B, T), start_pos, cache, **options) -> logits (B, T', vocab),
# GPT.forward itself or a broken stand-in for it.
Forward = Callable[..., Tensor]

# ---------------------------------------------------------------------------- checks


def check_mode(mode: str) -> None:
    """A mode is `naive` (no cache: every position recomputed) or a cache spec (`static`,
    `concat`, `paged:b16`, ...: see caches.spec); anything else is a ValueError."""
    from kvcache_cli.caches.spec import CacheSpecError, parse_cache_spec

    if mode == "naive":
        return
    try:
        parse_cache_spec(str(mode))
    except CacheSpecError as err:
        raise ValueError(f"unknown mode {str(mode)!r}: expected {', '.join(MODES)} or a cache "
                         f"spec ({err})") from None


def check_request(model: GPT, prompt_ids: list[int], max_new_tokens: int) -> None:
    """Refuse, before any work, a request the model cannot serve."""
    check_request_config(model.config, prompt_ids, max_new_tokens)


def check_request_config(config: GPTConfig, prompt_ids: list[int], max_new_tokens: int
                         ) -> None:
    """`check_request` from the model's config alone: callable before the weights load."""
    if not prompt_ids:
        raise ValueError("empty prompt: give at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {max_new_tokens}: expected at least 1")
    V, window = config.vocab_size, config.context
    bad = [t for t in prompt_ids if not 0 <= t < V]
    if bad:
        raise ValueError(f"token id {bad[0]} outside the vocabulary 0..{V - 1}")
    last = len(prompt_ids) + max_new_tokens - 1  # the position of the last new token
    if last >= window:
        raise IndexError(
            f"position {last} past context window {window}: a {len(prompt_ids)}-token prompt "
            f"+ {max_new_tokens} new tokens needs {last + 1} positions"
        )


# ---------------------------------------------------------------------------- steps


def sample(
    logits: Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Next token ids (B,) from last-position logits (B, vocab); temperature 0 is greedy."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@torch.inference_mode()
def _last_logits(forward: Forward, idx: Tensor, start_pos: int, cache: KVCache | None) -> Tensor:
    return forward(idx, start_pos, cache, last_only=True)[:, -1, :]  # (B, vocab)


def _steps(
    model: GPT,
    prompt_ids: list[int],
    max_new_tokens: int,
    mode: str,
    cache: KVCache | None,
    choose: Callable[[Tensor], Tensor],
    forward: Forward | None = None,
) -> Iterator[tuple[int, Tensor]]:
    """(token, the logits it was chosen from) per step; the loop behind every mode."""
    forward = forward if forward is not None else model
    idx = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)  # (1, T)
    P = idx.size(1)
    if mode == "naive":
        for i in range(max_new_tokens):
            # No cache: the whole sequence goes through the model again, every step.
            logits = _last_logits(forward, idx, 0, None)  # (1, vocab)
            nxt = choose(logits)  # (1,)
            yield int(nxt.item()), logits  # .item() waits for the device: the sync point
            if i + 1 < max_new_tokens:
                idx = torch.cat([idx, nxt.view(1, 1)], dim=1)  # (1, T + 1)
        return
    logits = _last_logits(forward, idx, 0, cache)  # prefill: the prompt in one forward
    for i in range(max_new_tokens):
        nxt = choose(logits)  # (1,)
        yield int(nxt.item()), logits
        if i + 1 < max_new_tokens:  # the last token is never fed back
            # Decode: one token at position P + i, attending over the cache.
            logits = _last_logits(forward, nxt.view(1, 1), P + i, cache)


def stream_tokens(
    model: GPT,
    prompt_ids: list[int],
    max_new_tokens: int,
    mode: str,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    cache: KVCache | None = None,
) -> Iterator[int]:
    """Yield each new token id as soon as it is chosen.

    The first yield comes right after the prefill (time to first token), each later
    one after one decode step. Checks run now, before the first `next()`. Without a
    `cache`, a fresh one is made for the request (sized prompt + new tokens for
    `static`); pass one to read its `bytes_copied` afterwards.
    """
    check_mode(mode)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    check_request(model, prompt_ids, max_new_tokens)
    if mode == "naive" and cache is not None:
        raise ValueError("mode naive uses no cache")
    if mode != "naive" and cache is None:
        cache = make_cache(mode, model, len(prompt_ids) + max_new_tokens)

    def choose(logits: Tensor) -> Tensor:
        return sample(logits, temperature, top_k, generator)

    steps = _steps(model, list(prompt_ids), max_new_tokens, mode, cache, choose)
    return (token for token, _ in steps)


@dataclass(frozen=True)
class Generation:
    mode: str
    device: str
    dtype: str
    prompt_ids: tuple[int, ...]
    tokens: tuple[int, ...]  # the new tokens only
    first_token_s: float  # prefill + first token: time to first token
    decode_s: float  # the remaining len(tokens) - 1 tokens, one forward each
    decode_tokens_per_s: float  # nan when only one token was asked for
    cache_bytes_held: int  # 0 for naive
    cache_bytes_copied: int
    stopped: bool = False  # ended at a stop token (a chat reply's end of turn), not the count


def generate(
    model: GPT,
    prompt_ids: list[int],
    max_new_tokens: int,
    mode: str = "static",
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    on_token: Callable[[int], None] | None = None,
    stop_ids: Collection[int] = (),
) -> Generation:
    """Run one request to the end; `on_token` sees each token as it is made. `mode` is one
    of MODES or any cache spec (`paged:b16`, ...). A token in `stop_ids` (a chat model's
    end of turn) is the last one made."""
    check_mode(mode)
    check_request(model, prompt_ids, max_new_tokens)  # before sizing a cache for it
    cache = make_cache(mode, model, len(prompt_ids) + max_new_tokens)
    stream = stream_tokens(
        model, prompt_ids, max_new_tokens, mode,
        temperature=temperature, top_k=top_k, generator=generator, cache=cache,
    )  # fmt: skip
    tokens: list[int] = []
    start = time.perf_counter()
    first, outside = start, 0.0  # outside: time spent in on_token, not generating
    for token in stream:
        if not tokens:
            first = time.perf_counter()
        tokens.append(token)
        if on_token is not None:
            before = time.perf_counter()
            on_token(token)
            outside += time.perf_counter() - before
        if token in stop_ids:
            break
    decode_s = time.perf_counter() - first - outside
    n_decoded = len(tokens) - 1
    return Generation(
        mode=str(mode),
        device=str(model.device),
        dtype=str(model.dtype).removeprefix("torch."),
        prompt_ids=tuple(prompt_ids),
        tokens=tuple(tokens),
        first_token_s=first - start,
        decode_s=decode_s,
        decode_tokens_per_s=n_decoded / decode_s if n_decoded else float("nan"),
        cache_bytes_held=cache.bytes_held if cache is not None else 0,
        cache_bytes_copied=cache.bytes_copied if cache is not None else 0,
        stopped=bool(tokens) and tokens[-1] in stop_ids,
    )


# ---------------------------------------------------------------------------- breaks


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


BREAKS = {
    "position-offset": "decode forgets the offset: every new token gets position 0",
    "causal-decode": "is_causal=True for a one-token query: the mask hides all but key 0",
    "stale-cache": "the cache of an earlier request is reused without a reset",
}


class _Diff:
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


def run_break(
    name: str,
    model: GPT,
    prompt_ids: list[int] | None = None,
    max_new_tokens: int = 24,
    *,
    mode: str = "concat",
    earlier_ids: list[int] | None = None,
    progress: BreakProgress | None = None,
) -> BreakResult:
    """Run the correct and the broken loop of one break on the same model, greedily.

    The default cache is `concat`, the article's. (With `static`, `stale-cache` does
    not break: explicit positions overwrite the old request and reads stop at the
    filled prefix.) The bounded caches' breaks (`bounded_breaks`) bring their own.
    `progress` hears of every token made, with the run it belongs to.
    """
    from kvcache_cli.breaks.bounded import BOUNDED_BREAKS, run_bounded_break

    if name in BOUNDED_BREAKS:  # their own caches, a fix and a break
        return run_bounded_break(name, model, prompt_ids, max_new_tokens)
    if name not in BREAKS:
        raise ValueError(f"unknown break {name!r}: expected "
                         f"{', '.join([*BREAKS, *BOUNDED_BREAKS])}")
    if mode not in ("concat", "static"):
        raise ValueError(f"breaks need a cache: mode concat or static, got {mode!r}")
    V = model.config.vocab_size
    # The default prompts are GPT-2 ids; a byte-level model reads the same two texts as
    # bytes, and any other vocabulary (a test's) wraps the ids.
    if model.config.tokenizer == "bytes":
        prompts = [list(text.encode()) for text in DEFAULT_PROMPT_TEXTS]
    else:
        prompts = [[t % V for t in ids] for ids in (DEFAULT_PROMPT_IDS, OTHER_PROMPT_IDS)]
    prompt = list(prompt_ids) if prompt_ids is not None else prompts[0]
    earlier = list(earlier_ids) if earlier_ids is not None else prompts[1]
    check_request(model, prompt, max_new_tokens)
    if name == "stale-cache":
        check_request(model, earlier, max_new_tokens)
    counter = _BreakCounter(progress, (3 if name == "stale-cache" else 2) * max_new_tokens)
    both = "correct and broken loops"  # side by side, a token of each in turn

    def run(label: str, forward: Forward | None = None, cache: KVCache | None = None,
            ids=prompt):
        cache = cache if cache is not None else make_cache(mode, model, len(ids) + max_new_tokens)
        return counter.count(label, _steps(model, ids, max_new_tokens, mode, cache,
                                           _greedy, forward))

    used: tuple[int, ...] = ()
    if name == "position-offset":
        # The one change: start_pos is 0 on every call instead of the token's position.
        broken = run(both, lambda idx, pos, cache, **kw: model(idx, 0, cache, **kw))
    elif name == "causal-decode":
        # The one change: SDPA's is_causal=True on every call, the decode steps included.
        broken = run(both, lambda idx, pos, cache, **kw: model(idx, pos, cache, **kw,
                                                               force_is_causal=True))
    else:  # stale-cache
        window = len(earlier) + len(prompt) + 2 * max_new_tokens
        cache = make_cache(mode, model, min(window, model.config.context))
        for _ in run("request 1, filling the cache", cache=cache, ids=earlier):
            pass
        broken = run(both, cache=cache)  # request 2 on the same cache, no reset
        used = tuple(earlier)
    bug, control = side_by_side(model, prompt, run(both), broken)
    return BreakResult(
        name=name,
        bug=BREAKS[name],
        mode=mode,
        prompt_ids=tuple(prompt),
        earlier_ids=used,
        **compared(bug, control),
    )


def compared(bug: _Diff, control: _Diff) -> dict:
    """The fields every break's result takes from its two comparisons (`side_by_side`)."""
    return dict(correct=tuple(bug.a), broken=tuple(bug.b), first_divergence=bug.first,
                max_logit_diff=max(bug.gaps), step_logit_diff=tuple(bug.gaps),
                naive_logit_diff=max(control.gaps), max_abs_logit=control.scale,
                naive_agrees=control.first is None)


def side_by_side(model: GPT, prompt: list[int], correct: Iterator[tuple[int, Tensor]],
                 broken: Iterator[tuple[int, Tensor]]) -> tuple[_Diff, _Diff]:
    """(correct against broken, correct against a full recompute): the two loops a step of
    each in turn, then the control that says the correct loop's gaps are rounding."""
    control, bug = _Diff(), _Diff()
    correct_logits = []  # each (1, vocab): compared with the full recompute below
    for (tc, lc), (tb, lb) in zip(correct, broken, strict=True):
        bug.add(tc, lc, tb, lb)
        correct_logits.append(lc)
    recomputed = _full_recompute(model, prompt, bug.a)  # (max_new_tokens, vocab)
    for i, (tc, lc) in enumerate(zip(bug.a, correct_logits)):
        ln = recomputed[i : i + 1]  # (1, vocab)
        control.add(tc, lc, int(ln.argmax()), ln)
    return bug, control


def _greedy(logits: Tensor) -> Tensor:
    return logits.argmax(dim=-1)


@torch.inference_mode()
def _full_recompute(model: GPT, prompt: list[int], tokens: list[int]) -> Tensor:
    """The logits a full recompute (the naive loop) chooses each token from, all in one
    forward: causal attention makes row t of a forward over the whole sequence exactly the
    last row of a fresh forward over its first t + 1 tokens. One forward, not one per token:
    the naive loop's cost grows with the square of the length (minutes at 1,000 tokens)."""
    ids = torch.tensor([prompt + tokens[:-1]], dtype=torch.long, device=model.device)  # (1, T)
    return model(ids, 0, None)[0, len(prompt) - 1 :]  # (len(tokens), vocab)


class _BreakCounter:
    """Counts the tokens of a break's runs for `progress` (which may be None)."""

    def __init__(self, progress: BreakProgress | None, total: int):
        self.progress, self.total, self.done = progress, total, 0

    def count(self, label: str, steps: Iterator[tuple[int, Tensor]]):
        for step in steps:
            self.done += 1
            if self.progress is not None:
                self.progress(label, self.done, self.total)
            yield step


# ---------------------------------------------------------------------------- tokenizer


