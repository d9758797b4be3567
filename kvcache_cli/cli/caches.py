"""`kvcache caches`: the cache kinds `--cache` accepts, how to spell each, what each
supports and how it rolls back; read from the registry in `caches.spec`, without torch."""

from __future__ import annotations

from typing import Annotated

import typer


def caches(
    kinds: Annotated[list[str] | None, typer.Argument(
        help="Kinds to show (e.g. int4 window); default: every kind.", show_default=False)
    ] = None,
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="A preset, a model kvcache runs (gemma3) or a config.json: "
        "which of its layers a --cache spec holds (a sliding layer holds its window).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw rows as JSON.")] = False,
) -> None:
    """List the cache kinds: their spelling, whether they are exact, bounded, paged or
    compiled, and whether and how each rolls back k tokens (speculative decoding)."""
    from kvcache_cli.caches.spec import KINDS, kinds_table, names, parse_cache_spec

    layers = None if model is None else _spec_layers(model)
    rows = kinds_table()
    if kinds:
        # A kind by any name a spec may start with (full is static), with fields or not.
        asked = [k.split(":", 1)[0].strip().lower() for k in kinds]
        unknown = next((k for k in asked if k not in names()), None)
        if unknown is not None:
            from kvcache_cli.cli.refusals import fail

            fail(f"unknown cache kind {unknown!r}: expected one of {', '.join(names())}")
        wanted = {k if k in KINDS else parse_cache_spec(k).kind for k in asked}
        rows = tuple(r for r in rows if r.name in wanted)
    if as_json:
        from kvcache_cli.views import to_json

        typer.echo(to_json(rows if layers is None else {"kinds": rows, "layers": layers}))
        return
    from kvcache_cli.cli.output import print_view
    from kvcache_cli.eval import peer_hf, peer_llama_cpp
    from kvcache_cli.views.caches import kinds_view

    peers = (f"eval --cache also takes the peers' own caches, each in its own engine on the "
             f"same weights: {peer_llama_cpp.GRAMMAR} (TYPE: "
             f"{', '.join(peer_llama_cpp.KV_TYPES)}; llama.cpp on the model's GGUF), and "
             f"{peer_hf.GRAMMAR} (transformers' LlamaForCausalLM with its QuantizedCache)",)
    print_view(kinds_view(rows, peers, layers))


def _spec_layers(model: str):
    """Which layers of `model` a spec holds; one line and exit 2 for a model not found."""
    from kvcache_cli import sizing
    from kvcache_cli.cli.refusals import fail
    from kvcache_cli.models.live import is_live, live_shape
    from kvcache_cli.sizing.cache_spec import spec_layers

    try:
        if is_live(model):
            shape = live_shape(model)[0]
        elif model.endswith(".json") or "/" in model:  # a config.json or its folder
            shape = sizing.resolve_shape(None, model)[0]
        else:
            shape = sizing.resolve_shape(model)[0]
    except ValueError as err:
        fail(str(err))
    return spec_layers(shape)
