"""A quantised cache's decoding step in one native call (`QuantizedCache._decode`,
`code_attention.decode_codes`): the new token written where its position puts it, its codes
bit for bit as `_Tokens.encode` writes them (int8's r0), or kept in the tail, and a chunk
that fills the tail quantised as torch quantises it; a layer off that placement (a crop
into the residual) stored by torch until the residual is full again; the attention over
sinks, codes and tail equal to a float64 reference over what the cache holds, for every
width, key axis, residual, sinks and odd lengths, on 1 and 2 threads, on the kernel's vector
path and its plain loops; the layer's `attend` dispatching one torch op where the token is
quantised at once; and rotated codes keeping their own path."""

from __future__ import annotations

import pytest
import torch
from nativekit import Ops, kernel_fixtures, keys_in_words, values_in_words

from kvcache_cli.caches import code_attention
from kvcache_cli.caches.base import CacheShape
from kvcache_cli.caches.quantized import QuantizedCache
from kvcache_cli.caches.spec import parse_cache_spec
from kvcache_cli.caches.step import Step

lib, use = kernel_fixtures(code_attention)

SHAPE = CacheShape(n_layer=1, n_kv_head=3, head_size=64, context=2048)


@pytest.fixture(params=[1, 2])
def threads(request):
    """The kernel's tokens split over this many threads (its blocks merged after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def build(spec: str, B: int, dtype=torch.float32) -> QuantizedCache:
    return QuantizedCache.build(parse_cache_spec(spec), SHAPE, max_len=2048, batch=B,
                                device="cpu", dtype=dtype, whole=False)


def product(B: int, gen: torch.Generator, k=None, v=None):
    """q (B, 9, 1, 64), k, v (B, 3, 1, 64): views of one q|k|v product (B, 1, 15, 64), as
    the fused model hands them to `attend` (k, v copied in where given)."""
    qkv = torch.randn(B, 1, 15, 64, generator=gen).transpose(1, 2)  # (B, 15, 1, 64)
    if k is not None:
        qkv[:, 9:12], qkv[:, 12:] = k, v
    return qkv[:, :9], qkv[:, 9:12], qkv[:, 12:]


def reference(q, keys, values):
    """softmax(q k / sqrt(hs)) v in float64 over every held position, query head h on KV
    head h // 3: (B, 9, 1, hs)."""
    k = keys.double().repeat_interleave(3, 1)  # (B, 9, n, hs)
    v = values.double().repeat_interleave(3, 1)
    w = (q.double() @ k.transpose(-1, -2) / 64 ** 0.5).softmax(-1)  # (B, 9, 1, n)
    return w @ v


def calls(monkeypatch) -> list[bool]:
    """The `write` flag of each `decode_codes` call from here on."""
    seen = []

    def counted(*args, call=code_attention.decode_codes):
        seen.append(args[8])
        return call(*args)

    monkeypatch.setattr(code_attention, "decode_codes", counted)
    return seen


@pytest.mark.usefixtures("use")
@pytest.mark.parametrize("spec", ["int8", "int8:s3", "int4:g16:ktok:r0", "int2:g8:ktok:r0:s2",
                                  "int4", "int4:g32:kchan:r16:s4", "int8:g64:kchan:r5",
                                  "int2:g32:ktok:r7:s1"])
# odd lengths; 33 steps pass a per-channel group's flush of 32; 1,101 tokens merge blocks of 512
@pytest.mark.parametrize(("B", "prompt", "steps"), [(1, 201, 33), (2, 1101, 3)])
def test_one_call_equals_float64_attention_over_what_the_cache_holds(spec, B, prompt, steps,
                                                                     threads, monkeypatch,
                                                                     request):
    gen = torch.Generator().manual_seed(prompt)
    cache = build(spec, B)
    # float32 products and sums of scores of size ~20 and outputs of size ~2, against
    # float64's: a code misread or a scale off by a group moves them by units. Keys
    # multiplied in integers, the query rounded to 16-bit words: scores move by ~1e-4
    # (the codes' own rounding moves them by ~1e-2), outputs by up to some 2e-3; 4-bit values
    # so, their weights rounded: outputs by ~1e-4 of themselves.
    lib = request.node.callspec.params["lib"]
    words = (keys_in_words(lib, cache.bits, cache.per_channel, 64, cache.group) or
             values_in_words(lib, cache.bits, 64, cache.group))
    tolerance = dict(rtol=1e-3, atol=4e-3) if words else dict(rtol=1e-4, atol=2e-5)
    cache.update(0, 0, *(torch.randn(B, 3, prompt, 64, generator=gen) * 2 for _ in range(2)))
    written, flushed = calls(monkeypatch), 0
    for start in range(prompt, prompt + steps):
        quantised = cache.layers[0].quantised
        q, k, v = product(B, gen)
        y = cache.attend(0, q * 3, k, v, Step(start, torch.tensor([start])))
        assert cache.length == start + 1
        keys, values = cache._read(cache.layers[0])  # (B, 3, start + 1, 64), dequantised
        assert keys.size(2) == start + 1
        torch.testing.assert_close(y.double(), reference(q * 3, keys, values), **tolerance)
        flushed += cache.layers[0].quantised > quantised + 1
    # every token where its position puts it, a chunk leaving the tail in the same call
    assert written == ["at"] * steps
    assert flushed or steps < cache.group or not cache.per_channel


def _awkward(gen: torch.Generator, B: int, T: int) -> torch.Tensor:
    """(B, 3, T, 64) keys or values with what rounds near a boundary: constant groups,
    values on the grid's half steps, signed zeros, tiny and large magnitudes."""
    x = torch.randn(B, 3, T, 64, generator=gen) * torch.logspace(-6, 4, T)[:, None]
    x[:, 0, ::3, :32] = 0.25  # a constant group
    x[:, 1, 1::3] = (x[:, 1, 1::3] * 4).round() / 8  # ties
    x[:, 2, 2::3, ::2] = -0.0
    return x


@pytest.mark.usefixtures("use")
@pytest.mark.parametrize(("spec", "dtype"), [
    ("int8", torch.float32), ("int4:g16:ktok:r0:s2", torch.float32),
    ("int2:g8:ktok:r0", torch.float32), ("int4:g16:kchan:r24", torch.float32),
    ("int4:g8:kchan:r4:s2", torch.float16), ("int8:g8:kchan:r5", torch.bfloat16)])
def test_the_call_writes_each_tokens_codes_and_tail_as_torch_does(spec, dtype, monkeypatch):
    """The tokens the call quantises, and those it puts in a tail (in the cache's dtype,
    rounded as torch casts), then the tail's flushes, hold what torch's path holds."""
    gen = torch.Generator().manual_seed(3)
    k, v = _awkward(gen, 2, 90), _awkward(gen, 2, 90)  # (2, 3, 90, 64)
    held = []
    for kernel in (code_attention.kernel, lambda: None):  # the call; torch's `_Tokens.encode`
        monkeypatch.setattr(code_attention, "kernel", kernel)
        cache = build(spec, 2, dtype)
        cache.update(0, 0, k[:, :, :20], v[:, :, :20])
        step_gen = torch.Generator().manual_seed(4)
        for t in range(20, 90):
            q, kt, vt = product(2, step_gen, k[:, :, t:t + 1], v[:, :, t:t + 1])
            cache.attend(0, q, kt, vt, Step(t, torch.tensor([t])))
        held.append(cache)
    fused, torch_ = held
    assert fused.layers[0].quantised == torch_.layers[0].quantised > 20
    for a, b in zip(fused.layers[0].tensors(), torch_.layers[0].tensors(), strict=True):
        # by value: a group whose minimum is zero may keep either sign of zero point
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_an_int8_step_is_one_call_a_layer_dispatching_one_torch_op():
    if code_attention.kernel() is None:
        pytest.skip(code_attention.NOTE[-1])
    gen = torch.Generator().manual_seed(5)
    cache = build("int8", 2)
    cache.update(0, 0, *(torch.randn(2, 3, 40, 64, generator=gen) for _ in range(2)))
    q, k, v = product(2, gen)
    copied, step = cache.bytes_copied, Step(40, torch.tensor([40]))
    with Ops() as ops:  # room for the token in the codes' buffers: nothing grows
        y = cache.attend(0, q, k, v, step)
    assert ops.names == ["aten.empty.memory_format"], ops.names  # y itself
    # what the token's rows hold, as stored: keys' and values' 2 x 3 x 64 codes, and a scale
    # and zero point (float16) for each of their 2 x 3 x 2 groups
    assert cache.bytes_copied == copied + 2 * (2 * 3 * 64 + 2 * 2 * 3 * 2 * 2)
    assert cache.length == 41 and cache.layers[0].quantised == 41
    merged = y.transpose(1, 2).reshape(2, 1, 9 * 64)  # models.base.merge_heads
    assert merged.data_ptr() == y.data_ptr()  # a view: no copy


@pytest.mark.usefixtures("use")
@pytest.mark.parametrize(("spec", "prompt"), [("int8", 60), ("int4", 200)])
def test_a_layers_kept_arguments_follow_its_buffers_as_they_grow(spec, prompt):
    # steps past the buffers' capacity (int8's codes as each token is quantised, int4's as
    # a chunk leaves its 128-token tail): each step's call reads what a call with its
    # arguments written afresh reads
    gen = torch.Generator().manual_seed(7)
    cache = QuantizedCache.build(parse_cache_spec(spec), SHAPE, max_len=prompt // 2, batch=1,
                                 device="cpu", dtype=torch.float32, whole=False)
    cache.update(0, 0, *(torch.randn(1, 3, prompt, 64, generator=gen) for _ in range(2)))
    L = cache.layers[0]
    seen = set()
    for start in range(prompt, prompt + 100):
        q, k, v = product(1, gen)
        y = cache.attend(0, q, k, v, Step(start, torch.tensor([start])))
        rows = tuple(r.buf for r in L.code_rows)
        full = (L.sink_k, L.sink_v, L.tails["k"].buf, L.tails["v"].buf)
        assert L.call.buffers == () or all(a is b for a, b in zip(rows + full, L.call.buffers))
        seen.add(tuple(t.data_ptr() for t in rows + full))
        afresh = code_attention.decode_codes(q, k, v, rows, L.quantised, cache.bits,
                                             cache.group, cache.per_channel, None, full,
                                             L.tails["k"].n)  # writes nothing
        assert torch.equal(y, afresh)
    assert len(seen) > 1  # the buffers grew, and the kept arguments followed them


def test_rotated_codes_and_a_wrong_position_keep_their_paths(monkeypatch):
    if code_attention.kernel() is None:
        pytest.skip(code_attention.NOTE[-1])
    gen = torch.Generator().manual_seed(6)
    cache = build("int8:rot", 1)
    cache.update(0, 0, *(torch.randn(1, 3, 40, 64, generator=gen) for _ in range(2)))
    written = calls(monkeypatch)
    q, k, v = product(1, gen)
    y = cache.attend(0, q, k, v, Step(40, torch.tensor([40])))
    assert written == []  # the query rotated and the values' sum unrotated in torch
    torch.testing.assert_close(y.double(), reference(q, *cache._read(cache.layers[0])),
                               rtol=1e-4, atol=2e-5)
    plain = build("int8", 1)
    plain.update(0, 0, *(torch.randn(1, 3, 40, 64, generator=gen) for _ in range(2)))
    with pytest.raises(ValueError, match="holds 40 positions, asked to write at 41"):
        plain.attend(0, q, k, v, Step(41, torch.tensor([41])))
    assert plain.length == 40 and plain.layers[0].quantised == 40  # nothing written


@pytest.mark.usefixtures("use")
def test_a_crop_into_the_residual_is_stored_by_torch_until_the_residual_is_full(monkeypatch):
    gen = torch.Generator().manual_seed(8)
    cache = build("int4:g8:kchan:r4", 1)  # 40 tokens: 32 as codes, 8 in the tail
    cache.update(0, 0, *(torch.randn(1, 3, 40, 64, generator=gen) for _ in range(2)))
    assert cache.buffers() is not None
    cache.crop(34)  # 32 codes, 2 in the tail, where position 34 would have 24 and 10
    assert cache.buffers() is None  # not replayable: its steps would move the codes
    written = calls(monkeypatch)
    for start in range(34, 50):
        cache.attend(0, *product(1, gen), Step(start, torch.tensor([start])))
    # torch's appends fill the tail back to the residual's 4 tokens: in place from there
    assert written == [None] * 2 + ["at"] * 14
    assert cache.buffers() is not None and cache.layers[0].quantised == 40
