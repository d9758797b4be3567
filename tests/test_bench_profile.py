"""`kvcache bench --profile`: one decode step of the static loop split by kind of op, in
the format asked for, the step against its parts replayed alone (the replay makes the
step's own calls), and bad input refused in one line. Timings are never compared."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from gemmakit import random_gemma3
from llamakit import tiny_hf, write_tiny_gguf
from typer.testing import CliRunner

from kvcache_cli.bench.profile import ORDER, on_cache, recording, replay
from kvcache_cli.caches import make_cache
from kvcache_cli.cli import app
from kvcache_cli.generate import stream_tokens
from kvcache_cli.measure import linears
from kvcache_cli.models import load_model, set_weights_dtype
from kvcache_cli.models.linear import arrange_weights

pytestmark = pytest.mark.usefixtures("one_torch_thread")
runner = CliRunner()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=96, n_positions=64,
                        initializer_range=0.3)
    path = tmp_path_factory.mktemp("tiny")
    GPT2LMHeadModel(config).save_pretrained(path)
    return path


def _bench(*args: str):
    return runner.invoke(app, ["bench", "--profile", *args], env={"COLUMNS": "100"})


@pytest.mark.parametrize("fmt, weights, dtype, shown", [
    ([], "fp32", "fp32", "fp32: step"),
    (["--weights-dtype", "int8"], "int8", "fp32", "int8: step"),
    (["--dtype", "bf16", "--weights-dtype", "int8"], "int8", "bf16", "bf16+int8: step"),
])
def test_profile_splits_a_decode_step_by_kind_of_op_in_the_format_asked(checkpoint, fmt,
                                                                         weights, dtype, shown):
    args = ["-m", str(checkpoint), "--new-tokens", "4", "--threads", "1", *fmt]
    result = _bench(*args, "--json")
    assert result.exit_code == 0, result.output
    p = json.loads(result.stdout)
    assert (p["weights"], p["dtype"], p["steps"], p["threads"]) == (weights, dtype, 4, 1)
    split = dict(p["split_ms"])
    assert list(split) == list(ORDER) and all(ms >= 0 for ms in split.values())
    # The products are seen (the native kernel's calls too, named while profiled), and the
    # parts cover the step: the rest of the wall time is Python's.
    assert split["products"] > 0 and split["attention"] > 0 and p["ops_per_step"] > 0
    assert sum(split.values()) >= p["step_ms"] * 0.999
    text = _bench(*args)
    assert text.exit_code == 0, text.output
    first, second, third = text.stdout.strip().splitlines()
    assert first.endswith("1 threads, ms a decode step (share), 4 steps profiled")
    assert second.startswith(shown) and "products " in second and "Python and dispatch" in second
    assert third.startswith("alone, medians of 4 interleaved: step ") and "the rest " in third


def test_profile_times_the_step_against_its_parts_alone_with_consistent_fields(checkpoint):
    result = _bench("-m", str(checkpoint), "--new-tokens", "3", "--threads", "1", "--json")
    assert result.exit_code == 0, result.output
    t = json.loads(result.stdout)["parts"]
    # 2 layers: 4 matrices each and the head; one attention call a layer
    assert (t["repeats"], t["product_calls"], t["attention_calls"]) == (3, 9, 2)
    assert t["step_ms"] > 0 and t["products_ms"] > 0 and t["attention_ms"] > 0
    assert t["rest_ms"] == pytest.approx(t["step_ms"] - t["products_ms"] - t["attention_ms"])
    # GPT-2's float32 matrices and biases: c_attn, c_proj, c_fc, mlp.c_proj, then the head
    C, V = 32, 96
    per_layer = (C * 3 * C + 3 * C) + (C * C + C) + (C * 4 * C + 4 * C) + (4 * C * C + C)
    assert t["product_bytes"] == 4 * (2 * per_layer + V * C)
    assert t["product_gbps"] == pytest.approx(t["product_bytes"] / t["products_ms"] / 1e6)
    assert t["limit_probe"] in ("read", "copy") and t["limit_gbps"] > 0
    assert t["product_share"] == pytest.approx(t["product_gbps"] / t["limit_gbps"])
    # GPT-2's blocks are torch ops: its step is not replayed, and the reason is given
    assert t["replayed_step_ms"] is None and "the step runs torch's" in t["not_replayed"]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_profile_times_a_replayed_step_beside_the_eager_one(request, family):
    from kvcache_cli.bench.profile import profile_step
    from kvcache_cli.views.bench import profile_view

    model = _model(request, family)  # Gemma 3's rings of 4 wrap: each decodes in one call
    p = profile_step(model, 3, f"tiny {family}", "fp32", prompt_len=8)
    t = p.parts
    assert t.replayed_step_ms > 0 and t.not_replayed is None
    assert profile_view(p).splitlines()[-1].startswith("replayed: step ")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return write_tiny_gguf(tiny_hf(), tmp_path_factory.mktemp("llama") / "tiny.gguf")


def _model(request, family: str):
    if family == "gemma3":  # sliding layers of a window of 4: the prompt wraps their rings
        return arrange_weights(random_gemma3(window=4))
    fixture = {"gpt2": "checkpoint", "llama": "tiny_llama"}[family]
    return load_model(str(request.getfixturevalue(fixture))).model


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma3"])
@pytest.mark.parametrize("weights", ["fp32", "fp16", "int8"])
def test_replay_makes_the_steps_own_calls_outputs_equal(request, family, weights):
    model = _model(request, family)
    set_weights_dtype(model, weights)
    prompt = [5, 17, 3, 40, 8]
    with torch.inference_mode():
        cache = make_cache("static", model, max_len=len(prompt) + 4, batch=1)
        tokens = stream_tokens(model, prompt, 4, "static", cache=cache)
        kept = [next(tokens)]
        before = copy.deepcopy(cache)
        with recording(model, cache) as (products, attention):
            kept.append(next(tokens))
        kept += list(tokens)  # the steps after it: recording left the model as it was
        unrecorded = list(stream_tokens(model, prompt, 4, "static"))
        # Replayed after later steps: the products on their recorded rows, the attention
        # on the cache as the recorded step met it.
        outputs = replay(products), replay(on_cache(attention, before))
    assert kept == unrecorded and len(set(unrecorded)) > 1, unrecorded
    n_layer = model.config.n_layer
    assert len(products) == len(linears(model)) == 4 * n_layer + 1  # each matrix once
    assert len(attention) == n_layer
    # The same kernels on the same inputs: bit for bit what the step computed.
    for calls, replayed in zip((products, attention), outputs, strict=True):
        for call, y in zip(calls, replayed, strict=True):
            assert y.shape == call.output.shape and torch.equal(y, call.output)


@pytest.mark.parametrize("args, said", [
    (["--plot", "p.png"], "--plot does not apply with --profile"),
    (["--draft", "lookup"], "--draft does not apply with --profile"),
    (["--modes", "static"], "--modes does not apply with --profile"),
    (["--new-tokens", "0"], "--new-tokens '0' is not a whole number from 1 to 10,000"),
    (["--new-tokens", "64"], "past context window 64"),
    (["--new-tokens", "16"], "--profile runs 34 tokens for --new-tokens 16"),
    (["--threads", "0"], "--threads 0: expected a whole number from 1 to 1,024"),
    (["--weights-dtype", "int3"], "int3"),
])
def test_profile_refuses_bad_input_in_one_line_exit_2(checkpoint, no_model_loads, args, said):
    result = _bench("-m", str(checkpoint), *args)
    assert result.exit_code == 2 and said in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
