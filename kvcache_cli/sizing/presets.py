"""Presets: real models by name or Hub id, each a config.json excerpt read by the same reader
as --config; and `resolve_shape`, which picks the one source of a shape a command was given."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvcache_cli.sizing.arithmetic import values_per_token
from kvcache_cli.sizing.config import load_config, shape_from_config
from kvcache_cli.sizing.shape import ModelShape, shape_from_flags
from kvcache_cli.sizing.units import (
    DTYPE_BITS,
    SizingError,
    bytes_for_values,
    canonical_dtype,
    nearest,
)


@dataclass(frozen=True)
class Preset:
    """A real model: its Hub id, published parameter count, and the config.json fields that
    matter (copied from the model's own config, so the preset goes through the same reader as
    --config)."""

    name: str
    hf_id: str
    params: int  # total parameters in the published checkpoint (safetensors metadata)
    config: dict = field(hash=False)

    @property
    def shape(self) -> ModelShape:
        return replace(
            shape_from_config(self.config, self.name, self.params), source=self.hf_id
        )


def _gpt2(size: str, layers: int, heads: int, width: int, params: int) -> Preset:
    name = "gpt2" if size == "small" else f"gpt2-{size}"
    config = {
        "model_type": "gpt2",
        "n_layer": layers,
        "n_head": heads,
        "n_embd": width,
        "n_positions": 1024,
        "vocab_size": 50257,
    }
    return Preset(name, f"openai-community/{name}", params, config)


def _llama(name: str, hf_id: str, params: int, layers: int, heads: int, kv: int, hidden: int,
           ffn: int, vocab: int, context: int, **extra: Any) -> Preset:
    config = {
        "model_type": "llama",
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "vocab_size": vocab,
        "max_position_embeddings": context,
        **extra,
    }
    return Preset(name, hf_id, params, config)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        _gpt2("small", 12, 12, 768, 124_439_808),
        _gpt2("medium", 24, 16, 1024, 354_823_168),
        _gpt2("large", 36, 20, 1280, 774_030_080),
        _gpt2("xl", 48, 25, 1600, 1_557_611_200),
        _llama("llama-2-7b", "meta-llama/Llama-2-7b-hf", 6_738_415_616,
               32, 32, 32, 4096, 11008, 32000, 4096),
        _llama("llama-2-13b", "meta-llama/Llama-2-13b-hf", 13_015_864_320,
               40, 40, 40, 5120, 13824, 32000, 4096),
        _llama("llama-2-70b", "meta-llama/Llama-2-70b-hf", 68_976_648_192,
               80, 64, 8, 8192, 28672, 32000, 4096),
        _llama("llama-3-8b", "meta-llama/Meta-Llama-3-8B", 8_030_261_248,
               32, 32, 8, 4096, 14336, 128256, 8192),
        _llama("llama-3-70b", "meta-llama/Meta-Llama-3-70B", 70_553_706_496,
               80, 64, 8, 8192, 28672, 128256, 8192),
        _llama("llama-3.1-405b", "meta-llama/Llama-3.1-405B", 405_853_388_800,
               126, 128, 8, 16384, 53248, 128256, 131072),
        # v0.1 is the model of the Mistral paper: every layer attends over a 4,096-token
        # window, so its cache stops growing there (the rolling buffer).
        _llama("mistral-7b", "mistralai/Mistral-7B-v0.1", 7_241_732_096,
               32, 32, 8, 4096, 14336, 32000, 32768, model_type="mistral", sliding_window=4096),
        _llama("mistral-7b-v0.3", "mistralai/Mistral-7B-v0.3", 7_248_023_552,
               32, 32, 8, 4096, 14336, 32768, 32768, model_type="mistral", sliding_window=None),
        # Qwen2.5 ships a sliding_window value with use_sliding_window false: all layers full.
        _llama("qwen2.5-7b", "Qwen/Qwen2.5-7B", 7_615_616_512,
               28, 28, 4, 3584, 18944, 152064, 131072, model_type="qwen2",
               use_sliding_window=False, sliding_window=131072, max_window_layers=28,
               tie_word_embeddings=False),
        # Gemma-2: head_dim 256 although 3584 / 16 = 224; layers alternate between a
        # 4,096-token sliding window and global attention (transformers derives the pattern).
        _llama("gemma-2-9b", "google/gemma-2-9b", 9_241_705_984,
               42, 16, 8, 3584, 14336, 256000, 8192, model_type="gemma2", head_dim=256,
               sliding_window=4096),
        # Gemma 3: one KV head of 256 (MQA); 15 of 18 layers attend over a window of 512,
        # every 6th over everything, each kind with its rotary base. `-m gemma3` runs it.
        _llama("gemma-3-270m", "google/gemma-3-270m", 268_098_176,
               18, 4, 1, 640, 2048, 262144, 32768, model_type="gemma3_text", head_dim=256,
               sliding_window=512, layer_types=[
                   "full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                   for i in range(18)],
               rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
               query_pre_attn_scalar=256, tie_word_embeddings=True),
        # No attention at all: 0 bytes of KV cache, and a 13 MB (fp16) state per sequence,
        # 64 layers × 5,120 channels × (4 conv + 16 SSM) values, whatever the length.
        Preset("mamba-2.8b", "state-spaces/mamba-2.8b-hf", 2_768_345_600, {
            "model_type": "mamba",
            "num_hidden_layers": 64,
            "hidden_size": 2560,
            "intermediate_size": 5120,
            "state_size": 16,
            "conv_kernel": 4,
            "expand": 2,
            "time_step_rank": 160,
            "vocab_size": 50280,
            "tie_word_embeddings": True,
        }),
        # Hybrid: one attention layer in every 8 (4 of 32 hold KV), Mamba in the other 28.
        Preset("jamba-v0.1", "ai21labs/Jamba-v0.1", 51_570_323_328, {
            "model_type": "jamba",
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "attn_layer_period": 8,
            "attn_layer_offset": 4,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
            "num_experts": 16,
            "num_experts_per_tok": 2,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "mamba_dt_rank": 256,
            "vocab_size": 65536,
            "max_position_embeddings": 262144,
            "tie_word_embeddings": False,
        }),
        # MLA: each layer caches a 512-wide latent plus a 64-wide rotary key, for all 128 heads.
        Preset("deepseek-v3", "deepseek-ai/DeepSeek-V3", 671_026_419_200, {
            "model_type": "deepseek_v3",
            "num_hidden_layers": 61,
            "num_attention_heads": 128,
            "num_key_value_heads": 128,
            "hidden_size": 7168,
            "kv_lora_rank": 512,
            "q_lora_rank": 1536,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128,
            "v_head_dim": 128,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "first_k_dense_replace": 3,
            "n_group": 8,
            "topk_group": 4,
            "vocab_size": 129280,
            "max_position_embeddings": 163840,
        }),
    )
}

_PRESET_ALIASES = {p.hf_id.lower(): p.name for p in PRESETS.values()} | {
    p.hf_id.split("/")[-1].lower(): p.name for p in PRESETS.values()
}


def preset(name: str) -> Preset:
    """A preset by name ('llama-2-7b') or Hub id ('meta-llama/Llama-2-7b-hf'), any case."""
    key = name.lower()
    key = _PRESET_ALIASES.get(key, key)
    if key not in PRESETS:
        raise SizingError(
            f"unknown model {name!r}: expected a preset name (see 'kvcache models')"
            + nearest(name, list(PRESETS))
        )
    return PRESETS[key]


def resolve_shape(
    model: str | None = None,
    config: str | Path | None = None,
    layers: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    heads: int | None = None,
    params: int | None = None,
) -> tuple[ModelShape, dict[str, Any]]:
    """One shape from exactly one source: a preset, a config.json, or the shape flags.

    Returns the shape and the config dict that `verify_cache` builds the model from.
    """
    flags = {"--layers": layers, "--kv-heads": kv_heads, "--head-dim": head_dim, "--heads": heads}
    given = [flag for flag, value in flags.items() if value is not None]
    if model is not None and config is not None:
        raise SizingError("--model and --config both given: expected one source for the shape")
    if model is not None or config is not None:
        source = "--model" if model is not None else "--config"
        if given:
            raise SizingError(
                f"{', '.join(given)} cannot be combined with {source}: expected the shape "
                f"from {source} or from flags, not both"
            )
    if model is not None:
        chosen = preset(model)
        shape = chosen.shape
        if params is not None:
            shape = replace(shape, params=params)
        return shape, dict(chosen.config)
    if config is not None:
        cfg = load_config(config)
        return shape_from_config(cfg, str(config), params), cfg
    if layers is None:
        raise SizingError("no model shape: expected --model NAME, --config PATH, or --layers N "
                          "with --kv-heads N")
    shape, cfg = shape_from_flags(layers, kv_heads, head_dim, heads)
    return replace(shape, params=params), cfg


@dataclass(frozen=True)
class ModelRow:
    """One preset as `kvcache models` lists it."""

    name: str
    hf_id: str
    params: int
    shape: ModelShape
    dtype: str
    bytes_per_token: int  # whole model, at `dtype`


def list_models(dtype: str = "fp16") -> tuple[ModelRow, ...]:
    """Every preset with its cache per token at `dtype`."""
    dtype = canonical_dtype(dtype)
    rows = []
    for p in PRESETS.values():
        shape = p.shape
        per_token = sum(
            g.layers * bytes_for_values(values_per_token(g.shape, g.kind), DTYPE_BITS[dtype])
            for g in shape.layer_groups()
        )
        rows.append(ModelRow(p.name, p.hf_id, p.params, shape, dtype, per_token))
    return tuple(rows)

