"""A quantised cache's own attention for a decoding token: the history read as codes, never
dequantised whole, gives what SDPA over the dequantised copy gives (logits, tokens,
perplexity as eval measures it), for every layout of codes, on both paths: the C++ kernel
(`caches.code_attention`) and the torch path it falls back to (a chunk of codes at a time)."""

import decoding
import pytest
import torch
import torch.nn.functional as F
from nativekit import keys_in_words, values_in_words

from kvcache_cli.caches import code_attention, make_cache
from kvcache_cli.caches import quantized as quantized_module
from kvcache_cli.caches.base import KVCache
from kvcache_cli.caches.quantized import QuantizedCache
from kvcache_cli.caches.spec import parse_cache_spec
from kvcache_cli.caches.step import Step
from kvcache_cli.eval.quality import evaluate
from kvcache_cli.models.gpt2 import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = GPTConfig(block_size=128, vocab_size=96, n_layer=2, n_head=2, n_embd=64)
SPECS = ["int8", "int4:r16", "int4:g8:kchan:r4", "int2:g4:ktok:r0:s2", "int4:g16:kchan:r8:rot"]


def model() -> GPT:
    return GPT(CONFIG, init_std=0.3, seed=0).eval()


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    """Each test on both paths; the torch one in chunks of 16 tokens, so a 100-token
    history is read in several, the last one short."""
    if request.param == "torch":
        monkeypatch.setattr(code_attention, "kernel", lambda: None)
        monkeypatch.setattr(quantized_module, "ATTEND_CHUNK", 16)
    elif code_attention.kernel() is None:
        pytest.skip(code_attention.NOTE[-1])
    return request.param


def _whole_copy(monkeypatch):
    """The path before: `update` dequantises the whole history and SDPA reads it."""
    monkeypatch.setattr(QuantizedCache, "attend", KVCache.attend)


@pytest.mark.usefixtures("path")
@pytest.mark.parametrize("spec", SPECS)
def test_attention_over_codes_gives_the_whole_copys_logits(spec, monkeypatch):
    m, idx = model(), decoding.tokens(100, CONFIG.vocab_size)
    answered = []
    for name in ("_decode", "_attend_kernel", "_attend"):  # the codes' paths
        def counted(self, *args, read=getattr(QuantizedCache, name)):
            answered.append(True)
            return read(self, *args)

        monkeypatch.setattr(QuantizedCache, name, counted)
    chunked = decoding.decode_logits(m, make_cache(spec, m, 100), idx, 10)
    assert sum(answered) > 100  # the codes' path answered most decoding steps' layers
    _whole_copy(monkeypatch)
    whole = decoding.decode_logits(m, make_cache(spec, m, 100), idx, 10)
    # Float32 noise of one attention (below) carried through two layers of std-0.3
    # weights, whose sharp softmaxes amplify it: up to ~2e-3 of logits of size ~10 on an
    # Intel Xeon, 6.5e-3 on an AMD EPYC (its kernels sum in another order); a chunk
    # misplaced or a scale off by a group moves them by units. Where the kernel multiplies
    # 4-bit values in integers, their weights rounded to 16-bit words move an attention's
    # output by ~1e-4 of itself, and the logits by up to ~0.1.
    layout = parse_cache_spec(spec)
    words = code_attention.kernel() is not None and values_in_words(
        "vector", layout["bits"], CONFIG.n_embd // CONFIG.n_head, layout["group"])
    torch.testing.assert_close(chunked, whole, atol=0.25 if words else 2e-2, rtol=1e-3)


@pytest.mark.usefixtures("path")
@pytest.mark.parametrize("spec", SPECS)
def test_one_attention_equals_sdpa_over_the_dequantised_copy(spec):
    from kvcache_cli.caches.base import CacheShape

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
    got = cache.attend(0, q, k[:, :, :1], v[:, :, :1], Step(100, torch.tensor([100])))
    # The same numbers summed in another order, scales folded into the query: float32
    # noise of the scores (size ~30) and of the output (size ~1). 4-bit values multiplied
    # in integers, their weights rounded to 16-bit words: outputs move by up to ~2e-4.
    words = code_attention.kernel() is not None and values_in_words(
        "vector", cache.bits, 32, cache.group)
    torch.testing.assert_close(got, expected, **(dict(atol=1e-3, rtol=1e-3) if words else
                                                 dict(atol=2e-5, rtol=1e-5)))


def test_a_prefill_and_an_unquantised_history_read_updates_copy():
    m = model()
    cache = make_cache("int4", m, 64)  # residual 128: nothing is quantised here
    q = k = v = torch.randn(1, 2, 1, 32)
    got = cache.attend(0, q, k, v, Step(0, torch.tensor([0])))
    keys, values = make_cache("int4", m, 64).update(0, 0, k, v)
    assert torch.equal(got, F.scaled_dot_product_attention(q, keys, values))
    big = torch.randn(1, 2, 5, 32)
    got = make_cache("int8", m, 64).attend(0, big, big, big, Step(0, torch.arange(5)))  # a chunk
    keys, values = make_cache("int8", m, 64).update(0, 0, big, big)
    assert torch.equal(got, F.scaled_dot_product_attention(big, keys, values, is_causal=True))


@pytest.mark.usefixtures("path")
@pytest.mark.parametrize("spec", ["int8", "int4:g8:kchan:r4:rot"])
def test_eval_perplexity_is_unchanged_by_the_codes_path(spec, monkeypatch):
    m, ids = model(), decoding.tokens(120, CONFIG.vocab_size, seed=1)[0].tolist()
    fast = evaluate(m, ids, [spec], prompt_len=8).caches[1]  # [0] is the exact reference
    _whole_copy(monkeypatch)
    slow = evaluate(m, ids, [spec], prompt_len=8).caches[1]
    # Quantisation shows (int8 moves this model's perplexity by about 1e-3), at more than
    # twice the tolerance below: the equality means something.
    assert abs(fast.perplexity_change) > 5e-4
    # The kernel sums in another order than torch's products: per attention as close to
    # a float64 SDPA as torch's path (median 3e-6, at most 2e-5, on outputs of size 8),
    # which this random model's sharp softmaxes carry to 8e-5 of its perplexity.
    assert fast.perplexity == pytest.approx(slow.perplexity, rel=2e-4)
    assert fast.perplexity_change == pytest.approx(slow.perplexity_change, abs=2e-4)


@pytest.mark.usefixtures("path")
@pytest.mark.parametrize("spec", ["int8:s3", "int4:g32:kchan:r16:s4", "int4:g16:ktok:r5:rot",
                                  "int2:g32:kchan:r0"])
def test_a_long_history_of_two_rows_equals_sdpa_over_the_dequantised_copy(spec):
    # 1,100 tokens: the kernel's blocks of 512 and their merge; two rows, sinks and a tail.
    from kvcache_cli.caches.base import CacheShape

    g = torch.Generator().manual_seed(1)
    cache = QuantizedCache.build(parse_cache_spec(spec), CacheShape(1, 3, 64, 2048),
                                 max_len=1101, batch=2, device="cpu", dtype=torch.float32,
                                 whole=False)
    k, v = (torch.randn(2, 3, 1100, 64, generator=g) for _ in range(2))  # (B, nkv, T, hs)
    cache.update(0, 0, k, v)
    q = torch.randn(2, 9, 1, 64, generator=g) * 2  # three query heads a KV head
    keys, values = cache.update(0, 1100, k[:, :, :1], v[:, :, :1])
    expected = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
    cache.crop(1100)
    got = cache.attend(0, q, k[:, :, :1], v[:, :, :1], Step(1100, torch.tensor([1100])))
    # keys or values the kernel multiplies in integers, the query or the weights rounded to
    # 16-bit words: scores of ~10 move by ~1e-4, outputs of ~1 by up to some 1e-3
    words = code_attention.kernel() is not None and (
        keys_in_words("vector", cache.bits, cache.per_channel, 64, cache.group) or
        values_in_words("vector", cache.bits, 64, cache.group))
    torch.testing.assert_close(got, expected, **(dict(atol=2e-3, rtol=1e-3) if words else
                                                 dict(atol=2e-5, rtol=1e-5)))


def test_the_kernel_steps_aside_in_one_line_where_it_cannot_be_built(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCACHE_CACHE", str(tmp_path))
    for setting, words in ((dict(CXX="/bin/false"), "could not build code_attention.cpp"),
                           (dict(KVCACHE_CODE_ATTENTION="torch"), "KVCACHE_CODE_ATTENTION")):
        code_attention.kernel.cache_clear()
        with monkeypatch.context() as m:
            for name, value in setting.items():
                m.setenv(name, value)
            assert code_attention.kernel() is None
        assert words in code_attention.NOTE[-1] and "\n" not in code_attention.NOTE[-1]
        assert not list(tmp_path.glob("kernels/*.so"))  # nothing half-built left behind
    code_attention.kernel.cache_clear()  # the next caller builds it, where it can


def _awkward(g: torch.Generator, T: int) -> torch.Tensor:
    """(1, 3, T, 64) keys or values with what rounds near a boundary: constant groups,
    values on the grid's half steps, signed zeros, tiny and large magnitudes."""
    x = torch.randn(1, 3, T, 64, generator=g) * torch.logspace(-6, 4, T)[:, None]
    x[:, 0, ::3, :32] = 0.25  # a constant group
    x[:, 1, 1::3] = (x[:, 1, 1::3] * 4).round() / 8  # ties
    x[:, 2, 2::3, ::2] = -0.0
    return x


@pytest.mark.parametrize("spec", ["int8", "int4:g16:ktok:r0", "int2:g8:kchan:r3:s1",
                                  "int4:g32:ktok:r2:rot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_stores_each_tokens_codes_as_torch_quantises_them(spec, dtype, monkeypatch):
    # quantise_tokens against affine.quantise: the same codes and scales bit for bit,
    # the same zero points by value (a group whose minimum is zero may keep either sign).
    if code_attention.kernel() is None:
        pytest.skip(code_attention.NOTE[-1])
    from kvcache_cli.caches.base import CacheShape

    stores = []

    def counted(*args, store=code_attention.quantise_tokens):
        stores.append(args[0].size(2))
        return store(*args)

    monkeypatch.setattr(code_attention, "quantise_tokens", counted)
    caches = []
    for kernel in (code_attention.kernel, lambda: None):
        monkeypatch.setattr(code_attention, "kernel", kernel)
        cache = QuantizedCache.build(parse_cache_spec(spec), CacheShape(2, 3, 64, 512),
                                     max_len=80, batch=1, device="cpu", dtype=dtype,
                                     whole=False)
        g = torch.Generator().manual_seed(2)
        k, v = (_awkward(g, 80).to(dtype) for _ in range(2))  # (1, 3, 80, 64)
        cache.update(0, 0, k[:, :, :40], v[:, :, :40])  # a prefill, then one token a step
        for t in range(40, 80):
            cache.update(0, t, k[:, :, t:t + 1], v[:, :, t:t + 1])
        caches.append(cache.layers[0])
    fused, torch_ = caches
    assert len(stores) > 5  # the kernel stored the decoding tokens (values at least)
    assert fused.quantised == torch_.quantised > 60
    for a, b in zip(fused.tensors(), torch_.tensors(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)  # by value: -0.0 == 0.0
    assert torch.equal(fused.k_scale.view(torch.int16), torch_.k_scale.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_kernel_reads_a_half_precision_models_sinks_and_tail_in_place(dtype, monkeypatch):
    # The sinks and the residual tail at the model's dtype join the codes' pass in the
    # kernel (fp16 or bf16 rows widened as read); the torch path merges them apart.
    if code_attention.kernel() is None:
        pytest.skip(code_attention.NOTE[-1])
    from kvcache_cli.caches.base import CacheShape

    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(1, 3, 600, 64, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(1, 9, 1, 64, generator=g).to(dtype)
    got = []
    for kernel in (code_attention.kernel, lambda: None):
        monkeypatch.setattr(code_attention, "kernel", kernel)
        cache = QuantizedCache.build(parse_cache_spec("int4:g32:kchan:r40:s4"),
                                     CacheShape(1, 3, 64, 512), max_len=601, batch=1,
                                     device="cpu", dtype=dtype, whole=False)
        cache.update(0, 0, k, v)
        got.append(cache.attend(0, q, k[:, :, :1], v[:, :, :1], Step(600, torch.tensor([600]))))
    assert got[0].dtype == dtype
    # float32 sums in two orders, each rounded once to the model's dtype: a unit of its
    # last place at most, of the output or (near zero) of the largest output
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got[0], got[1], rtol=eps, atol=eps * float(got[1].abs().max()))
