"""Gemma 3's breaks: each shows its symptom on a tiny random Gemma 3 (two sliding layers to
one global, a window of 16), and the CLI runs them on `-m gemma3` where it is installed.

The window breaks' symptom is where the logits move: not before the first query that sits
past the window (the window is the model's math: until a key falls out of it, a cache that
forgets nothing and a ring agree), and from there on."""

from __future__ import annotations

import json

import gemmakit
import pytest
import torch

from kvcache_cli.breaks.gemma3 import run_gemma3_break, swapped_bases
from kvcache_cli.caches.base import LayerType
from kvcache_cli.models.gemma3 import Gemma3, Gemma3Config
from kvcache_cli.models.llama import init_random

pytestmark = pytest.mark.usefixtures("one_torch_thread")
W, N_NEW = 16, 12  # the prompt is W - N_NEW // 2 = 10 tokens: the run crosses the window


def tiny(window: int = W) -> Gemma3:
    types = tuple(LayerType(window, 10_000.0) if (i + 1) % 3 else LayerType(None, 1e6)
                  for i in range(6))
    config = Gemma3Config(n_layer=6, n_head=4, n_kv_head=1, n_embd=64, intermediate=96,
                          vocab_size=97, context=128, head_dim=32, layer_types=types,
                          query_pre_attn_scalar=32)
    return init_random(Gemma3(config), std=0.3, seed=0).eval()


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny()


@pytest.mark.parametrize("name", ["sliding-unbanded", "global-windowed"])
def test_a_window_break_moves_nothing_until_a_query_sits_past_the_window(model, name):
    r = run_gemma3_break(name, model, N_NEW)
    assert (r.window, r.window_step) == (W, W - len(r.prompt_ids) + 1) == (W, 7)
    assert r.naive_agrees and r.naive_logit_diff < 1e-4  # the correct loop is exact
    assert max(r.step_logit_diff[:r.window_step]) < 1e-4  # inside the window: the same
    assert r.first_wrong_step == r.window_step  # the first query past it: moved
    assert r.step_logit_diff[r.window_step] > 0.1


def test_sliding_unbanded_holds_every_position_on_the_sliding_layers(model):
    r = run_gemma3_break("sliding-unbanded", model, N_NEW)
    held = len(r.prompt_ids) + N_NEW - 1  # the last token made is not fed back
    assert r.broken_bytes_by_kind["full"] == r.bytes_by_kind["full"]
    # float32, 1 KV head of 32, k and v: 256 bytes a position a layer; 4 sliding layers
    assert r.bytes_by_kind["sliding"] == 4 * W * 256  # rings of the window
    assert r.broken_bytes_by_kind["sliding"] >= 4 * held * 256


def test_global_windowed_holds_a_window_on_the_global_layers(model):
    r = run_gemma3_break("global-windowed", model, N_NEW)
    assert r.broken_bytes_by_kind == {"sliding": 4 * W * 256, "full": 2 * W * 256}
    assert r.bytes_by_kind["full"] > r.broken_bytes_by_kind["full"]


def test_swapped_bases_move_the_logits_from_the_prompt_on(model):
    r = run_gemma3_break("rope-bases-swapped", model, N_NEW)
    assert r.naive_agrees
    assert r.first_wrong_step == 0 and r.step_logit_diff[0] > 0.1
    assert r.broken_bytes_by_kind == r.bytes_by_kind  # a wrong angle costs no bytes


def test_swapped_bases_share_the_weights_and_trade_the_two_tables(model):
    broken = swapped_bases(model)
    assert broken.model is model.model  # the same blocks and weights
    assert broken.rotary["sliding"] is model.rotary["full"]
    assert broken.rotary["full"] is model.rotary["sliding"]
    assert set(model.rotary) == {"full", "sliding"}  # the original untouched


def test_a_model_without_sliding_layers_is_refused_in_one_line():
    from kvcache_cli.models.llama import Llama, LlamaConfig

    llama = Llama(LlamaConfig(n_layer=1, n_head=2, n_kv_head=1, n_embd=16, intermediate=32,
                              vocab_size=32, context=64))
    with pytest.raises(ValueError, match="runs on the Gemma 3 family") as err:
        run_gemma3_break("sliding-unbanded", llama, 4)
    assert "\n" not in str(err.value)


def test_a_gemma3_break_asked_of_a_llama_or_a_llama_break_of_gemma3_is_refused(tmp_path):
    from kvcache_cli.cli.breaks import _models_for

    with pytest.raises(Exception) as err:  # typer.Exit via fail()
        _models_for(["rope-bases-swapped"], "gpt2", "rope-bases-swapped")
    assert getattr(err.value, "exit_code", None) == 2
    gemma = gemmakit.write_tiny_gemma3(tmp_path / "tiny.gguf")
    runs, notes = _models_for(["position-offset", "global-windowed"], str(gemma), "all")
    assert runs == {str(gemma): ["global-windowed"]}
    assert len(notes) == 1 and "not on the Gemma 3 family" in notes[0]


def test_all_without_gemma3_installed_says_how_to_install_it(monkeypatch):
    from kvcache_cli.breaks.registry import names
    from kvcache_cli.cli.breaks import _models_for

    monkeypatch.setattr("kvcache_cli.models.gemma3_270m.gemma3_gguf", lambda: None)
    runs, notes = _models_for(names("gemma3"), None, "all")
    assert runs == {}
    assert notes == [f"skipped: the Gemma 3 breaks ({', '.join(names('gemma3'))}) need Gemma "
                     f"3 270M, which is not installed: {gemmakit.GEMMA3_INSTALL}"]


# ---------------------------------------------------------------- Gemma 3 270M, where installed

@pytest.mark.skipif(__import__("kvcache_cli.models.gemma3_270m", fromlist=["x"]).gemma3_gguf()
                    is None, reason=f"Gemma 3 270M is not installed ({gemmakit.GEMMA3_INSTALL})")
def test_cli_sliding_unbanded_on_gemma3_moves_at_the_window():
    from typer.testing import CliRunner

    from kvcache_cli.cli import app

    result = CliRunner().invoke(app, ["break", "sliding-unbanded", "-m", "gemma3",
                                      "--max-new-tokens", "4", "--json"])
    assert result.exit_code == 0, result.output
    r = json.loads(result.stdout)
    assert (r["window"], len(r["prompt_ids"]), r["window_step"]) == (512, 510, 3)
    assert r["naive_agrees"] and r["first_wrong_step"] == 3
