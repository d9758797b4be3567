"""`kvcache bench`: every decode step of every mode timed, against transformers and the
memory limit."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated

import typer

from kvcache_cli.cli.common import (
    GPT2_MODULES,
    TORCH_DTYPES,
    DeviceOption,
    DType,
    ModelOption,
    WeightsDTypeOption,
    check_plot,
    check_weights_dtype,
    fail,
    need_torch_extra,
    show_then_plot,
    threads_error,
    with_weights_dtype,
)


def bench(
    device: DeviceOption = "auto",
    model: ModelOption = "gpt2",
    weights: Annotated[str, typer.Option(
        help="auto (real if available, else random), pretrained, random. Speed depends "
        "on the shape only.")] = "auto",
    dtype: Annotated[DType, typer.Option(help="Weights, activations and cache.")] = DType.fp32,
    weights_dtype: WeightsDTypeOption = None,
    prompt_len: Annotated[int, typer.Option(help="Prompt length (seeded random token ids).")
    ] = 32,
    new_tokens: Annotated[int, typer.Option(help="Tokens to generate per run.")] = 128,
    modes: Annotated[str, typer.Option(
        help="Comma-separated, from: naive, concat, static, hf (transformers' generate), "
        "hf-static (its static cache), static-compiled, hf-static-compiled, and llama.cpp, "
        "llama.cpp-f16, llama.cpp-q8_0 (llama.cpp on the same weights written to GGUF; "
        "needs the llama extra, pip install 'kvcache[llama]', which builds llama.cpp "
        "from source: minutes).")
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

    from kvcache_cli import bench as bench_
    from kvcache_cli.gpt2 import load_gpt2
    from kvcache_cli.plot import save_plot
    from kvcache_cli.views.bench import bench as bench_view

    # Everything a user can get wrong is checked before minutes of benchmarking.
    mode_names, dev = _check_options(modes, compile_, device, threads, plot)
    check_weights_dtype(weights_dtype, model, str(dev))
    try:
        loaded = load_gpt2(model, weights=weights, device=dev,
                           dtype=getattr(torch, TORCH_DTYPES[dtype.value]))
        loaded, reference = with_weights_dtype(loaded, weights_dtype)
        bench_.check_bench(loaded.model, mode_names, prompt_len, new_tokens, repeats, threads,
                           naive_samples)  # fmt: skip
        with _progress() as (on_progress, on_finished):
            result = bench_.run_bench(
                loaded.model, modes=mode_names, prompt_len=prompt_len, new_tokens=new_tokens,
                repeats=repeats, threads=threads, naive_samples=naive_samples,
                model_name=loaded.source, weights_note=loaded.note, progress=on_progress,
                finished=on_finished, reference=reference,
            )  # fmt: skip
    except (ValueError, IndexError) as err:
        fail(str(err))
    except (RuntimeError, OSError) as err:
        fail(str(err), code=1)
    show_then_plot(result, bench_view, as_json, save_plot, plot, "per-step plot")


def _check_options(modes: str, compile_: bool, device: str, threads: int | None,
                   plot: Path | None) -> tuple[list[str], str]:
    """The mode names (with their compiled twins under --compile) and the device; bad input
    fails here, before the model loads."""
    from kvcache_cli import bench as bench_
    from kvcache_cli.llama_peer import check_llama_modes

    try:
        mode_names = bench_.parse_modes(modes)
        if compile_:
            extra = [bench_.COMPILED[m] for m in mode_names if m in bench_.COMPILED]
            if not extra:
                raise ValueError("--compile needs mode static or hf-static in --modes")
            mode_names = bench_.parse_modes(",".join((*mode_names, *extra)))
        dev = bench_.resolve_device(device)
        check_llama_modes(mode_names, dev.type)
    except ValueError as err:
        fail(str(err))
    if threads_error(threads):
        fail(threads_error(threads))
    check_plot(plot)
    return mode_names, dev


@contextlib.contextmanager
def _progress():
    """A bar on stderr while the run lasts, and a line per finished run off a terminal.

    On stderr and transient, so stdout holds only the result (and --json stays JSON).
    Redrawn twice a second, not rich's ten: the redraw thread shares the CPUs being timed.
    """
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

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

    with progress:
        yield on_progress, on_finished
