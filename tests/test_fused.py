"""The fused small ops (`models.fused`): each kernel against the torch ops it replaces, the
Llama and Gemma 3 blocks fused against the same blocks in torch, and the torch path kept
wherever the rows are not a float32 decode's few with no gradient.

Tolerances: every kernel sums in another order than torch (the norms in double, as
llama.cpp's CPU backend), so each result equals torch's within a few units of float32's
last place: rtol 1e-5 on one op, 1e-4 of the logits' scale through a model's layers. The
norms equal ggml's arithmetic to the bit (`ggml_rms_norm` here).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvcache_cli.caches import make_cache
from kvcache_cli.caches.base import LayerType
from kvcache_cli.generate import CompiledDecode, stream_tokens
from kvcache_cli.models import fused, linear
from kvcache_cli.models.gemma3 import Gemma3, Gemma3Config
from kvcache_cli.models.llama import Llama, LlamaConfig, Rotary, init_random

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ONE_OP = dict(rtol=1e-5, atol=1e-5)
ROWS = (1, 5, 16)  # a decode's row, a batched decode's few, the most `native_rows` takes
WIDTHS = (37, 576, 640)  # odd (a vector's tail), SmolLM2's and Gemma 3's hidden sizes


@pytest.fixture(autouse=True)
def kernels():
    if fused.library() is None or linear.products() is None:
        pytest.skip(f"no fused kernels here: {(fused.NOTE or linear.NOTE)[-1]}")


def torch_rms_norm(x, w, eps, offset):
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return h * (offset + w)


@pytest.mark.parametrize("R", ROWS)
@pytest.mark.parametrize("C", WIDTHS)
@pytest.mark.parametrize("offset", [0.0, 1.0])  # Llama's gain w, Gemma's 1 + w
def test_rms_norm_equals_torchs(R, C, offset):
    g = torch.Generator().manual_seed(R * C)
    x, w = torch.randn(R, C, generator=g) * 3, torch.randn(C, generator=g)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6, offset),
                               torch_rms_norm(x, w, 1e-6, offset), **ONE_OP)


@pytest.mark.parametrize("R", ROWS)
@pytest.mark.parametrize("C", WIDTHS)
@pytest.mark.parametrize("delta_normed", [False, True])  # Llama's add; Gemma's norm, then add
def test_the_residual_add_and_the_norm_after_it_equal_torchs(R, C, delta_normed):
    g = torch.Generator().manual_seed(R + C)
    x, delta = torch.randn(1, R, C, generator=g), torch.randn(1, R, C, generator=g) * 5
    w, dw = torch.randn(C, generator=g), torch.randn(C, generator=g)
    offset = 1.0 if delta_normed else 0.0
    added = x + (torch_rms_norm(delta, dw, 1e-5, offset) if delta_normed else delta)
    s, y = fused.add_rms_norm(x, delta, dw if delta_normed else None, w, 1e-5, offset)
    torch.testing.assert_close(s, added, **ONE_OP)
    torch.testing.assert_close(y, torch_rms_norm(added, w, 1e-5, offset), **ONE_OP)
    if delta_normed:  # Gemma's add after the MLP: the normed output added, no norm after
        torch.testing.assert_close(fused.add_normed(x, delta, dw, 1e-5, offset), added,
                                   **ONE_OP)


def ggml_rms_norm(x: np.ndarray, gain: np.ndarray, eps: float) -> np.ndarray:
    """ggml-cpu's rms_norm then its mul by the gain (ops.cpp): each square rounded to
    float32, summed in float64 one after another, the mean rounded to float32, then
    1.0f / sqrtf(mean + eps), the row times it, then times the gain, each in float32."""
    f32 = np.float32
    total = np.cumsum((x * x).astype(np.float64), axis=-1)[..., -1:]
    scale = f32(1) / np.sqrt((total / x.shape[-1]).astype(f32) + f32(eps))
    return (x * scale) * gain


@pytest.mark.parametrize("C", WIDTHS + (256,))  # and Gemma 3's head size (QK-norm)
def test_the_norms_are_ggmls_arithmetic_to_the_bit(C):
    """What makes a decode's rows, rounded to 8 bits (gguf-q8, q8_0), llama.cpp's rows:
    the norm, Gemma's norm of a sublayer's output then the residual add, and QK-norm."""
    rng = np.random.default_rng(C)
    x = (rng.standard_normal((16, C)) * np.logspace(-3, 3, 16)[:, None]).astype(np.float32)
    x[:, 3] *= 100  # an outlier channel, as SmolLM2's
    delta = (rng.standard_normal((16, C)) * 5).astype(np.float32)
    w, dw = (rng.standard_normal((2, C)) * 0.5).astype(np.float32)
    gain, delta_gain = np.float32(1) + w, np.float32(1) + dw  # Gemma's 1 + w, as stored
    t = torch.from_numpy
    assert np.array_equal(fused.rms_norm(t(x), t(w), 1e-6, 0.0).numpy(),
                          ggml_rms_norm(x, w, 1e-6))
    assert np.array_equal(fused.rms_norm(t(x), t(w), 1e-6, 1.0).numpy(),
                          ggml_rms_norm(x, gain, 1e-6))
    s, y = fused.add_rms_norm(t(x), t(delta), t(dw), t(w), 1e-6, 1.0)
    added = x + ggml_rms_norm(delta, delta_gain, 1e-6)
    assert np.array_equal(s.numpy(), added)
    assert np.array_equal(y.numpy(), ggml_rms_norm(added, gain, 1e-6))
    # QK-norm with a rotation by angle 0 (cos 1, sin 0), which leaves the normed heads be
    qkv = t(x.copy()).view(1, 16, 1, C).expand(1, 16, 3, C).contiguous()  # (B, T, q|k|v, hs)
    ones, zeros = torch.ones(1, C), torch.zeros(1, C)
    fused.qk_rotary(qkv, 1, 1, ones, zeros, torch.zeros(16, dtype=torch.int64), t(w), t(dw),
                    1.0, 1e-6, 1.0)
    assert np.array_equal(qkv[0, :, 0].numpy(), ggml_rms_norm(x, gain, 1e-6))
    assert np.array_equal(qkv[0, :, 1].numpy(), ggml_rms_norm(x, delta_gain, 1e-6))
    assert np.array_equal(qkv[0, :, 2].numpy(), x)


def rotated_in_torch(qkv, nq, nk, rope, q_norm, k_norm, q_scale):
    """What `LlamaAttention.project` did before: q, k of qkv (B, T, H, hs) normed, rotated."""
    heads = qkv.transpose(1, 2)  # (B, H, T, hs)
    q, k = heads[:, :nq], heads[:, nq:nq + nk]
    if q_norm is not None:
        q, k = torch_rms_norm(q, q_norm, 1e-6, 1.0), torch_rms_norm(k, k_norm, 1e-6, 1.0)
    return rope(q) * q_scale, rope(k)


@pytest.mark.parametrize("B,T", [(1, 1), (1, 7), (3, 1), (2, 4)])
@pytest.mark.parametrize("hs,nq,nk,qk_norm", [(64, 9, 3, False), (256, 4, 1, True),
                                              (6, 2, 2, True)])  # SmolLM2's, Gemma's, odd
def test_q_and_k_normed_and_rotated_in_place_equal_torchs(B, T, hs, nq, nk, qk_norm):
    g = torch.Generator().manual_seed(hs * B + T)
    config = LlamaConfig(n_layer=1, n_head=nq, n_kv_head=nk, n_embd=nq * hs, intermediate=8,
                         vocab_size=8, context=64, head_dim=hs)
    table = Rotary(config)
    # per row positions (B, T) where there are several rows; (T,) for every row else
    pos = (torch.randint(0, 64 - T, (B, 1), generator=g) + torch.arange(T) if B > 1 else
           torch.arange(20, 20 + T))
    rope = table.at(pos, torch.float32)
    qkv = torch.randn(B, T, nq + 2 * nk, hs, generator=g)
    q_norm, k_norm = (torch.randn(hs, generator=g), torch.randn(hs, generator=g)) if qk_norm \
        else (None, None)
    q_scale = 0.75 if qk_norm else 1.0
    q, k = rotated_in_torch(qkv, nq, nk, rope, q_norm, k_norm, q_scale)
    v = qkv[:, :, nq + nk:].clone()
    fused.qk_rotary(qkv, nq, nk, table.cos, table.sin, pos, q_norm, k_norm,
                    1.0 if qk_norm else 0.0, 1e-6, q_scale)
    heads = qkv.transpose(1, 2)
    torch.testing.assert_close(heads[:, :nq], q, **ONE_OP)
    torch.testing.assert_close(heads[:, nq:nq + nk], k, **ONE_OP)
    assert torch.equal(qkv[:, :, nq + nk:], v)  # the values untouched


@pytest.mark.parametrize("R", ROWS)
@pytest.mark.parametrize("width", [37, 1536, 2048])  # odd; SmolLM2's and Gemma 3's MLP's
@pytest.mark.parametrize("activation", fused.ACTIVATIONS)
def test_the_gated_activation_equals_torchs(R, width, activation):
    g = torch.Generator().manual_seed(R * width)
    gate_up = torch.randn(R, 2 * width, generator=g) * 4
    gate_up[0, :8] = torch.tensor([0.0, -30.0, 30.0, -100.0, 100.0, 1e-3, -9.0, 9.0])
    gate, up = gate_up.split(width, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    torch.testing.assert_close(fused.glu(gate_up, activation), act * up, **ONE_OP)


def test_each_fused_op_is_a_custom_op_the_compiler_can_trace():
    g = torch.Generator().manual_seed(0)
    x, d, w = (torch.randn(2, 10, generator=g) for _ in range(3))
    table = torch.randn(8, 4, generator=g)
    cases = [(fused._rms_norm, (x, w[0], 1e-6, 1.0)),
             (fused._add_rms_norm, (x, d, w[0], w[1], 1e-6, 0.0)),
             (fused._add_normed, (x, d, w[0], 1e-6, 1.0)),
             (fused._qk_rotary, (torch.randn(1, 2, 3, 4, generator=g), 1, 1, table, table,
                                 torch.tensor([3, 5]), None, None, 0.0, 1e-6, 1.0)),
             (fused._glu, (x, 1))]
    for op, args in cases:
        torch.library.opcheck(op, args)


def tiny(family: str, seed: int = 0, window: int | None = 8):
    """A random Llama (SmolLM2's head size) or Gemma 3 (256, a query scale, a layer sliding
    over `window` and a global one), norm gains random too, weights arranged as every
    loader does."""
    if family == "llama":
        model = Llama(LlamaConfig(n_layer=2, n_head=3, n_kv_head=1, n_embd=192,
                                  intermediate=160, vocab_size=96, context=64))
    else:
        types = (LayerType(window=window, rope_theta=10_000.0), LayerType(rope_theta=1e6))
        model = Gemma3(Gemma3Config(n_layer=2, n_head=2, n_kv_head=1, n_embd=96,
                                    head_dim=256, intermediate=160, vocab_size=96, context=64,
                                    layer_types=types, query_pre_attn_scalar=200,
                                    tie_word_embeddings=False))  # tied, it repeats
    init_random(model, 0.3, seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (0 if family == "gemma3"
                                                                    else 1))
    return linear.arrange_weights(model).eval()


def without_kernels(monkeypatch):
    """The library as if it could not be built: the model's torch ops, the reference."""
    monkeypatch.setattr(fused, "_lib", [None])


def steps(model, batch: int = 1):
    """Logits of a 5-token prefill and 6 decode steps, (B, 11, vocab)."""
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, model.config.vocab_size, (batch, 11), generator=g)
    cache = make_cache("static", model, max_len=16, batch=batch)
    with torch.inference_mode():
        out = [model(idx[:, :5], 0, cache)]
        for i in range(5, 11):
            out.append(model(idx[:, i:i + 1], i, cache))
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("batch", [1, 3])
def test_fused_logits_equal_the_torch_ops_logits(family, batch, monkeypatch):
    model = tiny(family)
    got = steps(model, batch)
    without_kernels(monkeypatch)
    expected = steps(model, batch)
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_fused_greedy_tokens_equal_the_torch_ops_tokens(family, monkeypatch):
    model = tiny(family, seed=3)
    with torch.inference_mode():
        got = list(stream_tokens(model, [5, 17, 2], 20, "static"))
        without_kernels(monkeypatch)
        expected = list(stream_tokens(model, [5, 17, 2], 20, "static"))
    assert len(set(expected)) > 3  # the tokens vary, so agreement says something
    assert got == expected


def calls(monkeypatch) -> list[str]:
    """The names of the fused calls a forward makes, as it makes them."""
    made: list[str] = []
    for name in ("_rms_norm_call", "_add_rms_norm_call", "_add_normed_call",
                 "_qk_rotary_call", "_glu_call"):
        call = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, _c=call, _n=name: (made.append(_n),
                                                                       _c(*a))[1])
    return made


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_decode_step_fuses_every_norm_rotation_and_activation(family, monkeypatch):
    model = tiny(family)
    made = calls(monkeypatch)
    with torch.inference_mode():
        model(torch.tensor([[1]]), 0, make_cache("static", model, max_len=4, batch=1))
    # per layer: the input norm, q and k, the add and norm, the activation (Gemma: and the
    # normed output added); then the final norm
    per_layer = 5 if family == "gemma3" else 4
    assert len(made) == 2 * per_layer + 1


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("case", ["bf16", "grad", "many rows"])
def test_the_torch_ops_run_where_the_rows_are_not_a_float32_decodes(family, case,
                                                                     monkeypatch):
    model = tiny(family)
    T = 17 if case == "many rows" else 1
    idx = torch.arange(T)[None] % model.config.vocab_size  # (1, T)
    if case == "bf16":
        model = model.to(torch.bfloat16)
    made = calls(monkeypatch)
    with torch.inference_mode(case != "grad"):
        logits = model(idx, 0, make_cache("static", model, max_len=T, batch=1))
    assert made == [] and logits.dtype == model.dtype
    assert logits.requires_grad == (case == "grad")


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_compiled_step_keeps_the_fused_ops_and_the_eager_tokens(family):
    model = tiny(family, window=None)  # a compiled step reads a static cache whole
    prompt, n = [3, 1, 4, 1, 5], 8
    eager = make_cache("static", model, max_len=len(prompt) + n, batch=1, whole=True)
    with torch.inference_mode():
        expected = list(stream_tokens(model, prompt, n, "static", cache=eager))
    torch._dynamo.reset()
    step = CompiledDecode(model)
    cache = make_cache("static", model, max_len=len(prompt) + n, batch=1, whole=True)
    with torch.inference_mode():
        got = list(stream_tokens(model, prompt, n, "static", cache=cache, forward=step))
    assert got == expected


def test_a_q_k_v_that_cannot_be_rotated_in_place_is_refused_with_its_strides():
    table = torch.randn(8, 4)
    qkv = torch.randn(1, 2, 3, 8)[..., :4]  # (1, 2, 3, 4), every head a strided half
    with pytest.raises(ValueError, match="strides"):
        fused.qk_rotary(qkv, 1, 1, table, table, torch.tensor([0, 1]), None, None, 0.0,
                        1e-6, 1.0)


def model_ops(model) -> set[str]:
    """The torch ops a decode step's model code (kvcache_cli/models, not the cache's)
    dispatches, by name."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    names: set[str] = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            caller = [f.filename for f in traceback.extract_stack() if "kvcache_cli" in f.filename]
            if caller and "kvcache_cli/models/" in caller[-1].replace("\\", "/"):
                names.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    cache = make_cache("static", model, max_len=4, batch=1)
    with torch.inference_mode():
        model(torch.tensor([[1]]), 0, cache)
        with Record():
            model(torch.tensor([[2]]), 1, cache)
    return names


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_fused_decode_step_makes_outputs_and_views_but_no_lookup_transpose_or_slice(family):
    # The rotary tables are read by position in the fused call (no index), the heads are
    # one view each (no transpose or slice), each output one allocation (empty, empty_like
    # or new_empty); Gemma's embedding scale is one mul by a number.
    allowed = {"embedding", "empty", "empty_like", "new_empty", "as_strided", "view", "add",
               "mul"}
    assert model_ops(tiny(family)) <= allowed


@pytest.mark.parametrize("hs,nq,nk", [(64, 9, 3), (256, 4, 1)])
def test_a_q_k_v_products_rows_as_made_rotate_as_its_heads_do(hs, nq, nk):
    g = torch.Generator().manual_seed(hs)
    table, pos = torch.randn(16, hs, generator=g), torch.arange(3, 8)
    heads = torch.randn(2, 5, nq + 2 * nk, hs, generator=g)  # (B, T, H, hs)
    rows = heads.clone().flatten(2)  # (B, T, H * hs): what the product returns
    w = torch.randn(hs, generator=g)
    for qkv in (heads, rows):
        fused.qk_rotary(qkv, nq, nk, table, table.flip(0), pos, w, w, 1.0, 1e-6, 0.5)
    assert torch.equal(rows, heads.flatten(2))
