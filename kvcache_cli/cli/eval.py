"""`kvcache eval`: what a cache costs in quality, each cache fed a text as generation feeds
it and scored against the exact cache on the same tokens."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from kvcache_cli.checkpoints import TRAINED
from kvcache_cli.cli.common import (
    GPT2_MODULES,
    DeviceOption,
    Weights,
    check_plot,
    complete_cache_list,
    fail,
    load_model,
    need_torch_extra,
    parse_cache_list_option,
    show_then_plot,
    threads_error,
)

# The trained byte-level checkpoint: a model whose predictions mean something offline,
# with its held-out text beside it.
EVAL_MODEL = TRAINED
HELDOUT = "heldout.txt"  # the text a checkpoint was not trained on, in its directory


def eval_(
    cache: Annotated[Any, typer.Option(
        "--cache", parser=parse_cache_list_option, metavar="SPECS",
        autocompletion=complete_cache_list,
        help="Comma-separated cache specs, e.g. static,paged:b16 or "
        "full,window:256,sink:4+252,h2o:128+128 (every kind: 'kvcache caches'); the exact "
        "'static' (alias full) is always run as the reference. Default: "
        "static,int8,int4,int2,fp8-e4m3, each format at its default layout.")] = None,
    model: Annotated[str, typer.Option(
        "--model", "-m", help=f"{EVAL_MODEL} (the trained checkpoint), gpt2, gpt2-medium, "
        "gpt2-large, gpt2-xl or a checkpoint dir.")] = EVAL_MODEL,
    weights: Annotated[Weights, typer.Option(
        help="auto: pretrained when available, else random (one note); quality on random "
        "weights means little.")] = Weights.auto,
    text: Annotated[Path | None, typer.Option(
        help=f"A UTF-8 text file (default: {HELDOUT} in the checkpoint's directory, the "
        "text it was not trained on).")] = None,
    tokens: Annotated[int | None, typer.Option(
        help="Tokens of the text to read (default: the text's, up to the context window "
        "and 2,000).")] = None,
    prompt_len: Annotated[int, typer.Option(
        help="Tokens prefilled before decoding starts; the rest are scored.")] = 64,
    chunk: Annotated[int, typer.Option(
        help="Tokens fed per decode step (1: one at a time, as generation does).")] = 1,
    device: DeviceOption = "auto",
    threads: Annotated[int | None, typer.Option(
        help="torch intra-op threads (default: torch's own, one per core).")] = None,
    plot: Annotated[Path | None, typer.Option(
        help="Write the frontier (perplexity against bytes per token) and the loss by "
        "position to this PNG (needs matplotlib).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw result as JSON.")] = False,
) -> None:
    """What a cache costs in quality: each cache fed a text as generation feeds it,
    against the exact cache on the same tokens.

    Per cache: perplexity, KL divergence from the exact next-token distribution, top-1
    agreement, bytes held per token and decode time; per layer, the first token's share
    of attention.
    """
    need_torch_extra("kvcache eval needs", *GPT2_MODULES)
    from kvcache_cli import quality
    from kvcache_cli.evaltext import TokenizerUnavailable

    # Everything a user can get wrong is refused before a model loads.
    try:
        specs, path, ids, n, dev = _check_options(cache, model, text, tokens, prompt_len,
                                                  chunk, device, threads)
    except ValueError as err:
        fail(str(err))
    except TokenizerUnavailable as err:
        fail(f"{err}: --model {EVAL_MODEL} evaluates the trained byte-level checkpoint, "
             "which needs no download", code=1)
    check_plot(plot)
    loaded = load_model(model, weights.value, str(dev))
    try:
        with _progress() as on_progress:
            result = quality.evaluate(
                loaded.model, ids.ids[:n], specs, prompt_len=prompt_len, chunk=chunk,
                threads=threads, model_name=loaded.source, weights_note=loaded.note,
                text_name=f"{path.name} ({ids.tokenizer})", progress=on_progress)
    except (ValueError, IndexError) as err:
        fail(str(err))
    except RuntimeError as err:
        fail(str(err), code=1)
    from kvcache_cli.quality_plot import save_plot
    from kvcache_cli.views.quality import plain, render

    # The rich view on a terminal; plain text in a pipe or a file (no boxes to parse, no
    # lines wrapped at 80 columns).
    view = render if sys.stdout.isatty() else plain
    show_then_plot(result, view, as_json, save_plot, plot, "plot")


def _check_options(cache, model, text, tokens, prompt_len, chunk, device, threads):
    """(specs, text path, its ids, tokens to read, device), or a ValueError naming the
    value, or TokenizerUnavailable."""
    from kvcache_cli import quality
    from kvcache_cli.bench import resolve_device
    from kvcache_cli.evaltext import eval_text, read_text
    from kvcache_cli.models import model_config

    specs = quality.default_caches() if cache is None else cache
    problem = threads_error(threads)
    if problem is not None:
        raise ValueError(problem)
    config = model_config(model)
    # --tokens, when given, against the context window; the text's length comes next.
    quality.check_eval(config.context, prompt_len + 1 if tokens is None else tokens,
                       prompt_len, chunk)
    path = text if text is not None else _heldout(model)
    ids = eval_text(read_text(path), str(path), config)
    n = quality.tokens_to_read(len(ids.ids), config.context, tokens, prompt_len,
                               f"--text {str(path)!r}")
    quality.check_caches(specs, config, n - 1, model)
    return specs, path, ids, n, resolve_device(device)


def _heldout(model: str) -> Path:
    """The held-out text shipped beside a checkpoint, or a ValueError saying to give one.

    A Llama-family model reads the shipped checkpoint's: Python standard-library sources,
    which every Python user has and SmolLM2 tokenizes to 25,850 tokens.
    """
    from kvcache_cli.checkpoints import TRAINED
    from kvcache_cli.gpt2 import PRESETS, checkpoint_dir
    from kvcache_cli.models import family_of

    if family_of(model) == "llama":
        return checkpoint_dir(TRAINED) / HELDOUT
    path = checkpoint_dir(model) / HELDOUT
    if model in PRESETS or not path.is_file():
        raise ValueError(f"--model {model} ships no {HELDOUT}: give the text to evaluate on "
                         "with --text FILE")
    return path


@contextlib.contextmanager
def _progress():
    """A transient bar on stderr when it is a terminal; nothing at all off one."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    console = Console(stderr=True)
    if not console.is_terminal:
        yield None
        return
    # Redrawn twice a second: the redraw thread shares the CPUs being timed.
    progress = Progress("scoring", BarColumn(), MofNCompleteColumn(), "tokens",
                        TimeElapsedColumn(), console=console, transient=True,
                        refresh_per_second=2)
    task = progress.add_task("scoring", total=None)
    with progress:
        yield lambda done, total: progress.update(task, completed=done, total=total)
