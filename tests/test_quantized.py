"""The quantised caches: packing and affine round trips, the residual's boundary, bytes
counted against the spec's formula, fp8 scales and saturation, crop, bad specs."""

import decoding
import pytest
import torch
from decoding import decode_logits

from kvcache_cli.caches import RollbackError, make_cache
from kvcache_cli.caches.affine import pack, quantise, unpack
from kvcache_cli.caches.fp8 import Fp8Cache
from kvcache_cli.caches.grammar import CacheSpecError
from kvcache_cli.caches.spec import check_spec, layer_bytes, parse_cache_spec
from kvcache_cli.caches.spec_quantized import quantised_split
from kvcache_cli.models.gpt2 import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Head width 32: the default group (32) fits, and so do groups of 4, 8 and 16.
CONFIG = GPTConfig(block_size=128, vocab_size=96, n_layer=2, n_head=2, n_embd=64)
HS = CONFIG.head_size


def model(dtype=torch.float32) -> GPT:
    return GPT(CONFIG, init_std=0.3, seed=0).to(dtype).eval()


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    return decoding.tokens(n, CONFIG.vocab_size, seed)  # (1, n)


def kv(T: int, seed: int = 0, B: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (B, CONFIG.n_head, T, HS)  # (B, nh, T, hs)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


# ---------------------------------------------------------------------------- formats


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_pack_then_unpack_gives_every_code_back(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (3, 5, 16), generator=g).to(torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape == (3, 5, 16 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack(packed, bits), codes)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_affine_dequantisation_error_is_at_most_half_a_step(bits):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(64, 32, generator=g) * torch.logspace(-3, 2, 64)[:, None]  # (64, G)
    q, scale, zero = quantise(x, bits)
    assert scale.dtype == zero.dtype == torch.float16
    assert int(q.max()) <= (1 << bits) - 1
    deq = q.float() * scale.float() + zero.float()
    # float32 arithmetic in the division adds a few ulps on top of the half step.
    assert ((deq - x).abs() <= scale.float() / 2 * (1 + 1e-5) + 1e-6).all()


def test_a_constant_group_dequantises_exactly_enough():
    x = torch.full((1, 8), 0.25)
    q, scale, zero = quantise(x, 4)
    assert torch.allclose(q.float() * scale.float() + zero.float(), x)


# ---------------------------------------------------------------------------- the cache


@pytest.mark.parametrize("spec", ["int8:r1000", "int4:r200", "int2:g8:kchan:r500:s3"])
def test_a_residual_longer_than_the_text_is_the_exact_cache(spec):
    m = model()
    idx = tokens(40)
    # static: its one-token steps run the native decode call over float32 keys, as the
    # residual's are read (the tail's blocks of the same call); sinks are blocks of their
    # own, merged with the tail's, so the sums part in their last bits there
    exact = decode_logits(m, make_cache("static", m, 40), idx, 10)
    quant = decode_logits(m, make_cache(spec, m, 40), idx, 10)
    if ":s" in spec:
        torch.testing.assert_close(quant, exact, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(quant, exact)  # nothing is quantised: the same arithmetic


@pytest.mark.parametrize("spec", ["int8", "int4:g8:kchan:r4", "int2:g4:ktok:r0",
                                  "int4:g16:kchan:r8:s2", "fp8-e4m3", "fp8-e5m2:head:calib",
                                  "paged-int8:b8", "paged-int4", "paged-fp8:b4"])
@pytest.mark.parametrize("n", [1, 7, 33])
def test_bytes_held_equal_the_specs_formula(spec, n):
    m = model()
    cache = make_cache(spec, m, n)
    decode_logits(m, cache, tokens(n), min(n, 5))
    per_layer = layer_bytes(parse_cache_spec(spec), n, CONFIG.n_head, HS, 4)
    assert cache.bytes_held == CONFIG.n_layer * per_layer


def test_int4_holds_under_a_third_of_float32s_bytes_at_length():
    spec = parse_cache_spec("int4:g16:kchan:r16")
    quant = layer_bytes(spec, 2000, 12, 64, 4)
    exact = layer_bytes(parse_cache_spec("static"), 2000, 12, 64, 4)
    assert quant < exact / 3


@pytest.mark.parametrize("keys", ["kchan", "ktok"])
def test_tokens_leave_the_residual_exactly_when_it_overflows(keys):
    G, R = 4, 6
    spec = parse_cache_spec(f"int4:g{G}:{keys}:r{R}")
    cache = make_cache(spec, model(), 64)
    chunk = G if keys == "kchan" else 1
    k, v = kv(30)
    for n in range(1, 31):
        cache.update(0, n - 1, k[:, :, n - 1:n], v[:, :, n - 1:n])
        layer = cache.layers[0]
        expect = max(0, n - R) // chunk * chunk
        assert layer.quantised == expect, n
        assert layer.tail_k.size(2) == n - expect
        assert quantised_split(dict(spec.params), n) == (expect, n - expect)


def test_the_residual_and_sinks_are_returned_bit_for_bit():
    cache = make_cache("int2:g4:kchan:r5:s2", model(), 64)
    k, v = kv(23)
    keys, values = cache.update(0, 0, k, v)
    quantised = cache.layers[0].quantised  # 23 - 2 sinks - 5 residual = 16: four groups
    assert quantised == 16
    assert torch.equal(keys[:, :, :2], k[:, :, :2]) and torch.equal(values[:, :, -5:], v[:, :, -5:])
    assert not torch.equal(keys[:, :, 2:18], k[:, :, 2:18])  # 2 bits do lose something


def test_per_channel_keys_follow_an_outlier_channel_better_than_per_token():
    k, v = kv(64, seed=3)
    k[..., 5] *= 40  # one channel dominates every token's range
    errors = {}
    for keys in ("kchan", "ktok"):
        cache = make_cache(f"int4:g16:{keys}:r0", model(), 64)
        got, _ = cache.update(0, 0, k, v)
        others = torch.arange(HS) != 5  # the channels sharing groups with the outlier
        errors[keys] = (got - k)[..., others].abs().mean().item()
    assert errors["kchan"] < errors["ktok"] / 3


def test_a_quantised_cache_decodes_close_to_the_exact_one_and_varies():
    m = model()
    idx = tokens(48)
    exact = decode_logits(m, make_cache("static", m, 48), idx, 16)
    assert len(set(exact[0].argmax(-1).tolist())) > 3  # the model does not repeat one token
    gaps = {spec: (decode_logits(m, make_cache(spec, m, 48), idx, 16) - exact).abs().max().item()
            for spec in ("int8", "int4:g16:kchan:r8", "int2:g16:kchan:r8")}
    assert 0 < gaps["int8"] < gaps["int4:g16:kchan:r8"] < gaps["int2:g16:kchan:r8"]


def test_a_half_precision_model_gets_its_own_dtype_back():
    cache = make_cache("int4:g8:kchan:r2", model(torch.bfloat16), 32)
    k, v = kv(20)
    keys, values = cache.update(0, 0, k.bfloat16(), v.bfloat16())
    assert keys.dtype == values.dtype == torch.bfloat16 and keys.shape == (1, 2, 20, HS)


# ---------------------------------------------------------------------------- fp8


def test_fp8_with_scale_one_saturates_and_counts_what_a_calibrated_scale_keeps():
    k, v = kv(10)
    k[0, 0, 3, 2] = 1000.0  # beyond e4m3's 448
    one = make_cache("fp8-e4m3:tensor:one", model(), 16)
    got, _ = one.update(0, 0, k, v)
    assert one.saturated == 1 and got[0, 0, 3, 2].item() == 448.0
    calib = make_cache("fp8-e4m3:tensor:calib", model(), 16)
    got, _ = calib.update(0, 0, k, v)
    assert calib.saturated == 0 and abs(got[0, 0, 3, 2].item() - 1000.0) < 1000 / 16


def test_fp8_per_head_scales_are_one_per_row_and_head():
    cache = make_cache("fp8-e5m2:head:calib", model(), 16, batch=3)
    assert isinstance(cache, Fp8Cache)
    k, v = kv(4, B=3)
    cache.update(1, 0, k, v)
    amax = k.abs().amax(dim=(2, 3))  # (B, nh)
    torch.testing.assert_close(cache.scales[1, 0], amax / 57344.0)


# ---------------------------------------------------------------------------- crop


@pytest.mark.parametrize("spec, at", [
    ("int4:g4:kchan:r12", 28), ("int2:g4:kchan:r3:s2", 29), ("int8:g8:ktok:r0", 22),
    ("fp8-e4m3:head:calib", 22), ("paged-int4:b4", 22)])
def test_crop_forgets_tokens_as_if_never_written(spec, at):
    # `at` lies where the quantised part of a 30-token cache is what it was at `at`
    # tokens: crop keeps the kept tokens as they are, and quantised stays quantised.
    m = model()
    idx, other = tokens(30), tokens(30, seed=1)
    cache = make_cache(spec, m, 30)
    reference = decode_logits(m, cache, idx, 8)
    cache.crop(at)
    decode_logits_from(m, cache, other, at, 30)  # a rejected draft
    cache.crop(at)
    redone = decode_logits_from(m, cache, idx, at, 30)
    assert cache.length == 30
    assert torch.equal(redone, reference[:, at:])


@pytest.mark.parametrize("spec", ["int4:g4:kchan:r6", "int2:g4:ktok:r3:s2", "int8:g8:ktok:r0"])
def test_crop_keeps_what_attention_read_of_the_kept_tokens(spec):
    cache = make_cache(spec, model(), 64)
    k, v = kv(31)
    before, _ = cache.update(0, 0, k[:, :, :30], v[:, :, :30])
    cache.crop(24)  # 24: a group boundary of every spec here
    after, _ = cache.update(0, 24, k[:, :, 30:31], v[:, :, 30:31])
    assert torch.equal(after[:, :, :24], before[:, :, :24]) and after.size(2) == 25


@pytest.mark.parametrize("spec", ["int4:g4:kchan:r6", "int8:g8:ktok:r0", "fp8-e4m3"])
def test_crop_copies_nothing(spec):
    # What is kept stays where it was: views of the same storage, not a clone of the history.
    cache = make_cache(spec, model(), 64)
    k, v = kv(30)
    cache.update(0, 0, k, v)
    held = cache.k[0] if isinstance(cache, Fp8Cache) else cache.layers[0].k_codes
    cache.crop(24)
    kept = cache.k[0] if isinstance(cache, Fp8Cache) else cache.layers[0].k_codes
    assert kept.size(2) > 0 and kept.data_ptr() == held.data_ptr()


def decode_logits_from(m: GPT, cache, idx: torch.Tensor, start: int, end: int):
    with torch.no_grad():
        return torch.cat([m(idx[:, p:p + 1], p, cache) for p in range(start, end)], dim=1)


def test_crop_inside_a_per_channel_key_group_is_refused_in_one_line():
    cache = make_cache("int4:g4:kchan:r2", model(), 64)
    k, v = kv(20)
    cache.update(0, 0, k, v)  # 20 - 2 residual = 18 -> 16 quantised, a tail of 4
    cache.update(1, 0, k, v)
    with pytest.raises(RollbackError, match="crop to a group boundary") as error:
        cache.crop(10)
    assert "\n" not in str(error.value) and cache.length == 20
    cache.crop(8)  # a group boundary: whole groups are kept bit for bit
    assert cache.length == 8 and cache.layers[1].quantised == 8


def test_crop_past_the_length_is_refused():
    cache = make_cache("int8", model(), 8)
    with pytest.raises(RollbackError, match="expected 0..0"):
        cache.crop(3)


# ---------------------------------------------------------------------------- specs


def test_the_defaults_spell_out_in_full():
    assert str(parse_cache_spec("int4")) == "int4:g32:kchan:r128"
    assert str(parse_cache_spec("int8")) == "int8:g32:ktok:r0"
    assert str(parse_cache_spec("INT2:r64:s4:g16")) == "int2:g16:kchan:r64:s4"
    assert str(parse_cache_spec("fp8")) == "fp8-e4m3:tensor:one"
    assert str(parse_cache_spec("paged-int8")) == "paged-int8:b16"


@pytest.mark.parametrize("text, message", [
    ("int4:g32:x", "unknown field 'x'; expected gN"),
    ("int4:g1", "group size '1' is not a whole number from 2"),
    ("int4:r8:r16", "residual given twice"),
    ("int3", "unknown cache 'int3'"),
    ("fp8:calib:one", "init given twice"),
    ("fp8-e4m3:row", "unknown field 'row'; expected tensor or head"),
])
def test_a_bad_quantised_spec_is_refused_in_one_line(text, message):
    with pytest.raises(CacheSpecError, match=message) as error:
        parse_cache_spec(text)
    assert "\n" not in str(error.value)


def test_a_group_that_does_not_divide_the_head_width_is_refused_before_a_model_loads():
    with pytest.raises(CacheSpecError, match="group size 48 does not divide the head width 64"):
        check_spec(parse_cache_spec("int4:g48"), 64)
    with pytest.raises(CacheSpecError, match="multiple of 4"):
        check_spec(parse_cache_spec("int2:g2"), 6)
    with pytest.raises(CacheSpecError, match="group size 64 does not divide the head width 32"):
        make_cache("int4:g64", model(), 8)
