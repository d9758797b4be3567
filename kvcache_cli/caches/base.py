"""The interface every KV cache kind implements, and what attention asks of it.

A cache stores, for each layer, the keys and values of the positions it keeps, and
hands attention what to attend over. The model asks this interface, never the class
(transformers' per-layer `Cache` objects share the same few verbs: update, crop, reset).

Torch-free at import, like `spec`: `kvcache size` and completion read the family's
names without paying for torch. Shapes: `update` takes one call's k, v as
(B, nkv, T, hs) and returns (B, nkv, S, hs); `attend` takes q (B, nh, T, hs) and returns
attention's output (B, nh, T, hs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the interface and the spec parser load without torch
    from torch import Tensor

    from kvcache_cli.caches.step import Step


class Rope(Protocol):
    """A rotary model's position encoding, as a cache that moves kept keys needs it
    (`:rerotate`, see `kvcache_cli.caches.bounded`): the model's own, so its layout (half
    split or interleaved), base and scaling are the model's business, not the cache's."""

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """x (..., S, hs) rotated by the angles of `positions` (integers broadcastable to
        x.shape[:-1], negative allowed): rotate(rotate(x, a), b) == rotate(x, a + b), so a
        key written at position p and rotated by d reads as if written at p + d."""
        ...


def nbytes(t: Tensor) -> int:
    """Bytes a tensor's elements occupy (its storage may be larger)."""
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class LayerType:
    """What one layer attends over, as the model defines it: every earlier position (full
    attention), or a sliding window of the `window` newest, the query's own included
    (Mistral, Gemma 2/3, GPT-OSS). transformers spells it `config.layer_types`
    ("full_attention" / "sliding_attention") with `sliding_window`; vLLM, a per-layer
    `FullAttentionSpec` / `SlidingWindowSpec(sliding_window=N)`. A window is the model's
    math, not a cut: a ring of `window` slots holds such a layer exactly.
    """

    window: int | None = None  # None: full attention
    # The layer's own rotary base where the model gives each layer type one (Gemma 3:
    # 10,000 on sliding layers, 1,000,000 on global ones); None: the model's one base,
    # or no rotary positions at all.
    rope_theta: float | None = None

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"sliding window {self.window}: expected at least 1 position")

    @property
    def sliding(self) -> bool:
        return self.window is not None

    @property
    def kind(self) -> str:
        """'full' or 'sliding': the name bytes per layer kind are reported under."""
        return "sliding" if self.sliding else "full"


FULL_ATTENTION = LayerType()


@dataclass(frozen=True)
class CacheShape:
    """What a cache is built from: every model family's config gives one (`cache_shape`).

    Under grouped-query attention a cache holds the KV heads, not the query heads:
    SmolLM2's 9 query heads share 3 KV heads, so each of its caches holds 3.
    """

    n_layer: int
    n_kv_head: int
    head_size: int
    context: int  # positions the model can attend over: no cache is built longer
    # A rotary model's RoPE, for a bounded cache that re-rotates the keys it keeps
    # (`sink:4+252:rerotate`): the full-attention layers' rotation, the only layers a
    # spec's bound applies to in a hybrid model. None: positions are not rotary (GPT-2's
    # are learned and added to the input), so no key can be moved to another position.
    rope: Rope | None = None
    # One LayerType per layer; () is filled with full attention on every layer (GPT-2,
    # Llama): `caches.make_cache` then builds one cache of the spec's kind, as always.
    layer_types: tuple[LayerType, ...] = ()

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (FULL_ATTENTION,) * self.n_layer)
        elif len(self.layer_types) != self.n_layer:
            raise ValueError(f"{len(self.layer_types)} layer types for {self.n_layer} layers; "
                             "expected one per layer")

    @property
    def hybrid(self) -> bool:
        """Some layer slides: its cache is a ring of its window (`caches.hybrid`)."""
        return any(t.sliding for t in self.layer_types)


class RollbackError(ValueError):
    """A cache asked to forget tokens it cannot give back (one line, for the CLI)."""


class KVCache:
    """What attention needs from a cache: the one seam between a model and its cache.

    `attend(layer, q, k, v, step)` is every layer's attention: it stores this call's keys
    and values k, v (B, nkv, T, hs) for the tokens at `step.pos` and returns the output
    (B, nh, T, hs) of the queries q (B, nh, T, hs) (q and k already rotated, where the
    model rotates) over every key the cache keeps for them. The default is gpt-fast's:
    `update`, then SDPA under the causal mask of keys held in position order. A cache that
    holds keys another way attends its own way: a ring or an eviction policy masks by the
    position each key holds (`key_positions`, its window and sinks), H2O computes explicit
    weights and `observe`s them, a quantised cache reads its codes through its kernel.

    `update(layer, start_pos, k, v)` stores this call's k, v for the tokens at positions
    start_pos .. start_pos+T-1 and returns the keys and values to attend over,
    (B, nkv, S, hs), with this call's tokens included.

    `length` is the number of positions written so far (the next token's position when
    one sequence is decoded), `bytes_held` what the cache occupies now (scales, zero
    points and padding included), `bytes_copied` how many bytes its writes have moved
    since it was made or reset.
    """

    length: int
    bytes_copied: int
    # What a cache declares of how it holds keys (read by its own `attend`, by tests and
    # by the breaks, never by a model). `whole`: update returns every slot the cache has,
    # filled or not, masked past each query's position (one shape at every step).
    whole: bool = False
    # Ranks keys by the attention they draw (heavy hitters): its `attend` computes the
    # weights explicitly and hands them to `observe`.
    wants_attention: bool = False
    # A sliding window (Mistral, StreamingLLM): the query at position p sees only the keys
    # at positions p - window + 1 .. p, and the first `sinks` positions whatever their age.
    window: int | None = None
    sinks: int = 0

    def update(self, layer: int, start_pos: int | Tensor, k: Tensor, v: Tensor
               ) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, step: Step) -> Tensor:
        """Store k, v (B, nkv, T, hs) and return attention's output (B, nh, T, hs) for
        queries q (B, nh, T, hs) at `step.pos` over every key kept (gpt-fast's)."""
        keys, values = self.update(layer, step.start, k, v)  # (B, nkv, S, hs)
        return step.in_order(q, keys, values)

    def key_positions(self, layer: int) -> Tensor | None:
        """The position of each key the last `update` of `layer` returned: (S,), (B, S)
        or (B, nkv, S), -1 for an empty slot; None when key j is position j."""
        return None

    def observe(self, layer: int, weights: Tensor) -> None:
        """This step's attention probabilities (B, nkv, T, S) over the keys `update`
        returned, for a cache that `wants_attention`. Under grouped-query attention each
        KV head gets the mean over the query heads that share it."""

    def crop(self, length: int) -> None:
        """Forget every position from `length` on (speculative decoding's rollback)."""
        raise RollbackError(f"{type(self).__name__} cannot roll back")

    @property
    def bytes_held(self) -> int:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError

    def buffers(self) -> list[Tensor] | None:
        """The cache's memory where it is fixed for the next decoding token and that token's
        write and attention are one native call that reads its position from the step
        (`code_attention.attend_decode`, `decode_codes`), so a step's calls are the same at
        every position and can be replayed (`generate.ReplayedDecode`), the cache's
        bookkeeping then recorded by `advance(start_pos, T)`; None for any other cache."""
        return None


class PositionedCache(KVCache):
    """A cache whose key j is not the token at position j (a ring buffer, kept sinks, an
    eviction policy): it says which position each key `update` returned holds
    (`key_positions`, -1 for an empty slot), and attention lets the query at position p
    see exactly the keys holding positions 0..p, within its `window` and `sinks`."""

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, step: Step) -> Tensor:
        keys, values = self.update(layer, step.start, k, v)  # (B, nkv, S, hs)
        return step.by_position(q, keys, values, self.key_positions(layer), self.window,
                                self.sinks)


class ForwardingCache(KVCache):
    """A cache that hands every call to the cache it wraps: a subclass overrides only what
    it watches (a break's probe of what attention read, eval's attention share)."""

    def __init__(self, inner: KVCache):
        self.inner = inner

    def update(self, layer: int, start_pos: int | Tensor, k: Tensor, v: Tensor
               ) -> tuple[Tensor, Tensor]:
        return self.inner.update(layer, start_pos, k, v)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, step: Step) -> Tensor:
        return self.inner.attend(layer, q, k, v, step)

    def key_positions(self, layer: int) -> Tensor | None:
        return self.inner.key_positions(layer)

    def observe(self, layer: int, weights: Tensor) -> None:
        self.inner.observe(layer, weights)

    def crop(self, length: int) -> None:
        self.inner.crop(length)

    def reset(self) -> None:
        self.inner.reset()

    @property
    def length(self) -> int:
        return self.inner.length

    @property
    def bytes_held(self) -> int:
        return self.inner.bytes_held

    @property
    def bytes_copied(self) -> int:
        return self.inner.bytes_copied

    @property
    def whole(self) -> bool:
        return self.inner.whole

    @property
    def wants_attention(self) -> bool:
        return self.inner.wants_attention

    @property
    def window(self) -> int | None:
        return self.inner.window

    @property
    def sinks(self) -> int:
        return self.inner.sinks
