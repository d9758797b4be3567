"""Prompt compression at prefill: the prompt's keys chosen once, then decoding appends.

The methods deployments try first for a long prompt (NVIDIA kvpress's "presses": one
class per method over one base, applied at prefill) choose once which of the prompt's
keys to keep, and never evict while decoding:

- `SnapKVCache` is `snapkv:B` (SnapKV, Li et al. 2024): the attention the last w prompt
  tokens (the observation window, where a question sits) pay every earlier key, averaged
  over those queries and pooled along the keys (kernel 7, max or average: a kept key
  brings its neighbours), the top B - w per KV head, and the window itself;
- `KnormCache` is `knorm:B` (kvpress's KnormPress): the B keys of lowest L2 norm, which
  draw the most attention (Devoto et al. 2024), no attention needed;
- `RecentCache` is `recent:B`: the B newest prompt keys (with `:sN`, the first N too):
  the simple window the others are measured against.

Each takes `:pyramid` for PyramidKV's per-layer budgets (the first layer keeps most, the
last budget / 20, the same total), else the same budget in every layer.

When. The first forward through a cache (position 0) is the prompt. It attends over all
of its own keys, causally, as it would through the exact cache; at the end of that
layer's forward the prompt is compressed (SnapKV in `observe`, which attention calls with
the weights after `update`; the others in `update`, which needs only the keys). Every
later forward appends after the kept keys, evicting nothing. Only the prompt's forward
computes explicit attention weights (`wants_attention` turns off once the last layer has
compressed): decoding runs SDPA.

Grouped-query attention: the cache holds KV heads, and `observe` gets each KV head's
weights as the mean over the query heads sharing it, so each KV head chooses from the
attention of its own group (kvpress averages over the group the same way).

Positions. A kept key keeps its text position (`key_positions`, per KV head: heads choose
apart) and attention masks by position, the policy of the bounded caches: GPT-2's learned
position is inside the key already, and with RoPE applied before the cache each kept key
carries its own rotation; nothing is re-numbered.

Memory is really freed: at compression each layer allocates its kept keys plus room for
the rest of `max_len`, and the prompt's full keys are dropped. Bytes held: K and V per
kept or appended slot, and its int64 position per KV head (`spec.POSITION_BYTES`).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import Tensor

from kvcache_cli.caches.base import KVCache, RollbackError, nbytes
from kvcache_cli.caches.bounded import _check_step
from kvcache_cli.caches.spec_bounded import layer_budgets
from kvcache_cli.caches.step import Step


class PromptCompressedCache(KVCache):
    """What every prompt-compressing kind shares: the kept keys of each layer in buffers
    allocated once at compression, appended after in place. A subclass only chooses which
    prompt keys to keep (`select`). Decoded position p >= P (the prompt's length) sits in
    slot budget[layer] + p - P, so a crop back to any length >= P is exact.
    """

    needs_weights = False  # select reads the prompt's attention weights (SnapKV)

    def __init__(self, shape, params: dict, max_len: int, batch: int, device,
                 dtype: torch.dtype, name: str):
        if not 0 < max_len <= shape.context:
            raise ValueError(f"max_len {max_len} outside the context window 1..{shape.context}")
        self.shape, self.params, self.max_len, self.batch = shape, params, max_len, batch
        self.device, self.dtype, self.name = device, dtype, name
        self.reset()

    @classmethod
    def build(cls, spec, shape, *, max_len: int, batch: int, device, dtype, whole: bool):
        return cls(shape, dict(spec.params), max_len, batch, device, dtype, str(spec))

    def reset(self) -> None:
        L = self.shape.n_layer
        self.length = 0
        self.bytes_copied = 0
        self.prompt_len = 0  # set by the prompt's forward
        self.budgets: tuple[int, ...] = ()  # keys each layer kept of the prompt
        self.compress_ms = 0.0  # the selection and copies, all layers, device synced
        self.k: list[Tensor | None] = [None] * L  # (B, nkv, kept + room, hs) once compressed
        self.v: list[Tensor | None] = [None] * L
        self.pos: list[Tensor | None] = [None] * L  # (B, nkv, kept + room) text positions
        self._prompt: dict[int, tuple[Tensor, Tensor]] = {}  # layer -> k, v awaiting observe
        self._held: list[Tensor | None] = [None] * L  # key positions of the last update
        self.wants_attention = self.needs_weights  # until the last layer has compressed

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, step: Step) -> Tensor:
        """The prompt attends over all of itself, in order (its weights observed where the
        method ranks by them); later tokens over the kept keys, masked by their positions."""
        keys, values = self.update(layer, step.start, k, v)  # (B, nkv, S, hs)
        held = self.key_positions(layer)  # None for the prompt: key j is position j
        if self.wants_attention:
            mask = (step.causal_mask(q.size(2), keys.size(2), q.device) if held is None
                    else step.visible(held))
            y, weights = step.weighted(q, keys, values, mask)
            self.observe(layer, weights)
            return y
        if held is None:
            return step.in_order(q, keys, values)
        return step.by_position(q, keys, values, held)

    def update(self, layer: int, start_pos: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        T = k.size(2)
        start, end = _check_step(self, layer, start_pos, T)
        if layer == 0:
            self.length = end
        if start == 0:
            # The prompt: it attends over all of itself (key j is position j), then is
            # compressed, here or once its weights are observed.
            if layer == 0:
                self.prompt_len = T
                self.budgets = layer_budgets(self.params, T, self.shape.n_layer)
            self._held[layer] = None
            if self.needs_weights:
                self._prompt[layer] = k, v
            else:
                self._compress(layer, k, v, None)
            return k, v
        n = self.budgets[layer] + start - self.prompt_len  # this layer's slots before the step
        self.k[layer][:, :, n:n + T] = k
        self.v[layer][:, :, n:n + T] = v
        self.pos[layer][:, :, n:n + T] = torch.arange(start, end, device=k.device)
        self.bytes_copied += nbytes(k) + nbytes(v)
        self._held[layer] = self.pos[layer][:, :, :n + T]  # (B, nkv, n + T)
        return self.k[layer][:, :, :n + T], self.v[layer][:, :, :n + T]

    def observe(self, layer: int, weights: Tensor) -> None:
        # weights (B, nkv, T, T): the prompt's attention, each KV head's group averaged.
        if layer in self._prompt:
            k, v = self._prompt.pop(layer)
            self._compress(layer, k, v, weights)
            if layer == self.shape.n_layer - 1:
                self.wants_attention = False  # decoding needs no weights: SDPA again

    def _compress(self, layer: int, k: Tensor, v: Tensor, weights: Tensor | None) -> None:
        _sync(k)
        began = time.perf_counter()
        B, nkv, T, hs = k.shape
        keep = self.budgets[layer]
        if keep >= T:
            chosen = torch.arange(T, device=k.device).expand(B, nkv, T)
        else:
            chosen = self.select(k, weights, keep)  # (B, nkv, keep)
        chosen = chosen.sort(dim=-1).values  # kept in text order
        slots = keep + self.max_len - T  # the kept keys, then room for every later token
        self.k[layer] = k.new_zeros((B, nkv, slots, hs))  # (B, nkv, slots, hs)
        self.v[layer] = v.new_zeros((B, nkv, slots, hs))
        self.pos[layer] = torch.full((B, nkv, slots), -1, device=k.device)  # (B, nkv, slots)
        at = chosen[..., None].expand(B, nkv, keep, hs)  # (B, nkv, keep, hs)
        self.k[layer][:, :, :keep] = k.gather(2, at)
        self.v[layer][:, :, :keep] = v.gather(2, at)
        self.pos[layer][:, :, :keep] = chosen  # the prompt starts at 0: index = position
        self.bytes_copied += 2 * nbytes(k[:, :, :keep])
        _sync(k)
        self.compress_ms += (time.perf_counter() - began) * 1e3

    def select(self, k: Tensor, weights: Tensor | None, keep: int) -> Tensor:
        """Indices (B, nkv, keep) of the prompt keys k (B, nkv, T, hs) to keep."""
        raise NotImplementedError

    def kept(self, layer: int) -> Tensor:
        """The prompt positions `layer` kept, (B, nkv, budget), in text order per KV head."""
        return self.pos[layer][:, :, :self.budgets[layer]]

    @property
    def prompt_bytes(self) -> int:
        """Bytes the compressed prompt holds: K, V and the position of each kept key, the
        room allocated for later tokens left out (`bytes_held` counts it)."""
        return sum(nbytes(t[:, :, :keep]) for layer, keep in enumerate(self.budgets)
                   for t in (self.k[layer], self.v[layer], self.pos[layer]))

    def key_positions(self, layer: int) -> Tensor | None:
        return self._held[layer]

    def crop(self, length: int) -> None:
        if length == self.length:
            return
        if length == 0:
            self.reset()
            return
        if not self.prompt_len <= length <= self.length:
            raise RollbackError(
                f"{self.name} cannot crop from {self.length} to {length} positions: the "
                f"prompt's {self.prompt_len:,} tokens were compressed and the keys it "
                f"dropped are gone; expected {self.prompt_len}..{self.length} (or 0)")
        self.length = length  # the next write lands in the first rejected slot

    @property
    def bytes_held(self) -> int:
        return sum(nbytes(t) for t in (*self.k, *self.v, *self.pos) if t is not None)


def _sync(t: Tensor) -> None:
    """Wait for the device, so the clock times the work and not its queueing."""
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


class SnapKVCache(PromptCompressedCache):
    """SnapKV: keys ranked by what the observation window's queries pay them, pooled."""

    needs_weights = True

    def select(self, k: Tensor, weights: Tensor | None, keep: int) -> Tensor:
        B, nkv, T, _ = k.shape
        w = min(self.params["window"], keep)  # the window is kept, inside the budget
        # What the window's queries pay each earlier key, averaged over the queries.
        paid = weights[:, :, T - w:, : T - w].float().mean(dim=2)  # (B, nkv, T - w)
        kernel = self.params["kernel"]
        pool = F.max_pool1d if self.params["pool"] == "max" else F.avg_pool1d
        # Pooling keeps a kept key's neighbours too: an answer spans several tokens.
        pooled = pool(paid.reshape(B * nkv, 1, T - w), kernel, stride=1,
                      padding=kernel // 2).reshape(B, nkv, T - w)  # (B, nkv, T - w)
        top = pooled.topk(keep - w, dim=-1).indices  # (B, nkv, keep - w)
        window = torch.arange(T - w, T, device=k.device).expand(B, nkv, w)  # (B, nkv, w)
        return torch.cat([top, window], dim=-1)


class KnormCache(PromptCompressedCache):
    """KnormPress: the keys of lowest L2 norm (they draw the most attention)."""

    def select(self, k: Tensor, weights: Tensor | None, keep: int) -> Tensor:
        norm = k.float().norm(dim=-1)  # (B, nkv, T)
        return (-norm).topk(keep, dim=-1).indices  # (B, nkv, keep)


class RecentCache(PromptCompressedCache):
    """The newest keys of the prompt (and the first `sinks`): a window, chosen once."""

    def select(self, k: Tensor, weights: Tensor | None, keep: int) -> Tensor:
        B, nkv, T, _ = k.shape
        sinks = min(self.params["sinks"], keep)
        first = torch.arange(sinks, device=k.device)
        last = torch.arange(T - (keep - sinks), T, device=k.device)
        return torch.cat([first, last]).expand(B, nkv, keep)  # (B, nkv, keep)
