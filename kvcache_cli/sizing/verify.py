"""--verify: build a model small in transformers, run a short forward with its cache on, and
compare the bytes its cache holds (K/V tensors and recurrent states) with the formula's.

`verify_cache` is the one function here that needs torch and transformers, and imports them
inside itself; the sweep test in tests/test_sizing_sweep.py runs it for every config class.
"""

from __future__ import annotations

import copy
import warnings

from kvcache_cli import TORCH_INSTALL
from kvcache_cli.sizing.arithmetic import (
    mha_values_per_token,
    state_bytes_per_sequence,
    tokens_held,
    values_per_token,
)
from kvcache_cli.sizing.config import shape_from_config
from kvcache_cli.sizing.config_fields import HIDDEN_KEYS, LAYER_KEYS
from kvcache_cli.sizing.reports import Verification, VerifyLayer
from kvcache_cli.sizing.shape import ModelShape
from kvcache_cli.sizing.units import DTYPE_BITS, bytes_for_values, canonical_dtype


class VerifyError(RuntimeError):
    """transformers could not build or run the model: a failure at run time, not bad input."""


# Widths the cache does not depend on, shrunk so a 70B-shaped layer builds in a second on a
# CPU. Attention widths (heads, KV heads, head_dim, MLA ranks) are never touched.
_SHRINK = {
    "vocab_size": 512,
    "intermediate_size": 64,
    "n_inner": 64,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "n_routed_experts": 4,
    "num_local_experts": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,
    "n_group": 1,
    "num_expert_group": 1,
    "topk_group": 1,
}
_VERIFY_WINDOW = 4  # a sliding window small enough to fill with a short prompt
_VERIFY_TOKENS = 8


def _verify_config(config: dict, max_layers: int) -> tuple[dict, list[str]]:
    """A copy of `config` with the first few layers and small non-attention widths.

    The first layers are kept, as many as it takes to include one layer of every kind the
    model has (so a sliding/global model checks both) and at least `max_layers`: a prefix,
    because every per-layer field (layer_types, MoE patterns, hybrid patterns, per-layer
    overrides) then only needs cutting, never re-indexing.
    """
    cfg = copy.deepcopy(config)
    if isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]
    if not cfg.get("model_type"):
        raise VerifyError("the config has no model_type: transformers cannot tell what to build")
    shape = shape_from_config(cfg)
    layer_key = next((k for k in LAYER_KEYS if cfg.get(k) is not None), None)
    # Decoder layers, before any per-layer block count; Nemotron-H has no count but its pattern.
    layers = cfg[layer_key] if layer_key else len(cfg["layers_block_type"])
    blocks = shape.layers // layers
    firsts = [shape.layer_kinds.index(kind) // blocks for kind in dict.fromkeys(shape.layer_kinds)]
    keep = min(layers, max(max_layers, max(firsts) + 1))
    changes = [f"layers {layers} → {keep} (the first {keep})"]
    if keep < layers:
        for key in (*LAYER_KEYS, "num_blocks"):  # xLSTM counts its blocks twice
            if cfg.get(key) == layers:
                cfg[key] = keep
        for key, value in list(cfg.items()):
            if (isinstance(value, list) or key == "hybrid_override_pattern") and len(
                    value) == layers:
                cfg[key] = value[:keep]  # layer_types, mlp_layer_types, hybrid patterns...
            elif key == "per_layer_config" and isinstance(value, dict):
                cfg[key] = {k: v for k, v in value.items() if str(k).isdigit() and int(k) < keep}
        if isinstance(cfg.get("attn_layer_indices"), list):
            cfg["attn_layer_indices"] = [i for i in cfg["attn_layer_indices"] if i < keep]
        nested = cfg.get("linear_attn_config")
        if isinstance(nested, dict) and isinstance(nested.get("full_attn_layers"), list):
            nested["full_attn_layers"] = [i for i in nested["full_attn_layers"] if i <= keep]
        if cfg.get("num_kv_shared_layers"):
            cfg["num_kv_shared_layers"] = 0  # the sharing layers are the last ones, cut here
            changes.append("num_kv_shared_layers → 0 (the layers that reuse a cache are cut)")

    for key, small in _SHRINK.items():
        if key == "intermediate_size" and shape.state_layers:
            continue  # Mamba's intermediate_size is the width of its state
        if key == "n_inner" and cfg.get("model_type") == "gpt2":
            cfg.setdefault("n_inner", None)
        if key in cfg and (cfg[key] is None or (isinstance(cfg[key], int) and cfg[key] > small)):
            changes.append(f"{key} {cfg[key]} → {small}")
            cfg[key] = small
    if (cfg.get("head_dim") is not None or cfg.get("kv_lora_rank") is not None) and (
            not shape.state_layers and shape.heads
            and shape.heads * shape.head_dim != cfg.get("hidden_size")):
        # head_dim is explicit and not hidden / heads, so the hidden width no longer sets it:
        # shrink it too. (Where they agree, some models assume it: Helium's o_proj.)
        hidden_key = next((k for k in HIDDEN_KEYS if k in cfg), None)
        small = 8 * shape.heads
        if hidden_key and isinstance(cfg[hidden_key], int) and cfg[hidden_key] > small:
            changes.append(f"{hidden_key} {cfg[hidden_key]} → {small}")
            cfg[hidden_key] = small
    for key in ("sliding_window", "attention_window_size", "attention_chunk_size"):
        if cfg.get(key) and cfg[key] > _VERIFY_WINDOW and any(
            k in ("sliding", "chunked") for k in shape.layer_kinds
        ):
            changes.append(
                f"{key} {cfg[key]} → {_VERIFY_WINDOW}, so {_VERIFY_TOKENS} tokens overflow it"
            )
            cfg[key] = _VERIFY_WINDOW
    # Token ids past the shrunk vocabulary, hub-only loaders and quantised weights have no
    # bearing on the cache and would stop an offline CPU build. Id 0 is inside any vocabulary
    # (None fails the configs that require an id).
    for key in [k for k in cfg if k.endswith("_token_id") and cfg[k] is not None]:
        cfg[key] = 0
    for key in ("quantization_config", "auto_map", "torch_dtype", "dtype"):
        cfg.pop(key, None)
    return cfg, changes


def verify_cache(config: dict, dtype: str = "fp16", max_layers: int = 2) -> Verification:
    """Build `config` with a few layers and random weights on CPU, run a short forward with
    the cache on, and compare the bytes its cache tensors hold with the formula's."""
    try:
        import torch
        import transformers.initialization  # noqa: F401 - what _run_small needs, checked here
    except ImportError as error:
        raise VerifyError(
            f"--verify needs torch and transformers ({error.name} is not installed): "
            f"{TORCH_INSTALL}"
        ) from None

    cfg, changes = _verify_config(config, max_layers)
    dtype = canonical_dtype(dtype)
    explanation: list[str] = []
    if dtype not in _TORCH_DTYPES:
        # transformers' default cache stores the model's own dtype; a quantised cache needs
        # optional backends. The element count is what is being checked, so check it at bf16.
        explanation.append(f"a {dtype} cache needs a quantised-cache backend; checked at bf16")
        dtype = "bf16"
    shape = shape_from_config(cfg)
    model_type = cfg.pop("model_type")
    model, cache, on_modules = _run_small(cfg, model_type, getattr(torch, _TORCH_DTYPES[dtype]))
    bits = DTYPE_BITS[dtype]
    layers, state_measured = _measure(model, cache, on_modules, shape, bits, model_type)
    measured = sum(layer.measured_bytes for layer in layers)
    formula = sum(layer.formula_bytes for layer in layers)
    state_formula = state_bytes_per_sequence(shape, bits)
    explanation.extend(_explain(shape, layers, bits))
    fp32_ssm = shape.state_layers * (bytes_for_values(shape.conv_state_values, bits)
                                     + bytes_for_values(shape.ssm_state_values, 32))
    if state_measured != state_formula and state_measured == fp32_ssm:
        explanation.append(f"this transformers model keeps its SSM state in fp32 whatever its "
                           f"dtype: {state_measured:,} bytes against the formula's "
                           f"{state_formula:,} at {dtype}")
    elif state_measured != state_formula:
        explanation.append(f"the recurrent states hold {state_measured:,} bytes against the "
                           f"formula's {state_formula:,}")
    return Verification(
        model_type=model_type,
        dtype=dtype,
        tokens=_VERIFY_TOKENS,
        window=shape.window,
        layers=tuple(layers),
        measured_bytes=measured,
        formula_bytes=formula,
        state_measured_bytes=state_measured,
        state_formula_bytes=state_formula,
        matches=measured == formula and state_measured == state_formula,
        window_convention_only=state_measured == state_formula and all(
            layer.measured_bytes in (layer.formula_bytes, _window_minus_one(shape, layer, bits))
            for layer in layers),
        changes=tuple(changes),
        explanation=tuple(explanation),
    )


# The cache dtypes transformers' default cache stores, by torch's name.
_TORCH_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def _run_small(cfg: dict, model_type: str, torch_dtype):
    """(the model transformers builds for `cfg`, the cache a short forward left, whether
    its recurrent states stay on its modules); any failure of transformers' is a VerifyError."""
    import torch
    import transformers
    from transformers.initialization import no_init_weights

    verbosity = transformers.logging.get_verbosity()
    # The shrunk model trips config warnings that say nothing about the cache; keep stderr clean.
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf_config = transformers.AutoConfig.for_model(model_type, **cfg)
            torch.manual_seed(0)
            # Uninitialised weights: the cache's shapes do not depend on their values, and
            # initialising a 4096-wide layer costs seconds on a CPU.
            with no_init_weights():
                model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch_dtype)
            model.eval()
            input_ids = torch.randint(0, hf_config.vocab_size, (1, _VERIFY_TOKENS))
            with torch.inference_mode():
                out = model(input_ids=input_ids, use_cache=True)
                on_modules = _cache_of(out) is None and _holds_module_state(model)
                if on_modules:
                    # RecurrentGemma returns no cache: its K/V go to a cache it makes and
                    # drops, its recurrent states stay on its modules. Hand it one to keep.
                    cache = transformers.DynamicCache(config=hf_config)
                    out = model(input_ids=input_ids, use_cache=True, cache=cache)
                    out.past_key_values = cache
    except Exception as error:  # transformers raises many types; all mean "cannot build/run it"
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise VerifyError(
            f"transformers could not build and run model_type {model_type!r}: "
            f"{type(error).__name__}: {first[:200]}"
        ) from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    cache = _cache_of(out)
    if cache is None or not hasattr(cache, "layers"):
        raise VerifyError(f"model_type {model_type!r} returned no layered cache to measure")
    return model, cache, on_modules


def _measure(model, cache, on_modules: bool, shape: ModelShape, bits: int, model_type: str
             ) -> tuple[list[VerifyLayer], int]:
    """(each cache layer's bytes held against the formula's, the recurrent states' bytes)."""
    import torch

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    # MiniMax's cache grows its K/V list only up to the last attention layer it saw, and keeps
    # its linear-attention states in a list beside it.
    state_measured = nbytes(t for t in getattr(cache, "linear_cache", []) or [])
    if on_modules:
        state_measured += nbytes(_module_states(model))
    cache_layers = list(cache.layers)
    if hasattr(cache, "linear_cache"):
        cache_layers += [None] * (shape.layers - len(cache_layers))
    if len(cache_layers) != shape.layers:
        raise VerifyError(f"model_type {model_type!r} built {len(cache_layers)} cache layers; "
                          f"the config reader expected {shape.layers}")
    layers = []
    for index, (layer, kind) in enumerate(zip(cache_layers, shape.layer_kinds, strict=True)):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else () for t in (keys, values)]
        # DeepSeek-V3.2's sparse-attention indexer keeps one more key per token.
        measured = nbytes((keys, values, getattr(layer, "indexer_keys", None)))
        state_measured += nbytes([*(getattr(layer, "conv_states", None) or {}).values(),
                                  *(getattr(layer, "recurrent_states", None) or {}).values()])
        expected = bytes_for_values(values_per_token(shape.layer_shape(index), kind),
                                    bits) * tokens_held(shape, kind, _VERIFY_TOKENS)
        layers.append(VerifyLayer(index, kind, shapes[0], shapes[1], measured, expected))
    return layers, state_measured


# Where a model that keeps its recurrent state on its modules (RecurrentGemma) holds it:
# the convolution's last inputs and the RG-LRU state.
_MODULE_STATES = ("conv1d_state", "recurrent_states")


def _module_states(model) -> list:
    return [getattr(module, name, None) for module in model.modules() for name in _MODULE_STATES]


def _holds_module_state(model) -> bool:
    return any(hasattr(module, name) for module in model.modules() for name in _MODULE_STATES)


def _cache_of(out):
    return getattr(out, "cache", None) or getattr(out, "past_key_values", None)


def _window_minus_one(shape: ModelShape, layer: VerifyLayer, bits: int) -> int | None:
    """What transformers keeps for a sliding or chunked layer between steps: window − 1 tokens."""
    if layer.kind not in ("sliding", "chunked"):
        return None
    per_token = values_per_token(shape.layer_shape(layer.index), layer.kind)
    return bytes_for_values(per_token, bits) * (shape.window - 1)


def _explain(shape: ModelShape, layers: list[VerifyLayer], bits: int) -> list[str]:
    """Why a layer's real cache differs from the formula, when it does."""
    lines = []
    for layer in layers:
        if layer.measured_bytes == layer.formula_bytes:
            continue
        own = shape.layer_shape(layer.index)
        per_token = bytes_for_values(values_per_token(own, layer.kind), bits)
        decompressed = bytes_for_values(mha_values_per_token(own, layer.kind), bits)
        if layer.measured_bytes == _window_minus_one(shape, layer, bits):
            lines.append(
                f"layer {layer.index} ({layer.kind}): transformers keeps window − 1 = "
                f"{shape.window - 1} tokens between steps and adds the new token's K/V inside "
                f"the step, so attention sees {shape.window}; the formula counts the whole "
                "window, which is what a serving engine allocates"
            )
        elif layer.kind == "mla" and layer.measured_bytes == decompressed * _VERIFY_TOKENS:
            lines.append(
                f"layer {layer.index} (mla): this transformers caches the decompressed per-head "
                f"keys and values, {shape.heads} × ({shape.qk_nope_head_dim} + "
                f"{shape.qk_rope_head_dim} + {shape.v_head_dim}) per token, "
                f"{decompressed / per_token:.1f}x the latent the formula counts"
            )
        else:
            lines.append(
                f"layer {layer.index} ({layer.kind}): the cache holds K {layer.key_shape} and "
                f"V {layer.value_shape}, {layer.measured_bytes:,} bytes against the formula's "
                f"{layer.formula_bytes:,}"
            )
    if not lines:
        lines.append("the real cache tensors hold exactly the formula's bytes")
    return lines
