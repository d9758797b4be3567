"""The `kvcache` command line: thin commands that parse, call, and render.

Every command computes a result object (from the reference script, `sizing`,
`generate` or `bench`) and hands it to a renderer: rich for people, `--json`
for programs. Torch and transformers are imported inside the commands that
need them, so `kvcache --help`, `size` and `demo` start fast.
"""

from __future__ import annotations

import sys
from typing import Annotated, NoReturn

import typer
from typer.core import TyperGroup

from kvcache_cli import __version__

# Typer re-exports click's BadParameter; its base is click's UsageError, whichever
# click (vendored in typer >= 0.29, or the click package before) is in use.
_UsageError = typer.BadParameter.__bases__[0]


def _typed_value(error: Exception) -> object | None:
    """The raw text a user typed, when the type conversion kept it (pydantic does)."""
    errors = getattr(error.__cause__, "errors", None)
    if callable(errors):
        details = errors()
        if details and "input" in details[0]:
            return details[0]["input"]
    return None


class _OneLineErrors(TyperGroup):
    """Report a bad option or argument as one line on stderr, exit status 2.

    Click's default is a usage block plus a boxed message; a user who typed
    `--layers abc` needs only the value and what was expected.
    """

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except _UsageError as error:
            if type(error).__name__ == "NoArgsIsHelpError":
                # Plain `kvcache` asks for the help, not an error.
                error.show()
                sys.exit(2)
            typed = _typed_value(error)
            hint = f" (got {typed!r})" if typed is not None else ""
            hint += f" (see '{error.ctx.command_path} --help')" if error.ctx else ""
            typer.echo(f"error: {error.format_message()}{hint}", err=True)
            sys.exit(2)
        except typer.Abort:
            typer.echo("aborted", err=True)
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)


def fail(message: str, code: int = 2) -> NoReturn:
    """The one way a command reports an error: one line on stderr, then exit.

    Code 2 is bad input (the user can fix the command line); 1 is a failure at
    run time.
    """
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


app = typer.Typer(
    cls=_OneLineErrors,
    name="kvcache",
    help="Understand, size and measure the transformer KV cache.",
    context_settings={"help_option_names": ["-h", "--help"]},
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
