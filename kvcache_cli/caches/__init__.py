"""The KV cache family: one interface, one module per kind, one registry of specs.

- `base`: the `KVCache` interface, every layer's attention (`attend`, then update, crop, ...);
- `step`: one forward's positions (`Step`), and attention by them: the masks every kind uses;
- `exact`: `ConcatCache` and `StaticCache`, every position at the model's precision;
- `hybrid`: `HybridCache`, a model's sliding layers in rings of their window and its
  full-attention layers in the spec's kind, one cache per group of layers;
- `paged`: `PagedCache`, blocks of a pool read through block tables (serve's pool);
- `spec`: the torch-free registry of kinds and the parser of spec strings
  (`static`, `paged:b16`, ...), shared by every command that names a cache.
"""

from __future__ import annotations

from importlib import import_module

from kvcache_cli.caches.base import CacheShape, KVCache, RollbackError, nbytes
from kvcache_cli.caches.grammar import CacheSpecError
from kvcache_cli.caches.spec import CacheSpec, parse_cache_spec

__all__ = ["KVCache", "RollbackError", "nbytes", "CacheSpec", "CacheSpecError",
           "parse_cache_spec", "make_cache", "cache_class", "MODES"]

# The generation modes by name (generate's loop, `kvcache generate --mode`): `naive`, no
# cache at all (make_cache gives None), or one of the two exact caches the article builds.
MODES = ("naive", "concat", "static")


# `make_cache(..., sliding=)`: a sliding layer's cache is a ring of its window ("model"),
# or the spec's kind holding every position under the same band ("full").
SLIDING_CHOICES = ("model", "full")


def cache_class(spec: CacheSpec) -> type[KVCache]:
    module, name = spec.info.factory.split(":")
    return getattr(import_module(module), name)


def make_cache(spec: str | CacheSpec, model, max_len: int, batch: int = 1,
               whole: bool = False, sliding: str = "model", spare: int = 0
               ) -> KVCache | None:
    """A fresh cache for `model` holding up to `max_len` positions of `batch` rows.

    `spec` is a parsed spec or its text (`static`, `paged:b16`, ...); `naive` means no
    cache at all (the loop that recomputes every position) and gives None. `whole`: a
    static cache read whole under a mask, one shape every step (for a compiled model).

    A model whose every layer attends in full gets the spec's kind itself. One with
    sliding layers gets a `HybridCache`: the spec's kind on the full-attention layers,
    and on each sliding layer a ring of its window (`sliding="model"`, exact; under a half
    kind, `fp16` or `bf16`, its numbers stored in 2 bytes too), or the spec's kind with the
    window kept as a band (`sliding="full"`, every position held).
    `spare`: slots each ring holds past its window (`window:W:kN`), so that it rolls back
    spare + 1 positions once it has wrapped (a speculative step's rejected tokens).
    """
    if sliding not in SLIDING_CHOICES:
        raise ValueError(f"sliding={sliding!r}: expected one of {', '.join(SLIDING_CHOICES)}")
    if isinstance(spec, str):
        if spec == "naive":
            return None
        spec = parse_cache_spec(spec)
    if hasattr(model, "make_cache"):  # a model that holds its own (hf.engine's transformers)
        return model.make_cache(spec, max_len, batch=batch, whole=whole, sliding=sliding)
    shape = model.config.cache_shape

    def make(kind: CacheSpec | None, layers: CacheShape) -> KVCache:
        built = dict(max_len=max_len, batch=batch, device=model.device, dtype=model.dtype,
                     whole=whole)
        if kind is None or kind is spec:
            return cache_class(spec).build(spec, layers, **built)
        # A sliding layer's ring: under a half kind its numbers are stored in the kind's 2
        # bytes too, as an engine's f16 cache stores its sliding layers.
        from kvcache_cli.caches.half import HALF_DTYPES

        return cache_class(kind).build(kind, layers, **built, store=HALF_DTYPES.get(spec.kind))

    if not shape.hybrid:
        return make(spec, shape)
    from kvcache_cli.caches.hybrid import HybridCache

    return HybridCache.build(make, shape, sliding=sliding, spare=spare)
