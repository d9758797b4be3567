"""The `kvcache` command line: thin commands that parse, call, and render.

Every command computes a result object (from the reference script, `sizing`,
`generate` or `bench`) and hands it to a renderer: rich for people, `--json`
for programs. One module per command (`demo`, `breaks`, `size`, `models`, `caches`,
`bench`, `serve`, `generate`, `eval`, `compress`); what they share by what it serves: `options`,
`loading` (the model), `refusals` (the error line), `output`. A command's module
is imported only when that command runs (`kvcache --help` imports none of them), and
torch and transformers only inside the commands that need them, so `kvcache --help`,
`size` and `demo` start fast.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import importlib
import sys
from collections.abc import Iterator, Mapping
from typing import Annotated, NamedTuple

import typer
from typer.core import TyperGroup

from kvcache_cli import __version__

# Typer re-exports click's BadParameter; its base is click's UsageError, whichever
# click (vendored in typer >= 0.29, or the click package before) is in use.
_UsageError = typer.BadParameter.__bases__[0]


class _Command(NamedTuple):
    module: str  # under kvcache_cli.cli
    function: str
    # The line `kvcache --help` shows: it is listed without importing the module. Written
    # out where the docstring's first sentence would not fit the line (click would cut it
    # with "..."); a test checks each against the loaded command's own.
    short_help: str


# In the order `kvcache --help` lists them: the NumPy reference first, then real models.
COMMANDS = {
    "demo": _Command("demo", "demo", "Run the reference script's demos on the NumPy toy."),
    "break": _Command("breaks", "break_", "Break the cache on purpose and watch the symptom."),
    "size": _Command("size", "size", "How big the KV cache is for a model, and what fits."),
    "models": _Command("models", "models", "List the model presets with their published shapes."),
    "caches": _Command("caches", "caches",
                       "List the cache kinds --cache accepts, and how each rolls back."),
    "bench": _Command("bench", "bench", "Time every decode step of every mode against the limit."),
    "serve": _Command("serve", "serve",
                      "Serve a workload: paged + continuous batching, and others."),
    "generate": _Command("generate", "generate",
                         "Generate with a model and its KV cache, streaming tokens."),
    "eval": _Command("eval", "eval_",
                     "Score caches against the exact one: perplexity, KL, bytes."),
    "compress": _Command("compress", "compress",
                         "What compressing a prompt's cache keeps, and what it costs."),
}


def _is_float(text: str) -> bool:
    from kvcache_cli import numbers

    return numbers.is_decimal(text) or text.lower() in ("nan", "inf", "infinity")


def _ascii_number(kind):
    """Click's int or float type (a range too) reading only what `numbers` reads: ASCII
    digits, of a bounded length. Click converts with int() and float(), which take '١٢'
    as 12 and raise Python's own advice past 4,300 digits. 'nan' and 'inf' pass to the
    command, whose range names them. Any other type is returned as it is."""
    from kvcache_cli import numbers

    # By class, as click's own names for them differ between releases ('int', 'integer').
    classes = {c.__name__ for c in type(kind).__mro__}
    reads, called = ((numbers.is_whole, "integer") if "IntParamType" in classes
                     else (_is_float, "float") if "FloatParamType" in classes
                     else (None, ""))
    if reads is None:
        return kind

    class Ascii(type(kind)):
        def convert(self, value, param, ctx):
            if isinstance(value, str) and not reads(value.strip().removeprefix("-")):
                # click's own words, which `usage_message` turns into the project's line.
                self.fail(f"{value!r} is not a valid {called}.", param, ctx)
            return super().convert(value, param, ctx)

    ascii_kind = copy.copy(kind)
    ascii_kind.__class__ = Ascii
    return ascii_kind


class _LazyCommands(Mapping):
    """The root group's commands, each built from its module on first lookup.

    Click looks a command up by name only to run it (or its --help), so `kvcache size`
    imports the size module and no other; listing the names (`--help`, the "Did you mean"
    suggestions) needs none of them.
    """

    def __init__(self) -> None:
        self._built: dict[str, typer.core.TyperCommand] = {}

    def __getitem__(self, name: str):
        if name not in self._built:
            entry = COMMANDS[name]
            function = getattr(importlib.import_module(f"kvcache_cli.cli.{entry.module}"),
                               entry.function)
            one = typer.Typer(rich_markup_mode=None, add_completion=False)
            one.command(name, short_help=entry.short_help)(function)
            # A Typer of one command and no callback builds that command itself.
            command = typer.main.get_command(one)
            for param in command.params:
                param.type = _ascii_number(param.type)
                if hasattr(param.type, "case_sensitive"):
                    # Names are read as cache specs are, in any case: FP16 is fp16.
                    param.type.case_sensitive = False
            self._built[name] = command
        return self._built[name]

    def __iter__(self) -> Iterator[str]:
        return iter(COMMANDS)

    def __len__(self) -> int:
        return len(COMMANDS)


class _OneLineErrors(TyperGroup):
    """Report a bad option or argument as one line on stderr, exit status 2, and load
    each command only when it is used.

    Click's default is a usage block plus a boxed message; a user who typed
    `--layers abc` needs only the value and what was expected.
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.commands = _LazyCommands()

    def format_commands(self, ctx, formatter) -> None:
        # Click's own listing builds every command for its one-line help: list the
        # table's lines instead, as click lays them out.
        with formatter.section("Commands"):
            formatter.write_dl([(name, entry.short_help) for name, entry in COMMANDS.items()])

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
            from kvcache_cli.cli.refusals import on_stderr, usage_message

            hint = f" (see '{error.ctx.command_path} --help')" if error.ctx else ""
            typer.echo(on_stderr(f"error: {usage_message(error)}{hint}"), err=True)
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
