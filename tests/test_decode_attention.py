"""A decoding step's attention through a static or half cache in one native call
(`code_attention.attend_decode`, `StaticCache.decode`): the new key and value written into
the buffers as torch's slice write writes them (rounded alike), the attention over slots
0..start equal to a float64 reference, on the kernel's vector path and its plain loops;
the layer's `attend` dispatching one torch op; and the cases it does not take keeping
SDPA's path."""

from __future__ import annotations

import pytest
import torch
from nativekit import Ops, kernel_fixtures

from kvcache_cli.caches import code_attention
from kvcache_cli.caches.base import CacheShape
from kvcache_cli.caches.exact import StaticCache
from kvcache_cli.caches.half import HalfCache
from kvcache_cli.caches.step import Step

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STORES = [torch.float32, torch.float16, torch.bfloat16]


lib, use = kernel_fixtures(code_attention)


def product(B: int, nh: int, nkv: int, hs: int, gen: torch.Generator):
    """q (B, nh, 1, hs), k, v (B, nkv, 1, hs): views of one q|k|v product (B, 1, H, hs),
    as the fused model hands them to `attend`."""
    qkv = torch.randn(B, 1, nh + 2 * nkv, hs, generator=gen).transpose(1, 2)  # (B, H, 1, hs)
    return qkv[:, :nh], qkv[:, nh:nh + nkv], qkv[:, nh + nkv:]


def buffers(B: int, nkv: int, slots: int, hs: int, store, gen):
    """Keys and values (B, nkv, slots, hs) in `store`, every slot holding a number."""
    return tuple(torch.randn(B, nkv, slots, hs, generator=gen).to(store) for _ in range(2))


def reference(q, keys, values, end: int):
    """softmax(q k / sqrt(hs)) v in float64 over slots 0..end - 1, query head h on KV head
    h // g: (B, nh, 1, hs)."""
    nh, nkv, hs = q.size(1), keys.size(1), q.size(-1)
    k = keys[:, :, :end].double().repeat_interleave(nh // nkv, 1)  # (B, nh, end, hs)
    v = values[:, :, :end].double().repeat_interleave(nh // nkv, 1)
    w = (q.double() @ k.transpose(-1, -2) / hs ** 0.5).softmax(-1)  # (B, nh, 1, end)
    return w @ v


@pytest.mark.usefixtures("use")
@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("g", [1, 3, 4])
@pytest.mark.parametrize("hs", [64, 256, 24])  # SmolLM2's, Gemma 3's, off the vector path
@pytest.mark.parametrize(("slots", "start"), [(40, 0), (40, 17), (40, 39), (1300, 1299)])
@pytest.mark.parametrize("B", [1, 3])
def test_one_call_writes_the_token_and_equals_float64_attention(store, g, hs, slots, start, B):
    gen = torch.Generator().manual_seed(hs + g + start + B)
    nkv = 2
    q, k, v = product(B, g * nkv, nkv, hs, gen)
    keys, values = buffers(B, nkv, slots, hs, store, gen)
    want_k, want_v = keys.clone(), values.clone()
    want_k[:, :, start:start + 1] = k  # torch's slice write, cast to the buffers' dtype
    want_v[:, :, start:start + 1] = v
    y = code_attention.attend_decode(q, k, v, keys, values, torch.tensor([start]))
    assert torch.equal(keys, want_k) and torch.equal(values, want_v)
    assert y.shape == (B, g * nkv, 1, hs) and y.is_contiguous()
    torch.testing.assert_close(y.double(), reference(q, keys, values, start + 1),
                               rtol=1e-4, atol=2e-6)


@pytest.mark.parametrize("store", [torch.float16, torch.bfloat16])
def test_the_written_bits_are_torchs_cast_at_ties_and_edges(store):
    if code_attention.kernel() is None:
        pytest.skip(f"the kernel cannot be built here: {code_attention.NOTE}")
    # halfway between two half numbers (ties to even, down and up), past the largest,
    # under the smallest, zeros, infinities and NaN
    tie = 2.0 ** -11 if store == torch.float16 else 2.0 ** -8
    odd = 1 + 2 * tie
    special = [1 + tie, odd + tie, -(1 + tie), -(odd + tie), 1 + tie * 1.001, 7e4, 4e38,
               1e-8, 3e-39, -0.0, 0.0, float("inf"), float("-inf"), float("nan"),
               65519.0, 65520.0]
    x = torch.tensor(special + [0.0] * (64 - len(special)))
    gen = torch.Generator().manual_seed(0)
    q, k, v = product(1, 3, 3, 64, gen)
    k[0, 0, 0], v[0, 2, 0] = x, -x
    keys, values = buffers(1, 3, 8, 64, store, gen)
    want_k, want_v = keys.clone(), values.clone()
    want_k[:, :, 5:6], want_v[:, :, 5:6] = k, v
    code_attention.attend_decode(q, k, v, keys, values, torch.tensor([5]))
    for got, want in ((keys, want_k), (values, want_v)):
        # a NaN stays a NaN; its bits are torch's choice of path (its vector cast writes a
        # bfloat16 NaN as 0xffff, its scalar one as 0x7fc0)
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num().view(torch.int16),
                           want.nan_to_num().view(torch.int16))


SHAPE = CacheShape(n_layer=2, n_kv_head=3, head_size=64, context=512)


def caches(B: int = 2, whole: bool = False):
    """A float32 static cache and the two half ones, the same prompt of 9 tokens in each."""
    made = [StaticCache(SHAPE, 64, B, "cpu", torch.float32, whole)] + \
        [HalfCache(SHAPE, 64, B, "cpu", torch.float32, store=s, whole=whole)
         for s in (torch.float16, torch.bfloat16)]
    prompt = torch.randn(2, B, 3, 9, 64, generator=torch.Generator().manual_seed(1))
    for c in made:
        for layer in range(2):
            c.update(layer, 0, prompt[0], prompt[1])
    return made


def test_a_decode_step_is_one_call_a_layer_with_updates_bookkeeping():
    if code_attention.kernel() is None:
        pytest.skip(f"the kernel cannot be built here: {code_attention.NOTE}")
    q, k, v = product(2, 9, 3, 64, torch.Generator().manual_seed(2))
    for cache in caches():
        held, copied = cache.bytes_held, cache.bytes_copied
        step = Step(9, torch.tensor([9]))
        with Ops() as ops:
            y = cache.attend(1, q, k, v, step)
        assert ops.names == ["aten.empty.memory_format"], ops.names
        assert cache.length == 10 and cache.bytes_held == held
        assert cache.bytes_copied == copied + 2 * 2 * 3 * 64 * cache.k[1].element_size()
        keys, values = cache.k[1][:, :, :10], cache.v[1][:, :, :10]
        torch.testing.assert_close(y.double(), reference(q, keys, values, 10),
                                   rtol=1e-4, atol=2e-6)
        merged = y.transpose(1, 2).reshape(2, 1, 9 * 64)  # models.base.merge_heads
        assert merged.data_ptr() == y.data_ptr()  # a view: no copy


def test_a_step_past_the_last_slot_is_refused_as_update_refuses_it():
    q, k, v = product(1, 3, 3, 64, torch.Generator().manual_seed(3))
    cache = StaticCache(SHAPE, 4, 1, "cpu", torch.float32)
    with pytest.raises(IndexError, match="past the static cache's 4 slots"):
        cache.attend(0, q, k, v, Step(4, torch.tensor([4])))


@pytest.mark.parametrize("case", ["prefill", "tensor start", "whole", "no kernel", "float64",
                                  "gradient"])
def test_the_cases_it_does_not_take_keep_sdpas_path(case, monkeypatch):
    def refused(*args):
        raise AssertionError("attend_decode called")

    monkeypatch.setattr(code_attention, "attend_decode", refused)
    if case == "no kernel":
        monkeypatch.setattr(code_attention, "kernel", lambda: None)
    T = 3 if case == "prefill" else 1
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, n, T, 64, generator=gen, requires_grad=case == "gradient")
               for n in (9, 3, 3))
    # a compiled decode's Step: its position a tensor (`generate.CompiledDecode`)
    step = Step(torch.tensor([9]), torch.tensor([9])) if case == "tensor start" else \
        Step.at(9, T, 512, "cpu")
    made = caches(whole=case == "whole")
    if case == "float64":  # a model run in float64: its static cache's buffers too
        q, k, v = q.double(), k.double(), v.double()
        made = [StaticCache(SHAPE, 64, 2, "cpu", torch.float64)]
        made[0].update(0, 0, *torch.randn(2, 2, 3, 9, 64, dtype=torch.float64))
    for cache in made:
        y = cache.attend(0, q, k, v, step)
        if case == "tensor start":  # the write recorded after the graph
            cache.advance(9, T)
        assert cache.length == 9 + T and y.shape == (2, 9, T, 64)


@pytest.mark.usefixtures("use")
@pytest.mark.parametrize("window", [6, 64])  # wraps, and never fills
def test_a_plain_windows_decoding_step_in_one_call_equals_its_torch_path(window, monkeypatch):
    from kvcache_cli.caches.bounded import RingCache

    shape = CacheShape(1, 3, 64, 512)
    # a ring holds the model's dtype: float32 where a decode's rows are native
    native, torch_path = (RingCache(shape, 0, window, 24, 1, "cpu", torch.float32,
                                    f"window:{window}") for _ in range(2))
    assert native.buffers() is not None
    gen = torch.Generator().manual_seed(6)
    prompt = torch.randn(2, 1, 3, 5, 64, generator=gen)  # keys, values of 5 tokens
    for cache in (native, torch_path):  # a prefill through the torch path
        cache.update(0, 0, *prompt)
    for pos in range(5, 24):
        q, k, v = product(1, 9, 3, 64, gen)
        step = Step.at(pos, 1, 512, "cpu")
        with Ops() as ops:
            got = native.attend(0, q, k, v, step)
        assert len(ops.names) == 1  # the output's allocation: the rest is the kernel
        with monkeypatch.context() as m:
            m.setattr(code_attention, "kernel", lambda: None)
            want = torch_path.attend(0, q, k, v, step)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert native.length == torch_path.length == pos + 1
        assert native.bytes_copied == torch_path.bytes_copied
    assert all(torch.equal(a, b) for a, b in zip(native.buffers(), torch_path.buffers(),
                                                   strict=True))
    # what the native steps left unrecorded (which slot holds which position) is worked
    # out when the torch path asks: the last token rolled back and written again through it
    for cache in (native, torch_path):
        cache.crop(23)
    token = torch.randn(2, 1, 3, 1, 64, generator=gen)
    assert all(torch.equal(a, b) for a, b in zip(native.update(0, 23, *token),
                                                   torch_path.update(0, 23, *token), strict=True))
    assert torch.equal(native.key_positions(0), torch_path.key_positions(0))


@pytest.mark.parametrize("spec", ["sink:2+6", "window:6:k2"])
def test_a_window_with_sinks_or_spare_slots_keeps_its_torch_path(spec):
    from kvcache_cli.caches.bounded import RingCache
    from kvcache_cli.caches.spec import parse_cache_spec

    shape = CacheShape(1, 3, 64, 512)
    cache = RingCache.build(parse_cache_spec(spec), shape, max_len=24, batch=1, device="cpu",
                            dtype=torch.float32, whole=False)
    assert cache.buffers() is None and not cache.decodes_in_one_call
