"""`kvcache serve`: a seeded workload through several engines, or decode steps at a
sweep of batch sizes against the roofline."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated

import typer

from kvcache_cli.cli.common import (
    GPT2_MODULES,
    DeviceOption,
    ModelOption,
    WeightsDTypeOption,
    check_plot,
    check_weights_dtype,
    fail,
    load_gpt2,
    need_torch_extra,
    show_then_plot,
    threads_error,
)


def serve(
    device: DeviceOption = "auto",
    model: ModelOption = "gpt2",
    weights: Annotated[str, typer.Option(
        help="auto (real if available, else random), pretrained, random.")] = "auto",
    weights_dtype: WeightsDTypeOption = None,
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
    from rich.console import Console

    from kvcache_cli.serving import batching
    from kvcache_cli.serving import engines as serving
    from kvcache_cli.serving.plot import save_plot
    from kvcache_cli.views.serve import render

    # Everything a user can get wrong is refused before a model loads.
    try:
        dev, what = _check(device, model, requests, prompt_len, output_len, shared_prefix, rate,
                           seed, engines, kv_mem, block_size, max_batch, threads, batch)
    except ValueError as err:
        fail(str(err))
    check_plot(plot)
    check_weights_dtype(weights_dtype, model, dev)
    loaded = load_gpt2(model, weights, dev)
    if weights_dtype is not None:
        from kvcache_cli.gpt2 import set_weights_dtype

        set_weights_dtype(loaded.model, weights_dtype)
    status = Console(stderr=True)
    try:
        if batch is not None:
            with status.status("decode steps at each batch size"):
                result = batching.run_sweep(loaded.model, what, threads=threads,
                                            model_name=loaded.source)
        else:
            spec, engine_names, memory = what
            with _progress(status) as on_step:
                result = serving.run_serve(
                    loaded.model, spec, engine_names, memory, block_size, max_batch,
                    prefix_sharing, threads, loaded.source, loaded.note, on_step)
    except (ValueError, IndexError) as err:
        fail(str(err))
    except RuntimeError as err:
        fail(str(err), code=1)
    show_then_plot(result, render, as_json, save_plot, plot, "plot")


def _check(device, model, requests, prompt_len, output_len, shared_prefix, rate, seed, engines,
           kv_mem, block_size, max_batch, threads, batch):
    """The device, and the batch sizes to sweep or (workload, engines, KV bytes); raises
    ValueError for anything a user can get wrong."""
    import torch

    from kvcache_cli import bench, sizing
    from kvcache_cli.gpt2 import model_config
    from kvcache_cli.serving import batching, workload
    from kvcache_cli.serving import engines as serving

    dev = str(bench.resolve_device(device))
    config = model_config(model)
    if batch is not None:
        what = batching.parse_sizes(batch)
        batching.check_sweep(config)
    else:
        spec = workload.WorkloadSpec(
            requests, workload.parse_range(prompt_len, "--prompt-len"),
            workload.parse_range(output_len, "--output-len"), shared_prefix, rate, seed)
        workload.check_spec(spec, config.block_size)
        engine_names = serving.parse_engines(engines)
        memory = sizing.parse_bytes(kv_mem, "--kv-mem")
        serving.plan_memory(config, torch.float32, spec, memory, block_size, max_batch)
        what = spec, engine_names, memory
    if threads_error(threads):
        raise ValueError(threads_error(threads))
    return dev, what


def _progress(console):
    """The live line on stderr: each engine's requests done, running, waiting, KV in use."""
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
