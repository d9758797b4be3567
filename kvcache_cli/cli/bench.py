"""`kvcache bench`: every decode step of every mode timed, against transformers and the
memory limit."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated

import typer

from kvcache_cli.cli import drafts
from kvcache_cli.cli.bench_context import CONTEXT_STEPS, bench_context
from kvcache_cli.cli.bench_engine import bench_engine
from kvcache_cli.cli.engine import Engine, EngineOption, pick_engine
from kvcache_cli.cli.loading import (
    GPT2_MODULES,
    check_cache_for,
    check_weights_dtype,
    default_model,
    need_torch_extra,
    pick_threads,
    refuse_missing_model,
    refuse_unbuilt_cuda,
    with_weights_dtype,
)
from kvcache_cli.cli.options import (
    TORCH_DTYPES,
    DeviceOption,
    DType,
    ModelOption,
    WeightsDTypeOption,
    refuse_empty_items,
    threads_error,
)
from kvcache_cli.cli.output import check_plot, console, progress, show_then_plot
from kvcache_cli.cli.prompt_file import prompt_ids, read_prompt
from kvcache_cli.cli.refusals import defaults_in, fail

# `bench --profile`: decode steps profiled, unless --new-tokens is given; the profiler's
# own cost grows with the events it keeps.
PROFILE_STEPS = 32


def bench(
    ctx: typer.Context,
    device: DeviceOption = "auto",
    model: ModelOption = None,
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
        "hf-static (its static cache), hf-quanto (its QuantizedCache, quanto int4), "
        "static-compiled, hf-static-compiled, static-replayed (static, each step's native "
        "calls recorded once and run again), llama.cpp, "
        "llama.cpp-f16, llama.cpp-q8_0 (llama.cpp on the same weights written to GGUF; "
        "needs the llama extra, pip install 'kvcache[llama]', which builds llama.cpp "
        "from source: minutes), llama.cpp-gguf (the GGUF file the model was read from, "
        "as it is: SmolLM2's Q4_1, Gemma 3's Q4_K_M), or any cache spec: window:128, int8 "
        "(kvcache caches).")
    ] = "naive,concat,static,hf,hf-static",
    cache: Annotated[str | None, typer.Option(
        metavar="SPECS", help="Comma-separated cache specs to time as modes, e.g. "
        "window:128,int4: beside static alone, or beside --modes when it is given. With "
        "--draft: the target's one cache, any kind that rolls back (default static).")
    ] = None,
    compile_: Annotated[bool, typer.Option(
        "--compile", help="Also run static and hf-static under torch.compile (compile time "
        "reported apart, never timed).")] = False,
    naive_samples: Annotated[int, typer.Option(
        help="Time naive at this many decode steps spread over the run; 0: every step "
        "(minutes).")] = 16,
    repeats: Annotated[int, typer.Option(help="Timed runs per mode; medians are reported.")] = 3,
    threads: Annotated[int | None, typer.Option(
        help="torch intra-op threads (default: one per core other processes leave free, "
        "with a note when that is fewer than all).")] = None,
    plot: Annotated[Path | None, typer.Option(
        help="Write the per-step latency plot to this PNG (needs matplotlib).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw result as JSON.")] = False,
    draft: drafts.DraftOption = None,
    speculate: Annotated[str, typer.Option(
        help="With --draft: the K values to sweep (most draft tokens checked a forward).")
    ] = "1,2,3,4,6,8",
    prompt_file: Annotated[Path | None, typer.Option(
        help="With --draft: a text whose first --prompt-len tokens are the prompt (prompt "
        "lookup needs text that repeats itself; the default is a shipped checkpoint's "
        "held-out text, else seeded random ids).")
    ] = None,
    context: Annotated[str | None, typer.Option(
        metavar="TOKENS", help="Comma-separated cached-token counts, e.g. 1024,4096,8176: one "
        "decode step timed at each for every --cache (default static,fp16,int8,int4), beside "
        "llama.cpp's step with the matched cache type (f16, q8_0, q4_0) on the same weights "
        "where the llama extra is installed, and the cache bytes each step reads. "
        f"--new-tokens: the steps timed a round at each context (default {CONTEXT_STEPS} "
        "here); --repeats: the rounds.")
    ] = None,
    replay: Annotated[bool, typer.Option(
        "--replay", help="With --context: our steps as `generate` runs them, each step's "
        "native calls recorded once and run again where the cache allows it (static, fp16, "
        "bf16, a model's own sliding windows), eager where it does not (each cache's row "
        "says which).")] = False,
    profile: Annotated[bool, typer.Option(
        "--profile", help="Where one decode step of the static loop goes, by kind of op "
        "(products, attention, norms, rotary, activations, cache writes, other ops, Python and "
        "dispatch), under torch.profiler on the CPU, then the step against its products "
        "and its attention replayed alone; --new-tokens: the steps profiled and timed "
        f"(default {PROFILE_STEPS} here); --dtype and --weights-dtype: the format.")
    ] = False,
    tasks: Annotated[str | None, typer.Option(
        metavar="SETS", help="Speculative decoding on the model's own chat tasks (copy: "
        "replies that copy the prompt; other: new text), comma-separated: plain greedy to the "
        "end of turn or --new-tokens, then each --draft (comma-separated, lookup[:n] or "
        "layers:N; default lookup) at each K of --speculate (default 2,4) with --cache, which "
        "must give the same tokens; acceptance, forwards per token and speed-up per set.")
    ] = None,
    engine: EngineOption = Engine.auto,
) -> None:
    """Time every decode step of every mode, against transformers and the memory limit.

    Warm-up excluded, the device synchronised around each timed step, medians over
    repeats; the memory bandwidth is probed in the same run. Progress shows the steps
    done and an ETA. With --draft: speculative decoding at each K of --speculate against
    plain decoding with the same cache, interleaved, medians over --repeats.
    """
    model = model if model is not None else default_model()
    _check_lists(modes, cache, speculate, context, tasks, draft)
    _check_first(threads, plot, model, device, replay and context is None)
    if pick_engine(model, engine) == "transformers":
        return bench_engine(ctx, model)  # its other options read from ctx.params
    if profile:
        _profile(ctx, device, model, weights, dtype, weights_dtype, prompt_len, new_tokens,
                 threads, as_json)
        return
    if tasks is not None:
        _tasks(ctx, tasks, draft or "lookup", speculate, cache or "static", model, weights,
               device, new_tokens, threads, as_json)
        return
    if context is not None:
        from kvcache_cli.bench.context import DEFAULT_CACHES

        bench_context(ctx, context, cache or DEFAULT_CACHES, device, model, weights, dtype,
                      weights_dtype, new_tokens, repeats, threads, plot, as_json, replay)
        return
    if draft is not None:
        _speculative(ctx, draft, speculate, cache or "static", prompt_file, device, model, weights,
                     dtype, prompt_len, new_tokens, repeats, threads, as_json)
        return
    given = [p for p in ("speculate", "prompt_file")
             if getattr(ctx.get_parameter_source(p), "name", "") == "COMMANDLINE"]
    if given:
        fail(f"--{given[0].replace('_', '-')} applies to speculative decoding only: expected "
             "a --draft with it")
    need_torch_extra("kvcache bench needs", *GPT2_MODULES, "transformers")
    import torch

    from kvcache_cli.bench import modes as bench_modes
    from kvcache_cli.bench import run as bench_
    from kvcache_cli.models import load_model
    from kvcache_cli.views.bench import bench as bench_view
    from kvcache_cli.views.bench_plot import save_plot

    # Everything a user can get wrong is checked before minutes of benchmarking.
    if cache is not None:
        given = getattr(ctx.get_parameter_source("modes"), "name", "") == "COMMANDLINE"
        modes = _with_caches(modes if given else "static", cache)
    mode_names, dev = _check_options(modes, compile_, device, threads, plot)
    for name in mode_names:
        if (spec := bench_modes.bounded_spec(name)) is not None:
            check_cache_for(spec, model)  # a window past the context, before the weights
    check_weights_dtype(weights_dtype, model, str(dev))
    _check_heads(modes, model)
    _check_own_gguf(mode_names, model)
    _check_config(ctx, model, mode_names, prompt_len, new_tokens, repeats, threads,
                  naive_samples)
    threads = pick_threads(threads, dev)
    try:
        loaded = load_model(model, weights=weights, device=dev,
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


def _check_lists(modes: str, cache: str | None, speculate: str, context: str | None,
                 tasks: str | None, draft: str | None) -> None:
    """An empty item in a comma-separated option, refused first: it needs no model."""
    refuse_empty_items(
        ("--modes", modes, "comma-separated modes such as naive,static,int8"),
        ("--cache", cache, "comma-separated cache specs such as window:128,int4"),
        ("--speculate", speculate, "comma-separated K values such as 1,2,4"),
        ("--context", context, "comma-separated token counts such as 1024,4096"),
        ("--tasks", tasks, "comma-separated sets such as copy,other"),
        # A list only with --tasks; alone, one draft, which its own parser reads.
        ("--draft", draft if tasks is not None else None,
         "comma-separated drafts such as lookup,layers:2"))


def _check_first(threads: int | None, plot: Path | None, model: str, device: str,
                 stray_replay: bool) -> None:
    """What every kind of bench run refuses before torch is imported: values first, then the
    path, then the device."""
    if threads_error(threads):
        fail(threads_error(threads))
    if stray_replay:
        fail("--replay applies to --context; a short run replays its steps with --modes "
             "static-replayed")
    check_plot(plot)
    refuse_missing_model(model)
    refuse_unbuilt_cuda(device)


def _speculative(ctx, draft: str, speculate: str, cache: str, prompt_file: Path | None,
                 device: str, model: str, weights: str, dtype: DType, prompt_len: int,
                 new_tokens: int, repeats: int, threads: int | None, as_json: bool) -> None:
    """`bench --draft`: plain and speculative decoding of one prompt, K swept."""
    ignored = [p for p in ("modes", "compile_", "naive_samples", "plot")
               if getattr(ctx.get_parameter_source(p), "name", "") == "COMMANDLINE"]
    if ignored:
        name = "--compile" if ignored[0] == "compile_" else f"--{ignored[0].replace('_', '-')}"
        fail(f"{name} does not apply with --draft: speculative decoding is timed against "
             "plain decoding with --cache")
    if "," in cache:
        fail(f"--cache {cache!r} with --draft: expected one cache, the target's (a kind that "
             "rolls back)")
    need_torch_extra("kvcache bench needs", *GPT2_MODULES)
    ks = drafts.parse_ks(speculate)
    if threads_error(threads):
        fail(threads_error(threads))
    from kvcache_cli.bench.run import MAX_REPEATS

    if not 1 <= repeats <= MAX_REPEATS:
        fail(f"--repeats {repeats:,}: expected a whole number from 1 to {MAX_REPEATS:,}")
    text = read_prompt(prompt_file)
    if text is None:
        from kvcache_cli.checkpoints import heldout_text, shipped_dir

        if shipped_dir(model) is not None:  # a shipped checkpoint: the text it never saw
            text = heldout_text(model)
    spec, note = drafts.check(model, draft, ks, cache, prompt_len + new_tokens)
    _check_lengths(ctx, model, prompt_len, new_tokens)

    from kvcache_cli.bench import modes as bench_modes
    from kvcache_cli.cli.loading import load_model
    from kvcache_cli.generate import check_request
    from kvcache_cli.measure import resolve_device
    from kvcache_cli.speculative import decode as sp
    from kvcache_cli.views.speculative import spec_run_view

    try:
        dev = str(resolve_device(device))
    except ValueError as err:
        fail(str(err))
    pick_threads(threads, dev)
    loaded = load_model(model, weights, dev, dtype.value)
    target = loaded.model  # the model the drafts are verified by
    prompt = (prompt_ids(target, text)[:prompt_len] if text is not None
              else bench_modes.random_prompt(target.config.vocab_size, prompt_len))
    try:
        check_request(target, prompt, new_tokens)
    except (ValueError, IndexError) as err:
        fail(str(err))
    built = drafts.build(spec, loaded, weights, dev, dtype.value, len(prompt) + new_tokens)
    if text is None and spec.kind == "lookup":
        note = "; ".join(filter(None, [note, "a random prompt: prompt lookup finds little to "
                                              "copy (give --prompt-file)"]))
    try:
        run = sp.compare(target, prompt, new_tokens, built, ks, cache=cache, repeats=repeats,
                         target=loaded.source, note=note or None)
    except (ValueError, IndexError) as err:
        fail(str(err))
    show_then_plot(run, spec_run_view, as_json, None, None, "")  # no plot: save is unused


def _given(ctx, names: tuple[str, ...]) -> str | None:
    """The first of `names` given on the command line, spelled as an option, or None."""
    given = [p for p in names
             if getattr(ctx.get_parameter_source(p), "name", "") == "COMMANDLINE"]
    if not given:
        return None
    return "--compile" if given[0] == "compile_" else f"--{given[0].replace('_', '-')}"


def _profile(ctx, device: str, model: str, weights: str, dtype: DType,
             weights_dtype: str | None, prompt_len: int, new_tokens: int,
             threads: int | None, as_json: bool) -> None:
    """`bench --profile`: one decode step split by kind of op."""
    ignored = _given(ctx, ("modes", "cache", "compile_", "naive_samples", "repeats", "plot",
                           "draft", "speculate", "prompt_file", "context", "tasks"))
    if ignored:
        fail(f"{ignored} does not apply with --profile: one format's decode step of the "
             "static loop is profiled")
    steps = new_tokens if _given(ctx, ("new_tokens",)) else PROFILE_STEPS
    from kvcache_cli.numbers import NumberError, whole

    try:
        steps = whole(str(steps), "--new-tokens", 1, 10_000)
        prompt_len = whole(str(prompt_len), "--prompt-len", 1, 10**7)
    except NumberError as err:
        fail(str(err))
    if threads_error(threads):
        fail(threads_error(threads))
    need_torch_extra("kvcache bench needs", *GPT2_MODULES)
    # The profiler here records the CPU's ops: a GPU's kernels would not be in the split.
    dev = _cpu_only(device, "--profile", "the split is of the CPU's ops")
    check_weights_dtype(weights_dtype, model, "cpu")
    _check_lengths(ctx, model, prompt_len, steps)
    import torch

    from kvcache_cli.bench.profile import parts_tokens, profile_step
    from kvcache_cli.models import load_model, set_weights_dtype
    from kvcache_cli.views.bench import profile_view

    _check_parts_length(model, prompt_len, steps, parts_tokens(steps))
    pick_threads(threads, dev)
    try:
        loaded = load_model(model, weights=weights, device=dev,
                            dtype=getattr(torch, TORCH_DTYPES[dtype.value]))
        if weights_dtype is not None:
            set_weights_dtype(loaded.model, weights_dtype)
        result = profile_step(loaded.model, steps, loaded.source, dtype.value, prompt_len)
    except (ValueError, IndexError) as err:
        fail(str(err))
    except (RuntimeError, OSError) as err:
        fail(str(err), code=1)
    show_then_plot(result, profile_view, as_json, None, None, "")  # no plot: save is unused


def _check_parts_length(model: str, prompt_len: int, steps: int, tokens: int) -> None:
    """The profiled steps, then as many timed against their parts, run on one cache:
    `tokens` after the prompt, within the context window."""
    from kvcache_cli.models import model_config

    try:
        window = model_config(model).context
    except ValueError:
        return  # not a model: the loader says so in its own words
    if prompt_len + tokens > window:
        fail(f"--profile runs {tokens:,} tokens for --new-tokens {steps:,} (the steps "
             f"profiled, then as many timed against their parts): --prompt-len "
             f"{prompt_len:,} + {tokens:,} past context window {window:,}")


def _cpu_only(device: str, flag: str, why: str):
    """The CPU for a run that measures only there (`auto` means it); another device is
    refused in one line."""
    from kvcache_cli.measure import resolve_device

    try:
        dev = resolve_device("cpu" if device == "auto" else device)
    except ValueError as err:
        fail(str(err))
    if dev.type != "cpu":
        fail(f"--device {device} with {flag}: {why}; expected --device cpu")
    return dev


def _tasks(ctx, sets: str, draft: str, speculate: str, cache: str, model: str, weights: str,
           device: str, new_tokens: int, threads: int | None, as_json: bool) -> None:
    """`bench --tasks`: speculative decoding on the model's chat tasks, the whole table."""
    ignored = _given(ctx, ("modes", "compile_", "naive_samples", "repeats", "plot",
                           "prompt_file", "prompt_len", "context", "weights_dtype", "dtype"))
    if ignored:
        fail(f"{ignored} does not apply with --tasks: each task's own prompt is decoded in "
             "float32, plain and with each --draft")
    if "," in cache:
        fail(f"--cache {cache!r} with --tasks: expected one cache, the target's (a kind that "
             "rolls back)")
    ks = drafts.parse_ks(speculate if _given(ctx, ("speculate",)) else "2,4")
    if threads_error(threads):
        fail(threads_error(threads))
    if new_tokens < 1:
        fail(f"--new-tokens {new_tokens:,}: expected a whole number, 1 or more")
    need_torch_extra("kvcache bench needs", *GPT2_MODULES)
    # Speculation's seconds are read off the host's clock, with no device synchronised.
    dev = _cpu_only(device, "--tasks", "the table is timed on the CPU")
    from kvcache_cli.caches import CacheSpecError
    from kvcache_cli.models import model_config
    from kvcache_cli.speculative.drafts import parse_draft
    from kvcache_cli.speculative.tasks import check_tasks

    try:
        specs = [parse_draft(d.strip()) for d in draft.split(",") if d.strip()]
        config = model_config(model)
        chat, stop_ids = check_tasks(config, model, [s.strip() for s in sets.split(",")
                                                     if s.strip()], specs, ks, cache,
                                     new_tokens)
    except (ValueError, CacheSpecError) as err:  # NumberError and RollbackError are both
        fail(str(err))
    import torch

    from kvcache_cli.cli.loading import load_model
    from kvcache_cli.speculative.drafts import make_draft
    from kvcache_cli.speculative.tasks import run_tasks
    from kvcache_cli.views.speculative import task_table_view

    pick_threads(threads, dev)
    loaded = load_model(model, weights, str(dev), "fp32")
    max_len = max(len(t.prompt_ids) for t in chat) + new_tokens + max(ks) + 1
    built = [make_draft(s, loaded.model, max_len) for s in specs]

    def progress(run) -> None:  # a set runs minutes: a line a task says it is alive
        typer.echo(f"{run.kind} {run.index}: {run.reply_tokens} tokens", err=True)

    try:
        table = run_tasks(loaded.model, model, chat, built, ks, cache, new_tokens, stop_ids,
                          torch.get_num_threads(), progress)
    except (ValueError, IndexError) as err:
        fail(str(err))
    show_then_plot(table, task_table_view, as_json, None, None, "")  # no plot: save is unused


def _check_lengths(ctx, model: str, prompt_len: int, new_tokens: int) -> None:
    """--prompt-len and --new-tokens against the context window, before the weights load
    (a --prompt-file's text can only be shorter)."""
    from kvcache_cli.models import model_config

    try:
        window = model_config(model).context
    except ValueError:
        return  # not a model: the loader says so in its own words
    if prompt_len < 1 or new_tokens < 1:
        flag, value = ("--prompt-len", prompt_len) if prompt_len < 1 else ("--new-tokens",
                                                                         new_tokens)
        fail(f"{flag} {value:,}: expected a whole number, 1 or more")
    if prompt_len + new_tokens > window:
        fail(defaults_in(ctx, f"--prompt-len {prompt_len:,} + --new-tokens {new_tokens:,} = "
                              f"{prompt_len + new_tokens:,} past context window {window:,}"))


def _check_config(ctx, model: str, mode_names, prompt_len, new_tokens, repeats, threads,
                  naive_samples) -> None:
    """`bench.check_bench_config` before the weights load: the model's config alone."""
    from kvcache_cli.bench import run as bench_
    from kvcache_cli.models import model_config

    try:
        config = model_config(model)
    except ValueError:
        return  # not a model: the loader says so in its own words
    try:
        bench_.check_bench_config(config, mode_names, prompt_len, new_tokens, repeats, threads,
                                  naive_samples)
    except ValueError as err:
        fail(defaults_in(ctx, str(err)))


def _with_caches(modes: str, caches: str) -> str:
    """--modes with --cache's specs after it, each once (a spec already there stays put),
    spelled as typed so that a later refusal names the user's text."""
    from kvcache_cli.bench.modes import mode_name
    from kvcache_cli.caches.grammar import CacheSpecError
    from kvcache_cli.caches.spec import parse_cache_list

    try:
        specs = parse_cache_list(caches)
    except CacheSpecError as err:
        fail(f"--cache: {err}")
    names = [m.strip() for m in modes.split(",") if m.strip()]
    there = {mode_name(n) for n in names}
    return ",".join([*names, *(s.typed for s in specs if str(s) not in there)])


def _check_options(modes: str, compile_: bool, device: str, threads: int | None,
                   plot: Path | None) -> tuple[list[str], str]:
    """The mode names (with their compiled twins under --compile) and the device; bad input
    fails here, before the model loads."""
    from kvcache_cli.bench import modes as bench_modes
    from kvcache_cli.measure import resolve_device
    from kvcache_cli.models.llama_cpp import check_llama_modes

    try:
        mode_names = bench_modes.parse_modes(modes)
        if compile_:
            extra = [bench_modes.COMPILED[m] for m in mode_names if m in bench_modes.COMPILED]
            if not extra:
                raise ValueError("--compile needs mode static or hf-static in --modes")
            mode_names = bench_modes.parse_modes(",".join((*mode_names, *extra)))
        dev = resolve_device(device)
        check_llama_modes(mode_names, dev.type)
    except ValueError as err:
        fail(str(err))
    if threads_error(threads):
        fail(threads_error(threads))
    check_plot(plot)
    return mode_names, dev


def _check_heads(modes: str, model: str) -> None:
    """Quantised specs whose groups or packing do not fit the model's heads, refused before
    the weights load, naming each as the user typed it in --modes or --cache."""
    from kvcache_cli.bench import modes as bench_modes
    from kvcache_cli.caches.grammar import CacheSpecError
    from kvcache_cli.caches.spec import check_spec, parse_cache_spec
    from kvcache_cli.models import model_config

    parts = [m.strip() for m in modes.split(",") if m.strip()]
    specs = [parse_cache_spec(m) for m in parts if m.lower() not in bench_modes.MODES]
    try:
        head_size = model_config(model).head_size if specs else 0
    except ValueError:
        return  # not a model: the loader says so in its own words
    try:
        for spec in specs:
            check_spec(spec, head_size)
    except CacheSpecError as err:
        fail(str(err))


def _check_own_gguf(mode_names: list[str], model: str) -> None:
    """llama.cpp-gguf runs the file the model was read from: refused, before the weights
    load, for a model that was not read from a GGUF."""
    from kvcache_cli.models import model_config

    if "llama.cpp-gguf" not in mode_names:
        return
    try:
        source = getattr(model_config(model), "gguf", None)
    except ValueError:
        return  # not a model: the loader says so in its own words
    if source is None:
        fail(f"mode 'llama.cpp-gguf' runs the GGUF file the model was read from, and "
             f"{model!r} was not read from one: expected -m smollm2, -m gemma3 or a .gguf")


@contextlib.contextmanager
def _progress():
    """(on_progress, on_finished): progress on stderr while the run lasts (`output.progress`:
    the run timed now, the steps of all runs, an ETA; a bar in a terminal, a line now and
    then off one), and off a terminal a line per finished run. On stderr and transient, so
    stdout holds only the result (and --json stays JSON)."""
    err_console = console(stderr=True)

    def on_finished(label: str, tokens_per_s: float) -> None:
        if not err_console.is_terminal:  # in a terminal the bar shows the run
            typer.echo(f"{label}: {tokens_per_s:.1f} tokens/s", err=True)

    with progress("loading", "steps") as update:
        yield (lambda label, done, total: update(done, total, label)), on_finished
