"""The `kvcache` command line: thin commands that parse, call, and render.

Every command computes a result object (from the reference script, `sizing`,
`generate` or `bench`) and hands it to a renderer: rich for people, `--json`
for programs. One module per command (`demo`, `breaks`, `size`, `models`, `caches`,
`bench`, `serve`, `generate`, `eval`), what they share in `common`. Torch and
transformers are imported inside the commands that need them, so `kvcache --help`,
`size` and `demo` start fast.
"""

from __future__ import annotations

import contextlib
import errno
import sys
from typing import Annotated

import typer
from typer.core import TyperGroup

from kvcache_cli import __version__
from kvcache_cli.cli import bench, breaks, caches, demo, generate, models, serve, size
from kvcache_cli.cli import eval as eval_command
from kvcache_cli.cli.common import usage_message

# Typer re-exports click's BadParameter; its base is click's UsageError, whichever
# click (vendored in typer >= 0.29, or the click package before) is in use.
_UsageError = typer.BadParameter.__bases__[0]


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
            hint = f" (see '{error.ctx.command_path} --help')" if error.ctx else ""
            typer.echo(f"error: {usage_message(error)}{hint}", err=True)
            sys.exit(2)
        except typer.Abort:
            typer.echo("aborted", err=True)
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    cls=_OneLineErrors,
    name="kvcache",
    help="Understand, size and measure the transformer KV cache.",
    context_settings={"help_option_names": ["-h", "--help"]},
    no_args_is_help=True,
    # --install-completion / --show-completion: typer imports its completion code either
    # way, so offering them costs `kvcache size` no start-up time (measured: 0.13 s CPU both).
    add_completion=True,
    pretty_exceptions_enable=False,
    # Plain click help: typer's rich help imports rich.markdown and pygments, which
    # doubles the start-up of `kvcache --help` (0.45 s against 0.22 s on 2 cores).
    rich_markup_mode=None,
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


# In the order `kvcache --help` lists them: the NumPy reference first, then real models.
# A short_help where the docstring's first sentence would not fit `kvcache --help`'s line:
# click would cut it with "...".
app.command(short_help="Run the reference script's demos on the NumPy toy.")(demo.demo)
app.command("break")(breaks.break_)
app.command(short_help="How big the KV cache is for a model, and what fits.")(size.size)
app.command()(models.models)
app.command()(caches.caches)
app.command(short_help="Time every decode step of every mode against the limit.")(bench.bench)
app.command(short_help="Serve a workload: paged + continuous batching, and others.")(
    serve.serve)
app.command(short_help="Generate with GPT-2 and its KV cache, streaming tokens.")(
    generate.generate)
app.command("eval", short_help="Score caches against the exact one: perplexity, KL, bytes.")(
    eval_command.eval_)


_UNWRITABLE = (errno.EPIPE, errno.ENOSPC, errno.EIO, errno.EBADF)


def main() -> None:
    """The entry point. Output that cannot be written ends quietly, exit 1, never a
    traceback: a reader that went away (`| head`) without a word, as click does for a write
    inside a command; a full disk (`> /dev/full`) with one line on stderr."""
    try:
        try:
            app()
        finally:
            if sys.stdout is not None:
                sys.stdout.flush()
    except OSError as error:
        if error.errno not in _UNWRITABLE:
            raise
        import os

        # Python flushes stdout once more at exit: point it at /dev/null so that is silent.
        devnull = os.open(os.devnull, os.O_WRONLY)
        with contextlib.suppress(OSError, ValueError):
            os.dup2(devnull, sys.stdout.fileno())
        if error.errno == errno.EPIPE:
            sys.exit(1)
        sys.stderr.write(f"error: cannot write the output: {error.strerror}\n")
        sys.exit(1)
