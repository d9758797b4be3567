"""Decode-first under a token budget, chunked prefill, and vLLM's latency figures.

Exactness first: under every policy, budget and layout, every request gets its solo
greedy tokens, prompts spanning several forwards, with prefix hits, a fully cached
prompt and preemption of a prompt part-way through. Then what a step carries
(decodes first, never over budget, padding never written), the metric definitions
on a timeline made up by hand, the arrivals, and bad input for every new option.
Timings are never asserted.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics

import numpy as np
import pytest
import servingkit
import torch
from servingkit import CONFIG, PNG_SIGNATURE, ROOMY, SPEC, TIGHT
from servingkit import seq as _seq
from servingkit import serve_cli as _cli
from servingkit import tiny_model as _model

from kvcache_cli.caches.paged import PagedCache
from kvcache_cli.models.gpt2 import GPT
from kvcache_cli.serving import engines as E
from kvcache_cli.serving import plan as serving_plan
from kvcache_cli.serving import recorder as serving_recorder
from kvcache_cli.serving.block_manager import BlockManager
from kvcache_cli.serving.metrics import RequestTimes, Stats, parse_goodput, parse_rates, summarise
from kvcache_cli.serving.model_runner import LAYOUTS, ModelRunner
from kvcache_cli.serving.scheduler import Chunk, Scheduler
from kvcache_cli.serving.sequence import Request, Sequence, Status
from kvcache_cli.serving.workload import WorkloadSpec, make_requests

pytestmark = pytest.mark.usefixtures("one_torch_thread")
checkpoint = servingkit.checkpoint  # the fixture, found by its name in this module

BLOCK = 4


def _serve(variant: serving_plan.Variant, kv_mem: int, layout: str = "packed",
           spec: WorkloadSpec = SPEC, sharing: bool = True):
    model = _model()
    requests = make_requests(spec, CONFIG.vocab_size)
    plan = serving_plan.plan_memory(CONFIG, model.dtype, spec, kv_mem, BLOCK, 64)
    reference = E.solo_tokens(model, requests)
    result, tokens = E.run_engine(variant, model, requests, spec, plan, BLOCK, 64, sharing,
                                  reference, layout=layout)
    return result, tokens, reference


# ---------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("variant", [
    serving_plan.Variant("paged", "prefill-first"),
    # one block a forward: every prompt is chunked
    serving_plan.Variant("paged", "decode-first", 4),
    serving_plan.Variant("paged", "decode-first", 12),  # chunks end mid-block
    serving_plan.Variant("paged", "decode-first", 256),  # several whole prompts share a forward
], ids=lambda v: v.name if isinstance(v, serving_plan.Variant) else v)
@pytest.mark.parametrize("kv_mem", [ROOMY, TIGHT], ids=["roomy", "tight"])
def test_every_policy_budget_and_layout_gives_every_request_its_solo_tokens(
        variant, layout, kv_mem):
    result, tokens, reference = _serve(variant, kv_mem, layout)
    assert len({t for ts in reference.values() for t in ts}) > 5  # the tokens vary
    assert tokens == reference, result.mismatches
    assert result.requests_exact == SPEC.requests
    if kv_mem == TIGHT:
        assert result.preemptions > 0  # recomputation ran, chunk by chunk under decode-first


def test_a_small_budget_splits_prompts_across_forwards_and_never_exceeds_itself():
    result, tokens, reference = _serve(serving_plan.Variant("paged", "decode-first", 4), ROOMY)
    assert tokens == reference
    prompt = sum(len(r.prompt) for r in make_requests(SPEC, CONFIG.vocab_size))
    # Every prompt token computed once, less the prefix hits: more forwards than prompts.
    assert result.steps.prompt_tokens == prompt - result.prefix_blocks_hit * BLOCK
    assert result.steps.forwards > SPEC.requests
    assert result.steps.budget_fill <= 1.0 and result.steps.tokens_per_forward <= 4


def test_decode_first_never_stalls_a_decode_and_prefill_first_does():
    first, _, _ = _serve(serving_plan.Variant("paged", "prefill-first"), ROOMY)
    budget, _, _ = _serve(serving_plan.Variant("paged", "decode-first", 8), ROOMY)
    # All 6 arrive at once and are admitted together: prompt k's forward keeps the k
    # prompts before it waiting for their second token, 0 + 1 + ... + 5 in all.
    assert first.steps.stalled >= 15 and budget.steps.stalled == 0
    assert budget.steps.budget_fill is not None and first.steps.budget_fill is None
    assert budget.steps.decode_tokens == first.steps.decode_tokens  # the same outputs


def test_prefix_hits_survive_chunk_boundaries():
    # A 10-token shared prefix, blocks of 4, a budget of 6: the first request's prefix
    # blocks are entered when scheduled, chunk by chunk, and later requests hit them.
    result, tokens, reference = _serve(serving_plan.Variant("paged", "decode-first", 6), ROOMY)
    assert tokens == reference
    assert result.prefix_blocks_hit >= 2 * (SPEC.requests - 1)  # 2 full blocks each


def test_a_fully_cached_prompt_still_computes_its_last_token_under_decode_first():
    model = _model()
    prompt = list(range(30, 38))  # exactly two blocks
    blocks = BlockManager(16, BLOCK)
    cache = PagedCache(CONFIG.cache_shape, 16, BLOCK, "cpu", torch.float32)
    runner = ModelRunner(model, cache)
    scheduler = Scheduler(blocks, 8, "decode-first", 8)
    first = _seq(prompt)
    scheduler.add(first)
    (chunk,) = scheduler.schedule().chunks
    first.tokens.append(runner.step([chunk])[0])
    again = _seq(prompt, rid=1)
    scheduler.add(again)
    step = scheduler.schedule()
    assert step.chunks[0] == Chunk(first, 8, 1)  # the decode first
    mine = step.chunks[1]
    # One block hit; the second is computed again: its last token chooses the next.
    assert (mine.seq, mine.start, mine.length) == (again, 4, 4) and mine.samples
    assert again.block_table[0] == first.block_table[0]
    tokens = runner.step(step.chunks)
    assert tokens[1] == first.tokens[8]  # the same prompt, the same next token


def test_a_prompt_preempted_part_way_is_recomputed_from_its_tokens():
    model = _model()
    blocks = BlockManager(6, BLOCK, prefix_sharing=False)
    cache = PagedCache(CONFIG.cache_shape, 6, BLOCK, "cpu", torch.float32)
    runner = ModelRunner(model, cache)
    scheduler = Scheduler(blocks, 8, "decode-first", 12)
    old, young = _seq(range(40, 48), n_new=6), _seq(range(60, 76), rid=1)  # 2 and 4 blocks
    scheduler.add(old)
    scheduler.add(young)
    step = scheduler.schedule()  # old's whole prompt, young's first chunk: the pool is full
    assert [(c.seq, c.length) for c in step.chunks] == [(old, 8), (young, 4)]
    old.tokens.append(runner.step(step.chunks)[0])
    assert young.num_cached == 4  # part-way through its prompt
    step = scheduler.schedule()  # old decodes into a third block: the youngest goes
    assert scheduler.preemptions == 1 and young.status is Status.WAITING
    assert young.num_cached == 0 and young.block_table == []
    for _ in range(40):
        if scheduler.idle:
            break
        for c, t in zip(step.chunks, runner.step(step.chunks), strict=True):
            if t is not None:
                c.seq.tokens.append(t)
        for s in [s for s in scheduler.running if s.done]:
            scheduler.finish(s)
        step = scheduler.schedule()
    reference = E.solo_tokens(model, [old.request, young.request])
    assert old.generated == reference[0] and young.generated == reference[1]


# ---------------------------------------------------------------------------- the step


def _mixed_step() -> tuple[GPT, list[Chunk], list[Sequence]]:
    """Two sequences decoding and two prompt chunks, one of them mid-prompt."""
    g = torch.Generator().manual_seed(4)
    rows = [torch.randint(0, CONFIG.vocab_size, (n,), generator=g).tolist()
            for n in (7, 12, 9, 14)]
    seqs, table = [], 0
    for i, tokens in enumerate(rows):
        n_blocks = -(-len(tokens) // BLOCK)
        seqs.append(Sequence(Request(i, tuple(tokens), 2, 0.0),
                             block_table=list(range(table, table + n_blocks))))
        table += n_blocks
    return _model(), [Chunk(seqs[0], 6, 1), Chunk(seqs[1], 11, 1), Chunk(seqs[2], 0, 9),
                      Chunk(seqs[3], 4, 6)], seqs


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_mixed_step_gives_each_row_its_solo_next_token_and_logits(layout):
    model, chunks, seqs = _mixed_step()
    cache = PagedCache(CONFIG.cache_shape, 32, BLOCK, "cpu", torch.float32)
    runner = ModelRunner(model, cache, layout)
    # What each row has cached before the step: its tokens up to the chunk's start.
    for c in chunks:
        if c.start:
            runner.step([Chunk(c.seq, 0, c.start)])
    got = runner.step(chunks)
    with torch.inference_mode():
        for c, token in zip(chunks, got, strict=True):
            end = c.start + c.length
            logits = model(torch.tensor([c.seq.tokens[:end]]), 0)[0, -1]  # (vocab,)
            if c.samples:
                assert token == int(logits.argmax())
            else:
                assert token is None and end < len(c.seq.tokens)
    assert [s.num_cached for s in seqs] == [7, 12, 9, 10]


def test_packed_and_padded_write_the_same_keys_and_padding_writes_nothing():
    written = {}
    for layout in LAYOUTS:
        model, chunks, _ = _mixed_step()
        cache = PagedCache(CONFIG.cache_shape, 32, BLOCK, "cpu", torch.float32)
        cache.k.fill_(7.0)  # a sentinel: any slot a step should not touch keeps it
        ModelRunner(model, cache, layout).step(chunks)
        written[layout] = cache.k.clone()
    # Rows 0 and 1 write one slot each, rows 2 and 3 their chunks: 17 slots, per layer
    # and head; padded's rows are padded to 9 tokens, and none of the padding lands.
    touched = (written["padded"] != 7.0).any(dim=-1)  # (L, nh, blocks, slots)
    assert int(touched[0, 0].sum()) == 1 + 1 + 9 + 6
    # float32 noise: the two layouts multiply rows in batches of different shapes.
    torch.testing.assert_close(written["packed"], written["padded"], rtol=1e-5, atol=1e-5)


def test_the_scheduler_puts_decodes_first_and_admits_nothing_after_a_preemption():
    blocks = BlockManager(5, BLOCK, prefix_sharing=False)
    scheduler = Scheduler(blocks, 8, "decode-first", 16)
    a, b, c = _seq(range(8), rid=0), _seq(range(20, 28), rid=1), _seq(range(50, 52), rid=2)
    for s in (a, b):
        scheduler.add(s)
    scheduler.schedule()
    for s in (a, b):
        s.num_cached = 8
        s.tokens.append(1)
    scheduler.add(c)
    step = scheduler.schedule()  # a needs a third block of 5: b goes, and c waits
    assert [(x.seq, x.length) for x in step.chunks] == [(a, 1)]
    assert scheduler.preemptions == 1 and list(scheduler.waiting) == [b, c]


@pytest.mark.parametrize(("policy", "budget", "message"), [
    ("decode-first", 3, "--token-budget 3: expected at least one block (4 tokens)"),
    ("decode-first", None, "decode-first needs a token budget"),
    ("fcfs", None, "unknown policy 'fcfs'"),
])
def test_the_scheduler_refuses_a_bad_policy_or_budget(policy, budget, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Scheduler(BlockManager(4, BLOCK), 8, policy, budget)


# ---------------------------------------------------------------------------- metrics


def test_the_metrics_follow_vllms_definitions_on_a_made_up_timeline():
    # Request 0 sent at 0 s, tokens at 1.0, 1.5, 2.5 s; request 1 sent at 2 s, one token
    # at 2.2 s; request 2 sent at 1 s, tokens at 1.4 and 1.6 s.
    times = [RequestTimes(0.0, (1.0, 1.5, 2.5), 10), RequestTimes(2.0, (2.2,), 20),
             RequestTimes(1.0, (1.4, 1.6), 30)]
    lat = summarise(times, duration_s=3.0, targets={"ttft": 500, "tpot": 400})
    assert [t.ttft_ms for t in times] == pytest.approx([1000, 200, 400])
    assert [t.e2e_ms for t in times] == pytest.approx([2500, 200, 600])
    # TPOT = (E2E - TTFT) / (output - 1); a one-token request has none.
    assert [t.tpot_ms for t in times] == pytest.approx([750, None, 200])
    assert lat.tpot.mean == pytest.approx(475) and lat.tpot.max == pytest.approx(750)
    # ITL pools every gap of every request: 500, 1000 and 200 ms.
    assert lat.itl.mean == pytest.approx(1700 / 3) and lat.itl.max == pytest.approx(1000)
    assert lat.itl.p50 == pytest.approx(500)
    assert lat.ttft.p90 == pytest.approx(np.percentile([1000, 200, 400], 90))
    assert lat.request_throughput == pytest.approx(1.0)
    assert lat.output_throughput == pytest.approx(6 / 3)
    assert lat.total_token_throughput == pytest.approx((60 + 6) / 3)
    # Request 0 misses TTFT 500; 1 meets it (no TPOT to miss); 2 meets both.
    assert lat.good_requests == 2 and lat.goodput == pytest.approx(2 / 3)
    assert lat.meets_targets is False  # 2 of 3 is under 90%


def test_percentiles_interpolate_as_numpy_does_and_empty_is_nan():
    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6]
    s = Stats.of(values)
    assert s.p99 == pytest.approx(float(np.percentile(values, 99)))
    assert s.p50 == pytest.approx(statistics.median(values))
    assert math.isnan(Stats.of([]).p99)
    assert summarise([RequestTimes(0.0, (1.0,), 1)], 1.0).goodput is None  # no targets


def test_a_concurrency_cap_sends_a_request_when_a_slot_frees():
    requests = [Request(i, (1,), 1, 0.1 * i) for i in range(3)]
    rec = serving_recorder.Recorder("x", requests, torch.device("cpu"), None, max_concurrency=1)
    rec.t0 -= 10  # every request has arrived
    assert [r.id for r in rec.arrivals()] == [0]  # the cap holds the others back
    rec.done(0, 4.0)
    assert [r.id for r in rec.arrivals()] == [1]
    assert rec.sent == {0: 0.0, 1: 4.0}  # request 1 waited for the slot, from 0.1 s to 4 s


def test_every_rate_serves_the_same_requests_and_burstiness_keeps_the_mean_rate():
    base = make_requests(SPEC, 97)
    spec = dataclasses.replace(SPEC, requests=400, rate=4.0)
    poisson = make_requests(spec, 97)
    bursty = make_requests(dataclasses.replace(spec, burstiness=0.25), 97)
    assert [r.prompt for r in poisson[:6]] == [r.prompt for r in base]
    assert [r.prompt for r in bursty] == [r.prompt for r in poisson]
    gaps = [np.diff([r.arrival_s for r in rs]) for rs in (poisson, bursty)]
    assert all(g.mean() == pytest.approx(0.25, rel=0.3) for g in gaps)
    assert gaps[1].std() > 1.5 * gaps[0].std()  # gamma shape 1/4: burstier


def test_goodput_and_rate_lists_parse():
    assert parse_goodput("ttft:500,tpot:50") == {"ttft": 500.0, "tpot": 50.0}
    assert parse_rates("8,1,inf,2") == (1.0, 2.0, 8.0, None)


# ---------------------------------------------------------------------------- CLI


def test_serve_sweeps_rates_and_policies_in_one_run_and_draws_the_curve(checkpoint, tmp_path):
    png = tmp_path / "curve.png"
    out = _cli("--model", str(checkpoint), "--weights", "pretrained", "--device", "cpu",
               "--requests", "3", "--prompt-len", "2:12", "--output-len", "2:6",
               "--shared-prefix", "4", "--kv-mem", "64KiB", "--block-size", "4",
               "--engines", "paged", "--token-budget", "4,64", "--rate", "inf,50",
               "--goodput", "ttft:60000,tpot:60000", "--plot", str(png), "--json")
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    names = [(e["engine"], e["rate"]) for e in data["engines"]]
    assert names == [(n, r) for r in (50.0, None) for n in ("paged pf", "paged df 4",
                                                           "paged df 64")]
    assert all(e["requests_exact"] == 3 for e in data["engines"])
    assert all(e["latency"]["good_requests"] == 3 for e in data["engines"])  # a minute each
    assert data["engines"][1]["steps"]["stalled"] == 0
    # Off a terminal: one line on stderr per engine and rate as it finishes.
    assert out.stderr.count("tok/s") == 6, out.stderr
    assert png.read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.parametrize(("args", "message"), [
    (["--token-budget", "0"], "error: --token-budget 0: expected at least one block (16 tokens)"),
    (["--token-budget", "8"], "error: --token-budget 8: expected at least one block (16 tokens)"),
    (["--token-budget", "64,x"], "error: --token-budget '64,x': expected tokens per forward"),
    (["--policy", "fcfs"], "error: --policy: unknown policy 'fcfs'; valid policies: "
                           "prefill-first, decode-first"),
    (["--goodput", "ttft=500"], "error: --goodput 'ttft=500': expected targets like"),
    (["--goodput", "ttft:500,itl:5"], "error: --goodput 'ttft:500,itl:5': expected targets"),
    (["--goodput", "tpot:-1"], "error: --goodput 'tpot:-1': expected targets like"),
    (["--rate", "1,,2"], "error: --rate '1,,2': an empty item; expected comma-separated "
     "requests/s"),
    (["--rate", "1,x"], "error: --rate '1,x': expected requests/s > 0"),
    (["--rate", "0"], "error: --rate '0': expected requests/s > 0"),
    (["--rate", "2,2"], "error: --rate '2,2': the rate 2 given twice"),
    (["--max-concurrency", "0"], "error: --max-concurrency 0: expected at least 1 request"),
    (["--burstiness", "0"], "error: --burstiness 0.0: expected a gamma shape > 0"),
    (["--layout", "ragged"], "error: --layout 'ragged': expected one of packed, padded"),
])
def test_bad_serving_options_are_one_line_and_exit_2_before_any_model_loads(args, message):
    # --weights pretrained for gpt2 would have to load (or fail to find) real weights:
    # refusing first proves the check ran before any loading.
    out = _cli("--device", "cpu", "--weights", "pretrained", *args)
    assert out.exit_code == 2, out.output
    assert message in out.stderr and out.stderr.count("\n") == 1, out.stderr
