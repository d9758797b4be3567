"""How a config.json's numbers are read: the spellings real configs use for each one (the
first present wins), and readers that refuse a missing, non-integer or out-of-range
value in one line naming the key."""

from __future__ import annotations

from typing import Any

from kvcache_cli.sizing.units import ConfigError, shown

# Real configs spell the same number several ways; the first present wins.
# decoder_layers / decoder_attention_heads: TrOCR's decoder (microsoft/trocr-base-handwritten).
LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers")

# attention_heads: XGLM (facebook/xglm-564M).
HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads",
              "decoder_attention_heads")

# multi_query_group_num: ChatGLM (THUDM/chatglm3-6b), 2 KV groups for 32 heads.
KV_HEAD_KEYS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_head_kv",
                 "multi_query_group_num")

# attention_head_dim: Zamba2 (Zyphra/Zamba2-2.7B), whose shared attention block is twice the
# model's width and which also carries a kv_channels of half that; kv_channels: ChatGLM
# (THUDM/chatglm3-6b).
HEAD_DIM_KEYS = ("head_dim", "attention_head_dim", "kv_channels")

HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model", "dim")

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len")

MAX_WIDTH = 2**24  # any one width (hidden, state, window...) in a config


def read_int(cfg: dict, key: str, where: str, low: int = 1, high: int = MAX_WIDTH) -> int:
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: {key} is {shown(value)}; expected a whole number")
    if not low <= value <= high:
        raise ConfigError(f"{where}: {key} is {shown(value)}; expected a whole number from "
                          f"{low:,} to {high:,}")
    return value


def first_int(cfg: dict, keys: tuple[str, ...], where: str, required: bool = True,
               high: int = MAX_WIDTH) -> int | None:
    for key in keys:
        if cfg.get(key) is not None:
            return read_int(cfg, key, where, high=high)
    if required:
        raise ConfigError(f"{where}: no {keys[0]} (expected one of {', '.join(keys)})")
    return None


def int_list(cfg: dict, key: str, where: str, high: int) -> list[int]:
    value = cfg[key]
    if not isinstance(value, list):
        raise ConfigError(f"{where}: {key} is {shown(value)}; expected a list of layer "
                          "indices")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item <= high:
            raise ConfigError(f"{where}: {key} holds {shown(item)}; expected layer indices from 0 "
                              f"to {high}")
    return value


def layer_names(value: Any, key: str, layers: int, where: str) -> list[str]:
    if not isinstance(value, list) or len(value) != layers:
        got = f"{len(value)} entries" if isinstance(value, list) else shown(value)
        raise ConfigError(f"{where}: {key} has {got}; expected a list of {layers}, one per layer")
    for name in value:
        if not isinstance(name, str):
            raise ConfigError(f"{where}: {key} holds {shown(name)}; expected layer type names")
    return value


def read_kv_heads(cfg: dict, heads: int, where: str) -> int:
    nested = cfg.get("attn_config")
    if isinstance(nested, dict) and nested.get("kv_n_heads") is not None:
        # databricks/dbrx-base: attn_config.kv_n_heads 8 under 48 heads.
        return read_int(nested, "kv_n_heads", f"{where} attn_config", high=heads)
    if cfg.get("new_decoder_architecture"):
        # tiiuae/falcon-40b: num_kv_heads 8, although multi_query is also true.
        return first_int(cfg, ("num_kv_heads", "num_key_value_heads"), where, required=False,
                          high=heads) or heads
    if cfg.get("multi_query"):  # bigcode/starcoder, tiiuae/falcon-7b: one K/V head
        return 1
    return first_int(cfg, KV_HEAD_KEYS, where, required=False, high=heads) or heads
