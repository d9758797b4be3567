"""kv_cache: a transformers `Cache` for a model, its layers kvcache's cache kinds.

The cache is built from the model's own layer types, as transformers' `DynamicCache` reads
them (`get_layer_types_and_kwargs`): the spec's kind on every full-attention layer, and on
a sliding (or chunked) layer transformers' own window (`sliding="model"`, exact, window - 1
tokens between steps; under a half kind, `fp16` or `bf16`, stored in its 2 bytes too) or the
spec's kind holding every position under the model's band (`sliding="full"`). Importing
this module registers the "kvcache" attention (`attention`).
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    DynamicSlidingWindowLayer,
    get_layer_types_and_kwargs,
)

from kvcache_cli.caches import SLIDING_CHOICES, CacheSpec, CacheSpecError, parse_cache_spec
from kvcache_cli.caches.half import HALF_DTYPES
from kvcache_cli.hf.attention import kvcache_attention
from kvcache_cli.hf.layers import ATTENTION, BridgeCache, BridgeError, BridgeLayer

# What `kvcache_cli.hf` re-exports (the attention registers itself as it is imported).
__all__ = ["kv_cache", "kvcache_attention", "ATTENTION", "BridgeCache", "BridgeLayer",
           "BridgeError", "CacheSpecError", "BRIDGE_KINDS", "SLIDING_CHOICES"]

# The kinds a transformers model can hold: those whose `update` returns every position in
# order (the exact ones; the half-precision and quantised ones, their history widened or
# dequantised), and those that evict or compress, which run under the kvcache attention.
BRIDGE_KINDS = ("static", "concat", "paged", "fp16", "bf16", "int8", "int4", "int2",
                "fp8-e4m3", "fp8-e5m2", "window", "sink", "h2o", "snapkv", "knorm", "recent")
# Kinds that allocate max_len positions up front (a compressed prompt: room for every later
# token): a model's whole context would be too many.
_ALLOCATES = ("static", "paged", "fp16", "bf16", "snapkv", "knorm", "recent")
# transformers' layer types the bridge builds, and the layer kind bytes are reported under.
_KIND = {"full_attention": "full", "sliding_attention": "sliding",
         "chunked_attention": "sliding", "dummy": "none"}


def kv_cache(model, spec: str | CacheSpec = "concat", *, max_len: int | None = None,
             sliding: str = "model") -> BridgeCache:
    """A transformers `Cache` for `model` (a loaded transformers model, or its config) whose
    attention layers hold keys and values in kvcache's kind `spec` (`"int8"`,
    `"int4:g32:kchan:r128"`, `"fp8:head"`, ...; the grammar of `kvcache caches`).

    max_len: the most positions the cache will hold; required by `static` and `paged`,
    which allocate them up front, else the model's context. sliding: `"model"` keeps each
    sliding layer in transformers' own window (exact; a half kind's in its 2 bytes),
    `"full"` puts the spec's kind there too. Raises CacheSpecError for a malformed spec and
    BridgeError for a kind or a model the bridge cannot serve (linear attention, state-space
    or indexer layers, latent attention), each one line. The kinds that evict or compress
    run only under the kvcache attention (`model.set_attn_implementation("kvcache")`), the
    quantised ones read their codes in place under it.
    """
    if sliding not in SLIDING_CHOICES:
        raise BridgeError(f"sliding={sliding!r}: expected one of {', '.join(SLIDING_CHOICES)}")
    if isinstance(spec, str):
        spec = parse_cache_spec(spec)
    if spec.kind not in BRIDGE_KINDS:
        raise BridgeError(f"cache {str(spec)!r}: the bridge holds {', '.join(BRIDGE_KINDS)}; "
                          "serve's block pools and the peers are not transformers cache layers")
    refuse_across_layers(spec)
    if spec.kind in _ALLOCATES and max_len is None:
        raise BridgeError(f"cache {str(spec)!r} allocates max_len positions up front: pass "
                          "max_len (prompt + new tokens)")
    config = getattr(model, "config", model).get_text_config(decoder=True)
    name = getattr(config, "model_type", None) or type(config).__name__
    if getattr(config, "kv_lora_rank", None) is not None:
        raise BridgeError(f"{name}: multi-head latent attention (its latent, or its "
                          "decompressed keys wider than its values); the bridge holds "
                          "full and sliding attention layers only")
    # Read head_dim only beside v_head_dim: Gemma 4's config refuses a per-layer field read whole.
    values = getattr(config, "v_head_dim", None)
    keys = getattr(config, "head_dim", None) if values is not None else None
    if None not in (keys, values) and keys != values:  # MiMo-V2-Flash: 192 and 128
        raise BridgeError(f"{name}: keys {keys} wide and values {values} wide; kvcache's "
                          "caches hold keys and values of one width")
    types, per_layer = get_layer_types_and_kwargs(config)
    other = sorted(set(types) - set(_KIND))
    if other:
        raise BridgeError(f"{name}: {', '.join(other)} layers; the bridge holds full and "
                          "sliding attention layers only")
    if max_len is None:
        max_len = getattr(config, "max_position_embeddings", None) or 1 << 20
    layers = []
    for kind, kwargs in zip(types, per_layer, strict=True):
        window = kwargs.get("sliding_window")
        if kind == "dummy":  # a layer that reads another's cache, or has no attention
            layers.append(DYNAMIC_LAYER_TYPE_MAPPING["dummy"]())
        elif window is not None and sliding == "model":
            store = HALF_DTYPES.get(spec.kind)
            layers.append(DynamicSlidingWindowLayer(sliding_window=window) if store is None
                          else HalfSlidingWindowLayer(window, store))
        else:
            layers.append(BridgeLayer(spec, max_len, window, config=config,
                                      index=len(layers)))
    return BridgeCache(layers, tuple(_KIND[t] for t in types), spec)


def refuse_across_layers(spec: CacheSpec) -> None:
    """Refuse (one line) what a cache of one layer cannot do: the bridge builds one per
    layer, each from the keys transformers rotated before the cache."""
    params = dict(spec.params)
    if params.get("positions") == "rerotate":
        raise BridgeError(f"cache {str(spec)!r}: rerotate turns kept keys to new positions "
                          "with the model's rotary embedding, which transformers applies "
                          "inside each model's attention (its layout, partial rotation and "
                          "scaling), out of a cache's reach: drop :rerotate (text positions)")
    if params.get("layers") == "pyramid":
        raise BridgeError(f"cache {str(spec)!r}: pyramid shares one budget across the "
                          "layers by depth; the bridge builds each layer's cache alone: "
                          "drop :pyramid (the same budget in every layer)")


class HalfSlidingWindowLayer(DynamicSlidingWindowLayer):
    """transformers' sliding-window layer with its window stored in a half kind's 2 bytes a
    number (`fp16`, `bf16`), as that kind stores the full-attention layers and an engine's
    f16 cache its sliding ones: each key and value rounded once, as it is stored, and what
    `update` returns widened back to the model's dtype."""

    def __init__(self, sliding_window: int, store: torch.dtype):
        super().__init__(sliding_window=sliding_window)
        self.store = store

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs
               ) -> tuple[Tensor, Tensor]:
        keys, values = super().update(key_states.to(self.store), value_states.to(self.store),
                                      *args, **kwargs)
        return keys.to(key_states.dtype), values.to(value_states.dtype)
