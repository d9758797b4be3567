"""The Python API: kvcache's cache kinds on any transformers model (docs/python-api.md).

    from kvcache_cli.hf import kv_cache
    cache = kv_cache(model, "int4:g32:kchan:r128")     # the CLI's spec grammar
    model.generate(input_ids, cache=cache, max_new_tokens=64)
    cache.bytes_held, cache.bytes_by_kind()            # total, and {'full': .., 'sliding': ..}

    model.set_attn_implementation("kvcache")           # each kind attends its own way:
    model.generate(input_ids, cache=kv_cache(model, "window:64"), max_new_tokens=64)

Using the bridge registers the "kvcache" attention with transformers (`attention`):
under it a quantised kind reads its codes through kvcache's C++ kernel instead of a
dequantised copy, and the kinds that evict (window, sink, h2o) or compress the prompt once
(snapkv, knorm, recent) mask by their keys' positions; they refuse to run under another.

The cache is built from the model's own layer types, as transformers' `DynamicCache` reads
them (`get_layer_types_and_kwargs`): the spec's kind on every full-attention layer, and on
a sliding (or chunked) layer transformers' own window (`sliding="model"`, exact, window - 1
tokens between steps) or the spec's kind holding every position under the model's band
(`sliding="full"`). The names load torch and transformers on first use (from `bridge`),
so `kvcache_cli.hf.load.read_hf_config` reads a model's config without them.
"""

from __future__ import annotations

import importlib

__all__ = ["kv_cache", "kvcache_attention", "ATTENTION", "BridgeCache", "BridgeLayer",
           "BridgeError", "CacheSpecError", "BRIDGE_KINDS", "SLIDING_CHOICES"]


def __getattr__(name: str):
    """Each public name from `hf.bridge` on first use: importing the package stays light."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module("kvcache_cli.hf.bridge"), name)
