"""`kvcache bench --context`: each cache's decode step timed at long contexts, beside
llama.cpp's with the matched cache type (`bench.context`), its options checked first."""

from __future__ import annotations

from pathlib import Path

from kvcache_cli.cli.loading import (
    GPT2_MODULES,
    check_cache_for,
    check_weights_dtype,
    need_torch_extra,
    pick_threads,
    with_weights_dtype,
)
from kvcache_cli.cli.options import TORCH_DTYPES, DType, threads_error
from kvcache_cli.cli.output import check_plot, progress, show_then_plot
from kvcache_cli.cli.refusals import fail

# Steps timed a round at each context, unless --new-tokens is given.
CONTEXT_STEPS = 8


def bench_context(ctx, context: str, cache: str, device: str, model: str, weights: str,
                  dtype: DType, weights_dtype: str | None, new_tokens: int, repeats: int,
                  threads: int | None, plot: Path | None, as_json: bool,
                  replay: bool) -> None:
    """`bench --context`: each cache's decode step at long contexts, beside llama.cpp's."""
    ignored = [p for p in ("modes", "compile_", "naive_samples", "prompt_len", "draft",
                           "speculate", "prompt_file")
               if getattr(ctx.get_parameter_source(p), "name", "") == "COMMANDLINE"]
    if ignored:
        name = "--compile" if ignored[0] == "compile_" else f"--{ignored[0].replace('_', '-')}"
        fail(f"{name} does not apply with --context: each --cache is timed at each context, "
             "beside llama.cpp's matched cache")
    steps = new_tokens if getattr(ctx.get_parameter_source("new_tokens"), "name",
                                  "") == "COMMANDLINE" else CONTEXT_STEPS
    from kvcache_cli.numbers import NumberError, whole

    try:
        contexts = [whole(t.strip(), "--context", 1, 10**7) for t in context.split(",")]
        steps = whole(str(steps), "--new-tokens", 1, 10_000)
    except NumberError as err:
        fail(str(err))
    if threads_error(threads):
        fail(threads_error(threads))
    from kvcache_cli.bench.run import MAX_REPEATS

    if not 1 <= repeats <= MAX_REPEATS:
        fail(f"--repeats {repeats:,}: expected a whole number from 1 to {MAX_REPEATS:,}")
    check_plot(plot)
    need_torch_extra("kvcache bench needs", *GPT2_MODULES)
    from kvcache_cli.caches.grammar import CacheSpecError
    from kvcache_cli.caches.spec import parse_cache_list

    try:
        specs = parse_cache_list(cache)
    except CacheSpecError as err:
        fail(f"--cache: {err}")
    for spec in specs:
        check_cache_for(spec, model)
    check_weights_dtype(weights_dtype, model, device)
    import torch

    from kvcache_cli.bench import context as context_bench
    from kvcache_cli.measure import resolve_device
    from kvcache_cli.models import linear, load_model, model_config
    from kvcache_cli.views.bench_context import context_view, save_context_plot

    try:
        context_bench.check_context(model_config(model), specs, contexts, steps)
        dev = resolve_device(device)
    except ValueError as err:
        fail(str(err))
    pick_threads(threads, dev)
    try:
        loaded = load_model(model, weights=weights, device=dev,
                            dtype=getattr(torch, TORCH_DTYPES[dtype.value]))
        loaded, _ = with_weights_dtype(loaded, weights_dtype)
        with progress("loading", "tokens of context") as update:
            result = context_bench.run_context(
                loaded.model, specs, contexts, steps, repeats, torch.get_num_threads(),
                model_name=loaded.source, weights=linear.weights_format(loaded.model),
                with_llama=dev.type == "cpu", replay=replay,
                progress=lambda label, done, total: update(done, total, label))
    except (ValueError, IndexError) as err:
        fail(str(err))
    except (RuntimeError, OSError) as err:
        fail(str(err), code=1)
    show_then_plot(result, context_view, as_json, save_context_plot, plot,
                   "step time against context")
