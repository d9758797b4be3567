"""A hybrid model's pool, quantised (`serve --kv-dtype`) and rolled back (speculative
decoding against the pool): the sliding groups' pages and the global groups' in int8/int4/
fp8 codes, and a rollback that finds every sliding window whole because the blocks that
leave it during a step's drafted tokens are given back only once they are accepted.
Every reply equals the solo greedy tokens of the same cache, prompts several windows long."""

from __future__ import annotations

import pytest
import torch
from gemmakit import random_gemma3
from test_serving_hybrid import BS, ROOMY, SPEC, W, gemma3_folder

from kvcache_cli.caches import RollbackError, make_cache
from kvcache_cli.caches.quantized_pool import pool_block_bytes
from kvcache_cli.generate import stream_tokens
from kvcache_cli.serving import engines as E
from kvcache_cli.serving import plan as serving_plan
from kvcache_cli.serving.hybrid_blocks import NULL, HybridBlockManager, kv_groups
from kvcache_cli.serving.hybrid_pool import make_hybrid_pool
from kvcache_cli.serving.pooled import PooledSequence
from kvcache_cli.serving.sequence import Request, Sequence
from kvcache_cli.serving.workload import make_requests
from kvcache_cli.speculative.decode import speculate
from kvcache_cli.speculative.drafts import Draft

pytestmark = pytest.mark.usefixtures("one_torch_thread")

QUANTISED = ["paged-int8", "paged-int4", "paged-fp8"]
INT8_NOISE = 5e-3  # a top-2 gap, of the largest logit, that a moved int8 code can flip


@pytest.fixture(scope="module")
def model():
    return random_gemma3(W)


def solo(model, requests, kind: str) -> dict[int, list[int]]:
    """Each request alone through `kind`'s blocks on every layer, the sliding layers
    banded to their window (`sliding="full"`): the same codes, one request at a time."""
    out = {}
    for r in requests:
        cache = make_cache(f"{kind}:b{BS}", model, len(r.prompt) + r.max_new_tokens,
                           sliding="full")
        out[r.id] = list(stream_tokens(model, list(r.prompt), r.max_new_tokens, "static",
                                       cache=cache))
    return out


# ---------------------------------------------------------------------------- quantised


@pytest.mark.parametrize("policy", ["prefill-first", "decode-first"])
@pytest.mark.parametrize("kind", QUANTISED)
def test_a_quantised_hybrid_pool_gives_every_request_its_solo_quantised_tokens(model, kind,
                                                                              policy):
    requests = make_requests(SPEC, model.config.vocab_size)
    reference = solo(model, requests, kind)
    plan = serving_plan.plan_memory(model.config, model.dtype, SPEC, ROOMY, BS, 64)
    variant = serving_plan.Variant(kind, policy, 16 if policy == "decode-first" else None,
                                   keep=0)
    result, _ = E.run_engine(variant, model, requests, SPEC, plan, BS, 64, True, reference)
    assert result.mismatches == () and result.requests_exact == SPEC.requests
    assert result.prefix_blocks_hit == 5 * (SPEC.requests - 1)
    assert result.hybrid.groups == {"sliding": 2, "full": 1}
    # A page holds BS tokens of one group's 2 layers in codes: a token takes one a group.
    page = pool_block_bytes(kind, model.config.cache_shape, BS, model.dtype) // 3
    assert result.hybrid.page_bytes == page
    assert result.pool_tokens == ROOMY // page * BS // 3


def test_a_tight_int4_pool_preempts_and_gives_back_what_left_the_window(model):
    requests = make_requests(SPEC, model.config.vocab_size)
    page = pool_block_bytes("paged-int4", model.config.cache_shape, BS, model.dtype) // 3
    variant = serving_plan.Variant("paged-int4", "decode-first", 16, keep=0)
    # 60 pages of codes: what the longest request (80 tokens) needs in 3 groups.
    plan = serving_plan.Plan(0, 1, 0, kv_mem=60 * page)
    result, _ = E.run_engine(variant, model, requests, SPEC, plan, BS, 64, True,
                             solo(model, requests, "paged-int4"))
    assert result.mismatches == () and result.preemptions > 0
    assert result.hybrid.peak_bytes["sliding"] < result.hybrid.peak_bytes["full"] * 2


def test_serve_kv_dtype_runs_on_a_hybrid_model_and_holds_more_tokens(folder):
    import json

    import servingkit

    run = servingkit.serve_cli("-m", str(folder), "--engines", "paged", "--kv-dtype",
                               "int8,int4", "--policy", "prefill-first", "--block-size", str(BS),
                               "--requests", "3",
                               "--prompt-len", "10:40", "--output-len", "4", "--json")
    assert run.exit_code == 0, run.output
    engines = {e["engine"].removesuffix(" pf"): e for e in json.loads(run.stdout)["engines"]}
    assert list(engines) == ["paged", "paged-int8", "paged-int4"]
    tokens = {name: e["pool_tokens"] for name, e in engines.items()}
    assert tokens["paged-int4"] > tokens["paged-int8"] > 3 * tokens["paged"]
    assert all(set(e["hybrid"]["peak_bytes"]) == {"full", "sliding"}
               for e in engines.values())


@pytest.fixture(scope="module")
def folder(tmp_path_factory, model):
    return gemma3_folder(tmp_path_factory.mktemp("gemma3"), model)


# ---------------------------------------------------------------------------- rollback

# 45 tokens: five windows and more
PROMPT = torch.randint(0, 211, (45,), generator=torch.Generator().manual_seed(1)).tolist()
NEW = 30


class Oracle(Draft):
    """Proposes the target's own next tokens with one changed, at a place that moves each
    step (none changed every fourth step): rejections at every depth, so rollbacks cut
    blocks, cross block bounds and follow steps whose tokens moved the window."""

    name = "oracle"

    def __init__(self, prompt: list[int], right: list[int]):
        self.prompt, self.right, self.steps = len(prompt), right, 0

    def propose(self, tokens, k, sampling, generator):
        out = list(self.right[len(tokens) - self.prompt:][:k])
        self.steps += 1
        wrong = self.steps % (k + 1)
        if wrong < len(out):
            out[wrong] = (out[wrong] + 1) % 200
        return out, None


def pooled(model, kind: str, prompt: list[int] = PROMPT, kv_mem: int = ROOMY,
           bs: int = BS) -> tuple[PooledSequence, HybridBlockManager]:
    """A sequence of `prompt` alone in a hybrid pool of `kind`, as a cache."""
    shape = model.config.cache_shape
    groups = kv_groups(shape)
    pool = make_hybrid_pool(kind, shape, groups, kv_mem, bs, model.device, model.dtype)
    manager = HybridBlockManager(pool.k.size(2), bs, groups, prefix_sharing=False)
    seq = Sequence(Request(0, tuple(prompt), NEW, 0.0))
    return PooledSequence(pool, manager, seq), manager


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("kind", ["paged", "paged-int8"])
def test_speculation_on_a_hybrid_pool_gives_the_solo_tokens(model, kind, k):
    right = solo(model, [Request(0, tuple(PROMPT), NEW, 0.0)], kind)[0]
    assert len(set(right)) > 8  # the tokens vary: agreement means something
    cache, manager = pooled(model, kind)
    got = speculate(model, PROMPT, NEW, Oracle(PROMPT, right), k, cache=cache)
    assert list(got.tokens) == right
    assert 0 < got.accepted < got.proposed  # some kept, some rolled back
    # The sliding groups gave back what left their window; every group holds its tail.
    seq = cache.seq
    assert seq.num_cached == len(PROMPT) + NEW - 1
    for group, table in zip(manager.groups, seq.group_tables):
        assert len(table) == manager.blocks_for(seq.num_cached)
        assert (NULL in table) == (group.window is not None)
    held = sum(b != NULL for t in seq.group_tables for b in t)
    assert manager.blocks_in_use == held
    assert cache.bytes_held == held * cache.pool.bytes_held // cache.pool.k.size(2)
    cache.reset()
    assert manager.blocks_in_use == 0


@pytest.mark.parametrize("k", [3, 6])
def test_speculation_with_its_own_cache_keeps_spare_ring_slots_and_the_solo_tokens(model, k):
    # Not the pool: speculate's own cache per request, whose sliding layers are rings of
    # the window. A ring that has wrapped rolls back one position unless it has spare slots;
    # speculate gives each ring k - 1, the draft (the target's first 3 layers) every position.
    from kvcache_cli.speculative.drafts import make_draft, parse_draft

    right = solo(model, [Request(0, tuple(PROMPT), NEW, 0.0)], "paged")[0]
    for spec in ("static", "paged"):
        got = speculate(model, PROMPT, NEW, Oracle(PROMPT, right), k, cache=spec)
        assert list(got.tokens) == right and 0 < got.accepted < got.proposed, spec
    draft = make_draft(parse_draft("layers:3"), model, len(PROMPT) + NEW)
    assert list(speculate(model, PROMPT, NEW, draft, k).tokens) == right


def test_a_rollback_past_what_the_window_gave_back_is_refused_in_one_line(model):
    cache, manager = pooled(model, "paged")
    with torch.inference_mode():
        model(torch.tensor([PROMPT]), 0, cache)
        model(torch.tensor([[1, 2, 3]]), len(PROMPT), cache)  # gives back before 45 - W + 1
    end = len(PROMPT) + 3
    cache.crop(len(PROMPT))  # to the tokens before the last forward: the window is whole
    with pytest.raises(RollbackError) as error:
        cache.crop(len(PROMPT) - W)
    assert "gave back" in str(error.value) and "\n" not in str(error.value)
    assert cache.length == len(PROMPT) and end > cache.length


# ---------------------------------------------------------------------------- the real file


def test_gemma3_270m_int8_pool_and_speculation_past_its_window():
    """The real file (`-m gemma3`; skips without its package): 3 requests sharing 560
    tokens, past the 512-token window, through an int8 hybrid pool, each reply equal to its
    solo int8 tokens, the later two hitting the prefix's 35 full blocks; then one of them
    decoded speculatively against a full-precision hybrid pool, equal to its solo tokens."""
    import gemmakit

    from kvcache_cli.models import load_model
    from kvcache_cli.serving.workload import WorkloadSpec

    gemmakit.gemma3_or_skip()
    model = load_model("gemma3").model
    spec = WorkloadSpec(3, (50, 100), (4, 4), 560, None, 0)
    requests = make_requests(spec, model.config.vocab_size)
    plan = serving_plan.plan_memory(model.config, model.dtype, spec, 256 << 20, 16, 64)
    variant = serving_plan.Variant("paged-int8", "decode-first", 256, keep=0)
    result, _ = E.run_engine(variant, model, requests, spec, plan, 16, 64, True,
                             solo(model, requests, "paged-int8"))
    # The engine prefills in chunks of 256 and from shared blocks, solo in one forward. Where
    # MKL's product of a row depends on the rows computed with it (an AVX2 EPYC: request 0
    # alone, prefilled in chunks of 256 or at once, parts at its second token), a key's
    # int8 code can move by one, and a greedy token can flip where its top-2 gap is within
    # that noise (measured there: 1.9e-3 of the largest logit, twice float32's `near_tie`).
    assert all(m.top2_gap <= INT8_NOISE * m.logit_scale for m in result.mismatches)
    assert result.prefix_blocks_hit == 2 * 35 and result.hybrid.window_misses == 0
    prompt = list(requests[0].prompt)
    right = solo(model, [Request(0, tuple(prompt), NEW, 0.0)], "paged")[0]
    cache, _ = pooled(model, "paged", prompt, 64 << 20, 16)
    got = speculate(model, prompt, NEW, Oracle(prompt, right), 4, cache=cache)
    assert list(got.tokens) == right and 0 < got.accepted < got.proposed
