"""Caches with a bound: a sliding window, attention sinks, heavy hitters.

Memory stops growing once the cache is full; what it forgets, attention never sees.

- `RingCache` is `window:W` (Mistral's rolling buffer: position p in slot p mod W) and
  `sink:S+W` (StreamingLLM: the first S positions kept for good, then a ring of W);
- `HeavyHitterCache` is `h2o:H+W` (H2O: per layer and head, the H positions that have
  drawn the most attention so far, plus the W most recent).

Positions, and the rotary position policy (`:text`, the default, or `:rerotate`). Under
GPT-2's learned embeddings, added to the input, a key keeps the position it was computed
at: nothing else is possible. A rotary model (Llama) rotates q and k by their positions
before `update`, so the cache holds keys rotated at their text positions, and an evicting
cache must decide which position a kept key has:

- `text`: the position it had in the text, what a band mask over the whole text computes:
  the cache returns the keys as written (transformers' sliding-window layers, Mistral);
- `rerotate`: its place among the keys the query attends (StreamingLLM): the kept keys
  numbered 0, 1, ... in text order, the query next. llama.cpp's context shift does this
  by re-rotating the kept keys in place by the shift, since its cache stores them rotated.

Only differences of positions enter q . k, so `rerotate` needs no new query position: a
key whose cache place is c_j and text position p_j, seen from a query at p_q (place c_q),
reads as a key at p_j + (g_q - g_j), where g = p - c is how many positions were evicted
before it. In a ring every window key has the query's g (nothing is evicted between
them), so only the S sinks move, by g_q = max(0, p - W + 1 - S): `window:W:rerotate` is
`window:W` exactly, and `sink:S+W:rerotate` rotates S keys a step, not W. Under H2O every
kept key has its own g. The rotation is applied to what `update` returns, from the keys as
written, never to the stored keys: rounding does not accumulate step after step (as an
in-place shift's does), and `crop` stays exact. The rotation is the model's (`Rope`, from
`CacheShape.rope`): a cache built for a model without one refuses `:rerotate`.

A chunk whose queries stand at different shifts (a prompt running past S + W in a ring)
would need the sinks at a different angle for each query, which one key tensor cannot
hold: `rerotate` refuses it; feed those tokens one at a time (eval's `--chunk 1`). H2O's
chunks are fine: its chunk queries see everything held, all at one shift.

The cache still never runs past the model's context window (`max_len`): positions within
the cache would allow it, positions in the text, and GPT-2's, would not.

What a query sees. The query at position p attends to what the cache holds after p is
written: `window:W` sees positions p-W+1 .. p, `sink:S+W` also positions 0 .. S-1. A chunk
of several tokens (a prompt) gets the same band through the mask (`PositionedCache`, by
`window` and `sinks`): the keys the cache held before the chunk, with the chunk's own, are
returned together (a transient (B, nkv, held + T, hs) copy) and each query sees its own
band, so a prompt in one forward gives the logits of the same prompt fed one token at a
time. Then only what the bound keeps is written. H2O ranks by attention, which a chunk
computes all at once: a chunk's queries see everything the cache held plus the chunk
causally, and the eviction to H+W follows (H2O's own prefill does the same); one token
per forward reproduces its step-by-step policy exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvcache_cli.caches import code_attention
from kvcache_cli.caches.base import KVCache, PositionedCache, RollbackError, Rope, nbytes
from kvcache_cli.caches.exact import decodes_natively, layer_buffers
from kvcache_cli.caches.spec import check_context
from kvcache_cli.caches.step import Step


def _rope_of(spec, shape) -> Rope | None:
    """The rotation `:rerotate` needs, None for `:text`; refused on a model without one."""
    if dict(spec.params).get("positions", "text") == "text":
        return None
    if shape.rope is None:
        raise ValueError(f"cache spec {str(spec)!r}: rerotate moves kept keys to their places "
                         f"in the cache, which needs rotary positions (RoPE); this model's "
                         f"are learned and added to the input, so a key keeps its own: drop "
                         f":rerotate")
    return shape.rope


def _check_step(cache, layer: int, start_pos, T: int) -> tuple[int, int]:
    """The step's first position and the one past its last: bounded caches write positions
    in order, one row, and no further than the `max_len` they were built for."""
    if isinstance(start_pos, Tensor):
        raise ValueError(f"{cache.name} keeps one position per slot for every row: rows at "
                         "different positions (serve's batches) need a paged or static cache")
    if layer == 0 and start_pos != cache.length:
        raise ValueError(f"{cache.name} writes positions in order: expected position "
                         f"{cache.length}, got {start_pos} (crop first to rewrite)")
    end = start_pos + T
    if end > cache.max_len:
        raise IndexError(f"position {end - 1} past the {cache.name} cache's max_len "
                         f"{cache.max_len}")
    return start_pos, end


class RingCache(PositionedCache):
    """The first `sinks` positions in slots 0..S-1 for good, later ones in a ring of
    R = window + spare slots: position p >= S in slot S + (p - S) mod R. `window:W` has no
    sinks. Spare slots (`:kN`) keep N positions older than the window, which the mask's band
    hides from every query, so that a crop can go N + 1 positions back after the ring has
    wrapped (speculative decoding's rejected tokens) and still be exact.

    Two buffers a layer allocated once, min(max_len, S + R) slots each, written in place:
    bytes held are the same at every step. Which position a slot holds follows from the
    length alone (`positions`); one vector of them, shared by every layer, is kept up to
    date as slots are written, so a decode step reads it without recomputing it (8 bytes
    a slot for the whole cache: bookkeeping, like `length`, outside `bytes_held`).

    `whole`: built for a compiled decode step (`generate.CompiledDecode`, Gemma 3's
    sliding layers), whose position is a tensor: the token goes to its slot by
    `index_copy_` and attention reads every slot under the mask of the positions they
    hold, all computed from that tensor, so one graph serves every position; the
    bookkeeping follows the graph (`advance`), as the static cache's does.

    `store`: the buffers' dtype where it is not the model's: a hybrid model's rings under a
    half kind (`fp16`, `bf16`) hold their numbers in its 2 bytes too, as llama.cpp's f16
    cache holds its sliding layers (`caches.make_cache`). What `update` returns is widened
    back to the model's dtype; a decoding step's native call reads them in place.
    """

    def __init__(self, shape, sinks: int, window: int, max_len: int, batch: int, device,
                 dtype: torch.dtype, name: str, spare: int = 0, rope: Rope | None = None,
                 whole: bool = False, store: torch.dtype | None = None):
        if not 0 < max_len <= shape.context:
            raise ValueError(f"max_len {max_len} outside the context window 1..{shape.context}")
        self.name, self.sinks, self.window, self.max_len = name, sinks, window, max_len
        self.rope = rope  # set: `rerotate`, the sinks moved up to the window (module doc)
        self.ring = window + spare  # slots after the sinks; the band is `window` of them
        self.slots = min(max_len, sinks + self.ring)  # never more than the sequence needs
        if whole and rope is not None and sinks:
            raise ValueError(f"{name}: a compiled step reads the sinks at the angle they were "
                             f"written; rerotate moves them by a shift it cannot compute "
                             f"from a tensor position: drop :rerotate or run eager")
        self.whole = whole
        self.dtype = dtype  # the model's: what attention computes in
        # per layer: (B, nkv, slots, hs)
        self.k, self.v = layer_buffers(shape.n_layer, (batch, shape.n_kv_head, self.slots,
                                                       shape.head_size), device, store or dtype,
                                       whole)
        self.device = device
        self.reset()

    @classmethod
    def build(cls, spec, shape, *, max_len: int, batch: int, device, dtype, whole: bool,
              store: torch.dtype | None = None):
        check_context(spec, shape.context)  # a budget it could never fill: refused
        params = dict(spec.params)
        return cls(shape, params.get("sinks", 0), params["window"], max_len, batch, device,
                   dtype, str(spec), params.get("spare", 0), _rope_of(spec, shape), whole,
                   store)

    def reset(self) -> None:
        # Nothing to clear: a slot's position says whether it is filled (-1: empty).
        self.length = 0
        self.bytes_copied = 0
        self._pos = torch.full((self.slots,), -1, device=self.device)  # (slots,)
        self._held: Tensor | None = None  # the returned keys' positions, per step

    def slot(self, pos: int) -> int:
        S = self.sinks
        return pos if pos < S else S + (pos - S) % self.ring

    def positions(self, length: int | Tensor | None = None) -> Tensor:
        """The position each slot holds once `length` positions are written (an int, or
        a (1,) tensor in a compiled step), -1: empty."""
        n = self.length if length is None else length
        S, R = self.sinks, self.ring
        s = torch.arange(self.slots, device=self.device)  # (slots,)
        # Sink slot s holds s; ring slot S + r the latest q = p - S < n - S with q ≡ r mod R.
        last = n - 1 - S
        ring = S + last - torch.remainder(last - (s - S), R)  # (slots,)
        held = torch.where(s < S, s, ring)
        return torch.where((held >= 0) & (held < n) & ((s < S) | (held >= S)), held, -1)

    @property
    def evicted(self) -> int:
        """Positions written and no longer held (per layer, row and head)."""
        return max(0, self.length - self.sinks - self.ring)

    def update(self, layer: int, start_pos: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        T = k.size(2)
        start, end = _check_step(self, layer, start_pos, T)
        filled = min(start, self.slots)  # slots in use before this step
        if layer == 0:
            if self._pos is None:  # native decoding steps (`decode`) left it to be worked out
                self._pos = self.positions()
            self.length = end
            if T == 1:  # the newest token's slot holds it now: exactly its band
                self._pos[self.slot(start)] = start
                self._held = self._pos[: min(end, self.slots)]
            else:  # what the chunk's queries find, then the chunk itself
                chunk = torch.arange(start, end, device=self.device)
                self._held = torch.cat([self._pos[:filled], chunk])
                self._pos = self.positions()
        if T == 1:
            # Decode: the newest token goes into its slot first (evicting p - R), then the
            # query reads the filled slots: its band, and any spare slots the mask hides.
            i = self.slot(start)
            self.k[layer][:, :, i] = k[:, :, 0]  # cast to the buffers' dtype (`store`)
            self.v[layer][:, :, i] = v[:, :, 0]
            self.bytes_copied += self._stored_bytes(layer, k)
            n = min(end, self.slots)
            keys, values = self.k[layer][:, :, :n], self.v[layer][:, :, :n]
            return self._moved(keys.to(self.dtype), start, end), values.to(self.dtype)
        # A chunk: its queries need keys its own later tokens would overwrite, so what the
        # cache held and the chunk are returned together and the band is the mask's job.
        # The chunk as stored (`store`: rounded once, its own queries reading it so too),
        # after what the cache held: (B, nkv, filled + T, hs), at the model's dtype.
        k, v = k.to(self.k[layer].dtype), v.to(self.v[layer].dtype)
        keys = torch.cat([self.k[layer][:, :, :filled], k], dim=2).to(self.dtype)
        values = torch.cat([self.v[layer][:, :, :filled], v], dim=2).to(self.dtype)
        keep = [p for p in range(start, end) if p < self.sinks or p >= end - self.ring]
        slots = torch.tensor([self.slot(p) for p in keep], dtype=torch.long, device=k.device)
        rows = torch.tensor([p - start for p in keep], dtype=torch.long, device=k.device)
        self.k[layer].index_copy_(2, slots, k.index_select(2, rows))
        self.v[layer].index_copy_(2, slots, v.index_select(2, rows))
        self.bytes_copied += nbytes(keys) + nbytes(values) + \
            len(keep) * self._stored_bytes(layer, k[:, :, :1])
        return self._moved(keys, start, end), values

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, step: Step) -> Tensor:
        if self.whole and isinstance(step.start, Tensor):  # `generate.CompiledDecode`
            return self.attend_at(layer, q, k, v, step)
        if q.size(2) == 1 and self.decodes_in_one_call and not isinstance(step.start, Tensor) and \
                self.k[layer].dtype in code_attention.FULL_FLAGS and decodes_natively(q, k, v) and \
                not torch.compiler.is_compiling():
            return self.decode(layer, q, k, v, step)
        return super().attend(layer, q, k, v, step)

    @property
    def decodes_in_one_call(self) -> bool:
        """Whether a float32 decoding token on the CPU is one native call (`decode`): for a
        window alone (no sinks, no spare slots, nothing rerotated), every filled slot holds
        a position of the newest token's band, so the step reads them all."""
        return self.sinks == 0 and self.ring == self.window and self.rope is None

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor, step: Step) -> Tensor:
        """A decoding token's write into its slot and its attention (B, nh, 1, hs) over
        the filled slots, one native call (`code_attention.attend_decode` over the ring).
        Which position each slot holds is worked out again when next asked for (`update`):
        written here it would be a torch op in a step that is otherwise native calls."""
        start, end = _check_step(self, layer, step.start, 1)
        y = code_attention.attend_decode(q, k, v, self.k[layer], self.v[layer], step.pos,
                                         ring=True)
        self.bytes_copied += self._stored_bytes(layer, k)
        if layer == 0:
            self.length, self._pos, self._held = end, None, None
        return y  # (B, nh, 1, hs)

    def buffers(self) -> list[Tensor] | None:
        """Every layer's key ring, then every value ring, where a decoding step is one
        native call (`KVCache.buffers`)."""
        return [*self.k, *self.v] if self.decodes_in_one_call else None

    def attend_at(self, layer: int, q: Tensor, k: Tensor, v: Tensor, step: Step) -> Tensor:
        """A compiled step's write of one token k, v (B, nkv, 1, hs) at position step.pos
        (1,), a tensor, and its attention over every slot, masked by the positions they
        then hold. It reads and changes no Python number (each would be a guard in the
        graph); the caller records the write afterwards (`advance`)."""
        pos, S = step.pos, self.sinks
        slot = torch.where(pos < S, pos, S + torch.remainder(pos - S, self.ring))  # (1,)
        store = self.k[layer].dtype
        self.k[layer].index_copy_(2, slot, k.to(store))
        self.v[layer].index_copy_(2, slot, v.to(store))
        held = self.positions(pos + 1)  # (slots,)
        return step.by_position(q, self.k[layer].to(self.dtype), self.v[layer].to(self.dtype),
                                held, self.window, S)

    def _stored_bytes(self, layer: int, k: Tensor) -> int:
        """Bytes that writing k and its values (B, nkv, T, hs) moves into the buffers."""
        return 2 * k.numel() * self.k[layer].element_size()

    def advance(self, start_pos: int, T: int) -> None:
        """Record what `attend_at`, or a replayed step's `decode`, wrote at every layer: T
        positions from start_pos."""
        end = start_pos + T
        if end > self.max_len:
            raise IndexError(f"position {end - 1} past the {self.name} cache's max_len "
                             f"{self.max_len}")
        self.length = end
        self.bytes_copied += T * (self.bytes_held // self.slots)
        self._pos = self.positions()
        self._held = None

    def _shift(self, pos: int) -> int:
        """Positions evicted between the sinks and the window of the query at `pos`."""
        return max(0, pos - self.window + 1 - self.sinks)

    def _moved(self, keys: Tensor, start: int, end: int) -> Tensor:
        """`rerotate`: keys (B, nkv, n, hs) with the sinks rotated by the queries' shift, a
        transient copy; the keys as returned otherwise (and before anything is evicted)."""
        if self.rope is None or self.sinks == 0 or self._shift(end - 1) == 0:
            return keys
        shift = self._shift(start)
        if shift != self._shift(end - 1):
            raise ValueError(
                f"{self.name}: the queries at positions {start}..{end - 1} stand at "
                f"different shifts from the sinks ({shift}..{self._shift(end - 1)}), which "
                f"one set of keys cannot hold; feed positions past "
                f"{self.sinks + self.window - 1} one at a time (--chunk 1)")
        S = self.sinks
        by = torch.full((S,), shift, device=keys.device)  # (S,): the same for every sink
        return torch.cat([self.rope.rotate(keys[:, :, :S], by), keys[:, :, S:]], dim=2)

    def key_positions(self, layer: int) -> Tensor | None:
        return self._held

    def crop(self, length: int) -> None:
        n = self.length
        if not 0 <= length <= n:
            raise RollbackError(f"cannot crop to {length} positions: the cache holds "
                                f"{n}; expected 0..{n}")
        # Exact while every position the next token (at `length`) attends is still held:
        # always before the ring wraps, and spare + 1 positions back once it has.
        back = self.ring - self.window + 1
        if n > self.sinks + self.ring and length < n - back:
            lost = max(self.sinks, length - self.window + 1)
            raise RollbackError(
                f"{self.name} cannot crop from {n} to {length} positions: position {lost}, "
                f"which the token at {length} attends, was overwritten when position "
                f"{lost + self.ring} was written (a wrapped ring rolls back {back}; "
                f"spare slots, :kN, let it roll back N + 1)")
        self.length = length
        self._pos = self.positions()
        self._held = None

    @property
    def bytes_held(self) -> int:
        return sum(nbytes(t) for t in self.k + self.v)


class HeavyHitterCache(KVCache):
    """H2O: per layer, row and head, the `heavy` positions with the largest accumulated
    attention plus the `recent` newest, in heavy + recent slots allocated once.

    Every key's score is the sum of the attention probabilities it has drawn from every
    query since it was written. When the cache is full, a new token takes the slot of the
    lowest-scoring key outside the recent window; the heads choose independently, so each
    holds its own positions (`key_positions` is (B, nkv, S)). Scores (float32) and
    positions (int64) are held per slot and counted in `bytes_held`.
    """

    wants_attention = True

    def __init__(self, shape, heavy: int, recent: int, max_len: int, batch: int, device,
                 dtype: torch.dtype, name: str, rope: Rope | None = None):
        if not 0 < max_len <= shape.context:
            raise ValueError(f"max_len {max_len} outside the context window 1..{shape.context}")
        self.name, self.heavy, self.recent, self.max_len = name, heavy, recent, max_len
        self.rope = rope  # set: `rerotate`, each kept key moved to its place (module doc)
        self.slots = min(max_len, heavy + recent)
        L, B, nkv = shape.n_layer, batch, shape.n_kv_head
        dims = (L, B, nkv, self.slots, shape.head_size)
        self.k = torch.zeros(dims, device=device, dtype=dtype)  # (L, B, nkv, slots, hs)
        self.v = torch.zeros(dims, device=device, dtype=dtype)
        self.score = torch.zeros((L, B, nkv, self.slots), device=device)  # (L, B, nkv, slots)
        self.pos = torch.full((L, B, nkv, self.slots), -1, device=device)  # (L, B, nkv, slots)
        self.reset()

    @classmethod
    def build(cls, spec, shape, *, max_len: int, batch: int, device, dtype, whole: bool):
        check_context(spec, shape.context)
        return cls(shape, spec["heavy"], spec["recent"], max_len, batch, device, dtype,
                   str(spec), _rope_of(spec, shape))

    def reset(self) -> None:
        self.length = 0
        self.bytes_copied = 0
        self.score.zero_()
        self.pos.fill_(-1)
        self.filled = 0  # slots in use, the same in every layer and head
        self._chunk: dict[int, tuple[Tensor, Tensor, Tensor]] = {}  # layer -> keys, values, pos

    @property
    def evicted(self) -> int:
        return max(0, self.length - self.slots)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, step: Step) -> Tensor:
        """Attention over the keys held, masked by their positions, its weights (SDPA
        never returns them) added to each key's score (`observe`)."""
        keys, values = self.update(layer, step.start, k, v)  # (B, nkv, S, hs)
        y, weights = step.weighted(q, keys, values, step.visible(self.key_positions(layer)))
        self.observe(layer, weights)
        return y

    def update(self, layer: int, start_pos: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        B, nkv, T, hs = k.shape
        start, end = _check_step(self, layer, start_pos, T)
        filled = self.filled if layer == 0 else self._filled_before
        if layer == 0:
            self._filled_before = filled
            self.length = end
            self.filled = min(filled + T, self.slots)
        self.bytes_copied += nbytes(k) + nbytes(v)
        if T == 1 and filled < self.slots:  # room left: the next free slot
            self.k[layer, :, :, filled] = k[:, :, 0]
            self.v[layer, :, :, filled] = v[:, :, 0]
            self.pos[layer, :, :, filled] = start
            self.score[layer, :, :, filled] = 0.0
            n = filled + 1
            return self.k[layer, :, :, :n], self.v[layer, :, :, :n]
        if T == 1:
            # Full: each head's new token replaces its lowest-scoring key outside the
            # recent window (start - W + 1 .. start), i.e. the H + 1 oldest candidates.
            pos, score = self.pos[layer], self.score[layer]  # (B, nkv, slots)
            candidate = pos <= start - self.recent
            out = score.masked_fill(~candidate, float("inf")).argmin(dim=-1, keepdim=True)
            self.pos[layer].scatter_(2, out, start)
            self.score[layer].scatter_(2, out, 0.0)
            at = out[..., None].expand(B, nkv, 1, hs)  # (B, nkv, 1, hs)
            self.k[layer].scatter_(2, at, k)
            self.v[layer].scatter_(2, at, v)
            return self._moved(self.k[layer], self.pos[layer], start, 1), self.v[layer]
        # A chunk: attend over everything held plus the chunk; `observe` then keeps H + W.
        new = torch.arange(start, end, device=k.device).expand(B, nkv, T)  # (B, nkv, T)
        keys = torch.cat([self.k[layer, :, :, :filled], k], dim=2)  # (B, nkv, filled + T, hs)
        values = torch.cat([self.v[layer, :, :, :filled], v], dim=2)
        pos = torch.cat([self.pos[layer, :, :, :filled], new], dim=2)  # (B, nkv, filled + T)
        self._chunk[layer] = keys, values, pos
        if filled + T <= self.slots:  # nothing evicted yet: every place is its position
            return keys, values
        return self._moved(keys, pos, start, T), values

    def _moved(self, keys: Tensor, pos: Tensor, start: int, T: int) -> Tensor:
        """`rerotate`: keys (B, nkv, n, hs) at positions pos (B, nkv, n), T of them (the
        newest) this step's, each rotated by g_q - g_j (module doc), a transient copy."""
        if self.rope is None:
            return keys
        place = pos.argsort(dim=-1).argsort(dim=-1)  # (B, nkv, n): rank in text order
        evicted_before = pos - place  # g_j, per head
        # The step's first query sits at position `start`, at place n - T: every query
        # of a chunk has the same g, since the chunk evicts nothing until `observe`.
        query = start - (pos.size(-1) - T)
        return self.rope.rotate(keys, query - evicted_before)

    def key_positions(self, layer: int) -> Tensor | None:
        if layer in self._chunk:
            return self._chunk[layer][2]  # (B, nkv, filled + T)
        n = self.filled
        return self.pos[layer, :, :, :n]  # (B, nkv, n)

    def observe(self, layer: int, weights: Tensor) -> None:
        # weights (B, nkv, T, S): what each query drew from each returned key.
        drawn = weights.float().sum(dim=2)  # (B, nkv, S)
        if layer not in self._chunk:
            self.score[layer, :, :, : drawn.size(-1)] += drawn
            return
        keys, values, pos = self._chunk.pop(layer)
        score = torch.cat([self.score[layer, :, :, : self._filled_before],
                           torch.zeros_like(pos[..., self._filled_before:], dtype=torch.float)],
                          dim=-1) + drawn  # (B, nkv, filled + T)
        if pos.size(-1) <= self.slots:
            keep = torch.arange(pos.size(-1), device=pos.device).expand_as(pos)  # all of it
        else:
            # The W newest positions, then the H best scores among the rest (a recent key
            # ranks above any score, so top-k picks both at once).
            recent = pos > self.length - 1 - self.recent
            keep = score.masked_fill(recent, float("inf")).topk(self.slots, dim=-1).indices
        n = keep.size(-1)  # (B, nkv, n)
        hs = keys.size(-1)
        at = keep[..., None].expand(*keep.shape, hs)  # (B, nkv, n, hs)
        self.k[layer, :, :, :n] = keys.gather(2, at)
        self.v[layer, :, :, :n] = values.gather(2, at)
        self.pos[layer, :, :, :n] = pos.gather(2, keep)
        self.score[layer, :, :, :n] = score.gather(2, keep)

    def crop(self, length: int) -> None:
        if length == self.length:
            return
        raise RollbackError(
            f"{self.name} cannot crop from {self.length} to {length} positions: the attention "
            "the later tokens drew is summed into every key's score and decided what was "
            "evicted; neither can be taken back")

    @property
    def bytes_held(self) -> int:
        return nbytes(self.k) + nbytes(self.v) + nbytes(self.score) + nbytes(self.pos)
