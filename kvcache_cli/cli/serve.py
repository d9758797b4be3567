"""`kvcache serve`: a seeded workload through several engines, or decode steps at a
sweep of batch sizes against the roofline."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated

import typer

from kvcache_cli import numbers
from kvcache_cli.cli.loading import (
    GPT2_MODULES,
    check_weights_dtype,
    default_model,
    load_model,
    need_torch_extra,
    pick_threads,
    refuse_missing_model,
    refuse_unbuilt_cuda,
)
from kvcache_cli.cli.options import (
    DeviceOption,
    ModelOption,
    WeightsDTypeOption,
    refuse_empty_items,
    threads_error,
)
from kvcache_cli.cli.output import (
    Eta,
    ProgressLines,
    check_plot,
    clock,
    console,
    progress_bar,
    show_then_plot,
)
from kvcache_cli.cli.refusals import defaults_in, fail


def serve(
    ctx: typer.Context,
    device: DeviceOption = "auto",
    model: ModelOption = None,
    weights: Annotated[str, typer.Option(
        help="auto (real if available, else random), pretrained, random.")] = "auto",
    weights_dtype: WeightsDTypeOption = None,
    workload: Annotated[str | None, typer.Option(
        help="chat (prompts through the model's chat template: one system prompt, user "
        "turns from a shipped set, replies to the end-of-turn token or --output-len), "
        "random (random ids), or a JSON file {\"system\": ..., \"prompts\": [...]} "
        "(default: chat for a model with a chat template, else random).")] = None,
    requests: Annotated[int | None, typer.Option(
        help="Requests in the workload (default: 24 random, 16 chat).")] = None,
    prompt_len: Annotated[str, typer.Option(
        help="random: prompt lengths MIN:MAX (after the shared prefix), drawn per request.")
    ] = "16:256",
    output_len: Annotated[str | None, typer.Option(
        help="random: output lengths MIN:MAX, drawn per request (default 16:128); chat: the "
        "cap on a reply, N (default 128).")] = None,
    shared_prefix: Annotated[int, typer.Option(
        help="random: tokens every prompt starts with (a system prompt).")] = 64,
    rate: Annotated[str | None, typer.Option(
        help="Arrivals, requests/s; several, e.g. 1,2,4,8,inf, run the workload at each "
        "and draw the curve (default: all at once, inf).")] = None,
    burstiness: Annotated[float, typer.Option(
        help="Gamma shape of the gaps between arrivals at a --rate: 1 Poisson, < 1 "
        "burstier.")] = 1.0,
    max_concurrency: Annotated[int | None, typer.Option(
        help="Requests in flight at most; a request is sent when a slot frees "
        "(default: no cap).")] = None,
    goodput: Annotated[str | None, typer.Option(
        help="Latency targets in ms, e.g. ttft:2000,tpot:100 (keys ttft, tpot, e2el): "
        "goodput counts the requests meeting every one.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the workload.")] = 0,
    engines: Annotated[str, typer.Option(
        help="Comma-separated, from: sequential, padded, paged, hf (transformers' "
        "continuous batching).")] = "sequential,paged,hf",
    policy: Annotated[str, typer.Option(
        help="paged's scheduler, comma-separated for each: prefill-first (a whole prompt "
        "alone, decodes wait) or decode-first (decodes, then prompt chunks, under "
        "--token-budget).")] = "prefill-first,decode-first",
    token_budget: Annotated[str, typer.Option(
        help="decode-first's tokens per forward, comma-separated for each, e.g. "
        "64,256,1024; at least one block.")] = "256",
    layout: Annotated[str, typer.Option(
        help="decode-first's forward: packed (rows back to back) or padded (a batch "
        "padded to the longest chunk).")] = "packed",
    kv_mem: Annotated[str, typer.Option(
        help="KV memory every engine may hold: 256MiB, 1GB or bytes.")] = "256MiB",
    block_size: Annotated[int, typer.Option(help="Tokens per KV block (paged, hf).")] = 16,
    kv_dtype: Annotated[str | None, typer.Option(
        help="Also run the paged engine on quantised blocks in the same --kv-mem: int8, "
        "int4, fp8 or a comma-separated list (engines paged-int8, ...).")] = None,
    keep_windows: Annotated[str | None, typer.Option(
        help="A model with sliding layers (gemma3): its sliding layers keep the window's "
        "blocks before every N tokens for later prefix hits (0: give back every block as it "
        "leaves the window, vLLM's); comma-separated runs paged once each, e.g. 0,64 "
        "(default 0).")] = None,
    max_batch: Annotated[int, typer.Option(help="Most sequences decoded at once.")] = 256,
    prefix_sharing: Annotated[bool, typer.Option(
        help="Share full blocks of equal prefixes (paged, and hf's own).")] = True,
    threads: Annotated[int | None, typer.Option(
        help="torch intra-op threads (default: one per core other processes leave free, "
        "with a note when that is fewer than all).")] = None,
    batch: Annotated[str | None, typer.Option(
        help="Instead of the workload: decode-step time at these batch sizes, e.g. "
        "1,4,16,64, against the roofline.")] = None,
    plot: Annotated[Path | None, typer.Option(
        help="Write KV in use and running sequences over time to this PNG; with several "
        "--rate, the curve: tokens/s against p99 TTFT and TPOT.")] = None,
    target: Annotated[str | None, typer.Option(
        help="Also send the workload to a running OpenAI-compatible server (vLLM, SGLang, "
        "llama.cpp) at this URL, e.g. http://127.0.0.1:8000, timed as 'vllm bench serve' "
        "times it; its row sits beside the engines.")] = None,
    target_model: Annotated[str | None, typer.Option(
        help="The served model's name the requests give (default: the one the server "
        "serves).")] = None,
    timeout: Annotated[float, typer.Option(
        help="--target: seconds one request may take, first byte to the end of its "
        "stream.")] = 300.0,
    target_prompt: Annotated[str, typer.Option(
        help="--target: send each prompt as its token ids (ids: the very tokens the engines "
        "get) or as text the server tokenizes again (text: for a server that takes only "
        "text, such as llama-cpp-python's).")] = "ids",
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw result as JSON.")] = False,
) -> None:
    """Serve a seeded workload through several engines: paged + continuous batching
    (prefill-first and decode-first) against one-at-a-time, padded batches and
    transformers' generate_batch.

    Latency as vLLM measures it (TTFT, TPOT, ITL, E2E; p50/p90/p99). Each request's
    tokens are checked against its solo generation; set-up is timed apart from the
    run. The default model is SmolLM2 where it is installed (16 chat requests), else the
    shipped stdlib-bytes (24 random requests); -m gpt2 for GPT-2's shapes.
    """
    model = model if model is not None else default_model()
    need_torch_extra("kvcache serve needs", *GPT2_MODULES, "transformers")
    if target is not None:  # its HTTP client: the same extra
        need_torch_extra("kvcache serve --target needs", "httpx", "httpx_sse",
                         "prometheus_client")
    if threads_error(threads):  # first: it needs no model and none of serving's imports
        fail(threads_error(threads))
    _check_lists(rate, goodput, engines, policy, token_budget, kv_dtype, keep_windows, batch)
    refuse_missing_model(model)
    refuse_unbuilt_cuda(device)
    from kvcache_cli.serving import batching
    from kvcache_cli.serving import engines as serving
    from kvcache_cli.serving.chat import requests as chat_requests
    from kvcache_cli.views.serve import render
    from kvcache_cli.views.serve_plot import save_plot

    # Everything a user can get wrong is refused before a model loads.
    layout = layout.strip().lower()  # names in any case, as every option reads them
    try:
        where = _target(ctx, target, target_model, timeout, batch, target_prompt)
        engines = _with_kv_dtypes(engines, kv_dtype, batch)
        chat = _chat_workload(ctx, workload, model, requests, output_len, seed, batch)
        dev, what = _check(device, model, requests, prompt_len, output_len, shared_prefix, rate,
                           seed, engines, kv_mem, block_size, max_batch, threads, batch,
                           burstiness, max_concurrency, goodput, policy, token_budget, layout,
                           chat, keep_windows)
    except ValueError as err:
        fail(defaults_in(ctx, str(err)))
    check_plot(plot)
    check_weights_dtype(weights_dtype, model, dev)
    status = console(stderr=True)
    remote = () if where is None else _run_target(where, target_model, timeout, model, what,
                                                   chat, status, target_prompt)
    loaded = load_model(model, weights, dev)
    threads = pick_threads(threads, dev)
    if weights_dtype is not None:
        from kvcache_cli.models import set_weights_dtype

        set_weights_dtype(loaded.model, weights_dtype)
    try:
        if batch is not None:
            with status.status("decode steps at each batch size"):
                result = batching.run_sweep(loaded.model, what, threads=threads,
                                            model_name=loaded.source)
        else:
            spec, variants, memory, rates, targets = what
            runs = len(variants) * len(rates) * spec.requests
            with _progress(status, runs, len(rates) > 1) as (on_step, on_done):
                result = serving.run_serve(
                    loaded.model, spec, variants, memory, block_size, max_batch,
                    prefix_sharing, threads, loaded.source, loaded.note, on_step, rates=rates,
                    targets=targets, layout=layout, done=on_done,
                    prompts=None if chat is None else chat_requests(chat, spec.output_len[1]),
                    stop_names=() if chat is None else chat.stop_names)
    except (ValueError, IndexError) as err:
        fail(str(err))
    except RuntimeError as err:
        fail(str(err), code=1)
    if remote:
        from kvcache_cli.serving.target_rows import beside

        result = beside(result, _checked(remote, result, loaded.model, model))
    show_then_plot(result, render, as_json, save_plot, plot, "plot")


def _check_lists(rate, goodput, engines, policy, token_budget, kv_dtype, keep_windows,
                 batch) -> None:
    """An empty item in a comma-separated option, refused before the model: it needs none."""
    refuse_empty_items(
        ("--rate", rate, "comma-separated requests/s such as 1,2,4,inf"),
        ("--goodput", goodput, "comma-separated targets such as ttft:2000,tpot:100"),
        ("--engines", engines, "comma-separated engines such as sequential,paged"),
        ("--policy", policy, "comma-separated policies such as prefill-first,decode-first"),
        ("--token-budget", token_budget, "comma-separated budgets such as 64,256,1024"),
        ("--kv-dtype", kv_dtype, "comma-separated kinds such as int8,int4"),
        ("--keep-windows", keep_windows, "comma-separated intervals such as 0,64"),
        ("--batch", batch, "comma-separated batch sizes such as 1,4,16,64"))


# A request slower than a day is a typing slip, not a run anyone waits for.
MAX_TIMEOUT_S = 86_400


def _target(ctx, url, model, timeout, batch, prompt_form):
    """The --target URL parsed (None without one); ValueError for what cannot be meant."""
    from kvcache_cli.serving.target import PROMPT_FORMS, parse_target

    if url is None:
        def typed(name: str) -> bool:
            return getattr(ctx.get_parameter_source(name), "name", "") == "COMMANDLINE"

        for flag, given in (("--target-model", model is not None),
                            ("--timeout", typed("timeout")),
                            ("--target-prompt", typed("target_prompt"))):
            if given:
                raise ValueError(f"{flag} is for a --target server: expected --target URL "
                                 "with it")
        return None
    if batch is not None:
        raise ValueError("--target serves the workload: not with --batch (decode steps only)")
    if not 0 < timeout <= MAX_TIMEOUT_S:
        raise ValueError(f"--timeout {timeout:g}: expected seconds more than 0 and at most "
                         f"{MAX_TIMEOUT_S:,}")
    if prompt_form not in PROMPT_FORMS:
        raise ValueError(f"--target-prompt {prompt_form!r}: expected one of "
                         f"{', '.join(PROMPT_FORMS)}")
    return parse_target(url)


def _checked(remote, result, model, name: str) -> list:
    """Each server row with its replies held against the solo tokens, where the model's
    tokenizer can decode them (rows as they are otherwise)."""
    from kvcache_cli.models import model_config
    from kvcache_cli.models.tokenizer import encoding_for
    from kvcache_cli.serving.target_rows import check_replies

    encoding, _ = encoding_for(model_config(name).tokenizer)
    if encoding is None or not result.solo_tokens:
        return [row for row, _ in remote]
    return [check_replies(row, requests, result.solo_tokens, encoding.decode, model)
            for row, requests in remote]


def _prompt_texts(model, requests) -> dict[int, str]:
    """Each prompt decoded by the model's own tokenizer (--target-prompt text)."""
    from kvcache_cli.models import model_config
    from kvcache_cli.models.tokenizer import encoding_for

    encoding, why = encoding_for(model_config(model).tokenizer)
    if encoding is None:
        raise ValueError(f"--target-prompt text: model {model!r}'s tokenizer: {why}")
    return {r.id: encoding.decode(list(r.prompt)) for r in requests}


def _run_target(where, target_model, timeout, model, what, chat, err_console, prompt_form):
    """The workload against the server at every rate, before any weights load: a server
    that is down or refuses the model fails the command in seconds, not after the engines."""
    import dataclasses

    from kvcache_cli.models import model_config
    from kvcache_cli.serving import target
    from kvcache_cli.serving.chat import requests as chat_requests
    from kvcache_cli.serving.workload import make_requests

    spec, _, _, rates, goals = what
    prompts = None if chat is None else chat_requests(chat, spec.output_len[1])
    vocab = model_config(model).vocab_size
    rows = []
    try:
        server = target.probe(where, target_model)
        for rate in rates:
            requests = make_requests(dataclasses.replace(spec, rate=rate), vocab, prompts)
            texts = _prompt_texts(model, requests) if prompt_form == "text" else None
            with _progress(err_console, len(requests), len(rates) > 1) as (on_step, on_done):
                def step(name, done, total, running, waiting, _step=on_step):
                    _step(name, done, total, running, waiting, 0, 0)

                rows.append((target.run(server, requests, spec, rate, timeout, goals, step,
                                        texts), requests))
                on_done(rows[-1][0])
    except ValueError as err:
        fail(str(err))
    except target.TargetError as err:
        fail(str(err), code=1)
    return tuple(rows)


DEFAULT_REQUESTS = {"random": 24, "chat": 16}
DEFAULT_OUTPUT = {"random": "16:128", "chat": "128"}
# What only a random workload reads: refused by name with a chat one, not silently ignored.
RANDOM_ONLY = ("prompt_len", "shared_prefix")


def _chat_workload(ctx, workload, model, requests, output_len, seed, batch):
    """A chat workload's rendered prompts (`serving.chat.ChatRequests`), or None for random
    ids; the template, the tokenizer and a workload file all read before any weights."""
    from kvcache_cli.models import model_config
    from kvcache_cli.serving import chat
    from kvcache_cli.serving import workload as limits

    if batch is not None:
        if workload is not None:
            raise ValueError("--workload serves requests: not with --batch (decode steps only)")
        return None
    kind = (workload or "").strip()
    if not kind:
        has_template = bool(getattr(model_config(model), "chat_template", None))
        kind = "chat" if has_template else "random"
    if kind.lower() == "random":
        return None
    path = None if kind.lower() == "chat" else Path(kind)
    prompts = chat.load_set(path)  # the value the user typed, read before the model is asked
    for name in RANDOM_ONLY:
        if getattr(ctx.get_parameter_source(name), "name", "") == "COMMANDLINE":
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag}: a chat workload's prompts are its template's and its "
                             "prompt set's; expected --workload random with it")
    cap = output_len or DEFAULT_OUTPUT["chat"]
    if not numbers.is_whole(cap.strip()):
        raise ValueError(f"--output-len {cap!r}: a chat reply ends at the end-of-turn token; "
                         "expected the cap on its length, N, e.g. 128")
    n = requests if requests is not None else DEFAULT_REQUESTS["chat"]
    if not 1 <= n <= limits.MAX_REQUESTS:  # before rendering that many
        raise ValueError(f"--requests {n}: expected a whole number "
                         f"{numbers.span(1, limits.MAX_REQUESTS)}")
    config = model_config(model)
    chat.check_template(config, model, "chat" if path is None else kind)
    return chat.build(prompts, config, model, n, seed)


def _check(device, model, requests, prompt_len, output_len, shared_prefix, rate, seed, engines,
           kv_mem, block_size, max_batch, threads, batch, burstiness, max_concurrency, goodput,
           policy, token_budget, layout, chat=None, keep_windows=None):
    """The device, and the batch sizes to sweep or (workload, engine variants, KV bytes,
    rates, goodput targets); raises ValueError for anything a user can get wrong."""
    import torch

    from kvcache_cli import sizing
    from kvcache_cli.measure import resolve_device
    from kvcache_cli.models import model_config
    from kvcache_cli.serving import batching, metrics, model_runner, scheduler, workload
    from kvcache_cli.serving import plan as serving_plan

    dev = str(resolve_device(device))
    config = model_config(model)
    if batch is not None:
        if keep_windows is not None:
            raise ValueError("--keep-windows serves the workload: not with --batch")
        what = batching.parse_sizes(batch)
        batching.check_sweep(config)
    else:
        rates = metrics.parse_rates(rate) if rate is not None else (None,)
        if chat is None:
            spec = workload.WorkloadSpec(
                requests if requests is not None else DEFAULT_REQUESTS["random"],
                workload.parse_range(prompt_len, "--prompt-len"),
                workload.parse_range(output_len or DEFAULT_OUTPUT["random"], "--output-len"),
                shared_prefix, rates[0], seed, burstiness, max_concurrency)
        else:
            spec = _chat_spec(chat, output_len, rates[0], seed, burstiness, max_concurrency)
        workload.check_spec(spec, config.context)
        if not 1 <= block_size <= config.context:  # before the budgets counted in blocks
            raise ValueError(f"--block-size {block_size:,}: expected a whole number from 1 to "
                             f"{config.context:,} (the context window)")
        engine_names = serving_plan.parse_engines(engines)
        serving_plan.check_hf_block_size(engine_names, block_size)
        policies = scheduler.parse_policy(policy)
        budgets = serving_plan.parse_budgets(token_budget, block_size)
        if layout not in model_runner.LAYOUTS:
            raise ValueError(f"--layout {layout!r}: expected one of "
                             f"{', '.join(model_runner.LAYOUTS)}")
        targets = metrics.parse_goodput(goodput) if goodput is not None else None
        memory = sizing.parse_bytes(kv_mem, "--kv-mem")
        held = _device_memory(dev)
        if memory > held:  # refused now, not as an allocator's traceback after the load
            raise ValueError(f"--kv-mem {kv_mem!r} is {sizing.format_bytes(memory)}, more than "
                             f"this {dev.split(':')[0].upper()}'s {sizing.format_bytes(held)} "
                             "of memory: expected at most that")
        serving_plan.plan_memory(config, torch.float32, spec, memory, block_size, max_batch)
        keeps = serving_plan.parse_keeps(keep_windows, block_size, config.cache_shape.hybrid)
        what = (spec, serving_plan.variants(engine_names, policies, budgets, keeps), memory,
                rates, targets)
    return dev, what


def _chat_spec(chat, output_len, rate, seed, burstiness, max_concurrency):
    """The WorkloadSpec that describes a chat workload's rendered prompts."""
    from kvcache_cli.serving import workload

    cap = workload.parse_range(output_len or DEFAULT_OUTPUT["chat"], "--output-len")[1]
    users = [len(p) - chat.shared_prefix for p in chat.prompts]
    return workload.WorkloadSpec(
        len(chat.prompts), (min(users), max(users)), (1, cap), chat.shared_prefix, rate, seed,
        burstiness, max_concurrency, kind="chat", stop_ids=chat.stop_ids, source=chat.source)


def _device_memory(device: str) -> int:
    """Bytes of memory on DEVICE: the host's RAM for cpu, the GPU's for cuda."""
    import os

    import torch

    if device.startswith("cuda"):
        return torch.cuda.mem_get_info()[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _with_kv_dtypes(engines: str, kv_dtype: str | None, batch: str | None) -> str:
    """--engines with a quantised paged engine after the others for each --kv-dtype."""
    if kv_dtype is None:
        return engines
    if batch is not None:
        raise ValueError("--kv-dtype runs the workload's paged engine: not with --batch")
    names = [part.strip().lower() for part in kv_dtype.split(",") if part.strip()]
    bad = [n for n in names if n not in ("int8", "int4", "fp8")]
    if bad or not names:
        raise ValueError(f"--kv-dtype {kv_dtype!r}: expected int8, int4, fp8 or a "
                         "comma-separated list of them")
    return ",".join([engines, *(f"paged-{n}" for n in dict.fromkeys(names))])


def _progress(err_console, total: int, several: bool):
    """On a terminal, the live line on stderr: the engine's requests done, running,
    waiting, KV in use, and the whole run's requests and time left (`output.Eta`); off one,
    the whole run's count and ETA now and then (`output.ProgressLines`). Either way, one
    line per engine (and rate) as it finishes."""
    from rich.progress import BarColumn, MofNCompleteColumn, TimeElapsedColumn

    progress = progress_bar(err_console, "{task.description}", BarColumn(),
                            MofNCompleteColumn(), "requests", TimeElapsedColumn())
    task = progress.add_task("set-up", total=None)
    overall = progress_bar(err_console, "the whole run", BarColumn(), MofNCompleteColumn(),
                           "requests, ETA {task.fields[eta]}")
    whole = overall.add_task("run", total=total, eta="-:--")
    eta, lines = Eta(), ProgressLines("serving", "requests")
    finished = [0]  # requests of the engines (and rates) already done

    def on_step(engine, done, total_, running, waiting, used, reserved) -> None:
        so_far = finished[0] + done
        if not err_console.is_terminal:
            lines(so_far, total, f"serving ({engine} now)")
            return
        kv = f" · KV {used / 2**20:,.0f}/{reserved / 2**20:,.0f} MiB" if reserved else ""
        progress.update(task, completed=done, total=total_,
                        description=f"{engine}: {running} running · {waiting} waiting{kv}")
        left = eta(so_far, total)
        overall.update(whole, completed=so_far, eta="-:--" if left is None else clock(left))

    def on_done(e) -> None:
        finished[0] += e.latency.requests
        rate = "" if not several else (
            ", all at once" if e.rate is None else f" at {e.rate:g} req/s")
        err_console.print(f"{e.engine}{rate}: {e.tokens_per_s:,.1f} tok/s, {e.total_s:,.1f} s, "
                          f"p99 TTFT {e.latency.ttft.p99:,.0f} ms, p99 ITL "
                          f"{e.latency.itl.p99:,.0f} ms", highlight=False)

    @contextlib.contextmanager
    def live():
        if not err_console.is_terminal:
            yield on_step, on_done
            return
        from rich.console import Group
        from rich.live import Live

        with Live(Group(progress, overall), console=err_console, transient=True,
                  refresh_per_second=2):
            yield on_step, on_done

    return live()
