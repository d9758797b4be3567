"""`kvcache caches`: the cache kinds `--cache` accepts, how to spell each, what each
supports and how it rolls back; read from the registry in `caches.spec`, without torch."""

from __future__ import annotations

from typing import Annotated

import typer


def caches(
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw rows as JSON.")] = False,
) -> None:
    """List the cache kinds: their spelling, whether they are exact, bounded, paged or
    compiled, and whether and how each rolls back k tokens (speculative decoding)."""
    from kvcache_cli.caches.spec import kinds_table

    rows = kinds_table()
    if as_json:
        from kvcache_cli.views import to_json

        typer.echo(to_json(rows))
        return
    from kvcache_cli.cli.common import print_view
    from kvcache_cli.views.caches import kinds_view

    print_view(kinds_view(rows))
