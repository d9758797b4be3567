"""The quality harness: exact caches score as the exact cache, perplexity is the full
forward's, a damaged cache shows its damage, and the first token's attention share is
what attention computes."""

import math

import pytest
import torch

from kvcache_cli.caches.base import PositionedCache
from kvcache_cli.caches.exact import StaticCache
from kvcache_cli.eval.quality import CacheMaker, check_eval, evaluate, first_token_share
from kvcache_cli.models.gpt2 import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = GPTConfig(block_size=128, vocab_size=96, n_layer=2, n_head=4, n_embd=32)
N, PROMPT = 72, 16
# KL is computed in float64 from log-softmax: caches that store the same keys agree to
# float rounding, far below this.
KL_EXACT = 1e-10


def tiny_model() -> GPT:
    # A wider init than GPT-2's 0.02, so the predictions vary and a damaged cache shows.
    return GPT(CONFIG, init_std=0.3, seed=0).eval()


def text_ids(n: int = N, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG.vocab_size, (n,), generator=g).tolist()


class NoisyKeys(StaticCache):
    """The static cache with seeded noise added to every key it stores."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.noise = torch.Generator().manual_seed(1)

    def attend(self, layer, q, k, v, step):
        # here, not in `update`: a decoding token's write bypasses it (`StaticCache.decode`)
        k = k + 0.5 * torch.randn(k.shape, generator=self.noise, dtype=k.dtype)
        return super().attend(layer, q, k, v, step)


def noisy(model: GPT, max_len: int) -> NoisyKeys:
    return NoisyKeys(model.config, max_len, 1, model.device, model.dtype)


@pytest.mark.parametrize("chunk", [1, 5])
def test_exact_caches_score_kl_zero_and_agree_on_every_top1(chunk):
    result = evaluate(tiny_model(), text_ids(), ["concat", "paged:b16"], prompt_len=PROMPT,
                      chunk=chunk)
    assert [c.cache for c in result.caches] == ["static", "concat", "paged:b16"]
    for row in result.caches:
        assert row.kl_mean <= KL_EXACT and row.kl_max <= KL_EXACT, row
        assert row.top1_agreement == 1.0, row
        # static's one-token steps run the native decode call (`StaticCache.decode`), the
        # others SDPA: the same float32 arithmetic summed in another order, which moves the
        # perplexity by some 5e-8 of itself (float32's unit roundoff is 6e-8)
        assert row.perplexity == pytest.approx(result.caches[0].perplexity, rel=1e-6)


def test_perplexity_is_exp_of_the_mean_nll_of_a_full_forward():
    model, ids = tiny_model(), text_ids()
    with torch.no_grad():
        logits = model(torch.tensor(ids)[None], 0)[0].double()  # (N, vocab), no cache
    logp = torch.log_softmax(logits, -1)
    targets = torch.tensor(ids[PROMPT:])
    nll = -logp[PROMPT - 1:-1].gather(1, targets[:, None])[:, 0]  # (N - PROMPT,)
    result = evaluate(model, ids, ["static"], prompt_len=PROMPT)
    (row,) = result.caches
    # float32 logits from a decode step and from one full forward differ by ~1e-6.
    assert row.perplexity == pytest.approx(math.exp(nll.mean().item()), rel=1e-5)
    assert row.bits_per_token == pytest.approx(nll.mean().item() / math.log(2), rel=1e-5)
    torch.testing.assert_close(torch.tensor(row.loss_by_position, dtype=torch.float64), nll,
                               rtol=1e-5, atol=1e-5)


def test_a_damaged_cache_shows_kl_above_zero_and_a_different_perplexity():
    result = evaluate(tiny_model(), text_ids(), [CacheMaker("noisy", noisy)],
                      prompt_len=PROMPT)
    exact, damaged = result.cache("static"), result.cache("noisy")
    assert damaged.kl_mean > 1e-3 and damaged.kl_max >= damaged.kl_mean
    assert damaged.perplexity != pytest.approx(exact.perplexity, rel=1e-3)
    assert damaged.perplexity_change == pytest.approx(
        damaged.perplexity / exact.perplexity - 1, rel=1e-9)
    assert PROMPT <= damaged.kl_max_position < N
    assert damaged.top1_agreement < 1.0


class LastKeys(PositionedCache):
    """Only the newest `keep` positions of each layer, their positions reported: a window
    written for this test, so the harness is seen to score a cache whose key j is not
    position j."""

    def __init__(self, keep: int):
        self.keep, self.k, self.v, self.pos = keep, {}, {}, {}
        self.length, self.bytes_copied = 0, 0

    def update(self, layer, start_pos, k, v):
        self.length = start_pos + k.size(2)
        new = torch.arange(start_pos, self.length)
        if layer in self.k:
            k = torch.cat([self.k[layer], k], dim=2)
            v = torch.cat([self.v[layer], v], dim=2)
            new = torch.cat([self.pos[layer], new])
        # This step's queries see every key they saw before it was cut: return all of it,
        # keep only the newest for the next step.
        self.k[layer], self.v[layer] = k[:, :, -self.keep:], v[:, :, -self.keep:]
        self.pos[layer] = new[-self.keep:]
        self.returned = new
        return k, v

    def key_positions(self, layer):
        return self.returned

    @property
    def bytes_held(self):
        return sum(t.numel() * t.element_size() for t in [*self.k.values(), *self.v.values()])


def test_loss_by_position_departs_from_exact_where_a_window_starts_dropping_keys():
    keep = 32
    result = evaluate(tiny_model(), text_ids(), [CacheMaker("last32", lambda m, n: LastKeys(
        keep))], prompt_len=PROMPT)
    exact, window = result.cache("static"), result.cache("last32")
    # The query at position q sees the `keep` kept keys and its own: all of 0 .. q while
    # q <= keep. It predicts token q + 1, so tokens up to keep + 1 score as exact.
    same = [a == pytest.approx(b, rel=1e-5, abs=1e-6) for a, b in
            zip(exact.loss_by_position, window.loss_by_position, strict=True)]
    first_wrong = PROMPT + same.index(False)
    assert first_wrong == keep + 2
    assert window.bytes_per_token < exact.bytes_per_token and window.kl_mean > 0


def test_the_reference_is_always_first_and_listed_once():
    result = evaluate(tiny_model(), text_ids(), ["paged", "full"], prompt_len=PROMPT)
    assert [(c.cache, c.reference) for c in result.caches] == [
        ("static", True), ("paged:b16", False)]


def test_bytes_per_token_are_the_cache_s_own_count_over_the_positions_written():
    result = evaluate(tiny_model(), text_ids(), ["paged:b16"], prompt_len=PROMPT)
    static, paged = result.caches
    # K and V, every layer, float32: the exact cache's cost of a token.
    assert static.bytes_per_token == 2 * CONFIG.n_layer * CONFIG.n_embd * 4
    assert static.positions == paged.positions == N - 1  # the last token is never fed
    # Paged holds whole blocks: 71 positions take 5 blocks of 16.
    assert paged.bytes_held == 5 * 16 * 2 * CONFIG.n_layer * CONFIG.n_embd * 4
    assert paged.bytes_ratio == pytest.approx(80 / 71)


def test_loss_by_position_has_one_entry_per_scored_token():
    result = evaluate(tiny_model(), text_ids(), ["concat"], prompt_len=PROMPT, chunk=3)
    assert result.scored == N - PROMPT
    for row in result.caches:
        assert len(row.loss_by_position) == N - PROMPT
        mean = sum(row.loss_by_position) / len(row.loss_by_position)
        assert math.exp(mean) == pytest.approx(row.perplexity, rel=1e-12)


def test_first_token_share_is_what_layer_zero_attention_gives_the_first_token():
    model, ids = tiny_model(), text_ids()
    shares, uniform = first_token_share(model, ids, PROMPT)
    # Layer 0's attention by hand: embeddings, ln_1, q and k, a causal softmax.
    fed = torch.tensor(ids[:-1])
    with torch.no_grad():
        h = model.transformer.h[0]
        x = model.transformer.wte(fed) + model.transformer.wpe(torch.arange(len(fed)))
        q, k, _ = h.attn.c_attn(h.ln_1(x)).split(CONFIG.n_embd, dim=1)  # each (T, C)
        hs = CONFIG.head_size
        q = q.view(-1, CONFIG.n_head, hs).transpose(0, 1)  # (nh, T, hs)
        k = k.view(-1, CONFIG.n_head, hs).transpose(0, 1)  # (nh, T, hs)
        scores = (q @ k.transpose(1, 2)).double() / math.sqrt(hs)  # (nh, T, T)
        causal = torch.ones(len(fed), len(fed), dtype=torch.bool).tril()
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    expected = weights[:, PROMPT - 1:, 0].mean().item()
    assert len(shares) == CONFIG.n_layer
    assert shares[0] == pytest.approx(expected, rel=1e-4)  # float32 attention
    assert all(0.0 <= s <= 1.0 for s in shares)
    assert uniform == pytest.approx(
        sum(1 / (p + 1) for p in range(PROMPT - 1, N - 1)) / (N - PROMPT))


def test_the_run_reports_its_progress_up_to_every_scored_token():
    seen = []
    evaluate(tiny_model(), text_ids(), [], prompt_len=PROMPT, chunk=4,
             progress=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (N - PROMPT, N - PROMPT)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


@pytest.mark.parametrize("tokens, prompt, chunk, message", [
    (129, 16, 1, "--tokens 129 is beyond the model's context window of 128"),
    (16, 16, 1, "--tokens 16 leaves nothing to score after --prompt-len 16"),
    # --tokens not given: the refusal names the --prompt-len typed, never a derived --tokens.
    (None, 200, 1, "^--prompt-len 200: expected a whole number from 1 to 127"),
    (None, 16, 500, "^--chunk 500: expected a whole number from 1 to 127"),
    (64, 0, 1, "--prompt-len 0"),
    (64, 16, 0, "--chunk 0"),
])
def test_a_run_that_cannot_be_made_is_refused_naming_the_value(tokens, prompt, chunk, message):
    with pytest.raises(ValueError, match=message):
        check_eval(CONFIG.block_size, tokens, prompt, chunk)


def test_a_token_outside_the_vocabulary_is_refused():
    ids = text_ids()
    ids[20] = CONFIG.vocab_size
    with pytest.raises(ValueError, match="token id 96 is outside the model's vocabulary"):
        evaluate(tiny_model(), ids, [], prompt_len=PROMPT)


def test_caches_are_built_for_the_model_s_shape_without_allocating_before_it_loads():
    from kvcache_cli.caches.spec import parse_cache_list
    from kvcache_cli.eval.quality import check_caches

    check_caches(parse_cache_list("static,concat,paged:b16"), CONFIG, N - 1)  # meta: no bytes
    with pytest.raises(ValueError, match="outside the context window 1..128"):
        check_caches(parse_cache_list("static"), CONFIG, CONFIG.block_size + 1)


def test_a_text_cut_at_the_read_limit_loses_only_its_split_last_character(tmp_path, monkeypatch):
    from kvcache_cli.eval import text as evaltext

    monkeypatch.setattr(evaltext, "MAX_TEXT_BYTES", 8)
    path = tmp_path / "t.txt"
    path.write_text("abcdefgé and more")  # é is 2 bytes: the 8-byte read splits it
    assert evaltext.read_text(path) == "abcdefg"
    path.write_bytes(b"ab\xffdefgh and more")  # not UTF-8 before the cut: refused
    with pytest.raises(ValueError, match="is not UTF-8 text \\(byte 2"):
        evaltext.read_text(path)


def test_the_view_draws_the_exact_cache_flat_and_a_damaged_one_rising():
    from kvcache_cli.views.plot import BARS
    from kvcache_cli.views.quality import excess_lines

    result = evaluate(tiny_model(), text_ids(), [CacheMaker("noisy", noisy)], prompt_len=PROMPT)
    lines, top = excess_lines(result, width=16)
    assert lines["static"] == BARS[0] * 16
    assert top > 0 and BARS[-1] in lines["noisy"]
