"""The runners `break_registry` names for the GPT-2 breaks that need more than `run_break`:
each sets up what its break needs from the loaded model and calls the module that owns it.

Every runner is called `runner(name, model, max_new_tokens=..., progress=...)`.
"""

from __future__ import annotations

from kvcache_cli.breaks.registry import QUANT_BREAK_TOKENS
from kvcache_cli.generate import DEFAULT_PROMPT_IDS, stream_tokens


def no_rollback(name: str, model, max_new_tokens: int = 16, progress=None):
    """The target's first half drafts for it: every step proposes K tokens, and the
    rejected ones are what the broken loop keeps."""
    from kvcache_cli.speculative import decode as sp

    half = model.config.n_layer // 2
    prompt = [t % model.config.vocab_size for t in DEFAULT_PROMPT_IDS]
    draft = (sp.make_draft(sp.parse_draft(f"layers:{half}"), model,
                           len(prompt) + max_new_tokens) if half else sp.LookupDraft())
    return sp.run_no_rollback(model, prompt, max_new_tokens, draft)


def rollback_shared(name: str, model, max_new_tokens: int = 16, progress=None):
    from kvcache_cli.speculative.decode import run_rollback_shared

    return run_rollback_shared(model, max_new_tokens)


def quantised(name: str, model, max_new_tokens: int = 16, progress=None):
    """A quantised-cache break, scored on the default prompt and the exact cache's greedy
    continuation of it (a text every model has, offline)."""
    from kvcache_cli.breaks.quantized import run_quant_break

    V = model.config.vocab_size
    prompt = [t % V for t in DEFAULT_PROMPT_IDS]
    n = min(max(max_new_tokens, QUANT_BREAK_TOKENS), model.config.context - len(prompt))
    text = prompt + list(stream_tokens(model, prompt, n, "static"))
    return run_quant_break(name, model, text, len(prompt))
