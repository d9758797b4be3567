"""`kvcache compress`: what each compressing kind keeps of one prompt (exact counts and
positions), the bytes the prompt holds before and after (exact arithmetic), a budget of the
whole prompt continuing exactly as the exact cache and a smaller one not, a hybrid model's
sliding layers left whole, its views and --json, and every bad input in one line."""

from __future__ import annotations

import json

import pytest
from bytecheckpoint import write_byte_checkpoint
from typer.testing import CliRunner

from kvcache_cli.cli import app

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

runner = CliRunner()
TEXT = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n" * 4
PROMPT = "class Point:\n    x: int = 0\n    y: int = 0\n"  # 43 bytes: 43 tokens


def invoke(*args: str):
    return runner.invoke(app, ["compress", *args], env={"COLUMNS": "80"})


def decode(ids: list[int]) -> str:
    return " ".join(map(str, ids))


def gpt64():
    """A tiny GPT-2 in float64 (4 heads of 8): the same arithmetic in two caches agrees to
    rounding noise; weights drawn wide, so greedy tokens vary."""
    from kvcache_cli.models.gpt2 import GPT, GPTConfig

    config = GPTConfig(block_size=96, vocab_size=96, n_layer=3, n_head=4, n_embd=32)
    return GPT(config, init_std=0.3, seed=0).double().eval()


def run(model, specs: str, P: int = 40, n: int = 8, layer=None):
    from kvcache_cli.caches.spec import parse_cache_list
    from kvcache_cli.eval.compress import compress_prompt

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (P,), generator=g).tolist()
    return compress_prompt(model, ids, parse_cache_list(specs), new_tokens=n, decode=decode,
                           layer=layer)


# ---------------------------------------------------------------------------- the computation


def test_recent_keeps_its_sinks_and_newest_tokens_in_exactly_the_bytes_it_should():
    r = run(gpt64(), "recent:10:s2")
    (row,) = r.rows
    assert row.kept == (10, 10, 10)
    assert row.kept_share == tuple(1.0 if p < 2 or p >= 32 else 0.0 for p in range(40))
    # float64, 4 KV heads of 8: K and V are 2 x 4 x 8 x 8 = 512 bytes a position and layer,
    # and a kept key adds an int64 position per KV head (32 bytes).
    assert [(b.kind, b.layers, b.exact, b.held) for b in row.bytes] == [
        ("full", 3, 3 * 40 * 512, 3 * 10 * (512 + 32))]
    assert row.compress_ms > 0 and r.exact.prefill_ms > 0
    assert len(row.continuation.tokens) == len(r.exact.tokens) == 8


def test_the_whole_prompt_kept_continues_as_the_exact_cache_and_a_quarter_does_not():
    r = run(gpt64(), "snapkv:1.0:w4,knorm:1.0,recent:1.0,recent:10")
    *whole, quarter = r.rows
    for row in whole:
        assert row.kept == (40, 40, 40) and set(row.kept_share) == {1.0}, row.cache
        assert row.continuation.tokens == r.exact.tokens and row.matching == 8, row.cache
        assert row.kl_max < 1e-12 and row.top1_agreement == 1.0, row.cache
    # Compression that dropped nothing, or dropped the wrong keys unnoticed, fails here.
    assert quarter.kl_mean > 1e-3 and quarter.matching < 8


def test_pyramid_budgets_are_kept_per_layer_and_one_layer_can_be_shown():
    from kvcache_cli.caches.spec import parse_cache_spec
    from kvcache_cli.caches.spec_bounded import layer_budgets

    spec = parse_cache_spec("snapkv:0.5:w4:pyramid")
    r = run(gpt64(), str(spec), layer=2)
    (row,) = r.rows
    assert row.kept == layer_budgets(dict(spec.params), 40, 3) and sum(row.kept) == 60
    # One layer's four KV heads: a token's share is the heads that kept it, in quarters.
    assert sum(row.kept_share) * 4 == row.kept[2] * 4 and r.shown_layer == 2
    assert {s * 4 for s in row.kept_share} <= {0.0, 1.0, 2.0, 3.0, 4.0}
    assert row.kept_share[-4:] == (1.0,) * 4  # the observation window, in every head


def gemma3_config(full: bool = True):
    """A tiny Gemma 3's config: (sliding, sliding, full) x 2, or every layer sliding."""
    from kvcache_cli.caches.base import LayerType
    from kvcache_cli.models.gemma3 import Gemma3Config

    last = LayerType(None, 1e6) if full else LayerType(8, 1e4)
    return Gemma3Config(n_layer=6, n_head=4, n_kv_head=1, n_embd=64, intermediate=96,
                        vocab_size=211, context=512, head_dim=32,
                        layer_types=(LayerType(8, 1e4), LayerType(8, 1e4), last) * 2,
                        query_pre_attn_scalar=24)


@pytest.mark.parametrize("full, layer, message", [
    (True, 0, "--layer 0 is a sliding layer, which keeps its window; expected a "
              "full-attention layer: 2, 5"),
    (False, None, "no layer attends in full, so no kind has a prompt to compress"),
])
def test_a_layer_with_nothing_to_compress_is_refused(full, layer, message):
    from kvcache_cli.caches.spec import parse_cache_list
    from kvcache_cli.eval.compress import check_compress

    config = gemma3_config(full)
    with pytest.raises(ValueError, match=message):
        check_compress(parse_cache_list("recent:4"), 40, 8, config.cache_shape, 512, layer)


def test_a_hybrid_model_compresses_its_full_layers_and_keeps_the_sliding_ones_whole():
    from kvcache_cli.models.gemma3 import Gemma3

    torch.manual_seed(0)
    model = Gemma3(gemma3_config()).double().eval()
    with torch.no_grad():  # built empty, as a checkpoint fills it: drawn here
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.05 if "embed" in name else 0.3)
    r = run(model, "recent:0.25,recent:1.0")
    quarter, whole = r.rows
    assert r.compressed_layers == (2, 5) and r.sliding_window == 8
    assert quarter.kept == (10, 10)
    full, sliding = {b.kind: b for b in quarter.bytes}["full"], {
        b.kind: b for b in quarter.bytes}["sliding"]
    # One KV head of 32 in float64: 512 bytes a position and layer, and 8 for a position.
    assert (full.layers, full.exact, full.held) == (2, 2 * 40 * 512, 2 * 10 * (512 + 8))
    # A ring of the window (8 slots, allocated for the prompt and continuation) on each of
    # the four sliding layers, and its position vector, in both caches.
    assert sliding.layers == 4 and sliding.held == sliding.exact > 0
    assert whole.matching == 8 and whole.kl_max < 1e-12


# ---------------------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_byte_checkpoint(tmp_path_factory.mktemp("bytes-ckpt"), 256, 64, TEXT)


def test_compress_prints_the_kept_counts_bytes_and_continuations_as_json(checkpoint):
    result = invoke(PROMPT, "-m", str(checkpoint), "--cache", "recent:10,knorm:1.0", "-n", "6",
                    "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["prompt_tokens"] == 43 and out["new_tokens"] == 6
    recent, whole = out["rows"]
    assert recent["cache"] == "recent:10" and recent["kept"] == [10, 10]
    # float32, 2 heads of 32: K and V are 512 bytes a position and layer, positions 16.
    assert recent["bytes"] == [{"kind": "full", "layers": 2, "exact": 2 * 43 * 512,
                                "held": 2 * 10 * (512 + 16)}]
    assert whole["continuation"]["tokens"] == out["exact"]["tokens"]
    assert whole["matching"] == 6 and whole["top1_agreement"] == 1.0


def test_a_question_ends_the_prompt_that_is_compressed(checkpoint):
    result = invoke(PROMPT, "-m", str(checkpoint), "--question", "Why?", "--cache",
                    "recent:4", "-n", "2", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    # No chat template on this model: the question after a blank line, in bytes.
    assert "".join(out["pieces"]) == PROMPT + "\n\nWhy?\n" and out["prompt_tokens"] == 50
    assert out["rows"][0]["kept_share"][-4:] == [1.0] * 4  # "hy?\n", the newest kept


def test_compress_marks_the_kept_tokens_within_80_columns(checkpoint):
    result = invoke(PROMPT, "-m", str(checkpoint), "--cache", "recent:10", "-n", "4",
                    "--show-kept", "--layer", "1")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert max(map(len, out.splitlines())) <= 80
    assert "10 of 43" in out and "kept by recent:10 (layer 1 × 2 KV heads):" in out
    assert out.rstrip().endswith("class Point:\n    x: int = 0\n    y[: int = 0\n]")


@pytest.mark.parametrize("args, message", [
    ([], "no prompt: expected one"),
    (["  "], "the prompt is empty"),
    ([PROMPT, "--text", "t.txt"], "a PROMPT and --text: expected one of the two"),
    ([PROMPT, "--cache", "int8"], "cache 'int8' does not compress the prompt: expected a kind "
                                  "that compresses at prefill (snapkv, knorm, recent)"),
    ([PROMPT, "--cache", "knorm:64"], "keeps 64 keys of a prompt of 43 tokens"),
    ([PROMPT, "--cache", "snapkv:0.5:w48"], "the observation window of 48 tokens is longer than "
                                        "the prompt of 43"),
    ([PROMPT, "-n", "300"], "pass the model's context window of 256"),
    ([PROMPT, "-n", "1"], "--max-new-tokens 1"),
    ([PROMPT, "--layer", "1"], "--layer 1 chooses the layer --show-kept shows"),
    ([PROMPT, "--show-kept", "--layer", "2"], "--layer 2: the model has layers 0..1"),
    ([PROMPT, "--question", " "], "--question is empty"),
])
def test_bad_input_is_refused_in_one_line_before_a_model_loads(checkpoint, args, message,
                                                               no_model_loads):
    result = invoke(*args, "-m", str(checkpoint))
    assert result.exit_code == 2, result.output
    assert result.stdout == "" and len(result.stderr.strip().splitlines()) == 1
    assert message in result.stderr, result.stderr


def test_on_smollm2_the_whole_prompt_continues_exactly_and_a_window_does_not():
    from llamakit import smollm2_or_skip

    smollm2_or_skip()
    result = invoke("The capital of France is Paris. The capital of Italy is Rome. The "
                    "capital of Spain is", "-m", "smollm2", "--cache",
                    "recent:10,snapkv:1.0:w4", "-n", "8", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["prompt_tokens"] == 19 and out["n_kv_head"] == 3
    recent, whole = out["rows"]
    # 30 layers, 3 KV heads of 64 in float32: 1,536 bytes of K and V a position and layer.
    assert recent["kept"] == [10] * 30
    assert recent["bytes"] == [{"kind": "full", "layers": 30, "exact": 30 * 19 * 1536,
                                "held": 30 * 10 * (1536 + 24)}]
    assert recent["kl_mean"] > 0.1 and recent["matching"] < 8
    assert whole["continuation"]["tokens"] == out["exact"]["tokens"] and whole["matching"] == 8
    assert whole["kl_max"] < 1e-6 and whole["top1_agreement"] == 1.0
