"""transformers' own LlamaForCausalLM with its QuantizedCache as eval rows: the spelling, the
refusals before a model loads, and rows that agree with the same quantiser run inside
kvcache's Llama (`quanto-int4`), each scored against its own exact cache."""

from __future__ import annotations

import random
import re

import pytest
from clikit import refusal
from llamakit import tiny_hf, write_tiny_gguf

from kvcache_cli.eval.peer_hf import HFCacheSpec, parse_transformers


@pytest.mark.parametrize(("text", "spec", "canonical"), [
    ("transformers:quanto-int4", HFCacheSpec("quanto", 4, 64, 128),
     "transformers:quanto-int4:g64:r128"),
    ("TRANSFORMERS:quanto-int2:g32:r16", HFCacheSpec("quanto", 2, 32, 16),
     "transformers:quanto-int2:g32:r16"),
    ("transformers:hqq-int4:r64", HFCacheSpec("hqq", 4, 64, 64), "transformers:hqq-int4:g64:r64"),
])
def test_a_transformers_spec_names_bits_group_and_residual(text, spec, canonical):
    assert parse_transformers(text) == spec and str(spec) == canonical


@pytest.mark.parametrize(("text", "words"), [
    ("transformers:quanto-int3", "expected transformers:KIND (quanto-int4, quanto-int2, hqq"),
    ("transformers:quanto-int4:x9", "unknown field 'x9'"),
    ("transformers:quanto-int4:g32:g16", "gN given twice"),
    ("transformers:quanto-int4:r0", "at least 1"),
])
def test_a_malformed_transformers_spec_is_one_line(text, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        parse_transformers(text)


def on_tiny_llama(tiny_llama, *args: str) -> list[str]:
    """eval's arguments for the tiny Llama and a text of its vocabulary."""
    text = tiny_llama.parent / "t.txt"
    text.write_text("a b c d " * 100)
    return ["-m", str(tiny_llama), "--text", str(text), *args]


@pytest.mark.parametrize(("llama", "cache", "words"), [
    (False, "transformers:quanto-int4", "is not a Llama"),  # the byte-level GPT
    (True, "transformers:quanto-int4:g5", "do not divide the head size 64"),
    (True, "int8,transformers:quanto-int4,transformers:quanto-int4", "listed twice"),
])
def test_bad_transformers_caches_are_one_line_exit_2_before_a_model_loads(
        no_model_loads, tiny_llama, llama, cache, words):
    pytest.importorskip("torch")
    args = (on_tiny_llama(tiny_llama, "--cache", cache) if llama
            else ["-m", "stdlib-bytes", "--cache", cache])
    assert words in refusal("eval", *args)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    pytest.importorskip("transformers")
    hf = tiny_hf(seed=1, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    return write_tiny_gguf(hf, tmp_path_factory.mktemp("gguf") / "tiny.gguf", "F32")


def test_transformers_rows_equal_its_quantiser_inside_kvcache_s_llama(tiny_llama):
    pytest.importorskip("optimum.quanto")
    from kvcache_cli.eval import quality
    from kvcache_cli.eval.peer_hf import REFERENCE, evaluate
    from kvcache_cli.models import load_model

    model = load_model(str(tiny_llama)).model
    ids = random.Random(0).choices(range(300), k=60)
    ours = quality.evaluate(model, ids, ["quanto-int4:g32:r8"], prompt_len=16)
    ref, peer = evaluate(model, ids, [HFCacheSpec("quanto", 4, 32, 8)], prompt_len=16)
    assert ref.cache == REFERENCE and ref.reference and ref.kl_mean == 0
    assert peer.against == REFERENCE and peer.peer == "transformers"
    assert len(peer.loss_by_position) == len(ours.caches[0].loss_by_position)
    # The same quantiser on the same weights and ids: transformers' whole model with its
    # cache agrees with kvcache's Llama holding transformers' cache layers, up to float32
    # rounding of two implementations of the same attention.
    quanto = ours.caches[1]
    assert quanto.kl_mean > 1e-4  # the quantiser did round something
    assert peer.kl_mean == pytest.approx(quanto.kl_mean, rel=0.05, abs=1e-5)
    assert peer.perplexity == pytest.approx(quanto.perplexity, rel=1e-3)
    assert peer.bytes_held == quanto.bytes_held


def test_a_backend_not_installed_is_one_line_exit_2_before_a_model_loads(
        no_model_loads, tiny_llama, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "hqq" else find_spec(name, *a))
    line = refusal("eval", *on_tiny_llama(tiny_llama, "--cache", "transformers:hqq-int4"))
    assert "DISABLE_CUDA=1 pip install hqq" in line


def test_hqq_rows_are_scored_against_transformers_exact_cache_with_their_bytes(tiny_llama):
    """HQQ's rows through transformers' own model: scored against its exact cache, the
    bytes of its codes, scales and zeros counted, more bits costing less KL."""
    pytest.importorskip("hqq")
    from kvcache_cli.eval.peer_hf import evaluate
    from kvcache_cli.models import load_model

    model = load_model(str(tiny_llama)).model
    ids = random.Random(1).choices(range(300), k=60)
    ref, four, two = evaluate(model, ids, [HFCacheSpec("hqq", 4, 64, 8),
                                           HFCacheSpec("hqq", 2, 64, 8)], prompt_len=16)
    assert ref.kl_mean == 0 and four.peer == two.peer == "transformers"
    assert 0 < four.kl_mean < two.kl_mean
    assert 0 < two.bytes_held < four.bytes_held < ref.bytes_held
