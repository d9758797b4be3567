"""`kvcache size` and `kvcache models` through typer's CliRunner: output, JSON, every bad input
as one line with exit 2, start-up without torch, and --verify against real transformers caches."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvcache_cli.cli import app
from kvcache_cli.sizing import PRESETS

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args), env={"COLUMNS": "100"})


def ok(*args: str):
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    return result


def size_json(*args: str) -> dict:
    return json.loads(ok("size", *args, "--json").stdout)


def test_issue_example_exactly_as_typed():
    out = ok("size", "--layers", "32", "--kv-heads", "8", "--seq", "32768").stdout
    assert "4.00 GiB (4.29 GB)" in out
    assert "= 2 × 32 × 8 × 128 × 32,768 × 2 × 1" in out
    assert "131,072 bytes" in out


def test_json_has_stable_keys_and_exact_numbers():
    data = size_json("--layers", "32", "--kv-heads", "8", "--heads", "32", "--seq", "32768")
    assert data["total_bytes"] == 4 * 2**30
    assert data["bytes_per_token"] == 131_072
    assert data["bytes_per_token_per_layer"] == 4096
    assert data["mha_total_bytes"] == 16 * 2**30 and data["reduction"] == 4.0
    assert data["kinds"][0]["kind"] == "full"
    assert data["tp"] is None and data["fit"] is None and data["verify"] is None


def test_model_with_gpu_mem_reports_the_fit():
    out = ok("size", "--model", "llama-2-7b", "--seq", "4096", "--gpu-mem", "80GiB").stdout
    assert "12.55 GiB" in out and "max sequences of 4,096 tokens" in out
    data = size_json("--model", "llama-2-7b", "--seq", "4096", "--gpu-mem", "80GiB",
                     "--block-size", "16")
    assert data["fit"]["max_tokens"] == 138_134
    assert data["fit"]["max_sequences"] == 33
    assert data["fit"]["max_sequences_paged"] == 33


def test_config_flag_reads_a_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gemma2", "num_hidden_layers": 42, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 256, "hidden_size": 3584,
        "sliding_window": 4096}))
    data = size_json("--config", str(tmp_path), "--seq", "32768")
    assert data["total_bytes"] == 21 * 8192 * 32768 + 21 * 8192 * 4096
    assert "sliding" in ok("size", "--config", str(tmp_path), "--seq", "32768").stdout


def test_tp_and_mla_are_shown():
    out = ok("size", "--model", "deepseek-v3", "--seq", "32768", "--tp", "8").stdout
    assert "tensor parallel, 8 GPUs" in out and "cannot be split" in out
    data = size_json("--model", "llama-2-70b", "--seq", "4096", "--tp", "16")
    assert data["tp"]["replicas"] == 2


def test_huge_sizes_print_in_exbibytes():
    out = ok("size", "--layers", "80", "--kv-heads", "8", "--seq", "1000000000",
             "--batch", "10000").stdout
    assert "2.84 EiB" in out


def test_models_lists_every_preset():
    out = ok("models").stdout
    for name in PRESETS:
        assert name in out
    data = json.loads(ok("models", "--json", "--dtype", "int4").stdout)
    assert [row["name"] for row in data] == list(PRESETS)
    llama = next(row for row in data if row["name"] == "llama-2-7b")
    assert llama["bytes_per_token"] == 131_072  # a quarter of fp16's 524,288


@pytest.mark.parametrize(("args", "message"), [
    (["size", "--layers", "0", "--kv-heads", "8", "--seq", "8"], "--layers 0"),
    (["size", "--layers", "-4", "--kv-heads", "8", "--seq", "8"], "--layers -4"),
    (["size", "--layers", "32", "--kv-heads", "8", "--seq", "0"], "--seq 0"),
    (["size", "--layers", "32", "--kv-heads", "8", "--seq", "8", "--batch", "-1"], "--batch -1"),
    (["size", "--layers", "abc", "--kv-heads", "8", "--seq", "8"], "'abc'"),
    (["size", "--layers", "32", "--kv-heads", "8", "--seq", "lots"], "'lots'"),
    (["size", "--layers", "32", "--kv-heads", "8", "--seq", "8", "--dtype", "fp61"],
     "unknown dtype 'fp61'"),
    (["size", "--model", "llama-2-7", "--seq", "8"], "did you mean llama-2-7b"),
    (["size", "--layers", "32", "--heads", "32", "--kv-heads", "6", "--seq", "8"],
     "--kv-heads 6 does not divide --heads 32"),
    (["size", "--model", "llama-2-7b", "--seq", "8", "--gpu-mem", "8GiB"],
     "is not more than the weights"),
    (["size", "--model", "llama-2-7b", "--seq", "8", "--gpu-mem", "80G"], "ambiguous"),
    (["size", "--model", "llama-2-7b", "--seq", "8", "--gpu-mem", "big"], "'big'"),
    (["size", "--layers", "32", "--kv-heads", "8", "--seq", "8", "--gpu-mem", "80GB"],
     "--params"),
    (["size", "--model", "llama-2-70b", "--seq", "8", "--tp", "3"], "--tp 3"),
    (["size", "--model", "llama-2-7b", "--layers", "3", "--seq", "8"], "cannot be combined"),
    (["size", "--config", "/nonexistent/config.json", "--seq", "8"], "not found"),
    (["models", "--dtype", "int3"], "unknown dtype 'int3'"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""  # nothing half-written
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert message in lines[0]
    assert "Traceback" not in result.output


@pytest.mark.parametrize(("content", "message"), [
    ("{oops", "not valid JSON"),
    ('{"num_attention_heads": 8}', "no num_hidden_layers"),
])
def test_bad_config_is_one_line_and_exit_2(tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_text(content)
    result = invoke("size", "--config", str(path), "--seq", "8")
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and message in result.stderr


@pytest.mark.parametrize("args", [
    ["--help"],
    ["size", "--layers", "32", "--kv-heads", "8", "--seq", "32768"],
    ["models"],
])
def test_startup_never_imports_torch_or_transformers(args):
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['kvcache', *{args!r}]\n"
        "try:\n"
        "    runpy.run_module('kvcache_cli', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert e.code in (0, None), e.code\n"
        "print('HEAVY', sorted(m for m in ('torch', 'transformers') if m in sys.modules),"
        " file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "HEAVY []" in done.stderr, done.stderr


# --- recurrent state: Mamba and hybrids ------------------------------------------------------

# state-spaces/mamba-2.8b-hf's config.json (the fields the state depends on).
MAMBA = {"model_type": "mamba", "num_hidden_layers": 64, "hidden_size": 2560,
         "intermediate_size": 5120, "state_size": 16, "conv_kernel": 4, "vocab_size": 50280}
# ai21labs/Jamba-v0.1: attention every 8th layer from layer 4, Mamba elsewhere.
JAMBA = {"model_type": "jamba", "num_hidden_layers": 32, "num_attention_heads": 32,
         "num_key_value_heads": 8, "hidden_size": 4096, "attn_layer_period": 8,
         "attn_layer_offset": 4, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2}


def test_mamba_has_no_kv_cache_and_its_state_is_reported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MAMBA))
    data = size_json("--config", str(tmp_path), "--seq", "32768", "--batch", "8")
    assert data["total_bytes"] == 0 and data["bytes_per_token"] == 0
    per_sequence = 64 * (5120 * 4 + 5120 * 16) * 2  # layers × (conv + SSM) values × fp16
    assert data["state_bytes_per_sequence"] == per_sequence
    assert data["state_bytes"] == 8 * per_sequence
    assert any("no attention layers: its KV cache is 0 bytes" in n for n in data["notes"])
    out = ok("size", "--config", str(tmp_path), "--seq", "32768").stdout
    assert "no attention layers, no KV cache" in out
    assert "recurrent state 12.50 MiB" in out


def test_fit_counts_the_recurrent_state_of_every_sequence(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MAMBA))
    fit = size_json("--config", str(tmp_path), "--seq", "32768", "--params", "2.77B",
                    "--gpu-mem", "24GiB")["fit"]
    per_sequence = 64 * (5120 * 4 + 5120 * 16) * 2
    assert fit["state_bytes_per_sequence"] == per_sequence
    assert fit["max_sequences"] == fit["room_bytes"] // per_sequence
    assert fit["max_tokens"] is None  # the state does not grow: any length fits


def test_hybrid_counts_kv_of_the_attention_layers_and_state_of_the_rest(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(JAMBA))
    data = size_json("--config", str(tmp_path), "--seq", "1000")
    assert [(k["kind"], k["layers"]) for k in data["kinds"]] == [("full", 4), ("recurrent", 28)]
    assert data["total_bytes"] == 2 * 4 * 8 * 128 * 1000 * 2
    assert data["state_bytes_per_sequence"] == 28 * (8192 * 4 + 8192 * 16) * 2


# --- --verify: the formula against real transformers caches ---------------------------------

SMALL = {
    "gpt2": {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 128},
    "llama-gqa": {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 8,
                  "num_key_value_heads": 2, "hidden_size": 128, "intermediate_size": 64,
                  "vocab_size": 128},
    "gemma2-sliding": {"model_type": "gemma2", "num_hidden_layers": 4, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "head_dim": 32, "hidden_size": 64,
                       "intermediate_size": 64, "vocab_size": 128, "sliding_window": 4},
    "deepseek-mla": {"model_type": "deepseek_v3", "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 4, "hidden_size": 64,
                     "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 16,
                     "qk_nope_head_dim": 32, "v_head_dim": 32, "intermediate_size": 64,
                     "moe_intermediate_size": 32, "n_routed_experts": 4,
                     "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
                     "first_k_dense_replace": 1, "vocab_size": 128},
}


def verify(tmp_path, name: str, *extra: str) -> dict:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps(SMALL[name]))
    return size_json("--config", str(tmp_path), "--seq", "8", "--verify", *extra)["verify"]


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa", "deepseek-mla"])
def test_verify_real_cache_holds_exactly_the_formula_bytes(tmp_path, name):
    v = verify(tmp_path, name)
    assert v["matches"] is True
    assert v["measured_bytes"] == v["formula_bytes"] > 0
    assert "exactly the formula's bytes" in v["explanation"][0]


def test_verify_shapes_are_the_kv_heads_not_the_query_heads(tmp_path):
    v = verify(tmp_path, "llama-gqa", "--dtype", "fp32")
    assert v["layers"][0]["key_shape"] == [1, 2, 8, 16]  # (B, n_kv, T, hs)
    assert v["measured_bytes"] == 2 * 2 * 2 * 16 * 8 * 4


def test_verify_mla_caches_the_latent_not_per_head_keys(tmp_path):
    v = verify(tmp_path, "deepseek-mla")
    # One latent (32) and one shared rotary key (16) per token, not 4 heads × (48 + 32).
    assert v["layers"][0]["key_shape"] == [1, 1, 8, 32]
    assert v["layers"][0]["value_shape"] == [1, 1, 8, 16]


def test_verify_explains_the_sliding_window_difference(tmp_path):
    v = verify(tmp_path, "gemma2-sliding")
    kinds = {layer["kind"]: layer for layer in v["layers"]}
    assert kinds["full"]["measured_bytes"] == kinds["full"]["formula_bytes"]
    sliding = kinds["sliding"]
    assert sliding["measured_bytes"] == sliding["formula_bytes"] * 3 // 4  # window − 1 of 4
    assert v["matches"] is False
    assert any("window − 1 = 3 tokens" in line for line in v["explanation"])


def test_verify_a_quantised_cache_dtype_is_checked_at_bf16(tmp_path):
    v = verify(tmp_path, "llama-gqa", "--dtype", "int4")
    assert v["dtype"] == "bf16" and v["matches"] is True
    assert "checked at bf16" in v["explanation"][0]


def test_verify_model_type_transformers_cannot_build_is_a_runtime_failure(tmp_path):
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "no-such-model", "num_hidden_layers": 2, "num_attention_heads": 4,
        "hidden_size": 64}))
    result = invoke("size", "--config", str(tmp_path), "--seq", "8", "--verify")
    assert result.exit_code == 1, result.output
    assert result.stdout == ""
    assert result.stderr.startswith("error: transformers could not build") and \
        result.stderr.count("\n") == 1
