"""What `generate` and `bench` share for speculative decoding: `--draft` and `--speculate`
checked before any model loads, the draft built after, and the run's rendering."""

from __future__ import annotations

from typing import Annotated

import typer

from kvcache_cli import numbers
from kvcache_cli.cli.loading import load_model
from kvcache_cli.cli.refusals import fail

DraftOption = Annotated[str | None, typer.Option(
    help="Speculative decoding with this draft: a GPT-2 preset or checkpoint dir (e.g. gpt2 "
         "for gpt2-medium), layers:N (the target's first N layers and its head), or "
         "lookup[:n] (n-gram matches in the context, no model).")]


def parse_ks(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]; each a whole number (its range is checked against the model)."""
    expected = "expected K or a comma-separated list such as 1,2,4,8"
    # Spaces around a K, never inside one: '1 2' is not 12.
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(numbers.is_whole(p) for p in parts):
        fail(f"--speculate {text!r}: {expected}")
    ks = [int(p) for p in parts]
    if len(set(ks)) != len(ks):
        fail(f"--speculate {text!r}: a K is listed twice; {expected}")
    return ks


def check(model: str, draft: str, ks: list[int], cache: str, positions: int | None = None,
          target=None):
    """(DraftSpec, a note or None) for a run about to load `model`; bad input exits 2 here,
    before any weights are read: K, the cache's rollback (and a bounded one's room for it,
    given the request's `positions`), the draft's vocabulary. `target`: the model's config,
    when the command has read it."""
    from kvcache_cli.caches import CacheSpecError
    from kvcache_cli.models import model_config
    from kvcache_cli.speculative.decode import check_speculation
    from kvcache_cli.speculative.drafts import parse_draft

    try:
        spec = parse_draft(draft)
        target = target if target is not None else model_config(model)
        draft_config = model_config(spec.model) if spec.kind == "model" else None
        note = check_speculation(target, spec, draft_config, ks, cache, draft, positions)
    except (ValueError, CacheSpecError) as err:  # RollbackError is a ValueError
        fail(str(err))
    return spec, note


def build(spec, loaded, weights: str, device: str, dtype: str, max_len: int):
    """The draft for a loaded target: a model draft's weights load now."""
    from kvcache_cli.speculative.drafts import make_draft

    draft_model = None
    if spec.kind == "model":
        draft_model = load_model(spec.model, weights, device, dtype).model
    try:
        return make_draft(spec, loaded.model, max_len, draft_model)
    except ValueError as err:
        fail(str(err))
