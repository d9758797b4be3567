"""A cache kind per layer: a model's sliding layers in rings of their window (exact), its
full-attention layers in the spec's kind, and the layer types read from transformers'
configs as transformers itself lays them out."""

from __future__ import annotations

import pytest
import torch
from llamakit import tiny_config, tiny_hf

from kvcache_cli.caches import make_cache
from kvcache_cli.caches.base import CacheShape, LayerType, RollbackError
from kvcache_cli.caches.bounded import RingCache
from kvcache_cli.caches.exact import ConcatCache, StaticCache
from kvcache_cli.caches.hybrid import BandedCache, HybridCache
from kvcache_cli.caches.quantized import QuantizedCache
from kvcache_cli.caches.step import Step
from kvcache_cli.models.llama import Llama, LlamaConfig, init_random
from kvcache_cli.sizing.layer_types import layer_types_from_hf
from kvcache_cli.sizing.units import ConfigError

W = 8  # the sliding layers' window
SLIDING, FULL = LayerType(window=W), LayerType()
PATTERN = (SLIDING, SLIDING, FULL, SLIDING)  # layers 0, 1, 3 slide; 2 attends in full
TOLERANCE = 1e-4  # float32 logits two ways, relative to the largest (as test_llama)


def model(layer_types=()) -> Llama:
    """A small random Llama: 4 layers, 2 KV heads of 16, 64 positions."""
    config = LlamaConfig(n_layer=4, n_head=2, n_kv_head=2, n_embd=32, intermediate=48,
                         vocab_size=50, context=64, layer_types=layer_types)
    return init_random(Llama(config), std=0.2, seed=0)


def shape(layer_types=()) -> CacheShape:
    return model(layer_types).config.cache_shape


def prefill(m: Llama, cache, n: int) -> None:
    """n positions through the model into the cache, in one forward."""
    with torch.no_grad():
        m(torch.randint(0, 50, (1, n), generator=torch.Generator().manual_seed(n)), 0, cache)


def test_a_shape_without_layer_types_is_every_layer_full_attention():
    s = shape()
    assert s.layer_types == (FULL,) * 4 and not s.hybrid
    assert s == shape((FULL,) * 4)
    with pytest.raises(ValueError, match="3 layer types for 4 layers"):
        CacheShape(n_layer=4, n_kv_head=2, head_size=16, context=64, layer_types=(FULL,) * 3)


@pytest.mark.parametrize("spec, cls", [("static", StaticCache), ("concat", ConcatCache),
                                       ("int8:g16", QuantizedCache)])
def test_an_all_full_model_gets_the_specs_own_class_unwrapped(spec, cls):
    assert type(make_cache(spec, model(), 32)) is cls


def test_each_layer_is_routed_to_its_kind_with_its_index_there():
    cache = make_cache("int8:g16", model(PATTERN), 32)
    assert isinstance(cache, HybridCache)
    rings = [cache.cache_of(i) for i in (0, 1, 3)]
    assert all(type(c) is RingCache and c.window == W and len(c.k) == 3 for c, _ in rings)
    assert [i for _, i in rings] == [0, 1, 2]
    full, index = cache.cache_of(2)
    assert type(full) is QuantizedCache and index == 0
    assert rings[0][0] is rings[2][0]  # one ring for every layer of the same window


def test_a_model_whose_every_layer_slides_is_one_ring():
    cache = make_cache("int8:g16", model((SLIDING,) * 4), 32)
    assert len(cache.caches) == 1 and type(cache.caches[0]) is RingCache
    assert len(cache.caches[0].k) == 4 and set(cache.bytes_by_kind()) == {"sliding"}


def test_a_prefill_past_the_window_holds_the_window_on_sliding_layers_and_all_on_full():
    n, m = 40, model(PATTERN)
    cache = make_cache("static", m, n)
    prefill(m, cache, n)
    per_token = 2 * 2 * 16 * 4  # K and V x 2 KV heads x 16 dims x float32, one layer
    assert cache.length == n
    assert cache.bytes_by_kind() == {"sliding": 3 * W * per_token, "full": 1 * n * per_token}
    assert cache.bytes_held == (3 * W + n) * per_token
    assert cache.bytes_copied == sum(c.bytes_copied for c in cache.caches)


def test_sliding_full_gives_the_sliding_layers_the_specs_kind_with_their_band():
    n, m = 40, model(PATTERN)
    cache = make_cache("static", m, n, sliding="full")
    banded, index = cache.cache_of(3)
    assert type(banded) is BandedCache and type(banded.inner) is StaticCache and index == 3
    prefill(m, cache, n)
    per_token = 2 * 2 * 16 * 4
    assert cache.bytes_by_kind() == {"sliding": 3 * n * per_token, "full": n * per_token}
    with pytest.raises(ValueError, match="sliding='ring': expected one of model, full"):
        make_cache("static", m, n, sliding="ring")


def test_crop_and_reset_reach_every_layers_cache():
    m = model(PATTERN)
    cache = make_cache("static", m, 32)
    prefill(m, cache, 20)
    cache.crop(19)  # a wrapped ring of the window alone rolls back one position
    assert cache.length == 19 and all(c.length == 19 for c in cache.caches)
    with pytest.raises(RollbackError, match="window:8 cannot crop from 19 to 12"):
        cache.crop(12)  # position 5, which the token at 12 attends, was overwritten
    cache.reset()
    assert cache.length == 0 and all(c.length == 0 for c in cache.caches)
    assert cache.bytes_copied == 0


# ---------------------------------------------------------------------------- exactness


def _pair(layer_types: tuple[str, ...]):
    """Our Llama with these layer types, and transformers' Qwen2 (whose layers take
    `layer_types`) holding the same weights, its q/k/v biases zero: the same function."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hf = tiny_hf(seed=5, num_hidden_layers=len(layer_types))
    ours = Llama(tiny_config(hf, layer_types=tuple(
        SLIDING if t == "sliding_attention" else FULL for t in layer_types)))
    ours.load_state_dict(hf.state_dict(), strict=False)
    ours.lm_head.weight = ours.model.embed_tokens.weight
    config = Qwen2Config(**{**hf.config.to_dict(), "layer_types": list(layer_types),
                            "sliding_window": W, "use_sliding_window": True})
    config._attn_implementation = "eager"
    qwen = Qwen2ForCausalLM(config).eval()
    missing = qwen.load_state_dict(hf.state_dict(), strict=False).missing_keys
    assert all(k.endswith("_proj.bias") for k in missing)
    with torch.no_grad():
        for name, p in qwen.named_parameters():
            if name.endswith("_proj.bias"):
                p.zero_()
    return ours, qwen


@pytest.mark.parametrize("spec, sliding", [("static", "model"), ("concat", "model"),
                                           ("static", "full")])
def test_sliding_layers_through_the_hybrid_cache_equal_a_banded_causal_mask(spec, sliding):
    types = ("sliding_attention", "full_attention", "sliding_attention")
    ours, qwen = _pair(types)
    assert layer_types_from_hf(qwen.config.to_dict()) == ours.config.layer_types
    prompt, steps = 3 * W + 3, 6  # a prompt past the window, then decode steps
    ids = torch.randint(0, 300, (1, prompt + steps), generator=torch.Generator().manual_seed(6))
    cache = make_cache(spec, ours, prompt + steps, sliding=sliding)
    with torch.no_grad():
        want = qwen(ids).logits  # (1, prompt + steps, vocab): the band as a mask
        got = [ours(ids[:, :prompt], 0, cache)]
        got += [ours(ids[:, p:p + 1], p, cache) for p in range(prompt, prompt + steps)]
    got = torch.cat(got, dim=1)
    assert (got - want).abs().max() <= TOLERANCE * want.abs().max()
    # One forward over the whole text, the band from the cache: the same logits.
    with torch.no_grad():
        full = ours(ids, 0, make_cache(spec, ours, prompt + steps, sliding="full"))
        assert torch.allclose(full, got, atol=1e-4)
    per_token = 2 * ours.config.n_kv_head * ours.config.head_size * 4
    held = cache.bytes_by_kind()
    n = prompt + steps
    assert held["full"] == n * per_token
    assert held["sliding"] == 2 * (W if sliding == "model" else n) * per_token


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_a_half_kinds_rings_hold_its_2_bytes_and_equal_it_on_every_layer_under_the_band(kind):
    """Under `fp16` or `bf16` the sliding layers' rings store numbers in the kind's 2 bytes
    too: the logits of a prompt past the window and of decoding steps (each a native call
    over the ring) are those of the kind on every layer with the band as a mask, where
    float32 rings would give the sliding layers' keys unrounded."""
    types = ("sliding_attention", "full_attention", "sliding_attention")
    ours, _ = _pair(types)
    prompt, steps = 3 * W + 3, 6
    ids = torch.randint(0, 300, (1, prompt + steps), generator=torch.Generator().manual_seed(8))

    def logits(cache):
        with torch.no_grad():
            out = [ours(ids[:, :prompt], 0, cache)]
            out += [ours(ids[:, p:p + 1], p, cache) for p in range(prompt, prompt + steps)]
        return torch.cat(out, dim=1)

    rings = make_cache(kind, ours, prompt + steps)
    ring = rings.cache_of(0)[0]
    assert isinstance(ring, RingCache) and ring.k[0].dtype == ring.v[0].dtype == \
        {"fp16": torch.float16, "bf16": torch.bfloat16}[kind]
    got = logits(rings)
    want = logits(make_cache(kind, ours, prompt + steps, sliding="full"))
    unrounded = logits(make_cache("static", ours, prompt + steps))
    assert (got - want).abs().max() <= TOLERANCE * want.abs().max()
    assert (unrounded - want).abs().max() > 3 * (got - want).abs().max()
    per_token = 2 * ours.config.n_kv_head * ours.config.head_size * 2  # 2 bytes a number
    assert rings.bytes_by_kind() == {"sliding": 2 * W * per_token,
                                     "full": (prompt + steps) * per_token}


def test_a_half_rings_compiled_write_and_attention_equal_its_native_decoding_call():
    """`attend_at` (a compiled step's, the position a tensor) rounds the token into the
    float16 ring as the native call does, and attends over the same widened numbers."""
    ring_shape = CacheShape(n_layer=1, n_kv_head=2, head_size=16, context=64)
    gen = torch.Generator().manual_seed(9)
    rings = [RingCache(ring_shape, 0, W, 64, 1, "cpu", torch.float32, f"window:{W}",
                       whole=whole, store=torch.float16) for whole in (False, True)]
    prefix = [torch.randn(1, 2, 2 * W + 1, 16, generator=gen) for _ in "kv"]
    for ring in rings:
        ring.update(0, 0, *prefix)
    q, k, v = (torch.randn(1, heads, 1, 16, generator=gen) for heads in (4, 2, 2))
    p = 2 * W + 1
    native = rings[0].attend(0, q, k, v, Step.at(p, 1, 64, "cpu"))
    compiled = rings[1].attend(0, q, k, v, Step(torch.tensor([p]), torch.tensor([p])))
    assert torch.equal(rings[0].k[0], rings[1].k[0]) and torch.equal(rings[0].v[0],
                                                                       rings[1].v[0])
    torch.testing.assert_close(compiled, native, atol=1e-5, rtol=1e-5)


def test_without_the_band_the_sliding_layers_see_past_the_window_and_the_output_differs():
    ours, qwen = _pair(("sliding_attention", "full_attention"))
    ids = torch.randint(0, 300, (1, 3 * W), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = qwen(ids).logits
        unbanded = ours(ids, 0, StaticCache(ours.config.cache_shape, 3 * W, 1, "cpu",
                                            torch.float32))
    assert (unbanded - want).abs().max() > 100 * TOLERANCE * want.abs().max()


# ---------------------------------------------------------------------------- transformers


def test_gemma3_layer_types_five_sliding_to_one_global_with_their_rotary_bases():
    from transformers import Gemma3TextConfig

    types = layer_types_from_hf(Gemma3TextConfig(sliding_window=512).to_dict())
    assert len(types) == 26
    assert [i for i, t in enumerate(types) if not t.sliding] == [5, 11, 17, 23]
    assert set(types) == {LayerType(512, 10_000.0), LayerType(None, 1_000_000.0)}


def test_gemma3_as_first_published_gives_the_local_base_beside_rope_theta():
    # google/gemma-3-270m's config.json (transformers 4's spelling): no layer_types.
    cfg = {"model_type": "gemma3_text", "num_hidden_layers": 18, "num_attention_heads": 4,
           "num_key_value_heads": 1, "head_dim": 256, "sliding_window": 512,
           "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}
    types = layer_types_from_hf(cfg)
    assert [i for i, t in enumerate(types) if not t.sliding] == [5, 11, 17]
    assert types[0] == LayerType(512, 10_000.0) and types[5] == LayerType(None, 1e6)


def test_mistral_slides_on_every_layer_with_its_one_base():
    from transformers import MistralConfig

    types = layer_types_from_hf(MistralConfig(sliding_window=4096, num_hidden_layers=4)
                                .to_dict())
    assert types == (LayerType(4096),) * 4


def test_qwen2_slides_from_max_window_layers_only_when_use_sliding_window():
    from transformers import Qwen2Config

    on = Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=32,
                     max_window_layers=2)
    assert layer_types_from_hf(on.to_dict()) == (FULL, FULL, LayerType(32), LayerType(32))
    off = Qwen2Config(num_hidden_layers=4, sliding_window=32)  # Qwen2.5: the window is off
    assert layer_types_from_hf(off.to_dict()) == (FULL,) * 4


def test_llama_is_all_full_and_a_kind_the_caches_do_not_build_is_one_line():
    from transformers import Llama4TextConfig, LlamaConfig

    assert layer_types_from_hf(LlamaConfig(num_hidden_layers=3).to_dict()) == (FULL,) * 3
    with pytest.raises(ConfigError, match="chunked layers; the caches build full and sliding"):
        layer_types_from_hf(Llama4TextConfig(num_hidden_layers=4).to_dict())


def test_a_quantised_kinds_full_precision_sinks_stay_outside_a_sliding_layers_band():
    # `int8:s4` keeps its first 4 positions unquantised; they are not attention sinks, so
    # under sliding="full" a sliding layer's band still hides them: with every layer sliding,
    # the last position's logits cannot depend on a token older than the layers' reach.
    m = model((SLIDING,) * 4)
    n = 4 * (W - 1) + 8  # past what 4 layers of window W reach back from the last position
    ids = torch.randint(0, 50, (1, n), generator=torch.Generator().manual_seed(1))
    changed = ids.clone()
    changed[0, 0] = (ids[0, 0] + 1) % 50
    with torch.no_grad():
        last = [m(x, 0, make_cache("int8:g16:s4", m, n, sliding="full"))[0, -1]
                for x in (ids, changed)]
    torch.testing.assert_close(last[0], last[1], rtol=0, atol=0)


def test_h2o_on_sliding_layers_held_whole_ranks_keys_by_the_banded_attention():
    # Under sliding="full" the band is applied around the kind, so H2O must still be shown
    # the weights it ranks keys by: without them every score stays 0 and it evicts blindly.
    m = model((SLIDING,) * 4)
    cache = make_cache("h2o:12+4", m, 40, sliding="full")
    prefill(m, cache, 24)
    inner = cache.inner if isinstance(cache, BandedCache) else cache.caches[0].inner
    assert inner.score.sum() > 0
