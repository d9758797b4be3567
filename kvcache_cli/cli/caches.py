"""`kvcache caches`: the cache kinds `--cache` accepts, how to spell each, and what each
supports; read from the registry in `caches.spec`, without torch."""

from __future__ import annotations

from typing import Annotated

import typer


def caches(
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw list as JSON.")] = False,
) -> None:
    """List the cache kinds --cache accepts, and what each supports."""
    from kvcache_cli.caches.spec import KINDS

    rows = [{"name": k.name, "spell": k.grammar, "aliases": list(k.aliases),
             "summary": k.summary, "exact": k.exact, "bounded": k.bounded, "pages": k.pages,
             "compiles": k.compiles, "rollback": k.rollback} for k in KINDS.values()]
    if as_json:
        from kvcache_cli.views import to_json

        typer.echo(to_json(rows))
        return
    from kvcache_cli.cli.common import print_view
    from kvcache_cli.views.caches import kinds_view

    print_view(kinds_view(rows))
