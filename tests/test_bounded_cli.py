"""The bounded caches wherever a cache is named: generate --cache, bench --cache,
eval --cache, each on a tiny byte-level checkpoint, and a budget past the context window
refused in one line before a model loads."""

from __future__ import annotations

import json

import pytest
from bytecheckpoint import write_byte_checkpoint
from typer.testing import CliRunner

from kvcache_cli.cli import app

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK = 128  # the tiny checkpoint's context window
TEXT = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n" * 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A byte-level GPT-2 (256 ids) saved as a Hugging Face checkpoint, with a held-out text."""
    return write_byte_checkpoint(tmp_path_factory.mktemp("bytes-ckpt"), BLOCK, 32, TEXT)


def invoke(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "100"})


def test_generate_with_a_window_holds_its_budget_whatever_the_length(checkpoint):
    args = ("generate", "--model", str(checkpoint), "--ids", "1,2,3,4,5", "-n", "40", "--json")
    window = json.loads(invoke(*args, "--cache", "window:8").stdout)
    static = json.loads(invoke(*args, "--cache", "static").stdout)
    # 2 layers x K and V x 8 slots x 32 wide x 4 bytes, against 45 positions' worth
    assert window["cache_bytes_held"] == 2 * 2 * 8 * 32 * 4
    assert static["cache_bytes_held"] == 2 * 2 * 45 * 32 * 4
    assert window["mode"] == "window:8" and len(window["tokens"]) == 40
    assert window["tokens"][:3] == static["tokens"][:3]  # nothing evicted yet


def test_eval_scores_the_bounded_caches_with_constant_bytes(checkpoint):
    result = invoke("eval", "--model", str(checkpoint), "--cache",
                    "full,window:32,sink:2+30,h2o:16+16", "--prompt-len", "16", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    rows = {c["cache"]: c for c in out["caches"]}
    assert list(rows) == ["static", "window:32", "sink:2+30", "h2o:16+16"]
    assert rows["window:32"]["bytes_held"] == rows["sink:2+30"]["bytes_held"] == 2 * 2 * 32 * 32 * 4
    # H2O also holds a float32 score and an int64 position per slot and head
    assert rows["h2o:16+16"]["bytes_held"] == 2 * 2 * 32 * 32 * 4 + 2 * 2 * 32 * 12
    for name in ("window:32", "sink:2+30", "h2o:16+16"):
        losses = rows[name]["loss_by_position"]
        exact = rows["static"]["loss_by_position"]
        # the same to float32 noise until the budget of 32 positions is passed, then not
        assert losses[:32 - 16] == pytest.approx(exact[:32 - 16], rel=1e-5)
        assert rows[name]["kl_mean"] > 0


@pytest.mark.parametrize("command", [
    ("generate", "--ids", "1,2,3", "--cache", "window:129"),
    ("bench", "--cache", "sink:4+125"),
    ("eval", "--cache", "h2o:100+29"),
])
def test_a_budget_past_the_context_window_is_refused_before_a_model_loads(
        checkpoint, no_model_loads, command):
    name, *rest = command
    result = invoke(name, "--model", str(checkpoint), *rest)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "holds 129 positions, beyond" in lines[0], result.stderr
    assert "context window of 128" in lines[0]


def test_bench_cache_adds_specs_beside_static_or_beside_the_modes_given():
    from kvcache_cli.cli.bench import _with_caches

    # Spelled as typed, so that a refusal later names the user's text.
    assert _with_caches("static", "window:8,SINK:2+6") == "static,window:8,SINK:2+6"
    assert _with_caches("concat,window:8", "window:8") == "concat,window:8"
    result = invoke("bench", "--cache", "window:8,window:8")
    assert result.exit_code == 2 and "listed twice" in result.stderr


def test_break_list_names_the_bounded_breaks():
    result = invoke("break", "--list")
    assert result.exit_code == 0, result.output
    for name in ("evict-sink", "ring-mask", "ring-off-by-one"):
        assert name in result.stdout
