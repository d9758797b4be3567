"""`kvcache size`: the KV cache of a real model, from a preset, a config or shape flags."""

from __future__ import annotations

from typing import Annotated

import typer

from kvcache_cli.cli.loading import need_torch_extra
from kvcache_cli.cli.options import complete_preset
from kvcache_cli.cli.output import print_view
from kvcache_cli.cli.refusals import fail


def size(
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="A preset (see 'kvcache models'); smollm2 or a .gguf, a "
        "model kvcache runs (then every cache kind it holds is listed too); a Hub id ORG/NAME, "
        "whose "
        "config.json is read through the local Hub cache; or a local folder or config.json.",
        autocompletion=complete_preset)] = None,
    revision: Annotated[str | None, typer.Option(
        help="Branch, tag or commit of a Hub id (default main); reads even a preset's id "
        "from the Hub.")] = None,
    config: Annotated[str | None, typer.Option(
        help="A Hugging Face config.json, or the folder holding it; read offline.")] = None,
    layers: Annotated[int | None, typer.Option(help="Decoder layers.")] = None,
    kv_heads: Annotated[int | None, typer.Option(
        help="K/V heads per layer (1 = MQA; default: --heads).")] = None,
    head_dim: Annotated[int | None, typer.Option(
        help="Width of one head (default 128).")] = None,
    heads: Annotated[int | None, typer.Option(
        help="Query heads, for the multi-head baseline.")] = None,
    seq: Annotated[str | None, typer.Option(
        help="Tokens per sequence: 4096, 32k (32,768) or 1M (default: the model's context "
        "window).")] = None,
    batch: Annotated[int, typer.Option(help="Sequences cached at once.")] = 1,
    dtype: Annotated[str | None, typer.Option(
        help="Cache dtype: fp32, fp16, bf16, fp8, int8, int4 (default fp16; fp32, the dtype "
        "kvcache runs it in, for -m smollm2 or a .gguf).", show_default=False)] = None,
    tp: Annotated[int, typer.Option(help="Tensor-parallel GPUs sharing the KV heads.")] = 1,
    gpu_mem: Annotated[str | None, typer.Option(
        help="Memory of one GPU: 80GiB, 80GB or bytes. Reports what fits.")] = None,
    weight_dtype: Annotated[str, typer.Option(
        help="Dtype of the weights, for --gpu-mem.")] = "fp16",
    params: Annotated[str | None, typer.Option(
        help="Parameter count for --gpu-mem without --model: 6.74B, 6738415616.")] = None,
    block_size: Annotated[int | None, typer.Option(
        help="Paged-cache block size in tokens, for --gpu-mem.")] = None,
    cache: Annotated[str | None, typer.Option(
        "--cache", metavar="SPEC", help="A cache spec such as int4:g32:kchan:r128, fp8, "
        "paged-int8: its codes, scales, zero points and full-precision tokens are counted "
        "(--dtype is then the precision of what it keeps unquantised).")] = None,
    group_size: Annotated[int | None, typer.Option(
        help="With --dtype int8/int4: the quantisation group (one fp16 scale and zero "
        "point per group), as --cache intN:gN.")] = None,
    residual: Annotated[int | None, typer.Option(
        help="With --dtype int8/int4: the newest tokens kept at fp16, as --cache intN:rN.")
    ] = None,
    window: Annotated[int | None, typer.Option(
        help="A bounded cache: every attention layer keeps only the W newest positions "
        "(window:W; with --sinks, sink:S+W), so the bytes stop growing there.")] = None,
    sinks: Annotated[int, typer.Option(
        help="With --window: the first S positions kept for good besides the window "
        "(StreamingLLM's attention sinks; it keeps 4).")] = 0,
    sliding: Annotated[str, typer.Option(
        help="With --cache on a model with sliding-window layers (-m gemma3): model puts the "
        "spec on the global layers, the sliding ones in exact rings of their window; full "
        "puts it on every layer, each holding every position (the waste).")] = "model",
    verify: Annotated[bool, typer.Option(
        "--verify", help="Build the model small in transformers and measure its real cache.")
    ] = False,
    engine: Annotated[str | None, typer.Option(
        help="vllm, sglang or llama.cpp: the cache that engine allocates in --kv-memory (or "
        "--gpu-mem × --gpu-memory-utilization less the weights), in tokens and blocks, and "
        "the command that starts it so, each flag's reason in a line. llama.cpp needs no "
        "memory: --batch slots of --seq, its buffers per front end.")] = None,
    kv_memory: Annotated[str | None, typer.Option(
        help="--engine: the memory for the KV cache alone, e.g. 1GiB (vLLM's "
        "--kv-cache-memory-bytes; VLLM_CPU_KVCACHE_SPACE on its CPU build).")] = None,
    gpu_memory_utilization: Annotated[float, typer.Option(
        help="--engine with --gpu-mem: the share of the GPU the engine may take (vLLM "
        "0.32's default).")] = 0.92,
    kv_cache_dtype: Annotated[str, typer.Option(
        help="--engine: auto (the model's --dtype) or fp8.")] = "auto",
    max_model_len: Annotated[str | None, typer.Option(
        help="--engine: the longest request, e.g. 2048 or 32k (default: --seq, else the "
        "model's context window).")] = None,
    max_num_batched_tokens: Annotated[int, typer.Option(
        help="--engine vllm: tokens scheduled a step; a sliding window reserves blocks for "
        "them.")] = 2048,
    engine_device: Annotated[str, typer.Option(
        help="--engine vllm: cuda, or cpu for vLLM's CPU build, whose attention takes blocks "
        "of multiples of 32 (CUDA's, of 16): a sliding layer's block is the kernel's.")
    ] = "cuda",
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw result as JSON.")] = False,
) -> None:
    """How big the KV cache is for a model, a sequence length and a batch, and what fits.

    The shape comes from --model, --config, or the flags --layers/--kv-heads/--head-dim.
    --window (and --sinks) size a bounded cache instead of the exact one.
    """
    import dataclasses

    from kvcache_cli import sizing
    from kvcache_cli.hub import HubUnavailable
    from kvcache_cli.models.live import is_live

    try:
        if model is not None and not model.strip():
            raise ValueError(f"--model {model!r}: expected a preset name (see 'kvcache "
                             "models'), a Hub id, smollm2, gemma3 or a path")
        tokens = None if seq is None else sizing.parse_tokens(seq)
        count = None if params is None else sizing.parse_count(params)
        memory = None if gpu_mem is None else sizing.parse_bytes(gpu_mem)
        live = model is not None and is_live(model)
        dtype_given = dtype is not None or live
        # "" is refused; llama.cpp's cache is f16 by default whatever the weights
        dtype = dtype if dtype is not None else (
            "fp32" if live and engine != "llama.cpp" else "fp16")
        _check_engine_options(engine, kv_memory, gpu_memory_utilization, kv_cache_dtype,
                              max_model_len, max_num_batched_tokens, cache, window, verify,
                              engine_device, block_size, tp)
        if engine is not None and max_model_len is not None:
            longest = sizing.parse_tokens(max_model_len, "--max-model-len")
            if tokens is not None and tokens != longest:
                raise ValueError(f"--seq {tokens:,} and --max-model-len {longest:,} both give "
                                 "the longest request under --engine: expected one of them")
            tokens = longest
        shape, hf_config, hub_config, config = _resolve_shape(
            model, revision, config, (layers, kv_heads, head_dim, heads), count, memory, live)
        if verify and window is not None:
            raise ValueError("--verify measures transformers' exact cache: expected no "
                             "--window with it")
        spec = _cache_spec(cache, dtype, group_size, residual, tp, block_size, verify)
        if spec is not None:
            if window is not None:
                raise ValueError("--window and --cache (or --group-size/--residual) both "
                                 "choose the cache: expected one of them")
            result = _size_spec(shape, spec, cache, dtype, tokens, batch, memory, weight_dtype,
                                sliding)
        else:
            if sliding != "model":
                raise ValueError(f"--sliding {sliding} chooses where a cache spec goes: "
                                 "expected --cache SPEC with it")
            paged = None if engine is not None and memory is None else block_size
            result = sizing.size_cache(shape, tokens, batch, dtype, tp, memory, weight_dtype,
                                       paged, window, sinks)
            if engine is not None:
                result = dataclasses.replace(result, engine=_engine_fit(
                    shape, engine, dtype, dtype_given, kv_cache_dtype, result.seq, kv_memory,
                    memory, gpu_memory_utilization, weight_dtype, block_size, tp,
                    _model_ref(engine, model if live else None, shape, hub_config, config),
                    max_num_batched_tokens, batch, engine_device))
            if live and window is None and engine is None:
                result = _with_live_kinds(result, shape, dtype)
    except ValueError as err:
        fail(str(err))
    except HubUnavailable as err:  # the Hub failed on its side
        fail(str(err), code=1)
    if verify:
        result = _verified(result, hf_config, dtype)
    _render(result, spec, as_json)


def _resolve_shape(model, revision, config, shape_flags, count, memory, live: bool):
    """(the shape, its config dict, the Hub's config or None, --config as read) from a
    model kvcache runs, a local path, a Hub id, a preset, --config or the shape flags.
    Raises ValueError for bad input, HubUnavailable when the Hub fails on its side."""
    import dataclasses

    from kvcache_cli import sizing

    if live:  # a model kvcache runs: its shape from the converted GGUF, no torch
        shape, hf_config = _live_shape(model, config, *shape_flags)
        model = None
        if count is not None:
            shape = dataclasses.replace(shape, params=count)
    if model is not None and _is_local_path(model):
        if config is not None:
            raise ValueError(f"--model {model!r} is a local config and --config is given: "
                             "expected one of the two")
        model, config = None, model  # a folder or file: read as --config reads it
    hub_config = _hub_config(model, revision, config, *shape_flags)
    if hub_config is not None:
        model, config = None, hub_config.path
    if not live:
        shape, hf_config = sizing.resolve_shape(model, config, *shape_flags, count)
    if memory is not None and shape.params is None and config is not None and hf_config:
        # --gpu-mem needs the weights: count them from the config where its family is
        # one the reader counts (else the fit asks for --params).
        shape = dataclasses.replace(shape, params=sizing.params_from_config(hf_config))
    if hub_config is not None:
        shape = dataclasses.replace(shape, name=hub_config.repo_id, source=(
            f"{hub_config.repo_id} @ {hub_config.revision} ({hub_config.commit[:7]})"))
    return shape, hf_config, hub_config, config


def _size_spec(shape, spec, cache, dtype, tokens, batch, memory, weight_dtype, sliding):
    """A cache spec counted: its codes, scales and full-precision tokens."""
    from kvcache_cli.sizing.cache_spec import size_spec

    full = "fp16" if cache is None else dtype  # --dtype int4 names the codes
    tokens = tokens if tokens is not None else shape.max_positions
    if tokens is None:
        raise ValueError("no --seq given and the model declares no context window; "
                         "expected --seq N")
    return size_spec(shape, spec, tokens, batch, full, memory, weight_dtype, sliding)


def _with_live_kinds(result, shape, dtype):
    """A model kvcache runs: every cache kind it holds, listed beside the exact one."""
    import dataclasses

    from kvcache_cli import sizing
    from kvcache_cli.models.live import live_kinds

    # The caches keep numbers at the model's precision: fp32 unless a float
    # --dtype says otherwise (fp8 and the int kinds are among the kinds).
    full = dtype if sizing.dtype_bits(dtype) >= 16 else "fp32"
    return dataclasses.replace(result, live=live_kinds(shape, result.seq, full))


def _verified(result, hf_config, dtype):
    """--verify: the result with transformers' own cache measured beside it."""
    import dataclasses

    from kvcache_cli import sizing

    need_torch_extra("--verify needs", "torch", "transformers")
    try:
        return dataclasses.replace(result, verify=sizing.verify_cache(hf_config, dtype))
    except sizing.VerifyError as err:
        fail(str(err), code=1)


def _render(result, spec, as_json: bool) -> None:
    if as_json:
        from kvcache_cli.views import to_json

        typer.echo(to_json(result))
        return
    from kvcache_cli.views.sizing import size_view, spec_size_view

    print_view(size_view(result) if spec is None else spec_size_view(result))


ENGINE_OPTIONS = ("--kv-memory", "--gpu-memory-utilization", "--kv-cache-dtype",
                  "--max-model-len", "--max-num-batched-tokens", "--engine-device")


# The options only vLLM's fit reads (SGLang pools single tokens; llama.cpp's cells are its
# own), and the ones llama.cpp's ignores too (kvcache prints one process's flags for it).
VLLM_ONLY = ("--block-size", "--max-num-batched-tokens", "--engine-device")


def _check_engine_options(engine, kv_memory, util, kv_cache_dtype, max_model_len,
                          batched, cache, window, verify, device, block_size, tp) -> None:
    """The engine's options only with --engine (each with an engine that reads it), and
    --engine only with the exact cache."""
    given = [flag for flag, value in zip(ENGINE_OPTIONS, (
        kv_memory is not None, util != 0.92, kv_cache_dtype != "auto",
        max_model_len is not None, batched != 2048, device != "cuda"), strict=True) if value]
    if engine is None:
        if given:
            raise ValueError(f"{given[0]} is for an engine's cache: expected --engine vllm, "
                             "sglang or llama.cpp with it")
        return
    for flag, value in (("--cache", cache), ("--window", window), ("--verify", verify or None)):
        if value is not None:
            raise ValueError(f"--engine sizes the engine's own cache: expected no {flag} "
                             "with it")
    ignored = [] if engine == "vllm" else [flag for flag, value in zip(VLLM_ONLY, (
        block_size is not None, batched != 2048, device != "cuda"), strict=True) if value]
    if engine == "llama.cpp" and tp != 1:
        ignored.append("--tp")
    if ignored:
        engines = "vllm and sglang" if ignored[0] == "--tp" else "vllm"
        raise ValueError(f"{ignored[0]} applies to --engine {engines} only: expected none "
                         f"with --engine {engine}")


def _engine_fit(shape, engine, dtype, dtype_given, kv_cache_dtype, max_model_len, kv_memory,
                gpu_mem, util, weight_dtype, block_size, tp, model, batched, slots, device):
    from kvcache_cli import sizing
    from kvcache_cli.sizing.engines import BLOCK_SIZE, fit_engine

    kv_bytes = None if kv_memory is None else sizing.parse_bytes(kv_memory, "--kv-memory")
    if kv_bytes is not None and gpu_mem is not None:
        raise ValueError("--kv-memory and --gpu-mem both give the cache's memory: expected "
                         "one of them")
    sizing.check_range("--max-num-batched-tokens", batched)
    return fit_engine(shape, engine, dtype, kv_cache_dtype, max_model_len, kv_bytes, gpu_mem,
                      util, weight_dtype, block_size or BLOCK_SIZE, tp, model, batched,
                      dtype_given, slots, device)


def _model_ref(engine, live, shape, hub_config, config) -> str:
    """What the printed command names: a Hub id, a folder, a model kvcache runs by its GGUF
    for llama.cpp and its Hub id for the others. `live` is that model's -m, or None."""
    from kvcache_cli.models.gemma3_270m import GEMMA3, gemma3_gguf
    from kvcache_cli.models.smollm2 import SMOLLM2_HUB, smollm2_gguf

    if live is not None:
        gguf, hub_id = (gemma3_gguf(), "google/gemma-3-270m") if live == GEMMA3 else (
            (smollm2_gguf(), SMOLLM2_HUB) if not live.endswith(".gguf") else (live, "MODEL"))
        return str(gguf) if engine == "llama.cpp" and gguf else hub_id
    if engine == "llama.cpp":
        return "MODEL.gguf"  # llama.cpp reads a GGUF, which a config.json does not name
    if hub_config is not None:
        return hub_config.repo_id
    if config is not None:
        return str(config)
    return shape.source if "/" in shape.source else "MODEL"


def _live_shape(model: str, config, *shape_flags):
    """(shape, config dict) of a model kvcache loads itself; ValueError with --config or
    shape flags beside it."""
    from kvcache_cli.models.live import live_shape

    if config is not None or any(flag is not None for flag in shape_flags):
        raise ValueError(f"--model {model} gives the shape: expected no --config, --layers, "
                         "--kv-heads, --head-dim or --heads with it")
    return live_shape(model)


def _cache_spec(cache, dtype, group_size, residual, tp, block_size, verify):
    """The spec to count by (--cache, or --dtype intN with --group-size/--residual), or None
    for the plain calculator. Raises ValueError (CacheSpecError) for bad input."""
    from kvcache_cli.caches.spec import parse_cache_spec

    grouped = group_size is not None or residual is not None
    if cache is None and not grouped:
        return None
    if cache is not None and grouped:
        raise ValueError("--group-size and --residual spell a spec with --dtype int8/int4; "
                         f"with --cache put them in it (e.g. {cache.split(':')[0]}:g32:r128)")
    for flag, given in (("--tp", tp > 1), ("--block-size", block_size is not None),
                        ("--verify", verify)):
        if given:
            raise ValueError(f"{flag} is not counted for a cache spec: expected --cache "
                             "(or --group-size/--residual) without it")
    if cache is not None:
        return parse_cache_spec(cache)
    if dtype.lower() not in ("int8", "int4"):
        raise ValueError(f"--group-size and --residual quantise in groups: expected --dtype "
                         f"int8 or int4, got {dtype!r}")
    fields = [f"g{group_size}" if group_size is not None else "",
              f"r{residual}" if residual is not None else ""]
    return parse_cache_spec(":".join([dtype.lower(), *filter(None, fields)]))


def _is_local_path(model: str) -> bool:
    """A --model that names a file or folder here (as transformers' from_pretrained looks
    for a local folder first), or is spelled as a path (./dir, ../dir, /dir, ~/dir)."""
    from pathlib import Path

    return model.startswith((".", "/", "~")) or Path(model).expanduser().exists()


def _hub_config(model, revision, config, *shape_flags):
    """The Hub repository's config.json when --model names one, else None.

    A preset's own name or Hub id stays the preset (offline, with its published parameter
    count) unless --revision asks for the repository itself. With --config or shape flags,
    nothing is fetched: resolve_shape reports the conflict. Raises ValueError for bad input
    and HubUnavailable when the Hub fails on its side.
    """
    from kvcache_cli import hub, sizing

    if model is None or not hub.is_hub_id(model):
        if revision is not None:
            raise ValueError(f"--revision {revision!r} applies to a Hub id: expected --model "
                             "ORG/NAME")
        return None
    if config is not None or any(flag is not None for flag in shape_flags):
        return None
    if revision is None:
        try:
            sizing.preset(model)
            return None
        except ValueError:
            pass
    return hub.config_json(model, revision)
