"""`kvcache break`: break the cache on purpose, on the NumPy toy and on GPT-2 in PyTorch."""

from __future__ import annotations

import contextlib
import time
from typing import Annotated

import typer

from kvcache_cli.cli.common import (
    GPT2_MODULES,
    fail,
    load_model,
    print_view,
    torch_device,
    torch_extra_missing,
)
from kvcache_cli.cli.demo import pick, show, show_list

# The GPT-2 breaks run on the PyTorch model; their names live here so that
# `kvcache break --list` needs no torch.
GPT2_BREAKS = {
    "position-offset": "GPT-2: every decode token gets position 0",
    "causal-decode": "GPT-2: is_causal=True for a one-row query against the cache",
    "stale-cache": "GPT-2: a cache reused across requests without a reset",
    "no-rollback": "GPT-2: speculative decoding keeps the rejected keys and values",
    "rollback-shared": "GPT-2: a paged rollback frees a block another sequence still reads",
    # The quantised caches' known failures, each beside its fix (kvcache_cli.quant_breaks).
    "kv-outlier-keys": "GPT-2, int4 cache: outlier key channels under one scale per key "
                       "vector, against per-channel scales",
    "kv-sink-token": "GPT-2, int2 cache: the attention-sink token quantised, against kept",
    "fp8-range": "GPT-2, fp8 cache: scale 1.0 on values beyond the range, against calibrated",
    "evict-sink": "GPT-2: a window that evicts the first tokens, against sinks + window",
    "ring-mask": "GPT-2: a ring buffer masked by slot index instead of position",
    "ring-off-by-one": "GPT-2: the newest token written one slot late, over a live key",
}
QUANT_BREAKS = ("kv-outlier-keys", "kv-sink-token", "fp8-range")
# Positions a quantised-cache break scores at least: a prompt's continuation.
QUANT_BREAK_TOKENS = 128


# Shell completion of names: runs only when the shell asks, never at start-up.
def _complete_break(incomplete: str) -> list[str]:
    import kv_cache_from_scratch as ref

    return [n for n in ["all", *ref.BREAKS, *GPT2_BREAKS] if n.startswith(incomplete)]


def break_(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(
        help="A break name, or 'all'.", autocompletion=_complete_break)] = "all",
    list_: Annotated[bool, typer.Option("--list", help="List the breaks and exit.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw result as JSON.")] = False,
    model: Annotated[str, typer.Option(
        "--model", "-m",
        help="GPT-2 breaks: gpt2, gpt2-medium, gpt2-large, gpt2-xl or a checkpoint dir.")
    ] = "gpt2",
    weights: Annotated[str, typer.Option(
        help="GPT-2 breaks: auto (real if available, else random), pretrained, random.")
    ] = "auto",
    device: Annotated[str, typer.Option(help="GPT-2 breaks: cpu or cuda.")] = "cpu",
    max_new_tokens: Annotated[int, typer.Option(
        help="GPT-2 breaks: tokens to generate per loop (the quantised-cache breaks score "
        f"at least {QUANT_BREAK_TOKENS}).")] = 16,
) -> None:
    """Break the cache on purpose and watch the symptom.

    Five on the NumPy toy (no-mask, no-append, cache-q, overflow, wrong-cache), and on
    GPT-2 in PyTorch: the article's three (position-offset, causal-decode, stale-cache),
    speculative decoding's no-rollback and rollback-shared, three quantised caches beside
    their fixes (kv-outlier-keys, kv-sink-token, fp8-range), and three bounded caches
    (evict-sink, ring-mask, ring-off-by-one), whose budget is half the positions the run
    writes, so the window wraps halfway.
    """
    import kv_cache_from_scratch as ref

    if list_:
        if name != "all":
            fail(f"--list lists every break: expected no NAME with it, got {name!r}")
        show_list({**{n: s.title for n, s in ref.BREAKS.items()}, **GPT2_BREAKS}, "breaks",
                  as_json)
        return
    names = pick(name, ref.BREAKS, "break", GPT2_BREAKS)
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
        show(results, as_json=False)
        results = {}
    if skipped:  # `all` without torch: the NumPy breaks ran; say what was left out and why
        typer.echo(f"note: {skipped}", err=True)
    elif gpt2_names:
        loaded, gpt2_results = _gpt2_breaks(gpt2_names, model, weights, device, max_new_tokens)
        if not as_json:
            _show_gpt2_breaks(loaded, device, gpt2_results)
        results |= {n: (GPT2_BREAKS[n], r) for n, r in gpt2_results.items()}
    if as_json:
        show(results, as_json=True)


def _refuse_given(ctx: typer.Context, params: tuple[str, ...], why: str) -> None:
    """Options typed on the command line that the command would ignore are bad input."""
    given = [f"--{p.replace('_', '-')}" for p in params
             if getattr(ctx.get_parameter_source(p), "name", "") == "COMMANDLINE"]
    if given:
        verb = "applies" if len(given) == 1 else "apply"
        fail(f"{', '.join(given)} {verb} {why}: expected a GPT-2 break with them, or none")


def _gpt2_breaks(names: list[str], model: str, weights: str, device: str,
                 max_new_tokens: int):
    """Load the model once and run each named GPT-2 break (correct and broken loop)."""
    torch_device(device)
    loaded = load_model(model, weights, device)
    results = {}
    try:
        for n in names:
            with _progress(n) as progress:
                results[n] = _run_gpt2_break(n, loaded.model, max_new_tokens, progress)
    except (ValueError, IndexError) as err:
        fail(str(err))
    return loaded, results


# Tokens a break makes, all its runs together, from which it logs progress off a terminal.
LOG_TOKENS = 120


@contextlib.contextmanager
def _progress(name: str):
    """A bar on stderr while a break runs; off a terminal, for a long break (LOG_TOKENS
    tokens or more: --max-new-tokens 40 and up), a line every tenth of the tokens and as
    each of its runs ends, so it shows it is alive in a log too. A short one stays quiet."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    console = Console(stderr=True)
    # The bar on a terminal only: off one, rich would still end it with a blank line.
    bar = task = None
    if console.is_terminal:
        bar = Progress(f"{name}: {{task.description}}", BarColumn(), MofNCompleteColumn(),
                       "tokens", TimeElapsedColumn(), console=console, transient=True,
                       refresh_per_second=2)
        task = bar.add_task("", total=None)
    state = {"label": None, "start": time.perf_counter(), "tokens": 0, "log": False}

    def ended() -> None:
        if state["label"] is not None and state["log"]:
            typer.echo(f"{name}: {state['label']}, {state['tokens']:,} tokens in "
                       f"{time.perf_counter() - state['start']:.1f} s", err=True)

    def on_token(label: str, done: int, total: int) -> None:
        if label != state["label"]:
            ended()
            state.update(label=label, start=time.perf_counter(), tokens=0)
        state["tokens"] += 1
        state["log"] = not console.is_terminal and total >= LOG_TOKENS
        if bar is not None:
            bar.update(task, description=label, completed=done, total=total)
        if state["log"] and done * 10 // total > (done - 1) * 10 // total:
            typer.echo(f"{name}: {done:,}/{total:,} tokens", err=True)  # every tenth

    with bar if bar is not None else contextlib.nullcontext():
        yield on_token
    ended()


def _run_gpt2_break(name: str, gpt, max_new_tokens: int, progress):
    from kvcache_cli import speculative as sp
    from kvcache_cli.generate import DEFAULT_PROMPT_IDS, run_break

    if name in QUANT_BREAKS:
        return _quant_break(name, gpt, max_new_tokens)
    if name == "no-rollback":
        # The target's first half drafts for it: every step proposes K tokens, and the
        # rejected ones are what the broken loop keeps.
        half = gpt.config.n_layer // 2
        prompt = [t % gpt.config.vocab_size for t in DEFAULT_PROMPT_IDS]
        draft = (sp.make_draft(sp.parse_draft(f"layers:{half}"), gpt,
                               len(prompt) + max_new_tokens) if half else sp.LookupDraft())
        return sp.run_no_rollback(gpt, prompt, max_new_tokens, draft)
    if name == "rollback-shared":
        return sp.run_rollback_shared(gpt, max_new_tokens)
    return run_break(name, gpt, max_new_tokens=max_new_tokens, progress=progress)


def _quant_break(name: str, model, max_new_tokens: int):
    """A quantised-cache break, scored on the default prompt and the exact cache's greedy
    continuation of it (a text every model has, offline)."""
    from kvcache_cli.generate import DEFAULT_PROMPT_IDS, stream_tokens
    from kvcache_cli.quant_breaks import run_quant_break

    V = model.config.vocab_size
    prompt = [t % V for t in DEFAULT_PROMPT_IDS]
    n = min(max(max_new_tokens, QUANT_BREAK_TOKENS), model.config.context - len(prompt))
    text = prompt + list(stream_tokens(model, prompt, n, "static"))
    return run_quant_break(name, model, text, len(prompt))


def _show_gpt2_breaks(loaded, device: str, results: dict) -> None:
    from kvcache_cli.generate import encoding_for
    from kvcache_cli.gpt2 import GPT2_VOCAB_SIZE
    from kvcache_cli.views.generate import break_view, header

    piece = None
    config = loaded.model.config
    if config.tokenizer == "bytes" or config.vocab_size == GPT2_VOCAB_SIZE:
        encoding, _ = encoding_for(config.tokenizer)
        if encoding is not None:
            piece = lambda t: encoding.decode([t])  # noqa: E731
    from kvcache_cli.speculative import NoRollbackResult, SharedRollbackResult
    from kvcache_cli.views.quant import quant_break_view
    from kvcache_cli.views.speculative import no_rollback_view, rollback_shared_view

    first = next(iter(results.values()))
    mode = getattr(first, "mode", None) or getattr(first, "cache", "static")
    print_view(header(loaded.source, loaded.model.num_params(), device, "float32", mode))
    for name, result in results.items():
        if name in QUANT_BREAKS:
            print_view(quant_break_view(result))
        elif isinstance(result, NoRollbackResult):
            print_view(no_rollback_view(result, piece))
        elif isinstance(result, SharedRollbackResult):
            print_view(rollback_shared_view(result, piece))
        else:
            print_view(break_view(result, piece))
