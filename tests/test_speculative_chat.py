"""Speculative decoding on chat tasks (`speculative.run_task`, `kvcache bench --tasks`):
every draft at every K gives plain greedy's reply exactly, the counts the table sums are
the runs' own, and what cannot run is refused in one line before the weights load.
Timings are never asserted."""

from __future__ import annotations

import json
import random

import pytest
from llamakit import smollm2_or_skip, tiny_hf, write_tiny_gguf
from servingkit import tiny_model
from typer.testing import CliRunner

from kvcache_cli.cli import app
from kvcache_cli.generate import generate
from kvcache_cli.speculative import drafts as D
from kvcache_cli.speculative import tasks as S

pytestmark = pytest.mark.usefixtures("one_torch_thread")
runner = CliRunner()


def _task(model, kind: str, seed: int) -> tuple[S.ChatTask, tuple[int]]:
    """A prompt that repeats itself (what lookup finds), and a stop token the model makes."""
    rng = random.Random(seed)
    part = [rng.randrange(model.config.vocab_size) for _ in range(8)]
    prompt = tuple(part * 3)
    plain = generate(model, list(prompt), 20).tokens
    return S.ChatTask(kind, seed, prompt), (plain[12],)


def test_every_draft_at_every_k_gives_plain_greedys_reply_to_its_stop_token():
    model = tiny_model()
    drafts = [D.LookupDraft(3), D.ModelDraft(D.layer_draft(model, 1), 128, "layers:1")]
    for cache in ("static", "paged", "int8:g8"):  # the tiny heads are 8 wide
        task, stop = _task(model, "copy", 1)
        run = S.run_task(model, task, drafts, [1, 3], cache, 20, stop)
        plain = generate(model, list(task.prompt_ids), 20, cache, stop_ids=stop)
        assert run.reply_tokens == len(plain.tokens) and run.stopped == plain.stopped
        assert all(run.identical), (cache, run.identical)
        assert [(s.draft, s.k) for s in run.runs] == [
            ("lookup:3", 1), ("lookup:3", 3), ("layers:1", 1), ("layers:1", 3)]


def test_the_table_sums_each_sets_proposals_acceptances_and_forwards():
    model = tiny_model()
    runs = []
    for kind, seed in (("copy", 1), ("copy", 2), ("other", 3)):
        task, stop = _task(model, kind, seed)
        runs.append(S.run_task(model, task, [D.LookupDraft(3)], [2], "static", 16, stop))
    rows = {r.kind: r for r in S.task_rows(runs)}
    copy = [t.runs[0] for t in runs if t.kind == "copy"]
    assert rows["copy"].tasks == 2 and rows["other"].tasks == 1
    assert rows["copy"].proposed == sum(s.proposed for s in copy) > 0
    assert rows["copy"].accepted == sum(s.accepted for s in copy)
    assert rows["copy"].forwards_per_token == (sum(s.target_forwards for s in copy)
                                               / sum(len(s.tokens) for s in copy))
    assert rows["copy"].identical == 2


def test_the_shipped_tasks_hold_both_sets_through_the_chat_template():
    config = smollm2_config()
    tasks = S.chat_tasks(config, "smollm2")
    kinds = [t.kind for t in tasks]
    assert kinds.count("copy") >= 3 and kinds.count("other") >= 3
    data = json.loads(S.TASKS.read_text())
    # A copying task gives the passage or function it asks to edit: most of its words.
    assert all(len(p.split()) > 25 for p in data["copy"])
    assert all(len(p.split()) < 15 for p in data["other"])


def smollm2_config():
    smollm2_or_skip()
    from kvcache_cli.models import model_config

    return model_config("smollm2")


@pytest.fixture(scope="module")
def chat_gguf(tmp_path_factory):
    """A tiny Llama GGUF with a chat template and a context that holds every shipped task."""
    path = tmp_path_factory.mktemp("chat") / "tiny.gguf"
    return str(write_tiny_gguf(tiny_hf(max_position_embeddings=2048), path, context=2048))


def test_bench_tasks_runs_every_set_and_draft_and_gives_greedys_tokens(chat_gguf):
    args = ["bench", "-m", chat_gguf, "--tasks", "copy,other", "--draft", "lookup,layers:1",
            "--speculate", "2", "--new-tokens", "6", "--threads", "1"]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    table = json.loads(result.stdout)
    assert {(r["kind"], r["draft"], r["k"]) for r in table["rows"]} == {
        (kind, draft, 2) for kind in ("copy", "other") for draft in ("lookup:3", "layers:1")}
    assert all(r["identical"] == r["tasks"] for r in table["rows"]) and table["cap"] == 6
    assert len(table["runs"]) == len(S.chat_tasks(_config(chat_gguf), chat_gguf))
    shown = runner.invoke(app, args)
    assert shown.exit_code == 0, shown.output
    assert "every run gave plain greedy's tokens" in shown.stdout
    assert "copy   lookup:3    2" in shown.stdout


def _config(model: str):
    from kvcache_cli.models import model_config

    return model_config(model)


@pytest.mark.parametrize("args, said", [
    (["-m", "gpt2"], "model 'gpt2' has no chat template"),
    (["--draft", "layers:30"], "the target has 30 layers; expected layers:N with N from 1 to 29"),
    (["--draft", "gpt2"], "expected lookup[:n] or layers:N"),
    (["--cache", "h2o:8+8"], "cannot roll back"),
    (["--tasks", "poems"], "--tasks 'poems': expected copy or other"),
    (["--speculate", "2,x"], "--speculate '2,x'"),
    (["--plot", "t.png"], "--plot does not apply with --tasks"),
])
def test_the_table_refuses_what_cannot_run_in_one_line_exit_2(args, said):
    if args[:2] != ["-m", "gpt2"]:
        smollm2_or_skip()
    result = runner.invoke(app, ["bench", "-m", "smollm2", "--tasks", "copy,other", *args])
    assert result.exit_code == 2 and said in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
