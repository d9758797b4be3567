"""`kvcache bench --profile`: one decode step of the static loop split by kind of op, in
the format asked for, and bad input refused in one line. Timings are never compared."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvcache_cli.bench.profile import ORDER
from kvcache_cli.cli import app

pytestmark = pytest.mark.usefixtures("one_torch_thread")
runner = CliRunner()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=96, n_positions=64,
                        initializer_range=0.3)
    path = tmp_path_factory.mktemp("tiny")
    GPT2LMHeadModel(config).save_pretrained(path)
    return path


def _bench(*args: str):
    return runner.invoke(app, ["bench", "--profile", *args], env={"COLUMNS": "100"})


@pytest.mark.parametrize("fmt, weights, dtype, shown", [
    ([], "fp32", "fp32", "fp32: step"),
    (["--weights-dtype", "int8"], "int8", "fp32", "int8: step"),
    (["--dtype", "bf16", "--weights-dtype", "int8"], "int8", "bf16", "bf16+int8: step"),
])
def test_profile_splits_a_decode_step_by_kind_of_op_in_the_format_asked(checkpoint, fmt,
                                                                         weights, dtype, shown):
    args = ["-m", str(checkpoint), "--new-tokens", "4", "--threads", "1", *fmt]
    result = _bench(*args, "--json")
    assert result.exit_code == 0, result.output
    p = json.loads(result.stdout)
    assert (p["weights"], p["dtype"], p["steps"], p["threads"]) == (weights, dtype, 4, 1)
    split = dict(p["split_ms"])
    assert list(split) == list(ORDER) and all(ms >= 0 for ms in split.values())
    # The products are seen (the native kernel's calls too, named while profiled), and the
    # parts cover the step: the rest of the wall time is Python's.
    assert split["products"] > 0 and split["attention"] > 0 and p["ops_per_step"] > 0
    assert sum(split.values()) >= p["step_ms"] * 0.999
    text = _bench(*args)
    assert text.exit_code == 0, text.output
    first, second = text.stdout.strip().splitlines()
    assert first.endswith("1 threads, ms a decode step (share), 4 steps profiled")
    assert second.startswith(shown) and "products " in second and "Python and dispatch" in second


@pytest.mark.parametrize("args, said", [
    (["--plot", "p.png"], "--plot does not apply with --profile"),
    (["--draft", "lookup"], "--draft does not apply with --profile"),
    (["--modes", "static"], "--modes does not apply with --profile"),
    (["--new-tokens", "0"], "--new-tokens '0' is not a whole number from 1 to 10,000"),
    (["--new-tokens", "64"], "past context window 64"),
    (["--threads", "0"], "--threads 0: expected a whole number from 1 to 1,024"),
    (["--weights-dtype", "int3"], "int3"),
])
def test_profile_refuses_bad_input_in_one_line_exit_2(checkpoint, no_model_loads, args, said):
    result = _bench("-m", str(checkpoint), *args)
    assert result.exit_code == 2 and said in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
