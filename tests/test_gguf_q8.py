"""The gguf-q8 and q8_0 weight formats: llama.cpp's arithmetic on GGUF blocks
(`gguf_q8_products.cpp`), held to a NumPy transcription of ggml's CPU backend (the row
rounded by quantize_row_q8_0 / q8_1 / q8_K, then each vec_dot's integer sums and float
scales) for every block type; the SIMD builds against the plain loops; q8_0's blocks against
llama.cpp's own quantiser; the real SmolLM2 and Gemma 3 giving llama.cpp's greedy tokens on
the same file (skipped without the llama extra); the refusals before any weights load."""

from __future__ import annotations

import contextlib
import copy
from unittest import mock

import numpy as np
import pytest
import torch
from llamakit import smollm2_or_skip
from test_gguf_products import _blocks
from typer.testing import CliRunner

from kvcache_cli.caches import code_attention, make_cache
from kvcache_cli.cli import app
from kvcache_cli.generate import stream_tokens
from kvcache_cli.models import (
    fused,
    linear,
    llama_cpp,
    load_model,
    model_config,
    set_weights_dtype,
)
from kvcache_cli.models.gguf import blocks as gguf_blocks
from kvcache_cli.models.gguf.blocks import BLOCK_TYPES, Q8_SOURCE, BlockLinear
from kvcache_cli.models.gguf.q8_0 import dequantize_q8_0, quantize_q8_0

pytestmark = pytest.mark.usefixtures("one_torch_thread")
has_llama = pytest.mark.skipif(not llama_cpp.llama_available(),
                               reason="needs the llama extra (llama-cpp-python, gguf)")
f32, f16 = np.float32, np.float16
# The integer sums are exact in both; what differs is the order the float terms d_w d_x isum
# are added in (8 lanes, then across them, against float64 here): a few float32 roundings of
# the largest partial sum.
RTOL = 1e-5
ROW_TYPE = {"Q4_0": "q8_0", "Q5_0": "q8_0", "Q8_0": "q8_0", "Q4_1": "q8_1", "Q5_1": "q8_1",
            "Q4_K": "q8_K", "Q5_K": "q8_K", "Q6_K": "q8_K"}


# --- ggml's row rounding (ggml-cpu/arch/x86/quants.c; ggml-quants.c for Q8_K) -------------

def round_q8_32(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(R, K) float32 -> q (R, K/32, 32), d (R, K/32) float16 as float32, and s = float16 of
    d * sum(q) (Q8_1's): quantize_row_q8_0 / q8_1 of the x86 build."""
    b = x.reshape(x.shape[0], -1, 32).astype(f32)
    amax = np.abs(b).max(axis=-1)  # (R, nb)
    d = (amax / f32(127)).astype(f32)
    inverse = np.divide(f32(127), amax, out=np.zeros_like(amax), where=amax != 0)
    q = np.rint(b * inverse[..., None]).astype(np.int64)  # ties to even (_MM_ROUND_NEAREST)
    s = (d * q.sum(axis=-1).astype(f32)).astype(f16).astype(f32)
    return q, d.astype(f16).astype(f32), s


def round_q8_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(R, K) float32 -> q (R, K/256, 256), d (R, K/256) float32: quantize_row_q8_K_ref."""
    b = x.reshape(x.shape[0], -1, 256).astype(f32)
    at = np.abs(b).argmax(axis=-1)  # the first of the largest magnitude
    peak = np.take_along_axis(b, at[..., None], -1)[..., 0]
    iscale = np.divide(f32(-127), peak, out=np.zeros_like(peak), where=peak != 0).astype(f32)
    q = np.minimum(127, np.rint(b * iscale[..., None])).astype(np.int64)
    d = np.divide(f32(1), iscale, out=np.zeros_like(iscale), where=iscale != 0).astype(f32)
    return q, d


# --- the weights' integers and scales, as each vec_dot reads them ---------------------------

def _half(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(f16)[..., 0].astype(f32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    return np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int64)


def _fifth(qh: np.ndarray) -> np.ndarray:
    bits = qh.copy().view(np.uint32)  # (.., 1)
    return ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int64)  # (.., 32)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 scales and 8 minimums (get_scale_min_k4)."""
    s = s.astype(np.int64)
    sc = [s[..., j] & 63 if j < 4 else (s[..., j + 4] & 15) | ((s[..., j - 4] >> 6) << 4)
          for j in range(8)]
    mn = [s[..., j + 4] & 63 if j < 4 else (s[..., j + 4] >> 4) | ((s[..., j] >> 6) << 4)
          for j in range(8)]
    return np.stack(sc, -1), np.stack(mn, -1)


def weights(blocks: np.ndarray, kind: str) -> dict:
    """q (N, nb, QK) ints as the dot multiplies them, and the block's float and int scales."""
    _, qk, size = BLOCK_TYPES[kind]
    raw = blocks.reshape(blocks.shape[0], -1, size)
    if kind == "Q4_0":
        return dict(q=_nibbles(raw[..., 2:]) - 8, d=_half(raw[..., :2]))
    if kind == "Q4_1":
        return dict(q=_nibbles(raw[..., 4:]), d=_half(raw[..., :2]), m=_half(raw[..., 2:4]))
    if kind == "Q5_0":
        return dict(q=_nibbles(raw[..., 6:]) + 16 * _fifth(raw[..., 2:6]) - 16,
                    d=_half(raw[..., :2]))
    if kind == "Q5_1":
        return dict(q=_nibbles(raw[..., 8:]) + 16 * _fifth(raw[..., 4:8]),
                    d=_half(raw[..., :2]), m=_half(raw[..., 2:4]))
    if kind == "Q8_0":
        return dict(q=raw[..., 2:].view(np.int8).astype(np.int64), d=_half(raw[..., :2]))
    if kind in ("Q4_K", "Q5_K"):
        sc, mn = _k_scales(raw[..., 4:16])
        qs = raw[..., 48:] if kind == "Q5_K" else raw[..., 16:]
        q = np.concatenate([np.concatenate([qs[..., 32 * c:32 * c + 32] & 15,
                                            qs[..., 32 * c:32 * c + 32] >> 4], -1)
                            for c in range(4)], -1).astype(np.int64)
        if kind == "Q5_K":
            qh = raw[..., 16:48].astype(np.int64)  # run j of 32 takes bit j
            q += 16 * np.concatenate([(qh >> j) & 1 for j in range(8)], -1)
        return dict(q=q, d=_half(raw[..., :2]), dmin=_half(raw[..., 2:4]), sc=sc, mins=mn)
    ql, qh = raw[..., :128].astype(np.int64), raw[..., 128:192].astype(np.int64)
    parts = []
    for h in range(2):
        lo, hi, bits = ql[..., 64 * h:64 * h + 32], ql[..., 64 * h + 32:64 * h + 64], \
            qh[..., 32 * h:32 * h + 32]
        parts += [(lo & 15) | ((bits & 3) << 4), (hi & 15) | (((bits >> 2) & 3) << 4),
                  (lo >> 4) | (((bits >> 4) & 3) << 4), (hi >> 4) | (((bits >> 6) & 3) << 4)]
    return dict(q=np.concatenate(parts, -1) - 32, d=_half(raw[..., 208:210]),
                sc=raw[..., 192:208].view(np.int8).astype(np.int64))


def reference(x: np.ndarray, blocks: np.ndarray, kind: str) -> np.ndarray:
    """(R, K) @ blocks^T in ggml's arithmetic, the float terms summed in float64: (R, N)."""
    w = weights(blocks, kind)
    qw = w["q"]  # (N, nb, QK)
    if ROW_TYPE[kind] == "q8_K":
        qx, dx = round_q8_k(x)  # (R, nb, 256), (R, nb)
        R, nb = dx.shape
        prod = np.einsum("rbi,nbi->rnbi", qx, qw).reshape(R, qw.shape[0], nb, -1, 16).sum(-1)
        d = (w["d"][None] * dx[:, None]).astype(f32)  # (R, N, nb): fp16(d) * y.d in float32
        if kind == "Q6_K":
            isum = (prod * w["sc"][None]).sum(-1)  # 16 scales a block
            return (d.astype(np.float64) * isum).sum(-1)
        isum = (prod.reshape(R, qw.shape[0], nb, 8, 2).sum(-1) * w["sc"][None]).sum(-1)
        bsums = qx.reshape(R, nb, 8, 32).sum(-1)  # (R, nb, 8): each 32's integer sum
        mins = np.einsum("rbj,nbj->rnb", bsums, w["mins"])
        dmin = (w["dmin"][None] * dx[:, None]).astype(f32)
        return ((d.astype(np.float64) * isum) - dmin.astype(np.float64) * mins).sum(-1)
    qx, dx, s = round_q8_32(x)
    isum = np.einsum("rbi,nbi->rnb", qx, qw)
    d = (w["d"][None] * dx[:, None]).astype(f32)
    y = (d.astype(np.float64) * isum).sum(-1)
    if "m" in w:
        y += (w["m"][None] * s[:, None]).astype(f32).astype(np.float64).sum(-1)
    return y


def _product(lib, kind: str, x: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    R, K = x.shape
    xt, w = torch.from_numpy(np.ascontiguousarray(x, f32)), torch.from_numpy(blocks)
    y = torch.full((R, w.shape[0]), float("nan"))
    assert lib.gguf_q8_product(BLOCK_TYPES[kind][0], xt.data_ptr(), w.data_ptr(), y.data_ptr(),
                               R, w.shape[0], K, w.shape[0], 1) == 0
    return y.numpy()


def _close(got: np.ndarray, expected: np.ndarray) -> None:
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=RTOL * np.abs(expected).max())


@pytest.fixture(scope="module")
def simd():
    lib = gguf_blocks.kernels(Q8_SOURCE)
    if lib is None:
        pytest.skip(f"no native products: {gguf_blocks.load(source=Q8_SOURCE)[1]}")
    return lib


@pytest.fixture(scope="module", params=["-DGGUF_AVX2", "-DGGUF_SCALAR"])
def other_build(request, simd):
    """The AVX2 build (maddubs, what a CPU without VNNI runs) and the plain loops."""
    lib, why = gguf_blocks.load((request.param,), Q8_SOURCE)
    if lib is None:
        pytest.skip(f"no {request.param} build: {why}")
    return lib


def _row(rows: int, K: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, K)).astype(f32)


def test_the_reference_reads_the_blocks_as_gguf_py_dequantises_them():
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    for kind in BLOCK_TYPES:
        blocks = _blocks(kind, 5, 2, seed=1)
        w = weights(blocks, kind)
        if kind in ("Q4_K", "Q5_K"):
            d, m = w["d"][..., None] * w["sc"], -w["dmin"][..., None] * w["mins"]  # (N, nb, 8)
            got = np.repeat(d, 32, -1) * w["q"] + np.repeat(m, 32, -1)
        elif kind == "Q6_K":
            got = np.repeat(w["d"][..., None] * w["sc"], 16, -1) * w["q"]
        else:
            got = w["d"][..., None] * w["q"] + w.get("m", f32(0))[..., None]
        expected = dequantize(blocks, GGMLQuantizationType[kind]).reshape(got.shape)
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7, err_msg=kind)


@pytest.mark.parametrize("kind", list(BLOCK_TYPES))
@pytest.mark.parametrize("n_blocks", [1, 3, 7])
@pytest.mark.parametrize("rows", [1, 16])
def test_the_integer_product_is_ggmls_rounded_row_times_the_blocks(simd, kind, n_blocks, rows):
    blocks = _blocks(kind, 37, n_blocks, seed=n_blocks)  # 37 outputs: no SIMD width's multiple
    K = n_blocks * BLOCK_TYPES[kind][1]
    x = _row(rows, K, seed=rows)
    _close(_product(simd, kind, x, blocks), reference(x, blocks, kind))


@pytest.mark.parametrize("kind", list(BLOCK_TYPES))
def test_the_rows_ties_round_to_even_as_ggmls_x86_build_does(simd, kind):
    # A block whose largest |x| is 127 makes the row's step exactly 1: every x + 0.5 is a tie,
    # which ggml's x86 build rounds to even (roundf would take 2.5 to 3, not 2).
    K = BLOCK_TYPES[kind][1]
    x = np.tile((np.arange(K) % 32 - 16 + 0.5).astype(f32), (2, 1))
    x[:, ::32] = 127.0
    x[1] *= -1
    blocks = _blocks(kind, 9, 1, seed=5)
    got, expected = _product(simd, kind, x, blocks), reference(x, blocks, kind)
    _close(got, expected)
    away = np.where(np.abs(x - np.trunc(x)) == 0.5, np.trunc(x) + np.sign(x), x).astype(f32)
    assert not np.allclose(reference(away, blocks, kind), expected, rtol=RTOL, atol=0)


@pytest.mark.parametrize("kind", ["Q4_0", "Q5_0", "Q8_0"])
@pytest.mark.parametrize("outputs", [3, 37])  # fewer than a pass's four weight rows; 9 and 1
@pytest.mark.parametrize("rows", [1, 16])
def test_the_signed_types_take_their_whole_integer_range(simd, kind, outputs, rows):
    # The VNNI build multiplies these weights as unsigned integers less an offset (Q8_0's
    # 128): its extremes, -128 included (which gguf's quantiser never writes but a file may
    # hold), against the reference, through every build.
    blocks = _blocks(kind, outputs, 3, seed=outputs + rows)
    if kind == "Q8_0":
        raw = blocks.reshape(outputs, 3, 34)
        raw[..., 2:] = np.random.default_rng(rows).choice([0x80, 0x81, 0x7f, 0x00, 0xff],
                                                         raw[..., 2:].shape)
    else:  # every nibble, and Q5_0's fifth bits, at 0 or at its largest
        size = BLOCK_TYPES[kind][2]
        raw = blocks.reshape(outputs, 3, size)
        raw[..., 2:size] = np.random.default_rng(rows).choice([0x00, 0xff, 0x0f, 0xf0],
                                                              raw[..., 2:size].shape)
    x = _row(rows, 3 * 32, seed=rows) * f32(100)
    expected = reference(x, blocks, kind)
    _close(_product(simd, kind, x, blocks), expected)
    for define in ("-DGGUF_AVX2", "-DGGUF_SCALAR"):
        lib, why = gguf_blocks.load((define,), Q8_SOURCE)
        if lib is not None:
            _close(_product(lib, kind, x, blocks), expected)


@pytest.mark.parametrize("kind", list(BLOCK_TYPES))
@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("size", [1.0, 1e-4])  # 1e-4: the rows' float16 d are subnormal
def test_the_avx2_and_plain_builds_agree_with_this_cpus(simd, other_build, kind, rows, size):
    blocks = _blocks(kind, 21, 3, seed=7)
    x = _row(rows, 3 * BLOCK_TYPES[kind][1], seed=3) * f32(size)
    plain = _product(other_build, kind, x, blocks)
    _close(plain, _product(simd, kind, x, blocks))
    _close(plain, reference(x, blocks, kind))


def test_q8_0_blocks_are_gguf_pys_quantisers_and_llama_cpps_roundf():
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    w = _row(37, 96, seed=2)
    w[0, :32] = np.arange(32) - 15.5  # ties: roundf takes them away from zero
    w[0, 0], w[1, 32:64] = 127.0, 0.0  # and an all-zero block
    blocks = quantize_q8_0(w)
    assert np.array_equal(blocks, quantize(w, GGMLQuantizationType.Q8_0))
    back = dequantize_q8_0(blocks)
    assert back[0, 1] == -15.0 and back[0, 16] == 1.0 and not back[1, 32:64].any()


def test_a_fused_module_runs_the_integer_kernel_on_decode_rows_and_floats_on_prefills(simd):
    parts = [(_blocks("Q5_0", 8, 8, 1), "Q5_0"), (_blocks("Q4_K", 5, 1, 3), "Q4_K")]
    module = BlockLinear(parts, 256, "gguf-q8")
    x = _row(16, 256, seed=4)
    expected = np.concatenate([reference(x, b, k) for b, k in parts], axis=1)
    _close(module(torch.from_numpy(x)).numpy(), expected)
    exact = torch.from_numpy(_row(40, 256, seed=5))  # a prefill: the dequantised matrix's
    torch.testing.assert_close(module(exact), exact @ module.dequantized().t(), rtol=1e-5,
                               atol=1e-4)


@pytest.fixture(scope="module")
def smollm2():
    smollm2_or_skip()
    return load_model("smollm2").model


def test_q8_0_sets_every_product_and_rounds_the_embedding(smollm2):
    q8 = set_weights_dtype(copy.deepcopy(smollm2), "q8_0")
    assert linear.weights_format(q8) == "q8_0"
    assert isinstance(q8.lm_head, BlockLinear) and q8.lm_head.kinds == ["Q8_0"]
    assert not any(isinstance(m, linear.Linear) for m in q8.modules())
    table = smollm2.embedding.weight.detach().numpy()
    assert np.array_equal(q8.embedding.weight.detach().numpy(),
                          dequantize_q8_0(quantize_q8_0(table)))


def _ggml_cpu():
    """llama.cpp's own CPU library (the llama extra's build) with its type traits: each
    type's row rounding (from_float of its vec_dot_type) and vec_dot."""
    import ctypes
    import os

    class Traits(ctypes.Structure):  # ggml-cpu.h's ggml_type_traits_cpu
        _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p),
                    ("vec_dot_type", ctypes.c_int), ("nrows", ctypes.c_int64)]

    import llama_cpp as bindings

    folder = os.path.join(os.path.dirname(bindings.__file__), "lib")
    ctypes.CDLL(os.path.join(folder, "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(os.path.join(folder, "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    lib.ggml_cpu_init()  # its float16 tables
    lib.ggml_get_type_traits_cpu.restype = ctypes.POINTER(Traits)
    return lib


@has_llama
@pytest.mark.parametrize("kind", list(BLOCK_TYPES))
def test_the_kernel_gives_llama_cpps_own_cpu_kernels_numbers(simd, kind):
    """ggml's from_float and vec_dot from the installed llama.cpp, one output at a time."""
    import ctypes

    ggml = _ggml_cpu()
    traits = ggml.ggml_get_type_traits_cpu(BLOCK_TYPES[kind][0]).contents
    row_type = {"q8_0": 8, "q8_1": 9, "q8_K": 15}[ROW_TYPE[kind]]  # GGMLQuantizationType
    assert traits.vec_dot_type == row_type
    from_float = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(
        ggml.ggml_get_type_traits_cpu(row_type).contents.from_float)
    vec_dot = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.POINTER(ctypes.c_float),
                               ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                               ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)(traits.vec_dot)
    blocks = _blocks(kind, 37, 5, seed=11)
    K = 5 * BLOCK_TYPES[kind][1]
    x = _row(1, K, seed=12)
    rounded = np.zeros(4 * K, np.uint8)  # more than any row type's bytes
    from_float(x.ctypes.data, rounded.ctypes.data, K)
    theirs = np.zeros(37, f32)
    for n in range(37):
        out = ctypes.c_float()
        vec_dot(K, ctypes.byref(out), 0, blocks[n].ctypes.data, 0, rounded.ctypes.data, 0, 1)
        theirs[n] = out.value
    # The same integers and scales; the float terms in their lanes' order or another.
    _close(_product(simd, kind, x, blocks)[0], theirs)


def _llama_steps(path, prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    """llama.cpp's greedy tokens on `path` and each step's logits (float32 cache, so the
    comparison is of the products, not of its float16 cache's rounding)."""
    import llama_cpp as bindings

    llm = bindings.Llama(model_path=str(path), n_ctx=len(prompt) + n, n_batch=len(prompt) + n,
                         n_threads=1, type_k=0, type_v=0, swa_full=False, verbose=False)
    tokens, logits, ids = [], [], list(prompt)
    try:
        for _ in range(n):
            llm.eval(ids)
            step = np.ctypeslib.as_array(bindings.llama_get_logits_ith(llm.ctx, -1),
                                         shape=(llm.n_vocab(),)).copy()
            logits.append(step)
            tokens.append(int(step.argmax()))
            ids = [tokens[-1]]
    finally:
        llm.close()
    return tokens, logits


# Two logits closer than this, in both engines, are a near tie: either may come first.
# Rounding a row to 8 bits makes a product a step function of it, and where a block holds an
# outlier (SmolLM2's activations reach the hundreds) one step is a large change, so a last
# place that differs anywhere before it moves a logit by up to about one: the gaps where the
# two engines' picks parted on an AVX2 host were 0.03-0.12 in llama.cpp's logits and
# 0.03-0.25 in ours.
NEAR_TIE = 0.3


def _same_tokens_but_near_ties(model, path, prompt: list[int], n: int,
                               torch_ops: bool = False) -> None:
    """Our greedy pick is llama.cpp's at every step of its own greedy run on the same file
    (each step fed llama.cpp's tokens, so one flip does not send the two texts apart), but
    where the two tokens are a near tie in both engines' logits, at most once in eight
    steps. Its cache is float32 here, as ours. Where llama.cpp runs the same kernels as
    ours to the last place (the AVX-512 host these tests were written on) the free-running
    tokens were equal too; its AVX2 kernels sum in another order, and part at near ties.
    The decode's norms are the fused ones, doing ggml's arithmetic to the bit
    (tests/test_fused.py), unless `torch_ops`: the small ops as torch's, where the fused path
    parts at a near tie for a reason outside the norms (see the callers). A static cache's
    decoding token attends through SDPA, not the native decode call
    (`code_attention.attend_decode`), whose float32 sums, in another order than llama.cpp's,
    part the tokens at a near tie on two of the three files."""
    assert fused.library() is not None
    theirs, their_logits = _llama_steps(path, prompt, n)
    ops = contextlib.ExitStack()
    ops.enter_context(mock.patch.object(code_attention, "kernel", lambda: None))
    if torch_ops:
        ops.enter_context(mock.patch.object(fused, "_lib", [None]))
    with torch.inference_mode(), ops:
        cache = make_cache("static", model, max_len=len(prompt) + n)
        ours = [model(torch.tensor([prompt]), 0, cache)[0, -1]]
        for at, token in enumerate(theirs[:-1]):  # each step fed llama.cpp's pick
            ours.append(model(torch.tensor([[token]]), len(prompt) + at, cache)[0, -1])
    parted = []
    for step, (token, theirs_now, ours_now) in enumerate(zip(theirs, their_logits, ours)):
        mine = int(ours_now.argmax())
        if mine != token:
            gaps = (theirs_now[token] - theirs_now[mine], float(ours_now[mine] - ours_now[token]))
            assert max(gaps) < NEAR_TIE, (step, token, mine, gaps)
            parted.append(step)
    assert len(set(theirs)) > 3 and len(parted) <= n // 8, parted


@has_llama
def test_smollm2_gguf_q8_picks_llama_cpps_tokens_on_its_file_but_near_ties(smollm2):
    model = set_weights_dtype(copy.deepcopy(smollm2), "gguf-q8")
    # Fused, every norm and product of the prompt's 5 rows equals llama.cpp's to the bit
    # through layer 17; the attention's output (kqv_out) differs in the last place: q and k
    # do already (llama.cpp's angles are p * s^i by float recurrence, its rotation two fused
    # multiply-adds), and with those made its own the attention alone still does (another
    # order of sums). At layer 18 that flips one 8-bit rounding of the last row before
    # o_proj: the 6th token then parts at llama.cpp's margin 0.03.
    _same_tokens_but_near_ties(model, model.config.gguf, [504, 3575, 282, 4649, 314], 24,
                               torch_ops=True)


@has_llama
def test_smollm2_q8_0_picks_llama_cpps_tokens_on_its_weights_q8_0_file_but_near_ties(
        smollm2, tmp_path):
    from gguf import GGUFReader

    model = set_weights_dtype(copy.deepcopy(smollm2), "q8_0")
    file = llama_cpp.prepare(smollm2, "llama.cpp-q8_0", tmp_path)  # from the float weights
    tensors = {t.name: t for t in GGUFReader(file.path).tensors}
    # llama.cpp's quantiser wrote the very blocks q8_0 holds.
    assert np.array_equal(np.asarray(tensors["blk.3.ffn_down.weight"].data),
                          model.model.layers[3].mlp.down_proj.blocks0.numpy())
    assert np.array_equal(np.asarray(tensors["token_embd.weight"].data),
                          model.lm_head.blocks0.numpy())
    _same_tokens_but_near_ties(model, file.path, [504, 3575, 282, 4649, 314], 24)


@has_llama
def test_gemma3_gguf_q8_picks_llama_cpps_tokens_on_its_file_but_near_ties():
    """The real file's Q4_K, Q5_0, Q6_K and Q8_0 blocks. (About a minute.)"""
    import gemmakit

    gemmakit.gemma3_or_skip()
    model = set_weights_dtype(load_model("gemma3").model, "gguf-q8")
    kinds = {k for m in model.modules() if isinstance(m, BlockLinear) for k in m.kinds}
    assert kinds == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    # Fused, the norms are ggml's to the bit, but layer 0's o_proj (Q4_K) gives another last
    # place than llama.cpp's on the same row (its float terms' order), and the rotation's
    # and the attention's outputs differ in the last place, as on SmolLM2: the 12th token
    # parts.
    _same_tokens_but_near_ties(model, model.config.gguf, [2, 818, 5279, 529, 7001, 563], 16,
                               torch_ops=True)


def test_gguf_q8_and_q8_0_are_refused_where_they_cannot_run(tmp_path):
    from llamakit import tiny_hf, write_tiny_gguf

    with pytest.raises(ValueError, match="gguf-q8 weights are the blocks of the GGUF"):
        linear.check_weights_dtype("gguf-q8", model_config("gpt2"), "cpu")
    with pytest.raises(ValueError, match="q8_0 weights run on the CPU only"):
        linear.check_weights_dtype("q8_0", model_config("gpt2"), "cuda")
    linear.check_weights_dtype("q8_0", model_config("gpt2"), "cpu")
    f32_file = write_tiny_gguf(tiny_hf(seed=3, vocab_size=300), tmp_path / "tiny.gguf", "F32")
    with pytest.raises(ValueError, match=r"gguf-q8 multiplies .* is F32 in tiny.gguf"):
        linear.check_weights_dtype("gguf-q8", model_config(str(f32_file)), "cpu")


def test_a_kernel_that_cannot_be_built_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(gguf_blocks, "_library", {})
    monkeypatch.setenv("KVCACHE_PRODUCTS", "torch")
    with pytest.raises(ValueError, match="q8_0 weights need the native block products"):
        linear.check_weights_dtype("q8_0", model_config("gpt2"), "cpu")


@pytest.mark.parametrize(("model", "fmt", "words"), [
    ("gpt2", "gguf-q8", "gguf-q8 weights are the blocks"),
    ("gpt2", "q8_1", "unknown weights dtype 'q8_1'")])
def test_the_cli_refuses_them_in_one_line_before_loading(model, fmt, words):
    out = CliRunner().invoke(app, ["bench", "--device", "cpu", "-m", model,
                                   "--weights-dtype", fmt])
    assert out.exit_code == 2, out.output
    assert out.stdout == "" and out.stderr.count("\n") == 1, out.output
    assert out.stderr.startswith(f"error: --weights-dtype: {words}")


def test_bench_pairs_q8_0_and_gguf_q8_with_the_llama_cpp_modes_of_the_same_arithmetic():
    from kvcache_cli.bench.context import LLAMA_MODE_FOR_WEIGHTS

    assert set(LLAMA_MODE_FOR_WEIGHTS) == set(linear.WEIGHT_DTYPES)
    assert LLAMA_MODE_FOR_WEIGHTS["q8_0"] == "llama.cpp-q8_0"
    assert LLAMA_MODE_FOR_WEIGHTS["gguf-q8"] == "llama.cpp-gguf"


@has_llama
def test_a_tiny_llama_under_gguf_q8_gives_llama_cpps_tokens_exactly(tmp_path, monkeypatch):
    """Without outlier activations a rounding flip is rare and small: the same tokens."""
    from llamakit import tiny_hf, write_tiny_gguf

    monkeypatch.setenv("KVCACHE_CACHE", str(tmp_path / "kvcache-cache"))
    path = write_tiny_gguf(tiny_hf(seed=3, vocab_size=300), tmp_path / "tiny-q4_1.gguf", "Q4_1")
    model = set_weights_dtype(load_model(str(path)).model, "gguf-q8")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    with torch.inference_mode():
        mine = list(stream_tokens(model, prompt, 16, "static"))
    theirs, _ = _llama_steps(path, prompt, 16)
    assert len(set(mine)) > 3 and mine == theirs


def test_q8_0_runs_a_model_with_biases_near_its_float_logits():
    model = load_model("stdlib-bytes").model  # GPT-2's shape: every product has a bias
    q8 = set_weights_dtype(copy.deepcopy(model), "q8_0")
    assert all(m.bias is not None for m in q8.modules() if isinstance(m, BlockLinear)
               and m is not q8.lm_head)
    ids = torch.tensor([list(b"def main():\n    return")])
    with torch.inference_mode():
        for rows in (ids, ids[:, :8]):  # a prefill past 16 rows (exact path), then the kernel's
            reference, logits = model(rows, 0), q8(rows, 0)
            # 8-bit weights and rows: a few % of the logits' range, as int8's
            assert (logits - reference).abs().max() / reference.abs().max() < 0.05


def test_the_compiled_step_runs_gguf_q8_as_one_operator(tmp_path, monkeypatch):
    from llamakit import tiny_hf, write_tiny_gguf

    from kvcache_cli.caches import make_cache
    from kvcache_cli.generate import CompiledDecode

    monkeypatch.setenv("KVCACHE_CACHE", str(tmp_path / "kvcache-cache"))
    path = write_tiny_gguf(tiny_hf(seed=3, vocab_size=300), tmp_path / "tiny-q4_1.gguf", "Q4_1")
    model = set_weights_dtype(load_model(str(path)).model, "gguf-q8")
    prompt, n = [3, 1, 4, 1, 5, 9, 2, 6], 12

    def cache():
        return make_cache("static", model, max_len=len(prompt) + n, batch=1, whole=True)

    with torch.inference_mode():
        expected = list(stream_tokens(model, prompt, n, "static", cache=cache()))
        torch._dynamo.reset()
        with torch._dynamo.config.patch(error_on_recompile=True):
            got = list(stream_tokens(model, prompt, n, "static", cache=cache(),
                                     forward=CompiledDecode(model)))
    assert len(set(expected)) > 3 and got == expected
