"""The paged KV cache and continuous batching (`kvcache_cli.serving`, `kvcache serve`).

Exactness first: a batch of rows at different positions gives each row's solo
logits, and every engine gives every request its solo greedy tokens, with and
without prefix sharing and preemption. Then the bookkeeping: blocks allocated on
demand and freed, shared by reference count, never written once shared, and a
pool that runs out preempts instead of failing. Timings are never asserted.
"""

from __future__ import annotations

import io
import json

import pytest
import servingkit
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from servingkit import CONFIG, PNG_SIGNATURE, ROOMY, SPEC, TIGHT
from servingkit import seq as _seq
from servingkit import serve_cli as _cli
from servingkit import tiny_model as _model

from kvcache_cli.caches.exact import StaticCache
from kvcache_cli.caches.paged import PagedCache, block_bytes
from kvcache_cli.models.gpt2 import GPTConfig
from kvcache_cli.serving import batching
from kvcache_cli.serving import engines as E
from kvcache_cli.serving import plan as serving_plan
from kvcache_cli.serving import results as serving_results
from kvcache_cli.serving.block_manager import BlockManager
from kvcache_cli.serving.model_runner import ModelRunner, block_tables
from kvcache_cli.serving.scheduler import Scheduler
from kvcache_cli.serving.sequence import Status
from kvcache_cli.serving.workload import WorkloadSpec, check_spec, make_requests, parse_range

pytestmark = pytest.mark.usefixtures("one_torch_thread")
checkpoint = servingkit.checkpoint  # the fixture, found by its name in this module


def _serve(model, spec, engine, kv_mem, block_size=4, max_batch=64, sharing=True):
    requests = make_requests(spec, model.config.vocab_size)
    plan = serving_plan.plan_memory(model.config, model.dtype, spec, kv_mem, block_size, max_batch)
    reference = E.solo_tokens(model, requests)
    result, _ = E.run_engine(engine, model, requests, spec, plan, block_size, max_batch,
                             sharing, reference)
    return result, reference


# ---------------------------------------------------------------------------- the model


def test_a_batch_of_rows_at_different_positions_gives_each_rows_solo_logits():
    model = _model()
    lengths = [3, 9, 6]  # prompts of different lengths: the rows sit at different positions
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, CONFIG.vocab_size, (n,), generator=g).tolist() for n in lengths]
    nxt = [5, 7, 11]
    cache = PagedCache(CONFIG.cache_shape, n_blocks=16, block_size=4, device="cpu",
                       dtype=torch.float32)
    runner = ModelRunner(model, cache)
    seqs, blocks = [], BlockManager(16, 4, prefix_sharing=False)
    for p, t in zip(prompts, nxt, strict=True):
        s = _seq(p)
        blocks.allocate(s)
        runner.prefill(s)
        s.tokens.append(t)
        blocks.append_slot(s)
        seqs.append(s)
    idx = torch.tensor([[t] for t in nxt])  # (B, 1)
    start = torch.tensor([s.num_cached for s in seqs])  # (B,)
    cache.bind(block_tables(seqs, "cpu"))
    with torch.inference_mode():
        batched = model(idx, start, cache)[:, -1]  # (B, vocab)
    for row, (p, t) in enumerate(zip(prompts, nxt, strict=True)):
        solo_cache = StaticCache(CONFIG.cache_shape, len(p) + 1, 1, "cpu", torch.float32)
        with torch.inference_mode():
            model(torch.tensor([p]), 0, solo_cache)
            solo = model(torch.tensor([[t]]), len(p), solo_cache)[0, -1]
        # float32 noise: the batched matmuls sum in another order than one row's.
        torch.testing.assert_close(batched[row], solo, atol=1e-5, rtol=1e-5)


def test_per_row_positions_past_the_window_are_refused():
    model = _model()
    with pytest.raises(IndexError, match="position 128 past context window 128"):
        model(torch.tensor([[1], [2]]), torch.tensor([3, 128]))


# ---------------------------------------------------------------------------- blocks


def test_blocks_are_allocated_as_a_sequence_grows_and_freed_when_it_ends():
    blocks = BlockManager(n_blocks=8, block_size=4, prefix_sharing=False)
    s = _seq(range(5))  # 5 tokens: 2 blocks
    blocks.allocate(s)
    assert len(s.block_table) == 2 and blocks.blocks_in_use == 2
    s.num_cached = 5
    for _ in range(3):  # positions 5, 6, 7 fit the second block
        blocks.append_slot(s)
        s.num_cached += 1
    assert len(s.block_table) == 2
    blocks.append_slot(s)  # position 8 needs a third
    assert len(s.block_table) == 3 and blocks.blocks_in_use == 3
    blocks.free(s)
    assert blocks.blocks_in_use == 0 and s.block_table == []


def test_equal_prefixes_share_full_blocks_by_reference_count():
    blocks = BlockManager(n_blocks=16, block_size=4)
    prefix = list(range(10, 18))  # two full blocks
    a, b = _seq(prefix + [1, 2, 3]), _seq(prefix + [4, 5], rid=1)
    blocks.allocate(a)
    blocks.allocate(b)
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared
    assert b.block_table[2] != a.block_table[2]  # the partial block is each one's own
    assert [blocks.refcount[x] for x in a.block_table[:2]] == [2, 2]
    assert b.num_cached == 8 and blocks.prefix_hits == 2
    blocks.free(a)
    assert [blocks.refcount[x] for x in b.block_table[:2]] == [1, 1]
    blocks.free(b)
    # Freed, the blocks keep their hashes: a later request with the prefix still hits.
    c = _seq(prefix + [9], rid=2)
    blocks.allocate(c)
    assert c.block_table[:2] == shared and blocks.prefix_hits == 4


def test_a_different_earlier_block_means_no_hit_on_a_later_equal_one():
    blocks = BlockManager(n_blocks=16, block_size=4)
    a, b = _seq([1, 2, 3, 4, 5, 6, 7, 8, 9]), _seq([0, 2, 3, 4, 5, 6, 7, 8, 9], rid=1)
    blocks.allocate(a)
    blocks.allocate(b)
    assert set(a.block_table).isdisjoint(b.block_table)  # the hash chains over the prefix


def test_a_prompt_of_full_blocks_still_computes_its_last_token():
    blocks = BlockManager(n_blocks=16, block_size=4)
    prompt = list(range(8))
    blocks.allocate(_seq(prompt))
    again = _seq(prompt, rid=1)
    blocks.allocate(again)
    assert again.num_cached == 4  # the second block is recomputed: its last token's logits


def test_shared_blocks_are_never_written():
    model = _model()
    cache = PagedCache(CONFIG.cache_shape, n_blocks=16, block_size=4, device="cpu",
                       dtype=torch.float32)
    runner, blocks = ModelRunner(model, cache), BlockManager(16, 4)
    prefix = list(range(20, 28))
    first = _seq(prefix + [1, 2])
    blocks.allocate(first)
    runner.prefill(first)
    shared = first.block_table[:2]
    before = cache.k[:, :, shared].clone(), cache.v[:, :, shared].clone()
    copied = cache.bytes_copied
    second = _seq(prefix + [3, 4, 5], rid=1)
    blocks.allocate(second)
    runner.prefill(second)
    assert second.block_table[:2] == shared
    assert torch.equal(cache.k[:, :, shared], before[0])
    assert torch.equal(cache.v[:, :, shared], before[1])
    # Only the 3 tokens past the shared prefix were written.
    assert cache.bytes_copied - copied == 3 * block_bytes(CONFIG.cache_shape, 1, torch.float32)


def test_an_exhausted_pool_raises_memory_error_naming_its_size():
    blocks = BlockManager(n_blocks=2, block_size=4)
    blocks.allocate(_seq(range(8)))
    with pytest.raises(MemoryError, match="all 2 KV blocks are in use"):
        blocks._take()


def test_the_scheduler_preempts_the_youngest_when_the_pool_runs_out():
    blocks = BlockManager(n_blocks=4, block_size=4, prefix_sharing=False)
    scheduler = Scheduler(blocks, max_batch=8)
    old, young = _seq(range(8), rid=0), _seq(range(30, 38), rid=1)
    for s in (old, young):
        scheduler.add(s)
    step = scheduler.schedule()
    assert step.prefill == (old, young) and blocks.blocks_in_use == 4
    for s in (old, young):
        s.num_cached = len(s.tokens)
        s.tokens.append(1)
    step = scheduler.schedule()  # both need a third block; there is none
    assert step.decode == (old,) and scheduler.preemptions == 1
    assert young.status is Status.WAITING and young.block_table == [] and young.num_cached == 0
    assert scheduler.waiting[0] is young and len(young.tokens) == 9  # kept, to recompute


# ---------------------------------------------------------------------------- engines


def test_solo_tokens_vary_so_that_agreement_means_something():
    model = _model()
    reference = E.solo_tokens(model, make_requests(SPEC, CONFIG.vocab_size))
    assert len({t for tokens in reference.values() for t in tokens}) > 5, reference


@pytest.mark.parametrize("sharing", [True, False])
def test_paged_gives_every_request_its_solo_tokens(sharing):
    result, _ = _serve(_model(), SPEC, "paged", ROOMY, sharing=sharing)
    assert result.mismatches == () and result.requests_exact == SPEC.requests
    assert result.preemptions == 0 and result.peak_running == SPEC.requests
    # The 10-token prefix is 2 full blocks of 4; every request after the first hits them.
    assert result.prefix_blocks_hit == (2 * (SPEC.requests - 1) if sharing else 0)


@pytest.mark.parametrize("sharing", [True, False])
def test_paged_with_preemption_still_gives_every_request_its_solo_tokens(sharing):
    result, _ = _serve(_model(), SPEC, "paged", TIGHT, sharing=sharing)
    assert result.preemptions > 0
    assert result.mismatches == ()
    assert result.kv_peak_used_bytes <= TIGHT


def test_padded_and_sequential_give_solo_tokens_and_padded_wastes_its_slabs():
    model = _model()
    sequential, _ = _serve(model, SPEC, "sequential", ROOMY)
    padded, _ = _serve(model, SPEC, "padded", ROOMY)
    paged, _ = _serve(model, SPEC, "paged", ROOMY)
    assert sequential.mismatches == () and padded.mismatches == ()
    assert sequential.peak_running == 1
    assert padded.kv_utilisation < paged.kv_utilisation


def test_the_padded_engine_is_sized_to_the_workload_not_the_whole_budget():
    # 4 requests under a budget of hundreds of rows: a batched generate() pads 4 rows, each
    # as long as its longest prompt and output, not as long as the ranges allow.
    model = _model()
    spec = WorkloadSpec(4, (2, 40), (2, 30), 0, None, 0)
    requests = make_requests(spec, model.config.vocab_size)
    plan = serving_plan.plan_memory(model.config, model.dtype, spec, ROOMY * 64, 4, 256)
    assert plan.padded_rows > 4 and plan.slab_len == spec.longest
    fitted = serving_plan.fit_padded(plan, requests, model.config, model.dtype, ROOMY * 64, 256)
    # Every row decodes until its group's longest output is done.
    longest = max(len(r.prompt) for r in requests) + max(r.max_new_tokens for r in requests)
    assert (fitted.padded_rows, fitted.slab_len) == (4, longest) and longest < spec.longest
    assert fitted.n_blocks == plan.n_blocks
    result = E.run_serve(model, spec, ["padded"], ROOMY * 64, 4, 256)
    assert (result.padded_rows, result.slab_len) == (4, longest)
    padded = result.engines[0]
    assert padded.mismatches == ()
    assert padded.kv_reserved_bytes == 4 * longest * result.bytes_per_token


def test_hf_continuous_batching_runs_the_same_weights_to_the_same_tokens():
    result, _ = _serve(_model(), SPEC, "hf", ROOMY)
    assert result.mismatches == ()
    assert result.setup_s > 0 and result.output_tokens == sum(
        r.max_new_tokens for r in make_requests(SPEC, CONFIG.vocab_size))


def test_a_differing_token_is_reported_with_its_step_and_the_solo_gap():
    model = _model()
    requests = make_requests(SPEC, CONFIG.vocab_size)
    reference = E.solo_tokens(model, requests)
    changed = {k: list(v) for k, v in reference.items()}
    changed[2][1] = (changed[2][1] + 1) % CONFIG.vocab_size
    (mismatch,) = E.mismatches(model, requests, changed, reference)
    assert (mismatch.request, mismatch.step) == (2, 1)
    assert mismatch.top2_gap >= 0 and mismatch.logit_scale > 0


def test_a_near_tie_is_a_gap_within_float32_noise_of_the_logits_size():
    assert serving_results.Mismatch(0, 1, top2_gap=0.003, logit_scale=1000.0).near_tie
    assert not serving_results.Mismatch(0, 1, top2_gap=0.5, logit_scale=10.0).near_tie


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 5),
    prompt=st.tuples(st.integers(1, 12), st.integers(0, 12)),
    output=st.tuples(st.integers(1, 8), st.integers(0, 8)),
    prefix=st.integers(0, 9),
    block_size=st.integers(1, 6),
    spare_blocks=st.integers(0, 12),
    seed=st.integers(0, 1000),
)
def test_random_request_mixes_give_each_request_its_solo_tokens(
        n, prompt, output, prefix, block_size, spare_blocks, seed):
    model = _model(GPTConfig(block_size=64, vocab_size=53, n_layer=1, n_head=2, n_embd=16))
    spec = WorkloadSpec(n, (prompt[0], prompt[0] + prompt[1]),
                        (output[0], output[0] + output[1]), prefix, None, seed)
    # From a pool that just holds the longest request (preemptions) to a roomy one.
    blocks = -(-spec.longest // block_size) + spare_blocks
    kv_mem = blocks * block_bytes(model.config.cache_shape, block_size, torch.float32)
    result, _ = _serve(model, spec, "paged", kv_mem, block_size=block_size)
    assert result.mismatches == ()


# ---------------------------------------------------------------------------- workload


def test_ranges_parse_and_bad_ones_name_the_option():
    assert parse_range("16:512", "--prompt-len") == (16, 512)
    assert parse_range("8", "--output-len") == (8, 8)
    with pytest.raises(ValueError, match=r"--prompt-len '9:3': expected 1 <= MIN <= MAX"):
        parse_range("9:3", "--prompt-len")
    with pytest.raises(ValueError, match="expected MIN:MAX or N"):
        parse_range("a:b", "--output-len")


def test_the_workload_is_seeded_and_every_prompt_starts_with_the_shared_prefix():
    spec = WorkloadSpec(5, (1, 9), (1, 4), 7, rate=2.0, seed=4)
    a, b = make_requests(spec, 50), make_requests(spec, 50)
    assert a == b
    assert len({r.prompt[:7] for r in a}) == 1
    assert all(x.arrival_s <= y.arrival_s for x, y in zip(a, a[1:])) and a[-1].arrival_s > 0
    with pytest.raises(ValueError, match="= 1030 positions, is past the context window 1024"):
        check_spec(WorkloadSpec(1, (16, 512), (16, 256), 262, None, 0), 1024)


# ---------------------------------------------------------------------------- batching


def test_the_sweep_always_includes_batch_1_and_finds_the_knee_by_interpolation():
    assert batching.parse_sizes("16,4") == (1, 4, 16)
    assert batching._knee([1, 4, 16], [1.0, 1.5, 3.5]) == pytest.approx(4 + 12 * 0.5 / 2.0)
    assert batching._knee([1, 4], [1.0, 1.2]) is None
    with pytest.raises(ValueError, match="--batch '0,4': expected batch sizes of at least 1"):
        batching.parse_sizes("0,4")


def test_the_sweep_times_every_batch_against_the_roofline():
    result = batching.run_sweep(_model(), (1, 4), bandwidth_mib=4, matmul_n=256)
    assert result.context == 128 - batching.WARMUP_STEPS - batching.STEPS
    assert [p.batch for p in result.points] == [1, 4]
    assert result.points[0].over_batch1 == 1.0
    assert result.points[1].intensity > result.points[0].intensity
    assert result.peak_gflops > 0 and result.bandwidth_gbps > 0


def test_the_sweep_plot_ticks_are_the_batch_sizes_as_plain_numbers():
    pytest.importorskip("matplotlib")
    from kvcache_cli.views.serve_plot import figure

    result = batching.run_sweep(_model(), (1, 4, 16), bandwidth_mib=4, matmul_n=256)
    fig = figure(result)
    ax = fig.axes[0]
    labels = [ax.xaxis.get_major_formatter()(v, i) for i, v in enumerate(ax.get_xticks())]
    assert list(ax.get_xticks()) == [1, 4, 16] and labels == ["1", "4", "16"]
    assert ax.yaxis.get_major_formatter()(1000.0, 0) == "1,000"  # not 10³


def test_the_curve_plot_reads_in_plain_milliseconds_and_names_the_rates_once():
    pytest.importorskip("matplotlib")
    import dataclasses

    from kvcache_cli.views.serve_plot import figure

    result = E.run_serve(_model(), SPEC, ["paged"], ROOMY, 4, 64)
    fig = figure(dataclasses.replace(result, rates=(1.0, None)))
    ttft, tpot = fig.axes
    assert fig._suptitle.get_text().endswith("arrival rates 1, inf requests/s")
    assert ttft.get_title() == "p99 TTFT against throughput"  # short: it fits its panel
    major, minor = ttft.yaxis.get_major_formatter(), ttft.yaxis.get_minor_formatter()
    assert major(1000.0, 0) == "1,000"  # not 10³
    assert [minor(v, 0) for v in (200.0, 300.0, 5000.0)] == ["200", "", "5,000"]


def test_the_serve_plot_draws_steps_and_notes_the_engine_it_cannot_draw():
    pytest.importorskip("matplotlib")
    import dataclasses

    from kvcache_cli.views.serve_plot import figure

    result = E.run_serve(_model(), SPEC, ["sequential", "paged"], ROOMY, 4, 64)
    # transformers' engine reports no timeline: stand it in with the paged result emptied.
    hf = dataclasses.replace(result.engines[1], engine="hf", timeline=())
    fig = figure(dataclasses.replace(result, engines=(*result.engines, hf)))
    kv, running = fig.axes
    assert {line.get_drawstyle() for line in kv.lines + running.lines} == {"steps-post"}
    assert len(running.lines) == 2  # sequential and paged; hf has nothing to draw
    notes = [t.get_text() for t in fig.texts]
    assert len(notes) == 1 and notes[0].startswith("not drawn: hf (")


# ---------------------------------------------------------------------------- CLI


def test_serve_compares_the_engines_in_json_and_draws_the_plot(checkpoint, tmp_path):
    png = tmp_path / "serve.png"
    out = _cli("--model", str(checkpoint), "--weights", "pretrained", "--device", "cpu",
               "--requests", "4", "--prompt-len", "2:20", "--output-len", "2:10",
               "--shared-prefix", "8", "--kv-mem", "64KiB", "--block-size", "4",
               "--engines", "paged,sequential,padded", "--plot", str(png), "--json")
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert [e["engine"] for e in data["engines"]] == [
        "paged pf", "paged df 256", "sequential", "padded"]  # paged under both policies
    assert all(e["requests_exact"] == 4 for e in data["engines"])
    assert data["engines"][0]["prefix_blocks_hit"] == 6  # 2 blocks, 3 later requests
    assert png.read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.parametrize(("args", "message"), [
    (["--requests", "0"], "error: --requests 0: expected a whole number from 1 to 100,000"),
    (["--prompt-len", "512:16"], "error: --prompt-len '512:16': expected 1 <= MIN <= MAX"),
    (["--output-len", "900"], "is past the context window 1024"),
    (["--kv-mem", "1MiB"], "error: --kv-mem 1,048,576 bytes holds 0 blocks of 16 tokens"),
    (["--engines", "paged,vllm"], "error: --engines: unknown engine 'vllm'"),
    (["--batch", "x"], "error: --batch 'x': expected batch sizes like 1,4,16,64"),
])
def test_bad_input_is_one_line_and_exit_2_before_any_model_loads(args, message):
    # --weights pretrained for gpt2 would have to load (or fail to find) real weights:
    # refusing first proves the check ran before any loading.
    out = _cli("-m", "gpt2", "--device", "cpu", "--weights", "pretrained", *args)
    assert out.exit_code == 2, out.output
    assert message in out.stderr and out.stderr.count("\n") == 1, out.stderr


def test_a_quantised_pools_lost_tokens_are_one_line_not_a_bug_report():
    import dataclasses

    from rich.console import Console

    from kvcache_cli.views.serve import render

    result = E.run_serve(_model(), SPEC, ["paged"], ROOMY, 4, 64)
    flips = tuple(serving_results.Mismatch(request=i, step=3 + i, top2_gap=2.0, logit_scale=10.0)
                  for i in range(4))
    lossy = dataclasses.replace(result.engines[0], engine="paged-int8 pf", mismatches=flips,
                                requests_exact=2)
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(render(dataclasses.replace(result, engines=(*result.engines, lossy))))
    text = console.export_text()
    assert "look for a bug" not in text
    assert ("paged-int8 pf: 4 of 6 requests left their solo float32 tokens (the first at new "
            "token 3)") in text
