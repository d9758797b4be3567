"""A config.json's layer types as the caches build them: full attention, or a sliding
window of W with the layer's own rotary base where the model has one.

The pattern and the window are read by `config.shape_from_config`, every spelling real
checkpoints use (`layer_types`, `sliding_window_pattern`, Qwen2's `use_sliding_window` and
`max_window_layers`, Mistral's lone `sliding_window`, ...); this adds the rotary bases per
layer type: transformers 5 keys `rope_parameters` by layer type (Gemma 3:
{"sliding_attention": {"rope_theta": 10000.0}, "full_attention": {"rope_theta": 1e6}}),
earlier Gemma 3 configs say `rope_local_base_freq` beside `rope_theta`.
"""

from __future__ import annotations

from typing import Any

from kvcache_cli.caches.base import LayerType
from kvcache_cli.sizing.config import shape_from_config
from kvcache_cli.sizing.families import decoder_config
from kvcache_cli.sizing.units import ConfigError

_TYPE_NAME = {"full": "full_attention", "sliding": "sliding_attention"}


def layer_types_from_hf(cfg: Any, name: str = "config.json") -> tuple[LayerType, ...]:
    """One LayerType per layer of a Hugging Face config dict; a ConfigError (one line) for
    a layer the caches do not build (chunked, latent, recurrent, none)."""
    shape = shape_from_config(cfg, name)
    other = sorted(set(shape.layer_kinds) - set(_TYPE_NAME))
    if other:
        raise ConfigError(f"{name}: {', '.join(other)} layers; the caches build full and "
                          "sliding attention layers only")
    bases = _rope_bases(decoder_config(cfg))
    return tuple(LayerType(shape.window if kind == "sliding" else None,
                           bases.get(_TYPE_NAME[kind]))
                 for kind in shape.layer_kinds)


def _rope_bases(cfg: dict) -> dict[str, float]:
    """The rotary base per layer type name where the config gives each its own; {} when
    every layer shares the model's one base (or there is none)."""
    params = cfg.get("rope_parameters")
    if params and isinstance(params, dict) and all(isinstance(v, dict) for v in params.values()):
        return {t: _base(p, "rope_theta", f"rope_parameters.{t}")
                for t, p in params.items() if "rope_theta" in p}
    if cfg.get("rope_local_base_freq") is not None and cfg.get("rope_theta") is not None:
        # google/gemma-3-270m as published (transformers 4): the local base for the
        # sliding layers, rope_theta for the global ones.
        return {"sliding_attention": _base(cfg, "rope_local_base_freq"),
                "full_attention": _base(cfg, "rope_theta")}
    return {}


def _base(cfg: dict, key: str, where: str = "") -> float:
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{where or key} is {value!r}; expected a positive rotary base")
    return float(value)
