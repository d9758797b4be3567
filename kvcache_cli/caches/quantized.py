"""Quantised KV caches: integer (int8, int4, int2) here, floating point (fp8) in `fp8`, and
serve's paged pool in `quantized_pool`; this docstring holds the design all three share.
What each costs in quality and bytes is measured in docs/caches.md, what it costs in time
in docs/bench.md.

Integer kinds store affine codes, x ~ q * scale + zero, with q in 0 .. 2^bits - 1, one
scale and one zero point per group of G numbers, both in float16 (2 bytes each; KIVI's
and transformers' choice). The zero point is the group's minimum (rounded down to
float16) and the scale its range / (2^bits - 1) (rounded up), so every number of the
group lies inside the grid and dequantises within scale / 2 of itself.

- values are quantised per token: groups of G channels of one token (G divides hs);
- keys per token (`ktok`, the same) or per channel (`kchan`, KIVI): a group is one
  channel across G consecutive tokens, so keys are quantised G tokens at a time once a
  group is complete; outlier channels then get scales of their own;
- the newest R tokens (`rN`, the residual) stay at the model's precision (KIVI,
  transformers' QuantizedCache), and so do the first S (`sN`, the attention sinks);
  with kchan the residual holds R .. R + G - 1 tokens (a group leaves it once complete);
- codes are bit-packed along the head dimension, 8 / bits per byte, so `bytes_held` is
  what memory holds: payload + scales + zero points + the full-precision tokens;
- `rot` rotates keys and values by a normalised Hadamard matrix H before they are
  quantised and by H.T after they are dequantised (`rotation`): the same numbers in exact
  arithmetic, with an outlier channel spread over the whole head before rounding. Only
  what is quantised is rotated: sinks and the residual stay bit for bit. Per-channel key
  groups are then groups of rotated channels. H (hs x hs float32, 16 KiB at hs 64) is a
  constant shared by every layer, like fp8's lookup table, and not in `bytes_held`:
  the rotation changes no byte of the formula below.

Spec grammar (fields in any order, each at most once):

    int8[:gN][:kchan|ktok][:rN][:sN][:rot]   default int8:g32:ktok:r0 (no rotation)
    int4[:gN][:kchan|ktok][:rN][:sN][:rot]   default int4:g32:kchan:r128
    int2[:gN][:kchan|ktok][:rN][:sN][:rot]   default int2:g32:kchan:r128
    fp8-e4m3[:tensor|head][:one|calib][:rot] default fp8-e4m3:tensor:one (alias fp8)
    fp8-e5m2[:tensor|head][:one|calib][:rot] default fp8-e5m2:tensor:one
    paged-int8[:bN], paged-int4[:bN], paged-fp8[:bN]: serve's block pool, quantised

Bytes one layer holds for one sequence of n tokens, kv heads, head width hs, model
element size e (`spec.layer_bytes`, equal to `bytes_held` per layer and row):

    s = min(n, S); Tq = floor(max(0, n - s - R) / c) * c, c = G for kchan else 1
    t = n - s - Tq                                        (the full-precision tail)
    2 * kv * Tq * hs * bits / 8                           payload, K and V
    + kv * Tq * (hs / G) * 4                              V scales + zeros (fp16)
    + kv * Tq * (hs / G) * 4   (ktok) | kv * (Tq / G) * hs * 4 (kchan)  K scales + zeros
    + 2 * kv * (s + t) * hs * e                           sinks, residual, tail

fp8 kinds store `x / scale` as torch's float8 (e4m3: 3 mantissa bits, range 448; e5m2:
2 bits, range 57344), one float32 scale per tensor (a layer's K, and its V, of one
sequence) or per head: 1.0 (`one`, vLLM's default) or calibrated on the prompt, the
first write (`calib`: amax / the format's max). Numbers beyond the range saturate at
it (vLLM clamps too) and are counted in `saturated` (with `rot`: the rotated numbers,
which the scales are calibrated on). Bytes: 2 * kv * n * hs + 8 per tensor or 8 * kv
per head.

`update` returns the sinks, the dequantised codes and the tail at the model's dtype, made
afresh (transient, not counted in `bytes_held`): what a prefill, a chunk of draft tokens
or a caller outside attention reads. A decoding token's attention does not: `attend`
reads the codes where they lie, their scales folded into the query and the weights, so
no float copy of the history is made at every step. On the CPU it runs in one C++ kernel
(`code_attention`, built at first use), which reads the codes as bytes once, because
converting every code to float first cost more than reading a float cache outright; a
float32 decoding token's whole layer (its store, the attention, the softmax's finish) is
one call of it (`QuantizedCache._decode`), as fp16's is (`StaticCache.decode`); on
another device, or where the kernel cannot be built (or `KVCACHE_CODE_ATTENTION=torch`),
in torch a chunk of `ATTEND_CHUNK` tokens at a time (`QuantizedCache._attend`). The
integer kinds' codes, scales and full-precision tail grow in place (`int_layer.Rows`), from
room for the cache's max_len tokens; fp8 and the paged pool still read the whole copy. Where every
held token lies where its position puts it (the sinks full; not so for a while after a crop
into the residual), the call itself writes the token, and quantises the chunk that fills the
tail, reading the position from the step: the same call at every position, so `generate`
replays an integer cache's steps as it does a static cache's (`buffers`, `advance`).

`crop(n)` (speculative decoding's rollback): exact when the forgotten tokens are all
full-precision; it may also cut into the quantised part where a cut leaves every kept
group whole (per-token groups always; per-channel key groups at a group boundary), and
the kept tokens read exactly as before. A cut inside a per-channel key group raises
RollbackError: those keys were quantised with scales that saw the forgotten tokens.

The paged pool (`quantized_pool.QuantPagedCache`, serve's `--kv-dtype`) quantises every
token as it is written (keys and values per token, one group per head: one scale and zero
point per head and token), since a block's tokens arrive one step at a time; fp8 blocks use
scale 1.0. Its block bytes come from the same `layer_bytes`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kvcache_cli.caches import code_attention
from kvcache_cli.caches.affine import _Channels, _Tokens, unpack
from kvcache_cli.caches.base import KVCache, RollbackError, nbytes
from kvcache_cli.caches.int_layer import BUFFER, IntLayer
from kvcache_cli.caches.rotation import Rotation
from kvcache_cli.caches.spec_quantized import check_head_dim
from kvcache_cli.caches.step import Step

# Quantised tokens one decoding step converts to float at a time (`QuantizedCache._attend`):
# SmolLM2's 3 KV heads of 64 make a chunk 1.5 MiB of float32, inside a core's 2 MiB L2
# here. Fewer, larger chunks cost less dispatch (30 layers, two passes each); 1,024 to
# 8,192 were tried on one layer at 8,192 tokens (1 thread, a loaded machine, so only to
# choose) and 2,048 was among the fastest for int8 and int4. Rounded to whole groups.
ATTEND_CHUNK = 2048

class _KeyFold:
    """q.k for affine keys without dequantising them: k = c * s + z per group, so
    q.k = sum over groups of s * (q_group . c_group) + z * sum(q_group). Made once a
    step per layer from the (scaled) queries qr (B, nkv, g, hs)."""

    def __init__(self, qr: Tensor, G: int, per_channel: bool):
        B, nkv, g, hs = qr.shape
        self.qr, self.G, self.per_channel = qr, G, per_channel
        if not per_channel:
            J = hs // G  # groups in a key
            parts = qr.view(B, nkv, g, J, G)
            # (B, nkv, hs, J*g): group j's queries in rows j*G.., columns j*g..; zeros off
            # the diagonal, so one product gives every group's partial dot products.
            eye = torch.eye(J, device=qr.device)
            self.blocks = torch.einsum("bkgjd,jl->bkjdlg", parts, eye).reshape(B, nkv, hs, J * g)
            self.sums = parts.sum(-1)  # (B, nkv, g, J)

    def scores(self, codes: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
        """(B, nkv, g, c) for codes (B, nkv, c, hs) float32 and their key scales."""
        B, nkv, c, hs = codes.shape
        g, G = self.qr.size(2), self.G
        if self.per_channel:  # scale, zero (B, nkv, c/G, hs): one per channel and G tokens
            folded = self.qr[:, :, None] * scale[:, :, :, None].float()  # (B, nkv, c/G, g, hs)
            raw = codes.view(B, nkv, c // G, G, hs) @ folded.transpose(-1, -2)  # (.., G, g)
            offset = zero.float() @ self.qr.transpose(-1, -2)  # (B, nkv, c/G, g)
            return (raw + offset[:, :, :, None]).view(B, nkv, c, g).transpose(-1, -2)
        J = hs // G  # scale, zero (B, nkv, c, J): one per token and G channels
        parts = (codes @ self.blocks).view(B, nkv, c, J, g)  # each group's q . c
        raw = (parts * scale.float()[..., None]).sum(-2)  # (B, nkv, c, g)
        return (raw + zero.float() @ self.sums.transpose(-1, -2)).transpose(-1, -2)


def _value_sum(p: Tensor, codes: Tensor, scale: Tensor, zero: Tensor, G: int) -> Tensor:
    """sum over tokens of p * v for per-token affine values v = c * s + z, without
    dequantising them: the scales fold into the weights, p * s (a few numbers a token).
    p (B, nkv, g, c), codes (B, nkv, c, hs) float32, scale and zero (B, nkv, c, hs/G)."""
    B, nkv, g, c = p.shape
    hs = codes.size(-1)
    J = hs // G
    weighted = p[..., None] * scale.float()[:, :, None]  # (B, nkv, g, c, J)
    weighted = weighted.transpose(-1, -2).reshape(B, nkv, g * J, c)  # rows (g, j)
    full = (weighted @ codes).view(B, nkv, g, J, J, G)  # row j's weights times every group
    out = full.diagonal(dim1=3, dim2=4).transpose(-1, -2)  # (B, nkv, g, J, G): j with j
    offset = p @ zero.float()  # (B, nkv, g, J)
    return (out + offset[..., None]).reshape(B, nkv, g, hs)


def _cat(a: Tensor, b: Tensor) -> Tensor:
    return b if a.size(2) == 0 else torch.cat([a, b], dim=2)


# ---------------------------------------------------------------------------- integer


class QuantizedCache(KVCache):
    """Integer keys and values (int8, int4, int2), affine per group, KIVI's layout."""

    def __init__(self, shape, batch: int, device, dtype: torch.dtype, *, bits: int,
                 group: int, key_axis: str, residual: int, sinks: int, rotate: bool = False,
                 name: str = "", capacity: int = 0):
        check_head_dim(name or f"int{bits}", {"bits": bits, "group": group, "rotate": rotate},
                       shape.head_size)
        self.shape, self.batch, self.device, self.dtype = shape, batch, device, dtype
        self.bits, self.group, self.residual, self.sinks = bits, group, residual, sinks
        self.per_channel = key_axis == "kchan"
        # Tokens leave the tail in chunks: a per-channel key group is G tokens.
        self.chunk = group if self.per_channel else 1
        self.keys = _Channels if self.per_channel else _Tokens
        self.rotation = Rotation(shape.head_size, device) if rotate else None
        self.capacity = capacity  # tokens the codes' buffers hold before they grow
        self.reset()

    @classmethod
    def build(cls, spec, shape, *, max_len: int, batch: int, device, dtype, whole: bool):
        return cls(shape, batch, device, dtype, bits=spec["bits"], group=spec["group"],
                   key_axis=spec["keys"], residual=spec["residual"], sinks=spec["sinks"],
                   rotate=bool(spec["rotate"]), name=str(spec), capacity=max_len)

    def reset(self) -> None:
        c = self.shape
        self.layers = [IntLayer(self.batch, c.n_kv_head, c.head_size, self.bits, self.group,
                                 self.per_channel, self.device, self.dtype, self.capacity,
                                 self.residual + self.chunk)
                       for _ in range(c.n_layer)]
        self.lengths = [0] * c.n_layer
        self.length = 0
        self.bytes_copied = 0

    def update(self, layer: int, start_pos: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self._read(self._store(layer, start_pos, k, v))

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, step: Step) -> Tensor:
        """One decoding token's attention over the history, the quantised part read as
        codes (`_decode` in one call, or `_attend_kernel`, or `_attend` a chunk at a time); a
        chunk of tokens (a prefill, a draft's verification), or, off the one call, a layer
        with nothing quantised yet, reads `update`'s copy under the causal mask."""
        decoding = q.size(2) == 1 and not isinstance(step.start, Tensor)
        if decoding and self._one_call(self.layers[layer], q, k, v):
            return self._decode(layer, q, k, v, step)
        if not decoding or self.layers[layer].quantised == 0:
            keys, values = self.update(layer, step.start, k, v)  # (B, nkv, S, hs)
            return step.in_order(q, keys, values)
        L = self._store(layer, step.start, k, v)
        if L.k_codes.device.type == "cpu" and code_attention.kernel() is not None:
            return self._attend_kernel(L, q)
        return self._attend(L, q)

    def _one_call(self, L: IntLayer, q: Tensor, k: Tensor, v: Tensor) -> bool:
        """Whether `_decode` takes this step: float32 on the CPU, each head's numbers
        contiguous, no gradient to keep (the call writes and reads raw memory), no rotation
        (its query and values' sum are turned in torch), not traced, the kernel built."""
        return self.rotation is None and q.device.type == "cpu" and \
            q.dtype == k.dtype == v.dtype == torch.float32 and \
            L.tails["k"].buf.dtype in code_attention.FULL_FLAGS and \
            q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and \
            not (q.requires_grad or k.requires_grad or v.requires_grad) and \
            not torch.compiler.is_compiling() and code_attention.kernel() is not None

    def _decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor, step: Step) -> Tensor:
        """A decoding token's store and attention (B, nh, 1, hs) in one native call
        (`code_attention.decode_codes`), as `StaticCache.decode` is fp16's. Where the layer
        holds every token where its position puts it (`_placed`), the call writes the token
        there too, the codes or the tail, and quantises the chunk that fills the tail, the
        same bits `_store` writes, reading the position from the step: the same call at
        every position, so a step can be replayed (`buffers`). Otherwise (the sinks filling,
        a crop into the residual, the buffers full) `_store` writes first. The torch ops a
        layer of the appends, the query's scaling and the softmax's finish were a fixed cost
        of every step, larger at SmolLM2's shape than the kernel's arithmetic's gap to fp16's."""
        L = self.layers[layer]
        self._check_append(layer, step.start)
        placed = self._placed(layer)
        if placed:
            self._count_step(layer)
        else:
            self._store(layer, step.start, k, v)
        return code_attention.decode_codes(
            q, k, v, tuple(map(BUFFER, L.code_rows)), L.quantised, self.bits, self.group,
            self.per_channel, "at" if placed else None,
            (L.sink_k, L.sink_v, L.tails["k"].buf, L.tails["v"].buf), L.tails["k"].n, L.call,
            (step.pos, self.residual, self.chunk))

    def _coded(self, m: int) -> int:
        """Of m tokens past the sinks, those held as codes: the whole chunks beyond the
        residual (the rest are the tail)."""
        return (m - self.residual) // self.chunk * self.chunk if m > self.residual else 0

    def _placed(self, layer: int) -> bool:
        """Whether the layer's next decoding token goes where its position puts it
        (`decode_codes`' "at"): the sinks full, the codes and tail as `_coded` has them (a
        crop into the residual leaves fewer in the tail until it is full again), and room in
        the buffers for the token and for the chunk it may make leave."""
        L = self.layers[layer]
        s, tail = L.sink_k.size(2), L.tails["k"]
        m = self.lengths[layer] - s  # tokens past the sinks, before the step
        coded = self._coded(m)
        if s != self.sinks or L.quantised != coded or tail.n != m - coded or \
                tail.capacity <= tail.n:
            return False
        if self._coded(m + 1) == coded:  # no chunk leaves
            return True
        for r, grow in L.chunk_rows:  # a loop: this runs every step at every layer
            if r.n + grow > r.capacity:
                return False
        return True

    def _count_step(self, layer: int) -> None:
        """Count what a placed decoding token's call writes in the layer (`_placed`): the
        token in the codes or the tail, and the chunk that leaves the tail."""
        L = self.layers[layer]
        m = self.lengths[layer] + 1 - L.sink_k.size(2)  # tokens past the sinks, with it
        coded = self._coded(m)
        at_once = self.residual == 0 and self.chunk == 1  # the token straight into the codes
        moved = 0 if at_once else L.tails["k"].grow(1) + L.tails["v"].grow(1)
        if coded > L.quantised:  # the token or a chunk quantised, the tail's rest to its front
            for r, n in L.chunk_rows:
                moved += r.grow(n)
            for r in L.tails.values():
                r.crop(m - coded)
                moved += (m - coded) * r.row_bytes
        self.bytes_copied += moved
        self.lengths[layer] = self.length = self.lengths[layer] + 1

    def advance(self, start_pos: int, T: int) -> None:
        """Count a replayed step's writes in every layer (`KVCache.buffers`): one token each,
        placed by the call."""
        if T != 1 or not all(start_pos == n for n in self.lengths):
            raise ValueError(f"a quantised cache replays one token a step at its length "
                             f"{self.length}; asked for {T} at {start_pos}")
        for layer in range(len(self.layers)):
            self._count_step(layer)

    def buffers(self) -> list[Tensor] | None:
        """Every layer's code and scale rows, sinks and tail buffers, where the next decoding
        token is one call at every layer that reads its position from the step (`_placed`,
        no rotation): its calls can be replayed (`KVCache.buffers`); else None."""
        if self.rotation is not None or not all(map(self._placed, range(len(self.layers)))):
            return None
        return [t for L in self.layers for t in (*map(BUFFER, L.code_rows), L.sink_k,
                                                 L.sink_v, L.tails["k"].buf, L.tails["v"].buf)]

    def _attend_kernel(self, L: IntLayer, q: Tensor) -> Tensor:
        """`_attend` in one C++ kernel (`code_attention`): the codes read as bytes, once,
        and the sinks and the tail in the same pass, so a step's attention is one call.
        With `rot` the codes are read with the rotated query and their values' sum
        unrotated, and merged with the sinks' and the tail's scores here."""
        B, nh, _, hs = q.shape
        nkv = L.tail_k.size(1)
        qg = q.float().view(B, nkv, nh // nkv, hs) / math.sqrt(hs)  # (B, nkv, g, hs)
        codes = (L.k_codes, L.k_scale, L.k_zero, L.v_codes, L.v_scale, L.v_zero, self.bits,
                 self.group, self.per_channel)
        if self.rotation is None and L.tail_k.dtype in code_attention.FULL_FLAGS:
            _, total, acc = code_attention.attend_codes(
                qg, *codes, full=(L.sink_k, L.sink_v, L.tail_k, L.tail_v))  # every token
            return (acc / total[..., None]).view(B, nh, 1, hs).to(q.dtype)
        m, total, acc = code_attention.attend_codes(
            qg if self.rotation is None else self.rotation.rotate(qg), *codes)
        if self.rotation is not None:
            acc = self.rotation.unrotate(acc)
        keys = _cat(L.sink_k, L.tail_k).float()  # (B, nkv, s + t, hs): full precision
        values = _cat(L.sink_v, L.tail_v).float()
        scores = qg @ keys.transpose(-1, -2)  # (B, nkv, g, s + t)
        top = torch.maximum(m, scores.amax(-1)) if scores.size(-1) else m  # (B, nkv, g)
        codes_w = (m - top).exp()  # the codes' sums rescaled to the common maximum
        p = (scores - top[..., None]).exp()  # (B, nkv, g, s + t)
        y = (acc * codes_w[..., None] + p @ values) / (total * codes_w + p.sum(-1))[..., None]
        return y.view(B, nh, 1, hs).to(q.dtype)

    def _check_append(self, layer: int, start_pos: int) -> None:
        if isinstance(start_pos, Tensor) or start_pos != self.lengths[layer]:
            raise ValueError(f"a quantised cache appends: layer {layer} holds "
                             f"{self.lengths[layer]} positions, asked to write at {start_pos}")

    def _store(self, layer: int, start_pos: int, k: Tensor, v: Tensor) -> IntLayer:
        self._check_append(layer, start_pos)
        L = self.layers[layer]
        T = k.size(2)
        room = max(0, self.sinks - L.sink_k.size(2))
        if room:  # the first S positions stay at full precision, never quantised
            L.sink_k, L.sink_v = _cat(L.sink_k, k[:, :, :room]), _cat(L.sink_v, v[:, :, :room])
            k, v = k[:, :, room:], v[:, :, room:]
        self.bytes_copied += L.tails["k"].append(k) + L.tails["v"].append(v)  # (B, nkv, t, hs)
        self._flush(L)
        self.lengths[layer] = start_pos + T
        self.length = self.lengths[layer]
        return L

    def _flush(self, L: IntLayer) -> None:
        """Quantise the oldest tail tokens beyond the residual, whole chunks only."""
        out = (L.tails["k"].n - self.residual) // self.chunk * self.chunk
        if out <= 0:
            return
        k, v = L.tail_k[:, :, :out], L.tail_v[:, :, :out]
        if self.rotation is not None:
            k, v = self.rotation.rotate(k), self.rotation.rotate(v)
        self._encode(L, "k", k, self.keys)
        self._encode(L, "v", v, _Tokens)
        # the rest moves to the front; the most a tail holds between flushes fits the buffer
        self.bytes_copied += sum(r.keep_last(r.n - out, self.residual + self.chunk)
                                 for r in L.tails.values())

    def _encode(self, L: IntLayer, which: str, x: Tensor, axis) -> None:
        """x (B, nkv, T, hs) quantised along `axis` and appended to the layer's `which`
        ("k" or "v") codes and scales. Per-token groups on the CPU go through the kernel's
        `quantise_tokens`, the same codes written in place in one call: a decoding step
        quantises its token in every layer, and a score of small torch ops each time was
        a fixed cost of the step that no context amortised."""
        rows = (L.codes[which], L.scales[f"{which}_scale"], L.scales[f"{which}_zero"])
        if axis is _Tokens and x.device.type == "cpu" and code_attention.kernel() is not None:
            claimed = [r.claim(x.size(2)) for r in rows]  # (view to fill, bytes moved)
            code_attention.quantise_tokens(x, *(view for view, _ in claimed), self.bits,
                                           self.group)
            self.bytes_copied += sum(moved for _, moved in claimed)
            return
        for r, new in zip(rows, axis.encode(x, self.bits, self.group), strict=True):
            self.bytes_copied += r.append(new)

    def _read(self, L: IntLayer) -> tuple[Tensor, Tensor]:
        """What attention reads: sinks, dequantised codes, tail, (B, nkv, n, hs)."""
        if L.quantised == 0:
            return _cat(L.sink_k, L.tail_k), _cat(L.sink_v, L.tail_v)
        B, nkv, s, hs = L.sink_k.shape
        q, n = L.quantised, s + L.quantised + L.tail_k.size(2)
        keys = L.tail_k.new_empty(B, nkv, n, hs)  # (B, nkv, n, hs): transient, not held
        values = L.tail_v.new_empty(B, nkv, n, hs)
        for out, sink, tail in ((keys, L.sink_k, L.tail_k), (values, L.sink_v, L.tail_v)):
            out[:, :, :s], out[:, :, s + q:] = sink, tail
        for out, axis, codes, scale, zero in (
                (keys, self.keys, L.k_codes, L.k_scale, L.k_zero),
                (values, _Tokens, L.v_codes, L.v_scale, L.v_zero)):
            if self.rotation is None:
                axis.decode_into(out[:, :, s:s + q], codes, scale, zero, self.bits, self.group)
            else:  # decoded in float32, un-rotated, then cast once to the model's dtype
                rotated = out.new_empty(B, nkv, q, hs, dtype=torch.float32)
                axis.decode_into(rotated, codes, scale, zero, self.bits, self.group)
                out[:, :, s:s + q] = self.rotation.unrotate(rotated)
        return keys, values

    def _attend(self, L: IntLayer, q: Tensor) -> Tensor:
        """Attention output (B, nh, 1, hs) of one query q (B, nh, 1, hs) over sinks,
        codes and tail, in float32; what SDPA over `_read`'s copy computes, up to the
        order of the sums.

        No float copy of the history is made: the codes are converted ATTEND_CHUNK
        tokens at a time into one small float32 buffer, which the products read while
        it is still in the CPU's cache, so memory is read as codes (a quarter or an
        eighth of float32's bytes). Nor are they dequantised: the scales and zero points
        are folded into the query and the attention weights instead (`_key_scores`,
        `_value_sum`), which are a few numbers a token where a key is hs. The scores of
        every position are kept (nh floats a token) and softmaxed once, then the values
        are read chunk by chunk the same way. With `rot` the query is rotated instead of
        every key (q.(k H^T) = (q H).k), and the values' sum unrotated once.
        """
        B, nh, _, hs = q.shape
        nkv = L.tail_k.size(1)
        g = nh // nkv  # query heads per KV head
        qg = q.float().view(B, nkv, g, hs) / math.sqrt(hs)  # (B, nkv, g, hs)
        qr = qg if self.rotation is None else self.rotation.rotate(qg)  # for rotated codes
        s, n_q = L.sink_k.size(2), L.quantised
        tail = s + n_q  # where the tail's positions start
        scores = qg.new_empty(B, nkv, g, tail + L.tail_k.size(2))  # (B, nkv, g, n)
        scores[..., :s] = qg @ L.sink_k.float().transpose(-1, -2)
        scores[..., tail:] = qg @ L.tail_k.float().transpose(-1, -2)
        G, bits = self.group, self.bits
        chunk = max(ATTEND_CHUNK // G, 1) * G  # whole groups: per-channel keys stay whole
        flat = qg.new_empty(B * nkv * min(chunk, n_q) * hs)  # one chunk's codes, as floats
        kg = G if self.per_channel else 1  # tokens per row of key scales
        keys = _KeyFold(qr, G, self.per_channel)
        for a in range(0, n_q, chunk):
            b = min(a + chunk, n_q)
            codes = flat[:B * nkv * (b - a) * hs].view(B, nkv, b - a, hs)
            codes.copy_(unpack(L.k_codes[:, :, a:b], bits))  # (B, nkv, c, hs) float32
            scores[..., s + a:s + b] = keys.scores(codes, L.k_scale[:, :, a // kg:b // kg],
                                                   L.k_zero[:, :, a // kg:b // kg])
        p = scores.softmax(dim=-1)  # (B, nkv, g, n)
        y = p[..., :s] @ L.sink_v.float() + p[..., tail:] @ L.tail_v.float()  # (B, nkv, g, hs)
        yq = torch.zeros_like(y)
        for a in range(0, n_q, chunk):
            b = min(a + chunk, n_q)
            codes = flat[:B * nkv * (b - a) * hs].view(B, nkv, b - a, hs)
            codes.copy_(unpack(L.v_codes[:, :, a:b], bits))
            yq += _value_sum(p[..., s + a:s + b], codes, L.v_scale[:, :, a:b],
                             L.v_zero[:, :, a:b], G)
        y += yq if self.rotation is None else self.rotation.unrotate(yq)
        return y.view(B, nh, 1, hs).to(q.dtype)

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise RollbackError(f"cannot crop to {length} positions: the cache holds "
                                f"{self.length}; expected 0..{self.length}")
        for L in self.layers:  # check every layer before changing any
            s, q = L.sink_k.size(2), L.quantised
            if self.per_channel and s < length < s + q and (length - s) % self.group:
                first = s + (length - s) // self.group * self.group
                raise RollbackError(
                    f"cannot crop to {length} positions: keys {first}..{first + self.group - 1} "
                    f"were quantised per channel as one group of {self.group} tokens; crop "
                    f"to a group boundary ({first}) or to {s + q} or more (full precision)")
        for i, L in enumerate(self.layers):
            self._crop_layer(L, length)
            self.lengths[i] = length
        self.length = length

    def _crop_layer(self, L: IntLayer, length: int) -> None:
        s, q = L.sink_k.size(2), L.quantised
        keep_s = min(s, length)
        keep_q = min(q, max(0, length - s))
        keep_t = max(0, length - s - q)
        if keep_s < s:  # else the same tensors: a replay's calls still point at them
            L.sink_k, L.sink_v = L.sink_k[:, :, :keep_s], L.sink_v[:, :, :keep_s]
        L.tails["k"].crop(keep_t)
        L.tails["v"].crop(keep_t)
        if keep_q < q:  # whole groups only (checked): the kept rows stay bit for bit
            kg = keep_q // self.group if self.per_channel else keep_q
            L.codes["k"].crop(keep_q)
            L.codes["v"].crop(keep_q)
            for name, n in (("k_scale", kg), ("k_zero", kg), ("v_scale", keep_q),
                            ("v_zero", keep_q)):
                L.scales[name].crop(n)
        # No copy: the tail's and the codes' storage past the cut is written over by the
        # next append and the next flush.

    @property
    def bytes_held(self) -> int:
        return sum(nbytes(t) for L in self.layers for t in L.tensors())
