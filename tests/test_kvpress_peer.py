"""NVIDIA kvpress's presses as eval rows: the spelling, the refusals before a model loads (no
venv: CI has none), the runner's protocol and scoring on a transformers model with a stand-in
press (no kvpress needed), and, where the venv `scripts/kvpress_venv.sh install` made is
there, the real presses beside kvcache's own kinds on the same tiny Llama."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import re
from pathlib import Path

import pytest
from clikit import refusal
from llamakit import tiny_hf, write_tiny_gguf

from kvcache_cli.eval import kvpress_runner, peer_kvpress
from kvcache_cli.eval.peer_kvpress import KvpressSpec, parse_kvpress
from kvcache_cli.eval.quality import Refusal


@pytest.mark.parametrize(("text", "canonical", "press", "kwargs"), [
    ("kvpress:snapkv:0.25", "kvpress:snapkv:0.25:w32:k7", "SnapKVPress",
     {"compression_ratio": 0.75, "window_size": 32, "kernel_size": 7}),
    ("KVPRESS:knorm:0.5", "kvpress:knorm:0.5", "KnormPress", {"compression_ratio": 0.5}),
    ("kvpress:recent:0.1:s4", "kvpress:recent:0.1:s4", "StreamingLLMPress",
     {"compression_ratio": 0.9, "n_sink": 4}),
    ("kvpress:expected:1.0", "kvpress:expected:1.0:s4", "ExpectedAttentionPress",
     {"compression_ratio": 0.0, "n_sink": 4}),
])
def test_a_kvpress_spec_keeps_kvcache_s_share_and_hands_kvpress_the_share_removed(
        text, canonical, press, kwargs):
    spec = parse_kvpress(text)
    assert str(spec) == canonical and parse_kvpress(canonical) == spec
    assert spec.press() == {"name": canonical, "press": press, "kwargs": kwargs}


@pytest.mark.parametrize(("text", "words"), [
    ("kvpress:h2o:0.25", "expected kvpress:KIND:R (snapkv, knorm, recent, expected"),
    ("kvpress:snapkv:64", "kvpress takes a ratio, not a count of tokens"),
    ("kvpress:knorm:1.5", "in (0, 1]"),
    ("kvpress:knorm:0.25:w4", "knorm takes none"),
    ("kvpress:snapkv:0.25:k6", "odd pooling kernel"),
    ("kvpress:recent:0.25:s1:s2", "sN given twice"),
])
def test_a_malformed_kvpress_spec_is_one_line(text, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        parse_kvpress(text)


def test_no_venv_is_one_line_naming_the_script_before_a_model_loads(
        no_model_loads, tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHE_KVPRESS_VENV", str(tmp_path / "none"))
    text = tiny_llama.parent / "t.txt"
    text.write_text("a b c d " * 100)
    line = refusal("eval", "-m", str(tiny_llama), "--text", str(text),
                   "--cache", "knorm:0.5,kvpress:knorm:0.5")
    assert "bash scripts/kvpress_venv.sh install" in line and str(tmp_path / "none") in line


def test_a_bad_kvpress_spec_among_kvcache_s_is_one_line_exit_2():
    assert "not a count of tokens" in refusal("eval", "-m", "stdlib-bytes", "--cache",
                                              "int8,kvpress:snapkv:32")


def test_kvpress_refuses_a_model_outside_its_families_and_says_why_sliding_layers_matter():
    supported = ("LlamaForCausalLM", "Gemma3ForConditionalGeneration")
    assert kvpress_runner.refusal("LlamaForCausalLM", ["full_attention"], supported, "0.5.5") \
        is None
    gemma = kvpress_runner.refusal("Gemma3ForCausalLM",
                                   ["sliding_attention", "full_attention"], supported, "0.5.5")
    assert "not Gemma3ForCausalLM" in gemma and "sliding layers as full ones" in gemma
    gpt = kvpress_runner.refusal("GPT2LMHeadModel", [], supported, "0.5.5")
    assert "not GPT2LMHeadModel" in gpt and "sliding" not in gpt


def test_a_refusal_is_a_line_a_cache_not_a_crash(monkeypatch):
    monkeypatch.setattr(peer_kvpress, "run_runner",
                        lambda job: {"refused": f"not {job['architecture']}", "rows": []})
    specs = [KvpressSpec("knorm", 0.5), KvpressSpec("recent", 0.5, (("s", 0),))]
    model = type("NotLlama", (), {"config": type("C", (), {"layer_types": ()})()})()
    rows, refused = peer_kvpress.evaluate(model, list(range(40)), specs, prompt_len=16,
                                          threads=1)
    why = "not GPT2LMHeadModel"
    assert rows == () and refused == (Refusal("kvpress:knorm:0.5", "kvpress", why),
                                      Refusal("kvpress:recent:0.5:s0", "kvpress", why))


@contextlib.contextmanager
def drop_oldest(cache, keep: int):
    """A stand-in press: at the end of the prefill it keeps each layer's newest `keep` keys
    and values (kvpress replaces a layer's tensors with the kept ones the same way)."""
    yield
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, -keep:], layer.values[:, :, -keep:]


def test_the_runner_scores_a_press_against_the_exact_cache_at_the_text_s_positions():
    """The runner's protocol on transformers' model with no kvpress: a press that keeps
    everything scores as the exact cache; one that drops keys holds fewer bytes and, decoding
    at the text's positions over what it kept, differs from the exact cache."""
    import torch
    from transformers import DynamicCache

    torch.set_num_threads(1)
    hf = tiny_hf(seed=2)
    ids = random.Random(2).choices(range(200), k=40)
    made = []  # the caches in the order the runner makes them: exact, none, drop

    def new_cache():
        made.append(DynamicCache())
        return made[-1]

    exact, none, drop = kvpress_runner.run(
        hf, ids, 16, [("none", contextlib.nullcontext),
                      ("drop", lambda: drop_oldest(made[2], 8))], new_cache)
    assert none.nll == exact.nll and max(none.kl) == 0 and all(none.agree)
    assert len(drop.nll) == len(exact.nll) == 40 - 16
    assert drop.nll[0] == exact.nll[0]  # the prefill's prediction saw the whole prompt
    assert max(drop.kl[1:]) > 1e-4
    c = hf.config
    token = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 4  # K and V, fp32
    assert kvpress_runner.layer_bytes(exact.cache) == 39 * token
    assert kvpress_runner.layer_bytes(drop.cache) == (8 + 39 - 16) * token


# What the runner writes for an exact cache and one press, two positions scored.
ROWS = [{"name": kvpress_runner.REFERENCE, "nll": [1.0, 2.0], "kl": [0.0, 0.0],
         "agree": [True, True], "step_ms": [1.0], "prefill_ms": 3.0, "bytes_held": 400,
         "positions": 10},
        {"name": "kvpress:knorm:0.5", "nll": [1.0, 3.0], "kl": [0.0, 0.5],
         "agree": [True, False], "step_ms": [1.0], "prefill_ms": 3.0, "bytes_held": 200,
         "positions": 10}]


def test_the_runner_s_rows_become_eval_rows_against_kvpress_s_exact_cache():
    ref, knorm = peer_kvpress.rows_from(ROWS, prompt_len=8)
    assert ref.reference and ref.peer == knorm.peer == "kvpress"
    assert knorm.against == kvpress_runner.REFERENCE and knorm.bytes_ratio == 0.5
    assert knorm.kl_mean == 0.25 and knorm.top1_agreement == 0.5 and knorm.kl_max_position == 9


def test_the_table_says_how_kvpress_ran_and_what_it_refused_and_json_keeps_it():
    from kvcache_cli.eval.quality import QualityResult, result_from_json
    from kvcache_cli.views.quality import plain

    ref, knorm = peer_kvpress.rows_from(ROWS, prompt_len=8)
    static = dataclasses.replace(ref, cache="static", peer="", against="static")
    result = QualityResult(
        model="m", weights_note=None, text="t", tokens=10, prompt_len=8, chunk=1, device="cpu",
        dtype="float32", threads=1, torch_version="2", machine="x86_64", reference="static",
        caches=(static, ref, knorm), first_token_share=(0.5,), uniform_share=0.1,
        refused=(Refusal("kvpress:recent:0.5:s0", "kvpress", "not Gemma3ForCausalLM"),))
    text = plain(result, 100)
    assert "kvpress's rows run its presses on transformers' model" in text
    assert "own exact kvpress:dynamic cache" in text and "llama.cpp" not in text
    assert "kvpress:recent:0.5:s0: refused by kvpress: not Gemma3ForCausalLM" in text
    saved = json.loads(json.dumps(dataclasses.asdict(result)))
    assert result_from_json(saved).refused == result.refused


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    pytest.importorskip("transformers")
    hf = tiny_hf(seed=1, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    return write_tiny_gguf(hf, tmp_path_factory.mktemp("gguf") / "tiny.gguf", "F32")


@pytest.fixture
def kvpress_venv(monkeypatch):
    """The venv `bash scripts/kvpress_venv.sh install` made (KVCACHE_KVPRESS_VENV, else its
    default under the home cache, which the suite's temporary KVCACHE_CACHE hides)."""
    venv = Path(os.environ.get("KVCACHE_KVPRESS_VENV")
                or Path.home() / ".cache" / "kvcache" / "kvpress-venv")
    if not (venv / "bin" / "python").is_file():
        pytest.skip(f"no kvpress venv at {venv} (bash scripts/kvpress_venv.sh install makes one)")
    monkeypatch.setenv("KVCACHE_KVPRESS_VENV", str(venv))
    return venv


def test_kvpress_s_presses_match_kvcache_s_kinds_on_the_same_llama(kvpress_venv, tiny_llama):
    """The real presses in their venv: KnormPress and StreamingLLMPress keep the same keys
    as kvcache's knorm and recent, so they score the same to float tolerance; kvcache's
    rows hold more bytes only by the position it keeps per key."""
    from kvcache_cli.eval import quality
    from kvcache_cli.models import load_model

    model = load_model(str(tiny_llama)).model
    ids = random.Random(0).choices(range(300), k=48)
    ours = quality.evaluate(model, ids, ["knorm:0.5", "recent:0.5"], prompt_len=16)
    rows, refused = peer_kvpress.evaluate(
        model, ids, [parse_kvpress("kvpress:knorm:0.5"), parse_kvpress("kvpress:recent:0.5"),
                     parse_kvpress("kvpress:snapkv:0.5:w4:k3")], prompt_len=16, threads=1)
    assert refused == ()
    ref, knorm, recent, snapkv = rows
    assert ref.kl_mean == 0 and ref.perplexity == pytest.approx(ours.caches[0].perplexity,
                                                                rel=1e-4)
    for peer, own in ((knorm, ours.caches[1]), (recent, ours.caches[2])):
        assert peer.kl_mean > 1e-4
        assert peer.kl_mean == pytest.approx(own.kl_mean, rel=1e-3, abs=1e-6)
        assert peer.perplexity == pytest.approx(own.perplexity, rel=1e-4)
        assert peer.bytes_held < own.bytes_held
    assert snapkv.bytes_held == knorm.bytes_held < ref.bytes_held


def test_kvpress_refuses_gemma_3_s_text_model_through_the_real_venv(kvpress_venv):
    out = peer_kvpress.run_runner({"architecture": "Gemma3ForCausalLM", "model": "", "ids": [],
                                   "layer_types": ["sliding_attention", "full_attention"],
                                   "prompt_len": 1, "threads": 1, "presses": []})
    assert out["rows"] == [] and "not Gemma3ForCausalLM" in out["refused"]
    assert "Gemma3ForConditionalGeneration" in out["refused"]
