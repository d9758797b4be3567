"""What the commands share: the one error line, the torch extra's checks, option types,
loading GPT-2, and printing a result before its plot.

Nothing here imports torch at module level: `kvcache size` and `demo` import this module.
"""

from __future__ import annotations

import re
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer


def fail(message: str, code: int = 2) -> NoReturn:
    """The one way a command reports an error: one line on stderr, then exit.

    Code 2 is bad input (the user can fix the command line); 1 is a failure at
    run time.
    """
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


# Click's own messages for a value it refuses, and the project's line for each: the option,
# the value as typed, what was expected. Matched by text, as click keeps no value on the error;
# compiled only when an error is shown (re caches them), never at start-up.
_CLICK_MESSAGES = (
    (r"'(?P<v>.*)' is not one of (?P<c>.*)\.$", "choice"),
    (r"'(?P<v>.*)' is not a valid (int|integer)( range)?\.$", "a whole number"),
    (r"'(?P<v>.*)' is not a valid float( range)?\.$", "a number"),
    (r"'(?P<v>.*)' is not a valid boolean\.$", "true or false"),
    (r"(?P<v>.*) is not in the range (?P<r>.*)\.$", "range"),
)


def _range_words(bounds: str) -> str:
    """click's 'x>=1', '0<=x<=9', 'x>0' → '1 or more', 'from 0 to 9', 'more than 0'."""
    m = re.fullmatch(r"(?:(?P<lo>[-\d.]+)(?P<lop><=?))?x(?:(?P<hip><=?)(?P<hi>[-\d.]+))?"
                     r"|x(?P<gop>>=?)(?P<g>[-\d.]+)", bounds)
    if m is None:
        return bounds
    if m["g"] is not None:
        return f"{_figure(m['g'])} or more" if m["gop"] == ">=" else f"more than {_figure(m['g'])}"
    if m["lo"] is not None and m["hi"] is not None:
        return f"from {_figure(m['lo'])} to {_figure(m['hi'])}"
    if m["hi"] is not None:
        return f"{_figure(m['hi'])} or less" if m["hip"] == "<=" else f"less than {m['hi']}"
    return bounds


def _figure(text: str) -> str:
    return f"{int(text):,}" if text.lstrip("-").isdigit() else text


def usage_message(error) -> str:
    """One line for a usage error click raised: `--dtype 'fp64': expected one of fp32, ...`,
    `--seq '32k': expected a whole number`, `unknown option --promt (did you mean ...)`."""
    import difflib

    message = error.message.strip()
    param = getattr(error, "param", None)
    name = type(error).__name__
    if name == "NoSuchOption":
        # click's near misses, closest first.
        close = difflib.get_close_matches(error.option_name,
                                          getattr(error, "possibilities", None) or [], cutoff=0)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        return f"unknown option {error.option_name}{hint}"
    if message.endswith("requires an argument.") and getattr(error, "option_name", None):
        return f"{error.option_name}: expected a value after it"
    extra = re.fullmatch(r"Got unexpected extra argument(?:s|\(s\))? \((?P<a>.*)\)", message)
    if extra:
        return (f"unexpected argument(s) {extra['a']!r}: expected no more arguments; "
                "quote a value that holds spaces")
    if param is None:
        return message[:1].lower() + message[1:].rstrip(".")
    opts = [o for o in getattr(param, "opts", []) if o.startswith("--")]
    opt = opts[0] if opts else param.human_readable_name
    if name == "MissingParameter":
        return f"{opt}: expected a value"
    for pattern, expected in _CLICK_MESSAGES:
        m = re.match(pattern, message)
        if m is None:
            continue
        value = m["v"]
        if expected == "choice":
            choices = [c.strip().strip("'") for c in m["c"].split(",")]
            close = difflib.get_close_matches(value.lower(), choices, n=2, cutoff=0.6)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            return f"{opt} {value!r}: expected one of {', '.join(choices)}{hint}"
        if expected == "range":
            kind = "a number" if "float" in getattr(param.type, "name", "") else "a whole number"
            words = _range_words(m["r"])
            return f"{opt} {value}: expected {kind}{'' if words[:4] == 'from' else ','} {words}"
        return f"{opt} {value!r}: expected {expected}"
    return f"{opt}: {message}"


def defaults_in(ctx, message: str) -> str:
    """MESSAGE with a note for each option it names that the user did not type: a
    refusal must not read as if the user had given the default."""
    shown = []
    for param in ctx.command.params:
        flag = next((o for o in param.opts if o.startswith("--")), None)
        # By name: click's enum is vendored by later typer releases.
        source = getattr(ctx.get_parameter_source(param.name), "name", "DEFAULT")
        if (flag and source == "DEFAULT"
                and re.search(rf"{re.escape(flag)}(?![\w-])", message)):
            shown.append(flag)
    if not shown:
        return message
    return f"{message} ({', '.join(shown)}: the default, not given)"


# --- the torch extra ----------------------------------------------------------------

# What the GPT-2 loader may import: torch always, safetensors for a checkpoint folder,
# huggingface_hub for the pretrained weights. All come with the torch extra.
GPT2_MODULES = ("torch", "safetensors", "huggingface_hub")


def torch_extra_missing(who_needs: str, *modules: str) -> str | None:
    """One line naming the missing MODULES and the install command, or None if none is missing.

    WHO_NEEDS starts the sentence ("kvcache bench needs"). find_spec locates a module
    without importing it, so the check costs no start-up time.
    """
    from importlib.util import find_spec

    missing = [name for name in modules if find_spec(name) is None]
    if not missing:
        return None
    names = ", ".join(missing[:-1]) + " and " + missing[-1] if len(missing) > 1 else missing[0]
    verb = "is" if len(missing) == 1 else "are"
    from kvcache_cli import TORCH_INSTALL

    return f"{who_needs} {names}, which {verb} not installed: {TORCH_INSTALL}"


def need_torch_extra(who_needs: str, *modules: str) -> None:
    """Fail in one line, exit 2, when modules of the torch extra are missing."""
    message = torch_extra_missing(who_needs, *modules)
    if message is not None:
        fail(message)


# --- option types ---------------------------------------------------------------------

# The options bench and serve share: where to run, and which GPT-2.
DeviceOption = Annotated[str, typer.Option(help="cpu, cuda, or auto (cuda when there is one).")]
ModelOption = Annotated[str, typer.Option(
    "--model", "-m", help="gpt2, gpt2-medium, gpt2-large, gpt2-xl, stdlib-bytes (shipped) or a "
    "checkpoint dir.")]


# Choices as str Enums: the one way every typer version (>= 0.12) lists and checks them.
class Device(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


class Weights(str, Enum):
    auto = "auto"
    pretrained = "pretrained"
    random = "random"


class DType(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

# A str, not an Enum, so an unknown value gets the project's one line (with the choices).
WeightsDTypeOption = Annotated[str | None, typer.Option(
    "--weights-dtype",
    help="How the products' matrices are stored: fp32, bf16, fp16, int8 (weight-only, "
    "one scale per output channel, gpt-fast's; CPU only), or q4 (a GGUF's own Q4_0/Q4_1 "
    "blocks, not re-quantised; CPU only). Default: --dtype's. Another "
    "format than float32 is checked against float32: logits' error, greedy tokens.")]

# OpenMP allocates per thread up front: a billion threads aborts the process.
MAX_THREADS = 1024


def threads_error(threads: int | None) -> str | None:
    """What is wrong with --threads, or None."""
    if threads is not None and not 1 <= threads <= MAX_THREADS:
        return f"--threads {threads:,}: expected a whole number from 1 to {MAX_THREADS:,}"
    return None


# Shell completion of names: these run only when the shell asks, never at start-up.
def complete_preset(incomplete: str) -> list[str]:
    from kvcache_cli.sizing import PRESETS

    return [n for n in PRESETS if n.startswith(incomplete)]


# --- cache specs --------------------------------------------------------------------------


def parse_cache_option(value):
    """--cache's text → a `CacheSpec`, parsed once by `caches.spec` as the option is read, so
    every command refuses the same mistakes with the same line. The registry is imported
    only when the option is given."""
    from kvcache_cli.caches.spec import CacheSpec, CacheSpecError, parse_cache_spec

    if isinstance(value, CacheSpec):
        return value
    try:
        return parse_cache_spec(value)
    except CacheSpecError as err:
        raise typer.BadParameter(str(err)) from None


def complete_cache(incomplete: str) -> list[tuple[str, str]]:
    """Every kind whose name starts with INCOMPLETE, with its one-line summary."""
    from kvcache_cli.caches.spec import KINDS

    return [(kind.name, kind.summary) for kind in KINDS.values()
            if kind.name.startswith(incomplete.lower())]


def check_cache_for(spec, model: str) -> None:
    """Refuse, before the weights load, a bounded cache whose budget passes the model's
    context window, and a quantised one whose groups do not fit its heads (both read from
    its preset or config.json alone)."""
    from kvcache_cli.caches.spec import CacheSpecError, check_context, check_spec
    from kvcache_cli.models import model_config

    try:
        config = model_config(model)
    except ValueError:
        return  # not a model: the loader says so in its own words
    try:
        check_context(spec, config.context, model)
        check_spec(spec, config.head_size)
    except CacheSpecError as err:
        fail(str(err))


def parse_cache_list_option(value):
    """A comma list of specs (`eval` compares several caches in one run) → `CacheSpec`s,
    parsed by `caches.spec` as the option is read, refused in the same words as --cache."""
    from kvcache_cli.caches.spec import CacheSpecError, parse_cache_list

    if isinstance(value, list):
        return value
    try:
        return parse_cache_list(value)
    except CacheSpecError as err:
        raise typer.BadParameter(str(err)) from None


def complete_cache_list(incomplete: str) -> list[tuple[str, str]]:
    """The kinds that may follow the last comma of INCOMPLETE, the list so far kept."""
    done, comma, last = incomplete.rpartition(",")
    return [(done + comma + name, summary) for name, summary in complete_cache(last)]


# The option every command that builds a cache takes: a `CacheSpec`, or None when not given.
# Typed Any: the spec's class is imported with the registry, after start-up.
CacheOption = Annotated[Any, typer.Option(
    "--cache", parser=parse_cache_option, metavar="SPEC", autocompletion=complete_cache,
    help="The KV cache: a kind and its fields, e.g. static, concat, paged:b16, window:256, "
    "sink:4+252, h2o:128+128 (every kind: 'kvcache caches'). The bounded ones keep each "
    "key's absolute position, so they run within the model's context window.")]


# --- GPT-2 on torch -------------------------------------------------------------------


def torch_device(device: str) -> str:
    """Check --device before loading anything: no CUDA is bad input, in one line."""
    import torch

    if device not in ("cpu", "cuda"):
        fail(f"--device {device!r}: expected cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        fail(f"--device cuda: CUDA is not available (torch {torch.__version__}); use --device cpu")
    return device


def load_model(model: str, weights: str, device: str, dtype: str = "fp32"):
    """Any family's model (`models.load_model`) with its errors as one line; its note
    (random weights...) on stderr."""
    import torch

    from kvcache_cli import models

    try:
        loaded = models.load_model(model, weights, device, getattr(torch, TORCH_DTYPES[dtype]))
    except ValueError as err:
        fail(str(err))
    except (RuntimeError, OSError) as err:
        fail(str(err), code=1)
    if loaded.note:
        typer.echo(f"note: {loaded.note}", err=True)
    return loaded


def check_weights_dtype(weights_dtype: str | None, model: str, device: str) -> None:
    """Refuse an unknown or unrunnable --weights-dtype before any weights load."""
    if weights_dtype is None:
        return
    from kvcache_cli import gpt2
    from kvcache_cli.models import family_of, model_config

    try:
        types = None
        if weights_dtype == "q4" and family_of(model) == "llama":
            from kvcache_cli.models.loading import source_types

            types = source_types(model)
        gpt2.check_weights_dtype(weights_dtype, model_config(model), device, types)
    except ValueError as err:
        fail(f"--weights-dtype: {err}")


def with_weights_dtype(loaded, weights_dtype: str | None):
    """(the loaded model in --weights-dtype, the float32 model to check it against, or None).

    The float32 reference exists only where the format differs from it; it is the
    weights as loaded, so both hold the same function up to the format's rounding.
    """
    import copy

    import torch

    from kvcache_cli import gpt2

    model = loaded.model
    fmt = weights_dtype or gpt2.weights_format(model)
    if fmt == "fp32" and model.dtype == torch.float32:
        return loaded, None
    reference = copy.deepcopy(model).float()  # the float32 original the format rounds
    reference = gpt2.arrange_weights(reference)
    if weights_dtype is not None:
        gpt2.set_weights_dtype(model, weights_dtype)
    return loaded, reference


# --- printing ----------------------------------------------------------------------------

# Off a terminal (a file, a pipe, CI) there is no edge to fit: lay out at the README's
# width, wider where a table's headings and words or an unbreakable line (a formula) need it.
OFF_TERMINAL_COLUMNS = 100


def print_view(renderable) -> None:
    """Print a view on stdout: as rich lays it out on a terminal; off one, at least
    COLUMNS (else OFF_TERMINAL_COLUMNS) wide and wider where a table or a formula needs it,
    and no line ending in spaces, so what a user saves matches what the README shows."""
    import os
    import sys

    from rich.console import Console

    console = Console()
    if console.is_terminal:
        console.print(fit_width(console, renderable, console.width))
        return
    columns = os.environ.get("COLUMNS", "")
    least = int(columns) if columns.isascii() and columns.isdigit() else OFF_TERMINAL_COLUMNS
    console = Console(width=max(least, _widest(console, renderable)))
    with console.capture() as captured:
        console.print(renderable)
    sys.stdout.write("\n".join(line.rstrip() for line in captured.get().split("\n")))


def fit_width(console, renderable, width: int):
    """RENDERABLE with every table too wide for WIDTH columns stacked, one record per row:
    rich would cut its words and numbers ('13.6…'), or wrap its prose a word a line.
    Groups and panels are walked; anything else is returned as it is."""
    import copy

    from rich.console import Group
    from rich.measure import Measurement
    from rich.panel import Panel
    from rich.table import Table

    if isinstance(renderable, Group):
        return Group(*(fit_width(console, r, width) for r in renderable.renderables))
    if isinstance(renderable, Panel):
        panel = copy.copy(renderable)
        panel.renderable = fit_width(console, renderable.renderable, width - 4)
        return panel
    if not isinstance(renderable, Table) or not renderable.columns:
        return renderable
    need = Measurement.get(console, console.options.update(max_width=10_000), renderable)
    # A column of single words (its prose has half the room it wants), or cut: rich marks
    # what it cuts with '…', which no cell of ours holds.
    if need.maximum <= 2 * width and "…" not in rendered(renderable, width):
        return renderable
    return stacked(renderable)


def rendered(renderable, width: int) -> str:
    """RENDERABLE as plain text at WIDTH columns, as a terminal that wide would show it."""
    import io

    from rich.console import Console

    console = Console(width=width, file=io.StringIO(), color_system=None, force_terminal=False)
    with console.capture() as captured:
        console.print(renderable)
    return captured.get()


def stacked(table):
    """A table as one record per row: the first cell as the record's title, then each
    other column's heading and value on a line, the value wrapping beside its heading."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    def plain(cell) -> str:
        return cell.plain if isinstance(cell, Text) else str(cell)

    headings = [plain(c.header).replace("\n", " ") for c in table.columns]
    columns = [list(c.cells) for c in table.columns]
    records = []
    if table.title:
        records.append(Text(plain(table.title), style="bold"))
    for r in range(table.row_count):
        grid = Table.grid(padding=(0, 2))
        grid.add_column(no_wrap=True, style="dim")
        grid.add_column(overflow="fold")
        for heading, cells in zip(headings[1:], columns[1:], strict=True):
            if plain(cells[r]).strip():
                grid.add_row(heading, cells[r])
        records += [Text(""), Text(plain(columns[0][r]), style="bold"), grid]
    if table.caption:
        records += [Text(""), Text(plain(table.caption))]
    return Group(*records)


def _widest(console, renderable) -> int:
    """Columns the tables (every word whole) and unbreakable texts (every line whole) inside
    RENDERABLE need."""
    from rich.console import Group
    from rich.measure import Measurement
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    if isinstance(renderable, Group):
        return max((_widest(console, r) for r in renderable.renderables), default=0)
    if isinstance(renderable, Panel):
        return _widest(console, renderable.renderable) + 4  # borders and padding
    options = console.options.update(max_width=10_000)
    if isinstance(renderable, Table):
        # Its minimum: every heading and word whole (no "attent…"); prose cells may wrap.
        return Measurement.get(console, options, renderable).minimum
    if isinstance(renderable, Text) and renderable.no_wrap:
        return Measurement.get(console, options, renderable).maximum
    return 0


# --- results and plots ------------------------------------------------------------------


def check_writable(path: Path) -> None:
    """--plot must be writable before the benchmark runs, without leaving a file behind."""
    import os

    if path.is_dir():
        fail(f"--plot: {str(path)!r} is a directory: expected a file name such as bench.png")
    if not path.parent.is_dir():
        fail(f"--plot: no directory {str(path.parent)!r} to write {path.name!r} into")
    if path.exists() and not os.access(path, os.W_OK):
        fail(f"--plot: {str(path)!r} is not writable: expected a path this user can write")
    if not path.exists() and not os.access(path.parent, os.W_OK | os.X_OK):
        fail(f"--plot: directory {str(path.parent)!r} is not writable: expected one this user "
             "can write")


def check_plot(plot: Path | None) -> None:
    """matplotlib present and the path writable, before minutes of measuring."""
    if plot is None:
        return
    from kvcache_cli.plot import PlotUnavailable, require_matplotlib

    try:
        require_matplotlib()
    except PlotUnavailable as err:
        fail(str(err))
    check_writable(plot)


def show_then_plot(result, view, as_json: bool, save, plot: Path | None, what: str) -> None:
    """Print a measured result (JSON, or VIEW's rendering: rich, or plain text as it is),
    then write its plot: a plot that fails to save after minutes of measuring loses
    nothing."""
    from rich.console import Console

    if as_json:
        from kvcache_cli.views import to_json

        typer.echo(to_json(result))
    else:
        shown = view(result)
        if isinstance(shown, str):  # a plain-text view, already laid out
            typer.echo(shown)
        else:
            print_view(shown)
    if plot is None:
        return
    try:
        save(result, plot)
    except (OSError, ValueError) as err:
        fail(f"--plot: the plot could not be written to {str(plot)!r} ({err}); the "
             "results are above", code=1)
    if not as_json:
        Console().print(f"{what} written to {plot}")
