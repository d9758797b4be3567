"""A quantised cache's own attention for a decoding token: the history read a chunk of
codes at a time, never dequantised whole, gives what SDPA over the dequantised copy gives
(logits, tokens, perplexity as eval measures it), for every layout of codes."""

import decoding
import pytest
import torch
import torch.nn.functional as F

from kvcache_cli.caches import make_cache
from kvcache_cli.caches import quantized as quantized_module
from kvcache_cli.caches.quantized import QuantizedCache
from kvcache_cli.eval.quality import evaluate
from kvcache_cli.models.gpt2 import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = GPTConfig(block_size=128, vocab_size=96, n_layer=2, n_head=2, n_embd=64)
SPECS = ["int8", "int4:r16", "int4:g8:kchan:r4", "int2:g4:ktok:r0:s2", "int4:g16:kchan:r8:rot"]


def model() -> GPT:
    return GPT(CONFIG, init_std=0.3, seed=0).eval()


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 16 tokens: a 100-token history is read in several, the last one short."""
    monkeypatch.setattr(quantized_module, "ATTEND_CHUNK", 16)


def _whole_copy(monkeypatch):
    """The path before: `update` dequantises the whole history and SDPA reads it."""
    monkeypatch.setattr(QuantizedCache, "attend", lambda self, *args: None)


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("spec", SPECS)
def test_chunked_attention_gives_the_whole_copys_logits(spec, monkeypatch):
    m, idx = model(), decoding.tokens(100, CONFIG.vocab_size)
    answered = []
    attend = QuantizedCache.attend

    def counted(self, *args):
        y = attend(self, *args)
        answered.append(y is not None)
        return y

    monkeypatch.setattr(QuantizedCache, "attend", counted)
    chunked = decoding.decode_logits(m, make_cache(spec, m, 100), idx, 10)
    assert sum(answered) > 100  # the chunked path answered most decoding steps' layers
    _whole_copy(monkeypatch)
    whole = decoding.decode_logits(m, make_cache(spec, m, 100), idx, 10)
    # Float32 noise of one attention (below) carried through two layers of std-0.3
    # weights, whose sharp softmaxes amplify it: up to ~2e-3 of logits of size ~10 on an
    # Intel Xeon, 6.5e-3 on an AMD EPYC (its kernels sum in another order); a chunk
    # misplaced or a scale off by a group moves them by units.
    torch.testing.assert_close(chunked, whole, atol=2e-2, rtol=1e-3)


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("spec", SPECS)
def test_one_attention_equals_sdpa_over_the_dequantised_copy(spec):
    from kvcache_cli.caches.base import CacheShape
    from kvcache_cli.caches.spec import parse_cache_spec

    g = torch.Generator().manual_seed(0)
    cache = QuantizedCache.build(parse_cache_spec(spec), CacheShape(1, 2, 32, 512),
                                 max_len=100, batch=1, device="cpu", dtype=torch.float32,
                                 whole=False)
    k, v = (torch.randn(1, 2, 100, 32, generator=g) * 3 for _ in range(2))  # (B, nkv, T, hs)
    cache.update(0, 0, k, v)
    q = torch.randn(1, 4, 1, 32, generator=g) * 3  # two query heads a KV head
    keys, values = cache.update(0, 100, k[:, :, :1], v[:, :, :1])  # the whole copy, 101
    expected = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
    cache.crop(100)
    got = cache.attend(0, 100, q, k[:, :, :1], v[:, :, :1])
    # The same numbers summed in another order, scales folded into the query: float32
    # noise of the scores (size ~30) and of the output (size ~1).
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


def test_a_prefill_and_an_unquantised_history_read_updates_copy():
    m = model()
    cache = make_cache("int4", m, 64)  # residual 128: nothing is quantised here
    q = k = v = torch.randn(1, 2, 1, 32)
    assert cache.attend(0, 0, q, k, v) is None and cache.length == 0  # stored nothing
    big = torch.randn(1, 2, 5, 32)
    assert make_cache("int8", m, 64).attend(0, 0, big, big, big) is None  # a chunk of 5


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("spec", ["int8", "int4:g8:kchan:r4:rot"])
def test_eval_perplexity_is_unchanged_by_the_chunked_path(spec, monkeypatch):
    m, ids = model(), decoding.tokens(120, CONFIG.vocab_size, seed=1)[0].tolist()
    fast = evaluate(m, ids, [spec], prompt_len=8).caches[1]  # [0] is the exact reference
    _whole_copy(monkeypatch)
    slow = evaluate(m, ids, [spec], prompt_len=8).caches[1]
    assert abs(fast.perplexity_change) > 1e-4  # quantisation shows: equality means something
    assert fast.perplexity == pytest.approx(slow.perplexity, rel=1e-5)
    assert fast.perplexity_change == pytest.approx(slow.perplexity_change, abs=1e-5)
