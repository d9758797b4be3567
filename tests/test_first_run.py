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
