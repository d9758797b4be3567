"""Bad input, everywhere: a table of argv → the first line on stderr and the exit code.

Every case must end in one line naming the value and what was expected, exit 2, nothing on
stdout, no traceback, within a second or two (a hang is a failure, not a slow pass).
"""

from __future__ import annotations

import json
import os
import time

import pytest
from typer.testing import CliRunner

from kvcache_cli.cli import app

runner = CliRunner()

LLAMA = {"model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 2, "hidden_size": 256}


def assert_one_line(args: list[str], code: int, first_line: str) -> None:
    started = time.monotonic()
    result = runner.invoke(app, args, env={"COLUMNS": "100"})
    elapsed = time.monotonic() - started
    assert result.exit_code == code, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.stdout == "", result.stdout  # nothing half-written
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and first_line in lines[0], lines[0]
    assert elapsed < 2, f"took {elapsed:.1f} s"


# --- numbers too large to mean anything, and --tp that cannot split the heads --------------

SIZE = ["size", "--layers", "32", "--kv-heads", "8", "--seq", "4096"]


@pytest.mark.parametrize(("args", "first_line"), [
    (["size", "--layers", "10000000", "--kv-heads", "8", "--seq", "8"],
     "--layers 10,000,000: expected a whole number from 1 to 100,000"),
    (["size", "--layers", "32", "--kv-heads", "100000", "--seq", "8"],
     "--kv-heads 100,000: expected a whole number from 1 to 65,536"),
    (["size", "--layers", "32", "--heads", "1000000", "--seq", "8"],
     "--heads 1,000,000: expected a whole number from 1 to 65,536"),
    (["size", "--layers", "32", "--kv-heads", "8", "--head-dim", "99999999", "--seq", "8"],
     "--head-dim 99,999,999: expected a whole number from 1 to 65,536"),
    (["size", "--layers", "32", "--kv-heads", "8", "--seq", str(10**15)],
     "--seq 1,000,000,000,000,000: expected a whole number from 1 to 1,000,000,000,000"),
    ([*SIZE, "--batch", str(10**12)], "--batch 1,000,000,000,000: expected"),
    ([*SIZE, "--tp", "1000000"], "--tp 1,000,000: expected a whole number from 1 to 65,536"),
    ([*SIZE, "--tp", "3"], "--tp 3 does not divide the 8 KV heads"),
    (["size", "--model", "llama-2-70b", "--seq", "8", "--tp", "48"],
     "--tp 48 does not divide the 64 attention heads"),
    ([*SIZE, "--params", "1e30", "--gpu-mem", "80GiB"],
     "--params '1e30': expected at most 1,000,000,000,000,000 parameters"),
    ([*SIZE, "--params", "1e999999999", "--gpu-mem", "80GiB"], "--params '1e999999999'"),
    ([*SIZE, "--params", "nan", "--gpu-mem", "80GiB"], "--params 'nan'"),
    ([*SIZE, "--params", "7B", "--gpu-mem", "99999999999999999999999GiB"],
     "expected a size from 1 byte to 1 EiB"),
    ([*SIZE, "--params", "7B", "--gpu-mem", "80GiB", "--block-size", str(10**9)],
     "--block-size 1,000,000,000: expected a whole number from 1 to 1,000,000"),
])
def test_numbers_out_of_range_are_refused_with_the_range(args, first_line):
    assert_one_line(args, 2, first_line)


# --- config.json: wrong types and ranges, and files that are not config files -------------


@pytest.mark.parametrize(("fields", "first_line"), [
    ({"num_hidden_layers": "32"}, "num_hidden_layers is '32'; expected a whole number"),
    ({"num_hidden_layers": True}, "num_hidden_layers is True; expected a whole number"),
    ({"num_hidden_layers": 3.5}, "num_hidden_layers is 3.5; expected a whole number"),
    ({"num_hidden_layers": 0}, "num_hidden_layers is 0; expected a whole number from 1"),
    ({"num_hidden_layers": -4}, "num_hidden_layers is -4; expected a whole number from 1"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers is 1,000,000,000; expected a whole "
                                   "number from 1 to 100,000"),
    ({"num_hidden_layers": None}, "no num_hidden_layers"),
    ({"num_attention_heads": [8]}, "num_attention_heads is [8]; expected a whole number"),
    ({"num_key_value_heads": 16}, "num_key_value_heads is 16; expected a whole number from 1 "
                                  "to 8"),
    ({"hidden_size": 4}, "hidden size 4 is smaller than 8 heads"),
    ({"head_dim": 10**8}, "head_dim is 100,000,000; expected a whole number from 1 to 65,536"),
    ({"model_type": 7}, "model_type is 7; expected a name"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types has 3 entries; expected a list of 4"),
    ({"layer_types": "full_attention"}, "layer_types has 'full_attention'; expected a list"),
    ({"layer_types": [1, 2, 3, 4]}, "layer_types holds 1; expected layer type names"),
    ({"layer_types": ["warp"] * 4}, "unknown layer type 'warp'"),
    ({"layer_types": ["sliding_attention"] * 4, "sliding_window": -1},
     "sliding_window is -1; expected a whole number from 1"),
    ({"attn_layer_period": 2, "attn_layer_offset": 5},
     "attn_layer_offset is 5; expected a whole number from 0 to 1"),
    ({"attn_layer_indices": [0, 9]}, "attn_layer_indices holds 9; expected layer indices from "
                                     "0 to 3"),
    ({"hybrid_override_pattern": "M*M"}, "hybrid_override_pattern is 'M*M'; expected 4 "
                                         "characters from M, *, -, E"),
    ({"linear_attn_config": {"full_attn_layers": [0]}}, "full_attn_layers holds 0"),
    ({"num_kv_shared_layers": 9}, "num_kv_shared_layers is 9; expected a whole number from 0 "
                                  "to 4"),
    ({"model_type": "mamba", "state_size": "big"}, "state_size is 'big'"),
])
def test_config_fields_of_the_wrong_type_or_range(tmp_path, fields, first_line):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, **fields}))
    assert_one_line(["size", "--config", str(tmp_path), "--seq", "8"], 2, first_line)


def _huge(path) -> None:
    path.write_text("{}")
    os.truncate(path, 64 * 2**20)  # sparse: 64 MiB on paper, nothing on disk


@pytest.mark.parametrize(("make", "first_line"), [
    (lambda p: p.write_text("[" * 200_000 + "]" * 200_000), "nests arrays or objects"),
    (lambda p: p.write_bytes(b"\xff\xfe{}"), "is not UTF-8 text"),
    (lambda p: p.write_text(""), "is not valid JSON"),
    (_huge, "expected a config.json under 16 MiB"),
    (os.mkfifo, "is not a regular file"),  # opening it would wait for a writer forever
])
def test_files_that_are_not_config_files(tmp_path, make, first_line):
    path = tmp_path / "config.json"
    make(path)
    assert_one_line(["size", "--config", str(path), "--seq", "8"], 2, first_line)


def test_dev_zero_is_refused_without_reading_it():
    assert_one_line(["size", "--config", "/dev/zero", "--seq", "8"], 2,
                    "config file '/dev/zero' is not a regular file")
