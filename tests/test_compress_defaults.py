"""`kvcache compress` on a short prompt: the default caches run (SnapKV's observation
window, which nobody typed, cut to the keys the prompt keeps, the run unchanged by it), and
a window the user typed longer than the prompt is refused in one line with one that fits."""

from __future__ import annotations

import json

import pytest
from bytecheckpoint import write_byte_checkpoint
from typer.testing import CliRunner

from kvcache_cli.caches.spec import parse_cache_list
from kvcache_cli.cli import app
from kvcache_cli.eval.compress import fit_windows

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXT = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n" * 4
SHORT = "class Point:"  # 12 bytes: 12 tokens, fewer than SnapKV's window of 32


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_byte_checkpoint(tmp_path_factory.mktemp("bytes-ckpt"), 256, 64, TEXT)


def invoke(*args: str):
    return CliRunner().invoke(app, ["compress", *args], env={"COLUMNS": "80"})


def test_the_default_caches_run_on_a_prompt_shorter_than_snapkvs_window(checkpoint):
    result = invoke(SHORT, "-m", str(checkpoint), "-n", "4", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["prompt_tokens"] == 12
    # A quarter of 12 is 3 keys a layer: the window is those 3, as snapkv:3 would have it.
    assert [r["cache"] for r in out["rows"]] == ["snapkv:0.25:w3:k7:max", "knorm:0.25",
                                                 "recent:0.25"]
    assert all(r["kept"] == [3, 3] for r in out["rows"])


def test_a_typed_spec_without_a_window_fits_the_prompt_too(checkpoint):
    result = invoke(SHORT, "-m", str(checkpoint), "-n", "2", "--cache", "SNAPKV:0.5:pyramid",
                    "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["rows"][0]["cache"] == "snapkv:0.5:w6:k7:max:pyramid"


@pytest.mark.parametrize("cache, fit", [
    ("snapkv:0.25:w32", "'snapkv:0.25:w3'"),
    ("snapkv:0.5:W20:avg", "'snapkv:0.5:w6:avg'"),
])
def test_a_typed_window_longer_than_the_prompt_is_refused_with_one_that_fits(
        checkpoint, cache, fit, no_model_loads):
    result = invoke(SHORT, "-m", str(checkpoint), "--cache", cache)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "longer than the prompt of 12; expected at most 12, e.g. " + fit in lines[0]
    assert "or no :wN" in lines[0]


def test_only_a_window_nobody_typed_is_cut_and_only_when_the_prompt_keeps_fewer_keys():
    specs = parse_cache_list("snapkv:0.25,snapkv:0.5:w32,knorm:0.25,recent:0.25:s2")
    assert [str(s) for s in fit_windows(specs, 12)] == [
        "snapkv:0.25:w3:k7:max", "snapkv:0.5:w32:k7:max", "knorm:0.25", "recent:0.25:s2"]
    # 128 tokens keep 32 keys a layer: SnapKV's own window, left as it is.
    assert str(fit_windows(specs, 128)[0]) == "snapkv:0.25:w32:k7:max"


def test_the_cut_window_keeps_what_the_uncut_one_keeps():
    """SnapKV observes at most the keys it keeps, so cutting the window to them changes no
    kept key and no token (a prompt of 40, long enough for the uncut w32 to run)."""
    from kvcache_cli.eval.compress import compress_prompt
    from kvcache_cli.models.gpt2 import GPT, GPTConfig

    config = GPTConfig(block_size=96, vocab_size=96, n_layer=2, n_head=4, n_embd=32)
    model = GPT(config, init_std=0.3, seed=0).double().eval()
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    uncut, cut = [
        compress_prompt(model, ids, specs, new_tokens=6, decode=str).rows[0]
        for specs in (parse_cache_list("snapkv:0.25"), fit_windows(parse_cache_list(
            "snapkv:0.25"), 40))]
    assert (uncut.cache, cut.cache) == ("snapkv:0.25:w32:k7:max", "snapkv:0.25:w10:k7:max")
    assert cut.kept_share == uncut.kept_share and cut.kept == uncut.kept == (10, 10)
    assert cut.continuation.tokens == uncut.continuation.tokens
    assert len(set(uncut.continuation.tokens)) > 1  # tokens that vary, so agreeing means something
