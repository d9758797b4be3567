"""The `kvcache` command line: thin commands that parse, call, and render.

Every command computes a result object (from the reference script, `sizing`,
`generate` or `bench`) and hands it to a renderer: rich for people, `--json`
for programs. Torch and transformers are imported inside the commands that
need them, so `kvcache --help`, `size` and `demo` start fast.
"""

from __future__ import annotations

import contextlib
import errno
import math
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from typer.core import TyperGroup

from kvcache_cli import __version__

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


# --- demo and break: the reference script's scenarios ---------------------------------

# The GPT-2 breaks run on the PyTorch model; their names live here so that
# `kvcache break --list` needs no torch.
GPT2_BREAKS = {
    "position-offset": "GPT-2: every decode token gets position 0",
    "causal-decode": "GPT-2: is_causal=True for a one-row query against the cache",
    "stale-cache": "GPT-2: a cache reused across requests without a reset",
}


# Shell completion of names: these run only when the shell asks, never at start-up.
def _complete_demo(incomplete: str) -> list[str]:
    import kv_cache_from_scratch as ref

    return [n for n in ["all", *ref.DEMOS] if n.startswith(incomplete)]


def _complete_break(incomplete: str) -> list[str]:
    import kv_cache_from_scratch as ref

    return [n for n in ["all", *ref.BREAKS, *GPT2_BREAKS] if n.startswith(incomplete)]


def _complete_preset(incomplete: str) -> list[str]:
    from kvcache_cli.sizing import PRESETS

    return [n for n in PRESETS if n.startswith(incomplete)]


def _pick(name: str, table: dict, kind: str, extra: dict | None = None) -> list[str]:
    """Names to run for NAME or `all`; an unknown name is bad input."""
    valid = [*table, *(extra or {})]
    if name == "all":
        return valid
    if name not in valid:
        fail(f"unknown {kind} {name!r}; choose one of: all, {', '.join(valid)}")
    return [name]


def _show(results: dict[str, tuple[str, object]], as_json: bool) -> None:
    """Print {name: (title, result)}: JSON of the result (or a name → result map), or panels."""
    if as_json:
        from kvcache_cli.views import to_json

        by_name = {name: result for name, (_, result) in results.items()}
        typer.echo(to_json(next(iter(by_name.values())) if len(by_name) == 1 else by_name))
        return
    from rich.console import Console

    from kvcache_cli.views.demos import render

    console = Console()
    for title, result in results.values():
        console.print(render(title, result))


@app.command()
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
        _list({n: s.title for n, s in ref.DEMOS.items()}, "demos", as_json)
        return
    names = _pick(name, ref.DEMOS, "demo")
    model = ref.init_model()
    _show({n: (ref.DEMOS[n].title, ref.DEMOS[n].run(model)) for n in names}, as_json)


@app.command("break")
def break_(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(
        help="A break name, or 'all'.", autocompletion=_complete_break)] = "all",
    list_: Annotated[bool, typer.Option("--list", help="List the breaks and exit.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw result as JSON.")] = False,
    model: Annotated[str, typer.Option(
        help="GPT-2 breaks: gpt2, gpt2-medium, gpt2-large, gpt2-xl or a checkpoint dir.")
    ] = "gpt2",
    weights: Annotated[str, typer.Option(
        help="GPT-2 breaks: auto (real if available, else random), pretrained, random.")
    ] = "auto",
    device: Annotated[str, typer.Option(help="GPT-2 breaks: cpu or cuda.")] = "cpu",
    max_new_tokens: Annotated[int, typer.Option(
        help="GPT-2 breaks: tokens to generate per loop.")] = 16,
) -> None:
    """Break the cache on purpose and watch the symptom.

    Five on the NumPy toy (no-mask, no-append, cache-q, overflow, wrong-cache) and
    three on GPT-2 in PyTorch (position-offset, causal-decode, stale-cache).
    """
    import kv_cache_from_scratch as ref

    if list_:
        if name != "all":
            fail(f"--list lists every break: expected no NAME with it, got {name!r}")
        _list({**{n: s.title for n, s in ref.BREAKS.items()}, **GPT2_BREAKS}, "breaks", as_json)
        return
    names = _pick(name, ref.BREAKS, "break", GPT2_BREAKS)
    if not any(n in GPT2_BREAKS for n in names):
        _refuse_given(ctx, ("model", "weights", "device", "max_new_tokens"),
                      f"to the GPT-2 breaks only, and {name!r} runs on the NumPy toy")
    gpt2_names = [n for n in names if n in GPT2_BREAKS]
    who_needs = (f"the GPT-2 break {gpt2_names[0]} needs" if len(gpt2_names) == 1
                 else f"the GPT-2 breaks ({', '.join(gpt2_names)}) need")
    skipped = gpt2_names and torch_extra_missing(who_needs, *GPT2_MODULES)
    if skipped and name != "all":
        fail(skipped)
    toy = [n for n in names if n in ref.BREAKS]
    toy_model = ref.init_model() if toy else None
    results = {n: (ref.BREAKS[n].title, ref.BREAKS[n].run(toy_model)) for n in toy}
    if not as_json:   # show the quick NumPy breaks before the GPT-2 model loads
        _show(results, as_json=False)
        results = {}
    if skipped:  # `all` without torch: the NumPy breaks ran; say what was left out and why
        typer.echo(f"note: {skipped}", err=True)
    elif gpt2_names:
        loaded, gpt2_results = _gpt2_breaks(gpt2_names, model, weights, device, max_new_tokens)
        if not as_json:
            _show_gpt2_breaks(loaded, device, gpt2_results)
        results |= {n: (GPT2_BREAKS[n], r) for n, r in gpt2_results.items()}
    if as_json:
        _show(results, as_json=True)


def _refuse_given(ctx: typer.Context, params: tuple[str, ...], why: str) -> None:
    """Options typed on the command line that the command would ignore are bad input."""
    given = [f"--{p.replace('_', '-')}" for p in params
             if getattr(ctx.get_parameter_source(p), "name", "") == "COMMANDLINE"]
    if given:
        verb = "applies" if len(given) == 1 else "apply"
        fail(f"{', '.join(given)} {verb} {why}: expected a GPT-2 break with them, or none")


def _list(titles: dict[str, str], heading: str, as_json: bool) -> None:
    if as_json:
        from kvcache_cli.views import to_json

        typer.echo(to_json(titles))
        return
    from rich.console import Console

    from kvcache_cli.views.demos import listing

    Console().print(listing(titles, heading))


# --- size and models: the cache calculator for real models ---------------------------


@app.command()
def size(
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="A preset (see 'kvcache models') or a Hub id ORG/NAME, whose "
        "config.json is read through the local Hub cache.",
        autocompletion=_complete_preset)] = None,
    revision: Annotated[str | None, typer.Option(
        help="Branch, tag or commit of a Hub id (default main); reads even a preset's id "
        "from the Hub.")] = None,
    config: Annotated[str | None, typer.Option(
        help="A Hugging Face config.json, or the folder holding it; read offline.")] = None,
    layers: Annotated[int | None, typer.Option(help="Decoder layers.")] = None,
    kv_heads: Annotated[int | None, typer.Option(
        help="K/V heads per layer (1 = MQA; default: --heads).")] = None,
    head_dim: Annotated[int | None, typer.Option(
        help="Width of one head (default 128).")] = None,
    heads: Annotated[int | None, typer.Option(
        help="Query heads, for the multi-head baseline.")] = None,
    seq: Annotated[int | None, typer.Option(
        help="Tokens per sequence (default: the model's context window).")] = None,
    batch: Annotated[int, typer.Option(help="Sequences cached at once.")] = 1,
    dtype: Annotated[str, typer.Option(
        help="Cache dtype: fp32, fp16, bf16, fp8, int8, int4.")] = "fp16",
    tp: Annotated[int, typer.Option(help="Tensor-parallel GPUs sharing the KV heads.")] = 1,
    gpu_mem: Annotated[str | None, typer.Option(
        help="Memory of one GPU: 80GiB, 80GB or bytes. Reports what fits.")] = None,
    weight_dtype: Annotated[str, typer.Option(
        help="Dtype of the weights, for --gpu-mem.")] = "fp16",
    params: Annotated[str | None, typer.Option(
        help="Parameter count for --gpu-mem without --model: 6.74B, 6738415616.")] = None,
    block_size: Annotated[int | None, typer.Option(
        help="Paged-cache block size in tokens, for --gpu-mem.")] = None,
    verify: Annotated[bool, typer.Option(
        "--verify", help="Build the model small in transformers and measure its real cache.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw result as JSON.")] = False,
) -> None:
    """How big the KV cache is for a model, a sequence length and a batch, and what fits.

    The shape comes from --model, --config, or the flags --layers/--kv-heads/--head-dim.
    """
    import dataclasses

    from kvcache_cli import sizing
    from kvcache_cli.hub import HubUnavailable

    try:
        count = None if params is None else sizing.parse_count(params)
        memory = None if gpu_mem is None else sizing.parse_bytes(gpu_mem)
        hub_config = _hub_config(model, revision, config, layers, kv_heads, head_dim, heads)
        if hub_config is not None:
            model, config = None, hub_config.path
        shape, hf_config = sizing.resolve_shape(
            model, config, layers, kv_heads, head_dim, heads, count
        )
        if hub_config is not None:
            shape = dataclasses.replace(shape, name=hub_config.repo_id, source=(
                f"{hub_config.repo_id} @ {hub_config.revision} ({hub_config.commit[:7]})"))
        result = sizing.size_cache(shape, seq, batch, dtype, tp, memory, weight_dtype, block_size)
    except ValueError as err:
        fail(str(err))
    except HubUnavailable as err:  # the Hub failed on its side
        fail(str(err), code=1)
    if verify:
        need_torch_extra("--verify needs", "torch", "transformers")
        try:
            result = dataclasses.replace(result, verify=sizing.verify_cache(hf_config, dtype))
        except sizing.VerifyError as err:
            fail(str(err), code=1)
    if as_json:
        from kvcache_cli.views import to_json

        typer.echo(to_json(result))
        return
    from rich.console import Console

    from kvcache_cli.views.sizing import size_view

    Console().print(size_view(result))


def _hub_config(model, revision, config, *shape_flags):
    """The Hub repository's config.json when --model names one, else None.

    A preset's own name or Hub id stays the preset (offline, with its published parameter
    count) unless --revision asks for the repository itself. With --config or shape flags,
    nothing is fetched: resolve_shape reports the conflict. Raises ValueError for bad input
    and HubUnavailable when the Hub fails on its side.
    """
    from kvcache_cli import hub, sizing

    if model is None or not hub.is_hub_id(model):
        if revision is not None:
            raise ValueError(f"--revision {revision!r} applies to a Hub id: expected --model "
                             "ORG/NAME")
        return None
    if config is not None or any(flag is not None for flag in shape_flags):
        return None
    if revision is None:
        try:
            sizing.preset(model)
            return None
        except ValueError:
            pass
    return hub.config_json(model, revision)


@app.command()
def models(
    dtype: Annotated[str, typer.Option(help="Cache dtype for the per-token column.")] = "fp16",
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw list as JSON.")] = False,
) -> None:
    """List the model presets with their published shapes."""
    from kvcache_cli import sizing

    try:
        rows = sizing.list_models(dtype)
    except ValueError as err:
        fail(str(err))
    if as_json:
        from kvcache_cli.views import to_json

        typer.echo(to_json(rows))
        return
    from rich.console import Console

    from kvcache_cli.views.sizing import models_view

    Console().print(models_view(rows))


# --- bench: measured decode speed -----------------------------------------------------


_MAX_THREADS = 1024
# The options bench and serve share: where to run, and which GPT-2.
DeviceOption = Annotated[str, typer.Option(help="cpu, cuda, or auto (cuda when there is one).")]
ModelOption = Annotated[str, typer.Option(
    help="gpt2, gpt2-medium, gpt2-large, gpt2-xl or a checkpoint dir.")]


class DType(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


_TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@app.command()
def bench(
    device: DeviceOption = "auto",
    model: ModelOption = "gpt2",
    weights: Annotated[str, typer.Option(
        help="auto (real if available, else random), pretrained, random. Speed depends "
        "on the shape only.")] = "auto",
    dtype: Annotated[DType, typer.Option(help="Weights and cache.")] = DType.fp32,
    prompt_len: Annotated[int, typer.Option(help="Prompt length (seeded random token ids).")
    ] = 32,
    new_tokens: Annotated[int, typer.Option(help="Tokens to generate per run.")] = 128,
    modes: Annotated[str, typer.Option(
        help="Comma-separated, from: naive, concat, static, hf (transformers' generate), "
        "hf-static (its static cache), static-compiled, hf-static-compiled.")
    ] = "naive,concat,static,hf,hf-static",
    compile_: Annotated[bool, typer.Option(
        "--compile", help="Also run static and hf-static under torch.compile (compile time "
        "reported apart, never timed).")] = False,
    naive_samples: Annotated[int, typer.Option(
        help="Time naive at this many decode steps spread over the run; 0: every step "
        "(minutes).")] = 16,
    repeats: Annotated[int, typer.Option(help="Timed runs per mode; medians are reported.")] = 3,
    threads: Annotated[int | None, typer.Option(
        help="torch intra-op threads (default: torch's own, one per core).")] = None,
    plot: Annotated[Path | None, typer.Option(
        help="Write the per-step latency plot to this PNG (needs matplotlib).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw result as JSON.")] = False,
) -> None:
    """Time every decode step of every mode, against transformers and the memory limit.

    Warm-up excluded, the device synchronised around each timed step, medians over
    repeats; the memory bandwidth is probed in the same run. The defaults take about
    a minute on 2 cores.
    """
    need_torch_extra("kvcache bench needs", *GPT2_MODULES, "transformers")
    import torch
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from kvcache_cli import bench as bench_
    from kvcache_cli.gpt2 import load_gpt2
    from kvcache_cli.plot import PlotUnavailable, require_matplotlib, save_plot

    # Everything a user can get wrong is checked before minutes of benchmarking.
    try:
        mode_names = bench_.parse_modes(modes)
        if compile_:
            extra = [bench_.COMPILED[m] for m in mode_names if m in bench_.COMPILED]
            if not extra:
                raise ValueError("--compile needs mode static or hf-static in --modes")
            mode_names = bench_.parse_modes(",".join((*mode_names, *extra)))
        dev = bench_.resolve_device(device)
    except ValueError as err:
        fail(str(err))
    if threads is not None and not 1 <= threads <= _MAX_THREADS:
        # OpenMP allocates per thread up front: a billion threads aborts the process.
        fail(f"--threads {threads:,}: expected a whole number from 1 to {_MAX_THREADS:,}")
    if plot is not None:
        try:
            require_matplotlib()
        except PlotUnavailable as err:
            fail(str(err))
        _check_writable(plot)
    torch_dtype = getattr(torch, _TORCH_DTYPES[dtype.value])
    try:
        loaded = load_gpt2(model, weights=weights, device=dev, dtype=torch_dtype)
    except ValueError as err:
        fail(str(err))
    except (RuntimeError, OSError) as err:
        fail(str(err), code=1)
    try:
        bench_.check_bench(loaded.model, mode_names, prompt_len, new_tokens, repeats, threads,
                           naive_samples)  # fmt: skip
    except ValueError as err:
        fail(str(err))
    except RuntimeError as err:
        fail(str(err), code=1)

    # On stderr and transient, so stdout holds only the result (and --json stays JSON).
    # Redrawn twice a second, not rich's ten: the redraw thread shares the CPUs being timed.
    err_console = Console(stderr=True)
    progress = Progress(
        "{task.description}", BarColumn(), MofNCompleteColumn(), "steps", TimeElapsedColumn(),
        "ETA", TimeRemainingColumn(), console=err_console, transient=True,
        refresh_per_second=2,
    )  # fmt: skip
    task = progress.add_task("loading", total=None)

    def on_progress(label: str, done: int, total: int) -> None:
        progress.update(task, description=label, completed=done, total=total)

    def on_finished(label: str, tokens_per_s: float) -> None:
        # Without a terminal there is no bar: one line per finished run says it is alive.
        if not err_console.is_terminal:
            typer.echo(f"{label}: {tokens_per_s:.1f} tokens/s", err=True)

    try:
        with progress:
            result = bench_.run_bench(
                loaded.model, modes=mode_names, prompt_len=prompt_len, new_tokens=new_tokens,
                repeats=repeats, threads=threads, naive_samples=naive_samples,
                model_name=loaded.source, weights_note=loaded.note, progress=on_progress,
                finished=on_finished,
            )  # fmt: skip
    except (ValueError, IndexError) as err:
        fail(str(err))
    except RuntimeError as err:
        fail(str(err), code=1)
    from kvcache_cli.views.bench import bench as bench_view

    _show_then_plot(result, bench_view, as_json, save_plot, plot, "per-step plot")


def _show_then_plot(result, view, as_json: bool, save, plot: Path | None, what: str) -> None:
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


# --- serve: many sequences at once ------------------------------------------------------


@app.command()
def serve(
    device: DeviceOption = "auto",
    model: ModelOption = "gpt2",
    weights: Annotated[str, typer.Option(
        help="auto (real if available, else random), pretrained, random.")] = "auto",
    requests: Annotated[int, typer.Option(help="Requests in the workload.")] = 64,
    prompt_len: Annotated[str, typer.Option(
        help="Prompt lengths MIN:MAX (after the shared prefix), drawn per request.")
    ] = "16:512",
    output_len: Annotated[str, typer.Option(help="Output lengths MIN:MAX, drawn per request.")
    ] = "16:256",
    shared_prefix: Annotated[int, typer.Option(
        help="Tokens every prompt starts with (a system prompt).")] = 0,
    rate: Annotated[float | None, typer.Option(
        help="Poisson arrivals, requests/s (default: all at once).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the workload.")] = 0,
    engines: Annotated[str, typer.Option(
        help="Comma-separated, from: sequential, padded, paged, hf (transformers' "
        "continuous batching).")] = "sequential,padded,paged,hf",
    kv_mem: Annotated[str, typer.Option(
        help="KV memory every engine may hold: 256MiB, 1GB or bytes.")] = "256MiB",
    block_size: Annotated[int, typer.Option(help="Tokens per KV block (paged, hf).")] = 16,
    max_batch: Annotated[int, typer.Option(help="Most sequences decoded at once.")] = 256,
    prefix_sharing: Annotated[bool, typer.Option(
        help="Share full blocks of equal prefixes (paged, and hf's own).")] = True,
    threads: Annotated[int | None, typer.Option(
        help="torch intra-op threads (default: torch's own, one per core).")] = None,
    batch: Annotated[str | None, typer.Option(
        help="Instead of the workload: decode-step time at these batch sizes, e.g. "
        "1,4,16,64, against the roofline.")] = None,
    plot: Annotated[Path | None, typer.Option(
        help="Write KV in use and running sequences over time to this PNG.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw result as JSON.")] = False,
) -> None:
    """Serve a seeded workload through several engines: paged + continuous batching
    against one-at-a-time, padded batches and transformers' generate_batch.

    Each request's tokens are checked against its solo generation; set-up is timed
    apart from the run.
    """
    need_torch_extra("kvcache serve needs", *GPT2_MODULES, "transformers")
    import torch
    from rich.console import Console

    from kvcache_cli import bench as bench_
    from kvcache_cli import sizing
    from kvcache_cli.gpt2 import model_config
    from kvcache_cli.plot import PlotUnavailable, require_matplotlib
    from kvcache_cli.serving import batching, workload
    from kvcache_cli.serving import engines as serving

    # Everything a user can get wrong is refused before a model loads.
    try:
        dev = bench_.resolve_device(device)
        config = model_config(model)
        if batch is not None:
            sizes = batching.parse_sizes(batch)
            batching.check_sweep(config)
        else:
            spec = workload.WorkloadSpec(
                requests, workload.parse_range(prompt_len, "--prompt-len"),
                workload.parse_range(output_len, "--output-len"), shared_prefix, rate, seed)
            workload.check_spec(spec, config.block_size)
            engine_names = serving.parse_engines(engines)
            memory = sizing.parse_bytes(kv_mem, "--kv-mem")
            serving.plan_memory(config, torch.float32, spec, memory, block_size, max_batch)
        if threads is not None and not 1 <= threads <= _MAX_THREADS:
            raise ValueError(f"--threads {threads:,}: expected a whole number from 1 to "
                             f"{_MAX_THREADS:,}")
    except ValueError as err:
        fail(str(err))
    if plot is not None:
        try:
            require_matplotlib()
        except PlotUnavailable as err:
            fail(str(err))
        _check_writable(plot)
    loaded = _load_gpt2(model, weights, str(dev))
    status = Console(stderr=True)
    try:
        if batch is not None:
            with status.status("decode steps at each batch size"):
                result = batching.run_sweep(loaded.model, sizes, threads=threads,
                                            model_name=loaded.source)
        else:
            with _serve_progress(status) as on_step:
                result = serving.run_serve(
                    loaded.model, spec, engine_names, memory, block_size, max_batch,
                    prefix_sharing, threads, loaded.source, loaded.note, on_step)
    except (ValueError, IndexError) as err:
        fail(str(err))
    except RuntimeError as err:
        fail(str(err), code=1)
    from kvcache_cli.serving.plot import save_plot
    from kvcache_cli.views.serve import render

    _show_then_plot(result, render, as_json, save_plot, plot, "plot")


def _serve_progress(console):
    """The live line on stderr: each engine's requests done, running, waiting, KV in use."""
    import contextlib

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    # Redrawn twice a second: the redraw thread shares the CPUs being timed.
    progress = Progress("{task.description}", BarColumn(), MofNCompleteColumn(), "requests",
                        TimeElapsedColumn(), console=console, transient=True,
                        refresh_per_second=2)
    task = progress.add_task("set-up", total=None)

    def on_step(engine, done, total, running, waiting, used, reserved) -> None:
        kv = f" · KV {used / 2**20:,.0f}/{reserved / 2**20:,.0f} MiB" if reserved else ""
        progress.update(task, completed=done, total=total,
                        description=f"{engine}: {running} running · {waiting} waiting{kv}")

    @contextlib.contextmanager
    def live():
        with progress:
            yield on_step

    return live()


# --- generate and the GPT-2 breaks: the PyTorch model --------------------------------


def _check_writable(path: Path) -> None:
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


def _torch_device(device: str) -> str:
    """Check --device before loading anything: no CUDA is bad input, in one line."""
    import torch

    if device not in ("cpu", "cuda"):
        fail(f"--device {device!r}: expected cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        fail(f"--device cuda: CUDA is not available (torch {torch.__version__}); use --device cpu")
    return device


def _load_gpt2(model: str, weights: str, device: str, dtype: str = "fp32"):
    import torch

    from kvcache_cli.gpt2 import load_gpt2

    try:
        loaded = load_gpt2(model, weights, device, getattr(torch, _TORCH_DTYPES[dtype]))
    except ValueError as err:
        fail(str(err))
    except (RuntimeError, OSError) as err:
        fail(str(err), code=1)
    if loaded.note:
        typer.echo(f"note: {loaded.note}", err=True)
    return loaded


def _parse_ids(text: str) -> list[int]:
    """Token ids, checked for form and sign before a model is loaded (its vocabulary after)."""
    expected = "expected comma-separated token ids like 464,2068,7586"
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        fail(f"--ids: {expected}, got {text[:40]!r}")
    if not ids:
        fail(f"--ids: {expected}, at least one, got {text!r}")
    bad = next((i for i in ids if not 0 <= i < 2**31), None)
    if bad is not None:
        fail(f"--ids: token id {bad} is not a vocabulary index; {expected}, each 0 or more")
    return ids


# Choices as str Enums: the one way every typer version (>= 0.12) lists and checks them.
class Device(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


class Mode(str, Enum):
    naive = "naive"
    concat = "concat"
    static = "static"


class Weights(str, Enum):
    auto = "auto"
    pretrained = "pretrained"
    random = "random"


@app.command()
def generate(
    prompt: Annotated[str | None, typer.Argument(
        help="Text to continue, tokenized with tiktoken's gpt2 encoding.")] = None,
    max_new_tokens: Annotated[int, typer.Option(
        "--max-new-tokens", "-n", min=1, help="Tokens to generate.")] = 32,
    device: Annotated[Device, typer.Option(help="Where to run.")] = Device.cpu,
    mode: Annotated[Mode, typer.Option(
        help="naive: the full forward every token; concat: a torch.cat cache; "
        "static: a preallocated cache written in place.")] = Mode.static,
    model: Annotated[str, typer.Option(
        "--model", "-m",
        help="gpt2, gpt2-medium, gpt2-large, gpt2-xl or a checkpoint dir (save_pretrained).")
    ] = "gpt2",
    weights: Annotated[Weights, typer.Option(
        help="auto: pretrained when cached or downloadable, else random (one note).")
    ] = Weights.auto,
    ids: Annotated[str | None, typer.Option(
        help="The prompt as token ids, e.g. 464,2068,7586: needs no tokenizer.")] = None,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 is greedy.")] = 0.0,
    top_k: Annotated[int | None, typer.Option(
        min=1, help="Sample from the k likeliest tokens only.")] = None,
    seed: Annotated[int, typer.Option(
        min=0, max=2**64 - 1, help="Seed for sampling (torch takes 64 bits).")] = 0,
    dtype: Annotated[DType, typer.Option(help="Weights and cache.")] = DType.fp32,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print the result as JSON instead of streaming.")] = False,
) -> None:
    """Generate with GPT-2 and its KV cache, streaming tokens as they are made."""
    device, mode, weights = device.value, mode.value, weights.value
    if (prompt is None) == (ids is None):
        fail("give a prompt or --ids (token ids), one of the two")
    if not math.isfinite(temperature):
        fail(f"--temperature {temperature}: expected a finite number, 0 or more (0 is greedy)")
    prompt_ids = _parse_ids(ids) if ids is not None else []  # before the model loads
    # A text prompt needs the tokenizer; token ids are shown as text only when it is there.
    need_torch_extra("kvcache generate needs", *GPT2_MODULES, *(("tiktoken",) if prompt else ()))
    _torch_device(device)
    import torch
    from rich.console import Console

    from kvcache_cli import generate as gen
    from kvcache_cli.gpt2 import GPT2_VOCAB_SIZE
    from kvcache_cli.views.generate import TokenStream, generation_view, header

    use_ids = "give the prompt as token ids, e.g. --ids 464,2068,7586"
    encoding, why = None, None
    if prompt is not None:  # before loading a model: a text prompt needs the tokenizer
        encoding, why = gen.gpt2_encoding()
        if encoding is None:
            fail(f"{why}: {use_ids}", code=1)
    loaded = _load_gpt2(model, weights, device, dtype.value)
    gpt = loaded.model
    gpt2_vocab = gpt.config.vocab_size == GPT2_VOCAB_SIZE
    if prompt is not None:
        if not gpt2_vocab:
            fail(f"the model's vocabulary ({gpt.config.vocab_size}) is not GPT-2's: {use_ids}")
        prompt_ids = encoding.encode(prompt, disallowed_special=())
    elif gpt2_vocab:
        encoding, why = gen.gpt2_encoding()  # only to show the new tokens as text
        if encoding is None:
            typer.echo(f"note: {why}: showing token ids", err=True)
    try:
        gen.check_request(gpt, prompt_ids, max_new_tokens)  # before anything is printed
    except (ValueError, IndexError) as err:
        fail(str(err))
    generator = torch.Generator(device=device).manual_seed(seed)
    console = Console()
    stream = None if as_json else TokenStream(console, encoding)
    if stream is not None:
        console.print(header(loaded.source, gpt.num_params(), device,
                             str(gpt.dtype).removeprefix("torch."), mode))
        stream.prompt(prompt_ids)
    try:
        result = gen.generate(
            gpt, prompt_ids, max_new_tokens, mode,
            temperature=temperature, top_k=top_k, generator=generator, on_token=stream,
        )  # fmt: skip
    except (ValueError, IndexError) as err:
        fail(str(err))
    except RuntimeError as err:
        fail(str(err), code=1)
    if as_json:
        from dataclasses import asdict

        from kvcache_cli.views import to_json

        text = encoding.decode(list(result.tokens)) if encoding is not None else None
        typer.echo(to_json({"model": loaded.source, "note": loaded.note, **asdict(result),
                            "text": text}))
        return
    stream.end()
    console.print(generation_view(result))


def _gpt2_breaks(names: list[str], model: str, weights: str, device: str,
                 max_new_tokens: int):
    """Load the model once and run each named GPT-2 break (correct and broken loop)."""
    _torch_device(device)
    from kvcache_cli.generate import run_break

    loaded = _load_gpt2(model, weights, device)
    try:
        return loaded, {n: run_break(n, loaded.model, max_new_tokens=max_new_tokens)
                        for n in names}
    except (ValueError, IndexError) as err:
        fail(str(err))


def _show_gpt2_breaks(loaded, device: str, results: dict) -> None:
    from rich.console import Console

    from kvcache_cli.generate import gpt2_encoding
    from kvcache_cli.gpt2 import GPT2_VOCAB_SIZE
    from kvcache_cli.views.generate import break_view, header

    piece = None
    if loaded.model.config.vocab_size == GPT2_VOCAB_SIZE:
        encoding, _ = gpt2_encoding()
        if encoding is not None:
            piece = lambda t: encoding.decode([t])  # noqa: E731
    console = Console()
    first = next(iter(results.values()))
    console.print(header(loaded.source, loaded.model.num_params(), device, "float32", first.mode))
    for result in results.values():
        console.print(break_view(result, piece))


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
