"""`kvcache compress`: what compressing one prompt's cache at prefill keeps, and what it
costs against the exact cache (`eval/compress.py` computes, `views/compress.py` prints)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from kvcache_cli.cli.engine import Engine, EngineOption, pick_engine
from kvcache_cli.cli.loading import (
    GPT2_MODULES,
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
    Weights,
    complete_cache_list,
    parse_cache_list_option,
    threads_error,
)
from kvcache_cli.cli.output import columns, console, print_view, progress
from kvcache_cli.cli.refusals import fail


def compress(
    ctx: typer.Context,
    prompt: Annotated[str | None, typer.Argument(
        help="The text to prefill and compress, quoted (or --text FILE).")] = None,
    text: Annotated[Path | None, typer.Option(
        help="A UTF-8 text file to prefill and compress, instead of PROMPT.")] = None,
    question: Annotated[str | None, typer.Option(
        help="A question asked after the text, inside the prompt that is compressed (its "
        "last tokens, where SnapKV's window looks), through the model's chat template when "
        "it has one, as eval --task retrieval asks; the continuation is the reply.")] = None,
    cache: Annotated[Any, typer.Option(
        "--cache", parser=parse_cache_list_option, metavar="SPECS",
        autocompletion=complete_cache_list,
        help="Comma-separated compressing kinds, each against the exact cache, e.g. "
        "snapkv:0.25,knorm:64,recent:0.25:s4 (docs/compression.md). Default: "
        "snapkv:0.25,knorm:0.25,recent:0.25. SnapKV's window, untyped (:wN), is cut to the "
        "keys the prompt keeps.")] = None,
    model: ModelOption = None,
    new_tokens: Annotated[int, typer.Option(
        "--max-new-tokens", "-n", min=2, help="Greedy tokens to continue with in each "
        "cache (never stopped at an end token).")] = 32,
    show_kept: Annotated[bool, typer.Option(
        "--show-kept", help="Print the prompt once per cache, each token marked by the "
        "share of layers and KV heads that kept it.")] = False,
    layer: Annotated[int | None, typer.Option(
        min=0, help="With --show-kept: one layer's choice (its KV heads averaged) instead "
        "of every compressed layer's.")] = None,
    weights: Annotated[Weights, typer.Option(
        help="auto: pretrained when available, else random (one note).")] = Weights.auto,
    device: DeviceOption = "auto",
    threads: Annotated[int | None, typer.Option(
        help="torch intra-op threads (default: one per core other processes leave free, "
        "with a note when that is fewer than all).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    engine: EngineOption = Engine.auto,
) -> None:
    """What compressing a prompt's cache at prefill keeps, and what it costs.

    The prompt is prefilled through the exact cache and through each compressing kind,
    which compresses it once at the end of that forward. Per kind: the prompt's keys kept,
    the bytes the prompt holds before and after, the compression's time, the greedy
    continuation against the exact cache's, and the next-token KL on the exact one.

    Examples:

    \b
      kvcache compress "The capital of France is Paris. The capital of Spain is"
      kvcache compress --text notes.txt --question "Who won?" --show-kept
    """
    model = model if model is not None else default_model()
    need_torch_extra("kvcache compress needs", *GPT2_MODULES)
    if threads_error(threads):
        fail(threads_error(threads))
    if layer is not None and not show_kept:
        fail(f"--layer {layer} chooses the layer --show-kept shows: expected --show-kept too")
    refuse_missing_model(model)
    refuse_unbuilt_cuda(device)
    from kvcache_cli.eval import compress as run
    from kvcache_cli.measure import resolve_device

    specs = cache if cache is not None else parse_cache_list_option(run.DEFAULT_CACHES)
    hf = _load_engine(ctx, model, device, specs) if pick_engine(model, engine) == \
        "transformers" else None
    try:
        config, ids, encoding, layout = _prompt_ids(
            model, prompt, text, question, hf.model.config if hf is not None else None)
        specs = run.fit_windows(specs, len(ids))  # a window nobody typed, to the prompt
        run.check_compress(specs, len(ids), new_tokens, config.cache_shape, config.context,
                           layer)
        dev = resolve_device(device)
    except ValueError as err:  # CacheSpecError included
        fail(str(err))
    except RuntimeError as err:  # a tokenizer that cannot be had offline
        fail(str(err))
    loaded = hf if hf is not None else load_model(model, weights.value, str(dev), config=config)
    pick_threads(threads, dev)
    try:
        with progress("compressing", "caches") as on_progress:
            result = run.compress_prompt(
                loaded.model, ids, specs, new_tokens=new_tokens, decode=encoding.decode,
                layer=layer, prompt=layout, model_name=loaded.source, progress=on_progress)
    except (ValueError, IndexError) as err:
        fail(str(err))
    except RuntimeError as err:
        fail(str(err), code=1)
    _show(result, as_json, show_kept)


def _load_engine(ctx: typer.Context, model: str, device: str, specs):
    """The transformers engine's model (`LoadedModel`), loaded before the prompt is
    checked against its config; what it does not run, refused in one line."""
    from kvcache_cli.cli.engine import load_engine, refuse_kinds, refuse_options
    from kvcache_cli.measure import resolve_device

    refuse_options(ctx, ("weights",), "the model runs as transformers loads it")
    need_torch_extra("kvcache compress needs", *GPT2_MODULES, "transformers")
    refuse_kinds(specs)
    try:
        return load_engine(model, str(resolve_device(device)))
    except ValueError as err:
        fail(str(err))


def _prompt_ids(model: str, prompt: str | None, text: Path | None, question: str | None,
                config=None):
    """(the model's config, the prompt's ids, its encoding, how it was laid out), before
    any weights load (`config`: the transformers engine's, read from its model); a
    ValueError names what is wrong."""
    from kvcache_cli.eval.text import TokenizerUnavailable, read_text, tokenizer_for
    from kvcache_cli.models import model_config
    from kvcache_cli.models.tokenizer import encoding_for

    if prompt is not None and text is not None:
        raise ValueError("a PROMPT and --text: expected one of the two")
    if prompt is None and text is None:
        raise ValueError('no prompt: expected one, e.g. kvcache compress "The KV cache '
                         'holds..." (or --text FILE)')
    body = read_text(text) if text is not None else prompt
    if not body.strip():
        raise ValueError("the prompt is empty: expected some text (or --text FILE)")
    if question is not None and not question.strip():
        raise ValueError("--question is empty: expected a question, or no --question")
    config = config if config is not None else model_config(model)
    encoding, why = encoding_for(tokenizer_for(config))
    if encoding is None:
        raise TokenizerUnavailable(why)
    layout = "the text as written"
    if question is not None:
        template = getattr(config, "chat_template", None)
        if template:
            from kvcache_cli.models.chat_template import render_chat

            body = render_chat(template, [{"role": "user", "content": f"{body}\n\n{question}"}])
            layout = "the text and the question, one user turn of the model's chat template"
        else:
            body = f"{body}\n\n{question}\n"
            layout = "the text, then the question (the model has no chat template)"
    ids = encoding.encode(body, disallowed_special=())
    return config, ids, encoding, layout


def _show(result, as_json: bool, show_kept: bool) -> None:
    """JSON; else the rich view on a terminal, plain text at `columns()` off one."""
    if as_json:
        from kvcache_cli.views import to_json

        typer.echo(to_json(result))
        return
    from kvcache_cli.views.compress import plain, render

    if console().is_terminal:
        print_view(render(result, show_kept))
    else:
        typer.echo(plain(result, columns(), show_kept))
