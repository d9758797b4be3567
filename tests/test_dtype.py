"""`--dtype` on `generate` and `bench`: weights and cache in half precision.

Half precision picks other greedy tokens than float32 sooner or later (it rounds
every product), so the checks are that everything runs in the asked dtype and that
the CLI gives the tokens the library gives in that dtype, not float32's tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvcache_cli.caches import make_cache
from kvcache_cli.cli import app
from kvcache_cli.generate import generate
from kvcache_cli.models.gpt2 import load_gpt2

PROMPT = [17, 200, 3, 91, 45]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=256,
                        initializer_range=0.3, bos_token_id=None, eos_token_id=None)
    path = tmp_path_factory.mktemp("tiny-gpt2")
    GPT2LMHeadModel(config).save_pretrained(path)
    return path


@pytest.mark.parametrize(("flag", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_cli_generate_runs_weights_and_cache_in_the_asked_dtype(checkpoint, flag, dtype):
    model = load_gpt2(str(checkpoint), dtype=dtype).model
    assert all(p.dtype == dtype for p in model.parameters())
    cache = make_cache("static", model, 16)
    assert {t.dtype for t in cache.k + cache.v} == {dtype}
    expected = generate(model, PROMPT, 8, "static").tokens
    assert len(set(expected)) > 2, expected
    out = CliRunner().invoke(app, ["generate", "--model", str(checkpoint), "--ids",
                                   ",".join(map(str, PROMPT)), "-n", "8", "--dtype", flag,
                                   "--json"])  # fmt: skip
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["dtype"] == str(dtype).removeprefix("torch.")
    assert data["tokens"] == list(expected)


def test_cli_unknown_dtype_is_one_line_and_exit_2(checkpoint):
    out = CliRunner().invoke(app, ["generate", "--model", str(checkpoint), "--ids", "1,2",
                                   "--dtype", "fp64"])  # fmt: skip
    assert out.exit_code == 2, out.output
    assert out.stderr.count("\n") == 1 and "fp64" in out.stderr, out.stderr
