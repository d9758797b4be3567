"""What the commands share: the one error line, the torch extra's checks, option types,
loading GPT-2, and printing a result before its plot.

Nothing here imports torch at module level: `kvcache size` and `demo` import this module.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, NoReturn

import typer


def fail(message: str, code: int = 2) -> NoReturn:
    """The one way a command reports an error: one line on stderr, then exit.

    Code 2 is bad input (the user can fix the command line); 1 is a failure at
    run time.
    """
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


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
    return f"{who_needs} {names}, which {verb} not installed: pip install 'kvcache[torch]'"


def need_torch_extra(who_needs: str, *modules: str) -> None:
    """Fail in one line, exit 2, when modules of the torch extra are missing."""
    message = torch_extra_missing(who_needs, *modules)
    if message is not None:
        fail(message)


# --- option types ---------------------------------------------------------------------

# The options bench and serve share: where to run, and which GPT-2.
DeviceOption = Annotated[str, typer.Option(help="cpu, cuda, or auto (cuda when there is one).")]
ModelOption = Annotated[str, typer.Option(
    help="gpt2, gpt2-medium, gpt2-large, gpt2-xl, stdlib-bytes (shipped) or a checkpoint dir.")]


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


# --- GPT-2 on torch -------------------------------------------------------------------


def torch_device(device: str) -> str:
    """Check --device before loading anything: no CUDA is bad input, in one line."""
    import torch

    if device not in ("cpu", "cuda"):
        fail(f"--device {device!r}: expected cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        fail(f"--device cuda: CUDA is not available (torch {torch.__version__}); use --device cpu")
    return device


def load_gpt2(model: str, weights: str, device: str, dtype: str = "fp32"):
    """gpt2.load_gpt2 with its errors as one line; its note (random weights...) on stderr."""
    import torch

    from kvcache_cli import gpt2

    try:
        loaded = gpt2.load_gpt2(model, weights, device, getattr(torch, TORCH_DTYPES[dtype]))
    except ValueError as err:
        fail(str(err))
    except (RuntimeError, OSError) as err:
        fail(str(err), code=1)
    if loaded.note:
        typer.echo(f"note: {loaded.note}", err=True)
    return loaded


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
    """Print a measured result (JSON, or VIEW's rendering), then write its plot: a plot
    that fails to save after minutes of measuring loses nothing."""
    from rich.console import Console

    if as_json:
        from kvcache_cli.views import to_json

        typer.echo(to_json(result))
    else:
        Console().print(view(result))
    if plot is None:
        return
    try:
        save(result, plot)
    except (OSError, ValueError) as err:
        fail(f"--plot: the plot could not be written to {str(plot)!r} ({err}); the "
             "results are above", code=1)
    if not as_json:
        Console().print(f"{what} written to {plot}")
