"""kvcache's caches as transformers cache layers: one `BridgeLayer` per attention layer, and
`BridgeCache`, the list of them a transformers model reads as its `Cache`.

transformers builds a forward's masks and positions from `get_seq_length` and
`get_mask_sizes` before any layer's `update`, and attends over what `update` returns under
them. A `BridgeLayer` reports what `DynamicLayer` reports (every token seen, keys 0..n in
position order, offset 0), so it may hold only a kind whose `update` returns every position
in order: the exact kinds (with a model's sliding layers too, its window then the mask's
band) and the quantised ones, which return their dequantised history. A kind that evicts
or reorders keys (a ring, sinks, H2O, a compressed prompt) needs masks from its key
positions; `hf.kv_cache` refuses those until that seam exists.

Torch and transformers load here: `kvcache_cli.hf` is imported only by a caller that has a
transformers model.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from kvcache_cli.caches import cache_class, nbytes
from kvcache_cli.caches.base import CacheShape, KVCache
from kvcache_cli.caches.spec import CacheSpec, check_spec


class BridgeError(ValueError):
    """A model or spec the bridge cannot serve, or a request it cannot honour (one line)."""


class BridgeLayer(CacheLayerMixin):
    """One attention layer's cache: a kvcache cache of one layer, built at the first `update`
    from its keys' shape, dtype and device (a layer may have heads of its own width).

    `sliding_window`: the layer is one of the model's sliding layers, held whole here (every
    position kept, the model's mask applying its band): `is_sliding` tells transformers to
    build that layer's mask with the window.
    """

    is_compileable = False

    def __init__(self, spec: CacheSpec, max_len: int, sliding_window: int | None = None):
        super().__init__()
        self.spec, self.max_len = spec, max_len
        self.is_sliding = sliding_window is not None
        self.sliding_window = sliding_window
        # What rolling back keeps exact: a kind without a rollback refuses `crop` (one line).
        self.is_croppable = bool(spec.info.rollback)
        self.cache: KVCache | None = None

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        B, nkv, _, hs = key_states.shape  # (B, nkv, T, hs)
        if value_states.shape[-1] != hs:
            # MLA as transformers caches it: keys (nope + rope) wider than values.
            raise BridgeError(f"keys {hs} wide and values {value_states.shape[-1]} wide (a "
                              "latent attention's decompressed heads): kvcache's caches hold "
                              "keys and values of one width")
        check_spec(self.spec, hs)
        shape = CacheShape(n_layer=1, n_kv_head=nkv, head_size=hs, context=self.max_len)
        self.cache = cache_class(self.spec).build(
            self.spec, shape, max_len=self.max_len, batch=B, device=key_states.device,
            dtype=key_states.dtype, whole=False)
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs
               ) -> tuple[Tensor, Tensor]:
        """Store this call's keys and values (B, nkv, T, hs) after every position held, and
        return every position's, (B, nkv, S, hs) in position order (the quantised kinds'
        history dequantised)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.cache.update(0, self.cache.length, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.cache.length if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # update returns every position from 0, this call's included: DynamicLayer's sizes.
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the newest -tokens_to_remove positions (transformers 5's spelling: a
        negative count, as assisted generation calls it)."""
        if tokens_to_remove > 0:
            raise BridgeError(f"crop({tokens_to_remove}): expected a negative count of tokens "
                              "to remove, as transformers 5 crops")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self.cache.crop(max(0, self.cache.length + tokens_to_remove))  # RollbackError: 1 line

    def reset(self) -> None:
        if self.is_initialized:
            self.cache.reset()

    def _refuse_rows(self, what: str) -> None:
        if self.get_seq_length():
            raise BridgeError(f"{what} moves a cache's rows; the bridge's caches keep the "
                              "rows they were built with (use DynamicCache for it)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._refuse_rows("beam search")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._refuse_rows("repeating a batch")

    def batch_select_indices(self, indices: Tensor) -> None:
        self._refuse_rows("selecting rows of a batch")

    @property
    def bytes_held(self) -> int:
        return self.cache.bytes_held if self.is_initialized else 0


def layer_bytes_held(layer) -> int:
    """Bytes a cache layer holds: a bridge layer's kvcache cache, or the keys and values of
    one of transformers' own (a model's sliding layer in `DynamicSlidingWindowLayer`)."""
    if isinstance(layer, BridgeLayer):
        return layer.bytes_held
    return sum(nbytes(t) for t in (layer.keys, layer.values) if isinstance(t, Tensor))


class BridgeCache(Cache):
    """A transformers `Cache` whose layers are kvcache caches (`BridgeLayer`) where the
    spec applies, and transformers' own sliding layers where the model's window is kept.

    `kinds[i]` is layer i's kind as bytes are reported under it, 'full' or 'sliding'.
    """

    def __init__(self, layers: list, kinds: tuple[str, ...], spec: CacheSpec):
        super().__init__(layers=layers)
        self.kinds, self.spec = kinds, spec

    @property
    def bytes_held(self) -> int:
        """Bytes every layer holds now (scales, zero points and residual tokens included)."""
        return sum(layer_bytes_held(layer) for layer in self.layers)

    def bytes_by_kind(self) -> dict[str, int]:
        """Bytes held per layer kind, {'full': ..., 'sliding': ...}: the kinds the model has."""
        held: dict[str, int] = {}
        for kind, layer in zip(self.kinds, self.layers, strict=True):
            held[kind] = held.get(kind, 0) + layer_bytes_held(layer)
        return held
