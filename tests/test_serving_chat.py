"""serve's chat workload: prompts through a chat template sharing one system prompt,
replies that end at a stop token in every engine, the system prompt's prefix-cache hit
rate, the pool under GQA replayed, and the refusals of a chat workload that cannot run.
Timings are never asserted."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
import servingkit
from llamakit import CHAT_TEMPLATE, tiny_hf, write_tiny_gguf
from servingkit import ROOMY, TIGHT
from servingkit import serve_cli as _cli
from servingkit import tiny_model as _model

from kvcache_cli.serving import chat, gqa_pool
from kvcache_cli.serving import engines as E
from kvcache_cli.serving import plan as serving_plan
from kvcache_cli.serving.sequence import Request
from kvcache_cli.serving.workload import WorkloadSpec

pytestmark = pytest.mark.usefixtures("one_torch_thread")
checkpoint = servingkit.checkpoint  # the fixture, found by its name in this module


def _chat_spec(requests, shared: int, cap: int) -> WorkloadSpec:
    users = [len(r.prompt) - shared for r in requests]
    return WorkloadSpec(len(requests), (min(users), max(users)), (1, cap), shared, None, 0,
                        kind="chat", stop_ids=requests[0].stop_ids)


def _with_stop(model, n: int = 6, cap: int = 12, shared: int = 9):
    """Requests sharing a prefix, whose stop token is one the model really makes: the token
    at step 3 of request 0's solo run, so some replies stop early and some reach the cap."""
    import random

    rng = random.Random(4)
    prefix = [rng.randrange(model.config.vocab_size) for _ in range(shared)]
    plain = [Request(i, tuple(prefix + [rng.randrange(model.config.vocab_size)
                                        for _ in range(rng.randint(2, 12))]), cap, 0.0)
             for i in range(n)]
    solo = E.solo_tokens(model, plain)
    stop = solo[0][3]
    return tuple(dataclasses.replace(r, stop_ids=(stop,)) for r in plain), stop


# ---------------------------------------------------------------------------- the prompt set


def test_the_shipped_prompt_set_holds_a_few_dozen_user_turns_of_varied_length():
    s = chat.load_set(None)
    words = sorted(len(p.split()) for p in s.prompts)
    assert len(s.prompts) >= 36 and len(set(s.prompts)) == len(s.prompts)
    assert words[0] <= 3 and words[-1] >= 50  # a word to a paragraph
    assert len(s.system.split()) >= 40  # long enough to fill several blocks


def test_a_draw_repeats_no_prompt_until_every_one_has_been_drawn():
    s = chat.ChatSet("sys", tuple(f"q{i}" for i in range(5)), "test")
    drawn = chat.draw(s, 12, seed=1)
    assert sorted(drawn[:5]) == sorted(s.prompts) and sorted(drawn[5:10]) == sorted(s.prompts)
    assert drawn == chat.draw(s, 12, seed=1) and drawn != chat.draw(s, 12, seed=2)


def test_every_chat_prompt_starts_with_the_shared_system_turn():
    # Only what the workload reads of a config; the byte tokenizer: a token a byte.
    config = types.SimpleNamespace(chat_template=CHAT_TEMPLATE, tokenizer="bytes",
                                   eos_ids=(10,))
    c = chat.build(chat.ChatSet("Be brief.", ("hi", "why is the sky blue?"), "t"), config,
                   "tiny", 2, seed=0)
    system = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    assert c.shared_prefix == len(system.encode())
    assert all(p[:c.shared_prefix] == tuple(system.encode()) for p in c.prompts)
    assert c.stop_ids == (10,)


@pytest.mark.parametrize("text, said", [
    ('{"system": 3', "not JSON (line 1"),
    ('{"system": "s", "prompts": []}', "every prompt a non-empty string"),
    ('["a", "b"]', 'expected JSON {"system"'),
])
def test_a_workload_file_that_does_not_parse_is_refused_in_one_line(tmp_path, text, said):
    path = tmp_path / "w.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="--workload") as err:
        chat.load_set(path)
    assert said in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------------------- the engines


def test_every_engine_stops_a_reply_at_its_stop_token_as_its_solo_run_does():
    model = _model()
    requests, stop = _with_stop(model)
    reference = E.solo_tokens(model, requests)
    lengths = [len(t) for t in reference.values()]
    assert min(lengths) < 12 and all(t[-1] == stop for t in reference.values() if len(t) < 12)
    spec = _chat_spec(requests, 9, 12)
    result = E.run_serve(model, spec, ["sequential", "padded", "paged", "hf"], ROOMY,
                         block_size=4, prompts=requests, stop_names=("<stop>",))
    for e in result.engines:
        assert e.requests_exact == len(requests), (e.engine, e.mismatches)
        assert e.output_tokens == sum(lengths), e.engine
    assert result.replies.stopped == sum(1 for n in lengths if n < 12)
    assert result.replies.capped + result.replies.stopped == len(requests)


def test_the_paged_engine_serves_the_shared_prefix_from_the_cache_after_the_first():
    model = _model()
    requests, _ = _with_stop(model, shared=9)  # two full blocks of 4 shared
    result = E.run_serve(model, _chat_spec(requests, 9, 12), ["paged"], ROOMY, block_size=4,
                         prompts=requests)
    assert [e.shared_hit_rate for e in result.engines] == [1.0]
    off = E.run_serve(model, _chat_spec(requests, 9, 12), ["paged"], ROOMY, block_size=4,
                      prompts=requests, prefix_sharing=False)
    assert off.engines[0].shared_hit_rate == 0.0


def test_the_replayed_scheduler_preempts_as_often_as_the_paged_engine_does():
    model = _model()
    requests, _ = _with_stop(model, n=8)
    spec = _chat_spec(requests, 9, 12)
    plan = serving_plan.plan_memory(model.config, model.dtype, spec, TIGHT, 4, 64)
    result, tokens = E.run_engine("paged", model, requests, spec, plan, 4, 64, True,
                                  E.solo_tokens(model, requests))
    replayed = gqa_pool.replay(requests, tokens, plan.n_blocks, 4, 64)
    assert result.preemptions > 0  # the pool is small enough to matter
    assert (replayed.preemptions, replayed.peak_running) == (result.preemptions,
                                                             result.peak_running)


def test_fewer_kv_heads_admit_a_larger_batch_and_preempt_less_in_the_same_pool():
    model = _model()
    requests, _ = _with_stop(model, n=8)
    replies = E.solo_tokens(model, requests)
    # SmolLM2's 46,080 bytes a token against GPT-2 small's 73,728: 1.6x the tokens.
    f = gqa_pool.figures(requests, replies, bytes_per_token=640, gpt2_bytes_per_token=1024,
                         pool_bytes=1 << 20, block_size=4, max_batch=64)
    assert f.tokens_per_mib == 1.6 * f.gpt2_tokens_per_mib
    assert f.at_small.peak_running > f.gpt2_at_small.peak_running
    assert f.at_small.preemptions < f.gpt2_at_small.preemptions


# ---------------------------------------------------------------------------- the CLI


def test_a_chat_workload_for_a_model_without_a_chat_template_is_one_line_exit_2(checkpoint):
    r = _cli("--model", str(checkpoint), "--workload", "chat")
    assert r.exit_code == 2, r.output
    assert "has no chat template" in r.output and "--workload random" in r.output
    assert "Traceback" not in r.output


@pytest.mark.parametrize("args, said", [
    (["--workload", "{missing}.json"], "no such file"),
    (["--workload", "chat", "--prompt-len", "4:8"], "--prompt-len: a chat workload"),
    (["--workload", "chat", "--output-len", "4:8"], "the cap on its length"),
])
def test_a_chat_workload_refuses_what_it_cannot_read_in_one_line(tmp_path, args, said):
    path = write_tiny_gguf(tiny_hf(), tmp_path / "tiny.gguf")
    args = [a.replace("{missing}", str(tmp_path / "none")) for a in args]
    r = _cli("--model", str(path), *args)
    assert r.exit_code == 2, r.output
    assert said in r.output and len(r.output.strip().splitlines()) == 1


def test_a_chat_model_gets_the_chat_workload_by_default(tmp_path):
    path = write_tiny_gguf(tiny_hf(), tmp_path / "tiny.gguf")
    r = _cli("--model", str(path))  # the shipped system prompt, byte by byte, is too long
    assert r.exit_code == 2, r.output
    assert "the longest chat request, a shared system turn of" in r.output


def test_serve_runs_a_chat_workload_file_every_request_exact(tmp_path):
    path = write_tiny_gguf(tiny_hf(), tmp_path / "tiny.gguf")
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps({"system": "Be brief.", "prompts": ["Hi", "Why?", "No"]}))
    r = _cli("--model", str(path), "--workload", str(workload), "--requests", "3",
             "--output-len", "4", "--engines", "sequential,paged", "--policy",
             "prefill-first", "--block-size", "8", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["workload"]["kind"] == "chat" and out["replies"]["cap"] == 4
    assert all(e["requests_exact"] == 3 for e in out["engines"])
    assert out["engines"][1]["shared_hit_rate"] == 1.0
