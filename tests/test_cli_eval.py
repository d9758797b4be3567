"""`kvcache eval` on the command line: a tiny byte-level checkpoint scored end to end, its
three views and its plot, and every bad input refused in one line before a model loads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from bytecheckpoint import write_byte_checkpoint
from typer.testing import CliRunner

from kvcache_cli.cli import app

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

runner = CliRunner()
BLOCK = 256  # the tiny checkpoint's context window
TEXT = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n" * 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A byte-level GPT-2 (256 ids) saved as a Hugging Face checkpoint, its held-out text
    beside it, as the trained checkpoint ships."""
    # Heads 64 wide, as every GPT-2 size and the trained checkpoint have: every quantised
    # format's default group size divides them.
    return write_byte_checkpoint(tmp_path_factory.mktemp("bytes-ckpt"), BLOCK, 128, TEXT)


def invoke(*args: str):
    return runner.invoke(app, ["eval", *args], env={"COLUMNS": "100"})


def test_eval_scores_the_default_caches_against_the_exact_cache(checkpoint):
    from kvcache_cli.caches.spec import parse_cache_spec
    from kvcache_cli.eval.quality import DEFAULT_CACHES

    # Past int4's and int2's default residual of 128 full-precision tokens.
    result = invoke("--model", str(checkpoint), "--prompt-len", "16", "--tokens", "200",
                    "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert [c["cache"] for c in out["caches"]] == [
        str(parse_cache_spec(name)) for name in DEFAULT_CACHES]
    exact, *compressed = out["caches"]
    assert exact["kl_max"] == 0 and exact["top1_agreement"] == 1.0
    for row in compressed:
        assert row["kl_mean"] > 0 and row["bytes_per_token"] < exact["bytes_per_token"], row
        assert len(row["loss_by_position"]) == 200 - 16
    assert out["tokens"] == 200 and out["text"] == "heldout.txt (bytes)"
    assert len(out["first_token_share"]) == 2


def test_eval_s_help_names_the_default_caches():
    from kvcache_cli.eval.quality import DEFAULT_CACHES

    result = runner.invoke(app, ["eval", "--help"], env={"COLUMNS": "200"})
    assert f"Default: {','.join(DEFAULT_CACHES)}," in " ".join(result.stdout.split())


def test_exact_kinds_score_kl_zero_through_the_command(checkpoint):
    result = invoke("--model", str(checkpoint), "--cache", "full,concat,paged:b16",
                    "--prompt-len", "16", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert [c["cache"] for c in out["caches"]] == ["static", "concat", "paged:b16"]
    assert out["tokens"] == BLOCK
    for row in out["caches"]:
        # static's one-token steps sum attention in the native decode call's order, the
        # others in SDPA's: float32 rounding, some 2e-10 here (logits moved by about 1e-5)
        assert row["kl_max"] <= 1e-8 and row["top1_agreement"] == 1.0, row


def test_eval_reads_the_tokens_prompt_and_chunk_asked_for(checkpoint, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    result = invoke("--model", str(checkpoint), "--text", str(text), "--cache", "full,concat",
                    "--tokens", "100", "--prompt-len", "20", "--chunk", "8", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert (out["tokens"], out["prompt_len"], out["chunk"]) == (100, 20, 8)
    assert [c["cache"] for c in out["caches"]] == ["static", "concat"]


def test_off_a_terminal_eval_prints_plain_text_and_only_progress_lines_on_stderr(checkpoint):
    result = invoke("--model", str(checkpoint), "--cache", "concat", "--prompt-len", "16")
    assert result.exit_code == 0, result.output
    # no bar, no note: at most a progress line now and then (a quick run may print none)
    assert all(line.startswith("scoring static, concat: ")
               for line in result.stderr.splitlines())
    lines = result.stdout.splitlines()
    header = next(line for line in lines if line.startswith("cache"))
    assert "perplexity" in header and "KL mean" in header and "bytes/tok" in header
    assert any(line.startswith("concat ") for line in lines)
    assert "─" not in result.stdout and "\x1b[" not in result.stdout  # no box, no colour


def test_eval_writes_the_frontier_plot(checkpoint, tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "eval.png"
    result = invoke("--model", str(checkpoint), "--cache", "paged:b16", "--prompt-len", "16",
                    "--tokens", "64", "--plot", str(plot))
    assert result.exit_code == 0, result.output
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replot_redraws_a_saved_runs_plot_without_running_it(checkpoint, tmp_path,
                                                              request):
    pytest.importorskip("matplotlib")
    drawn, redrawn, saved = tmp_path / "run.png", tmp_path / "again.png", tmp_path / "run.json"
    run = invoke("--model", str(checkpoint), "--cache", "int8", "--prompt-len", "16",
                 "--tokens", "64", "--plot", str(drawn), "--json")
    assert run.exit_code == 0, run.output
    saved.write_text(run.stdout)
    request.getfixturevalue("no_model_loads")  # from here on, a model load fails the test
    result = invoke("--replot", str(saved), "--plot", str(redrawn))
    assert result.exit_code == 0, result.output
    assert f"plot written to {redrawn}" in result.output
    assert redrawn.read_bytes() == drawn.read_bytes()


@pytest.mark.parametrize(("content", "plot", "said"), [
    (None, True, "no such file; expected a saved kvcache eval --json"),
    ("{not json", True, "Expecting property name"),
    ('{"model": "m", "caches": []}', True,
     "not the --json of a kvcache eval text run (the file has no 'weights_note': expected "),
    ('{"question": 1, "caches": [], "first_token_share": []}', True,
     "not the --json of a kvcache eval text run"),
    ("[1, 2]", True, "not the --json of a kvcache eval text run"),
    ("{}", False, "expected --plot OUT.png"),
])
def test_replot_of_a_file_that_is_not_a_saved_run_is_one_line_exit_2(tmp_path, content, plot,
                                                                       said):
    saved = tmp_path / "saved.json"
    if content is not None:
        saved.write_text(content)
    result = invoke("--replot", str(saved), *(["--plot", str(tmp_path / "p.png")] if plot
                                              else []))
    assert result.exit_code == 2 and said in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def _text(tmp_path, data: bytes):
    path = tmp_path / "text.txt"
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize(("args", "first_line"), [
    (["--cache", "int9"], "--cache: unknown cache 'int9'"),
    (["--cache", "static,full"], "cache 'static' is listed twice"),
    (["--cache", "paged:x16"], "unknown field 'x16'"),
    (["--cache", ","], "no cache in ','"),
    (["--cache", "window:300"], "holds 300 positions, beyond"),
    (["--cache", "int4:g128"], "group size 128 does not divide the head width 64"),
    (["--tokens", "257"], "--tokens 257 is beyond the model's context window of 256"),
    (["--tokens", "100", "--text", b"short text" * 9],
     "has only 90 tokens; expected at most 90"),
    (["--text", b"x" * 64], "has 64 tokens, too few for a prompt of 64"),
    (["--text", b""], "is empty; expected a UTF-8 text file"),
    (["--text", b"  \n\n"], "is empty"),
    (["--text", b"PK\x03\x04\x00\x00binary"], "looks binary (a NUL byte at offset 4)"),
    (["--text", b"caf\xe9 latin-1"], "is not UTF-8 text (byte 3"),
    (["--text", None], "no such file"),
    (["--prompt-len", "0"], "--prompt-len 0: expected a whole number from 1 to "),
    (["--chunk", "0"], "--chunk 0: expected a whole number from 1 to "),
    (["--threads", "0"], "--threads 0: expected a whole number from 1 to 1,024"),
    (["--device", "tpu"], "unknown device 'tpu'"),
])
def test_bad_input_is_one_line_exit_2_before_a_model_loads(
        checkpoint, tmp_path, no_model_loads, args, first_line):
    args = list(args)
    if "--text" in args:
        i = args.index("--text") + 1
        args[i] = str(tmp_path / "missing.txt") if args[i] is None else _text(tmp_path, args[i])
    result = invoke("--model", str(checkpoint), *args)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert first_line in lines[0], lines[0]


@pytest.mark.parametrize(("args", "first_line"), [
    # Every kind --model takes, before torch is imported (issue 43).
    (["--model", "/nonexistent/ckpt"], "model '/nonexistent/ckpt': no such file or folder"),
    (["--model", "gpt2", "--weights", "random"], "--model gpt2 ships no heldout.txt: give"),
])
def test_a_missing_checkpoint_or_text_is_one_line(no_model_loads, args, first_line):
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert first_line in result.stderr


def test_a_plot_path_that_is_a_directory_is_refused_before_a_model_loads(
        checkpoint, tmp_path, no_model_loads):
    pytest.importorskip("matplotlib")
    result = invoke("--model", str(checkpoint), "--plot", str(tmp_path))
    assert result.exit_code == 2, result.output
    assert "is a directory" in result.stderr


@pytest.mark.parametrize("where", ["proc", "under a file"])
def test_a_plot_path_no_file_can_be_made_at_is_refused_before_a_model_loads(
        checkpoint, tmp_path, no_model_loads, where):
    pytest.importorskip("matplotlib")
    if where == "proc" and not Path("/proc/self").is_dir():
        pytest.skip("no /proc here")
    (tmp_path / "a-file").write_text("")
    plot = "/proc/nope.png" if where == "proc" else str(tmp_path / "a-file" / "eval.png")
    result = invoke("--model", str(checkpoint), "--plot", plot)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    line, = result.stderr.strip().splitlines()
    assert line.startswith("error: --plot: ") and "expected a " in line, line


def test_gpt2_without_tiktoken_s_files_says_so_and_offers_the_trained_checkpoint(
        tmp_path, no_model_loads, monkeypatch):
    monkeypatch.setattr("kvcache_cli.models.tokenizer.gpt2_encoding",
                        lambda: (None, "tiktoken's gpt2 encoding is unavailable (offline)"))
    result = invoke("--model", "gpt2", "--weights", "random", "--text",
                    _text(tmp_path, TEXT.encode()))
    assert result.exit_code == 2, result.output  # a refusal like every other (issue 43)
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: tiktoken's gpt2 encoding is unavailable (offline)")
    assert "--model stdlib-bytes" in line


def test_without_torch_eval_says_which_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import fails, find_spec answers None
    result = invoke("--cache", "static")
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert "kvcache eval needs torch, which is not installed" in line
    assert "pip install 'kvcache[torch]'" in line


def test_the_cache_list_completes_the_kind_after_the_last_comma():
    from kvcache_cli.cli.options import complete_cache_list

    assert [name for name, _ in complete_cache_list("static,paged-i")] == [
        "static,paged-int8", "static,paged-int4"]
    assert "concat" in [name for name, _ in complete_cache_list("")]


def test_a_checkpoint_naming_no_tokenizer_outside_gpt2_s_vocabulary_is_one_line(
        checkpoint, tmp_path, no_model_loads):
    config = json.loads((checkpoint / "config.json").read_text())
    del config["tokenizer"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes((checkpoint / "model.safetensors").read_bytes())
    result = invoke("--model", str(tmp_path), "--text", str(checkpoint / "heldout.txt"))
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert "no tokenizer for a vocabulary of 256 ids" in line



def test_without_smollm2_eval_reads_the_trained_checkpoint_s_held_out_text(monkeypatch):
    from kvcache_cli.checkpoints import TRAINED

    monkeypatch.setattr("kvcache_cli.models.smollm2.smollm2_gguf", lambda: None)
    result = invoke("--cache", "static,int8", "--tokens", "200", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["model"] == f"checkpoint {TRAINED} (shipped)"
    assert out["text"] == "heldout.txt (bytes)" and out["tokens"] == 200
    static, int8 = out["caches"]
    # A trained model predicts Python source far better than uniform over 256 bytes.
    assert static["bits_per_token"] < 6
    assert 0 < int8["kl_mean"] and int8["bytes_per_token"] < static["bytes_per_token"]


def test_progress_off_a_terminal_says_the_count_elapsed_and_an_eta_now_and_then(capsys):
    from kvcache_cli.cli.output import ProgressLines

    now = iter([0.0, 1.0, 5.0, 20.0, 30.0, 200.0, 201.0])
    progress = ProgressLines("scoring", "tokens", clock=lambda: next(now))  # began at 0 s
    progress(0, 1000)  # 1 s: nothing done, nothing said
    progress(50, 1000)  # 5 s: under a tenth, under a minute; the ETA's rate counts from here
    progress(150, 1000)  # 20 s: a tenth more, 10 s on: a line
    progress(200, 1000)  # 30 s: 50 more only
    progress(210, 1000)  # 200 s: a minute since the last line
    progress(1000, 1000)  # 201 s: done
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["scoring: 150/1,000 tokens, 0:20 elapsed, ETA 2:08",
                     "scoring: 210/1,000 tokens, 3:20 elapsed, ETA 16:03",
                     "scoring: 1,000/1,000 tokens, 3:21 elapsed"]


def test_every_command_defaults_to_smollm2_where_installed_else_the_shipped_checkpoint(
        monkeypatch):
    from kvcache_cli.cli.loading import default_model

    monkeypatch.setattr("kvcache_cli.models.smollm2.smollm2_gguf", lambda: "SmolLM2.gguf")
    assert default_model() == "smollm2"
    monkeypatch.setattr("kvcache_cli.models.smollm2.smollm2_gguf", lambda: None)
    assert default_model() == "stdlib-bytes"
    for command in ("generate", "eval", "bench", "serve"):
        text = " ".join(CliRunner().invoke(app, [command, "--help"],
                                           env={"COLUMNS": "200"}).output.split())
        assert "Default: smollm2 where it is installed" in text, command
