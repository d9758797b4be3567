"""Prompt compression at prefill (snapkv, knorm, recent): the grammar and its refusals, the
per-layer budgets, what each kind keeps, the bytes really freed, grouped-query attention,
the eval protocol and the retrieval task's plumbing."""

from __future__ import annotations

import pytest
import torch
from bytecheckpoint import write_byte_checkpoint
from typer.testing import CliRunner

from kvcache_cli.caches import RollbackError, make_cache
from kvcache_cli.caches.base import CacheShape
from kvcache_cli.caches.compressed import KnormCache, RecentCache, SnapKVCache
from kvcache_cli.caches.grammar import CacheSpecError
from kvcache_cli.caches.spec import check_prompt, layer_bytes, parse_cache_spec
from kvcache_cli.caches.spec_bounded import layer_budgets
from kvcache_cli.cli import app
from kvcache_cli.models.gpt2 import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = GPTConfig(block_size=96, vocab_size=96, n_layer=3, n_head=4, n_embd=32)
# float64: the same arithmetic in two caches agrees to rounding noise.
EXACT = 1e-12


def model64() -> GPT:
    return GPT(CONFIG, init_std=0.3, seed=0).double().eval()


def ids(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG.vocab_size, (1, n), generator=g)  # (1, n)


# ---------------------------------------------------------------------------- the grammar


@pytest.mark.parametrize("text, canonical", [
    ("snapkv:256", "snapkv:256:w32:k7:max"),
    ("SNAPKV:0.25", "snapkv:0.25:w32:k7:max"),
    ("snapkv:16", "snapkv:16:w16:k7:max"),  # the window is part of the budget
    ("snapkv:64:w8:k5:avg:pyramid", "snapkv:64:w8:k5:avg:pyramid"),
    ("knorm:0.5", "knorm:0.5"),
    ("knorm:32:pyramid", "knorm:32:pyramid"),
    ("recent:64:s4", "recent:64:s4"),
])
def test_a_budget_in_tokens_or_a_ratio_parses_to_its_canonical_spelling(text, canonical):
    spec = parse_cache_spec(text)
    assert str(spec) == canonical and parse_cache_spec(canonical) == spec


@pytest.mark.parametrize("text, message", [
    ("snapkv:0", "a budget of 0 keeps no key"),
    ("snapkv:0.0", "ratio '0.0' is outside \\(0, 1\\]"),
    ("knorm:1.5", "ratio '1.5' is outside \\(0, 1\\]"),
    ("recent:-0.5", "ratio '-0.5' is outside"),
    ("snapkv", "expected snapkv:B, the keys kept per layer and head"),
    ("snapkv:16:w32", "always keeps its observation window of 32 tokens, more than the "
                      "budget of 16"),
    ("recent:4:s8", "always keeps its sinks of 8 tokens"),
    ("snapkv:64:k6", "pooling kernel 6 is even"),
    ("snapkv:64:q3", "unknown field 'q3'; expected wN \\(window\\), kN \\(kernel\\)"),
    ("knorm:64:pyramid:uniform", "layers given twice"),
])
def test_a_bad_budget_is_refused_in_one_line(text, message):
    with pytest.raises(CacheSpecError, match=message) as error:
        parse_cache_spec(text)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("text, prompt, message", [
    ("snapkv:300", 256, "keeps 300 keys of a prompt of 256 tokens"),
    ("snapkv:0.5:w300", 256, "observation window of 300 tokens is longer than the prompt"),
    ("recent:0.5:s40", 32, "sinks of 40 tokens is longer than the prompt of 32"),
])
def test_a_prompt_the_budget_cannot_fill_is_refused(text, prompt, message):
    with pytest.raises(CacheSpecError, match=message):
        check_prompt(parse_cache_spec(text), prompt)
    check_prompt(parse_cache_spec("static"), 1)  # a kind that keeps the prompt: no check


# ---------------------------------------------------------------------------- budgets


@pytest.mark.parametrize("budget, prompt, layers", [("256", 1000, 30), ("900", 1000, 30),
                                                    ("0.25", 1000, 7), ("16:w4", 64, 4)])
def test_pyramid_budgets_shrink_with_depth_and_keep_the_uniform_total(budget, prompt, layers):
    spec = parse_cache_spec(f"snapkv:{budget}:pyramid")
    pyramid = layer_budgets(dict(spec.params), prompt, layers)
    uniform = layer_budgets(dict(parse_cache_spec(f"snapkv:{budget}").params), prompt, layers)
    assert len(set(uniform)) == 1 and sum(pyramid) == sum(uniform)
    assert list(pyramid) == sorted(pyramid, reverse=True) and pyramid[0] > pyramid[-1]
    assert max(pyramid) <= prompt and min(pyramid) >= min(spec["window"], uniform[0])


def test_pyramid_budgets_stay_flat_when_the_window_fills_the_budget():
    params = dict(parse_cache_spec("snapkv:8:pyramid").params)  # w8: the window is all of it
    assert layer_budgets(params, 64, 4) == (8, 8, 8, 8)


def test_a_ratio_keeps_its_share_of_the_prompt():
    assert layer_budgets(dict(parse_cache_spec("knorm:0.25").params), 1000, 2) == (250, 250)
    # A prompt shorter than a token budget is kept whole (generate, serve); eval refuses it.
    assert layer_budgets(dict(parse_cache_spec("knorm:64").params), 20, 2) == (20, 20)


# ---------------------------------------------------------------------------- bytes


@pytest.mark.parametrize("text", ["snapkv:8", "snapkv:0.25:pyramid", "knorm:10",
                                  "recent:0.5:s2", "snapkv:40:w4"])
def test_bytes_held_equal_the_specs_formula_and_fall_with_the_budget(text):
    model, x = model64(), ids(40)
    cache, exact = make_cache(text, model, 40), make_cache("static", model, 40)
    with torch.no_grad():
        model(x, 0, cache)
        model(x, 0, exact)
    c = CONFIG
    formula = c.n_layer * layer_bytes(parse_cache_spec(text), 40, c.n_head, c.head_size, 8)
    assert cache.bytes_held == formula
    kept = sum(cache.budgets) / c.n_layer
    # K and V at 8 bytes an element, and an int64 position per kept key and head.
    assert formula == c.n_layer * kept * c.n_head * (2 * c.head_size * 8 + 8)
    if kept < 40:
        assert cache.bytes_held < exact.bytes_held


# ---------------------------------------------------------------------------- what is kept


@pytest.mark.parametrize("text", ["snapkv:24", "knorm:24", "recent:24", "snapkv:1.0"])
def test_a_budget_of_the_whole_prompt_decodes_the_exact_caches_logits(text):
    model, x = model64(), ids(36, seed=3)
    logits = {}
    for spec in ("static", text):
        cache = make_cache(spec, model, 36)
        with torch.no_grad():
            steps = [model(x[:, :24], 0, cache)]
            steps += [model(x[:, p:p + 1], p, cache) for p in range(24, 36)]
        logits[spec] = torch.cat(steps, dim=1)
    assert logits["static"].abs().max() > 1
    assert (logits[text] - logits["static"]).abs().max().item() <= EXACT


def test_a_smaller_budget_changes_the_decoded_logits():
    model, x = model64(), ids(36, seed=3)
    out = {}
    for spec in ("static", "snapkv:8"):
        cache = make_cache(spec, model, 36)
        with torch.no_grad():
            model(x[:, :24], 0, cache)
            out[spec] = torch.cat([model(x[:, p:p + 1], p, cache) for p in range(24, 36)], 1)
    assert (out["snapkv:8"] - out["static"]).abs().max().item() > 1e-3


def test_kept_keys_are_the_prompts_keys_at_their_text_positions():
    model, x = model64(), ids(30, seed=4)
    cache, exact = make_cache("snapkv:10:w3", model, 34), make_cache("static", model, 34)
    with torch.no_grad():
        model(x, 0, cache)
        model(x, 0, exact)
        assert not cache.wants_attention  # decoding runs without explicit weights
        model(ids(1, seed=5), 30, cache)
    for layer in range(CONFIG.n_layer):
        pos = cache.key_positions(layer)  # (B, nkv, 10 + 1)
        assert pos.shape == (1, CONFIG.n_head, 11) and (pos[..., -1] == 30).all()
        kept = pos[..., :10]
        assert (kept[..., -3:] == torch.arange(27, 30)).all()  # the observation window
        hs = CONFIG.head_size
        want = exact.k[layer][:, :, :30].gather(2, kept[..., None].expand(-1, -1, -1, hs))
        # Past layer 0 the prompt's explicit softmax and the exact cache's SDPA differ by
        # float64 rounding; the keys are the same keys.
        torch.testing.assert_close(cache.k[layer][:, :, :10], want, rtol=0, atol=EXACT)


SHAPE = CacheShape(n_layer=1, n_kv_head=2, head_size=4, context=64)


def _prompt_kv(T: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn((1, 2, T, 4), generator=g)  # (B, nkv, T, hs)
    return k, torch.randn((1, 2, T, 4), generator=g)


def test_snapkv_keeps_per_kv_head_what_the_window_attends_and_its_neighbours():
    T = 20
    cache = SnapKVCache(SHAPE, dict(parse_cache_spec("snapkv:7:w2:k3").params), T, 1, "cpu",
                        torch.float32, "snapkv")
    k, v = _prompt_kv(T)
    cache.update(0, 0, k, v)
    weights = torch.full((1, 2, T, T), 1e-3)  # (B, nkv, T, S)
    weights[0, 0, -2:, 5] = 0.9  # KV head 0's group attends key 5, head 1's key 12
    weights[0, 1, -2:, 12] = 0.9
    weights[0, 1, :-2, 3] = 0.9  # what the queries outside the window pay is ignored
    cache.observe(0, weights)
    pos = cache.pos[0][0, :, :7]  # (nkv, 7)
    # Max pooling (kernel 3) lifts 5's neighbours to its score; then the window 18, 19.
    assert set(pos[0].tolist()) >= {4, 5, 6, 18, 19}
    assert set(pos[1].tolist()) >= {11, 12, 13, 18, 19} and 3 not in pos[1].tolist()


def test_knorm_keeps_the_keys_of_lowest_norm():
    T = 12
    cache = KnormCache(SHAPE, dict(parse_cache_spec("knorm:3").params), T, 1, "cpu",
                       torch.float32, "knorm")
    k, v = _prompt_kv(T)
    k[0, :, [2, 7, 9]] *= 1e-3
    returned, _ = cache.update(0, 0, k, v)
    assert torch.equal(returned, k)  # the prompt attends over all of itself
    assert cache.pos[0][0].tolist() == [[2, 7, 9], [2, 7, 9]]


def test_recent_keeps_the_sinks_and_the_newest_keys():
    cache = RecentCache(SHAPE, dict(parse_cache_spec("recent:5:s2").params), 12, 1, "cpu",
                        torch.float32, "recent")
    cache.update(0, 0, *_prompt_kv(12))
    assert cache.pos[0][0, 0].tolist() == [0, 1, 9, 10, 11]


def test_grouped_query_attention_compresses_per_kv_head():
    from kvcache_cli.models.llama import Llama, LlamaConfig, init_random

    config = LlamaConfig(n_layer=2, n_head=6, n_kv_head=2, n_embd=48, intermediate=64,
                         vocab_size=96, context=64)
    model = init_random(Llama(config), 0.3, 0).double().eval()
    cache = make_cache("snapkv:8:w2", model, 40)
    with torch.no_grad():
        model(ids(32), 0, cache)
        logits = model(ids(1, seed=1), 32, cache)
    assert torch.isfinite(logits).all()
    pos = cache.key_positions(0)
    assert pos.shape == (1, 2, 9)  # each of the 2 KV heads its own 8 keys, then the new one
    assert not torch.equal(pos[0, 0], pos[0, 1])


def test_a_crop_into_the_compressed_prompt_is_refused_in_one_line():
    model = model64()
    cache = make_cache("snapkv:8", model, 40)
    with torch.no_grad():
        model(ids(30), 0, cache)
        model(ids(4, seed=1), 30, cache)
    cache.crop(31)  # the appended tokens roll back
    assert cache.length == 31
    with pytest.raises(RollbackError, match="prompt's 30 tokens were compressed") as error:
        cache.crop(20)
    assert "\n" not in str(error.value)


# ---------------------------------------------------------------------------- eval


def test_eval_times_the_compression_and_scores_it_against_the_exact_cache():
    from kvcache_cli.eval.quality import evaluate

    model, x = model64(), ids(60, seed=2)[0].tolist()
    result = evaluate(model, x, ["snapkv:0.25", "recent:0.25"], prompt_len=40)
    exact, snap = result.cache("static"), result.cache("snapkv:0.25:w32:k7:max")
    assert exact.compress_ms == 0 and 0 < snap.compress_ms < snap.prefill_ms
    assert snap.kl_mean > 0 and snap.bytes_held < exact.bytes_held
    # Its prefill's prediction is the exact one: the prompt attends over all of itself.
    assert snap.loss_by_position[0] == pytest.approx(exact.loss_by_position[0], abs=1e-9)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    text = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n" * 8
    return write_byte_checkpoint(tmp_path_factory.mktemp("bytes"), 256, 64, text)


@pytest.mark.parametrize("cache, message", [
    ("snapkv:100", "error: cache 'snapkv:100:w32:k7:max' keeps 100 keys of a prompt of 64"),
    ("snapkv:0.5:w80", "observation window of 80 tokens is longer than the prompt of 64"),
    ("knorm:0", "a budget of 0 keeps no key"),
    ("recent:2.5", "ratio '2.5' is outside \\(0, 1\\]"),
])
def test_eval_refuses_a_budget_the_prompt_cannot_fill_in_one_line(checkpoint, cache, message,
                                                                   no_model_loads):
    result = CliRunner().invoke(app, ["eval", "-m", str(checkpoint), "--cache", cache,
                                      "--prompt-len", "64", "--tokens", "100"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1
    import re
    assert re.search(message, lines[0]), lines[0]


# ---------------------------------------------------------------------------- retrieval


def test_the_key_sits_at_its_depth_and_the_question_ends_the_message():
    from kvcache_cli.eval.retrieval import FILLER, QUESTION, message

    first, last = message(10, 0.0, "12345"), message(10, 1.0, "12345")
    assert first.index("12345") < first.index(FILLER)
    assert last.rindex(FILLER) < last.index("12345")
    assert last.endswith(QUESTION.strip()) and first.count(FILLER) == 10


def test_cases_cover_every_length_and_depth_with_distinct_keys():
    from kvcache_cli.eval.retrieval import FILLER, cases

    # Bytes as tokens: a filler of 92 bytes, so 920 tokens of filler are 10 of them.
    got = cases([920, 1840], lambda s: list(s.encode()), depths=(0.0, 0.5, 1.0), per_cell=2)
    assert len(got) == 12 and len({c.key for c in got}) == 12
    assert [c.message.count(FILLER) for c in (got[0], got[-1])] == [10, 20]


@pytest.mark.parametrize("reply, correct", [
    ("The pass key is 12345.", True), ("12345", True), ("It is 1234.", False),
    ("The pass key is 54321. Not 12345.", False), ("I do not know.", False)])
def test_a_reply_is_correct_when_its_first_number_is_the_key(reply, correct):
    from kvcache_cli.eval.retrieval import is_correct

    assert is_correct(reply, "12345") is correct


def test_retrieval_runs_every_cache_on_the_same_prompts():
    from kvcache_cli.eval.retrieval import Prompter, run_retrieval

    model = model64()
    prompter = Prompter("test", lambda s: [b % CONFIG.vocab_size for b in s.encode()][-60:],
                        lambda t: " ".join(map(str, t)), lambda m: m, ())
    result = run_retrieval(model, prompter, ["snapkv:0.5", "recent:0.5"], [20],
                           depths=(0.0, 1.0), per_cell=1)
    assert [s.cache for s in result.scores] == ["static", "snapkv:0.5:w32:k7:max",
                                                 "recent:0.5"]
    assert len(result.answers) == 6
    snap = result.score("snapkv:0.5:w32:k7:max")
    assert snap.bytes_ratio < 1 and snap.compress_ms > 0 and result.score("static").compress_ms == 0


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory):
    return write_byte_checkpoint(tmp_path_factory.mktemp("bytes512"), 512, 64, "text " * 50)


def test_eval_task_retrieval_prints_one_row_per_cache_as_json(long_checkpoint):
    import json

    result = CliRunner().invoke(app, ["eval", "-m", str(long_checkpoint), "--task",
                                      "retrieval", "--lengths", "40", "--cache",
                                      "snapkv:0.5", "--json"])
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)  # progress lines, on a slow run, go to stderr
    assert [s["cache"] for s in got["scores"]] == ["static", "snapkv:0.5:w32:k7:max"]
    assert len(got["answers"]) == 2 * 10  # 5 depths x 2 keys, each cache
    assert got["scores"][1]["bytes_ratio"] < 1


@pytest.mark.parametrize("args, message", [
    (["--lengths", "0"], "--lengths '0': expected filler lengths in tokens"),
    (["--lengths", "a,b"], "--lengths 'a,b': expected"),
    (["--lengths", "2000"], "pass the model's context window of 512 positions"),
    (["--lengths", "40", "--cache", "snapkv:400"], "keeps 400 keys of a prompt of"),
])
def test_eval_task_retrieval_refuses_bad_input_in_one_line(long_checkpoint, args, message,
                                                           no_model_loads):
    result = CliRunner().invoke(app, ["eval", "-m", str(long_checkpoint), "--task",
                                      "retrieval", *args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_eval_task_retrieval_prints_its_table_and_writes_its_plot(long_checkpoint, tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "retrieval.png"
    result = CliRunner().invoke(app, ["eval", "-m", str(long_checkpoint), "--task",
                                      "retrieval", "--lengths", "40", "--cache",
                                      "knorm:0.5", "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    # Split into blocks of columns that fit the width, each headed by "cache".
    headers = [line for line in result.output.splitlines() if line.startswith("cache")]
    assert headers[0].split()[:3] == ["cache", "accuracy", "@0%"]
    assert any("compress %" in header for header in headers)
    assert any(line.startswith("knorm:0.5 ") for line in result.output.splitlines())
    assert plot.stat().st_size > 0
