"""`eval` on Gemma 3: what the cuts cost on a model with sliding layers, on a tiny random
Gemma 3 (two sliding layers of window 16 to one global, 6 layers): quantised caches on the
global layers only and on every layer (`--sliding model,full`), windows and sinks on the
global layers, SnapKV at prefill, bytes per layer kind; transformers' QuantizedCache refused
as a row with its reason. llama.cpp's rows on the real file where llama-cpp-python is."""

from __future__ import annotations

import math

import gemmakit
import pytest
import torch
from test_gemma3_breaks import tiny

from kvcache_cli.caches.spec import parse_cache_spec
from kvcache_cli.eval import quality
from kvcache_cli.eval.quality import ALL_LAYERS

pytestmark = pytest.mark.usefixtures("one_torch_thread")
W, N, PROMPT = 16, 64, 24
SLIDING, FULL = 4, 2  # layers of each kind in the tiny model
POSITION = 2 * 32 * 4  # float32 k and v of one KV head of 32: bytes a position a layer
I8 = "int8:g32:ktok:r0"  # int8's canonical spelling, the row's name


@pytest.fixture(scope="module")
def model():
    return tiny(W)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 97, (N,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture(scope="module")
def result(model, ids):
    specs = [parse_cache_spec(s) for s in ("int8", "window:8", "sink:2+6", "snapkv:0.5:w8")]
    runs = quality.with_sliding(specs[:3], ["model", "full"]) + specs[3:]
    return quality.evaluate(model, ids, runs, prompt_len=PROMPT)


def test_the_reference_holds_rings_on_the_sliding_layers_and_everything_on_the_global(result):
    ref = result.cache("static")
    held = N - 1
    assert ref.bytes_by_kind == {"sliding": SLIDING * W * POSITION, "full": FULL * held * POSITION}
    assert ref.bytes_held == sum(ref.bytes_by_kind.values())


def test_int8_on_every_layer_holds_every_position_on_the_sliding_ones(result):
    global_only, everywhere = result.cache(I8), result.cache(f"{I8}{ALL_LAYERS}")
    ref = result.cache("static")
    assert global_only.bytes_by_kind["sliding"] == ref.bytes_by_kind["sliding"]  # float rings
    assert global_only.bytes_by_kind["full"] < ref.bytes_by_kind["full"]
    # int8 codes of all 63 positions on the sliding layers: more than float rings of 16
    assert everywhere.bytes_by_kind["sliding"] > ref.bytes_by_kind["sliding"]
    assert everywhere.bytes_by_kind["full"] == global_only.bytes_by_kind["full"]
    assert everywhere.kl_mean > global_only.kl_mean > 0


def test_a_window_and_sinks_cut_the_global_layers_only(result):
    ref = result.cache("static")
    for name in ("window:8", "sink:2+6"):
        row = result.cache(name)
        assert row.bytes_by_kind == {"sliding": ref.bytes_by_kind["sliding"],
                                     "full": FULL * 8 * POSITION}, name
        assert row.kl_mean > 0
    # on every layer the same bound also cuts the sliding layers' 16 to 8
    assert result.cache(f"window:8{ALL_LAYERS}").bytes_by_kind["sliding"] == SLIDING * 8 * POSITION


def test_snapkv_compresses_the_global_layers_at_prefill(result):
    row, ref = result.cache("snapkv:0.5:w8:k7:max"), result.cache("static")
    assert row.compress_ms > 0  # the hybrid's global cache compressed the prompt
    assert row.bytes_by_kind["sliding"] == ref.bytes_by_kind["sliding"]
    assert row.bytes_by_kind["full"] < ref.bytes_by_kind["full"]
    assert row.loss_by_position[0] == pytest.approx(ref.loss_by_position[0], abs=1e-4)


@pytest.mark.parametrize("name", ["snapkv:0.5:w8", "h2o:8+8"])
def test_a_kind_that_chooses_by_attention_runs_on_every_layer_seeing_the_banded_weights(
        model, ids, name):
    # On every layer a sliding layer's band is applied around the kind, which is still shown
    # the weights it ranks keys by: it cuts the sliding layers' history as it cuts the global.
    runs = quality.with_sliding([parse_cache_spec(name)], ["full"])
    row = quality.evaluate(model, ids, runs, prompt_len=PROMPT).cache(runs[0].name)
    held = N - 1
    assert row.bytes_by_kind["sliding"] < SLIDING * held * POSITION
    assert row.bytes_by_kind["full"] < FULL * held * POSITION
    assert math.isfinite(row.kl_mean) and row.kl_mean > 0


def test_the_first_token_share_is_zero_where_the_window_has_passed_it(result):
    # Every scored query sits past the window of 16: a sliding layer cannot see token 0.
    shares = result.first_token_share
    assert [shares[i] for i in (0, 1, 3, 4)] == [0.0] * SLIDING
    assert shares[2] > 0 and shares[5] > 0


def test_transformers_refuses_its_quantised_cache_as_a_row_with_its_reason(model, ids):
    pytest.importorskip("optimum.quanto")
    from kvcache_cli.eval import peer_hf
    from kvcache_cli.eval.peer_hf import parse_transformers

    specs = [parse_transformers("transformers:quanto-int4")]
    rows = peer_hf.evaluate(model, ids[:40], specs, prompt_len=PROMPT)
    refused = peer_hf.refusals(model, specs)
    assert [r.cache for r in rows] == [peer_hf.REFERENCE]  # its DynamicCache ran
    assert rows[0].bytes_by_kind["full"] == FULL * 39 * POSITION
    assert rows[0].bytes_by_kind["sliding"] < SLIDING * 39 * POSITION  # windows held
    assert len(refused) == 1 and refused[0].peer == "transformers"
    assert "sliding_attention" in refused[0].reason and "\n" not in refused[0].reason


def test_a_saved_json_with_refusals_and_kinds_reads_back(result):
    import dataclasses
    import json

    from kvcache_cli.eval.quality import Refusal, result_from_json
    from kvcache_cli.views import to_json

    with_refusal = dataclasses.replace(result, refused=(Refusal("t:x", "transformers", "no"),))
    back = result_from_json(json.loads(to_json(with_refusal)))
    assert back.refused == with_refusal.refused
    assert back.cache(I8).bytes_by_kind == result.cache(I8).bytes_by_kind


def test_the_plain_view_has_a_column_per_layer_kind_and_the_refusals(result):
    import dataclasses

    from kvcache_cli.eval.quality import Refusal
    from kvcache_cli.views.quality import KINDS, plain

    text = plain(dataclasses.replace(result, refused=(Refusal("t:x", "transformers", "no"),)),
                 200)
    assert KINDS in text and "t:x: refused by transformers: no" in text


def test_sliding_full_on_a_model_without_sliding_layers_is_one_line_exit_2():
    from typer.testing import CliRunner

    from kvcache_cli.cli import app

    result = CliRunner().invoke(app, ["eval", "-m", "stdlib-bytes", "--sliding", "full"])
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and "has no sliding-window layers" in result.stderr


@pytest.mark.parametrize("value", ["ring", "model,model", ""])
def test_an_unknown_sliding_choice_is_one_line_exit_2(value):
    from typer.testing import CliRunner

    from kvcache_cli.cli import app

    result = CliRunner().invoke(app, ["eval", "-m", "stdlib-bytes", "--sliding", value])
    assert result.exit_code == 2, result.output
    assert "expected model, full or model,full" in result.stderr


def test_llama_cpp_counts_every_layer_kind_at_full_length_on_the_real_file():
    pytest.importorskip("llama_cpp")
    from kvcache_cli.eval.peer_llama_cpp import evaluate, parse_llama_cpp
    from kvcache_cli.models import model_config

    path = gemmakit.gemma3_or_skip()
    config = model_config(str(path))
    ids = [2] + list(range(1000, 1100))  # <bos>, then 100 ids
    rows = evaluate(str(path), ids, [parse_llama_cpp("llama.cpp:q8_0")], config,
                    prompt_len=32)
    ref, q8 = rows
    assert ref.bytes_by_kind == {"sliding": 15 * 100 * 2 * 256 * 4, "full": 3 * 100 * 2 * 256 * 4}
    assert q8.bytes_held < ref.bytes_held and not math.isnan(q8.kl_mean)


def test_sliding_with_the_retrieval_task_is_one_line_exit_2():
    from typer.testing import CliRunner

    from kvcache_cli.cli import app

    result = CliRunner().invoke(app, ["eval", "--task", "retrieval", "--sliding", "full"])
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and "applies to --task text only" in result.stderr


def test_a_cache_on_every_layer_is_named_by_its_row_where_caches_are_listed():
    # eval's progress lists the caches it scores by str(): a row's name, not a repr.
    (maker,) = quality.with_sliding([parse_cache_spec("int8")], ["full"])
    assert str(maker) == f"{I8}{ALL_LAYERS}"
