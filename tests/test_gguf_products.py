"""The gguf weight format: the GGUF's blocks multiplied as stored (`gguf_products.cpp`),
held to gguf-py's own dequantiser for every block type the kernel reads; the SIMD build
against the plain loops; models read from a GGUF (a tiny Llama, a tiny Gemma 3 in the real
file's types, and the real SmolLM2 and Gemma 3) running their products on the blocks with
the float32 model's tokens; the refusals before any weights load."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from llamakit import smollm2_or_skip, tiny_hf, write_tiny_gguf
from typer.testing import CliRunner

from kvcache_cli.cli import app
from kvcache_cli.generate import stream_tokens
from kvcache_cli.measure import weight_bytes
from kvcache_cli.models import linear, load_model, model_config, set_weights_dtype
from kvcache_cli.models.gguf import blocks as gguf_blocks
from kvcache_cli.models.gguf.as_stored import _merged
from kvcache_cli.models.gguf.blocks import BLOCK_TYPES, BlockLinear

pytestmark = pytest.mark.usefixtures("one_torch_thread")

QUANTISED_BY_GGUF = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # gguf-py can't make k-quants
# The product is the dequantised matrix's in float32, summed in another order: each
# output's error is a few float32 roundings of its size (~1e-7 relative) times the sqrt of
# K terms; a wrong nibble, bit or scale moves it by whole weights (~100% of the output).
RTOL = 1e-5


def _blocks(kind: str, rows: int, n_blocks: int, seed: int) -> np.ndarray:
    """(rows, n_blocks * block bytes) uint8: gguf's quantiser's blocks of normal weights
    where it has one, else random bytes with valid float16 scales (finite, 1e-3..1e-2,
    and for the k-quants' minimum 0..1e-2) in their places."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    if kind in QUANTISED_BY_GGUF:
        w = rng.standard_normal((rows, n_blocks * block)).astype(np.float32)
        return quantize(w, GGMLQuantizationType[kind])
    raw = rng.integers(0, 256, (rows, n_blocks, size), dtype=np.uint8)

    def halves(low, high):
        return (rng.uniform(low, high, (rows, n_blocks)).astype(np.float16)
                .view(np.uint8).reshape(rows, n_blocks, 2))

    if kind == "Q6_K":  # ql, qh, 16 int8 scales, then d
        raw[..., 208:210] = halves(1e-3, 1e-2)
    else:  # d, dmin, then the packed scales and minimums
        raw[..., 0:2], raw[..., 2:4] = halves(1e-3, 1e-2), halves(0, 1e-2)
    return raw.reshape(rows, -1)


def _dequantized(blocks: np.ndarray, kind: str) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(np.asarray(dequantize(blocks, GGMLQuantizationType[kind]),
                                       dtype=np.float32))


def _product(lib, kind: str, x: torch.Tensor, blocks: np.ndarray) -> torch.Tensor:
    R, K = x.shape
    w = torch.from_numpy(blocks)
    y = torch.full((R, w.shape[0]), float("nan"))
    assert lib.gguf_product(BLOCK_TYPES[kind][0], x.data_ptr(), w.data_ptr(), y.data_ptr(), R,
                            w.shape[0], K, w.shape[0], 1) == 0
    return y


@pytest.fixture(scope="module")
def simd():
    lib = gguf_blocks.kernels()
    if lib is None:
        pytest.skip(f"no native products: {gguf_blocks.load()[1]}")
    return lib


@pytest.fixture(scope="module")
def scalar():
    lib, why = gguf_blocks.load(("-DGGUF_SCALAR",))
    if lib is None:
        pytest.skip(f"no native products: {why}")
    return lib


@pytest.fixture(scope="module", params=["native", "-DGGUF_AVX2"])
def vectorised(request, simd):
    """The build this CPU runs, and (on an AVX-512 CPU) the AVX2 one CI machines run."""
    if request.param == "native":
        return simd
    lib, why = gguf_blocks.load((request.param,))
    if lib is None:
        pytest.skip(f"no AVX2 build: {why}")
    return lib


@pytest.mark.parametrize("kind", list(BLOCK_TYPES))
@pytest.mark.parametrize("n_blocks", [1, 3, 7])
@pytest.mark.parametrize("rows", [1, 16])
def test_the_block_product_is_the_dequantised_matrixs_product(simd, kind, n_blocks, rows):
    blocks = _blocks(kind, 37, n_blocks, seed=n_blocks)  # 37 outputs: no SIMD width's multiple
    w = _dequantized(blocks, kind)  # (37, K)
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows))
    expected = (x.double() @ w.double().t()).float()  # (rows, 37)
    torch.testing.assert_close(_product(simd, kind, x, blocks), expected, rtol=RTOL,
                               atol=RTOL * float(expected.abs().max()))


@pytest.mark.parametrize("kind", list(BLOCK_TYPES))
def test_the_kernels_unpacked_blocks_are_gguf_pys_dequantised_weights(simd, kind):
    blocks = _blocks(kind, 5, 3, seed=0)
    w = torch.from_numpy(blocks)
    _, block, size = BLOCK_TYPES[kind]
    out = torch.empty(5, blocks.shape[1] // size * block)
    assert simd.gguf_dequantize(BLOCK_TYPES[kind][0], w.data_ptr(), out.data_ptr(), 5,
                                out.shape[1], 1) == 0
    # The same float32 operations a weight (d q + m, d the float16 scale times the 6-bit
    # one), but the compiler may fuse the multiply and add: one rounding apart at most.
    torch.testing.assert_close(out, _dequantized(blocks, kind), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", list(BLOCK_TYPES))
@pytest.mark.parametrize("rows", [1, 6])  # a decode's one row sums each 32 before its scale
def test_the_simd_builds_and_the_plain_loops_agree(vectorised, scalar, kind, rows):
    blocks = _blocks(kind, 21, 5, seed=7)
    _, block, size = BLOCK_TYPES[kind]
    K = blocks.shape[1] // size * block
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(3))
    fast, plain = _product(vectorised, kind, x, blocks), _product(scalar, kind, x, blocks)
    # Two sum orders of the same float32 terms (16 lanes against one): RTOL of the largest.
    torch.testing.assert_close(fast, plain, rtol=RTOL, atol=RTOL * float(plain.abs().max()))


def test_a_fused_product_of_several_types_and_a_prefill_are_its_parts_side_by_side(simd):
    parts = [(_blocks("Q5_0", 8, 8, 1), "Q5_0"), (_blocks("Q8_0", 3, 8, 2), "Q8_0"),
             (_blocks("Q4_K", 5, 1, 3), "Q4_K")]  # 256 inputs each, three types
    module = BlockLinear(parts, 256)
    w = torch.cat([_dequantized(b, k) for b, k in parts])  # (16, 256)
    torch.testing.assert_close(module.dequantized(), w, rtol=1e-6, atol=1e-7)
    for rows in (1, 16, 40):  # decode rows by the kernel; a prefill's 40 by torch's matmul
        x = torch.randn(1, rows, 256, generator=torch.Generator().manual_seed(rows))
        expected = x @ w.t()
        torch.testing.assert_close(module(x), expected, rtol=RTOL,
                                   atol=RTOL * float(expected.abs().max()))


def test_the_block_sizes_are_ggmls():
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    for kind, (number, block, size) in BLOCK_TYPES.items():
        assert GGMLQuantizationType[kind].value == number
        assert GGML_QUANT_SIZES[GGMLQuantizationType[kind]] == (block, size)


def test_rows_that_are_not_whole_blocks_of_the_width_are_refused():
    blocks = _blocks("Q4_K", 2, 1, 0)  # 256 inputs a row
    with pytest.raises(ValueError, match="Q4_K rows of 144 bytes are not 512 inputs"):
        BlockLinear([(blocks, "Q4_K")], 512)
    with pytest.raises(ValueError, match="not 320 inputs in blocks of 256"):
        BlockLinear([(blocks, "Q4_K")], 320)


def test_neighbouring_parts_of_one_type_are_one_tensor_of_the_files_bytes():
    q, k, v = _blocks("Q5_0", 4, 2, 1), _blocks("Q5_0", 2, 2, 2), _blocks("Q8_0", 2, 2, 3)
    module = BlockLinear(_merged([(q, "Q5_0"), (k, "Q5_0"), (v, "Q8_0")]), 64)
    assert module.kinds == ["Q5_0", "Q8_0"] and module.out_features == 8
    assert np.array_equal(module.blocks0.numpy(), np.concatenate([q, k]))


@pytest.fixture
def tiny_llama(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHE_CACHE", str(tmp_path / "kvcache-cache"))
    path = write_tiny_gguf(tiny_hf(seed=3, vocab_size=300), tmp_path / "tiny-q4_1.gguf", "Q4_1")
    return str(path), load_model(str(path)).model


def test_a_llama_read_from_a_gguf_runs_its_blocks_with_float32s_tokens(tiny_llama):
    _, model = tiny_llama
    prompt = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    blocks = set_weights_dtype(copy.deepcopy(model), "gguf")
    assert linear.weights_format(blocks) == "gguf"
    # Every product, the fused ones and the tied head (the embedding's blocks) included.
    assert isinstance(blocks.lm_head, BlockLinear) and blocks.lm_head.kinds == ["Q4_1"]
    assert not any(isinstance(m, linear.Linear) for m in blocks.modules())
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        reference, logits = model(ids, 0), blocks(ids, 0)  # a prefill: 24 rows
        tokens = list(stream_tokens(model, prompt, 16, "static"))
        block_tokens = list(stream_tokens(blocks, prompt, 16, "static"))
    assert (logits - reference).abs().max() / reference.abs().max() < 1e-5
    assert len(set(tokens)) > 3 and block_tokens == tokens
    # 20 bytes a block of 32 (Q4_1) where float32 takes 128: under a fifth.
    assert weight_bytes(blocks) < weight_bytes(model) / 5
    assert linear.float_state(blocks).keys() == linear.float_state(model).keys()


def test_a_gemma3_in_the_real_files_block_types_runs_them_all(tmp_path):
    import gemmakit

    from kvcache_cli.models.gemma3 import Gemma3
    from kvcache_cli.models.gguf.reader import read_gemma3

    read = read_gemma3(gemmakit.write_tiny_gemma3(tmp_path / "tiny.gguf", types={
        "blk.1.ffn_down.weight": "Q4_K", "blk.2.ffn_down.weight": "Q5_K",
        "blk.3.attn_q.weight": "Q4_0", "blk.3.attn_k.weight": "Q4_1",
        "blk.4.ffn_up.weight": "Q5_1"}))
    model = Gemma3(read.config).eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in read.tensors.items()},
                          strict=False)
    model.lm_head.weight = model.model.embed_tokens.weight
    blocks = set_weights_dtype(copy.deepcopy(model), "gguf")
    kinds = {k for m in blocks.modules() if isinstance(m, BlockLinear) for k in m.kinds}
    assert kinds == set(BLOCK_TYPES)
    layer = blocks.model.layers[0].self_attn.qkv_proj
    assert layer.kinds == ["Q5_0", "Q8_0"]  # q and k one tensor, v its own
    ids = torch.arange(2, 14).view(1, -1)
    with torch.inference_mode():
        for rows in (ids, ids[:, :1]):  # a prefill, then a decode's one row
            reference, logits = model(rows, 0), blocks(rows, 0)
            assert (logits - reference).abs().max() / reference.abs().max() < 1e-4


def test_the_compiled_step_runs_the_blocks_as_one_operator(tiny_llama):
    from kvcache_cli.caches import make_cache
    from kvcache_cli.generate import CompiledDecode

    blocks = set_weights_dtype(copy.deepcopy(tiny_llama[1]), "gguf")
    prompt, n = [3, 1, 4, 1, 5, 9, 2, 6], 12

    def cache():
        return make_cache("static", blocks, max_len=len(prompt) + n, batch=1, whole=True)

    with torch.inference_mode():
        expected = list(stream_tokens(blocks, prompt, n, "static", cache=cache()))
        torch._dynamo.reset()
        with torch._dynamo.config.patch(error_on_recompile=True):  # fullgraph: no break
            got = list(stream_tokens(blocks, prompt, n, "static", cache=cache(),
                                     forward=CompiledDecode(blocks)))
    assert len(set(expected)) > 3 and got == expected


def test_the_step_profile_counts_the_block_products_as_products(tiny_llama):
    from kvcache_cli.bench.profile import profile_step

    blocks = set_weights_dtype(copy.deepcopy(tiny_llama[1]), "gguf")
    p = profile_step(blocks, 3, "tiny", "fp32", prompt_len=8)
    # Every product of this model is a BlockLinear's: no torch product runs in a decode
    # step, so what is counted is the kernel's calls, named while profiled.
    assert p.weights == "gguf" and dict(p.split_ms)["products"] > 0


def test_gguf_is_refused_for_a_model_not_read_from_a_gguf_or_off_the_cpu(tiny_llama):
    config = model_config("gpt2")
    with pytest.raises(ValueError, match="gguf weights are the blocks of the GGUF"):
        linear.check_weights_dtype("gguf", config, "cpu")
    llama = tiny_llama[1].config
    with pytest.raises(ValueError, match="gguf weights run on the CPU only"):
        linear.check_weights_dtype("gguf", llama, "cuda")
    linear.check_weights_dtype("gguf", llama, "cpu")


def test_the_cli_refuses_gguf_on_gpt2_in_one_line_before_loading():
    out = CliRunner().invoke(app, ["bench", "--device", "cpu", "-m", "gpt2",
                                   "--weights-dtype", "gguf"])
    assert out.exit_code == 2, out.output
    assert out.stdout == "" and out.stderr.count("\n") == 1, out.output
    assert out.stderr.startswith("error: --weights-dtype: gguf weights are the blocks")


def test_smollm2_as_stored_keeps_float32s_greedy_tokens():
    """The trained model on its own Q4_1 and Q8_0 blocks. (About 10 s on a quiet machine.)"""
    smollm2_or_skip()
    model = load_model("smollm2").model
    blocks = set_weights_dtype(copy.deepcopy(model), "gguf")
    prompt = [504, 3575, 282, 4649, 314]  # "The capital of France is"
    with torch.inference_mode():
        assert (list(stream_tokens(blocks, prompt, 16, "static"))
                == list(stream_tokens(model, prompt, 16, "static")))


def test_gemma3_as_stored_keeps_float32s_greedy_tokens():
    """The real file's Q4_K, Q5_0, Q6_K and Q8_0 blocks. (About a minute: the 262,144-row
    head is loaded as float32 and as blocks.)"""
    import gemmakit

    gemmakit.gemma3_or_skip()
    model = load_model("gemma3").model
    blocks = set_weights_dtype(copy.deepcopy(model), "gguf")
    kinds = {k for m in blocks.modules() if isinstance(m, BlockLinear) for k in m.kinds}
    assert kinds == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    prompt = [2, 818, 5279, 529, 7001, 563]  # <bos>The capital of France is
    with torch.inference_mode():
        assert (list(stream_tokens(blocks, prompt, 16, "static"))
                == list(stream_tokens(model, prompt, 16, "static")))
