"""The Hadamard rotation of the quantised caches (`:rot`): an orthogonal matrix, the same
numbers in exact arithmetic, less rounding error where a channel is an outlier, no bytes
added, and one line refusing a head it cannot rotate."""

import math

import decoding
import pytest
import torch
from decoding import decode_logits
from typer.testing import CliRunner

from kvcache_cli.caches import make_cache
from kvcache_cli.caches.base import CacheShape
from kvcache_cli.caches.fp8 import Fp8Cache
from kvcache_cli.caches.grammar import CacheSpecError
from kvcache_cli.caches.quantized import QuantizedCache
from kvcache_cli.caches.rotation import Rotation, hadamard
from kvcache_cli.caches.spec import check_spec, layer_bytes, parse_cache_spec
from kvcache_cli.cli import app
from kvcache_cli.models.gpt2 import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Head width 32, a power of two: the default group (32) fits, so does a rotation.
CONFIG = GPTConfig(block_size=128, vocab_size=96, n_layer=2, n_head=2, n_embd=64)
HS = CONFIG.head_size


def model(dtype=torch.float32) -> GPT:
    return GPT(CONFIG, init_std=0.3, seed=0).to(dtype).eval()


def outlier_kv(T: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values (1, nh, T, hs) with one channel offset by 20 times the others'
    spread, as a trained model's outlier channels are (large, and of one sign)."""
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(1, CONFIG.n_head, T, HS, generator=g) for _ in range(2))
    k[..., 5] += 20
    v[..., 11] += 20
    return k, v


@pytest.mark.parametrize("n", [1, 2, 8, 64, 128])
def test_the_hadamard_matrix_is_orthogonal_and_its_own_inverse(n):
    h = hadamard(n, dtype=torch.float64)
    eye = torch.eye(n, dtype=torch.float64)
    # float64: the products of +-1/sqrt(n) sum to 0 or 1 within a few ulps.
    torch.testing.assert_close(h @ h.T, eye, rtol=0, atol=1e-12)
    torch.testing.assert_close(h, h.T, rtol=0, atol=0)
    assert torch.equal(h.abs(), torch.full((n, n), 1 / math.sqrt(n), dtype=torch.float64))


def test_rotating_then_unrotating_gives_the_numbers_back():
    x = torch.randn(3, 5, HS, generator=torch.Generator().manual_seed(1))
    r = Rotation(HS, "cpu")
    # float32 rounding of a 32-term sum, twice (the target's 1e-5).
    torch.testing.assert_close(r.unrotate(r.rotate(x)), x, rtol=0, atol=1e-5)
    assert not torch.allclose(r.rotate(x), x)  # it does move them


@pytest.mark.parametrize("spec", ["int4:g32:ktok:r0", "int2:g32:ktok:r0", "int4:g32:kchan:r0",
                                  "int2:g32:kchan:r0"])
def test_rotation_lowers_the_error_of_an_outlier_channel(spec):
    k, v = outlier_kv(64)
    errors = {}
    for rot in ("", ":rot"):
        cache = make_cache(spec + rot, model(), 64)
        keys, values = cache.update(0, 0, k, v)
        errors[rot] = ((keys - k).norm() + (values - v).norm()).item()
    # A group spanning the head: the offset sets every token's range unrotated, and
    # 20/sqrt(32) of it after (measured: 0.48 to 0.58 of the error, seeds 0..2).
    assert errors[":rot"] < 0.7 * errors[""], errors


@pytest.mark.parametrize("spec", ["int4:g32:kchan:r8:rot", "int2:g8:kchan:r4:s2:rot"])
def test_per_channel_keys_sinks_and_residual_under_rotation(spec):
    k, v = outlier_kv(40)
    cache = make_cache(spec, model(), 64)
    keys, values = cache.update(0, 0, k, v)
    p = dict(parse_cache_spec(spec).params)
    s, r = p["sinks"], cache.layers[0].tail_k.size(2)
    assert cache.layers[0].quantised > 0 and r >= p["residual"]
    # Only what is quantised is rotated: the sinks and the residual come back bit for bit.
    assert torch.equal(keys[:, :, :s], k[:, :, :s]) and torch.equal(keys[:, :, -r:], k[:, :, -r:])
    assert torch.equal(values[:, :, -r:], v[:, :, -r:])
    # ... and what is, comes back in the model's basis, within the codes' error.
    q = slice(s, 40 - r)
    assert (values[:, :, q] - v[:, :, q]).abs().max() < v.abs().max() / 2


@pytest.mark.parametrize("spec", ["int8:g32:ktok:r0", "int8:g32:kchan:r0"])
def test_at_eight_bits_the_rotated_cache_decodes_as_the_exact_one(spec):
    m = model()
    idx = decoding.tokens(48, CONFIG.vocab_size, 0)
    exact = decode_logits(m, make_cache("static", m, 48), idx, 16)
    assert len(set(exact[0].argmax(-1).tolist())) > 3  # the model does not repeat one token
    logits = {rot: decode_logits(m, make_cache(spec + rot, m, 48), idx, 16)
              for rot in ("", ":rot")}
    assert not torch.equal(logits[":rot"], logits[""])  # the rotation was applied
    gap = {rot: (got - exact).abs() for rot, got in logits.items()}
    # int8's step is 1/255 of a group's range: the logits move by about 1% of their
    # spread (measured 0.3% to 1%), and the rotation only moves where the rounding falls.
    assert gap[":rot"].mean() < 0.02 * exact.std()
    assert gap[":rot"].mean() < 1.25 * gap[""].mean()
    assert (logits[":rot"].argmax(-1) == exact.argmax(-1)).float().mean() >= 0.95


def test_a_residual_longer_than_the_text_is_exact_with_rotation():
    m = model()
    idx = decoding.tokens(40, CONFIG.vocab_size, 0)
    # concat: SDPA, as the residual is read (`static` decodes in the native call)
    exact = decode_logits(m, make_cache("concat", m, 40), idx, 10)
    assert torch.equal(decode_logits(m, make_cache("int4:r1000:rot", m, 40), idx, 10), exact)


@pytest.mark.parametrize("spec", ["int8:rot", "int4:g8:kchan:r4:rot", "int2:g4:ktok:r0:s3:rot",
                                  "fp8-e4m3:rot", "fp8-e5m2:head:calib:rot"])
@pytest.mark.parametrize("n", [1, 7, 33])
def test_bytes_held_with_rotation_equal_the_formula_and_the_unrotated_bytes(spec, n):
    m = model()
    cache = make_cache(spec, m, n)
    assert cache.rotation is not None
    decode_logits(m, cache, decoding.tokens(n, CONFIG.vocab_size, 0), min(n, 5))
    parsed = parse_cache_spec(spec)
    per_layer = layer_bytes(parsed, n, CONFIG.n_head, HS, 4)
    assert cache.bytes_held == CONFIG.n_layer * per_layer
    plain = parse_cache_spec(str(parsed).removesuffix(":rot"))
    assert layer_bytes(plain, n, CONFIG.n_head, HS, 4) == per_layer


def test_rot_spells_back_and_is_off_by_default():
    assert str(parse_cache_spec("INT4:ROT:g16")) == "int4:g16:kchan:r128:rot"
    assert str(parse_cache_spec("fp8:rot")) == "fp8-e4m3:tensor:one:rot"
    assert parse_cache_spec("int2")["rotate"] == 0 and parse_cache_spec("fp8")["rotate"] == 0
    with pytest.raises(CacheSpecError, match="rotate given twice"):
        parse_cache_spec("int8:rot:rot")


@pytest.mark.parametrize("spec", ["int4:g16:rot", "fp8-e4m3:rot"])
def test_a_head_size_that_is_not_a_power_of_two_is_refused_in_one_line(spec):
    with pytest.raises(CacheSpecError, match="rot needs a head width that is a power of two "
                                             r"\(a Sylvester-Hadamard matrix\), not 48") as error:
        check_spec(parse_cache_spec(spec), 48)
    assert "\n" not in str(error.value)
    shape = CacheShape(n_layer=1, n_kv_head=1, head_size=48, context=16)
    with pytest.raises(CacheSpecError, match="not 48"):
        cls = Fp8Cache if spec.startswith("fp8") else QuantizedCache
        cls.build(parse_cache_spec(spec), shape, max_len=16, batch=1, device="cpu",
                  dtype=torch.float32, whole=False)
    check_spec(parse_cache_spec(spec.replace(":rot", "")), 48)  # the same without rot fits


def test_the_cli_refuses_a_rotation_its_model_cannot_take_with_exit_2():
    # sizing a head 80 wide (phi-2's): refused before anything is computed
    result = CliRunner().invoke(app, ["size", "--layers", "2", "--kv-heads", "2", "--head-dim",
                                      "80", "--seq", "1000", "--cache", "int4:g16:rot"])
    assert result.exit_code == 2, result.output
    assert "rot needs a head width that is a power of two" in result.output
    assert "not 80" in result.output and result.output.count("\n") == 1
