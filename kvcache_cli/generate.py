"""Generation with any family's model: prefill, decode, the naive loop and every cache.

Modes: `naive` runs the full forward over the whole sequence for every token;
`concat` and `static` prefill the prompt once and then decode one token per forward
against a cache (`caches.ConcatCache`, `caches.StaticCache`). All three pick the same
greedy tokens (the breaks, in `breaks/`, change one call of this loop).
Reference: the GPT-2 KV-cache article in `seeds/003_*`, section 5.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from operator import itemgetter

import torch
from torch import Tensor

from kvcache_cli.caches import MODES, CacheSpec, KVCache, make_cache
from kvcache_cli.caches.step import Step
from kvcache_cli.models.base import FamilyConfig, FamilyModel

# A step's forward: (tokens (B, T), start_pos, cache, **options) -> logits (B, T', vocab),
# GPT.forward itself or a broken stand-in for it.
Forward = Callable[..., Tensor]

# ---------------------------------------------------------------------------- checks


def check_mode(spec: str | CacheSpec) -> None:
    """A spec is `naive` (no cache: every position recomputed) or a cache spec: parsed (a
    `CacheSpec`, as the CLI passes it) or its text (`static`, `concat`, `paged:b16`, ...: see
    caches.spec); anything else is a ValueError."""
    from kvcache_cli.caches.grammar import CacheSpecError
    from kvcache_cli.caches.spec import parse_cache_spec

    if spec == "naive" or isinstance(spec, CacheSpec):
        return
    try:
        parse_cache_spec(str(spec))
    except CacheSpecError as err:
        raise ValueError(f"unknown mode {str(spec)!r}: expected {', '.join(MODES)} or a cache "
                         f"spec ({err})") from None


def check_request(model: FamilyModel, prompt_ids: list[int], max_new_tokens: int) -> None:
    """Refuse, before any work, a request the model cannot serve."""
    check_request_config(model.config, prompt_ids, max_new_tokens)


def check_request_config(config: FamilyConfig, prompt_ids: list[int], max_new_tokens: int
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
    probs = probabilities(logits.float(), temperature, top_k)  # (B, vocab)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def probabilities(logits: Tensor, temperature: float, top_k: int | None) -> Tensor:
    """Logits (n, vocab) -> the distribution (n, vocab) sampling draws from, in the logits'
    dtype: scaled by 1 / temperature, all but the top_k most likely masked out."""
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]  # (n, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.softmax(logits, dim=-1)


# On a generator, inference_mode holds while the generator runs, not while its caller does.
@torch.inference_mode()
def token_steps(
    model: FamilyModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    spec: str,
    cache: KVCache | None,
    choose: Callable[[Tensor], Tensor],
    forward: Forward | None = None,
) -> Iterator[tuple[int, Tensor]]:
    """(token, the logits it was chosen from) per step; the loop behind every mode."""
    forward = forward if forward is not None else model
    idx = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)  # (1, T)
    P = idx.size(1)
    if spec == "naive":
        for i in range(max_new_tokens):
            # No cache: the whole sequence goes through the model again, every step.
            logits = forward(idx, 0, None, last_only=True)[:, -1]  # (1, vocab)
            nxt = choose(logits)  # (1,)
            yield int(nxt.item()), logits  # .item() waits for the device: the sync point
            if i + 1 < max_new_tokens:
                idx = torch.cat([idx, nxt.view(1, 1)], dim=1)  # (1, T + 1)
        return
    logits = forward(idx, 0, cache, last_only=True)[:, -1]  # (1, vocab): the prefill
    for i in range(max_new_tokens):
        nxt = choose(logits)  # (1,)
        yield int(nxt.item()), logits
        if i + 1 < max_new_tokens:  # the last token is never fed back
            # Decode: one token at position P + i, attending over the cache.
            logits = forward(nxt.view(1, 1), P + i, cache, last_only=True)[:, -1]


class CompiledDecode:
    """One decode step compiled whole, as gpt-fast compiles it; the prefill runs eager.

    The step is one graph at every position, so it compiles once and never breaks:
    the cache is static and read whole (`StaticCache(whole=True)`: one shape at every
    step; a sliding layer's ring, `RingCache(whole=True)`, every slot under the mask of
    the positions it holds), the position enters as a tensor, never as a Python int (an
    int is a guard, and each new value a recompile), and nothing inside the graph reads
    or writes a Python number: the cache records each write after the graph
    (`advance`). The step is the model's own forward, with a `Step` whose position is a
    tensor (the cache then writes with `write_at` / `attend_at`), so every family
    compiles the same way. Called as a `Forward`; T > 1 tokens (the prefill) go to the
    eager model. On CUDA the caches' buffers are marked as static addresses, so the step
    (mode "reduce-overhead") replays as one CUDA graph.
    """

    def __init__(self, model: FamilyModel, mode: str = "default"):
        from kvcache_cli.models.linear import pin_threads

        self.model = pin_threads(model)
        self.step = torch.compile(_decode_step, mode=mode, fullgraph=True, dynamic=False)

    def __call__(self, idx: Tensor, start_pos: int, cache: KVCache | None,
                 last_only: bool = False) -> Tensor:
        if idx.size(1) > 1:
            return self.model(idx, start_pos, cache, last_only=last_only)
        if cache is None or not cache.whole or not hasattr(cache, "advance"):
            raise ValueError("a compiled decode step reads a static cache whole (and a "
                             "sliding layer's ring): make_cache('static', ..., whole=True)")
        pos = torch.tensor([start_pos], device=idx.device)  # (1,): the position as data
        logits = self.step(self.model, idx, Step(pos, pos), cache)  # (B, 1, vocab)
        cache.advance(start_pos, 1)
        return logits


def _decode_step(model: FamilyModel, idx: Tensor, step: Step, cache: KVCache) -> Tensor:
    """Logits (B, T, vocab) of tokens idx (B, T) at positions step.pos (T,), every row at
    the same positions, written into and read from a whole static cache."""
    return model(idx, step, cache)


def stream_tokens(
    model: FamilyModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    spec: str | CacheSpec,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    cache: KVCache | None = None,
    forward: Forward | None = None,
) -> Iterator[int]:
    """Yield each new token id as soon as it is chosen.

    The first yield comes right after the prefill (time to first token), each later
    one after one decode step. Checks run now, before the first `next()`. Without a
    `cache`, a fresh one is made for the request (sized prompt + new tokens for
    `static`); pass one to read its `bytes_copied` afterwards. `forward` stands in for
    the model's own (a `CompiledDecode`).
    """
    _check_generation(model, prompt_ids, max_new_tokens, spec, temperature, top_k)
    if spec == "naive" and cache is not None:
        raise ValueError("mode naive uses no cache")
    if spec != "naive" and cache is None:
        cache = make_cache(spec, model, len(prompt_ids) + max_new_tokens)
    return _tokens(model, prompt_ids, max_new_tokens, spec, cache,
                   temperature, top_k, generator, forward)


def _check_generation(model: FamilyModel, prompt_ids: list[int], max_new_tokens: int,
                      spec: str | CacheSpec, temperature: float, top_k: int | None) -> None:
    """Every check of a request, once per call of `stream_tokens` or `generate`."""
    check_mode(spec)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    check_request(model, prompt_ids, max_new_tokens)


def _tokens(model: FamilyModel, prompt_ids: list[int], max_new_tokens: int,
            spec: str | CacheSpec, cache: KVCache | None, temperature: float,
            top_k: int | None, generator: torch.Generator | None,
            forward: Forward | None) -> Iterator[int]:
    """The new token ids of a checked request, one per step."""

    def choose(logits: Tensor) -> Tensor:
        return sample(logits, temperature, top_k, generator)

    steps = token_steps(model, list(prompt_ids), max_new_tokens, spec, cache, choose, forward)
    return map(itemgetter(0), steps)  # the tokens, the logits dropped


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
    model: FamilyModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    spec: str | CacheSpec = "static",
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    on_token: Callable[[int], None] | None = None,
    stop_ids: Collection[int] = (),
) -> Generation:
    """Run one request to the end; `on_token` sees each token as it is made. `spec` is one
    of MODES or any cache spec (`paged:b16`, ...). A token in `stop_ids` (a chat model's
    end of turn) is the last one made."""
    # Before sizing a cache for it.
    _check_generation(model, prompt_ids, max_new_tokens, spec, temperature, top_k)
    cache = make_cache(spec, model, len(prompt_ids) + max_new_tokens)
    stream = _tokens(model, prompt_ids, max_new_tokens, spec, cache,
                     temperature, top_k, generator, None)
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
        mode=str(spec),
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


