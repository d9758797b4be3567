"""`kvcache eval`: what a cache costs in quality, each cache fed a text as generation feeds
it and scored against the exact cache on the same tokens."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from kvcache_cli.checkpoints import TRAINED
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
    threads_error,
)
from kvcache_cli.cli.output import (
    check_plot,
    columns,
    console,
    progress,
    show_then_plot,
)
from kvcache_cli.cli.refusals import fail

# The trained byte-level checkpoint: a model whose predictions mean something offline,
# with its held-out text beside it.
HELDOUT = "heldout.txt"  # the text a checkpoint was not trained on, in its directory


def parse_eval_caches(value):
    """--cache as eval reads it: kvcache's specs (`caches.spec`), llama.cpp's cache types
    (`llama.cpp:q4_0`, `llama_quality`) and transformers' own model with its quantised
    cache (`transformers:quanto-int4`, `hf_quality`) and kvpress's presses
    (`kvpress:snapkv:0.25`, `peer_kvpress`) in one comma list, each once."""
    from kvcache_cli.caches.grammar import CacheSpecError
    from kvcache_cli.caches.spec import parse_cache_list
    from kvcache_cli.cli.options import cache_items
    from kvcache_cli.eval.peer_hf import is_transformers, parse_transformers
    from kvcache_cli.eval.peer_kvpress import is_kvpress, parse_kvpress
    from kvcache_cli.eval.peer_llama_cpp import is_llama_cpp, parse_llama_cpp

    if isinstance(value, list):
        return value
    parts = cache_items(value)  # an empty item refused, not dropped

    def peer(part: str):
        if is_kvpress(part):
            return parse_kvpress(part)
        return parse_llama_cpp(part) if is_llama_cpp(part) else parse_transformers(part)

    try:
        is_peer = [is_llama_cpp(part) or is_transformers(part) or is_kvpress(part)
                   for part in parts]
        ours = [part for part, p in zip(parts, is_peer) if not p]
        peers = [peer(part) for part, p in zip(parts, is_peer) if p]
        specs = parse_cache_list(",".join(ours) if peers else value) if ours or not peers \
            else []
    except (CacheSpecError, ValueError) as err:
        raise typer.BadParameter(str(err)) from None
    names = [str(s) for s in peers]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice:
        raise typer.BadParameter(f"cache {twice!r} is listed twice in {value!r}")
    return specs + peers


class Task(str, Enum):
    text = "text"
    retrieval = "retrieval"


def eval_(
    ctx: typer.Context,
    cache: Annotated[Any, typer.Option(
        "--cache", parser=parse_eval_caches, metavar="SPECS",
        autocompletion=complete_cache_list,
        help="Comma-separated cache specs, e.g. int8,int4:rot or full,window:256,"
        "sink:4+252, h2o:128+128,snapkv:0.25 (every kind: 'kvcache caches'); the exact "
        "'static' (alias full) is always run as the reference. Default: "
        "static,fp16,int8,int4,int2,fp8-e4m3, each format at its default layout. "
        "llama.cpp's own cache types run the model's GGUF in llama.cpp on the same ids: "
        "llama.cpp:q4_0, llama.cpp:kq8_0:vq4_0, ...:norot (LLAMA_ATTN_ROT_DISABLE=1), "
        "scored against llama.cpp's f32 cache. transformers:quanto-int4[:gN][:rN] (or "
        "quanto-int2, hqq-int4, hqq-int2) runs transformers' own LlamaForCausalLM with its "
        "QuantizedCache, scored against its DynamicCache. kvpress:snapkv:0.25 (or knorm, "
        "recent[:sN], expected) runs NVIDIA kvpress's press in its own venv "
        "(scripts/kvpress_venv.sh), scored against its DynamicCache.")] = None,
    model: ModelOption = None,
    weights: Annotated[Weights, typer.Option(
        help="auto: pretrained when available, else random (one note); quality on random "
        "weights means little.")] = Weights.auto,
    text: Annotated[Path | None, typer.Option(
        help=f"A UTF-8 text file (default: {HELDOUT} in the checkpoint's directory, the "
        "text it was not trained on).")] = None,
    tokens: Annotated[int | None, typer.Option(
        help="Tokens of the text to read (default: the text's, up to the context window "
        "and 2,000).")] = None,
    prompt_len: Annotated[int, typer.Option(
        help="Tokens prefilled in one forward before decoding starts; the rest are "
        "scored. Compressing kinds (snapkv, knorm, recent) compress this prompt once.")] = 64,
    chunk: Annotated[int, typer.Option(
        help="Tokens fed per decode step (1: one at a time, as generation does).")] = 1,
    sliding: Annotated[str, typer.Option(
        help="A model with sliding-window layers (-m gemma3): model puts each --cache on "
        "the global layers, the sliding ones in exact rings of their window; full puts it "
        "on every layer, the sliding ones holding every position under their band (rows "
        "named '<spec> all layers'); model,full gives both rows.")] = "model",
    device: DeviceOption = "auto",
    threads: Annotated[int | None, typer.Option(
        help="torch intra-op threads (default: one per core other processes leave free, "
        "with a note when that is fewer than all).")] = None,
    plot: Annotated[Path | None, typer.Option(
        help="Write the frontier (perplexity against bytes per token) and the loss by "
        "position to this PNG (needs matplotlib).")] = None,
    task: Annotated[Task, typer.Option(
        help="text: score a text token by token against the exact cache; retrieval: the "
        "built-in pass-key set (a key at a known depth of a filler, asked after it), "
        "answered greedily through the model's chat template, exact match (default "
        "caches snapkv:0.25,knorm:0.25,recent:0.25; -m smollm2).")] = Task.text,
    lengths: Annotated[str, typer.Option(
        help="--task retrieval: the filler's lengths in tokens, comma-separated.")] = "512",
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw result as JSON.")] = False,
    replot: Annotated[Path | None, typer.Option(
        metavar="FILE.json", help="Redraw --plot from a saved --json of a text run, without "
        "running the caches again (runs on SmolLM2 cost minutes a cache).")] = None,
    engine: EngineOption = Engine.auto,
) -> None:
    """What a cache costs in quality: each cache fed a text as generation feeds it,
    against the exact cache on the same tokens.

    Per cache: perplexity, KL divergence from the exact next-token distribution, top-1
    agreement, bytes held per token and decode time; per layer, the first token's share
    of attention.
    """
    model = model if model is not None else default_model()
    need_torch_extra("kvcache eval needs", *GPT2_MODULES)
    if replot is not None:
        _refuse_with_replot(ctx)
        _replot(replot, plot)
        return
    refuse_missing_model(model)
    refuse_unbuilt_cuda(device)
    hf = _load_engine(ctx, model, device, task) if pick_engine(model, engine) == \
        "transformers" else None
    if task is Task.retrieval:
        if sliding != "model":
            fail(f"--sliding {sliding}: applies to --task text only (retrieval runs each "
                 "cache on the global layers)")
        _retrieval(cache, model, weights, lengths, device, threads, plot, as_json)
        return
    from kvcache_cli.eval import quality
    from kvcache_cli.eval.text import TokenizerUnavailable

    # Everything a user can get wrong is refused before a model loads (but the
    # transformers engine's, whose config is its model's).
    try:
        specs, peers, path, ids, n, dev = _check_options(cache, model, text, tokens,
                                                         prompt_len, chunk, device, threads,
                                                         sliding, hf)
    except ValueError as err:
        fail(str(err))
    except TokenizerUnavailable as err:
        fail(f"{err}: --model {TRAINED} evaluates the trained byte-level checkpoint, "
             "which needs no download")
    check_plot(plot)
    loaded = hf if hf is not None else load_model(model, weights.value, str(dev))
    threads = pick_threads(threads, dev)
    try:
        # Every cache is scored on each step in turn: the bar names them all.
        scoring = f"scoring {', '.join(map(str, specs))}"
        with progress(scoring, "tokens") as on_progress:
            result = quality.evaluate(
                loaded.model, ids.ids[:n], specs, prompt_len=prompt_len, chunk=chunk,
                threads=threads, model_name=loaded.source, weights_note=loaded.note,
                text_name=f"{path.name} ({_tokenizer_label(ids.tokenizer)})",
                progress=on_progress)
            if peers:
                result = _with_peers(result, loaded.model, ids.ids[:n], peers, prompt_len,
                                     on_progress)
    except (ValueError, IndexError) as err:
        fail(str(err))
    except RuntimeError as err:
        fail(str(err), code=1)
    from kvcache_cli.views.eval_plot import save_plot
    from kvcache_cli.views.quality import plain, render

    _show(result, render, plain, save_plot, as_json, plot)


def _refuse_with_replot(ctx: typer.Context) -> None:
    """Options typed beside --replot, which draws the saved run as it was: each would be
    ignored, so each is refused, as other commands refuse what does not apply."""
    given = [next(o for o in p.opts if o.startswith("--")) for p in ctx.command.params
             if p.name not in ("replot", "plot")
             and getattr(ctx.get_parameter_source(p.name), "name", "") == "COMMANDLINE"]
    if given:
        verb = "applies" if len(given) == 1 else "apply"
        fail(f"{', '.join(given)} {verb} to a run, not to --replot, which redraws the saved "
             "one as it was: expected --replot FILE.json --plot OUT.png alone")


def _replot(saved: Path, plot: Path | None) -> None:
    """`eval --replot`: the plot of a saved --json, drawn as the run would have drawn it;
    the file checked whole before the plot is drawn (`result_from_json`)."""
    import json

    from kvcache_cli.eval.quality import result_from_json
    from kvcache_cli.views.eval_plot import save_plot

    name = repr(str(saved))
    if plot is None:
        fail(f"--replot {name}: expected --plot OUT.png, where to draw it")
    try:
        data = json.loads(saved.read_text(encoding="utf-8"))
    except FileNotFoundError:
        fail(f"--replot {name}: no such file; expected a saved kvcache eval --json")
    # A directory, bytes that are not UTF-8 or not JSON, JSON nested past Python's stack.
    except (OSError, ValueError, RecursionError) as err:
        fail(f"--replot {name}: not a JSON file ({err}); expected a saved kvcache eval --json")
    try:
        result = result_from_json(data)
    except ValueError as err:
        fail(f"--replot {name}: {err}")
    check_plot(plot)
    try:
        save_plot(result, plot)
    except (OSError, ValueError) as err:  # the file checked whole: the disk's fault
        fail(f"--plot: the plot could not be written to {str(plot)!r} ({err})", code=1)
    typer.echo(f"plot written to {plot} (redrawn from {saved})")


def _show(result, render, plain, save_plot, as_json: bool, plot) -> None:
    """The rich view on a terminal; plain text in a pipe or a file (no boxes to parse), at
    the width every view is laid out at; then the plot, if asked for."""
    view = render if console().is_terminal else (lambda r: plain(r, columns()))
    show_then_plot(result, view, as_json, save_plot, plot, "plot")


def _load_engine(ctx: typer.Context, model: str, device: str, task: Task):
    """The transformers engine's model (`LoadedModel`), loaded before the options are
    checked against its config; what it does not run, refused in one line."""
    from kvcache_cli.cli.engine import load_engine, refuse_options
    from kvcache_cli.measure import resolve_device

    refuse_options(ctx, ("weights", "replot"), "the model runs as transformers loads it")
    if task is Task.retrieval:
        fail("--task retrieval with --engine transformers: the pass-key set runs on "
             "kvcache's own families (--engine kvcache)")
    need_torch_extra("kvcache eval needs", *GPT2_MODULES, "transformers")
    try:
        return load_engine(model, str(resolve_device(device)))
    except ValueError as err:
        fail(str(err))


def _check_options(cache, model, text, tokens, prompt_len, chunk, device, threads, sliding,
                   hf=None):
    """(kvcache's specs, each once per --sliding choice; the peers', text path, its ids,
    tokens to read, device), or a ValueError naming the value, or TokenizerUnavailable.
    `hf`: the transformers engine's model, whose config the options are checked against and
    whose bridge holds the caches (the default list cut to the kinds it holds)."""
    from kvcache_cli.caches.spec import fitted
    from kvcache_cli.eval import peer_hf as hf_quality
    from kvcache_cli.eval import peer_kvpress, quality
    from kvcache_cli.eval.peer_hf import HFCacheSpec
    from kvcache_cli.eval.peer_llama_cpp import LlamaCppSpec, check_installed
    from kvcache_cli.eval.text import read_tokens
    from kvcache_cli.measure import resolve_device
    from kvcache_cli.models import model_config

    problem = threads_error(threads)
    if problem is not None:
        raise ValueError(problem)
    config = hf.model.config if hf is not None else model_config(model)
    # The defaults laid out for this model's heads: a refusal names only what was typed.
    given = ([fitted(s, config.head_size) for s in _default_caches(hf)] if cache is None
             else cache)
    peer_types = LlamaCppSpec | HFCacheSpec | peer_kvpress.KvpressSpec
    specs = [s for s in given if not isinstance(s, peer_types)]
    peers = [s for s in given if isinstance(s, peer_types)]
    if hf is not None:
        _check_engine_caches(specs, peers)
    llama_cpp = [s for s in peers if isinstance(s, LlamaCppSpec)]
    # --tokens, when given, against the context window; the text's length comes next.
    quality.check_eval(config.context, tokens, prompt_len, chunk)
    path = text if text is not None else _heldout(model, hf is not None)
    # As many tokens as the run can score: the file beyond them is never read.
    wanted = tokens if tokens is not None else min(config.context, quality.DEFAULT_TOKENS)
    ids = read_tokens(path, config, wanted)
    n = quality.tokens_to_read(len(ids.ids), config.context, tokens, prompt_len,
                               f"--text {str(path)!r}")
    quality.check_caches(specs, config, n - 1, model, prompt_len)
    specs = quality.with_sliding(specs, _sliding_choices(sliding, config, model))
    check_installed(llama_cpp, getattr(config, "gguf", None), model)
    hf_quality.check_installed([s for s in peers if isinstance(s, HFCacheSpec)], config, model)
    peer_kvpress.check_installed([s for s in peers if isinstance(s, peer_kvpress.KvpressSpec)],
                                 config, model)
    dev = resolve_device(device)
    if llama_cpp and dev.type != "cpu":
        raise ValueError(f"cache {str(llama_cpp[0])!r} runs llama.cpp on the CPU, where the "
                         f"extra builds it; got device {dev.type}: use --device cpu")
    return specs, peers, path, ids, n, dev


def _sliding_choices(value: str, config, model: str) -> list[str]:
    """--sliding's comma list (model, full), or a ValueError naming the value: an unknown
    choice, one given twice, or full on a model without sliding layers."""
    from kvcache_cli.caches import SLIDING_CHOICES

    choices = [c.strip() for c in value.split(",")]
    bad = next((c for c in choices if c not in SLIDING_CHOICES), None)
    if bad is not None or len(set(choices)) < len(choices):
        raise ValueError(f"--sliding {value!r}: expected model, full or model,full")
    if "full" in choices and not config.cache_shape.hybrid:
        raise ValueError(f"--sliding {value}: --model {model} has no sliding-window layers "
                         "(every layer attends in full); expected a model with them, e.g. "
                         "-m gemma3")
    return choices


def _default_caches(hf) -> list:
    """eval's default caches: on the transformers engine, those its bridge holds."""
    from kvcache_cli.eval import quality

    if hf is None:
        return quality.default_caches()
    from kvcache_cli.hf import BRIDGE_KINDS

    return [s for s in quality.default_caches() if s.kind in BRIDGE_KINDS]


def _check_engine_caches(specs, peers) -> None:
    """The transformers engine's caches: kinds its bridge holds, and no peer (a peer runs
    beside kvcache's own model); a ValueError (one line)."""
    from kvcache_cli.hf.engine import check_kinds

    if peers:
        raise ValueError(f"cache {str(peers[0])!r} with --engine transformers: a peer's "
                         "cache runs beside kvcache's own model (--engine kvcache)")
    check_kinds(specs)


def _with_peers(result, model, ids, peers, prompt_len, on_progress):
    """`result` with the peers' rows after kvcache's, the same ids through each: llama.cpp's
    caches on the GGUF the model was read from, transformers' in its own LlamaForCausalLM,
    kvpress's in its venv (with the presses it refused for this model, one line each)."""
    import dataclasses

    from kvcache_cli.eval import peer_hf as hf_quality
    from kvcache_cli.eval import peer_kvpress
    from kvcache_cli.eval import peer_llama_cpp as llama_quality
    from kvcache_cli.eval.peer_hf import HFCacheSpec
    from kvcache_cli.eval.peer_llama_cpp import LlamaCppSpec

    rows, refused = (), ()
    llama_cpp = [s for s in peers if isinstance(s, LlamaCppSpec)]
    if llama_cpp:
        names = f"scoring {', '.join(map(str, llama_cpp))}"
        rows += llama_quality.evaluate(model.config.gguf, ids, llama_cpp, model.config,
                                       prompt_len=prompt_len, threads=result.threads,
                                       progress=lambda d, t: on_progress(d, t, names))
    transformers = [s for s in peers if isinstance(s, HFCacheSpec)]
    if transformers:
        names = f"scoring {', '.join(map(str, transformers))}"
        rows += hf_quality.evaluate(model, ids, transformers, prompt_len=prompt_len,
                                    progress=lambda d, t: on_progress(d, t, names))
        refused = hf_quality.refusals(model, transformers)
    presses = [s for s in peers if isinstance(s, peer_kvpress.KvpressSpec)]
    if presses:
        names = f"scoring {', '.join(map(str, presses))} in kvpress's venv"
        more, declined = peer_kvpress.evaluate(model, ids, presses, prompt_len=prompt_len,
                                               threads=result.threads,
                                               progress=lambda d, t: on_progress(d, t, names))
        rows += more
        refused += declined
    return dataclasses.replace(result, caches=result.caches + rows,
                               refused=result.refused + refused)


def _tokenizer_label(tokenizer: str) -> str:
    """'bytes', 'gpt2', or the name of a model's own tokenizer file (its folder says which
    model: a converted GGUF's is named after the GGUF)."""
    if not tokenizer.startswith("file:"):
        return tokenizer
    path = Path(tokenizer.removeprefix("file:"))
    return f"{path.parent.name}/{path.name}"


def _retrieval(cache, model, weights, lengths, device, threads, plot, as_json) -> None:
    """`--task retrieval`: the pass-key set through every cache, one table and a plot."""
    from kvcache_cli.eval import retrieval
    from kvcache_cli.measure import resolve_device
    from kvcache_cli.models import model_config

    try:
        problem = threads_error(threads)
        if problem is not None:
            raise ValueError(problem)
        sizes = retrieval.parse_lengths(lengths)
        config = model_config(model)
        prompter = retrieval.prompter_for(config)
        specs = cache if cache is not None else retrieval.DEFAULT_CACHES
        _, ids = retrieval.prompts(prompter, sizes)
        retrieval.check_fit(sizes, ids, config.context)
        retrieval.specs_to_run(specs, ids)  # a budget the prompts cannot fill: refused now
        dev = resolve_device(device)
    except ValueError as err:
        fail(str(err))
    except RuntimeError as err:
        fail(str(err), code=1)
    check_plot(plot)
    loaded = load_model(model, weights.value, str(dev))

    pick_threads(threads, dev)
    try:
        with progress("answering", "prompts") as on_progress:
            result = retrieval.run_retrieval(loaded.model, prompter, specs, sizes,
                                             model_name=loaded.source, progress=on_progress)
    except (ValueError, IndexError) as err:
        fail(str(err))
    except RuntimeError as err:
        fail(str(err), code=1)
    from kvcache_cli.views.retrieval import plain, render, save_plot

    _show(result, render, plain, save_plot, as_json, plot)


def _heldout(model: str, transformers: bool = False) -> Path:
    """The held-out text shipped beside a checkpoint, or a ValueError saying to give one.

    A Llama-family or Gemma 3 model, or any the transformers engine runs, reads the shipped
    checkpoint's: Python standard-library sources, which every Python user has and SmolLM2
    tokenizes to 25,850 tokens.
    """
    from kvcache_cli.checkpoints import TRAINED
    from kvcache_cli.models import family_of
    from kvcache_cli.models.gpt2 import PRESETS, checkpoint_dir

    if transformers or family_of(model) in ("llama", "gemma3"):
        return checkpoint_dir(TRAINED) / HELDOUT
    path = checkpoint_dir(model) / HELDOUT
    if model in PRESETS or not path.is_file():
        raise ValueError(f"--model {model} ships no {HELDOUT}: give the text to evaluate on "
                         "with --text FILE")
    return path
