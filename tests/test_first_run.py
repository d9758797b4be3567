"""What a newcomer meets on a first run (issue 43): a plain prompt to a chat model is asked
as a chat turn, a run that stops at once says why, help is copyable, refusals are one line."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvcache_cli.cli import app


def invoke(*args: str, **kwargs):
    return CliRunner().invoke(app, list(args), **kwargs)


@pytest.fixture(scope="module")
def chat_gguf(tmp_path_factory):
    """A tiny Llama GGUF with a chat template: a chat model, as smollm2 is."""
    from llamakit import tiny_hf, write_tiny_gguf

    return str(write_tiny_gguf(tiny_hf(), tmp_path_factory.mktemp("chat") / "tiny.gguf"))


def test_a_plain_prompt_to_a_chat_model_is_asked_as_a_chat_turn(chat_gguf):
    result = invoke("generate", "What is a KV cache?", "-m", chat_gguf, "-n", "2", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["question"] == "What is a KV cache?"
    assert data["chat_prompt"].startswith("<|im_start|>user\nWhat is a KV cache?<|im_end|>")
    shown = invoke("generate", "What is a KV cache?", "-m", chat_gguf, "-n", "2")
    assert shown.exit_code == 0, shown.output
    assert "user: What is a KV cache?\nassistant: " in shown.stdout


def test_raw_continues_the_prompt_as_written(chat_gguf):
    result = invoke("generate", "What is a KV cache?", "-m", chat_gguf, "-n", "2", "--raw",
                    "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert "question" not in data and "chat_prompt" not in data
    both = invoke("generate", "--chat", "hi", "--raw", "-m", chat_gguf)
    assert both.exit_code == 2 and both.stderr.startswith("error: --raw and --chat: ")


@pytest.mark.parametrize(("args", "said"), [
    ((), "the model ended its reply at an end token after 1 new token; --ignore-eos"),
    (("--raw",), "without --raw it is asked as a chat turn"),
])
def test_a_run_that_stops_at_an_end_token_at_once_says_so(chat_gguf, monkeypatch, args, said):
    import dataclasses

    from kvcache_cli import generate as gen

    real = gen.generate

    def ends_at_once(model, prompt_ids, max_new_tokens, mode, **kwargs):
        ran = real(model, prompt_ids, 1, mode, **kwargs)
        return dataclasses.replace(ran, stopped=True)

    monkeypatch.setattr(gen, "generate", ends_at_once)
    result = invoke("generate", "hello", "-m", chat_gguf, "-n", "8", *args)
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stderr.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and said in notes[0], result.stderr


def test_a_run_that_stops_by_its_count_says_nothing(chat_gguf):
    result = invoke("generate", "hello", "-m", chat_gguf, "-n", "2", "--ignore-eos")
    assert result.exit_code == 0, result.output
    assert "end token" not in result.stderr


@pytest.mark.parametrize("busy", [True, False])
def test_a_model_runs_on_the_cores_other_processes_leave_free(chat_gguf, monkeypatch, busy):
    import torch

    from kvcache_cli import measure

    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    picked = []
    monkeypatch.setattr(torch, "set_num_threads", picked.append)
    monkeypatch.setattr(measure, "free_cores", lambda: (1, 2.8) if busy else (4, 0.1))
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    result = invoke("generate", "hi", "-m", chat_gguf, "-n", "2")
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stderr.splitlines() if "other processes" in line]
    if busy:
        assert notes == ["note: other processes keep 2.8 of 4 cores busy: running on 1 "
                         "thread, not 4 (--threads sets it)"]
        assert picked == [1]
    else:
        assert notes == [] and picked == []
    given = invoke("generate", "hi", "-m", chat_gguf, "-n", "2", "--threads", "3")
    assert "other processes" not in given.stderr and picked[-1] == 3


def test_free_cores_counts_what_other_processes_take(monkeypatch):
    from kvcache_cli import measure

    monkeypatch.undo()  # conftest's quiet machine: this test measures the real one
    sampled = measure.free_cores(0.05)
    if sampled is None:
        pytest.skip("no /proc/stat here")
    free, busy = sampled
    import os

    assert 1 <= free <= (os.cpu_count() or 1) and busy >= 0


def test_the_eta_leaves_out_the_first_units_one_time_costs():
    from kvcache_cli.cli.output import Eta

    # eval's shape: a prefill that takes 60 s and scores 1 token, then 511 tokens at 0.3 s.
    times = [0.0] + [60.0 + 0.3 * i for i in range(512)]
    eta = Eta()
    assert eta(0, 512, times[0]) is None and eta(1, 512, times[1]) is None
    left = eta(11, 512, times[11])
    truth = times[-1] - times[11]
    assert abs(left - truth) < 0.01 * truth
    whole_run_rate = times[11] / 11 * (512 - 11)  # the ETA before: ~19 times the truth
    assert whole_run_rate > 10 * truth


def test_progress_off_a_terminal_names_what_runs_now(capsys):
    from kvcache_cli.cli.output import ProgressLines

    now = iter([0.0, 10.0, 20.0, 40.0])
    lines = ProgressLines("loading", "tokens of context", clock=lambda: next(now))
    lines(1024, 13_296, "filling int8 to 1,024")  # 10 s: under a tenth; the rate starts
    lines(5120, 13_296, "4,096 tokens timed")  # 20 s: 4,096 in 10 s
    lines(13_296, 13_296, "8,176 tokens timed")  # 40 s
    assert capsys.readouterr().err.splitlines() == [
        "4,096 tokens timed: 5,120/13,296 tokens of context, 0:20 elapsed, ETA 0:20",
        "8,176 tokens timed: 13,296/13,296 tokens of context, 0:40 elapsed"]


def test_json_writes_null_for_nan_and_infinity_never_a_string():
    import math

    from kvcache_cli.views import to_json

    data = json.loads(to_json({"decode_tokens_per_s": math.nan, "rate": [math.inf, 1.5]}))
    assert data == {"decode_tokens_per_s": None, "rate": [None, 1.5]}


def test_generate_json_of_one_token_has_a_null_decode_rate(chat_gguf):
    result = invoke("generate", "hi", "-m", chat_gguf, "-n", "1", "--json")
    assert result.exit_code == 0, result.output
    assert '"decode_tokens_per_s": null' in result.stdout


@pytest.fixture(scope="module")
def byte_checkpoint(tmp_path_factory):
    from bytecheckpoint import write_byte_checkpoint

    text = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n" * 12
    return str(write_byte_checkpoint(tmp_path_factory.mktemp("bytes"), 256, 128, text))


def test_eval_says_why_a_short_run_holds_more_for_int4_than_int8(byte_checkpoint):
    result = invoke("eval", "-m", byte_checkpoint, "--cache", "int8,int4", "--tokens", "200",
                    "--prompt-len", "16", env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert " MiB" in out or " KiB" in out
    assert " MB" not in out and " kB" not in out
    line = next(line for line in out.splitlines() if line.startswith("int4:g32:kchan:r128: "))
    assert "at full precision (residual" in line
    assert not any(line.startswith("int8:g32:ktok:r0: ") for line in out.splitlines())
    saved = invoke("eval", "-m", byte_checkpoint, "--cache", "int4", "--tokens", "200",
                   "--prompt-len", "16", "--json")
    assert saved.exit_code == 0 and '"nan"' not in saved.stdout
    from kvcache_cli.eval.quality import result_from_json

    data = json.loads(saved.stdout)
    data["caches"][0]["decode_ms_per_token"] = None  # a row with no time, as a peer's
    read = result_from_json(data)  # what --replot reads: null back to NaN
    assert read.caches[0].decode_ms_per_token != read.caches[0].decode_ms_per_token


def test_generate_help_shows_each_example_on_a_line_of_its_own():
    result = invoke("generate", "--help", env={"COLUMNS": "80"})
    assert result.exit_code == 0
    lines = [line.strip() for line in result.stdout.splitlines()]
    for example in ('kvcache generate "What is a KV cache?"',
                    'kvcache generate "def fibonacci(n):" -m stdlib-bytes -n 64',
                    "kvcache generate --ids 464,2068,7586 -m gpt2 --cache int8"):
        assert example in lines, result.stdout


def _without_torch(*args: str) -> tuple[int, str, bool]:
    """(exit code, stderr, whether torch was imported) of a command run in a fresh process."""
    import subprocess
    import sys

    script = ("import sys\nfrom kvcache_cli.cli import app\ntry:\n    app(sys.argv[1:])\n"
              "except SystemExit as end:\n    code = end.code\n"
              "sys.stderr.write(f'torch imported: {\"torch\" in sys.modules}\\n')\n"
              "sys.exit(code)\n")
    run = subprocess.run([sys.executable, "-c", script, *args], capture_output=True,
                         text=True, timeout=120)
    *lines, imported = run.stderr.splitlines()
    return run.returncode, "\n".join(lines), imported == "torch imported: True"


@pytest.mark.parametrize("command", ["generate", "bench", "eval", "serve"])
def test_a_missing_model_file_is_refused_before_torch_naming_every_kind(command):
    ids = ("--ids", "1") if command == "generate" else ()
    code, stderr, imported = _without_torch(command, "-m", "/nonexistent.gguf", *ids)
    assert code == 2 and not imported, stderr
    assert stderr.startswith("error: model '/nonexistent.gguf': no such file or folder")
    assert stderr.count("\n") == 0
    for kind in ("gpt2", "stdlib-bytes", "smollm2", "a .gguf file", "a GPT-2 folder"):
        assert kind in stderr


@pytest.mark.parametrize("command", ["generate", "bench", "eval", "serve"])
def test_cuda_on_a_torch_built_without_it_is_refused_before_torch(command):
    from kvcache_cli.measure import torch_without_cuda

    if torch_without_cuda() is None:
        pytest.skip("this torch is built with CUDA: only torch can say whether a GPU is there")
    ids = ("--ids", "1") if command == "generate" else ()
    code, stderr, imported = _without_torch(command, "--device", "cuda", *ids)
    assert code == 2 and not imported, stderr
    assert "CUDA is not available" in stderr and stderr.count("\n") == 0


@pytest.mark.parametrize("terminal", [True, False])
def test_an_error_line_is_wrapped_at_the_width_in_a_terminal_only(monkeypatch, terminal):
    import sys

    from kvcache_cli.cli.refusals import on_stderr

    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal, raising=False)
    line = "error: " + "a refusal that names the value as typed and what was expected " * 4
    shown = on_stderr(line.strip())
    if not terminal:  # a log or a pipe keeps it whole, for grep and for programs
        assert shown == line.strip()
        return
    rows = shown.split("\n")
    assert len(rows) > 1 and all(len(row) <= 80 for row in rows)
    assert all(row.startswith("  ") for row in rows[1:])
    assert " ".join(row.strip() for row in rows) == line.strip()


def test_size_at_80_columns_keys_its_split_table_by_the_layer_kind():
    result = invoke("size", "--layers", "32", "--kv-heads", "8", "--seq", "32768",
                    env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    total = next(i for i, line in enumerate(lines) if line.rstrip().endswith("total"))
    assert lines[total].split() == ["layers", "kind", "total"]
    assert lines[total + 2].split() == ["32", "full", "attention", "4.00", "GiB"]


def test_eval_reads_only_the_part_of_a_huge_text_that_its_tokens_need(byte_checkpoint,
                                                                       tmp_path, monkeypatch):
    from kvcache_cli.eval import text as eval_text

    huge = tmp_path / "huge.txt"
    huge.write_text("def add(a, b):\n    return a + b\n" * 250_000)  # 8 MB
    encoded = []
    real = eval_text.encode
    monkeypatch.setattr(eval_text, "encode",
                        lambda text, tokenizer: encoded.append(len(text)) or real(text, tokenizer))
    result = invoke("eval", "-m", byte_checkpoint, "--text", str(huge), "--tokens", "100",
                    "--prompt-len", "16", "--cache", "concat", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tokens"] == 100
    assert encoded and max(encoded) <= 100 * eval_text.FIRST_READ_BYTES_PER_TOKEN


def test_a_short_first_read_grows_until_the_tokens_are_there(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from kvcache_cli.eval import text as eval_text

    monkeypatch.setattr(eval_text, "FIRST_READ_BYTES_PER_TOKEN", 1)
    path = tmp_path / "t.txt"
    path.write_text("é" * 1000)  # two bytes a character: the first read holds half
    read = eval_text.read_tokens(path, SimpleNamespace(tokenizer="bytes", vocab_size=256), 300)
    assert read.ids == tuple("é".encode() * 150)
    whole = eval_text.read_tokens(path, SimpleNamespace(tokenizer="bytes", vocab_size=256), 5000)
    assert len(whole.ids) == 2000


@pytest.mark.parametrize("damage", ["truncated", "emptied"])
def test_a_cached_gguf_cut_short_since_it_was_written_is_written_again(tmp_path, damage):
    pytest.importorskip("gguf")
    from llamakit import tiny_config, tiny_hf

    from kvcache_cli.models.gguf.export import export_gguf
    from kvcache_cli.models.gguf.reader import read_gguf

    hf = tiny_hf()
    state, config = hf.state_dict(), tiny_config(hf)
    first = export_gguf(state, config, "f32", tmp_path)
    assert not first.cached
    whole = first.path.read_bytes()
    first.path.write_bytes(whole[:len(whole) // 2] if damage == "truncated" else b"")
    again = export_gguf(state, config, "f32", tmp_path)
    assert not again.cached and again.path.read_bytes() == whole
    read_gguf(again.path)  # reads whole again
    assert export_gguf(state, config, "f32", tmp_path).cached


def test_size_prices_a_context_too_long_to_allocate_and_generate_refuses_it(tmp_path,
                                                                            monkeypatch):
    from llamakit import tiny_hf, write_tiny_gguf

    from kvcache_cli.models import bounds

    path = write_tiny_gguf(tiny_hf(), tmp_path / "long.gguf", context=2**20)
    monkeypatch.setattr(bounds, "physical_memory", lambda: 256 * 2**20)
    sized = invoke("size", "-m", str(path), "--json")
    assert sized.exit_code == 0, sized.output
    assert json.loads(sized.stdout)["seq"] == 2**20
    run = invoke("generate", "-m", str(path), "--ids", "1,2", "-n", "1")
    assert run.exit_code == 2 and run.stderr.count("\n") == 1, run.output
    assert "context 1,048,576: a static cache of the whole context" in run.stderr


def test_size_refuses_an_empty_dtype_in_one_line():
    result = invoke("size", "--layers", "2", "--kv-heads", "2", "--seq", "8", "--dtype", "")
    assert result.exit_code == 2
    assert result.stderr == ("error: unknown dtype '': expected one of fp32, fp16, bf16, "
                             "fp8, int8, int4\n")
