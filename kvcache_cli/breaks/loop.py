"""The article's three loop breaks on any family: a correct cached loop with one call
changed (every decode token at position 0; is_causal on a one-row query; a cache reused
without a reset), run side by side with the correct loop (GPT-2 article, section 5)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from kvcache_cli.breaks.base import (
    DEFAULT_PROMPT_IDS,
    DEFAULT_PROMPT_TEXTS,
    OTHER_PROMPT_IDS,
    BreakCounter,
    BreakProgress,
    BreakResult,
    compared,
    greedy,
    side_by_side,
)
from kvcache_cli.caches import KVCache, make_cache
from kvcache_cli.caches.base import ForwardingCache
from kvcache_cli.caches.step import Step
from kvcache_cli.generate import Forward, check_request, token_steps
from kvcache_cli.models.base import FamilyModel

BREAKS = {
    "position-offset": "decode forgets the offset: every new token gets position 0",
    "causal-decode": "is_causal=True for a one-token query: the mask hides all but key 0",
    "stale-cache": "the cache of an earlier request is reused without a reset",
}


class CausalOnEveryCall(ForwardingCache):
    """`causal-decode`: the cache it wraps, read with SDPA's is_causal=True whatever the
    shapes. SDPA aligns is_causal to the top left, so on a one-row query against S keys
    (the article's bug 2) it lets the newest token see key 0 and nothing else; a square
    prefill is unharmed."""

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, step: Step) -> Tensor:
        keys, values = self.inner.update(layer, step.start, k, v)  # (B, nkv, S, hs)
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True,
                                              enable_gqa=keys.size(1) < q.size(1))


def run_break(
    name: str,
    model: FamilyModel,
    prompt_ids: list[int] | None = None,
    max_new_tokens: int = 24,
    *,
    spec: str = "concat",
    earlier_ids: list[int] | None = None,
    progress: BreakProgress | None = None,
) -> BreakResult:
    """Run the correct and the broken loop of one break on the same model, greedily.

    The default cache is `concat`, the article's. (With `static`, `stale-cache` does
    not break: explicit positions overwrite the old request and reads stop at the
    filled prefix.) The bounded caches' breaks (`breaks.bounded`) bring their own.
    `progress` hears of every token made, with the run it belongs to.
    """
    if name not in BREAKS:
        raise ValueError(f"unknown break {name!r}: expected {', '.join(BREAKS)}")
    if spec not in ("concat", "static"):
        raise ValueError(f"breaks need a cache: mode concat or static, got {spec!r}")
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
    counter = BreakCounter(progress, (3 if name == "stale-cache" else 2) * max_new_tokens)
    both = "correct and broken loops"  # side by side, a token of each in turn

    def run(label: str, forward: Forward | None = None, cache: KVCache | None = None,
            ids=prompt):
        cache = cache if cache is not None else make_cache(spec, model, len(ids) + max_new_tokens)
        return counter.count(label, token_steps(model, ids, max_new_tokens, spec, cache,
                                           greedy, forward))

    used: tuple[int, ...] = ()
    if name == "position-offset":
        # The one change: start_pos is 0 on every call instead of the token's position.
        broken = run(both, lambda idx, pos, cache, **kw: model(idx, 0, cache, **kw))
    elif name == "causal-decode":
        # The one change: SDPA's is_causal=True on every call, the decode steps included.
        broken = run(both, cache=CausalOnEveryCall(make_cache(spec, model, len(prompt)
                                                              + max_new_tokens)))
    else:  # stale-cache
        window = len(earlier) + len(prompt) + 2 * max_new_tokens
        cache = make_cache(spec, model, min(window, model.config.context))
        for _ in run("request 1, filling the cache", cache=cache, ids=earlier):
            pass
        broken = run(both, cache=cache)  # request 2 on the same cache, no reset
        used = tuple(earlier)
    bug, control = side_by_side(model, prompt, run(both), broken)
    return BreakResult(
        name=name,
        bug=BREAKS[name],
        mode=spec,
        prompt_ids=tuple(prompt),
        earlier_ids=used,
        **compared(bug, control),
    )
