"""Speculative decoding: greedy output equals plain greedy for every cache kind that rolls
back, any draft and K; the sampling rule keeps the target's distribution; the rollback
moves no history; the two breaks show their symptoms; bad drafts and K are refused."""

import dataclasses

import pytest
import torch
from cachekinds import example_spec, rollback_specs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcache_cli.breaks.speculative import run_no_rollback, run_rollback_shared
from kvcache_cli.caches import RollbackError, make_cache
from kvcache_cli.caches.paged import PagedCache
from kvcache_cli.caches.spec import KINDS
from kvcache_cli.models.gpt2 import GPT, GPTConfig
from kvcache_cli.serving.block_manager import BlockManager
from kvcache_cli.serving.pooled import PooledSequence
from kvcache_cli.serving.sequence import Request, Sequence
from kvcache_cli.speculative.decode import (
    _verify_sampled,
    check_speculation,
    compare,
    plain_greedy,
    speculate,
)
from kvcache_cli.speculative.drafts import (
    Draft,
    LookupDraft,
    Sampling,
    layer_draft,
    make_draft,
    parse_draft,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Head width 32, so quantised kinds' groups of 32 fit; a window of 128 positions, so a
# bounded kind of 64 + 64 fits and holds every position the tests write (at most 53).
CONFIG = GPTConfig(block_size=128, vocab_size=64, n_layer=4, n_head=2, n_embd=64)
# A prompt that repeats itself, so prompt lookup finds matches.
PROMPT = [5, 9, 2, 33, 7, 5, 9, 2, 40, 11, 5, 9, 2]


def _model(seed: int = 0) -> GPT:
    # A wide init (std 0.3) so the greedy tokens vary; float64 so a verification of k + 1
    # tokens and k + 1 one-token steps pick the same argmax (no float32 near-ties).
    return GPT(CONFIG, init_std=0.3, seed=seed).double().eval()


MODEL = _model()
PLAIN, _ = plain_greedy(MODEL, PROMPT, 40)


class Oracle(Draft):
    """Proposes the target's greedy token with probability p, else a random one."""

    def __init__(self, p: float, seed: int, truth=PLAIN, prompt=PROMPT):
        self.p, self.truth, self.P = p, truth, len(prompt)
        self.g = torch.Generator().manual_seed(seed)
        self.name = f"oracle:{p:.2f}"

    def propose(self, tokens, k, sampling, generator):
        out = []
        for i in range(k):
            right = self.truth[len(tokens) - self.P + i]
            if float(torch.rand((), generator=self.g)) < self.p:
                out.append(right)
            else:
                out.append(int(torch.randint(0, CONFIG.vocab_size, (), generator=self.g)))
        return out, None


class AlwaysWrong(Draft):
    name = "wrong"

    def propose(self, tokens, k, sampling, generator):
        right = PLAIN[len(tokens) - len(PROMPT):][:k]
        return [(t + 1) % CONFIG.vocab_size for t in right], None


def test_plain_greedy_tokens_vary_so_that_agreement_means_something():
    assert len(set(PLAIN)) >= 6


# ---------------------------------------------------------------------------- exactness


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=st.sampled_from(rollback_specs(64)), k=st.integers(1, 8),
       p=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_greedy_speculation_gives_plain_greedy_tokens_for_every_kind_and_k(spec, k, p, seed):
    plain = PLAIN if KINDS[spec.split(":")[0]].exact else plain_greedy(MODEL, PROMPT, 40, spec)[0]
    got = speculate(MODEL, PROMPT, 40, Oracle(p, seed), k, cache=spec)
    assert got.tokens == plain
    assert sum(got.histogram) == got.target_forwards - 1
    assert got.accepted == sum(n * c for n, c in enumerate(got.histogram))


@pytest.mark.parametrize("draft", ["lookup", "lookup:1", "layers:1", "layers:3", "model"])
@pytest.mark.parametrize("spec", rollback_specs(64))
def test_every_draft_gives_plain_greedy_tokens(draft, spec):
    if draft == "model":  # a smaller GPT of the same vocabulary
        small = GPT(dataclasses.replace(CONFIG, n_layer=2, n_embd=32), init_std=0.3,
                    seed=1).double().eval()
        d = make_draft(parse_draft("small"), MODEL, 60, small)
    else:
        d = make_draft(parse_draft(draft), MODEL, 60)
    exact = KINDS[spec.split(":")[0]].exact
    plain = PLAIN if exact else plain_greedy(MODEL, PROMPT, 40, spec)[0]
    for k in (1, 4, 8):
        assert speculate(MODEL, PROMPT, 40, d, k, cache=spec).tokens == plain, k


def test_a_perfect_draft_checks_k_tokens_per_forward():
    got = speculate(MODEL, PROMPT, 40, Oracle(1.0, 0), 4)
    assert got.tokens == PLAIN and got.acceptance_rate == 1.0
    # The prefill gives token 1; every step then 4 drafted + 1 bonus: 39 = 7 * 5 + 4.
    assert got.histogram == (0, 0, 0, 1, 7)
    assert got.target_forwards == 9


def test_an_always_wrong_draft_gives_the_targets_tokens_and_returns_every_block():
    manager = BlockManager(16, 4, prefix_sharing=False)
    pool = PagedCache(CONFIG.cache_shape, 16, 4, "cpu", torch.float64)
    seq = Sequence(Request(0, tuple(PROMPT), 40, 0.0))
    cache = PooledSequence(pool, manager, seq)
    got = speculate(MODEL, PROMPT, 40, AlwaysWrong(), 8, cache=cache)
    assert got.tokens == PLAIN and got.accepted == 0 and got.proposed > 0
    # Only the accepted positions keep blocks: the last token is chosen, never written.
    assert seq.num_cached == len(PROMPT) + 39
    assert manager.blocks_in_use == manager.blocks_for(len(PROMPT) + 39)
    cache.reset()
    assert manager.blocks_in_use == 0 and len(manager.free_blocks) == 16


@pytest.mark.parametrize("spec", ["static", "paged:b4"])
def test_rollback_copies_only_the_tokens_written_no_history(spec):
    # Every byte a cache moved is a token a forward wrote: the prompt, then each step's
    # pending token and its drafted ones. A rollback adds nothing.
    cache = make_cache(spec, MODEL, len(PROMPT) + 40)
    got = speculate(MODEL, PROMPT, 40, AlwaysWrong(), 6, cache=cache)
    per_token = 2 * CONFIG.n_layer * CONFIG.n_embd * 8  # K and V, every layer, float64
    written = len(PROMPT) + got.proposed + (got.target_forwards - 1)
    assert got.cache_bytes_copied == written * per_token


def test_lookup_proposes_what_followed_the_latest_earlier_match():
    draft = LookupDraft(3)
    tokens = [1, 2, 3, 4, 8, 2, 3, 5, 6, 7, 9, 2, 3]
    assert draft.propose(tokens, 3, Sampling(), None)[0] == [5, 6, 7]
    assert draft.propose(tokens + [99], 3, Sampling(), None)[0] == []
    assert draft.propose([4, 4], 5, Sampling(), None)[0] == [4]
    # In a run the latest match has one token after it; an earlier one has k.
    assert draft.propose([7] * 10, 4, Sampling(), None)[0] == [7, 7, 7, 7]


def test_a_self_draft_shares_the_targets_first_layers_and_head():
    draft = layer_draft(MODEL, 2)
    assert draft.config.n_layer == 2 and len(draft.transformer.h) == 2
    assert draft.transformer.h[1] is MODEL.transformer.h[1]
    assert draft.lm_head.weight.data_ptr() == MODEL.lm_head.weight.data_ptr()
    assert MODEL.config.n_layer == 4


def test_compare_sweeps_k_and_names_the_best():
    run = compare(MODEL, PROMPT, 24, LookupDraft(), [1, 2, 4])
    assert [r.k for r in run.runs] == [1, 2, 4] and all(run.identical)
    assert run.best_k in (1, 2, 4) and run.best_speedup == max(run.speedups)
    assert run.plain_tokens_per_s > 0


# ---------------------------------------------------------------------------- sampling


def test_the_acceptance_rule_draws_from_the_targets_distribution():
    # One drafted token from q, accepted with min(1, p/q) or replaced from
    # norm(max(0, p - q)): the token that comes out follows p.
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5], [0.0] * 5], dtype=torch.float64)
    q = torch.tensor([0.05, 0.5, 0.3, 0.1, 0.05], dtype=torch.float64)
    sampling = Sampling(temperature=1.0)
    p = sampling.probs(logits)[0]
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(5, dtype=torch.float64)
    n = 6000
    for _ in range(n):
        d = int(torch.multinomial(q, 1, generator=g))
        accepted, token = _verify_sampled(logits, [d], q[None], sampling, g)
        counts[d if accepted else token] += 1
    # 6000 draws: a frequency's standard error is at most 0.0065; 4 of them is 0.026.
    torch.testing.assert_close(counts / n, p, rtol=0, atol=0.026)


def test_sampled_speculation_runs_with_every_draft_and_is_seeded():
    for draft in (LookupDraft(), make_draft(parse_draft("layers:2"), MODEL, 60)):
        runs = [speculate(MODEL, PROMPT, 30, draft, 4, sampling=Sampling(0.8, 20),
                          generator=torch.Generator().manual_seed(7)) for _ in range(2)]
        assert runs[0].tokens == runs[1].tokens and len(runs[0].tokens) == 30


# ---------------------------------------------------------------------------- breaks


def test_no_rollback_leaves_plain_greedy_on_concat():
    result = run_no_rollback(MODEL, PROMPT, 40, Oracle(0.5, 3), k=4)
    assert result.fixed == result.correct
    assert result.first_divergence is not None and result.broken != result.correct
    assert result.acceptance_fixed > 0


@pytest.mark.parametrize("spec", ["static", "paged:b4"])
def test_explicit_positions_make_a_forgotten_rollback_harmless(spec):
    # The next verification overwrites the rejected slots, and reads stop at its end.
    got = speculate(MODEL, PROMPT, 40, Oracle(0.5, 3), 4, cache=spec, rollback=False)
    assert got.tokens == PLAIN


def test_rollback_shared_corrupts_the_other_sequence_and_the_fix_refuses_or_waits():
    result = run_rollback_shared(MODEL)
    assert result.reader_fixed == result.reader_solo
    assert result.first_divergence is not None
    assert not result.third_admitted_fixed and result.third_admitted_broken
    assert result.refused.startswith("cannot roll back to 5 positions: block")


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(("text", "message"), [
    ("lookup:0", "draft 'lookup:0': the longest n-gram '0' is not a whole number from 1 to 16"),
    ("layers:x", "draft 'layers:x': the number of layers 'x' is not a whole number"),
    ("", "empty draft: expected a GPT-2 preset"),
])
def test_a_bad_draft_is_refused_in_one_line(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        parse_draft(text)


@pytest.mark.parametrize(("k", "message"), [
    (0, "--speculate 0: expected K from 1 to 127"),
    (128, "--speculate 128: expected K from 1 to 127"),
])
def test_k_outside_one_to_the_window_is_refused(k, message):
    with pytest.raises(ValueError, match=message):
        check_speculation(CONFIG, parse_draft("lookup"), None, k, "static")


def test_a_draft_of_another_vocabulary_is_refused():
    other = dataclasses.replace(CONFIG, vocab_size=65, n_layer=1)
    with pytest.raises(ValueError, match="draft d has a vocabulary of 65 tokens, the target 64"):
        check_speculation(CONFIG, parse_draft("d"), other, 4, "static")


def test_a_draft_larger_than_the_target_is_allowed_with_a_note():
    big = dataclasses.replace(CONFIG, n_layer=8)
    note = check_speculation(CONFIG, parse_draft("big"), big, 4, "static")
    assert note is not None and "not smaller than the target" in note
    assert check_speculation(CONFIG, parse_draft("big"), CONFIG.__class__(
        **{**dataclasses.asdict(CONFIG), "n_layer": 1}), 4, "static") is None


def test_a_self_draft_as_deep_as_the_target_is_refused():
    with pytest.raises(ValueError, match="the target has 4 layers; expected layers:N with N "
                                         "from 1 to 3"):
        check_speculation(CONFIG, parse_draft("layers:4"), None, 2, "static")


def test_a_cache_that_cannot_roll_back_is_refused_before_anything_runs(monkeypatch):
    ring = dataclasses.replace(KINDS["static"], name="ring", rollback="")
    monkeypatch.setitem(KINDS, "ring", ring)
    with pytest.raises(RollbackError, match="^cache ring cannot roll back, which speculative "
                                            "decoding needs: expected one of static"):
        check_speculation(CONFIG, parse_draft("lookup"), None, 4, "ring")


def test_example_specs_cover_every_registered_kind():
    assert {s.split(":")[0] for s in rollback_specs()} == {
        n for n, k in KINDS.items() if k.rollback}
    assert example_spec("paged") == "paged:b16"


def test_a_sampled_sweep_claims_no_agreement_with_plain_greedy_and_renders():
    from rich.console import Console

    from kvcache_cli.views.speculative import spec_run_view

    run = compare(MODEL, PROMPT, 16, LookupDraft(), [2, 3], sampling=Sampling(0.8))
    assert run.identical == () and not run.greedy and len(run.runs) == 2
    console = Console(width=100, record=True, file=None)
    with console.capture() as captured:
        console.print(spec_run_view(run))
    assert "sampled" in captured.get() and "best K" in captured.get()


def test_a_ring_that_would_wrap_refuses_k_above_one_before_anything_runs():
    with pytest.raises(RollbackError, match=r"^cache window:16 holds 16 positions and this "
                       r"request writes 53: once it wraps it rolls back one position at most"):
        speculate(MODEL, PROMPT, 40, Oracle(0.5, 0), 4, cache="window:16")
    # One token a step never rolls back more than one position: the ring keeps up.
    got = speculate(MODEL, PROMPT, 40, Oracle(0.5, 0), 1, cache="window:16")
    assert got.tokens == plain_greedy(MODEL, PROMPT, 40, "window:16")[0]
    # Spare slots reach further back: k of 4 on a ring with 3 (N + 1 = 4) runs.
    got = speculate(MODEL, PROMPT, 40, Oracle(0.5, 0), 4, cache="window:16:k3")
    assert got.tokens == plain_greedy(MODEL, PROMPT, 40, "window:16:k3")[0]
    with pytest.raises(RollbackError, match=r"rolls back 4 positions at most, and "
                                            r"--speculate 5 may reject 5"):
        speculate(MODEL, PROMPT, 40, Oracle(0.5, 0), 5, cache="window:16:k3")


def test_h2o_cannot_roll_back_and_is_refused_in_one_line():
    assert not KINDS["h2o"].rollback
    with pytest.raises(RollbackError, match="^cache h2o:8\\+8 cannot roll back"):
        check_speculation(CONFIG, parse_draft("lookup"), None, 4, "h2o:8+8")
