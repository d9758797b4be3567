"""`kvcache break`: break the cache on purpose, on the NumPy toy and on GPT-2 in PyTorch."""

from __future__ import annotations

from typing import Annotated

import typer

from kvcache_cli.cli.common import GPT2_MODULES, fail, load_gpt2, torch_device, torch_extra_missing
from kvcache_cli.cli.demo import pick, show, show_list

# The GPT-2 breaks run on the PyTorch model; their names live here so that
# `kvcache break --list` needs no torch.
GPT2_BREAKS = {
    "position-offset": "GPT-2: every decode token gets position 0",
    "causal-decode": "GPT-2: is_causal=True for a one-row query against the cache",
    "stale-cache": "GPT-2: a cache reused across requests without a reset",
}


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
    from kvcache_cli.generate import run_break

    loaded = load_gpt2(model, weights, device)
    try:
        return loaded, {n: run_break(n, loaded.model, max_new_tokens=max_new_tokens)
                        for n in names}
    except (ValueError, IndexError) as err:
        fail(str(err))


def _show_gpt2_breaks(loaded, device: str, results: dict) -> None:
    from rich.console import Console

    from kvcache_cli.generate import encoding_for
    from kvcache_cli.gpt2 import GPT2_VOCAB_SIZE
    from kvcache_cli.views.generate import break_view, header

    piece = None
    config = loaded.model.config
    if config.tokenizer == "bytes" or config.vocab_size == GPT2_VOCAB_SIZE:
        encoding, _ = encoding_for(config.tokenizer)
        if encoding is not None:
            piece = lambda t: encoding.decode([t])  # noqa: E731
    console = Console()
    first = next(iter(results.values()))
    console.print(header(loaded.source, loaded.model.num_params(), device, "float32", first.mode))
    for result in results.values():
        console.print(break_view(result, piece))
