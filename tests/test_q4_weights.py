"""The q4 weight format: a GGUF's own Q4_0/Q4_1 (and Q8_0) blocks run by torch's CPU int4
kernel without re-quantising, checked against the float32 model dequantised from the same
file, and the refusals of a model or device it cannot run, before any weights load."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from llamakit import smollm2_or_skip, tiny_hf, write_tiny_gguf
from typer.testing import CliRunner

from kvcache_cli.cli import app
from kvcache_cli.generate import stream_tokens
from kvcache_cli.measure import weight_bytes
from kvcache_cli.models import linear, load_model, model_config, set_weights_dtype
from kvcache_cli.models.linear import Int4Linear, planes_of
from kvcache_cli.models.llama_loading import source_types

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def converted_cache(tmp_path, monkeypatch):
    """Each test converts GGUF files into a folder of its own, never the user's cache."""
    monkeypatch.setenv("KVCACHE_CACHE", str(tmp_path / "kvcache-cache"))


def _planes_float(planes) -> torch.Tensor:
    """sum over planes of (q - 8) * s + z in float32: what the planes hold, no kernel."""
    w = 0
    for q, sz in planes:
        s, z = (sz[..., i].t().repeat_interleave(32, dim=1) for i in (0, 1))  # (out, in)
        w = w + (q.float() - 8) * s + z
    return w


def test_a_fused_product_of_q4_and_q8_blocks_is_its_parts_side_by_side():
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from kvcache_cli.models.gguf.q4 import _stacked

    rng = np.random.default_rng(1)
    q4 = quantize(rng.normal(size=(32, 64)).astype(np.float32), GGMLQuantizationType.Q4_1)
    q8 = quantize(rng.normal(size=(16, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
    parts = [planes_of(q4, "Q4_1"), planes_of(q8, "Q8_0")]  # one plane, then two
    fused = Int4Linear(_stacked(parts))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    expected = torch.cat([Int4Linear(p)(x) for p in parts], dim=-1)  # (3, 48)
    assert torch.equal(fused(x), expected)  # the padding plane adds exactly nothing
    torch.testing.assert_close(fused.dequantized(), torch.cat([_planes_float(p) for p in parts]),
                               rtol=0, atol=0.05)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_planes_hold_the_files_own_numbers(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    w = np.random.default_rng(0).normal(size=(48, 96)).astype(np.float32)
    blocks = quantize(w, GGMLQuantizationType[kind])  # (48, bytes): what a GGUF stores
    expected = dequantize(blocks, GGMLQuantizationType[kind])
    planes = planes_of(blocks, kind)
    assert len(planes) == (2 if kind == "Q8_0" else 1)  # 8 bits as two 4-bit planes
    assert all(int(q.min()) >= 0 and int(q.max()) <= 15 for q, _ in planes)
    # In float32 the mapping is exact: no weight re-quantised (float16 d, m are exact too).
    torch.testing.assert_close(_planes_float(planes), torch.from_numpy(expected),
                               atol=1e-6, rtol=0)


def test_the_kernels_product_is_the_planes_product_on_bfloat16_rows():
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    w = np.random.default_rng(1).normal(size=(64, 96)).astype(np.float32)
    planes = planes_of(quantize(w, GGMLQuantizationType.Q4_1), "Q4_1")
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(0))
    expected = x @ _planes_float(planes).t()  # (3, 64)
    # bfloat16 rows, scales and output (8 significant bits) move a sum of 96 unit-size
    # terms by ~1% of its size; a wrong nibble order or scale moves it by whole units.
    torch.testing.assert_close(Int4Linear(planes)(x), expected, atol=0.3, rtol=0.02)


@pytest.fixture
def tiny_q4(tmp_path):
    # A vocabulary of 320: the kernel packs output rows in sixteens.
    path = write_tiny_gguf(tiny_hf(seed=3, vocab_size=320), tmp_path / "tiny-q4_1.gguf", "Q4_1")
    return str(path), load_model(str(path)).model


def test_q4_runs_the_blocks_the_float32_model_was_dequantised_from(tiny_q4):
    _, model = tiny_q4
    ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(0))
    q4 = set_weights_dtype(copy.deepcopy(model), "q4")
    assert linear.weights_format(q4) == "q4" and isinstance(q4.lm_head, Int4Linear)
    with torch.inference_mode():
        reference, logits = model(ids, 0), q4(ids, 0)
        tokens = list(stream_tokens(model, ids[0].tolist(), 16, "static"))
        q4_tokens = list(stream_tokens(q4, ids[0].tolist(), 16, "static"))
    # The same weights (each within bfloat16's rounding of its scale), the rows and
    # outputs rounded to bfloat16: through two layers of std-0.2 weights that moves the
    # logits by about 2% of the largest (what bf16 weights do, test_weight_formats); a
    # wrong nibble, row order or scale moves them by 100%.
    assert (logits - reference).abs().max() / reference.abs().max() < 0.05
    assert len(set(tokens)) > 3 and q4_tokens == tokens
    # Half a byte a weight plus a bfloat16 scale and zero per 32: under a fifth of float32.
    assert weight_bytes(q4) < weight_bytes(model) / 5


def test_q4_is_refused_for_a_model_not_read_from_a_gguf_or_off_the_cpu(tiny_q4, tmp_path):
    path, _ = tiny_q4
    config = model_config("gpt2")
    with pytest.raises(ValueError, match="not read from a GGUF file"):
        linear.check_weights_dtype("q4", config, "cpu")
    with pytest.raises(ValueError, match="q4 weights run on the CPU only"):
        linear.check_weights_dtype("q4", config, "cuda")
    f32 = write_tiny_gguf(tiny_hf(vocab_size=320), tmp_path / "tiny-f32.gguf", "F32")
    with pytest.raises(ValueError, match=r"q4 runs Q4_0, Q4_1, Q8_0 blocks without "
                       r"re-quantising; model\.embed_tokens\.weight is F32 in tiny-f32\.gguf"):
        linear.check_weights_dtype("q4", load_model(str(f32)).model.config, "cpu",
                                 source_types(str(f32)))
    config = load_model(path).model.config
    linear.check_weights_dtype("q4", config, "cpu", source_types(path))
    odd = dataclasses.replace(config, vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary a multiple of 16.*300"):
        linear.check_weights_dtype("q4", odd, "cpu", source_types(path))


def test_the_cli_refuses_q4_on_gpt2_in_one_line_before_loading():
    out = CliRunner().invoke(app, ["bench", "--device", "cpu", "-m", "gpt2",
                                   "--weights-dtype", "q4"])
    assert out.exit_code == 2, out.output
    assert out.stdout == "" and out.stderr.count("\n") == 1, out.output
    assert out.stderr.startswith("error: --weights-dtype: q4 weights are a GGUF's own")


def test_smollm2_q4_keeps_float32s_greedy_tokens():
    """The trained model: the 4-bit blocks are the numbers its float32 weights came from.
    (About 10 s on a quiet machine: loading 135M weights twice, once from the blocks.)"""
    smollm2_or_skip()
    model = load_model("smollm2").model
    q4 = set_weights_dtype(copy.deepcopy(model), "q4")
    prompt = [504, 3575, 282, 4649, 314]  # "The capital of France is"
    with torch.inference_mode():
        assert (list(stream_tokens(q4, prompt, 8, "static"))
                == list(stream_tokens(model, prompt, 8, "static")))
