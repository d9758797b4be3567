"""Bad input, everywhere: a table of argv → the first line on stderr and the exit code.

Every case must end in one line naming the value and what was expected, exit 2, nothing on
stdout, no traceback. A hang is a failure, not a slow pass: the bound is generous, so a
loaded machine cannot fail it (timing is the benchmarks' job, not a test's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
    assert elapsed < 30, f"took {elapsed:.1f} s"


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
    ([*SIZE, "--params", "7B", "--gpu-mem", "1.5"], "--gpu-mem '1.5' is 1.5 bytes: expected a "
                                                    "whole number of bytes"),
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


@pytest.mark.parametrize("fields", [
    {"num_hidden_layers": "x" * 100_000}, {"block_types": list(range(50_000))},
    {"layer_types": "y" * 100_000}, {"attn_layer_indices": ["a" * 100_000]},
    {"num_hidden_layers": 10**100},
])
def test_a_huge_value_is_quoted_short(tmp_path, fields):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, **fields}))
    result = runner.invoke(app, ["size", "--config", str(tmp_path), "--seq", "8"])
    assert result.exit_code == 2, result.output
    assert len(result.stderr) < 200 + len(str(tmp_path)), result.stderr[:300]


@pytest.mark.parametrize("index", ["²", "５", "1" * 5000])
def test_a_per_layer_index_that_is_not_ascii_digits_is_refused(tmp_path, index):
    fields = {"per_layer_config": {index: {"head_dim": 128}}}
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, **fields}))
    assert_one_line(["size", "--config", str(tmp_path), "--seq", "8"], 2,
                    "per_layer_config has")


def _huge(path) -> None:
    path.write_text("{}")
    os.truncate(path, 64 * 2**20)  # sparse: 64 MiB on paper, nothing on disk


@pytest.mark.parametrize(("make", "first_line"), [
    (lambda p: p.write_text("[" * 200_000 + "]" * 200_000), "nests arrays or objects"),
    (lambda p: p.write_bytes(b"\xff\xfe{}"), "is not UTF-8 text"),
    (lambda p: p.write_text(""), "is not valid JSON"),
    (lambda p: p.write_text('{"num_hidden_layers": ' + "9" * 5000 + "}"),
     "holds a number thousands of digits long"),
    (_huge, "expected a config.json under 16 MiB"),
    (os.mkfifo, "is not a regular file"),  # opening it would wait for a writer forever
])
def test_files_that_are_not_config_files(tmp_path, make, first_line):
    path = tmp_path / "config.json"
    make(path)
    assert_one_line(["size", "--config", str(path), "--seq", "8"], 2, first_line)


@pytest.mark.parametrize(("args", "first_line"), [
    (["-m", ""], "--model '': expected a preset name"),
    (["--config", ""], "config path '': expected a config.json or the folder"),
])
def test_an_empty_model_or_config_is_refused_not_read_as_the_working_folder(tmp_path,
                                                                            monkeypatch, args,
                                                                            first_line):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    monkeypatch.chdir(tmp_path)
    assert_one_line(["size", *args, "--seq", "8"], 2, first_line)


def test_dev_zero_is_refused_without_reading_it():
    assert_one_line(["size", "--config", "/dev/zero", "--seq", "8"], 2,
                    "config file '/dev/zero' is not a regular file")


# --- options that do not apply, and generate's numbers checked before the model loads ---------


@pytest.mark.parametrize(("args", "first_line"), [
    (["demo", "bogus", "--list"], "--list lists every demo: expected no NAME with it, got "
                                  "'bogus'"),
    (["break", "no-mask", "--list"], "--list lists every break"),
    (["break", "no-mask", "--model", "gpt2-xl"],
     "--model applies to the torch breaks only, and 'no-mask' runs on the NumPy toy"),
    (["break", "overflow", "--device", "cuda", "--max-new-tokens", "5"],
     "--device, --max-new-tokens apply to the torch breaks only"),
    # a model that is none: refused before the NumPy breaks print, and never called GPT-2
    (["break", "all", "--model", "/nonexistent"], "/nonexistent"),
    (["break", "sliding-unbanded", "--model", "llama-3-8b"], "unknown model 'llama-3-8b'"),
    # --model names nothing that exists: each case must fail before a model is looked for.
    (["generate", "--ids", "1,2", "--temperature", "nan", "--model", "/nonexistent"],
     "--temperature nan: expected a finite number"),
    (["generate", "--ids", "1,2", "--temperature", "inf", "--model", "/nonexistent"],
     "--temperature inf: expected a finite number"),
    (["generate", "--ids", "1,2", "--seed", str(2**64), "--model", "/nonexistent"],
     "--seed 18446744073709551616: expected a whole number from 0 to "
     "18,446,744,073,709,551,615"),
    (["generate", "--ids", "1,2", "--seed", "-1", "--model", "/nonexistent"],
     "--seed -1: expected a whole number from 0 to"),
    (["generate", "--ids", "1,-5", "--model", "/nonexistent"], "--ids: token id -5 is not a "
                                                               "vocabulary index"),
    (["generate", "--ids", ",", "--model", "/nonexistent"], "at least one"),
    (["generate", "--ids", "464 2068", "--model", "/nonexistent"],
     "--ids: expected comma-separated token ids like 464,2068,7586, got '464 2068'"),
    (["generate", "--ids", "one,two", "--model", "/nonexistent"],
     "--ids: expected comma-separated token ids like 464,2068,7586, got 'one,two'"),
])
def test_options_that_do_not_apply_and_values_checked_first(args, first_line):
    pytest.importorskip("torch")
    import torch  # noqa: F401 - imported here so the timed run below measures the check only

    assert_one_line(args, 2, first_line)


@pytest.mark.parametrize(("threads", "first_line"), [
    ("0", "--threads 0: expected a whole number from 1 to 1,024"),
    # OpenMP would try to allocate for every thread and abort the process.
    ("1000000000", "--threads 1,000,000,000: expected a whole number from 1 to 1,024"),
])
def test_bench_threads_out_of_range(threads, first_line):
    pytest.importorskip("torch")
    import torch  # noqa: F401

    assert_one_line(["bench", "--threads", threads, "--model", "/nonexistent"], 2, first_line)


@pytest.mark.parametrize("threads", ["0", "1000000000"])
def test_serve_threads_out_of_range_before_a_model_loads(threads):
    pytest.importorskip("torch")
    import torch  # noqa: F401

    assert_one_line(["serve", "--threads", threads, "--weights", "random"], 2,
                    f"--threads {int(threads):,}: expected a whole number from 1 to 1,024")


@pytest.mark.parametrize(("plot", "first_line"), [
    (".", "--plot: '.' is a directory: expected a file name"),
    ("/nonexistent/bench.png", "--plot: no directory '/nonexistent' to write 'bench.png' into"),
])
def test_plot_path_is_checked_before_the_benchmark_runs(plot, first_line):
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    import torch  # noqa: F401

    # --model names nothing: the plot check must come first.
    assert_one_line(["bench", "--plot", plot, "--model", "/nonexistent"], 2, first_line)
    # serve reads its model's shape first (a preset, no weights), then the plot path.
    assert_one_line(["serve", "--plot", plot, "--weights", "random"], 2, first_line)


# --- checkpoints that are not GPT-2 checkpoints -----------------------------------------------

TINY = {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 8, "vocab_size": 16,
        "n_positions": 16}


@pytest.fixture(scope="module")
def tiny_state():
    torch = pytest.importorskip("torch")
    from kvcache_cli.models.gpt2 import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=16, n_layer=1, n_head=2, n_embd=8))
    # Hugging Face names and layout: Conv1D weights transposed, the tied lm_head left out.
    from kvcache_cli.models.gpt2 import _CONV1D

    return {k: (t.t() if k.endswith(_CONV1D) else t).contiguous()
            for k, t in model.state_dict().items() if k != "lm_head.weight"}


def _save_safetensors(state, path):
    from safetensors.torch import save_file

    save_file(state, str(path))


def _truncated(tmp, state):
    _save_safetensors(state, tmp / "model.safetensors")
    data = (tmp / "model.safetensors").read_bytes()
    (tmp / "model.safetensors").write_bytes(data[: len(data) // 2])


def _bin(tmp, obj):
    import torch

    torch.save(obj, tmp / "pytorch_model.bin")


def _index(tmp, shard):
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"transformer.wte.weight": shard}}))


@pytest.mark.parametrize(("config", "make", "first_line"), [
    ({k: v for k, v in TINY.items() if k != "n_layer"}, _save_safetensors,
     "no 'n_layer'; expected a GPT-2 config.json"),
    ({**TINY, "n_head": "2"}, _save_safetensors, "n_head is '2'; expected a whole number"),
    ({**TINY, "n_embd": 10**9}, _save_safetensors, "n_embd is 1000000000; expected a whole "
                                                   "number from 1 to 65,536"),
    ({**TINY, "n_embd": 7}, _save_safetensors, "n_embd 7 is not a multiple of n_head 2"),
    (TINY, _truncated, "not a readable safetensors file"),
    (TINY, lambda tmp, state: (tmp / "model.safetensors").write_bytes(b"\x08" + b"\0" * 64),
     "not a readable safetensors file"),
    (TINY, lambda tmp, state: (tmp / "model.safetensors").write_bytes(b""), "is empty"),
    (TINY, lambda tmp, state: _bin(tmp, [1, 2, 3]), "holds list, not a state dict"),
    (TINY, lambda tmp, state: _bin(tmp, {"wte.weight": "not a tensor"}),
     "holds a dict of other values, not a state dict"),
    (TINY, lambda tmp, state: (tmp / "pytorch_model.bin").write_bytes(b"PK\x03\x04junk"),
     "not a plain tensor file"),
    # Plain text makes the weights-only unpickler raise a KeyError, other bytes other errors.
    (TINY, lambda tmp, state: (tmp / "pytorch_model.bin").write_text("hello, weights\n"),
     "not a plain tensor file (not a pickle: KeyError)"),
    (TINY, lambda tmp, state: (tmp / "pytorch_model.bin").write_bytes(bytes(range(256))),
     "not a plain tensor file"),
    (TINY, lambda tmp, state: _index(tmp, "../outside.safetensors"),
     "shard '../outside.safetensors' is outside the checkpoint directory"),
    (TINY, lambda tmp, state: _index(tmp, "/etc/passwd"), "shard '/etc/passwd' is outside"),
    (TINY, lambda tmp, state: _save_safetensors(
        {k: t for k, t in state.items() if k != "transformer.h.0.ln_1.weight"},
        tmp / "model.safetensors"),
     "checkpoint has no 'h.0.ln_1.weight'"),
])
def test_broken_checkpoints_are_one_line(tmp_path, tiny_state, config, make, first_line):
    (tmp_path / "config.json").write_text(json.dumps(config))
    if make is _save_safetensors:
        _save_safetensors(tiny_state, tmp_path / "model.safetensors")
    else:
        make(tmp_path, tiny_state)
    assert_one_line(["generate", "--model", str(tmp_path), "--weights", "pretrained",
                     "--ids", "1,2", "-n", "1"], 2, first_line)


def test_a_good_tiny_checkpoint_loads(tmp_path, tiny_state):
    """The fixture itself is a valid checkpoint: the failures above come from the damage."""
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    _save_safetensors(tiny_state, tmp_path / "model.safetensors")
    result = runner.invoke(app, ["generate", "--model", str(tmp_path), "--weights",
                                 "pretrained", "--ids", "1,2", "-n", "2", "--json"])
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["tokens"]) == 2


# --- stdout that cannot be written ------------------------------------------------------------


def _kvcache(args: list[str], stdout) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvcache_cli", *args], stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=60)


@pytest.mark.parametrize("args", [["models"], ["size", "--model", "llama-2-7b", "--json"]])
def test_stdout_full_is_one_line_and_exit_1(args):
    with open("/dev/full", "w") as full:
        done = _kvcache(args, full)
    assert done.returncode == 1
    assert done.stderr == "error: cannot write the output: No space left on device\n"


@pytest.mark.parametrize("args", [["models"], ["demo", "memory"], ["size", "--model", "gpt2"]])
def test_reader_gone_exits_quietly(args):
    read, write = os.pipe()
    os.close(read)  # like `| head` that has already exited
    with os.fdopen(write, "w") as pipe:
        done = _kvcache(args, pipe)
    assert done.returncode == 1  # click's status for a broken pipe
    assert done.stderr == ""


def test_a_plot_that_fails_after_the_run_keeps_the_results(tmp_path, tiny_state):
    pytest.importorskip("matplotlib")
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    _save_safetensors(tiny_state, tmp_path / "model.safetensors")
    # /dev/full passes every check made before the run and fails only when written.
    result = runner.invoke(app, ["bench", "--model", str(tmp_path), "--weights", "pretrained",
                                 "--device", "cpu", "--prompt-len", "2", "--new-tokens", "2",
                                 "--repeats", "1", "--modes", "naive", "--plot", "/dev/full",
                                 "--json"])
    assert result.exit_code == 1, result.output
    assert json.loads(result.stdout)["modes"], "the measured results come first"
    # Off a terminal stderr holds a line per finished run; the error is the last line.
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith(
        "error: --plot: the plot could not be written to '/dev/full'"), result.stderr
    assert [line for line in lines if line.startswith("error:")] == lines[-1:], result.stderr


def test_serve_hf_engine_without_continuous_batching_is_refused_before_a_model_loads(
        monkeypatch):
    pytest.importorskip("torch")
    # An older transformers, without generate_batch's configuration class.
    monkeypatch.setitem(sys.modules, "transformers.generation.configuration_utils", None)
    assert_one_line(["serve", "--weights", "random", "--engines", "paged,hf"], 2,
                    "has no continuous batching (generate_batch): upgrade transformers")


@pytest.mark.parametrize("where", ["proc", "under a file"])
def test_a_plot_path_no_file_can_be_made_at_is_refused_before_the_run(tmp_path, where):
    # Root passes every permission check: /proc (and a read-only mount) shows only when a
    # file is made there, which must happen before minutes of measuring, not after.
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    import torch  # noqa: F401

    if where == "proc" and not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    (tmp_path / "a-file").write_text("")
    plot, first_line = (("/proc/nope.png", "--plot: '/proc/nope.png' cannot be written (")
                        if where == "proc" else
                        (str(tmp_path / "a-file" / "b.png"), "is a file, not a directory: "
                         "expected a folder to write 'b.png' into"))
    assert_one_line(["bench", "--plot", plot, "--model", "/nonexistent"], 2, first_line)
    assert_one_line(["serve", "--plot", plot, "--weights", "random"], 2, first_line)


def test_the_plot_path_check_leaves_no_file_behind(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    import torch  # noqa: F401

    plot = tmp_path / "bench.png"
    # The path is tried, then the model is refused: no run, so no plot, and no trial file.
    result = runner.invoke(app, ["bench", "--plot", str(plot), "--model", "/nonexistent"])
    assert result.exit_code == 2, result.output
    assert "/nonexistent" in result.stderr and "--plot" not in result.stderr
    assert list(tmp_path.iterdir()) == []
