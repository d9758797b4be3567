"""The half-precision caches (`fp16`, `bf16`): 2 bytes a number held, attention in float32;
equal to attention over keys and values rounded to half (near bitwise, kernel and torch
path alike), within half precision's rounding of the float32 cache, and the same greedy
tokens as the float cache on the tiny models."""

import json
import math

import pytest
import torch
from llamakit import tiny_hf, write_tiny_gguf
from typer.testing import CliRunner

from kvcache_cli.bench import context as bench_context
from kvcache_cli.caches import code_attention, make_cache
from kvcache_cli.caches.base import CacheShape
from kvcache_cli.caches.half import HALF_DTYPES, HalfCache
from kvcache_cli.caches.spec import layer_bytes, parse_cache_list, parse_cache_spec
from kvcache_cli.caches.step import Step, sdpa
from kvcache_cli.cli import app
from kvcache_cli.generate import generate
from kvcache_cli.models import load_model
from kvcache_cli.models.gpt2 import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Round to nearest: a stored number is within this relative error of the float32 one.
UNIT_ROUNDOFF = {"fp16": 2.0**-11, "bf16": 2.0**-8}
SHAPE = CacheShape(n_layer=1, n_kv_head=3, head_size=64, context=4096)


def _filled(fmt: str, n: int, seed: int = 0):
    """A cache of n - 1 prompt tokens, and the decoding token's q (B, nh, 1, hs), k, v
    (B, nkv, n, hs) in float32: the cache's output for it, and the inputs."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(2, 3, n, 64, generator=g) * 2  # (B, nkv, n, hs)
    v = torch.randn(2, 3, n, 64, generator=g)
    q = torch.randn(2, 9, 1, 64, generator=g) * 2  # (B, nh, 1, hs): 3 queries a KV head
    cache = HalfCache(SHAPE, n, 2, "cpu", torch.float32, store=HALF_DTYPES[fmt])
    cache.update(0, 0, k[:, :, :-1], v[:, :, :-1])
    y = cache.attend(0, q, k[:, :, -1:], v[:, :, -1:], Step.at(n - 1, 1, 4096, "cpu"))
    return y, q, k, v


def _rounding_bound(fmt: str, q, k, v) -> float:
    """How far half-precision rounding of k and v may move attention's output: v's rounding
    moves it by at most u max|v|; k's moves each score by at most u sum_d |q_d k_d| / sqrt(hs)
    (call the largest e), so each weight by a factor within exp(+-2e), the output by at most
    (exp(2e) - 1) max|v|. Plus float32's own noise."""
    u = UNIT_ROUNDOFF[fmt]
    qg = q.view(2, 3, 3, 64).abs()  # (B, nkv, g, hs)
    e = u * (qg @ k.abs().transpose(-1, -2)).max().item() / math.sqrt(64)
    vmax = v.abs().max().item()
    return u * vmax + math.expm1(2 * e) * vmax + 1e-5


# ---------------------------------------------------------------------------- the spec


def test_fp16_and_bf16_are_kinds_every_command_reads():
    for fmt in ("fp16", "bf16"):
        spec = parse_cache_spec(fmt.upper())
        assert str(spec) == fmt and spec.info.factory.endswith("half:HalfCache")
        assert not spec.info.exact and spec.info.rollback  # rounded, but rolls back
    rows = json.loads(CliRunner().invoke(app, ["caches", "--json"]).stdout)
    assert {"fp16", "bf16"} <= {r["name"] for r in rows}


def test_a_half_cache_holds_2_bytes_a_number_whatever_the_model_runs_in():
    spec = parse_cache_spec("fp16")
    for element in (4, 2, 8):
        assert layer_bytes(spec, 100, 3, 64, element) == 2 * 100 * 3 * 64 * 2
    cache = HalfCache(SHAPE, 40, 1, "cpu", torch.float32, store=torch.bfloat16)
    x = torch.randn(1, 3, 40, 64)
    cache.update(0, 0, x, x)
    assert cache.bytes_held == cache.bytes_copied == 2 * 40 * 3 * 64 * 2
    assert cache.k[0].dtype == torch.bfloat16


def test_size_prices_the_half_kinds_at_half_of_a_float32_static():
    from kvcache_cli.models.live import live_kinds
    from kvcache_cli.sizing.presets import preset

    shape = preset("gpt2").shape
    held = {k.spec: k for k in live_kinds(shape, 1000, "fp32").kinds}
    for fmt in ("fp16", "bf16"):
        assert held[fmt].bytes_held == held["static"].bytes_held // 2
        assert held[fmt].ratio_to_static == 0.5
    out = CliRunner().invoke(app, ["size", "-m", "llama-2-7b", "--seq", "4096", "--cache", "fp16",
                                   "--dtype", "fp32", "--json"])
    r = json.loads(out.stdout)  # 2 x 32 layers x 32 KV heads x 128 x 4,096 tokens x 2 bytes
    assert r["payload_bytes"] == r["bytes_per_sequence"] == 2 * 32 * 32 * 128 * 4096 * 2
    assert r["full_bytes"] == r["scale_bytes"] == 0 and r["ratio_to_fp16"] == 1.0


# ---------------------------------------------------------------------------- attention


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
@pytest.mark.parametrize("n", [1, 9, 700, 1300])  # one token; under, over and past a block
def test_a_decode_step_is_attention_over_k_v_rounded_to_half(fmt, n):
    y, q, k, v = _filled(fmt, n)
    store = HALF_DTYPES[fmt]
    rounded = sdpa(q, k.to(store).float(), v.to(store).float(), None)  # (B, nh, 1, hs)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, rounded, rtol=1e-5, atol=1e-5)  # float32's sum order
    exact = sdpa(q, k, v, None)
    moved = (y - exact).abs().max().item()
    assert 0 < moved <= _rounding_bound(fmt, q, k, v), (moved, _rounding_bound(fmt, q, k, v))


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_the_kernel_and_the_torch_path_agree(fmt, monkeypatch):
    if code_attention.kernel() is None:
        pytest.skip(f"the kernel cannot be built here: {code_attention.NOTE}")
    calls = []
    real = code_attention.attend_decode
    monkeypatch.setattr(code_attention, "attend_decode", lambda *a: calls.append(1) or real(*a))
    kernel, *_ = _filled(fmt, 600)
    assert calls  # the decode step read the stored numbers through the kernel
    monkeypatch.setattr(code_attention, "kernel", lambda: None)
    calls.clear()
    torch_path, *_ = _filled(fmt, 600)
    assert not calls
    torch.testing.assert_close(kernel, torch_path, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- models


def _greedy(model, prompt: list[int], n: int, spec: str) -> list[int]:
    return list(generate(model, prompt, n, spec).tokens)  # temperature 0: the argmax


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = write_tiny_gguf(tiny_hf(seed=3), tmp_path_factory.mktemp("half") / "tiny.gguf")
    return load_model(str(path)).model


def test_greedy_fp16_tokens_on_the_tiny_llama_are_the_float_caches(tiny_llama):
    prompt = list(range(5, 25))
    tokens = _greedy(tiny_llama, prompt, 24, "fp16")
    assert tokens == _greedy(tiny_llama, prompt, 24, "static")
    assert len(set(tokens)) > 3  # a real sequence, not one token repeated


def test_bf16_keeps_every_token_its_rounding_cannot_flip(tiny_llama):
    """bf16 keeps 8 bits of mantissa: on this random model the float cache's greedy step 4
    is a near tie (its top two 0.001 apart) that bf16's rounding (logits moved by ~0.03)
    flips. Along the float cache's tokens, every step whose top two are further apart than
    twice the logits moved must choose the same token, and most steps are such."""
    prompt = list(range(5, 25))
    tokens = _greedy(tiny_llama, prompt, 24, "static")
    ids = torch.tensor([prompt + tokens[:-1]])
    with torch.no_grad():  # teacher-forced, one token a step after the prompt
        full, half = (torch.cat([tiny_llama(ids[:, :20], 0, c)[:, -1:]] +
                                [tiny_llama(ids[:, p:p + 1], p, c) for p in range(20, 43)], 1)[0]
                      for c in (make_cache(s, tiny_llama, 44) for s in ("static", "bf16")))
    top = full.topk(2).values  # (24, 2)
    margin, moved = top[:, 0] - top[:, 1], (half - full).abs().amax(-1)  # (24,)
    decided = margin > 2 * moved
    assert torch.equal(half.argmax(-1)[decided], full.argmax(-1)[decided])
    assert int(decided.sum()) >= 20 and not decided.all()  # step 4 is the tie


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_greedy_tokens_on_the_tiny_gpt2_are_the_float_caches(fmt):
    model = GPT(GPTConfig(block_size=64, vocab_size=96, n_layer=2, n_head=2, n_embd=64),
                init_std=0.3, seed=0).eval()
    prompt = list(range(3, 15))
    tokens = _greedy(model, prompt, 30, fmt)
    assert tokens == _greedy(model, prompt, 30, "static")
    assert len(set(tokens)) > 3


def test_the_logits_move_by_rounding_only(tiny_llama):
    ids = torch.tensor([list(range(5, 45))])
    with torch.no_grad():
        full = tiny_llama(ids, 0, make_cache("static", tiny_llama, 40))
        for fmt in ("fp16", "bf16"):
            half = tiny_llama(ids, 0, make_cache(fmt, tiny_llama, 40))
            moved = (half - full).abs().max().item()
            assert 0 < moved < 50 * UNIT_ROUNDOFF[fmt] * full.abs().max().item(), (fmt, moved)


def test_bench_context_times_fp16_by_default_and_sets_llama_cpps_f16_beside_it():
    default = parse_cache_list(bench_context.DEFAULT_CACHES)
    assert [str(s) for s in default][:2] == ["static", "fp16"]  # beside, not instead
    assert bench_context._matched(default, "f16") == "fp16"  # like for like
    assert bench_context._matched(parse_cache_list("static,int8"), "f16") == "static"
    assert bench_context._matched(parse_cache_list("bf16,int8"), "f16") == "bf16"


def test_bench_context_reads_2_bytes_a_number_of_the_half_caches():
    model = load_model("stdlib-bytes").model
    r = bench_context.run_context(model, parse_cache_list("static,fp16,bf16"), [24, 48], 2, 1,
                                  1, "stdlib-bytes", "fp32", with_llama=False)
    static, fp16, bf16 = r.series
    for s in (fp16, bf16):
        assert [2 * p.cache_bytes for p in s.points] == [p.cache_bytes for p in static.points]
