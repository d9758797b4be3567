"""The parameters transformers builds for a config.json, counted from the config alone:
what `size --gpu-mem` subtracts for the weights before it fits the cache."""

from __future__ import annotations

from kvcache_cli.sizing.config_fields import (
    HEAD_DIM_KEYS,
    HEAD_KEYS,
    HIDDEN_KEYS,
    LAYER_KEYS,
    first_int,
    read_kv_heads,
)
from kvcache_cli.sizing.families import decoder_config
from kvcache_cli.sizing.units import ConfigError

# Decoder families whose weights are counted from their config alone: every layer one
# attention block and one gated MLP (gate, up, down), RMSNorm weights, and the embedding
# tied to the LM head or not, as each family's configuration class defaults it.
_GATED_FAMILIES = {
    # model_type: (norms per layer, q/k/v biases, tied embeddings by default)
    "llama": (2, False, False),
    "mistral": (2, False, False),
    "qwen2": (2, True, False),  # Qwen2Attention: q, k and v have biases, o has none
    "gemma": (2, False, True),
    "gemma2": (4, False, True),  # pre- and post-norms around attention and the MLP
    "gemma3_text": (4, False, True),  # and QK-norm: a head's width of q and of k (below)
    "qwen3": (2, False, False),  # and QK-norm, as Gemma 3's
}
QK_NORM = ("gemma3_text", "qwen3")
# What a refusal says when the weights' size is unknown.
NEED_PARAMS = ("--gpu-mem needs the weights' size, which kvcache counts from a preset and from "
               "the config of a dense gpt2, llama, mistral, qwen2, qwen3, gemma, gemma2 or "
               "gemma3_text model only: expected --params N (e.g. --params 6.74B)")


def params_from_config(cfg: dict, where: str = "config.json") -> int | None:
    """The parameters transformers builds for `cfg`, or None for a family not counted here
    (mixtures of experts, state spaces, MLA: pass --params for those) or a config that
    lacks a width the count needs."""
    if isinstance(cfg.get("text_config"), dict):
        return None  # a multimodal wrapper: its vision tower's weights are not counted here
    try:
        return _count_params(decoder_config(cfg), where)  # with its class's defaults
    except ConfigError:
        return None


def _count_params(cfg: dict, where: str) -> int | None:
    model_type = cfg.get("model_type")
    if model_type == "gpt2":
        return _gpt2_params(cfg, where)
    if model_type not in _GATED_FAMILIES:
        return None
    norms, qkv_bias, tied = _GATED_FAMILIES[model_type]
    hidden = first_int(cfg, HIDDEN_KEYS, where)
    heads = first_int(cfg, HEAD_KEYS, where)
    kv_heads = read_kv_heads(cfg, heads, where)
    head_dim = (first_int(cfg, HEAD_DIM_KEYS, where, required=False) or hidden // heads)
    inner = first_int(cfg, ("intermediate_size",), where)
    vocab = first_int(cfg, ("vocab_size",), where)
    layers = first_int(cfg, LAYER_KEYS, where)
    q, kv = heads * head_dim, kv_heads * head_dim
    bias = (q + 2 * kv) * (qkv_bias or bool(cfg.get("attention_bias")))
    attention = hidden * (q + 2 * kv) + q * hidden + bias
    layer = attention + 3 * hidden * inner + norms * hidden
    if model_type in QK_NORM:
        layer += 2 * head_dim
    tie = cfg.get("tie_word_embeddings", tied)
    return vocab * hidden * (1 if tie else 2) + layers * layer + hidden


def _gpt2_params(cfg: dict, where: str) -> int:
    # openai-community/gpt2: learned positions, LayerNorms with biases, Conv1D weights with
    # biases, a 4 × n_embd MLP unless n_inner says otherwise; the LM head is the embedding.
    hidden = first_int(cfg, ("n_embd",), where)
    inner = first_int(cfg, ("n_inner",), where, required=False) or 4 * hidden
    layer = (2 * hidden + hidden * 3 * hidden + 3 * hidden + hidden * hidden + hidden
             + 2 * hidden + hidden * inner + inner + inner * hidden + hidden)
    return (first_int(cfg, ("vocab_size",), where) * hidden
            + first_int(cfg, ("n_positions",), where) * hidden
            + first_int(cfg, ("n_layer",), where) * layer + 2 * hidden)
