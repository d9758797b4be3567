"""The families: where one model_type's config.json departs from the common reading (a
window that excludes the query, two attention blocks a layer, a state kept in fp32, fields
its config class fills in), and the decoder config a multimodal wrapper holds. Read by the
shape reader (`sizing.config`), the weights' count (`sizing.params`) and transformers'
loader (`hf.load`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    """How one architecture family's config.json is read where it departs from the common
    reading, as transformers' class for it builds the model. The defaults are the common
    reading."""

    # transformers fills `layer_types` when config.json has none: every Nth layer global, the
    # rest sliding (the Hub's gemma-2 configs carry only `sliding_window` and rely on this).
    sliding_every: int | None = None
    # A state-space or RNN family: no layer attends, whatever the config says of layers.
    no_attention: bool = False
    # Attention blocks, each with its own cache, in every decoder layer (when config.json's
    # num_hidden_layers, which counts them all, is absent).
    blocks_per_layer: int = 1
    # sliding_window_size counts the tokens before the query; the class adds the query itself.
    window_before_query: bool = False
    # Sliding layers keep this many times the model's KV heads (no config field says so).
    sliding_kv_scale: int = 1
    # Full-attention layers are global_head_dim wide (512 by default), with
    # num_global_key_value_heads when attention_k_eq_v says so.
    global_widths: bool = False
    # Every layer keeps a recurrent state beside its attention, whatever its layer type.
    state_in_every_layer: bool = False
    # The recurrent state's bits whatever the dtype (0: the dtype's, or mamba_ssm_cache_dtype).
    state_bits: int = 0
    # What transformers' config class fills in where config.json says nothing (the Hub's
    # google/gemma-3-4b-it gives no head counts, head size or rotary bases).
    defaults: tuple[tuple[str, Any], ...] = ()


COMMON = Family()

FAMILIES: dict[str, Family] = {
    # state-spaces/mamba-2.8b-hf, tiiuae/falcon-mamba-7b, mistralai/Mamba-Codestral-7B-v0.1,
    # RWKV/rwkv-4-169m-pile, NX-AI/xLSTM-7b.
    **dict.fromkeys(("mamba", "falcon_mamba", "mamba2", "rwkv", "xlstm"),
                    Family(no_attention=True)),
    "gemma2": Family(sliding_every=2),  # google/gemma-2-9b
    "gpt_oss": Family(sliding_every=2),  # openai/gpt-oss-20b
    "gemma3": Family(sliding_every=6),  # google/gemma-3-27b-it
    # transformers' Gemma3TextConfig defaults
    "gemma3_text": Family(sliding_every=6, defaults=(
        ("num_hidden_layers", 26), ("num_attention_heads", 8), ("num_key_value_heads", 4),
        ("head_dim", 256), ("max_position_embeddings", 131072), ("sliding_window", 4096),
        ("rope_theta", 1_000_000.0), ("rope_local_base_freq", 10_000.0),
        ("hidden_size", 2304), ("intermediate_size", 9216), ("vocab_size", 262_208))),
    "cohere2": Family(sliding_every=4),
    "gemma4": Family(global_widths=True),  # google/gemma-4
    "gemma4_text": Family(global_widths=True),
    # meituan-longcat/LongCat-Flash-Chat: two attention blocks in every decoder layer.
    "longcat_flash": Family(blocks_per_layer=2),
    # XiaomiMiMo/MiMo-V2-Flash: the window excludes the query; sliding layers keep twice the
    # KV heads (its attention builds them so).
    "mimo_v2_flash": Family(window_before_query=True, sliding_kv_scale=2),
    "falcon_h1": Family(state_in_every_layer=True),  # tiiuae/Falcon-H1-7B: attention + Mamba-2
    # google/recurrentgemma-2b: transformers' RG-LRU keeps its state in fp32.
    "recurrent_gemma": Family(state_bits=32),
}


def family(cfg: dict) -> Family:
    """The rules config.json's model_type reads by: its family's entry, else the common ones."""
    model_type = cfg.get("model_type")
    return FAMILIES.get(model_type, COMMON) if isinstance(model_type, str) else COMMON


# The decoder a multimodal wrapper builds from a text_config that names no model_type.
WRAPPED_TEXT_TYPES = {"gemma3": "gemma3_text", "gemma3n": "gemma3n_text",
                      "gemma4": "gemma4_text", "llama4": "llama4_text", "mistral3": "mistral",
                      "llava": "llama"}


def decoder_config(cfg: dict) -> dict:
    """The decoder's config as transformers builds it: a multimodal wrapper's text_config
    (its model_type the wrapper's text class where it names none), and what the family's
    config class fills in where config.json is silent (`Family.defaults`)."""
    if isinstance(cfg.get("text_config"), dict):
        outer, cfg = cfg.get("model_type"), cfg["text_config"]
        if "model_type" not in cfg and isinstance(outer, str) and outer in WRAPPED_TEXT_TYPES:
            cfg = {**cfg, "model_type": WRAPPED_TEXT_TYPES[outer]}
    return {**dict(family(cfg).defaults), **cfg}
