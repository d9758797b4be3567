"""The bounded caches: window:W, sink:S+W, h2o:H+W.

Each is checked against something computed without it: the full cache where nothing
is evicted, a no-cache forward under an explicit band mask where something is, and a
plain-Python replay of H2O's policy for the positions it keeps.
"""

import math

import decoding
import pytest
import torch
import torch.nn.functional as F
from decoding import decode_logits

from kvcache_cli.caches import RollbackError, make_cache
from kvcache_cli.caches.grammar import CacheSpecError
from kvcache_cli.caches.spec import check_context, layer_bytes, parse_cache_spec
from kvcache_cli.models.gpt2 import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = GPTConfig(block_size=64, vocab_size=96, n_layer=2, n_head=4, n_embd=32)
# float64: the cache and the reference run the same sums in a different order.
EXACT = 1e-12
# float32 rounding of the same sums in a different order (the target's 1e-5).
FLOAT32 = 1e-5


def model(dtype=torch.float64) -> GPT:
    return GPT(CONFIG, init_std=0.3, seed=0).to(dtype).eval()


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    return decoding.tokens(n, CONFIG.vocab_size, seed)  # (1, n)



def banded_logits(m: GPT, idx: torch.Tensor, window: int, sinks: int = 0) -> torch.Tensor:
    """Logits of a no-cache forward whose attention is written out here under an explicit
    band mask: query i sees key j when j <= i and (j > i - window or j < sinks)."""
    T = idx.size(1)
    i = torch.arange(T)[:, None]  # (T, 1)
    j = torch.arange(T)[None, :]  # (1, T)
    band = (j <= i) & ((j > i - window) | (j < sinks))  # (T, T)
    t = m.transformer
    with torch.no_grad():
        x = t.wte(idx) + t.wpe(torch.arange(T))  # (1, T, C)
        for block in t.h:
            a = block.attn
            C, nh = x.size(-1), a.n_head
            q, k, v = a.c_attn(block.ln_1(x)).split(C, dim=2)
            q, k, v = (z.view(1, T, nh, C // nh).transpose(1, 2) for z in (q, k, v))
            scores = q @ k.transpose(-2, -1) / math.sqrt(C // nh)  # (1, nh, T, T)
            y = scores.masked_fill(~band, float("-inf")).softmax(-1) @ v  # (1, nh, T, hs)
            x = x + a.c_proj(y.transpose(1, 2).reshape(1, T, C))
            x = x + block.mlp(block.ln_2(x))
        return m.lm_head(t.ln_f(x))  # (1, T, vocab)


# ---------------------------------------------------------------------------- specs


@pytest.mark.parametrize("text, canonical, held", [
    ("window:256", "window:256", 256), ("SINK:4+252", "sink:4+252", 256),
    ("h2o:128+128", "h2o:128+128", 256)])
def test_bounded_specs_parse_and_spell_back(text, canonical, held):
    spec = parse_cache_spec(text)
    assert str(spec) == canonical and parse_cache_spec(canonical) == spec
    assert spec.info.bounded and spec.info.budget(dict(spec.params)) == held


@pytest.mark.parametrize("text, message", [
    ("window:0", "window '0' is not a whole number from 1"),
    ("window", "expected window:W"),
    ("window:8:9", "expected window:W"),
    ("sink:4", "expected sink:S\\+W"),
    ("sink:4+0", "window '0' is not a whole number from 1"),
    ("sink:0+8", "no sinks; expected at least 1, or window:8"),
    ("sink:9+8", "more sinks \\(9\\) than window slots \\(8\\)"),
    ("h2o:x+8", "heavy hitters 'x' is not a whole number"),
    ("h2o:8", "expected h2o:H\\+W"),
])
def test_a_bad_bounded_spec_is_refused_in_one_line(text, message):
    with pytest.raises(CacheSpecError, match=message) as error:
        parse_cache_spec(text)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("text", ["window:1025", "sink:4+1021", "h2o:600+600"])
def test_a_budget_beyond_the_context_window_is_refused(text):
    with pytest.raises(CacheSpecError, match="beyond gpt2's context window of 1,024"):
        check_context(parse_cache_spec(text), 1024, "gpt2")
    check_context(parse_cache_spec("window:1024"), 1024, "gpt2")  # the whole window: fine


@pytest.mark.parametrize("text", ["window:12", "sink:3+9", "h2o:5+7"])
@pytest.mark.parametrize("max_len", [8, 40])
def test_layer_bytes_equal_what_the_cache_holds(text, max_len):
    m = model()
    cache = make_cache(text, m, max_len)
    c = CONFIG
    formula = c.n_layer * layer_bytes(parse_cache_spec(text), max_len, c.n_head, c.head_size, 8)
    assert cache.bytes_held == formula
    if max_len > 12:  # the budget, whatever the sequence: 12 positions
        assert formula == c.n_layer * layer_bytes(parse_cache_spec(text), 12, c.n_head,
                                                  c.head_size, 8)


# ---------------------------------------------------------------------------- window, sink


@pytest.mark.parametrize("text", ["window:24", "window:40", "sink:2+22", "h2o:8+16"])
def test_a_budget_at_least_the_sequence_equals_the_full_cache_exactly(text):
    m, idx = model(), tokens(24)
    full = decode_logits(m, None, idx, 24)
    bounded = decode_logits(m, make_cache(text, m, 24), idx, 7)
    assert full.abs().max() > 1  # logits that vary: agreement means something
    assert (bounded - full).abs().max().item() <= EXACT


def test_a_window_at_least_the_sequence_equals_the_full_cache_in_float32():
    m, idx = model(torch.float32), tokens(24, seed=5)
    full = decode_logits(m, None, idx, 24)
    window = decode_logits(m, make_cache("window:24", m, 24), idx, 7)
    assert (window - full).abs().max().item() <= FLOAT32


@pytest.mark.parametrize("text, window, sinks", [
    ("window:8", 8, 0), ("window:5", 5, 0), ("sink:2+6", 6, 2), ("sink:1+9", 9, 1)])
@pytest.mark.parametrize("prefill", [1, 3, 20])  # before the ring fills, and long past it
def test_a_wrapped_ring_equals_attention_under_a_band_mask(text, window, sinks, prefill):
    m, idx = model(), tokens(40, seed=6)
    cache = make_cache(text, m, 40)
    ring = decode_logits(m, cache, idx, prefill)
    band = banded_logits(m, idx, window, sinks)
    assert cache.evicted == 40 - window - sinks  # it did wrap
    assert (ring - band).abs().max().item() <= EXACT
    # ... and differs from full attention, so the band is what was checked.
    assert (ring - decode_logits(m, None, idx, 40)).abs().max().item() > 1e-3


@pytest.mark.parametrize("text, sinks, window", [("sink:3+5", 3, 5), ("sink:1+4", 1, 4)])
def test_sink_tokens_survive_every_eviction(text, sinks, window):
    m, idx = model(), tokens(30, seed=7)
    cache = make_cache(text, m, 30)
    with torch.no_grad():
        m(idx[:, :2], 0, cache)
        for p in range(2, 30):
            m(idx[:, p:p + 1], p, cache)
            held = cache.key_positions(0).tolist()
            assert held[:sinks] == list(range(sinks)), p  # in their slots, for good
            recent = range(max(sinks, p - window + 1), p + 1)
            assert sorted(held) == [*range(min(sinks, p + 1)), *recent], p


def test_bytes_held_stay_constant_after_the_budget():
    m, idx = model(torch.float32), tokens(60, seed=8)
    cache = make_cache("sink:2+10", m, 60)
    seen = []
    with torch.no_grad():
        for p in range(60):
            m(idx[:, p:p + 1], p, cache)
            seen.append(cache.bytes_held)
    assert set(seen) == {CONFIG.n_layer * 2 * 12 * CONFIG.n_embd * 4}
    assert cache.evicted == 60 - 12


def test_a_window_crops_exactly_before_it_wraps_and_one_position_after():
    m, idx, wrong = model(), tokens(30, seed=9), tokens(5, seed=10)
    cache = make_cache("window:12", m, 30)
    with torch.no_grad():
        m(idx[:, :6], 0, cache)
        m(wrong, 6, cache)  # 11 positions: nothing evicted yet
        cache.crop(6)
        after = torch.cat([m(idx[:, p:p + 1], p, cache) for p in range(6, 20)], dim=1)
        cache.crop(19)  # one back after wrapping: still exact
        last = m(idx[:, 19:20], 19, cache)
    band = banded_logits(m, idx[:, :20], 12)
    assert (after - band[:, 6:]).abs().max().item() <= EXACT
    assert (last - band[:, 19:]).abs().max().item() <= EXACT
    with pytest.raises(RollbackError, match="cannot crop from 20 to 15 positions: position 4, "
                                            "which the token at 15 attends, was overwritten"):
        cache.crop(15)


def test_a_ring_refuses_positions_out_of_order():
    m = model()
    cache = make_cache("window:8", m, 20)
    with torch.no_grad():
        m(tokens(4), 0, cache)
        with pytest.raises(ValueError, match="expected position 4, got 6"):
            m(tokens(1), 6, cache)


# ---------------------------------------------------------------------------- h2o


def replay_h2o(scores: torch.Tensor, heavy: int, recent: int) -> list[list[set[int]]]:
    """H2O's policy in plain Python, per head: before position p is written to a full
    cache, the held position <= p - recent with the least accumulated attention goes;
    then every held position adds what the query at p gave it (scores[h][p][j])."""
    nh, T, _ = scores.shape
    out = []
    for h in range(nh):
        held: dict[int, float] = {}
        steps = []
        for p in range(T):
            if len(held) == heavy + recent:
                old = [j for j in held if j <= p - recent]
                del held[min(old, key=lambda j: held[j])]
            held[p] = 0.0
            for j in held:
                held[j] += float(scores[h, p, j])
            steps.append(set(held))
        out.append(steps)
    return out


def test_h2o_keeps_the_positions_an_independent_replay_of_its_policy_keeps():
    from kvcache_cli.caches.bounded import HeavyHitterCache

    heavy, recent, T, nh, hs = 3, 2, 20, CONFIG.n_head, CONFIG.head_size
    g = torch.Generator().manual_seed(11)
    given = torch.rand(nh, T, T, generator=g, dtype=torch.float64)  # what p gives j
    cache = HeavyHitterCache(CONFIG, heavy, recent, T, 1, "cpu", torch.float32, "h2o:3+2")
    expected = replay_h2o(given, heavy, recent)
    for p in range(T):
        k = torch.randn(1, nh, 1, hs, generator=g)
        cache.update(0, p, k, k)
        pos = cache.key_positions(0)[0]  # (nh, S): the positions the query at p sees
        for h in range(nh):
            assert set(pos[h].tolist()) == expected[h][p], (p, h)
        weights = given[:, p].gather(1, pos).float()  # (nh, S): what p gives each slot
        cache.observe(0, weights[None, :, None, :])  # (1, nh, 1, S)
    assert cache.evicted == T - heavy - recent


def test_h2o_heads_keep_different_positions_on_a_model():
    m, idx = model(), tokens(40, seed=12)
    cache = make_cache("h2o:4+4", m, 40)
    decode_logits(m, cache, idx, 1)
    pos = cache.key_positions(1)[0]  # (nh, 8)
    assert pos.shape == (CONFIG.n_head, 8)
    for h in range(CONFIG.n_head):  # every head keeps its 4 newest, 4 heavy hitters
        assert set(range(36, 40)) <= set(pos[h].tolist())
    assert len({tuple(sorted(p.tolist())) for p in pos}) > 1


def test_h2o_after_a_long_prompt_keeps_the_recent_window_and_the_top_scores():
    # A prompt longer than the budget: attended in full, then cut to the W newest
    # and the H positions that drew the most attention (checked on raw weights).
    m, idx = model(), tokens(20, seed=13)
    cache = make_cache("h2o:3+4", m, 20)
    seen = {}
    observe = cache.observe

    def spy(layer, weights):
        seen[layer] = weights.sum(dim=2)[0].clone()  # (nh, 20): attention each key drew
        observe(layer, weights)

    cache.observe = spy
    with torch.no_grad():
        m(idx, 0, cache)
    for layer in range(CONFIG.n_layer):
        kept = cache.key_positions(layer)[0]  # (nh, 7)
        for h in range(CONFIG.n_head):
            top = seen[layer][h, :16].topk(3).indices.tolist()
            assert set(kept[h].tolist()) == {*top, 16, 17, 18, 19}


def test_h2o_refuses_to_crop_into_its_past():
    m = model()
    cache = make_cache("h2o:2+2", m, 10)
    with torch.no_grad():
        m(tokens(6), 0, cache)
    cache.crop(6)  # its own length: nothing to forget
    with pytest.raises(RollbackError, match="h2o:2\\+2 cannot crop from 6 to 5 positions"):
        cache.crop(5)


def test_a_ring_chunk_gives_the_logits_of_one_token_a_step():
    # The band is the mask's job for a chunk, so chunk size changes nothing.
    m, idx = model(), tokens(30, seed=14)
    stepwise = decode_logits(m, make_cache("sink:2+5", m, 30), idx, 1)
    cache = make_cache("sink:2+5", m, 30)
    with torch.no_grad():
        chunks = torch.cat([m(idx[:, a:a + 10], a, cache) for a in (0, 10, 20)], dim=1)
    assert (chunks - stepwise).abs().max().item() <= EXACT


def test_sdpa_and_explicit_weights_agree_for_the_mask_a_ring_reports():
    # The same band through SDPA (ring) and through explicit softmax (the reference):
    # the mask the model builds is the band, not an accident of one kernel.
    q = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    k = torch.randn(1, 2, 5, 4, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0, 1], [0, 1, 1, 0, 1], [0, 0, 1, 1, 1]], dtype=torch.bool)
    a = F.scaled_dot_product_attention(q, k, k, attn_mask=mask)
    b = (q @ k.transpose(-2, -1) / 2).masked_fill(~mask, float("-inf")).softmax(-1) @ k
    assert (a - b).abs().max().item() <= EXACT


# ---------------------------------------------------------------------------- breaks


@pytest.mark.parametrize("name, wrong", [
    # budget 12 (half of 9 + 16 positions): position 12 is the first the window evicts
    # for, position 11 the first whose late slot held a live key. Step i reads position
    # 8 + i (step 0: the prompt's last).
    ("evict-sink", 4), ("ring-mask", 4), ("ring-off-by-one", 3)])
def test_each_bounded_break_goes_wrong_where_the_ring_first_loses_a_key(name, wrong):
    from kvcache_cli.breaks.bounded import run_bounded_break

    m = model(torch.float32)
    r = run_bounded_break(name, m, max_new_tokens=16)
    assert r.budget == 12 and r.naive_agrees  # the fix equals its band, recomputed
    assert r.naive_logit_diff <= FLOAT32 * r.max_abs_logit
    assert r.first_wrong_step == wrong
    assert max(r.step_logit_diff[:wrong]) <= FLOAT32 * r.max_abs_logit
    assert r.step_logit_diff[wrong] > 0.1
    assert r.first_divergence is not None and r.first_divergence >= wrong
    assert r.kl_broken > r.kl_fix  # worse than the fix against the full cache


def test_bounded_breaks_render_their_budget_and_kl():
    from rich.console import Console

    from kvcache_cli.breaks.bounded import run_bounded_break
    from kvcache_cli.views.generate import break_view

    console = Console(width=120, record=True)
    result = run_bounded_break("ring-mask", model(torch.float32), max_new_tokens=16)
    console.print(break_view(result))
    text = console.export_text()
    assert "budget 12 positions; logits first move past rounding at step 4" in text
    assert "every position under the band mask" in text


# ---------------------------------------------------------------------------- spare slots


def test_spare_slots_let_a_wrapped_ring_crop_n_plus_one_back_exactly():
    m, idx, wrong = model(), tokens(40, seed=15), tokens(5, seed=16)
    spec = parse_cache_spec("window:8:K3")
    assert str(spec) == "window:8:k3" and spec.info.budget(dict(spec.params)) == 11
    cache = make_cache(spec, m, 40)
    with torch.no_grad():
        m(idx[:, :20], 0, cache)  # wrapped: 20 positions through 11 slots
        m(wrong[:, :4], 20, cache)
        cache.crop(20)  # 4 back: within spare + 1
        after = torch.cat([m(idx[:, p:p + 1], p, cache) for p in range(20, 30)], dim=1)
    band = banded_logits(m, idx[:, :30], 8)  # the spare slots change nothing attention sees
    assert (after - band[:, 20:]).abs().max().item() <= EXACT
    assert cache.bytes_held == CONFIG.n_layer * layer_bytes(spec, 40, CONFIG.n_head,
                                                            CONFIG.head_size, 8)
    with torch.no_grad():
        m(wrong, 30, cache)
    with pytest.raises(RollbackError, match="rolls back 4; spare slots"):
        cache.crop(30)  # 5 back: one too many


@pytest.mark.parametrize("text, message", [
    ("window:8:x3", "unknown field 'x3'; expected window:W\\[:kN\\]"),
    ("window:k3", "expected window:W first"),
    ("sink:4+8:k", "spare slots '' is not a whole number"),
    ("h2o:4+4:k2", "unknown field 'k2'; expected h2o:H\\+W"),
])
def test_a_bad_spare_field_is_refused_in_one_line(text, message):
    with pytest.raises(CacheSpecError, match=message):
        parse_cache_spec(text)


def test_speculative_decoding_runs_on_a_window_with_spare_slots():
    from kvcache_cli.speculative.decode import plain_greedy, speculate
    from kvcache_cli.speculative.drafts import make_draft, parse_draft

    m = model()
    prompt = [5, 9, 2, 33, 7, 5, 9, 2, 40, 11, 5, 9, 2]
    plain = plain_greedy(m, prompt, 40, "window:16:k8")[0]
    draft = make_draft(parse_draft("layers:1"), m, 60)
    for k in (1, 4, 8):  # up to k + 1 positions rolled back after the ring wraps
        assert speculate(m, prompt, 40, draft, k, cache="window:16:k8").tokens == plain, k
