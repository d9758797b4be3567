"""kvcache's caches as transformers cache layers: one `BridgeLayer` per attention layer, and
`BridgeCache`, the list of them a transformers model reads as its `Cache`.

transformers builds a forward's masks and positions from `get_seq_length` and
`get_mask_sizes` before any layer's `update`, and attends over what `update` returns under
them. A `BridgeLayer` reports what `DynamicLayer` reports (every token seen, keys 0..n in
position order, offset 0): the mask transformers builds is right for a kind whose `update`
returns every position in order, the exact kinds (a model's sliding layers too, its window
then the mask's band) and the quantised ones (their history dequantised).

Every other way of attending is the cache's own (`KVCache.attend`: a quantised kind reads
its codes through the C++ kernel, a ring or an eviction masks by its keys' positions, H2O
computes its weights and observes them), and it runs where the model runs the attention
function registered as "kvcache" (`hf.attention`): under it, a layer of a kind that is not
exact stores nothing in `update`, which hands this call's keys and values on unchanged
(`_defer`), and the attention function gives them, with the queries, to the cache's own
`attend` (`BridgeLayer.attend`). A kind that evicts or compresses cannot be served
otherwise: its `update` refuses, in one line, to run under another attention.

Torch and transformers load here: `kvcache_cli.hf` is imported only by a caller that has a
transformers model.
"""

from __future__ import annotations

import math
import threading

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from kvcache_cli.caches import cache_class, nbytes
from kvcache_cli.caches.base import CacheShape, KVCache
from kvcache_cli.caches.hybrid import BandedCache
from kvcache_cli.caches.spec import CacheSpec, check_spec
from kvcache_cli.caches.step import Step

# The name the kvcache attention is registered under (`hf.attention`): a model run with
# attn_implementation="kvcache" attends through its caches' own `attend`.
ATTENTION = "kvcache"


class BridgeError(ValueError):
    """A model or spec the bridge cannot serve, or a request it cannot honour (one line)."""


# The layer whose `update` handed its keys and values on to the attention function, and
# those tensors: the attention function claims them by identity (`claim`). A model runs
# one layer's update and attention back to back, so one slot a thread serves every cache.
_local = threading.local()


def _handed() -> list:
    return _local.__dict__.setdefault("handed", [])


def _defer(layer: BridgeLayer, keys: Tensor, values: Tensor) -> None:
    handed = _handed()
    if handed:
        index = handed[0][0].index
        handed.clear()
        raise BridgeError(f"layer {index}'s keys never reached the kvcache attention: this "
                          "model does not attend through transformers' attention interface; "
                          "run it with its own attention (the quantised kinds then read a "
                          "dequantised copy)")
    keys.kvcache_handed = True  # marked: a model that reads it again elsewhere is refused
    handed.append((layer, keys, values))


def claim(keys: Tensor, values: Tensor) -> BridgeLayer | None:
    """The bridge layer whose `update` handed on `keys` and `values` (the attention
    function's), or None: the layer is transformers' own, or a kind attended as
    transformers does (its history returned by `update`)."""
    handed = _handed()
    if not handed:
        if getattr(keys, "kvcache_handed", False):  # Gemma 3n: later layers reuse its keys
            raise BridgeError("a layer attends over keys another layer's cache handed on (keys "
                              "shared across layers), which the kvcache attention stored as "
                              "that layer's; run the model with its own attention")
        return None
    layer, k, v = handed.pop()
    if k is not keys or v is not values:  # DiffLlama splits its values, then attends twice
        raise BridgeError(f"layer {layer.index}: the model changes its keys or values between "
                          "the cache and the attention function, which the kvcache attention "
                          "cannot follow; run it with its own attention")
    return layer


class BridgeLayer(CacheLayerMixin):
    """One attention layer's cache: a kvcache cache of one layer, built at the first `update`
    from its keys' shape, dtype and device (a layer may have heads of its own width).

    `sliding_window`: the layer is one of the model's sliding layers, held whole here (every
    position kept, or the evicting kind's budget; the model's mask, or for an evicting kind
    the kvcache attention, applying its band): `is_sliding` tells transformers to build
    that layer's mask with the window.
    """

    is_compileable = False

    def __init__(self, spec: CacheSpec, max_len: int, sliding_window: int | None = None, *,
                 config=None, index: int = 0):
        super().__init__()
        self.spec, self.max_len, self.index = spec, max_len, index
        # The text config the model's attention reads its implementation from (None: a
        # layer built alone, never attended by kvcache).
        self.config = config
        self.is_sliding = sliding_window is not None
        self.sliding_window = sliding_window
        # What rolling back keeps exact: a kind without a rollback refuses `crop` (one line).
        self.is_croppable = bool(spec.info.rollback)
        # Keys out of position order: only the cache's own attention can mask them.
        self.evicts = spec.info.bounded or spec.info.compresses
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
        if self.is_sliding and self.evicts:
            # Every position its kind keeps, its own attention keeping the model's band too.
            self.cache = BandedCache(self.cache, [self.sliding_window])
        self.device = key_states.device
        self.is_initialized = True

    @property
    def attends_here(self) -> bool:
        """The model runs the kvcache attention and this kind attends its own way: `update`
        stores nothing, and `attend` does both."""
        # A sliding layer held whole in an in-order kind attends as transformers does, the
        # band its mask, over the history `update` returns: only an evicting kind's cache is
        # a `BandedCache` (`lazy_initialization`), so a quantised one attended here would
        # see past the window (the zoo's sliding models fail without this).
        own = self.evicts or not (self.spec.info.exact or self.is_sliding)
        return own and self.config is not None and \
            self.config._attn_implementation == ATTENTION

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs
               ) -> tuple[Tensor, Tensor]:
        """Store this call's keys and values (B, nkv, T, hs) after every position held, and
        return every position's, (B, nkv, S, hs) in position order (the quantised kinds'
        history dequantised). Under the kvcache attention a kind that is not exact stores
        nothing here and returns this call's own, for `attend`."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.attends_here:
            _defer(self, key_states, value_states)
            return key_states, value_states
        if self.evicts:
            raise BridgeError(f"cache {str(self.spec)!r} keeps keys out of position order, "
                              "which transformers' masks cannot describe: run the model "
                              "with the kvcache attention, "
                              f'model.set_attn_implementation("{ATTENTION}")')
        return self.cache.update(0, self.cache.length, key_states, value_states)

    def attend(self, query: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None,
               scaling: float | None) -> Tensor:
        """The cache's own attention (B, nh, T, hs) of queries (B, nh, T, hs) over every key
        it keeps, this call's keys and values (B, nkv, T, hs) stored first: the kvcache
        attention's work for a layer whose `update` handed them on. `mask` is transformers'
        for keys in position order: it may say no more than the causal order (and the
        layer's window) does, which the cache applies by its keys' positions itself."""
        step = Step.at(self.cache.length, query.size(2), self.max_len, query.device)
        if mask is not None:
            self._check_mask(mask, step)
        hs = query.size(-1)
        if scaling is not None and scaling != hs ** -0.5:  # kvcache scales by 1 / sqrt(hs)
            query = query * (scaling * math.sqrt(hs))
        return self.cache.attend(0, query, keys, values, step)

    def _check_mask(self, mask: Tensor, step: Step) -> None:
        """Refuse (one line) a mask beyond the causal band: padded rows, or tokens that see
        ahead; kvcache's caches keep every row's tokens at the same positions."""
        seen = int(step.pos[-1]) + 1  # the keys transformers' mask is sized for
        held = torch.arange(seen, device=mask.device)  # (S,): key j at position j
        want = step.visible(held, self.sliding_window)  # (1, 1, T, S)
        if mask.dtype != torch.bool or mask.shape[-2:] != want.shape[-2:] or \
                not bool((mask == want).all()):
            raise BridgeError(f"layer {self.index}: a mask beyond the causal order (padded "
                              "rows, or tokens that see ahead); kvcache's caches keep each "
                              "row's tokens at the same positions: pass rows without padding")

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
