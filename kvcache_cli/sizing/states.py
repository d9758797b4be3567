"""The recurrent state of layers that keep one instead of (or beside) a KV cache: one rule
per family (Mamba 1 and 2, gated DeltaNet, lightning attention, RG-LRU, short convolutions
...), each giving the state's widths from the config."""

from __future__ import annotations

from collections.abc import Callable

from kvcache_cli.sizing.config_fields import (
    HEAD_KEYS,
    HIDDEN_KEYS,
    KV_HEAD_KEYS,
    first_int,
    read_int,
)
from kvcache_cli.sizing.units import ConfigError


def _get(cfg: dict, where: str, *keys: str, default: int | None = None) -> int:
    for key in keys:
        if cfg.get(key) is not None:
            return read_int(cfg, key, where)
    if default is not None:
        return default
    raise ConfigError(f"{where}: no {keys[0]} (expected one of {', '.join(keys)}) for the "
                      "recurrent layers' state")


def _hidden(cfg: dict, where: str) -> int:
    return _get(cfg, where, *HIDDEN_KEYS)


def _mamba1_state(cfg: dict, where: str) -> tuple[int, int]:
    # state-spaces/mamba-2.8b-hf, tiiuae/falcon-mamba-7b, ai21labs/Jamba-v0.1 (mamba_ prefix):
    # a conv over the last d_conv inputs and a d_state-wide state per channel.
    expand = _get(cfg, where, "mamba_expand", "expand", default=2)
    channels = _get(cfg, where, "intermediate_size", default=expand * _hidden(cfg, where)) \
        if cfg.get("model_type") != "jamba" else expand * _hidden(cfg, where)
    conv = _get(cfg, where, "mamba_d_conv", "conv_kernel", default=4)
    state = _get(cfg, where, "mamba_d_state", "state_size", default=16)
    return channels * conv, channels * state


def _mamba2_state(cfg: dict, where: str) -> tuple[int, int]:
    # mistralai/Mamba-Codestral-7B-v0.1, ibm-ai-platform/Bamba-9B, nvidia/Nemotron-H-8B,
    # tiiuae/Falcon-H1-7B, ibm-granite/granite-4.0-h-small, Zyphra/Zamba2-2.7B: the conv runs
    # over x, B and C together; the state is heads × head_dim × d_state.
    state = _get(cfg, where, "mamba_d_state", "ssm_state_size", "state_size")
    groups = _get(cfg, where, "mamba_n_groups", "mamba_ngroups", "n_groups", default=1)
    head_dim = _get(cfg, where, "mamba_d_head", "mamba_head_dim", "mamba_headdim", "head_dim")
    if any(cfg.get(k) is not None for k in ("mamba_n_heads", "mamba_num_heads", "num_heads")):
        heads = _get(cfg, where, "mamba_n_heads", "mamba_num_heads", "num_heads")
    else:
        expand = _get(cfg, where, "mamba_expand", "expand", default=2)
        heads = expand * _hidden(cfg, where) // head_dim
    channels = heads * head_dim
    if cfg.get("mamba_d_ssm") is not None:  # Falcon-H1 sets the inner width directly
        channels = read_int(cfg, "mamba_d_ssm", where)
    conv = _get(cfg, where, "mamba_d_conv", "conv_kernel")
    return (channels + 2 * groups * state) * conv, heads * head_dim * state


def _gated_deltanet_state(cfg: dict, where: str) -> tuple[int, int]:
    # Qwen/Qwen3-Next-80B-A3B-Instruct: a conv over q, k and v, and a key × value state per
    # value head.
    key_heads = _get(cfg, where, "linear_num_key_heads")
    value_heads = _get(cfg, where, "linear_num_value_heads")
    key_dim = _get(cfg, where, "linear_key_head_dim")
    value_dim = _get(cfg, where, "linear_value_head_dim")
    conv = _get(cfg, where, "linear_conv_kernel_dim")
    width = 2 * key_heads * key_dim + value_heads * value_dim
    return width * conv, value_heads * key_dim * value_dim


def _delta_attention_state(cfg: dict, where: str) -> tuple[int, int]:
    # moonshotai/Kimi-Linear-48B-A3B-Instruct, inclusionAI/Ring-mini-linear-2.0: separate short
    # convs over q, k and v, and a head_dim × head_dim state per head.
    heads = _get(cfg, where, "linear_num_heads")
    head_dim = _get(cfg, where, "linear_head_dim")
    conv = _get(cfg, where, "linear_conv_kernel_dim")
    return 3 * heads * head_dim * conv, heads * head_dim * head_dim


def _lightning_state(cfg: dict, where: str) -> tuple[int, int]:
    # MiniMaxAI/MiniMax-Text-01: lightning attention keeps one head_dim × head_dim state per
    # attention head, and no convolution.
    heads = first_int(cfg, HEAD_KEYS, where)
    head_dim = first_int(cfg, ("head_dim",), where, required=False) or (
        first_int(cfg, HIDDEN_KEYS, where) // heads)
    return 0, heads * head_dim * head_dim


def _cca_state(cfg: dict, where: str) -> tuple[int, int]:
    # Zyphra/ZAYA1-base: compressed convolutional attention convolves q and k over the last
    # (cca_time0 − 1) + (cca_time1 − 1) steps, and delays half the value width by one token.
    heads = first_int(cfg, HEAD_KEYS, where)
    kv_heads = first_int(cfg, KV_HEAD_KEYS, where, required=False) or heads
    head_dim = first_int(cfg, ("head_dim",), where, required=False) or (
        first_int(cfg, HIDDEN_KEYS, where) // heads)
    steps = _get(cfg, where, "cca_time0", default=2) - 1 + _get(cfg, where, "cca_time1",
                                                                 default=2) - 1
    return (heads + kv_heads) * head_dim * steps, kv_heads * head_dim // 2


def _rglru_state(cfg: dict, where: str) -> tuple[int, int]:
    # google/recurrentgemma-2b: a convolution over the last conv1d_width − 1 inputs and one
    # RG-LRU state, both lru_width wide (the state in fp32, see _state_bits).
    width = _get(cfg, where, "lru_width", *HIDDEN_KEYS)
    return width * (_get(cfg, where, "conv1d_width", default=4) - 1), width


def _short_conv_state(cfg: dict, where: str) -> tuple[int, int]:
    # LiquidAI/LFM2-1.2B: a short convolution over the last conv_L_cache inputs, no SSM state.
    return _hidden(cfg, where) * _get(cfg, where, "conv_L_cache"), 0


_MAMBA2_TYPES = {"mamba2", "bamba", "nemotron_h", "falcon_h1", "granitemoehybrid", "zamba2"}


def state_rule(cfg: dict) -> Callable[[dict, str], tuple[int, int]] | None:
    model_type = cfg.get("model_type")
    if model_type in _MAMBA2_TYPES:
        return _mamba2_state
    if model_type in ("mamba", "falcon_mamba", "jamba"):
        return _mamba1_state
    if cfg.get("linear_num_value_heads") is not None:
        return _gated_deltanet_state
    if cfg.get("linear_num_heads") is not None:
        return _delta_attention_state
    if cfg.get("conv_L_cache") is not None:
        return _short_conv_state
    if model_type == "minimax":
        return _lightning_state
    if model_type == "zaya":
        return _cca_state
    if model_type == "recurrent_gemma":
        return _rglru_state
    return None
