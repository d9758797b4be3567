"""`generate --draft`, `bench --draft`, `kvcache caches` and the two rollback breaks on the
command line: results, and bad input refused in one line before any model loads."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvcache_cli.caches.spec import KINDS
from kvcache_cli.cli import app

pytestmark = pytest.mark.usefixtures("one_torch_thread")

runner = CliRunner()
IDS = "5,9,2,33,7,5,9,2,40,11,5,9,2"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=256,
                        initializer_range=0.3, bos_token_id=None, eos_token_id=None)
    path = tmp_path_factory.mktemp("tiny-gpt2")
    GPT2LMHeadModel(config).eval().save_pretrained(path)
    return path


def invoke(args: list[str]):
    result = runner.invoke(app, args, env={"COLUMNS": "100"})
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def test_generate_with_a_draft_gives_plain_greedy_tokens(checkpoint):
    plain = invoke(["generate", "--model", str(checkpoint), "--ids", IDS, "-n", "20", "--json"])
    assert plain.exit_code == 0, plain.output
    for draft in ("lookup", "layers:1"):
        got = invoke(["generate", "--model", str(checkpoint), "--ids", IDS, "-n", "20",
                      "--draft", draft, "--speculate", "3", "--json"])
        assert got.exit_code == 0, got.output
        run = json.loads(got.stdout)
        assert run["runs"][0]["tokens"] == json.loads(plain.stdout)["tokens"]
        assert run["identical"] == [True] and run["runs"][0]["k"] == 3


def test_generate_with_a_draft_rolls_back_the_cache_given_by_cache(checkpoint):
    args = ["generate", "--model", str(checkpoint), "--ids", IDS, "-n", "16", "--json"]
    plain = json.loads(invoke(args).stdout)["tokens"]
    got = invoke([*args, "--cache", "paged:b4", "--draft", "layers:1", "--speculate", "5"])
    assert got.exit_code == 0, got.output
    run = json.loads(got.stdout)
    assert run["cache"] == "paged:b4" and run["runs"][0]["tokens"] == plain


def test_generate_with_a_draft_shows_the_tokens_and_the_acceptance(checkpoint):
    got = invoke(["generate", "--model", str(checkpoint), "--ids", IDS, "-n", "12",
                  "--draft", "lookup"])
    assert got.exit_code == 0, got.output
    assert "draft lookup:3" in got.stdout and "accepted" in got.stdout
    assert "best K 4" in got.stdout  # --speculate defaults to 4


def test_a_draft_as_large_as_the_target_runs_with_a_note(checkpoint):
    got = invoke(["generate", "--model", str(checkpoint), "--ids", IDS, "-n", "6",
                  "--draft", str(checkpoint), "--json"])
    assert got.exit_code == 0, got.output
    assert "note: the draft" in got.stderr and "is not smaller than the target" in got.stderr
    assert json.loads(got.stdout)["runs"][0]["acceptance_rate"] == 1.0  # it is the target


def test_bench_with_a_draft_sweeps_k_and_names_the_best(checkpoint):
    got = invoke(["bench", "--model", str(checkpoint), "--device", "cpu", "--draft", "layers:1",
                  "--speculate", "1,2,4", "--prompt-len", "8", "--new-tokens", "16",
                  "--repeats", "1", "--cache", "paged:b4", "--json"])
    assert got.exit_code == 0, got.output
    run = json.loads(got.stdout)
    assert [r["k"] for r in run["runs"]] == [1, 2, 4] and all(run["identical"])
    assert run["best_k"] in (1, 2, 4) and run["cache"] == "paged:b4"


def test_the_caches_command_lists_every_kind_and_its_rollback_without_torch():
    got = invoke(["caches", "--json"])
    assert got.exit_code == 0, got.output
    rows = json.loads(got.stdout)
    assert [r["name"] for r in rows] == list(KINDS)
    assert all(r["rolls_back"] == bool(KINDS[r["name"]].rollback) for r in rows)
    code = ("import sys; sys.argv = ['kvcache', 'caches']; from kvcache_cli.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "sys.exit(3 if 'torch' in sys.modules else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and "cache kinds" in done.stdout, done.stderr


def test_the_two_rollback_breaks_show_their_symptoms(checkpoint):
    got = invoke(["break", "no-rollback", "--model", str(checkpoint), "--max-new-tokens", "16",
                  "--json"])
    assert got.exit_code == 0, got.output
    result = json.loads(got.stdout)
    assert result["fixed"] == result["correct"] and result["first_divergence"] is not None
    got = invoke(["break", "rollback-shared", "--model", str(checkpoint), "--json"])
    assert got.exit_code == 0, got.output
    result = json.loads(got.stdout)
    assert result["reader_fixed"] == result["reader_solo"]
    assert result["first_divergence"] is not None and result["third_admitted_broken"]


# ---------------------------------------------------------------------------- bad input


@pytest.mark.usefixtures("no_model_loads")
@pytest.mark.parametrize(("args", "message"), [
    (["--draft", "lookup", "--speculate", "0"], "--speculate 0: expected K from 1 to 63"),
    (["--draft", "lookup", "--speculate", "64"], "--speculate 64: expected K from 1 to 63"),
    (["--draft", "gpt2"], "draft gpt2 has a vocabulary of 50,257 tokens, the target 256"),
    (["--draft", "layers:2"], "the target has 2 layers; expected layers:N with N from 1 to 1"),
    (["--draft", "lookup:x"], "the longest n-gram 'x' is not a whole number"),
    (["--draft", "lookup", "--mode", "naive"], "--draft needs a cache to roll back"),
    (["--speculate", "3"], "--speculate 3 needs a --draft"),
    (["--draft", "lookup", "--cache", "window:8", "-n", "20"],
     "cache window:8 holds 8 positions and this request writes 33"),
    (["--draft", "lookup", "--cache", "h2o:4+4"], "cache h2o:4+4 cannot roll back"),
])
def test_generate_refuses_bad_speculation_in_one_line(checkpoint, args, message):
    got = invoke(["generate", "--model", str(checkpoint), "--ids", IDS, *args])
    assert got.exit_code == 2, got.output
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert got.stdout == ""


@pytest.mark.usefixtures("no_model_loads")
@pytest.mark.parametrize(("args", "message"), [
    (["--draft", "lookup", "--speculate", "1,0"], "--speculate 0: expected K from 1 to 63"),
    (["--draft", "lookup", "--speculate", "2,2"], "a K is listed twice"),
    (["--draft", "lookup", "--cache", "ring"], "cache ring cannot roll back, which "
                                               "speculative decoding needs"),
    (["--draft", "lookup", "--modes", "static"], "--modes does not apply with --draft"),
    (["--speculate", "2"], "--speculate applies to speculative decoding only"),
    (["--draft", "lookup", "--cache", "static,paged"], "one cache"),
    (["--draft", "lookup", "--prompt-file", "/nonexistent"], "no such file"),
])
def test_bench_refuses_bad_speculation_in_one_line(checkpoint, args, message, monkeypatch):
    # A kind that cannot roll back, as a ring that evicts would register itself.
    monkeypatch.setitem(KINDS, "ring", dataclasses.replace(KINDS["static"], name="ring",
                                                          rollback=""))
    got = invoke(["bench", "--model", str(checkpoint), *args])
    assert got.exit_code == 2, got.output
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert got.stdout == ""


def test_bench_prompts_a_shipped_checkpoint_with_its_held_out_text():
    from kvcache_cli.checkpoints import heldout_bytes

    got = invoke(["bench", "-m", "stdlib-bytes", "--device", "cpu", "--draft", "lookup",
                  "--speculate", "2", "--prompt-len", "64", "--new-tokens", "8", "--repeats",
                  "1", "--json"])
    assert got.exit_code == 0, got.output
    run = json.loads(got.stdout)
    assert run["prompt_tokens"] == 64 and run["note"] is None and all(run["identical"])
    assert len(heldout_bytes()) > 64


def test_a_prompt_file_without_a_tokenizer_is_refused_as_bad_input(monkeypatch, capsys):
    # Like generate's and eval's: tiktoken offline is a refusal (exit 2), not a crash (1).
    from types import SimpleNamespace

    import typer

    import kvcache_cli.models.tokenizer as tokenizer
    from kvcache_cli.cli.prompt_file import prompt_ids
    from kvcache_cli.models.gpt2 import GPT2_VOCAB_SIZE

    monkeypatch.setattr(tokenizer, "gpt2_encoding", lambda: (None, "tiktoken is not installed"))
    gpt2 = SimpleNamespace(config=SimpleNamespace(tokenizer="bpe", vocab_size=GPT2_VOCAB_SIZE))
    with pytest.raises(typer.Exit) as exit_:
        prompt_ids(gpt2, "hello")
    assert exit_.value.exit_code == 2
    assert capsys.readouterr().err == "error: --prompt-file: tiktoken is not installed\n"
