"""A decode step's small ops, fused: the norms, the residual adds, QK-norm and the rotation,
and the gated activations of the Llama family (Llama, SmolLM2, Gemma 3), each one call.

A decode step of SmolLM2 dispatched about 4,100 torch ops, 30 layers of a few large
products among small ones: each RMSNorm five to eight (pow, mean, add, rsqrt, mul, casts),
the rotation six (slices, neg, cat, mul, add), SwiGLU three, each a few microseconds of the
CPU's time for 576 numbers. `fused.cpp` does each group in one pass: RMSNorm (Llama's gain
w, Gemma's 1 + w), the residual add with the norm after it (Gemma's norm of the sublayer's
output before it too), q's and k's heads normed (Gemma's QK-norm) and rotated in place in
the q|k|v product, and SwiGLU / tanh-GeGLU on the gate|up product.

They run where the native products do (`rows`: float32 rows on the CPU, a decode's few,
no gradient, the library built); everywhere else, and where it cannot be built, the model
keeps its torch ops, which are what these equal to float32 rounding (tests/test_fused.py).
Each eager call goes to the library directly; under torch.compile each is a custom op the
compiler keeps whole (`kvcache::rms_norm`, ...), as the products are.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from kvcache_cli.models.linear import native_rows, whole

SOURCE = Path(__file__).with_name("fused.cpp")
ACTIVATIONS = ("silu", "gelu_tanh")  # the kernel's code for each gated activation: its index
NOTE: list[str] = []  # why the fused ops are not in use, once asked for
_lib: list = []  # the loaded library (or None), once: read by every forward


def library():
    """The fused ops' library (`fused.cpp`, built at first use), or None with a line in
    NOTE: no compiler, or KVCACHE_FUSED=torch (the torch ops, to time one against the
    other). Loaded with the products (`linear.arrange_weights`), before any forward."""
    if not _lib:
        from kvcache_cli.caches import native

        lib, why = native.build(SOURCE, off="KVCACHE_FUSED")
        if lib is None:
            NOTE.append(f"norms, rotation and activations run in torch: {why}")
        else:
            ptr, size, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
            lib.rms_norm.argtypes = [ptr, ptr, f32, f32, ptr, size, size]
            lib.add_rms_norm.argtypes = [ptr] * 4 + [f32, f32, ptr, ptr, size, size]
            lib.qk_rotary.argtypes = ([ptr] + [size] * 5 + [ptr, ptr, f32, f32, ptr, ptr, ptr,
                                                            size, f32])
            lib.glu.argtypes = [ptr, ptr, size, size, ctypes.c_int]
            lib.scale.argtypes = [ptr, f32, ptr, size]
        _lib.append(lib)
    return _lib[0]


def rows(x: Tensor) -> bool:
    """Whether x's rows (..., C) take the fused ops: where the native products take them
    (`linear.native_rows`), the library loaded."""
    return native_rows(x) and bool(_lib) and _lib[0] is not None


def _at(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _eager_or_op(call, op):
    """An eager call goes to the library directly (the custom op's dispatch costs more than
    a norm of 576 numbers); a compiled graph needs the op to keep the call whole."""
    return op if torch.compiler.is_compiling() else call


def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float) -> Tensor:
    """x (..., C) normed to unit root mean square, times offset + weight (C,)."""
    return _eager_or_op(_rms_norm_call, _rms_norm)(whole(x), weight, eps, offset)


def add_rms_norm(x: Tensor, delta: Tensor, delta_weight: Tensor | None, weight: Tensor,
                 eps: float, offset: float) -> tuple[Tensor, Tensor]:
    """(s, s normed with gain offset + weight) for s = x + delta, delta first normed with
    gain offset + delta_weight where given; x, delta (..., C)."""
    run = _eager_or_op(_add_rms_norm_call, _add_rms_norm)
    return run(whole(x), whole(delta), delta_weight, weight, eps, offset)


def add_normed(x: Tensor, delta: Tensor, delta_weight: Tensor, eps: float, offset: float
               ) -> Tensor:
    """x + delta normed with gain offset + delta_weight; x, delta (..., C)."""
    run = _eager_or_op(_add_normed_call, _add_normed)
    return run(whole(x), whole(delta), delta_weight, eps, offset)


def add(x: Tensor, delta: Tensor) -> Tensor:
    """x + delta (..., C), a residual add: on a decode's eager rows one call (so that the
    step is native calls alone, which a replayed step needs: `generate.ReplayedDecode`),
    else torch's add, which a compiled graph fuses with what is around it."""
    if not rows(x) or torch.compiler.is_compiling():
        return x + delta
    x, delta = whole(x), whole(delta)
    s = torch.empty_like(x)
    C = x.shape[-1]
    _lib[0].add_rms_norm(x.data_ptr(), delta.data_ptr(), None, None, 0.0, 0.0, s.data_ptr(),
                         None, x.numel() // C, C)
    return s


def scale(x: Tensor, s: float) -> Tensor:
    """x * s (..., C): Gemma's embedding scale, one call on a decode's eager rows (as `add`),
    else torch's product."""
    if not rows(x) or torch.compiler.is_compiling():
        return x * s
    x = whole(x)
    y = torch.empty_like(x)
    _lib[0].scale(x.data_ptr(), s, y.data_ptr(), x.numel())
    return y


def qk_rotary(qkv: Tensor, nq: int, nk: int, cos: Tensor, sin: Tensor, pos: Tensor,
              q_weight: Tensor | None, k_weight: Tensor | None, offset: float, eps: float,
              q_scale: float) -> None:
    """In place on qkv, contiguous, a q|k|v product's rows as it makes them, (B, T, H * hs)
    (no view to dispatch), or as heads, (B, T, H, hs), H = nq + nk + nv: q's and k's heads
    normed (where weights are given), rotated to their positions pos ((T,) or (B, T), rows
    of the tables cos and sin (ctx, hs), which give the head size), q then times q_scale."""
    if not qkv.is_contiguous():  # a contiguous copy would leave the caller's heads as they were
        raise ValueError(f"qk_rotary rotates a contiguous q|k|v in place; got strides "
                         f"{qkv.stride()} for shape {tuple(qkv.shape)}")
    if pos.dtype != torch.int64:
        pos = pos.long()
    run = _eager_or_op(_qk_rotary_call, _qk_rotary)
    run(qkv, nq, nk, cos, sin, whole(pos), q_weight, k_weight, offset, eps, q_scale)


def glu(gate_up: Tensor, activation: str) -> Tensor:
    """act(gate) * up (..., I) of a gate|up product (..., 2I), gate first; act one of
    ACTIVATIONS."""
    return _eager_or_op(_glu_call, _glu)(whole(gate_up), ACTIVATIONS.index(activation))


def _rms_norm_call(x: Tensor, weight: Tensor, eps: float, offset: float) -> Tensor:
    y = torch.empty_like(x)  # (..., C)
    C = x.shape[-1]
    _lib[0].rms_norm(x.data_ptr(), weight.data_ptr(), offset, eps, y.data_ptr(),
                     x.numel() // C, C)
    return y


def _add_rms_norm_call(x: Tensor, delta: Tensor, delta_weight: Tensor | None, weight: Tensor,
                       eps: float, offset: float) -> tuple[Tensor, Tensor]:
    s, y = torch.empty_like(x), torch.empty_like(x)
    C = x.shape[-1]
    _lib[0].add_rms_norm(x.data_ptr(), delta.data_ptr(), _at(delta_weight), weight.data_ptr(),
                         offset, eps, s.data_ptr(), y.data_ptr(), x.numel() // C, C)
    return s, y


def _add_normed_call(x: Tensor, delta: Tensor, delta_weight: Tensor, eps: float,
                     offset: float) -> Tensor:
    s = torch.empty_like(x)
    C = x.shape[-1]
    _lib[0].add_rms_norm(x.data_ptr(), delta.data_ptr(), delta_weight.data_ptr(), None,
                         offset, eps, s.data_ptr(), None, x.numel() // C, C)
    return s


def _qk_rotary_call(qkv: Tensor, nq: int, nk: int, cos: Tensor, sin: Tensor, pos: Tensor,
                    q_weight: Tensor | None, k_weight: Tensor | None, offset: float, eps: float,
                    q_scale: float) -> None:
    hs = cos.shape[-1]
    heads = qkv.shape[-2] if qkv.shape[-1] == hs else qkv.shape[-1] // hs  # H >= 3: no tie
    _lib[0].qk_rotary(qkv.data_ptr(), qkv.numel() // (heads * hs), heads, nq, nk, hs,
                      _at(q_weight), _at(k_weight), offset, eps, cos.data_ptr(), sin.data_ptr(),
                      pos.data_ptr(), pos.numel(), q_scale)


def _glu_call(gate_up: Tensor, act: int) -> Tensor:
    I = gate_up.shape[-1] // 2  # noqa: E741 (the MLP's inner width, as the config names it)
    y = gate_up.new_empty((*gate_up.shape[:-1], I))  # (..., I)
    _lib[0].glu(gate_up.data_ptr(), y.data_ptr(), gate_up.numel() // (2 * I), I, act)
    return y


# The same calls as custom ops, for torch.compile; each fake says the shapes it makes.
_rms_norm = torch.library.custom_op("kvcache::rms_norm", _rms_norm_call, mutates_args=())
_add_rms_norm = torch.library.custom_op("kvcache::add_rms_norm", _add_rms_norm_call,
                                        mutates_args=())
_add_normed = torch.library.custom_op("kvcache::add_normed", _add_normed_call,
                                      mutates_args=())
_qk_rotary = torch.library.custom_op("kvcache::qk_rotary", _qk_rotary_call,
                                     mutates_args=("qkv",))
_glu = torch.library.custom_op("kvcache::glu", _glu_call, mutates_args=())


@_rms_norm.register_fake
def _(x, weight, eps, offset):
    return torch.empty_like(x)


@_add_rms_norm.register_fake
def _(x, delta, delta_weight, weight, eps, offset):
    return torch.empty_like(x), torch.empty_like(x)


@_add_normed.register_fake
def _(x, delta, delta_weight, eps, offset):
    return torch.empty_like(x)


@_qk_rotary.register_fake
def _(qkv, nq, nk, cos, sin, pos, q_weight, k_weight, offset, eps, q_scale):
    return None


@_glu.register_fake
def _(gate_up, act):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
