"""`kvcache size --cache SPEC`'s arithmetic: a quantised cache's payload, scales and
full-precision tokens for a real model, beside fp16, and what fits (torch-free)."""

import subprocess
import sys

import pytest

from kvcache_cli.caches.spec import parse_cache_spec
from kvcache_cli.sizing import resolve_shape
from kvcache_cli.sizing.cache_spec import size_spec
from kvcache_cli.sizing.units import SizingError


def llama():
    return resolve_shape("llama-2-7b")[0]  # 32 layers, 32 KV heads of 128


def test_int4_counts_codes_scales_and_the_residual_per_the_formula():
    r = size_spec(llama(), parse_cache_spec("int4:g32:kchan:r128"), 4096)
    # 3,968 tokens as codes (4,096 - 128, a whole number of groups of 32), 128 at fp16.
    assert (r.quantised_tokens, r.full_tokens) == (3968, 128)
    layer = 32 * 32 * 128  # layers x kv heads x head width
    assert r.payload_bytes == 2 * layer * 3968 // 2  # K and V, half a byte each
    # V: one fp16 scale and zero per 32 channels of a token; K: per 32 tokens of a channel.
    assert r.scale_bytes == 2 * 2 * (layer * 3968 // 32) * 2
    assert r.full_bytes == 2 * layer * 128 * 2
    assert r.bytes_per_sequence == r.payload_bytes + r.scale_bytes + r.full_bytes
    assert r.fp16_bytes_per_sequence == 2 * layer * 4096 * 2
    assert 0.33 < r.ratio_to_fp16 < 0.34


def test_a_gpu_holds_more_sequences_of_a_quantised_cache():
    r = size_spec(llama(), parse_cache_spec("int8"), 4096, gpu_mem=24 << 30)
    assert r.fit.max_sequences >= 1.7 * r.fit.fp16_max_sequences
    exact = size_spec(llama(), parse_cache_spec("static"), 4096, gpu_mem=24 << 30)
    assert r.fit.max_tokens > 1.7 * exact.fit.max_tokens


def test_a_group_wider_than_the_head_is_refused_naming_both():
    with pytest.raises(SizingError, match="group size 256 does not divide the head width 128"):
        size_spec(llama(), parse_cache_spec("int4:g256"), 4096)


def test_the_cache_sizing_imports_no_torch():
    code = ("import sys; from kvcache_cli.sizing.cache_spec import size_spec; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ---------------------------------------------------------------------------- the command


def size(*args: str):
    from typer.testing import CliRunner

    from kvcache_cli.cli import app

    return CliRunner().invoke(app, ["size", *args], env={"COLUMNS": "100"})


def test_size_cache_spec_and_dtype_flags_count_the_same_bytes():
    import json

    spelled = size("-m", "llama-2-7b", "--seq", "2000", "--cache", "int4:g32:kchan:r128",
                   "--json")
    flags = size("-m", "llama-2-7b", "--seq", "2000", "--dtype", "int4", "--group-size", "32",
                 "--residual", "128", "--json")
    assert spelled.exit_code == flags.exit_code == 0, spelled.output + flags.output
    a, b = json.loads(spelled.output), json.loads(flags.output)
    assert a == b and a["spec"] == "int4:g32:kchan:r128" and a["full_tokens"] == 144


def test_size_shows_the_parts_and_what_fits():
    result = size("-m", "llama-2-7b", "--seq", "4096", "--cache", "int8", "--gpu-mem", "24GiB")
    assert result.exit_code == 0, result.output
    for text in ("scales + zero points", "sequences of 4,096 tokens", "int8:g32:ktok:r0"):
        assert text in result.output


@pytest.mark.parametrize("args, message", [
    (("--cache", "int4:g48"), "error: cache spec 'int4:g48': group size 48 does not "
                              "divide the head width 128"),
    (("--cache", "int4:q8"), "unknown field 'q8'"),
    (("--dtype", "fp16", "--residual", "64"), "expected --dtype int8 or int4, got 'fp16'"),
    (("--cache", "int8", "--tp", "2"), "--tp is not counted for a cache spec"),
])
def test_size_refuses_a_bad_cache_in_one_line(args, message):
    result = size("-m", "llama-2-7b", *args)
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1
