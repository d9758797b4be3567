"""`kvcache models`: the model presets with their published shapes."""

from __future__ import annotations

from typing import Annotated

import typer

from kvcache_cli.cli.output import print_view
from kvcache_cli.cli.refusals import fail


def models(
    dtype: Annotated[str, typer.Option(help="Cache dtype for the per-token column.")] = "fp16",
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw list as JSON.")] = False,
) -> None:
    """List the model presets with their published shapes."""
    from kvcache_cli import sizing

    try:
        rows = sizing.list_models(dtype)
    except ValueError as err:
        fail(str(err))
    if as_json:
        from kvcache_cli.views import to_json

        typer.echo(to_json(rows))
        return
    from kvcache_cli.views.sizing import models_view

    print_view(models_view(rows))
