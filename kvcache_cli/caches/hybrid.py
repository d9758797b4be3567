"""A cache per layer kind: a hybrid model's sliding layers in rings of their window, its
full-attention layers in the kind the spec names.

Most layers of the models released since 2024 attend over a sliding window (Gemma 2/3,
GPT-OSS, Mistral): only the full-attention layers grow with the context. `HybridCache`
holds each group of layers that cache alike in one cache of its own, built for just those
layers, and routes every per-layer call to it with the layer's index within the group:

- a sliding layer of window W: `window:W`, a ring of W slots (`caches.bounded.RingCache`).
  The window is the model's own definition (the query at p sees p - W + 1 .. p, what
  transformers' sliding layers and vLLM's `SlidingWindowSpec` compute), so the ring is
  exact, not a cut: nothing it forgets would have been attended;
- a full-attention layer: the spec's kind (`static`, `int8`, `sink:4+252`, ...);
- `sliding="full"` gives the sliding layers the spec's kind too, with their band kept
  (`BandedCache`): the same output, every position held, the waste in `bytes_by_kind`.

vLLM's hybrid KV-cache manager groups layers the same way (one group per attention spec);
transformers' `DynamicCache(config=...)` builds a sliding layer per sliding type.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from kvcache_cli.caches.base import CacheShape, ForwardingCache, KVCache
from kvcache_cli.caches.spec import parse_cache_spec
from kvcache_cli.caches.step import Step


def layer_groups(shape: CacheShape, sliding: str) -> dict[int | None, list[int]]:
    """The layers of each group that caches alike, in layer order, keyed by their window
    (a ring of it), or None for the layers that take the spec's kind. A layer's rotary
    base plays no part: a cache stores keys already rotated."""
    groups: dict[int | None, list[int]] = {}
    for i, t in enumerate(shape.layer_types):
        groups.setdefault(t.window if sliding == "model" else None, []).append(i)
    return groups


class HybridCache(KVCache):
    """One cache per group of layers (`layer_groups`), each built for its layers only; a
    thin router: every per-layer call goes to the layer's cache, with its index there.

    `crop` and `reset` go to every cache; `length` is the tokens seen (layer 0's cache
    counts them); `bytes_held` and `bytes_copied` are the sums, `bytes_by_kind` the held
    bytes per layer kind ('full', 'sliding').
    """

    def __init__(self, shape: CacheShape, caches: dict[int | None, KVCache],
                 groups: dict[int | None, list[int]]):
        self.shape = shape
        self.caches = list(caches.values())
        route = {layer: (caches[key], j) for key, layers in groups.items()
                 for j, layer in enumerate(layers)}
        self._route = [route[i] for i in range(shape.n_layer)]  # layer -> cache, index there
        self._count = {id(caches[key]): len(layers) for key, layers in groups.items()}

    @classmethod
    def build(cls, make, shape: CacheShape, *, sliding: str, spare: int = 0) -> HybridCache:
        """`make(spec, shape)` builds a kind for the shape of some layers: spec None is
        the spec the model's cache was asked for; the rings are `window:W`, with `spare`
        slots more (`window:W:kN`: the band is still W) where a rollback needs them."""
        groups = layer_groups(shape, sliding)
        caches: dict[int | None, KVCache] = {}
        for window, layers in groups.items():
            sub = replace(shape, n_layer=len(layers),
                          layer_types=tuple(shape.layer_types[i] for i in layers))
            # A window as long as the context never evicts: a ring of the context then.
            ring = None if window is None else parse_cache_spec(
                f"window:{min(window, shape.context)}" + (f":k{spare}" if spare else ""))
            caches[window] = make(ring, sub)
        if sliding == "full":
            caches[None] = BandedCache(caches[None],
                                       [shape.layer_types[i].window for i in groups[None]])
        return cls(shape, caches, groups)

    def cache_of(self, layer: int) -> tuple[KVCache, int]:
        """The cache holding `layer`, and the layer's index in it."""
        return self._route[layer]

    # Per-layer calls: the layer's own cache, with the layer's index there; each cache
    # applies its own mask (a ring its window's band).
    def update(self, layer: int, start_pos: int | Tensor, k: Tensor, v: Tensor
               ) -> tuple[Tensor, Tensor]:
        cache, i = self._route[layer]
        return cache.update(i, start_pos, k, v)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, step: Step) -> Tensor:
        cache, i = self._route[layer]
        return cache.attend(i, q, k, v, step)

    def key_positions(self, layer: int) -> Tensor | None:
        cache, i = self._route[layer]
        return cache.key_positions(i)

    def observe(self, layer: int, weights: Tensor) -> None:
        cache, i = self._route[layer]
        cache.observe(i, weights)

    @property
    def wants_attention(self) -> bool:
        # Read before a layer's first call: true if any cache ranks by attention (H2O on
        # the full layers); the others then receive weights they ignore.
        return any(c.wants_attention for c in self.caches)

    def crop(self, length: int) -> None:
        for cache in self.caches:
            cache.crop(length)

    def reset(self) -> None:
        for cache in self.caches:
            cache.reset()

    @property
    def length(self) -> int:
        return self._route[0][0].length

    @property
    def whole(self) -> bool:
        """Every cache built for a compiled decode step (`generate.CompiledDecode`)."""
        return all(c.whole for c in self.caches)

    def advance(self, start_pos: int, T: int) -> None:
        """Record a compiled or replayed step's writes in every cache."""
        for cache in self.caches:
            cache.advance(start_pos, T)

    def buffers(self) -> list[Tensor] | None:
        """Every cache's buffers, in turn, where each has them (`KVCache.buffers`)."""
        each = [c.buffers() for c in self.caches]
        return None if None in each else [t for held in each for t in held]

    @property
    def bytes_held(self) -> int:
        return sum(c.bytes_held for c in self.caches)

    @property
    def bytes_copied(self) -> int:
        return sum(c.bytes_copied for c in self.caches)

    def bytes_by_kind(self) -> dict[str, int]:
        """Bytes held per layer kind, {'full': ..., 'sliding': ...} for the kinds present:
        a cache's bytes shared out over its layers evenly (each holds the same slots)."""
        held: dict[str, int] = {}
        for layer, t in enumerate(self.shape.layer_types):
            cache, _ = self._route[layer]
            share = cache.bytes_held // self._count[id(cache)]
            held[t.kind] = held.get(t.kind, 0) + share
        return held


class BandedCache(ForwardingCache):
    """A cache of every position given its layers' sliding bands (`sliding="full"`): the
    sliding layers' output unchanged, their full history held. `windows[i]` is layer i's
    band, None for a full-attention layer, which reads through the kind's own `attend`."""

    def __init__(self, inner: KVCache, windows: list[int | None]):
        super().__init__(inner)
        self.windows = windows

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, step: Step) -> Tensor:
        band = self.windows[layer]
        if band is None:
            return self.inner.attend(layer, q, k, v, step)
        keys, values = self.inner.update(layer, step.start, k, v)  # (B, nkv, S, hs)
        held = self.inner.key_positions(layer)
        if held is None:
            # Key j is position j; slots past this step's last position are not written.
            held = torch.arange(keys.size(2), device=keys.device)  # (S,)
            held = held.masked_fill(held > step.pos.max(), -1)
        if self.inner.window is None:
            # No window of its own, so no attention sinks: a quantised kind's `sinks` are
            # positions it keeps unquantised, which the band still hides.
            window, sinks = band, 0
        else:
            window, sinks = min(band, self.inner.window), self.inner.sinks
        if not self.inner.wants_attention:
            return step.by_position(q, keys, values, held, window, sinks)
        # A kind that ranks keys by the attention they draw (H2O) sees the banded weights.
        y, weights = step.weighted(q, keys, values, step.visible(held, window, sinks))
        self.inner.observe(layer, weights)
        return y
