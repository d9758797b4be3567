"""`kvcache demo`: the reference script's demos, and the listing and panels `break` shares."""

from __future__ import annotations

from typing import Annotated

import typer

from kvcache_cli.cli.output import print_view
from kvcache_cli.cli.refusals import fail


# Shell completion of names: runs only when the shell asks, never at start-up.
def _complete_demo(incomplete: str) -> list[str]:
    import kv_cache_from_scratch as ref

    return [n for n in ["all", *ref.DEMOS] if n.startswith(incomplete)]


def demo(
    name: Annotated[str, typer.Argument(
        help="A demo name, or 'all'.", autocompletion=_complete_demo)] = "all",
    list_: Annotated[bool, typer.Option("--list", help="List the demos and exit.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw result as JSON.")] = False,
) -> None:
    """Run the reference script's demos: macs, exact, mask, memory, gqa, intensity, paged."""
    import kv_cache_from_scratch as ref

    if list_:
        if name != "all":
            fail(f"--list lists every demo: expected no NAME with it, got {name!r}")
        show_list({n: s.title for n, s in ref.DEMOS.items()}, "demos", as_json)
        return
    names = pick(name, ref.DEMOS, "demo")
    model = ref.init_model()
    show({n: (ref.DEMOS[n].title, ref.DEMOS[n].run(model)) for n in names}, as_json)


def pick(name: str, table: dict, kind: str, extra: dict | None = None) -> list[str]:
    """Names to run for NAME or `all`; an unknown name is bad input."""
    valid = [*table, *(extra or {})]
    if name == "all":
        return valid
    if name not in valid:
        from kvcache_cli.sizing.units import nearest

        fail(f"unknown {kind} {name!r}: expected all or one of {', '.join(valid)}"
             + nearest(name, valid))
    return [name]


def show(results: dict[str, tuple[str, object]], as_json: bool) -> None:
    """Print {name: (title, result)}: JSON of the result (or a name → result map), or panels."""
    if as_json:
        from kvcache_cli.views import to_json

        by_name = {name: result for name, (_, result) in results.items()}
        typer.echo(to_json(next(iter(by_name.values())) if len(by_name) == 1 else by_name))
        return
    from kvcache_cli.views.demos import render

    for title, result in results.values():
        print_view(render(title, result))


def show_list(titles: dict[str, str], heading: str, as_json: bool) -> None:
    """`--list`: name → title, as JSON or a table."""
    if as_json:
        from kvcache_cli.views import to_json

        typer.echo(to_json(titles))
        return
    from kvcache_cli.views.demos import listing

    print_view(listing(titles, heading))
