"""Attention over a quantised cache's codes, or a half-precision cache's numbers, in one C++
kernel (`code_attention.cpp`); and the new tokens' per-token codes, stored in one call.

A decoding token's attention reads every cached key and value once: what decides its time
is how many bytes it reads and what it does to each. In torch the integer caches had to
turn their codes into float32 first (a copy a chunk at a time, then float products), which
cost more than SDPA reading float32 outright; this kernel reads the codes as bytes (where
the CPU has AVX2 or AVX-512, the common keys' codes multiply the query rounded to 16-bit
words as integers, and 4-bit values the weights so rounded: `code_attention_simd.h` says how
close), folds the scales into the query and the weights, and keeps the softmax's partial
sums (flash-decoding's m, l, acc), so the full-precision sinks and tail merge in exactly. A
static cache's buffers are read the same way (`attend_decode`): float32, or a half-precision
cache's 2 bytes a number (`caches.half`), each row widened to float32 as it is read, so no
float32 copy of the history is made; and the new token's key and value are written in and
the softmax finished in the same call, one call a layer where SDPA's path was 28 torch ops
(the slice writes, the slices, SDPA's own, the transposes).

A quantised cache's decoding token is one call a layer too (`decode_codes`): int8's default
(per-token keys, no residual) quantises the new key and value straight into the code rows
(`quantise_tokens`' arithmetic, bit for bit), a cache with a residual window has put the
token in its tail first; then the queries, read as views of the q|k|v product, over sinks,
codes and tail, the softmax finished where `merge_heads` reads it. What it replaced (the
query's scaling and reshape, the appends, the partial sums' division, the wrapper's checks)
cost more a layer at SmolLM2's shape than the kernel's own gap to fp16's step. Its
arguments are one struct the layer keeps (`DecodeCall`), rewritten where a step changes them:
ctypes converting 40 arguments a call took as long as the attention over a short history.

Storing a decoding token's codes took some twenty small torch ops a layer (the groups'
minimum and maximum, the float16 rounding of scale and zero point, round, clamp, pack, an
append per tensor), a fixed cost a step that no context length amortises; `quantise_tokens`
does the same arithmetic in one pass, bit for bit, straight into the cache's buffers.

It is built at first use with the machine's C++ compiler (`caches.native`; some 30 s
of CPU where its vector path is compiled, once per CPU and compiler) and loaded with
ctypes. Where it cannot be built (no compiler, another CPU), `kernel()` is None, `NOTE`
says why in one line, and the caches keep their torch path; `KVCACHE_CODE_ATTENTION=torch`
asks for that path, to time one against the other.
"""

from __future__ import annotations

import ctypes
import operator
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

from kvcache_cli.caches import native

SOURCE = Path(__file__).with_name("code_attention.cpp")
NOTE: list[str] = []  # why the kernel is not in use, once it was asked for


@cache
def kernel() -> ctypes.CDLL | None:
    """The built kernel, or None (and a line in NOTE) where it cannot be built here."""
    lib, why = load()
    if lib is None:
        NOTE.append(f"attention over codes runs in torch: {why}")
    return lib


def load(defines: tuple[str, ...] = ()) -> tuple[ctypes.CDLL | None, str | None]:
    """(the kernel built with `defines`, None), or (None, why not). `-DCODE_ATTENTION_SCALAR`
    builds its plain loops, which a CPU without AVX2 (or a head size not a multiple of the
    vector's lanes) runs, and `-DCODE_ATTENTION_AVX2` keeps an AVX-512 CPU to AVX2's lanes,
    so every path is tested and timed on one machine."""
    lib, why = native.build(SOURCE, off="KVCACHE_CODE_ATTENTION", defines=defines)
    if lib is None:
        return None, why
    lib.attend_codes.restype = ctypes.c_int
    lib.attend_codes.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 12 + \
        ([ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2) * 2 + [ctypes.c_int64] + \
        [ctypes.c_void_p] * 3
    lib.attend_decode.restype = ctypes.c_int
    lib.attend_decode.argtypes = ([ctypes.c_void_p] + [ctypes.c_int64] * 2) * 3 + \
        [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 6 + [ctypes.c_void_p] + \
        [ctypes.c_int64] * 2 + [ctypes.c_void_p]
    lib.decode_codes.restype = ctypes.c_int
    lib.decode_codes.argtypes = [ctypes.POINTER(DecodeArgs)]
    lib.quantise_tokens.restype = ctypes.c_int
    lib.quantise_tokens.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 6 + \
        [ctypes.c_void_p, ctypes.c_int64] * 3
    return lib, None


def attend_codes(qr: Tensor, k_codes: Tensor, k_scale: Tensor, k_zero: Tensor,
                 v_codes: Tensor, v_scale: Tensor, v_zero: Tensor, bits: int, G: int,
                 per_channel: bool, full: tuple[Tensor, ...] = ()
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """Softmax partial sums over the quantised tokens, for queries qr (B, nkv, g, hs) in
    float32, already scaled by 1 / sqrt(hs) (and rotated where the codes are):
    m, l (B, nkv, g) and acc (B, nkv, g, hs), with y = acc / l over these tokens alone.
    Codes (B, nkv, n, hs * bits / 8) uint8; key scales and zeros (B, nkv, n, hs / G) per
    token or (B, nkv, n / G, hs) per channel, value ones (B, nkv, n, hs / G), float16;
    each a view whose rows (the token axis) are contiguous. `full`: the sinks' keys and
    values and the tail's, (B, nkv, s, hs) and (B, nkv, t, hs) in one of FULL_FLAGS'
    dtypes, read with the same queries in the same pass; y is then over every token."""
    B, nkv, g, hs = qr.shape
    n = k_codes.size(2)
    q = qr.contiguous()
    m = q.new_empty(B, nkv, g)
    l_sum = q.new_empty(B, nkv, g)
    acc = q.new_empty(B, nkv, g, hs)
    for t in (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero):
        # rows of one (b, h) reached by one stride: true of the growing buffers' views
        assert t.stride(-1) == 1 and t.stride(0) == nkv * t.stride(1), t.stride()
    none = (k_codes[:, :, :0], k_codes[:, :, :0], 0)  # n 0
    sink_k, sink_v, sink_row = _stored(*full[:2]) if full else none
    tail_k, tail_v, tail_row = _stored(*full[2:]) if full else none
    status = kernel().attend_codes(
        q.data_ptr(), k_codes.data_ptr(), k_scale.data_ptr(), k_zero.data_ptr(),
        v_codes.data_ptr(), v_scale.data_ptr(), v_zero.data_ptr(),
        k_codes.stride(1), v_codes.stride(1), k_scale.stride(1), v_scale.stride(1),
        B * nkv, n, g, hs, bits, G, int(per_channel), torch.get_num_threads(),
        sink_k.data_ptr(), sink_v.data_ptr(), sink_row, sink_k.size(2),
        tail_k.data_ptr(), tail_v.data_ptr(), tail_row, tail_k.size(2),
        FULL_FLAGS.get(tail_k.dtype, 0),
        m.data_ptr(), l_sum.data_ptr(), acc.data_ptr())
    if status:
        raise ValueError(f"attention over codes: {bits}-bit codes are not supported")
    return m, l_sum, acc


# The half-precision storage the kernel reads, by the flag it takes; and float32, which a
# quantised cache's sinks and tail may be kept in beside its codes.
HALF_FLAGS = {torch.float16: 0, torch.bfloat16: 1}
FULL_FLAGS = {**HALF_FLAGS, torch.float32: 2}


def _stored(*pair: Tensor) -> tuple[Tensor, Tensor, int]:
    """Keys, values (B, nkv, n, hs) as the kernel reads them, and the elements from one row
    (b, h) to the next, row (b, h) at (b * nkv + h) * that: a row's tokens contiguous, rows
    one stride apart (a contiguous tensor, or the filled part of a tail's buffer, read in
    place); both copied contiguous where they are not (a sink sliced from a prefill's keys)."""
    B, nkv, n, hs = pair[0].shape
    if pair[0].is_contiguous() and pair[1].is_contiguous():  # the common case, checked in C
        return pair[0], pair[1], n * hs

    def row_stride(t: Tensor) -> int | None:  # size-1 dimensions' strides do not count
        if t.stride(3) != 1 or (n > 1 and t.stride(2) != hs):
            return None
        if B * nkv == 1:
            return n * hs
        row = t.stride(1) if nkv > 1 else t.stride(0)
        even = B == 1 or nkv == 1 or t.stride(0) == nkv * row
        return row if even and row >= n * hs else None

    rows = {row_stride(t) for t in pair}
    if None in rows or len(rows) > 1:
        return pair[0].contiguous(), pair[1].contiguous(), n * hs
    return pair[0], pair[1], rows.pop()


def attend_decode(q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor,
                  pos: Tensor, ring: bool = False) -> Tensor:
    """A decoding step's attention (B, nh, 1, hs), float32, in one call: the new token's k,
    v (B, nkv, 1, hs) float32 written into the buffers keys, values (B, nkv, slots, hs),
    contiguous, float32 or half (FULL_FLAGS), at slot start = pos[0] (rounded as torch's
    cast rounds), then queries q (B, nh, 1, hs) over slots 0 .. start, query head h on KV
    head h // (nh / nkv), scaled by 1 / sqrt(hs). With `ring`, the buffers are a sliding
    window's ring (no sinks, no spare slots): the token goes to slot start % slots and the
    queries read every filled slot, min(start + 1, slots). The kernel reads the position
    from pos (int64, the step's positions), so the call's arguments are the same at every
    position (`generate.ReplayedDecode` runs it again). q, k, v may be any views whose last
    axis is contiguous (the q|k|v product's heads); `merge_heads` reads the result as a
    view."""
    if pos.dtype != torch.int64:
        raise ValueError(f"decode attention reads its position as int64; got {pos.dtype}")
    B, nh, _, hs = q.shape
    nkv, slots = keys.shape[1:3]
    # (B, nh, 1, hs): one op to dispatch; merge_heads' transpose and reshape of it are views
    y = torch.empty(B, nh, 1, hs, dtype=torch.float32)
    status = kernel().attend_decode(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
        v.data_ptr(), v.stride(0), v.stride(1), keys.data_ptr(), values.data_ptr(), slots,
        FULL_FLAGS[keys.dtype], B, nh, nkv, hs, pos.data_ptr(), ring, torch.get_num_threads(),
        y.data_ptr())
    if status:
        raise ValueError(f"decode attention: slot {int(pos[0])} of {slots}, {nh} query heads "
                         f"on {nkv} KV heads, {keys.dtype}")
    return y


# What `decode_codes` writes of the new token, by the flag the kernel takes.
WRITES = {None: 0, "at": 1}


class DecodeArgs(ctypes.Structure):
    """`decode_codes`' arguments as the kernel takes them, one struct (code_attention.cpp's
    `DecodeArgs`, field for field): ctypes converts each argument of a call, and 40 of them
    took as long as the kernel's work over a short history."""

    _fields_ = [(name, ctypes.c_void_p if pointer else ctypes.c_int64) for name, pointer in (
        ("q", 1), ("q_b", 0), ("q_h", 0), ("k", 1), ("k_b", 0), ("k_h", 0), ("v", 1),
        ("v_b", 0), ("v_h", 0), ("write", 0), ("kc", 1), ("ks", 1), ("kz", 1), ("vc", 1),
        ("vs", 1), ("vz", 1), ("kc_row", 0), ("vc_row", 0), ("ks_row", 0), ("vs_row", 0),
        ("B", 0), ("nh", 0), ("nkv", 0), ("n", 0), ("hs", 0), ("bits", 0), ("G", 0),
        ("key_channels", 0), ("threads", 0), ("sink_k", 1), ("sink_v", 1), ("sink_row", 0),
        ("s", 0), ("tail_k", 1), ("tail_v", 1), ("tail_row", 0), ("t", 0), ("fmt", 0),
        ("y", 1), ("at", 1), ("residual", 0), ("chunk", 0))]


class DecodeCall:
    """One layer's `decode_codes` arguments, kept between its steps: what the buffers fix
    (their addresses and strides, the sinks, the shape) is written when they change (a
    capacity's growth), and a step writes only its own (q, k, v, n, t, what to write)."""

    def __init__(self):
        self.args = DecodeArgs()
        self.buffers: tuple[Tensor, ...] = ()  # the rows and full it was prepared for
        self.kept: tuple[Tensor, ...] = ()  # what `args` points into, copies included
        self.tail_in_place = False

    def prepare(self, rows: tuple[Tensor, ...], full: tuple[Tensor, ...], bits: int, G: int,
                per_channel: bool) -> None:
        a = self.args
        kc, ks, kz, vc, vs, vz = rows
        sink_k, sink_v, a.sink_row = _stored(*full[:2])
        tail_k, tail_v, a.tail_row = _stored(*full[2:])
        self.tail_in_place = tail_k.data_ptr() == full[2].data_ptr()  # not a copy
        a.kc, a.ks, a.kz, a.vc, a.vs, a.vz = (r.data_ptr() for r in rows)
        a.kc_row, a.vc_row, a.ks_row, a.vs_row = kc.stride(1), vc.stride(1), ks.stride(1), \
            vs.stride(1)
        a.B, a.nkv, a.hs = kc.size(0), kc.size(1), tail_k.size(3)
        a.bits, a.G, a.key_channels = bits, G, int(per_channel)
        a.sink_k, a.sink_v, a.s = sink_k.data_ptr(), sink_v.data_ptr(), sink_k.size(2)
        a.tail_k, a.tail_v, a.fmt = tail_k.data_ptr(), tail_v.data_ptr(), \
            FULL_FLAGS[tail_k.dtype]
        self.buffers, self.kept = rows + full, (sink_k, sink_v, tail_k, tail_v)


def decode_codes(q: Tensor, k: Tensor, v: Tensor, rows: tuple[Tensor, ...], n: int,
                 bits: int, G: int, per_channel: bool, write: str | None,
                 full: tuple[Tensor, Tensor, Tensor, Tensor], t: int,
                 prepared: DecodeCall | None = None,
                 placed: tuple[Tensor, int, int] | None = None) -> Tensor:
    """A quantised cache's decoding step of one layer (B, nh, 1, hs), float32, in one call,
    as `attend_decode` is a static cache's. rows: the code and scale buffers k_codes,
    k_scale, k_zero, v_codes, v_scale, v_zero, each (B, nkv, capacity, width) with rows
    (the token axis) contiguous, n of their tokens filled. The new token's k, v (B, nkv, 1,
    hs) float32 are written by `write`: "at", where its position puts them, placed = (pos,
    residual, chunk): the step's positions (int64, read by the kernel, so the call is the
    same at every position and `generate.ReplayedDecode` runs it again) and how the cache
    keeps tokens past the s sinks (full), the newest `residual` in the tail (rounded as
    torch's cast rounds) and the rest quantised `chunk` at a time; n and t are then the
    kernel's to find, a token quantised at once or a chunk that fills the tail quantised in
    the same call (`quantise_tokens`' and `QuantizedCache._flush`'s codes, bit for bit), and
    the caller records the counts (`QuantizedCache.advance`); None, put in the tail by the
    caller. Then the queries q
    (B, nh, 1, hs) over the codes, full = (sink_k, sink_v, tail_k, tail_v), the sinks (B,
    nkv, s, hs) and the tail's buffers (B, nkv, capacity, hs) with t of their tokens filled
    (no view to make: a slice is a torch op a layer), query head h on KV head h // (nh /
    nkv), scaled by 1 / sqrt(hs), the softmax finished. q, k, v may be any views whose last axis is
    contiguous (the q|k|v product's heads); `merge_heads` reads the result as a view.
    `prepared`: the layer's arguments from its last step, written again only where these
    buffers are not the ones they point into."""
    B, nh, _, hs = q.shape
    call = prepared or DecodeCall()
    if not (call.buffers and all(map(operator.is_, rows + full, call.buffers))):
        call.prepare(rows, full, bits, G, per_channel)
    if write == "at" and not call.tail_in_place:
        raise ValueError(f"decoding over codes: a tail of strides {full[2].stride()} cannot "
                         "be written in place")
    a = call.args
    y = torch.empty(B, nh, 1, hs, dtype=torch.float32)  # (B, nh, 1, hs)
    a.q, a.q_b, a.q_h = q.data_ptr(), q.stride(0), q.stride(1)
    a.k, a.k_b, a.k_h = k.data_ptr(), k.stride(0), k.stride(1)
    a.v, a.v_b, a.v_h = v.data_ptr(), v.stride(0), v.stride(1)
    a.nh, a.write, a.n, a.t, a.y = nh, WRITES[write], n, t, y.data_ptr()
    a.threads = torch.get_num_threads()
    if write == "at":
        pos, a.residual, a.chunk = placed
        a.at, a.n, a.t = pos.data_ptr(), 0, 0  # the kernel's: no number that moves a step
    if kernel().decode_codes(ctypes.byref(a)):
        raise ValueError(f"decoding over codes: {bits}-bit codes in groups of {G} of {hs}, "
                         f"{nh} query heads on {a.nkv} KV heads, write {write}, "
                         f"{full[2].dtype} tail of {t}: not supported")
    return y


def quantise_tokens(x: Tensor, codes: Tensor, scale: Tensor, zero: Tensor, bits: int,
                    G: int) -> None:
    """`affine._Tokens.encode` of x (B, nkv, T, hs) written in place, bit for bit: codes
    (B, nkv, T, hs * bits / 8) uint8, scale and zero (B, nkv, T, hs / G) float16, each a
    view whose rows (the token axis) are contiguous, as `int_layer.Rows.claim` hands them out."""
    B, nkv, T, hs = x.shape
    x = (x if x.dtype == torch.float32 else x.float()).contiguous()  # (B, nkv, T, hs):
    # row b * nkv + h at (b * nkv + h) * T * hs
    for t in (codes, scale, zero):
        assert t.stride(-1) == 1 and t.stride(-2) == t.size(-1) and \
            t.stride(0) == nkv * t.stride(1), t.stride()
    status = kernel().quantise_tokens(
        x.data_ptr(), T * hs, B * nkv, T, hs, bits, G, codes.data_ptr(), codes.stride(1),
        scale.data_ptr(), scale.stride(1), zero.data_ptr(), zero.stride(1))
    if status:
        raise ValueError(f"quantising tokens: {bits}-bit codes in groups of {G} of {hs} "
                         "are not supported")
