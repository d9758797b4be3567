"""serve on a model with sliding layers: a pool per layer kind (vLLM's hybrid KV-cache
manager), its sliding groups giving back the blocks that fall out of the window, and the
prefix cache, whose hit needs the sliding layers' window at the branch point. Every reply
is held against its solo greedy tokens, with prompts several windows long."""

from __future__ import annotations

import json

import pytest
import servingkit
import torch
from gemmakit import random_gemma3

from kvcache_cli.caches.base import LayerType
from kvcache_cli.caches.paged import block_bytes
from kvcache_cli.models.gemma3 import Gemma3
from kvcache_cli.serving import engines as E
from kvcache_cli.serving import plan as serving_plan
from kvcache_cli.serving.hybrid_blocks import NULL, Group, HybridBlockManager, kv_groups
from kvcache_cli.serving.sequence import Request
from kvcache_cli.serving.workload import WorkloadSpec, make_requests

pytestmark = pytest.mark.usefixtures("one_torch_thread")

W, BS = 8, 4  # the window, two blocks of it
# Prompts of 10 to 40 tokens after a shared prefix of 20: up to seven windows.
SPEC = WorkloadSpec(requests=6, prompt_len=(10, 40), output_len=(4, 20), shared_prefix=20,
                    rate=None, seed=3)
ROOMY = 1 << 20


@pytest.fixture(scope="module")
def model() -> Gemma3:
    return random_gemma3(W)


def page_bytes(model) -> int:
    """One page: BS tokens of one group's 2 layers."""
    return block_bytes(model.config.cache_shape, BS, torch.float32) // 3


def serve(model, requests, spec, engine, kv_mem, max_batch=64, sharing=True):
    plan = serving_plan.plan_memory(model.config, model.dtype, spec, kv_mem, BS, max_batch)
    reference = E.solo_tokens(model, requests)
    result, _ = E.run_engine(engine, model, requests, spec, plan, BS, max_batch, sharing,
                             reference)
    return result


# ---------------------------------------------------------------------------- the groups


def test_the_layers_split_into_groups_of_one_size_as_vllm_groups_them(model):
    assert kv_groups(model.config.cache_shape) == (
        Group(W, (0, 1)), Group(W, (3, 4)), Group(None, (2, 5)))
    # Gemma 3 270M: 15 sliding layers and 3 global ones, so 6 groups of 3.
    shape = model.config.cache_shape
    real = type(shape)(18, 1, 256, 32_768, layer_types=(
        (LayerType(512),) * 5 + (LayerType(None),)) * 3)
    groups = kv_groups(real)
    assert [len(g.layers) for g in groups] == [3] * 6
    assert [g.kind for g in groups].count("full") == 1


def test_a_sliding_group_gives_back_the_blocks_before_its_window():
    groups = (Group(W, (0,)), Group(None, (1,)))
    blocks = HybridBlockManager(40, BS, groups)
    seq = servingkit.seq(range(30), n_new=4)
    blocks.allocate(seq)
    seq.num_cached = 30  # the prompt computed: the next token, at 30, sees 23 .. 30
    blocks.before_compute(seq)
    sliding, full = seq.group_tables
    assert sliding[:5] == [NULL] * 5 and NULL not in sliding[5:]  # block 5 holds 20 .. 23
    assert NULL not in full
    assert blocks.blocks_in_use == 8 + 3  # the full group's 8 blocks, the sliding group's 3
    # Kept every 16 tokens: the windows before 16 (blocks 2, 3) stay.
    kept = HybridBlockManager(40, BS, groups, keep_every=16)
    seq = servingkit.seq(range(30), n_new=4)
    kept.allocate(seq)
    seq.num_cached = 30
    kept.before_compute(seq)
    assert [i for i, b in enumerate(seq.group_tables[0]) if b == NULL] == [0, 1, 4]


def test_a_hit_needs_the_full_groups_prefix_but_only_the_window_before_its_end():
    groups = (Group(W, (0,)), Group(None, (1,)))
    blocks = HybridBlockManager(40, BS, groups)
    a = servingkit.seq(range(36))
    blocks.allocate(a)  # pages 0 .. 8 sliding, 9 .. 17 full; every block entered
    a.num_cached = 36
    blocks.before_compute(a)  # sliding blocks 0 .. 6 given back, their hashes kept
    taken = [blocks._take() for _ in range(22 + 6)]  # never-used pages, then blocks 0 .. 5
    assert taken[-6:] == list(range(6))
    blocks.release(taken[0]), blocks.release(taken[1])  # two pages behind block 6, for b
    b = servingkit.seq([*range(32), 500, 501, 502, 503], rid=1)
    blocks.allocate(b)  # the window before 32 is blocks 6, 7: still cached
    assert b.admitted_hits == 8 and blocks.window_misses == 0
    assert b.group_tables[0][:8] == [NULL] * 6 + [6, 7]
    blocks.free(b)
    # b gave back its 2 new pages, then block 6 (a holds 7 on): take them in that order,
    # and no window is cached before 32, nor before any earlier block.
    assert [blocks._take() for _ in range(3)][-1] == 6
    for page in taken[2:20]:  # room for c's 9 blocks in each group
        blocks.release(page)
    c = servingkit.seq([*range(32), 600, 601, 602, 603], rid=2)
    blocks.allocate(c)
    assert c.admitted_hits == 0
    assert (blocks.window_misses, blocks.recomputed_tokens) == (1, 32)


# ---------------------------------------------------------------------------- exactness


def test_the_prompts_are_several_windows_long_and_the_tokens_vary(model):
    requests = make_requests(SPEC, model.config.vocab_size)
    assert max(len(r.prompt) for r in requests) > 5 * W
    reference = E.solo_tokens(model, requests)
    assert len({t for tokens in reference.values() for t in tokens}) > 10


@pytest.mark.parametrize("policy", ["prefill-first", "decode-first"])
@pytest.mark.parametrize("sharing", [True, False])
def test_paged_gives_every_request_its_solo_tokens(model, policy, sharing):
    requests = make_requests(SPEC, model.config.vocab_size)
    variant = serving_plan.Variant("paged", policy, 16 if policy == "decode-first" else None,
                                   keep=0)
    result = serve(model, requests, SPEC, variant, ROOMY, sharing=sharing)
    assert result.mismatches == () and result.requests_exact == SPEC.requests
    # The 20-token prefix is 5 full blocks; every request after the first hits them.
    assert result.prefix_blocks_hit == (5 * (SPEC.requests - 1) if sharing else 0)
    assert result.hybrid.groups == {"sliding": 2, "full": 1}
    # A token takes a page in each of the 3 groups.
    assert result.pool_tokens == ROOMY // page_bytes(model) * BS // 3


@pytest.mark.parametrize("keep", [0, BS])
def test_a_tight_pool_preempts_and_still_gives_solo_tokens(model, keep):
    requests = make_requests(SPEC, model.config.vocab_size)
    # 60 pages: what the longest request the spec allows (80 tokens) needs in 3 groups.
    tight = 60 * page_bytes(model)
    variant = serving_plan.Variant("paged", "decode-first", 16, keep=keep)
    result = serve(model, requests, SPEC, variant, tight)
    assert result.mismatches == () and result.preemptions > 0
    assert result.kv_peak_used_bytes <= tight


@pytest.mark.parametrize("engine", ["sequential", "padded"])
def test_the_other_engines_attend_over_the_window_too(model, engine):
    requests = make_requests(SPEC, model.config.vocab_size)
    assert serve(model, requests, SPEC, engine, ROOMY).mismatches == ()


# ---------------------------------------------------------------------------- the pool


def test_giving_back_what_left_the_window_holds_more_sequences_in_one_pool(model):
    # Decode-first computes prompts in chunks of 16, so a sliding group holds its window
    # and a chunk, not the whole prompt. Keeping every block (every BS tokens) is the pool
    # of a model whose every layer is full: the same bytes admit fewer at once.
    requests = make_requests(SPEC, model.config.vocab_size)
    kv_mem = 75 * page_bytes(model)
    runs = {keep: serve(model, requests, SPEC, serving_plan.Variant(
        "paged", "decode-first", 16, keep=keep), kv_mem) for keep in (0, BS)}
    eager, kept = runs[0], runs[BS]
    assert eager.mismatches == () and kept.mismatches == ()
    assert eager.hybrid.peak_bytes["sliding"] < kept.hybrid.peak_bytes["sliding"]
    assert eager.peak_running > kept.peak_running
    assert eager.preemptions < kept.preemptions


# ---------------------------------------------------------------------------- prefix hits

PREFIX = tuple(range(100, 132))  # 32 tokens: 8 blocks, four windows


def branching(model) -> tuple[list[Request], WorkloadSpec]:
    """A asks PREFIX + 4 tokens, then C an unrelated prompt, then B PREFIX + 4 others: B
    branches from A at token 32. One at a time (max_batch 1), all arrived at once."""
    a = Request(0, PREFIX + (1, 2, 3, 4), 12, 0.0)
    c = Request(1, tuple(range(150, 150 + 40)), 4, 0.0)
    b = Request(2, PREFIX + (5, 6, 7, 8), 4, 0.0)
    return [a, c, b], WorkloadSpec(3, (8, 40), (4, 12), 0, None, 0)


@pytest.mark.parametrize("kv_pages, keep, hit, misses, recomputed", [
    # A roomy pool: A's blocks, given back as they left its window, are still cached when
    # B comes (a block keeps its hash until the free list hands it out): B hits all 8.
    (400, 0, 8, 0, 0),
    # A tight one (60 pages): C takes the free list's front, where A's early returns lie:
    # the full layers still hold the prefix, the sliding ones not its window, and B
    # recomputes it. (From 65 pages on, C leaves the window alone.)
    (60, 0, 0, 1, 32),
    # Kept every 32 tokens: A held the window before token 32 (blocks 6, 7) to its end,
    # and gave it back after C's share of the list: B hits all 8 again.
    (60, 32, 8, 0, 0),
])
def test_a_prefix_hit_needs_the_sliding_window_at_the_branch_point(model, kv_pages, keep, hit,
                                                                   misses, recomputed):
    requests, spec = branching(model)
    result = serve(model, requests, spec, serving_plan.Variant("paged", "prefill-first",
                                                               keep=keep),
                   kv_pages * page_bytes(model), max_batch=1)
    assert result.mismatches == ()
    assert result.prefix_blocks_hit == hit
    assert (result.hybrid.window_misses, result.hybrid.recomputed_tokens) == (misses,
                                                                             recomputed)
    assert result.steps.prompt_tokens == sum(len(r.prompt) for r in requests) - hit * BS


# ---------------------------------------------------------------------------- the CLI


def gemma3_folder(path, model):
    """`model` as a transformers folder at `path`, with a tokenizer: what `-m` takes."""
    from kvcache_cli.models.gemma3 import to_hf
    from kvcache_cli.models.gguf.export import synthetic_vocab
    from kvcache_cli.models.tokenizer import from_gguf

    to_hf(model).save_pretrained(path)
    from_gguf(*synthetic_vocab(300), "smollm").save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory, model):
    return gemma3_folder(tmp_path_factory.mktemp("gemma3"), model)


def test_serve_runs_a_gemma3_folder_and_reports_bytes_per_kind(folder):
    run = servingkit.serve_cli("-m", str(folder), "--engines", "sequential,paged",
                               "--policy", "decode-first", "--token-budget", "16",
                               "--block-size", str(BS), "--requests", "4",
                               "--prompt-len", "10:40", "--output-len", "4:8",
                               "--shared-prefix", "20", "--keep-windows", "0,32", "--json")
    assert run.exit_code == 0, run.output
    result = json.loads(run.stdout)
    paged = [e for e in result["engines"] if e["engine"].startswith("paged")]
    assert [e["engine"] for e in paged] == ["paged df 16", "paged df 16 keep 32"]
    for e in result["engines"]:
        assert e["mismatches"] == [], e["engine"]
    for e in paged:
        assert set(e["hybrid"]["peak_bytes"]) == {"full", "sliding"}
    assert [e["hybrid"]["keep_every"] for e in paged] == [0, 32]
    table = servingkit.serve_cli("-m", str(folder), "--engines", "paged", "--policy",
                                 "decode-first", "--block-size", str(BS), "--requests", "2",
                                 "--prompt-len", "10:20", "--output-len", "4")
    assert table.exit_code == 0, table.output
    assert "Hybrid pool" in table.output and "window misses" in table.output


@pytest.mark.parametrize("args, message", [
    (["--keep-windows", "6"], "--keep-windows 6: expected 0 or a multiple of the block size"),
    (["--keep-windows", "x"], "--keep-windows 'x': expected tokens"),
])
def test_bad_hybrid_input_is_one_line_and_exit_2(folder, args, message):
    run = servingkit.serve_cli("-m", str(folder), "--block-size", str(BS), "--prompt-len",
                               "10:40", "--output-len", "4:8", *args)
    assert run.exit_code == 2, run.output
    assert message in run.output


def test_keep_windows_on_a_model_without_sliding_layers_is_refused(checkpoint):
    run = servingkit.serve_cli("-m", str(checkpoint), "--prompt-len", "4:8", "--output-len",
                               "2:4", "--shared-prefix", "4", "--keep-windows", "16")
    assert run.exit_code == 2 and "has no sliding layers" in run.output


checkpoint = servingkit.checkpoint  # the fixture, found by its name in this module


# ---------------------------------------------------------------------------- the real file


def test_gemma3_270m_serves_prompts_past_its_window_as_each_alone():
    """The real file (`-m gemma3`; skips without its package): 3 requests sharing 560
    tokens, past the 512-token window, each reply equal to its solo greedy tokens, the
    later two hitting the prefix's 35 full blocks (their window still cached)."""
    import gemmakit

    from kvcache_cli.models import load_model

    gemmakit.gemma3_or_skip()
    model = load_model("gemma3").model
    spec = WorkloadSpec(3, (50, 100), (4, 4), 560, None, 0)
    variants = serving_plan.variants(["paged"], ["decode-first"], [256], [0, 512])
    result = E.run_serve(model, spec, variants, 256 << 20)
    for e in result.engines:
        assert e.mismatches == () and e.requests_exact == 3, e.engine
        assert e.prefix_blocks_hit == 2 * 35 and e.hybrid.window_misses == 0
        assert e.hybrid.groups == {"sliding": 5, "full": 1}
