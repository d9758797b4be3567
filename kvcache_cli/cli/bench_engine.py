"""`kvcache bench --engine transformers`: the decode steps of kvcache's own loop timed on a
transformers model, each cache kind the bridge holds as a mode (`hf.engine`)."""

from __future__ import annotations

import typer

from kvcache_cli.cli.loading import GPT2_MODULES, need_torch_extra, pick_threads
from kvcache_cli.cli.options import DType
from kvcache_cli.cli.output import show_then_plot
from kvcache_cli.cli.refusals import fail

# What bench runs on this engine: kvcache's loop (no cache, or one of a kind the bridge
# holds). transformers' own generate() (hf*), the compiled step and llama.cpp time another
# engine, and the other runs (--context, --profile, --draft, --tasks) kvcache's own model.
LOOPS = ("naive", "concat", "static")
NOT_HERE = ("weights", "weights_dtype", "compile_", "profile", "tasks", "context", "draft",
            "speculate", "prompt_file")


def bench_engine(ctx: typer.Context, model: str) -> None:
    """Time each mode's decode steps on the transformers model of -m MODEL, the command's
    other options as parsed (`ctx.params`)."""
    p = ctx.params
    modes, cache, threads, plot = p["modes"], p["cache"], p["threads"], p["plot"]
    prompt_len, new_tokens, repeats = p["prompt_len"], p["new_tokens"], p["repeats"]
    from kvcache_cli.cli.bench import _check_options, _progress, _with_caches
    from kvcache_cli.cli.engine import load_engine, refuse_options

    refuse_options(ctx, NOT_HERE, "bench times kvcache's decode loop over the bridge's "
                   "caches (--modes naive, concat, static, and cache specs)")
    need_torch_extra("kvcache bench needs", *GPT2_MODULES, "transformers")
    given = getattr(ctx.get_parameter_source("modes"), "name", "") == "COMMANDLINE"
    modes = modes if given else "static"
    if cache is not None:
        modes = _with_caches(modes, cache)
    names, dev = _check_options(modes, False, p["device"], threads, plot)
    _check_modes(names)
    from kvcache_cli.bench import run as bench_
    from kvcache_cli.views.bench import bench as bench_view
    from kvcache_cli.views.bench_plot import save_plot

    threads = pick_threads(threads, dev)
    loaded = load_engine(model, str(dev), DType(p["dtype"]).value)  # click's str, or the enum
    try:
        bench_.check_bench(loaded.model, names, prompt_len, new_tokens, repeats, threads,
                           p["naive_samples"])
        with _progress() as (on_progress, on_finished):
            result = bench_.run_bench(
                loaded.model, modes=names, prompt_len=prompt_len, new_tokens=new_tokens,
                repeats=repeats, threads=threads, naive_samples=p["naive_samples"],
                model_name=loaded.source, progress=on_progress, finished=on_finished)
    except (ValueError, IndexError) as err:
        fail(str(err))
    except (RuntimeError, OSError) as err:
        fail(str(err), code=1)
    show_then_plot(result, bench_view, p["as_json"], save_plot, plot, "per-step plot")


def _check_modes(names: list[str]) -> None:
    """Modes this engine runs: kvcache's loop, with a kind the bridge holds."""
    from kvcache_cli.bench.modes import MODES
    from kvcache_cli.caches.spec import parse_cache_spec
    from kvcache_cli.cli.engine import refuse_kinds

    other = next((m for m in names if m in MODES and m not in LOOPS), None)
    if other is not None:
        fail(f"mode {other!r} with --engine transformers: it times another engine or "
             f"kvcache's own model; expected {', '.join(LOOPS)} or a cache spec")
    refuse_kinds([parse_cache_spec(m) for m in names if m != "naive"])
