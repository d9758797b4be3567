"""`kvcache bench --cache`: quantised caches timed in our loop beside the exact one."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvcache_cli.bench import modes as bench_modes
from kvcache_cli.bench import run as bench_run
from kvcache_cli.cli import app
from kvcache_cli.models.gpt2 import GPT, GPTConfig, load_gpt2, to_hf


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    config = GPTConfig(block_size=64, vocab_size=96, n_layer=2, n_head=2, n_embd=64)
    to_hf(GPT(config, init_std=0.3, seed=0)).save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


def test_cache_specs_are_modes_spelled_canonically():
    assert bench_modes.parse_modes("static,int4,fp8") == ("static", "int4:g32:kchan:r128",
                                                    "fp8-e4m3:tensor:one")


def test_a_quantised_cache_is_timed_and_counted_beside_static(checkpoint):
    model = load_gpt2(str(checkpoint), weights="pretrained").model
    result = bench_run.run_bench(model, modes=("static", "int8:g32:ktok:r0", "int4:g8:kchan:r4"),
                             prompt_len=20, new_tokens=10, repeats=1, bandwidth_mib=4)
    static, int8, int4 = (result.mode(m) for m in ("static", "int8:g32:ktok:r0",
                                                    "int4:g8:kchan:r4"))
    assert len(int8.tokens) == len(int4.tokens) == 10
    # 29 positions: int8 holds them all as codes, int4 all but its residual's 5.
    assert max(int4.cache_bytes_held, int8.cache_bytes_held) < static.cache_bytes_held / 2


def test_bench_refuses_a_group_wider_than_the_heads_before_loading(checkpoint):
    out = CliRunner().invoke(app, ["bench", "--model", str(checkpoint), "--cache", "int4:g48"])
    assert out.exit_code == 2
    assert "group size 48 does not divide the head width 32" in out.output
