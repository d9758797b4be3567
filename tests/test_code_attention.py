"""caches/code_attention.cpp's partial sums against a float64 reference of the same arithmetic
(codes unpacked and dequantised, c * scale + zero, then softmax(q.k) v), on each of its
paths: the vector one (`code_attention_simd.h`, with AVX-512's lanes where this CPU has them,
and with AVX2's) and the plain loops (built with -DCODE_ATTENTION_SCALAR). Every code width,
per-token and per-channel keys, group sizes on and off the vector path, GQA groups of 1 to 9
queries (the vector path takes them 4 at a time), lengths that end mid-tile and cross the
kernel's blocks (512 tokens, or a shorter row's share of the threads), and the sinks and tail
read in the same pass. Where the vector
path multiplies keys in integers (8-bit per-token keys in groups of 32, 8- and 4-bit
per-channel ones, head sizes 64 and 128), the reference rounds the query as it does."""

from __future__ import annotations

import pytest
import torch
from nativekit import BUILDS, VECTOR_PATH, kernel_fixtures, keys_in_words, values_in_words

from kvcache_cli.caches import affine, code_attention

lib, use = kernel_fixtures(code_attention)


def unpack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., hs * bits / 8) uint8 -> (..., hs) float64, the first code in the lowest bits."""
    per, mask = 8 // bits, (1 << bits) - 1
    parts = [(codes.long() >> (k * bits)) & mask for k in range(per)]
    return torch.stack(parts, -1).flatten(-2).double()


def reference(q, keys, values, full=(), scores=None, weighted=None):
    """m, l, acc over keys, values (B, nkv, n, hs) float64 and the sinks' and tail's,
    for queries q (B, nkv, g, hs): the partial sums the kernel returns; `scores`, the keys'
    scores where they are not q . k (`word_scores`); `weighted(p)`, the weights p times the
    values where that is not p @ values (`word_values`)."""
    if full:
        keys = torch.cat([full[0].double(), keys, full[2].double()], 2)
        values = torch.cat([full[1].double(), values, full[3].double()], 2)
    s = q.double() @ keys.transpose(-1, -2) if scores is None else scores  # (B, nkv, g, n)
    m = s.amax(-1)
    p = (s - m[..., None]).exp()
    return m, p.sum(-1), p @ values if weighted is None else weighted(p)


def dequantised(x, bits, G, per_channel):
    """x (B, nkv, n, hs) quantised as the cache does; its codes and their float64 values."""
    k_axis = affine._Channels if per_channel else affine._Tokens
    kc, ks, kz = k_axis.encode(x[0], bits, G)
    vc, vs, vz = affine._Tokens.encode(x[1], bits, G)
    B, nkv, n, hs = x[0].shape
    if per_channel:  # scales (B, nkv, n / G, hs): one row for each G tokens
        keys = unpack(kc, bits) * ks.double().repeat_interleave(G, 2) + \
            kz.double().repeat_interleave(G, 2)
    else:  # scales (B, nkv, n, hs / G): one for each G channels
        keys = unpack(kc, bits) * ks.double().repeat_interleave(G, 3) + \
            kz.double().repeat_interleave(G, 3)
    values = unpack(vc, bits) * vs.double().repeat_interleave(G, 3) + \
        vz.double().repeat_interleave(G, 3)
    return (kc, ks, kz, vc, vs, vz), keys, values


def rounded(x):
    """x (..., hs) float32 rounded as the integer path rounds a query, on one step a row (its
    largest magnitude to 32767) to whole steps, as float64."""
    big = x.abs().amax(-1, keepdim=True)
    inverse = torch.where(big > 0, 32767 / big, torch.zeros_like(big))
    return torch.round(x * inverse).double() * (big / 32767).double()


def word_scores(q, stored, bits, G, per_channel):
    """float64 scores of queries q (B, nkv, g, hs) over the codes as the integer path makes
    them: the query rounded (per-token keys), or the query times a group's channel scales
    rounded (per-channel keys), times the codes; plus the query times the zero points."""
    kc, ks, kz = stored[:3]
    codes = unpack(kc, bits)  # (B, nkv, n, hs)
    if per_channel:
        scaled = rounded(q[:, :, :, None] * ks.float()[:, :, None])  # (B, nkv, g, n / G, hs)
        raw = (scaled.repeat_interleave(G, 3) * codes[:, :, None]).sum(-1)
        zeros = kz.double().repeat_interleave(G, 2)
    else:
        raw = rounded(q) @ (codes * ks.double().repeat_interleave(G, 3)).transpose(-1, -2)
        zeros = kz.double().repeat_interleave(G, 3)
    return raw + q.double() @ zeros.transpose(-1, -2)


def kernel_block(n):
    """The tokens a block of the kernel covers over n tokens a row (`block_tokens`): 512, or
    the row's share of the threads rounded up to 16 tokens, if less, down to 128."""
    share = -(-n // torch.get_num_threads())
    return min(512, max(128, -(-share // 16) * 16))


def word_values(stored, G):
    """p -> float64 p @ values as the integer path makes it, for weights p (B, nkv, g, n):
    in each block of the kernel's tokens (`kernel_block`), the weights times each group's
    scale rounded on one step (the block's largest scale over 32767) times the 4-bit codes,
    plus the weights times the zero points. p is each block's exp(s - its largest s), as
    the kernel's."""
    vc, vs, vz = stored[3:]
    codes = unpack(vc, 4)  # (B, nkv, n, hs)
    block = kernel_block(vc.size(2))

    def weighted(p):
        w = p[..., None] * vs.double()[:, :, None]  # (B, nkv, g, n, hs / G)
        blocks = []
        for a in range(0, w.size(3), block):
            part = w[:, :, :, a:a + block]
            # the block's largest scale, in p's units: times its largest weight
            big = vs[:, :, a:a + block].double().amax((-1, -2))[:, :, None, None, None] * \
                p[:, :, :, a:a + block].amax(3)[..., None, None]
            blocks.append(torch.round(part / big * 32767) * big / 32767)
        steps = torch.cat(blocks, 3).repeat_interleave(G, -1)  # (B, nkv, g, n, hs)
        return (steps * codes[:, :, None]).sum(3) + p @ vz.double().repeat_interleave(G, 3)

    return weighted


def check(got, want, scale=1.0):
    m, l_sum, acc = got
    wm, wl, wacc = want
    # float32 products and sums of some hundred terms, in another order than float64's
    torch.testing.assert_close(m.double(), wm, atol=1e-4 * scale, rtol=1e-5)
    torch.testing.assert_close((acc / l_sum[..., None]).double(), wacc / wl[..., None],
                               atol=2e-5 * scale, rtol=1e-4)


@pytest.mark.usefixtures("use")
@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize(("hs", "G", "n", "g"), [
    (64, 32, 1100, 3),  # SmolLM2's shape: blocks of 512, a short last tile
    # a row under 512 tokens a thread: blocks of its share (272 at 2 threads), one ending
    # inside a per-channel group of keys
    (64, 32, 544, 3),
    (64, 64, 96, 4),
    (128, 32, 64, 1),
    (256, 32, 200, 4),  # Gemma 3's shape: one KV head of 256, 4 queries
    (48, 16, 48, 5),   # a head size of no unrolled loop; 5 queries: 4 and 1
    (32, 8, 40, 9),    # groups narrower than AVX-512's lanes (a permute of scales); 9 queries
    (32, 4, 20, 2),    # narrower than AVX2's lanes too
    (16, 2, 24, 2),
    (16, 16, 16, 3),
    (24, 8, 24, 2),    # a head size AVX2's lanes divide and AVX-512's do not (plain loops there)
    (20, 4, 30, 3),    # a head size no vector path takes: the plain loops
])
def test_codes_equal_float64_attention_over_the_dequantised_cache(bits, per_channel, hs, G, n,
                                                                   g, request):
    gen = torch.Generator().manual_seed(bits * 100 + hs + G + n + g)
    B, nkv = 2, 3
    n -= n % G if per_channel else 0  # per-channel keys are quantised G tokens at a time
    x = torch.randn(2, B, nkv, n, hs, generator=gen)
    stored, keys, values = dequantised(x, bits, G, per_channel)
    q = torch.randn(B, nkv, g, hs, generator=gen) / hs ** 0.5
    got = code_attention.attend_codes(q, *stored, bits, G, per_channel)
    build = request.node.callspec.params["lib"]
    scores = weighted = None
    if keys_in_words(build, bits, per_channel, hs, G):
        scores = word_scores(q, stored, bits, G, per_channel)
    if values_in_words(build, bits, hs, G):
        weighted = word_values(stored, G)
    check(got, reference(q, keys, values, scores=scores, weighted=weighted),
          scale=keys.abs().max().item())


@pytest.mark.usefixtures("use")
@pytest.mark.parametrize(("bits", "per_channel", "hs"), [(8, False, 64), (8, True, 64),
                                                        (4, True, 64), (4, True, 256)])
def test_the_integer_path_rounds_the_query_to_16_bit_words(bits, per_channel, hs, request):
    # one channel 10^4 times the rest: a step of the rounding is then some 10^-4 of the others
    # (q8_0's 8 bits would have rounded them all to 0)
    gen = torch.Generator().manual_seed(bits)
    B, nkv, n, g, G = 1, 3, 256, 3, 32
    x = torch.randn(2, B, nkv, n, hs, generator=gen)
    stored, keys, values = dequantised(x, bits, G, per_channel)
    q = torch.randn(B, nkv, g, hs, generator=gen) / 8
    q[..., 5] = 1e3
    got = code_attention.attend_codes(q, *stored, bits, G, per_channel)
    build = request.node.callspec.params["lib"]
    words = word_scores(q, stored, bits, G, per_channel)
    floats = q.double() @ keys.transpose(-1, -2)
    moved = (words - floats).abs().max() / floats.abs().max()
    assert 1e-6 < moved < 1e-3  # the rounding is seen in the scores, and small beside them
    want = words if keys_in_words(build, bits, per_channel, hs, G) else None
    check(got, reference(q, keys, values, scores=want), scale=keys.abs().max().item())


@pytest.mark.usefixtures("use")
@pytest.mark.parametrize(("hs", "G"), [(64, 32), (128, 32), (64, 64), (256, 32)])
def test_the_integer_path_rounds_the_values_weights_to_16_bit_words(hs, G, request):
    # a query that picks out a few keys: the rest's weights are then some steps of the
    # rounding each, 1e-5 of the largest (q4_0's 8-bit weights would have rounded them to 0)
    gen = torch.Generator().manual_seed(hs + G)
    B, nkv, n, g = 1, 3, 1088, 3  # two blocks and a part, per-channel keys' groups whole
    x = torch.randn(2, B, nkv, n, hs, generator=gen)
    stored, keys, values = dequantised(x, 4, G, True)
    q = torch.randn(B, nkv, g, hs, generator=gen) / 8
    q[..., 5] = 30
    got = code_attention.attend_codes(q, *stored, 4, G, True)
    build = request.node.callspec.params["lib"]
    scores = word_scores(q, stored, 4, G, True) if keys_in_words(build, 4, True, hs, G) else None
    words = reference(q, keys, values, scores=scores, weighted=word_values(stored, G))
    floats = reference(q, keys, values, scores=scores)
    out = [acc / l_sum[..., None] for _, l_sum, acc in (words, floats)]
    moved = (out[0] - out[1]).abs().max() / out[1].abs().max()
    assert 1e-6 < moved < 1e-3  # the rounding is seen in the outputs, and small beside them
    follows, other = out if values_in_words(build, 4, hs, G) else out[::-1]
    y = (got[2] / got[1][..., None]).double()
    assert (y - follows).abs().mean() < (y - other).abs().mean() / 4
    # a weight within float32's error of a half step rounds either way: a step's error
    # across one group's channels
    torch.testing.assert_close(y, follows, atol=4e-4, rtol=1e-3)


@pytest.mark.usefixtures("use")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("sinks", "tail"), [(4, 0), (0, 7), (3, 17)])
def test_sinks_and_tail_join_the_codes_in_one_pass(dtype, sinks, tail):
    gen = torch.Generator().manual_seed(sinks * 10 + tail)
    B, nkv, n, hs, g, bits, G = 1, 3, 544, 64, 3, 8, 32
    x = torch.randn(2, B, nkv, n, hs, generator=gen)
    stored, keys, values = dequantised(x, bits, G, False)
    full = tuple(torch.randn(B, nkv, k, hs, generator=gen).to(dtype)
                 for k in (sinks, sinks, tail, tail))
    q = torch.randn(B, nkv, g, hs, generator=gen) / 8
    got = code_attention.attend_codes(q, *stored, bits, G, False, full=full)
    check(got, reference(q, keys, values, full), scale=keys.abs().max().item())


def test_the_vector_paths_and_the_plain_loops_agree_on_every_width(monkeypatch):
    built = [code_attention.load(d)[0] for d in BUILDS.values()]
    if None in built:
        pytest.skip("the kernel cannot be built here")
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 1, 3, 1024, 64, generator=gen)
    q = torch.randn(1, 3, 3, 64, generator=gen) / 8
    for bits in (8, 4, 2):
        stored, _, _ = dequantised(x, bits, 32, bits != 8)
        outs = []
        for lib in built:
            monkeypatch.setattr(code_attention, "kernel", lambda lib=lib: lib)
            m, l_sum, acc = code_attention.attend_codes(q, *stored, bits, 32, bits != 8)
            outs.append(acc / l_sum[..., None])
        # the same float32 arithmetic summed in another order; but the vector builds multiply
        # keys of 8 and 4 bits in integers, the query rounded within some 1e-5 of its largest,
        # and the plain loops do not
        for name, out in zip(BUILDS, outs):
            rounding = VECTOR_PATH and name == "plain" and bits != 2
            torch.testing.assert_close(out, outs[0], atol=1e-4 if rounding else 1e-5,
                                       rtol=1e-4 if rounding else 1e-5)
