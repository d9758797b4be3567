"""The bridge (`kvcache_cli.hf`): kvcache's caches as transformers cache layers, over the zoo.

For every decoder config class `size --verify` sweeps (tests/test_sizing_sweep.py), built
small from its defaults (the sweep's shrink: a prefix of layers holding one of every kind,
the sliding window 4, so 8 prompt tokens overflow it; then 4 heads of 16 where the model
allows), with random weights:

- the exact kind (`concat`) gives the logits `DynamicCache` gives, over the prompt and
  4 decode steps, with the model's sliding layers in transformers' window and in the
  spec's kind under the model's band;
- every quantised kind runs, and each of its layers holds the bytes `size` predicts
  (`caches.spec.layer_bytes`, at the widths `sizing` reads from the config); under the
  kvcache attention (`hf.attention`: the codes read by the kernel) it gives the logits it
  gives under SDPA over its dequantised history;
- every kind that evicts or compresses runs under the kvcache attention and holds the bytes
  `size` predicts, or the model is refused in one line for what that attention does not
  compute (a logit cap, learned sinks, keys changed after the cache);
- an architecture the bridge cannot serve (latent attention, linear attention and
  state-space layers, indexer layers) is refused in one line naming it.

And the API page's example (docs/python-api.md) runs as written.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from kvcache_cli import sizing

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from test_sizing_sweep import KNOWN_GAPS, _default_config, _skip_reason  # noqa: E402
from transformers.cache_utils import DynamicSlidingWindowLayer  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

from kvcache_cli.caches import CacheSpecError, parse_cache_spec  # noqa: E402
from kvcache_cli.caches.base import RollbackError  # noqa: E402
from kvcache_cli.caches.spec import check_spec, layer_bytes  # noqa: E402
from kvcache_cli.caches.spec_bounded import POSITION_BYTES  # noqa: E402
from kvcache_cli.hf import ATTENTION, BridgeCache, BridgeError, BridgeLayer, kv_cache  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TOLERANCE = 1e-4  # float32 logits two ways, relative to the largest (as test_llama)
PROMPT, STEPS = 8, 4
# Weights a shrunk model may have: the sweep's shrink keeps attention widths (a 4096-wide
# layer is 70M), and Gemma 3n keeps a per-layer embedding of 2.3B; initialised at float32,
# more would not fit beside the rest of the suite.
MAX_WEIGHTS = 100_000_000
# Out of scope here, with why.
NOT_HERE = {"rwkv": "RWKV keeps its own recurrent state, no Cache (and compiles a kernel for "
                    "it first, half a minute)"}
# Models whose window is only what their cache keeps (their mask is plain causal): the
# spec's kind holding every position there (sliding="full") reads more than the model does.
WINDOW_BY_CACHE = {"moshi"}
# One of each quantised family, in groups of G, the largest of 8, 4, 2 that divides every
# head width of the model (42 wide in glm4_moe's defaults); a residual short enough that the
# prompt leaves it.
QUANTISED = ("int8:g{G}", "int4:g{G}:kchan:r2", "int2:g{G}:ktok:r2:s1", "fp8-e4m3:head:calib")
# One of each kind that evicts or compresses, each budget past by the prompt.
EVICTING = ("window:4", "sink:1+3", "h2o:2+2", "snapkv:4:w2", "knorm:4", "recent:4")
# The two attentions' float32 rounding (1e-6 of the largest logit elsewhere) grows in Gemma
# 3n to 3e-4 at one of its steps (int8, groups of 8; 0 where nothing is quantised).
NOISIER = {"gemma3n_text": 1e-3}
# What a model may be refused under the kvcache attention, each in one line.
ATTENTION_REFUSED = (r"which the kvcache attention does not compute|changes its keys or values|"
                     r"never reached the kvcache attention|a mask beyond the causal order|"
                     r"keeps keys out of position order|attention that sees ahead|"
                     r"keys another layer's cache handed on")


def _narrowed(small: dict) -> dict:
    """The sweep's config narrowed further: 4 heads of 16 (2 KV heads, or 1 where it had
    one), 64 wide, a small per-layer embedding (Gemma 3n). The sweep keeps attention widths,
    which size checks; the bridge does not depend on them, and 4096-wide layers cost seconds
    to initialise. Where a model's own constraints refuse it, the sweep's config is tried."""
    heads, kv = small.get("num_attention_heads"), small.get("num_key_value_heads")
    if not isinstance(heads, int) or not isinstance(small.get("hidden_size"), int):
        return small
    narrow = {**small, "num_attention_heads": 4, "hidden_size": 64}
    if isinstance(kv, int):
        narrow["num_key_value_heads"] = 1 if kv == 1 else 2 if kv < heads else 4
    if small.get("head_dim") is not None:
        narrow["head_dim"] = 16
    for key, value in (("vocab_size_per_layer_input", 512), ("hidden_size_per_layer_input", 16)):
        if isinstance(small.get(key), int):
            narrow[key] = value
    return narrow


def _built(model_type: str, small: dict):
    """The model transformers builds for `small`, random weights in float32."""
    config = transformers.AutoConfig.for_model(model_type, **small)
    with torch.device("meta"):  # counted before a byte is allocated
        weights = sum(p.numel() for p in
                      transformers.AutoModelForCausalLM.from_config(config).parameters())
    if weights > MAX_WEIGHTS:
        raise MemoryError(f"{weights:,} weights shrunk, past the test's {MAX_WEIGHTS:,}")
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _small_model(model_type: str):
    """(the model transformers builds from the class's defaults, shrunk, with random weights
    in float32; the shape sizing reads for it; the tokens and logits DynamicCache gives), or
    a skip saying why not."""
    try:
        cfg = _default_config(model_type)
    except Exception as error:  # noqa: BLE001 - the class's own validators reject its defaults
        pytest.skip(f"{model_type}: its default config does not validate: {error!s:.100}")
    reason = (_skip_reason(model_type, cfg) or KNOWN_GAPS.get(model_type)
              or NOT_HERE.get(model_type))
    if reason:
        pytest.skip(f"{model_type}: {reason}")
    small, _ = sizing._verify_config(cfg, max_layers=1)
    small.pop("model_type")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        for candidate in (_narrowed(small), small):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model = _built(model_type, candidate)
                    tokens, want = _reference(model)
            except Exception as error:  # noqa: BLE001 - transformers raises many types
                failure = error
                continue
            shape = sizing.shape_from_config({**candidate, "model_type": model_type})
            return model, shape, tokens, want
    finally:
        transformers.logging.set_verbosity(verbosity)
    pytest.skip(f"{model_type}: transformers cannot build and run it shrunk: {failure!s:.100}")


def _run(model, cache, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Logits of the prompt tokens[:, :PROMPT], then of each later token fed alone."""
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = [model(input_ids=tokens[:, :PROMPT], cache=cache, use_cache=True).logits]
        for i in range(PROMPT, tokens.size(1)):
            out.append(model(input_ids=tokens[:, i:i + 1], cache=cache, use_cache=True).logits)
    return out


def _reference(model) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Random prompt tokens, then STEPS greedy tokens under DynamicCache, and its logits."""
    torch.manual_seed(1)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    tokens = torch.randint(0, vocab, (1, PROMPT))
    cache = transformers.DynamicCache(config=model.config)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logits = [model(input_ids=tokens, cache=cache, use_cache=True).logits]
        for _ in range(STEPS):
            tokens = torch.cat([tokens, logits[-1][:, -1:].argmax(-1)], dim=1)
            logits.append(model(input_ids=tokens[:, -1:], cache=cache, use_cache=True).logits)
    return tokens, logits


@pytest.mark.parametrize("model_type", sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
def test_every_kind_on_every_architecture(model_type, one_torch_thread, record_property):
    model, shape, tokens, want = _small_model(model_type)
    try:
        kv_cache(model, "concat")
    except BridgeError as error:
        assert "\n" not in str(error) and re.search(
            r"latent attention|layers; the bridge holds|of one width", str(error)), error
        pytest.skip(f"{model_type}: refused: {error}")

    hybrid = any(isinstance(layer, DynamicSlidingWindowLayer)
                 for layer in kv_cache(model, "concat").layers)
    banded = hybrid and model_type not in WINDOW_BY_CACHE
    for sliding in ("model", "full") if banded else ("model",):
        cache = kv_cache(model, "concat", sliding=sliding)
        got = _run(model, cache, tokens)
        if cache.get_seq_length() == 0:  # GPT-1, XLNet: a forward that keeps no Cache
            pytest.skip(f"{model_type}: its forward never writes a Cache")
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            assert (g - w).abs().max() <= TOLERANCE * w.abs().max(), (sliding, step)

    widths = {shape.layer_shape(i).head_dim for i in range(shape.layers)}
    group = next(g for g in (8, 4, 2) if all(w % g == 0 for w in widths))
    quantised = {}
    for text in QUANTISED:
        spec = parse_cache_spec(text.format(G=group))
        try:
            for width in widths:
                check_spec(spec, width)
        except CacheSpecError:  # int2 needs heads a multiple of 4: glm4_moe's are 42 wide
            continue
        cache = kv_cache(model, spec, sliding="full")
        logits = _run(model, cache, tokens)
        assert all(torch.isfinite(x).all() for x in logits), text
        _assert_size_bytes(cache, shape, spec, tokens.size(1))
        quantised[spec] = logits
    refused = _under_the_kvcache_attention(model, shape, tokens, quantised,
                                           NOISIER.get(model_type, TOLERANCE))
    record_property("kvcache_attention", refused or "served")  # for the docs' counts


def _assert_size_bytes(cache, shape, spec, tokens: int) -> None:
    """Each bridge layer holds what `size` predicts for its kind after `tokens` tokens (a
    compressed prompt: PROMPT tokens compressed, then room for every later one)."""
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, BridgeLayer):
            own = shape.layer_shape(index)
            kv, width = own.kv_heads, own.head_dim
            if spec.info.compresses:
                want = (layer_bytes(spec, PROMPT, kv, width, 4)
                        + (tokens - PROMPT) * kv * (2 * width * 4 + POSITION_BYTES))
            else:
                want = layer_bytes(spec, tokens, kv, width, 4)
            assert layer.bytes_held == want, (str(spec), index)


def _under_the_kvcache_attention(model, shape, tokens, quantised: dict, tolerance: float
                                 ) -> str | None:
    """The quantised kinds' logits again under the kvcache attention, and the kinds that
    evict or compress: run, and hold `size`'s bytes; or the model refused in one line (the
    refusal returned)."""
    model.set_attn_implementation(ATTENTION)
    for spec, want in quantised.items():
        try:
            got = _run(model, kv_cache(model, spec, sliding="full"), tokens)
        except BridgeError as error:
            assert "\n" not in str(error) and re.search(ATTENTION_REFUSED, str(error)), error
            return str(error)
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            assert (g - w).abs().max() <= tolerance * w.abs().max(), (str(spec), step)
    for text in EVICTING:
        spec = parse_cache_spec(text)
        cache = kv_cache(model, spec, max_len=tokens.size(1))
        try:
            logits = _run(model, cache, tokens)
        except BridgeError as error:
            assert "\n" not in str(error) and re.search(ATTENTION_REFUSED, str(error)), error
            return str(error)
        assert all(torch.isfinite(x).all() for x in logits), text
        _assert_size_bytes(cache, shape, spec, tokens.size(1))
    return None


def _page_example() -> str:
    page = (REPO / "docs" / "python-api.md").read_text(encoding="utf-8")
    return page.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_api_pages_example_runs_as_written(capsys, one_torch_thread):
    exec(compile(_page_example(), "docs/python-api.md", "exec"), {})  # noqa: S102
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "torch.Size([1, 20]) 19"
    total, by_kind = lines[1].split(" ", 1)
    # Two sliding layers, int4 per channel in groups of 16 with a residual of 4..19 tokens.
    assert int(total) == sum(eval(by_kind).values()) > 0  # noqa: S307
    assert lines[2].startswith("torch.Size([1, 20]) {'sliding': ")


def test_the_exact_kind_is_dynamic_caches_under_generate(one_torch_thread):
    model = _tiny_llama()
    prompt = torch.randint(0, 128, (1, 6))
    want = model.generate(prompt, max_new_tokens=6, do_sample=False)
    for spec, max_len in (("concat", None), ("static", 12), ("paged:b4", 12), ("int8:g8", None)):
        got = model.generate(prompt, cache=kv_cache(model, spec, max_len=max_len),
                             max_new_tokens=6, do_sample=False)
        assert torch.equal(got, want) or spec.startswith("int"), spec


def test_assisted_generation_crops_the_bridge(one_torch_thread):
    model = _tiny_llama()
    prompt = torch.randint(0, 128, (1, 6))
    want = model.generate(prompt, max_new_tokens=8, do_sample=False)
    cache = kv_cache(model, "concat")
    got = model.generate(prompt, cache=cache, assistant_model=_tiny_llama(seed=1),
                         max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)
    assert cache.get_seq_length() == got.size(1) - 1


def test_a_refusal_is_one_line_naming_what(one_torch_thread):
    model = _tiny_llama()
    with pytest.raises(BridgeError, match=r"^cache 'paged-int8:b16': the bridge holds static, "):
        kv_cache(model, "paged-int8")
    with pytest.raises(BridgeError, match=r"'static' allocates max_len positions"):
        kv_cache(model, "static")
    with pytest.raises(BridgeError, match=r"sliding='ring': expected one of model, full"):
        kv_cache(model, "concat", sliding="ring")
    with pytest.raises(CacheSpecError, match="group size 32 does not divide the head width 16"):
        _run(model, kv_cache(model, "int8"), torch.zeros(1, PROMPT, dtype=torch.long))
    cache = kv_cache(model, "int4:g8:kchan:r0")
    _run(model, cache, torch.zeros(1, PROMPT + 1, dtype=torch.long))
    with pytest.raises(RollbackError, match="cannot crop to 7 positions"):
        cache.crop(-2)


def test_bytes_held_per_kind_on_a_hybrid_model(one_torch_thread):
    config = transformers.Gemma2Config(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    tokens = torch.zeros(1, PROMPT, dtype=torch.long)
    kept = kv_cache(model, "int8:g8")
    _run(model, kept, tokens)
    assert isinstance(kept.layers[0], DynamicSlidingWindowLayer)
    # transformers' window keeps 3 tokens between steps; the full layer holds int8 codes.
    assert kept.bytes_by_kind() == {"sliding": 2 * 2 * 3 * 16 * 4,
                                    "full": layer_bytes(parse_cache_spec("int8:g8"), 8, 2, 16, 4)}
    whole = kv_cache(model, "int8:g8", sliding="full")
    _run(model, whole, tokens)
    assert whole.bytes_by_kind()["sliding"] == whole.bytes_by_kind()["full"]
    assert isinstance(whole, BridgeCache) and whole.bytes_held == sum(
        whole.bytes_by_kind().values())


def test_a_half_kinds_sliding_layers_store_its_2_bytes_as_its_full_layers_do(one_torch_thread):
    config = transformers.Gemma2Config(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    tokens = torch.randint(0, 128, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(2))
    rings = kv_cache(model, "fp16", max_len=PROMPT + STEPS)
    got = _run(model, rings, tokens)
    sliding = rings.layers[0]
    assert isinstance(sliding, DynamicSlidingWindowLayer) and sliding.keys.dtype == torch.float16
    # transformers' window keeps 3 tokens between steps, 2 bytes a number
    assert rings.bytes_by_kind()["sliding"] == 2 * 2 * 3 * 16 * 2
    # the kind on every layer, the band transformers' mask: the same numbers, rounded alike
    want = _run(model, kv_cache(model, "fp16", max_len=PROMPT + STEPS, sliding="full"), tokens)
    unrounded = _run(model, transformers.DynamicCache(config=model.config), tokens)
    for g, w, u in zip(got, want, unrounded, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(u, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("text", ["int4:g8:kchan:r2:s1:rot", "int2:g16:ktok:r0:rot",
                                  "fp8-e5m2:rot"])
def test_a_rotated_kind_holds_what_size_predicts(text, one_torch_thread):
    model = _tiny_llama()
    cache = kv_cache(model, text)
    logits = _run(model, cache, torch.randint(0, 128, (1, PROMPT + 3)))
    assert all(torch.isfinite(x).all() for x in logits)
    assert [layer.bytes_held for layer in cache.layers] == [
        layer_bytes(parse_cache_spec(text), PROMPT + 3, 2, 16, 4)] * 2


def _tiny_llama(seed: int = 0):
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()
