"""The `kvcache` command line: thin commands that parse, call, and render.

Every command computes a result object (from the reference script, `sizing`,
`generate` or `bench`) and hands it to a renderer: rich for people, `--json`
for programs. Torch and transformers are imported inside the commands that
need them, so `kvcache --help`, `size` and `demo` start fast.
"""

from __future__ import annotations

from typing import Annotated

import typer

from kvcache_cli import __version__

app = typer.Typer(
    name="kvcache",
    help="Understand, size and measure the transformer KV cache.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"kvcache {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """Understand, size and measure the transformer KV cache."""


def main() -> None:
    app()
