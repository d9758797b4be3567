"""config.json → ModelShape, as transformers would build the model, for every way real
checkpoints spell "this layer attends", "this layer holds a window", "this layer holds a
recurrent state instead" and "this layer reuses another layer's cache".

The layer pattern is decided by a table of rules, tried in order; each rule reads one config
spelling and names the public model it comes from. Where a family departs from the common
reading (a window that excludes the query, two attention blocks a layer, a state kept in
fp32), its entry in `sizing.families` says so. Every number read is checked for type and
range, and the file itself is read with a size cap and only when it is a regular file, so a
hostile or broken config ends in one ConfigError line, never a hang or a traceback.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcache_cli.sizing.config_fields import (
    CONTEXT_KEYS,
    HEAD_DIM_KEYS,
    HEAD_KEYS,
    HIDDEN_KEYS,
    KV_HEAD_KEYS,
    LAYER_KEYS,
    first_int,
    int_list,
    layer_names,
    read_int,
    read_kv_heads,
)
from kvcache_cli.sizing.families import Family, decoder_config, family
from kvcache_cli.sizing.shape import ModelShape
from kvcache_cli.sizing.states import state_rule
from kvcache_cli.sizing.units import LIMITS, ConfigError, shown

_MAX_CONFIG_BYTES = 16 * 2**20  # the largest real config.json is well under 1 MiB
_MAX_WINDOW = LIMITS["--seq"]

# transformers' layer type names (and the older spellings configs still carry) → kind.
LAYER_TYPE_KIND = {
    "full_attention": "full",
    "attention": "full",
    "global": "full",
    "global_attention": "full",
    "full": "full",
    "hybrid": "full",  # linear attention beside a full KV cache in one layer (Falcon-H1)
    "indexed_attention": "full",  # DeepSeek-V3.2 sparse attention: KV plus an indexer key
    "sliding_attention": "sliding",
    "sliding": "sliding",
    "local": "sliding",
    "local_attention": "sliding",
    "hybrid_sliding": "sliding",
    "chunked_attention": "chunked",
    "linear_attention": "recurrent",
    "mamba": "recurrent",
    "mamba2": "recurrent",
    "m2": "recurrent",
    "conv": "recurrent",
    "recurrent": "recurrent",
    "rwkv": "recurrent",
    "moe": "none",
    "mlp": "none",
}
_HYBRID = {"hybrid", "hybrid_sliding"}  # these layers keep a recurrent state as well as KV



# --- the layer pattern: one rule per spelling ---------------------------------------------------

# Each rule returns every layer's transformers layer type, or None when its spelling is absent.
Rule = Callable[[dict, int, str], "list[str] | None"]


def _explicit_layer_types(cfg: dict, layers: int, where: str) -> list[str] | None:
    # google/gemma-3-27b-it, Qwen/Qwen3-Next-80B-A3B-Instruct, LiquidAI/LFM2-1.2B ("conv"),
    # openai/gpt-oss-20b: one name per layer.
    if cfg.get("layer_types") is None:
        return None
    return layer_names(cfg["layer_types"], "layer_types", layers, where)


def _indexed_attention(cfg: dict, layers: int, where: str) -> list[str] | None:
    # deepseek-ai/DeepSeek-V3.2: index_head_dim and no layer_types; DeepseekV32Config makes
    # every layer indexed_attention, whose lightning indexer caches one more key per token.
    if cfg.get("model_type") != "deepseek_v32" or cfg.get("index_head_dim") is None:
        return None
    return ["indexed_attention"] * layers


def _layers_block_type(cfg: dict, layers: int, where: str) -> list[str] | None:
    # Zyphra/Zamba-7B-v1 and Zyphra/Zamba2-2.7B: "mamba" or "hybrid" (a Mamba block with the
    # shared attention block beside it) per layer.
    if cfg.get("layers_block_type") is None:
        return None
    return layer_names(cfg["layers_block_type"], "layers_block_type", layers, where)


_PATTERN_KIND = {"M": "mamba", "*": "full_attention", "-": "mlp", "E": "moe"}


def _hybrid_override_pattern(cfg: dict, layers: int, where: str) -> list[str] | None:
    # nvidia/Nemotron-H-8B-Base-8K: "M-M-M-M*-..." (Mamba, attention, MLP, MoE), one per layer.
    pattern = cfg.get("hybrid_override_pattern")
    if pattern is None:
        return None
    if not isinstance(pattern, str) or len(pattern) != layers or set(pattern) - set(_PATTERN_KIND):
        raise ConfigError(f"{where}: hybrid_override_pattern is {str(pattern)[:60]!r}; expected "
                          f"{layers} characters from M, *, -, E")
    return [_PATTERN_KIND[c] for c in pattern]


def _block_types(cfg: dict, layers: int, where: str) -> list[str] | None:
    # google/recurrentgemma-2b: ["recurrent", "recurrent", "attention"], repeated over the layers.
    key = "block_types" if cfg.get("block_types") is not None else "_block_types"
    types = cfg.get(key)
    if types is None:
        return None
    if not isinstance(types, list) or not types or not all(isinstance(t, str) for t in types):
        raise ConfigError(f"{where}: {key} is {shown(types)}; expected a non-empty list of "
                          "names")
    if cfg.get("model_type") == "recurrent_gemma":
        # RecurrentGemmaConfig.layers_block_type: its attention blocks are always local,
        # attention_window_size tokens wide.
        types = ["local_attention" if t == "attention" else t for t in types]
    return [types[i % len(types)] for i in range(layers)]


def _attn_layer_indices(cfg: dict, layers: int, where: str) -> list[str] | None:
    # ibm-ai-platform/Bamba-9B: the attention layers listed, Mamba-2 everywhere else.
    if cfg.get("attn_layer_indices") is None:
        return None
    attention = set(int_list(cfg, "attn_layer_indices", where, layers - 1))
    return ["full_attention" if i in attention else "mamba" for i in range(layers)]


def _attn_layer_period(cfg: dict, layers: int, where: str) -> list[str] | None:
    # ai21labs/Jamba-v0.1: one attention layer in every 8, at offset 4; Mamba elsewhere.
    if cfg.get("attn_layer_period") is None and cfg.get("model_type") != "jamba":
        return None
    period = read_int(cfg, "attn_layer_period", where, high=LIMITS["--layers"]) \
        if "attn_layer_period" in cfg else 8
    offset = read_int(cfg, "attn_layer_offset", where, low=0, high=period - 1) \
        if "attn_layer_offset" in cfg else 4
    if offset >= period:
        raise ConfigError(f"{where}: the default attn_layer_offset 4 is past attn_layer_period "
                          f"{period}; expected an offset below the period")
    return ["full_attention" if i % period == offset else "mamba" for i in range(layers)]


def _linear_attn_config(cfg: dict, layers: int, where: str) -> list[str] | None:
    # moonshotai/Kimi-Linear-48B-A3B-Instruct: full_attn_layers counts from 1; the rest are
    # Kimi Delta Attention, a linear attention with a recurrent state.
    nested = cfg.get("linear_attn_config")
    if nested is None:
        return None
    if not isinstance(nested, dict) or nested.get("full_attn_layers") is None:
        raise ConfigError(f"{where}: linear_attn_config is {str(nested)[:60]}; expected an "
                          "object with full_attn_layers")
    full = {i - 1 for i in int_list(nested, "full_attn_layers", f"{where} linear_attn_config",
                                     layers)}
    if -1 in full:
        raise ConfigError(f"{where}: linear_attn_config full_attn_layers holds 0; expected "
                          f"layer numbers from 1 to {layers}")
    return ["full_attention" if i in full else "linear_attention" for i in range(layers)]


def _full_attention_interval(cfg: dict, layers: int, where: str) -> list[str] | None:
    # Qwen/Qwen3-Next-80B-A3B-Instruct as first published: every 4th layer attends, the others
    # are Gated DeltaNet.
    if cfg.get("full_attention_interval") is None and cfg.get("model_type") != "qwen3_next":
        return None
    every = read_int(cfg, "full_attention_interval", where, high=layers) \
        if "full_attention_interval" in cfg else 4
    return ["full_attention" if (i + 1) % every == 0 else "linear_attention"
            for i in range(layers)]


def _state_space_only(cfg: dict, layers: int, where: str) -> list[str] | None:
    # A family with no attention anywhere (FAMILIES: state-space and RNN models).
    return ["mamba"] * layers if family(cfg).no_attention else None


def _chunked_without_layer_types(cfg: dict, layers: int, where: str) -> list[str] | None:
    # meta-llama/Llama-4-Scout-17B-16E: attention_chunk_size 8192 and every 4th layer (the one
    # without RoPE) global, as Llama4TextConfig derives it.
    if cfg.get("attention_chunk_size") is None:
        return None
    every = read_int(cfg, "no_rope_layer_interval", where, high=layers) \
        if "no_rope_layer_interval" in cfg else 4
    return ["full_attention" if (i + 1) % every == 0 else "chunked_attention"
            for i in range(layers)]


def _sliding_window(cfg: dict, layers: int, where: str) -> list[str] | None:
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False or window is None:
        # Qwen/Qwen2.5-7B ships sliding_window with use_sliding_window false: the window is off.
        return None
    if cfg.get("sliding_window_pattern") is not None:
        # google/gemma-3-4b-pt as first published: every 6th layer global.
        every = read_int(cfg, "sliding_window_pattern", where, high=max(layers, 1))
    else:
        # google/gemma-2-9b: only sliding_window; the family's class alternates.
        every = family(cfg).sliding_every
    if every:
        return ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                for i in range(layers)]
    if cfg.get("max_window_layers") is not None:
        # Qwen2 with the window on: layers from this index slide.
        first = read_int(cfg, "max_window_layers", where, low=0, high=layers)
        return ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    return ["sliding_attention"] * layers  # mistralai/Mistral-7B-v0.1: every layer slides


LAYER_RULES: tuple[Rule, ...] = (
    _explicit_layer_types,
    _indexed_attention,
    _layers_block_type,
    _hybrid_override_pattern,
    _block_types,
    _attn_layer_indices,
    _attn_layer_period,
    _linear_attn_config,
    _full_attention_interval,
    _state_space_only,
    _chunked_without_layer_types,
    _sliding_window,
)


def layer_type_names(cfg: dict, layers: int, where: str) -> list[str]:
    """Every layer's transformers layer type, from the first rule whose spelling is present."""
    for rule in LAYER_RULES:
        names = rule(cfg, layers, where)
        if names is not None:
            return names
    return ["full_attention"] * layers  # meta-llama/Llama-2-7b-hf: every layer attends in full


# --- layers with their own widths ----------------------------------------------------------------

# per_layer_config fields (transformers 5) → the ModelShape field each one sets.
_PER_LAYER_FIELDS = {
    "num_key_value_heads": "kv_heads",
    "num_attention_heads": "heads",
    "head_dim": "head_dim",
    "v_head_dim": "v_head_dim",
    "kv_lora_rank": "kv_lora_rank",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "qk_nope_head_dim": "qk_nope_head_dim",
}


def _layer_overrides(cfg: dict, names: list[str], where: str) -> list[dict[str, int]]:
    """Per layer, the widths it sets apart from the model's, from each spelling of them."""
    layers = len(names)
    overrides: list[dict[str, int]] = [{} for _ in range(layers)]
    per_layer = cfg.get("per_layer_config")
    if per_layer is not None:
        # rednote-hilab/dots.ocr-style MoE notes, Gemma 4 as transformers 5 writes it:
        # {"05": {"head_dim": 512}, ...}, layer index → the fields that layer overrides.
        if not isinstance(per_layer, dict):
            raise ConfigError(f"{where}: per_layer_config is {str(per_layer)[:40]}; expected an "
                              "object of layer index → fields")
        for key, fields in per_layer.items():
            index = str(key)  # ASCII digits: isdigit alone passes '²' and full-width ones
            if not (index.isascii() and index.isdigit() and len(index) < 10) or \
                    int(index) >= layers or not isinstance(fields, dict):
                raise ConfigError(f"{where}: per_layer_config has {str(key)[:20]!r}: "
                                  f"{str(fields)[:40]}; expected layer indices from 0 to "
                                  f"{layers - 1}, each with an object of fields")
            for field, target in _PER_LAYER_FIELDS.items():
                if fields.get(field) is not None:
                    overrides[int(key)][target] = read_int(fields, field,
                                                       f"{where} per_layer_config {key}")
    rules = family(cfg)
    for i, name in enumerate(names):
        kind = LAYER_TYPE_KIND.get(name)
        if name == "indexed_attention" and cfg.get("index_head_dim") is not None:
            # deepseek-ai/DeepSeek-V3.2-Exp: the lightning indexer caches one more key per
            # token in the layers that use it.
            overrides[i]["index_head_dim"] = read_int(cfg, "index_head_dim", where)
        if rules.global_widths and name == "full_attention" and per_layer is None:
            # google/gemma-4 config.json: global layers are global_head_dim wide (512 by
            # default), with num_global_key_value_heads when attention_k_eq_v says so.
            width = read_int(cfg, "global_head_dim", where) if "global_head_dim" in cfg else 512
            overrides[i]["head_dim"] = width
            if cfg.get("attention_k_eq_v") and cfg.get("num_global_key_value_heads") is not None:
                overrides[i]["kv_heads"] = read_int(cfg, "num_global_key_value_heads", where)
        if kind == "sliding":
            # The Inkling family: sliding layers have their own heads and widths.
            for field, target in (("swa_num_key_value_heads", "kv_heads"),
                                  ("swa_num_attention_heads", "heads"),
                                  ("swa_head_dim", "head_dim")):
                if cfg.get(field) is not None:
                    overrides[i][target] = read_int(cfg, field, where)
            if rules.sliding_kv_scale != 1:
                # XiaomiMiMo/MiMo-V2-Flash: the config has no field for its sliding heads.
                kv = first_int(cfg, KV_HEAD_KEYS, where, required=False) or first_int(
                    cfg, HEAD_KEYS, where)
                overrides[i]["kv_heads"] = rules.sliding_kv_scale * kv
    return overrides


# --- the shape ----------------------------------------------------------------------------------


def shape_from_config(cfg: Any, name: str = "config.json", params: int | None = None) -> ModelShape:
    """Read the cache-relevant numbers from a Hugging Face config dict, as transformers would."""
    cfg, where = _decoder(cfg, name)
    rules = family(cfg)
    notes: list[str] = []
    names, kinds = _layer_kinds(cfg, rules, where, notes)
    layers = len(kinds)
    has_kv = any(kind != "recurrent" and kind != "none" for kind in kinds)
    is_mla = cfg.get("kv_lora_rank") is not None
    heads, kv_heads, head_dim = _attention_widths(cfg, is_mla, where, notes) if has_kv else (0,) * 3
    kinds = ["mla" if is_mla and kind == "full" else kind for kind in kinds]
    window = _window(cfg, kinds, rules, where)
    extra = _extra_widths(cfg, is_mla, where) if has_kv else {}
    overrides: tuple[tuple[tuple[str, int], ...], ...] = ()
    if has_kv and rules.blocks_per_layer == 1:
        model_widths = {"kv_heads": kv_heads, "heads": heads, "head_dim": head_dim,
                        "v_head_dim": extra.get("v_head_dim", 0), **extra}
        per_layer = [tuple(sorted((k, v) for k, v in over.items() if model_widths.get(k) != v))
                     for over in _layer_overrides(cfg, names, where)]
        if len(set(per_layer)) == 1:  # every layer alike (DeepSeek-V3.2's indexer keys)
            uniform = dict(per_layer[0])
            kv_heads = uniform.pop("kv_heads", kv_heads)
            heads = uniform.pop("heads", heads)
            head_dim = uniform.pop("head_dim", head_dim)
            extra.update(uniform)
        elif any(per_layer):
            overrides = tuple(per_layer)
            notes.append(f"{sum(map(bool, per_layer))} of {layers} layers have their own head "
                         "widths")
    state_layers, (conv, ssm, ssm_bits) = _recurrent_state(cfg, kinds, names, rules, where,
                                                            notes)
    return ModelShape(
        name=name,
        layers=layers,
        heads=heads or None,
        kv_heads=kv_heads,
        head_dim=head_dim,
        layer_kinds=tuple(kinds),
        window=window,
        state_layers=state_layers,
        conv_state_values=conv,
        ssm_state_values=ssm,
        ssm_state_bits=ssm_bits,
        params=params,
        max_positions=first_int(cfg, CONTEXT_KEYS, where, required=False, high=_MAX_WINDOW),
        source=where,
        notes=tuple(notes),
        layer_overrides=overrides,
        **extra,
    )


def _decoder(cfg: Any, name: str) -> tuple[dict, str]:
    """(the decoder's config, where it was read): `decoder_config`'s, with the layer count a
    Nemotron-H pattern implies."""
    where = name
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(cfg).__name__}")
    if isinstance(cfg.get("text_config"), dict):  # multimodal wrappers: the decoder is inside
        where = f"{name} (text_config)"
    cfg = decoder_config(cfg)
    if not isinstance(cfg.get("model_type", ""), str):
        raise ConfigError(f"{where}: model_type is {shown(cfg['model_type'])}; expected a "
                          "name")
    if not any(cfg.get(key) is not None for key in LAYER_KEYS) and isinstance(
            cfg.get("layers_block_type"), list):
        # nvidia/NVIDIA-Nemotron-Nano-9B-v2 in transformers: the count is the pattern's length.
        cfg = {**cfg, "num_hidden_layers": len(cfg["layers_block_type"])}
    return cfg, where


def _layer_kinds(cfg: dict, rules: Family, where: str, notes: list[str]
                 ) -> tuple[list[str], list[str]]:
    """(every decoder layer's transformers layer type, every cache layer's kind)."""
    layers = first_int(cfg, LAYER_KEYS, where, high=LIMITS["--layers"])
    names = layer_type_names(cfg, layers, where)
    kinds = []
    for type_name in names:
        if type_name not in LAYER_TYPE_KIND:
            raise ConfigError(
                f"{where}: unknown layer type {type_name[:40]!r}; expected one of "
                + ", ".join(sorted(LAYER_TYPE_KIND))
            )
        kinds.append(LAYER_TYPE_KIND[type_name])
    if cfg.get("num_kv_shared_layers"):
        # google/gemma-3n-E4B-it: the last 15 of 35 layers read the cache of an earlier layer
        # of the same kind and keep none of their own.
        shared = read_int(cfg, "num_kv_shared_layers", where, low=0, high=layers)
        kinds[layers - shared:] = ["none"] * shared
        notes.append(f"the last {shared} layers reuse earlier layers' K/V (num_kv_shared_layers)")
    blocks = rules.blocks_per_layer
    if blocks > 1 and cfg.get("num_hidden_layers") is None:
        # transformers' num_hidden_layers, when given, counts every block already.
        kinds = [kind for kind in kinds for _ in range(blocks)]
        notes.append(f"{layers} decoder layers with {blocks} attention blocks each: "
                     f"{blocks * layers} cache layers")
    return names, kinds


def _attention_widths(cfg: dict, is_mla: bool, where: str, notes: list[str]
                      ) -> tuple[int, int, int]:
    """(query heads, KV heads, one head's width) of the attention layers."""
    heads = first_int(cfg, HEAD_KEYS, where, high=LIMITS["--heads"])
    kv_heads = read_kv_heads(cfg, heads, where)
    if heads % kv_heads:
        raise ConfigError(f"{where}: {kv_heads} KV heads do not divide {heads} attention "
                          "heads; expected a divisor")
    if is_mla:
        # The width of one query/key head after decompression; the cache holds the latent.
        head_dim = (first_int(cfg, ("qk_nope_head_dim",), where)
                    + first_int(cfg, ("qk_rope_head_dim",), where))
    elif any(cfg.get(key) is not None for key in HEAD_DIM_KEYS):
        head_dim = first_int(cfg, HEAD_DIM_KEYS, where, high=LIMITS["--head-dim"])
    else:
        hidden = first_int(cfg, HIDDEN_KEYS, where)
        head_dim = hidden // heads  # rounded down, as transformers' attention does
        if hidden % heads:
            notes.append(f"hidden size {hidden} is not a multiple of {heads} heads and "
                         f"there is no head_dim: transformers rounds down to {head_dim}")
        if not head_dim:
            raise ConfigError(f"{where}: hidden size {hidden} is smaller than {heads} heads; "
                              "expected head_dim or a hidden size of at least one per head")
    return heads, kv_heads, head_dim


def _window(cfg: dict, kinds: list[str], rules: Family, where: str) -> int | None:
    """The tokens a sliding layer holds, or a chunked layer's chunk; None for neither."""
    if "sliding" in kinds and cfg.get("sliding_window") is None and cfg.get(
            "sliding_window_size") is not None:
        # The Inkling family calls the window sliding_window_size.
        return read_int(cfg, "sliding_window_size", where, high=_MAX_WINDOW) + (
            rules.window_before_query)
    if "sliding" in kinds:
        # google/recurrentgemma-2b: attention_window_size.
        return first_int(cfg, ("sliding_window", "attention_window_size"), where,
                         high=_MAX_WINDOW)
    if "chunked" in kinds:
        return first_int(cfg, ("attention_chunk_size",), where, high=_MAX_WINDOW)
    return None


def _extra_widths(cfg: dict, is_mla: bool, where: str) -> dict[str, int]:
    """The widths beyond heads × head_dim: MLA's latent and rotary parts, a value width."""
    if is_mla:
        return {key: first_int(cfg, (key,), where)
                for key in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")}
    if cfg.get("v_head_dim") is not None:
        # XiaomiMiMo/MiMo-V2-Flash: keys 192 wide, values 128.
        return {"v_head_dim": read_int(cfg, "v_head_dim", where, high=LIMITS["--head-dim"])}
    return {}


def _recurrent_state(cfg: dict, kinds: list[str], names: list[str], rules: Family, where: str,
                     notes: list[str]) -> tuple[int, tuple[int, int, int]]:
    """(the layers counted with a recurrent state, (conv values, SSM values, SSM bits))."""
    state_layers = sum(kind == "recurrent" for kind in kinds) + sum(n in _HYBRID for n in names)
    if rules.state_in_every_layer:
        state_layers = len(kinds)
    rule = state_rule(cfg)
    if state_layers and rule is not None:
        conv, ssm = rule(cfg, where)
        # nvidia/NVIDIA-Nemotron-Nano-9B-v2: "mamba_ssm_cache_dtype": "float32".
        ssm_bits = rules.state_bits or {"float32": 32, "float16": 16, "bfloat16": 16}.get(
            str(cfg.get("mamba_ssm_cache_dtype")), 0)
        return state_layers, (conv, ssm, ssm_bits)
    if state_layers:
        notes.append(f"{state_layers} recurrent layers keep a fixed-size state this reader does "
                     f"not know for model_type {str(cfg.get('model_type'))[:40]!r}; not counted")
    return 0, (0, 0, 0)


# --- the file -----------------------------------------------------------------------------------

def load_config(path: str | Path) -> dict:
    """config.json as a dict: PATH may be the file or the model folder that holds it.

    Only a regular file is opened (a FIFO would block the open, /dev/zero would never end),
    and at most _MAX_CONFIG_BYTES of it are read.
    """
    import json  # here, not at the top: `kvcache size` with flags starts ~7 ms faster

    if not str(path).strip():  # Path("") is the working folder: not what an empty value meant
        raise ConfigError(f"config path {str(path)!r}: expected a config.json or the folder "
                          "that holds it")
    path = Path(path)
    quoted = repr(str(path))
    try:
        if path.is_dir():
            path = path / "config.json"
            quoted = repr(str(path))
        info = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"config file {quoted} not found; expected a config.json") from None
    except (OSError, ValueError) as error:
        raise ConfigError(f"config file {quoted} cannot be read: {error}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"config file {quoted} is not a regular file; expected a config.json")
    if info.st_size > _MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {quoted} is {info.st_size:,} bytes; expected a "
                          f"config.json under {_MAX_CONFIG_BYTES // 2**20} MiB")
    try:
        # O_NONBLOCK: had the path been swapped for a FIFO since the stat, the open returns
        # at once instead of waiting for a writer.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as handle:
            data = handle.read(_MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise ConfigError(f"config file {quoted} cannot be read: {error}") from None
    if len(data) > _MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {quoted} is over {_MAX_CONFIG_BYTES // 2**20} MiB; "
                          "expected a config.json")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"config file {quoted} is not UTF-8 text: {error.reason} at byte "
                          f"{error.start}") from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"config file {quoted} is not valid JSON: {error.msg} at line {error.lineno} "
            f"column {error.colno}"
        ) from None
    except ValueError:  # an integer of thousands of digits, which int() refuses to read
        raise ConfigError(f"config file {quoted} holds a number thousands of digits long; "
                          "expected a config.json") from None
    except RecursionError:  # the parser recurses once per nested array or object
        raise ConfigError(f"config file {quoted} nests arrays or objects thousands deep; "
                          "expected a config.json") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"config file {quoted}: expected a JSON object, got {type(cfg).__name__}")
    return cfg
