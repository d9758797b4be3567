"""`bench` with weight formats and llama.cpp as a peer, on a tiny random GPT-2.

The llama.cpp runs need the `llama` extra (llama-cpp-python builds llama.cpp from source,
minutes), so they skip without it: CI's default run installs only the test extra. What
needs no llama.cpp (the refusals, the int8 bench, the verdict line) always runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvcache_cli.bench import run as bench_run
from kvcache_cli.cli import app
from kvcache_cli.models import llama_cpp as llama_peer
from kvcache_cli.models.gpt2 import GPT, GPTConfig
from kvcache_cli.models.linear import arrange_weights

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT, NEW = 6, 12
has_llama = pytest.mark.skipif(not llama_peer.llama_available(),
                               reason="needs the llama extra (llama-cpp-python, gguf)")


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A tiny GPT-2 checkpoint, drawn wide (initializer_range 0.3) so greedy tokens vary."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=96, n_positions=64,
                        initializer_range=0.3)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


def _cli(*args: str):
    return CliRunner().invoke(app, ["bench", *args])


def _one_line(out, code: int = 2) -> str:
    assert out.exit_code == code, out.output
    assert out.stdout == "" and out.stderr.count("\n") == 1, out.output
    return out.stderr


def test_unknown_weights_dtype_is_one_line_with_the_choices():
    err = _one_line(_cli("--device", "cpu", "--weights-dtype", "int4"))
    assert err == ("error: --weights-dtype: unknown weights dtype 'int4'; expected fp32, "
                   "bf16, fp16, int8, q4, gguf, gguf-q8, q8_0\n")


def test_int8_for_a_width_its_kernel_cannot_run_is_refused_before_loading(tmp_path):
    # A config and no weights: the refusal must come before any weights are read.
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "n_positions": 64, "vocab_size": 96, "n_layer": 2,
         "n_head": 2, "n_embd": 40}))  # fmt: skip
    err = _one_line(_cli("--device", "cpu", "--model", str(tmp_path), "--weights-dtype",
                         "int8"))  # fmt: skip
    assert "n_embd a multiple of 16" in err and "40" in err


def test_a_llama_mode_without_the_extra_names_it_and_says_it_builds(monkeypatch):
    monkeypatch.setattr(llama_peer, "llama_available", lambda: False)
    err = _one_line(_cli("--device", "cpu", "--modes", "static,llama.cpp-q8_0"))
    assert err.startswith("error: mode 'llama.cpp-q8_0' needs the llama extra: ")
    assert "pip install 'kvcache[llama]'" in err and "from source" in err


def test_int8_bench_reports_its_error_against_float32_and_its_bytes(checkpoint):
    out = _cli("--model", str(checkpoint), "--weights", "pretrained", "--device", "cpu",
               "--prompt-len", str(PROMPT), "--new-tokens", str(NEW), "--repeats", "1",
               "--modes", "static,concat", "--weights-dtype", "int8", "--json")
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["weights_format"] == "int8" and data["dtype"] == "float32"
    check = data["weights_check"]
    assert check["weights"] == "int8" and 0 < check["logits_rel_error"] < 0.1
    # Equal tokens, or a flip where float32's own two best were close: reported, not hidden.
    assert check["same_tokens"] or check["first_difference"]["near_tie"]
    static = next(m for m in data["modes"] if m["mode"] == "static")
    assert static["weight_bytes"] == data["weight_bytes"]
    assert "avx512_bf16" in (data["cpu_half_support"] or "avx512_bf16")  # where the CPU has it


def test_the_verdict_names_the_fastest_peer_the_ratio_and_the_limits(checkpoint):
    out = _cli("--model", str(checkpoint), "--weights", "pretrained", "--device", "cpu",
               "--prompt-len", str(PROMPT), "--new-tokens", str(NEW), "--repeats", "1",
               "--modes", "static,hf", "--threads", "1")
    assert out.exit_code == 0, out.output
    shown = " ".join(out.stdout.split())
    assert "fastest peer hf" in shown and "ours static" in shown
    assert "of the limit" in shown and "x the peer" in shown


def test_generate_runs_int8_weights_and_says_so(checkpoint):
    out = CliRunner().invoke(app, ["generate", "--model", str(checkpoint), "--weights",
                                   "pretrained", "--ids", "1,2,3", "-n", "4",
                                   "--weights-dtype", "int8"])  # fmt: skip
    assert out.exit_code == 0, out.output
    assert "int8 weights" in " ".join(out.stdout.split())


def test_serve_runs_int8_weights_and_every_request_keeps_its_solo_tokens(checkpoint):
    out = CliRunner().invoke(app, [
        "serve", "--device", "cpu", "--model", str(checkpoint), "--weights", "pretrained",
        "--weights-dtype", "int8", "--requests", "3", "--prompt-len", "4:6",
        "--output-len", "3:5", "--shared-prefix", "0", "--engines", "sequential,paged",
        "--kv-mem", "1MiB", "--threads", "1", "--json"])  # fmt: skip
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert all(e["requests_exact"] == 3 and not e["mismatches"] for e in data["engines"])


# ---------------------------------------------------------------------------- llama.cpp


def _tiny() -> GPT:
    config = GPTConfig(block_size=64, vocab_size=256, n_layer=2, n_head=4, n_embd=64)
    return arrange_weights(GPT(config, init_std=0.2, seed=0).eval())


@has_llama
def test_llama_cpp_f32_runs_the_same_function_and_q8_0_reads_fewer_bytes(tmp_path):
    model = _tiny()
    result = bench_run.run_bench(model, modes=("static", "llama.cpp", "llama.cpp-q8_0"),
                             prompt_len=PROMPT, new_tokens=NEW, repeats=1, bandwidth_mib=4,
                             gguf_dir=tmp_path)  # fmt: skip
    static, f32, q8 = (result.mode(m) for m in ("static", "llama.cpp", "llama.cpp-q8_0"))
    assert len(set(static.tokens)) > 2  # the tokens vary, so agreement means something
    for m in (f32, q8):
        assert m.tokens_generated == NEW
        assert m.same_tokens or m.difference_margin.near_tie, (m.mode, m.difference_margin)
    assert q8.weight_bytes < f32.weight_bytes / 3
    assert result.llama_cpp_version is not None
    assert len(list(tmp_path.glob("*.gguf"))) == 2  # F32 written once, Q8_0 quantised from it


@has_llama
def test_llama_cpp_files_are_reused_by_content(tmp_path):
    first = llama_peer.prepare(_tiny(), "llama.cpp-f16", tmp_path)
    again = llama_peer.prepare(_tiny(), "llama.cpp-f16", tmp_path)
    assert not first.cached and again.cached and again.path == first.path
