"""The kvcache attention inside transformers (`kvcache_cli.hf.attention`), and the kinds that
evict or compress as transformers cache layers.

- every evicting and compress-once kind gives, on a tiny Llama run by transformers, the
  logits kvcache's own Llama gives with the same weights, through a prompt longer than the
  budget and several decode steps;
- on the quantised kinds the registered attention equals SDPA over the dequantised
  history, and reads no float copy of it while decoding;
- what it cannot serve is refused in one line: an evicting kind under another attention,
  a position policy or a per-depth budget a cache of one layer cannot hold, padded rows,
  a rollback the kind cannot make.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from llamakit import tiny_hf  # noqa: E402

from kvcache_cli.caches import make_cache  # noqa: E402
from kvcache_cli.caches.base import RollbackError  # noqa: E402
from kvcache_cli.caches.quantized import QuantizedCache  # noqa: E402
from kvcache_cli.hf import ATTENTION, BridgeError, kv_cache  # noqa: E402
from kvcache_cli.models.llama import Llama, LlamaConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOLERANCE = 1e-4  # float32 logits two ways, relative to the largest (as test_llama)
PROMPT, STEPS = 20, 6  # a prompt past every budget below, then tokens fed one at a time
EVICTING = ["window:8", "window:8:k3", "sink:2+6", "h2o:3+5", "snapkv:8:w3", "snapkv:0.4:avg",
            "knorm:8", "recent:8:s2"]
QUANTISED = ["int8:g8", "int4:g8:kchan:r2", "int2:g16:ktok:r2:s1", "int4:g8:kchan:r2:s1:rot",
             "fp8-e4m3:head:calib", "fp16", "bf16"]


def _pair():
    """A random transformers Llama running the kvcache attention, and kvcache's Llama with
    its weights."""
    hf = tiny_hf(seed=7)
    hf.set_attn_implementation(ATTENTION)
    ours = Llama(LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, intermediate=96,
                             vocab_size=300, context=128, tie_word_embeddings=True))
    ours.load_state_dict(hf.state_dict(), strict=False)
    ours.lm_head.weight = ours.model.embed_tokens.weight
    return hf, ours.eval()


def _tokens(n: int = PROMPT + STEPS) -> torch.Tensor:
    return torch.randint(0, 300, (1, n), generator=torch.Generator().manual_seed(3))


def _hf_logits(model, cache, tokens: torch.Tensor, prompt: int = PROMPT) -> torch.Tensor:
    """Logits (1, n, vocab) of the prompt in one forward, then each later token alone."""
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = [model(input_ids=tokens[:, :prompt], cache=cache).logits]
        for i in range(prompt, tokens.size(1)):
            out.append(model(input_ids=tokens[:, i:i + 1], cache=cache).logits)
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("spec", EVICTING)
def test_each_evicting_kind_gives_kvcache_own_models_logits(spec):
    hf, ours = _pair()
    tokens = _tokens()
    n = tokens.size(1)
    cache = kv_cache(hf, spec, max_len=n)
    got = _hf_logits(hf, cache, tokens)
    own = make_cache(spec, ours, n)
    with torch.inference_mode():
        want = [ours(tokens[:, :PROMPT], 0, own)]
        want += [ours(tokens[:, p:p + 1], p, own) for p in range(PROMPT, n)]
    want = torch.cat(want, dim=1)
    assert (got - want).abs().max() <= TOLERANCE * want.abs().max()
    # The cut is real: the exact cache's logits differ once the budget evicts.
    exact = _hf_logits(hf, kv_cache(hf, "concat"), tokens)
    assert (exact - want)[:, PROMPT:].abs().max() > 1e-3
    # transformers' masks and positions count every token seen; the cache holds its budget.
    assert cache.get_seq_length() == n
    assert cache.bytes_held == own.bytes_held


def _spy_reads(monkeypatch) -> list[int]:
    """Count the float copies a quantised cache makes of its history (`_read`)."""
    reads: list[int] = []
    original = QuantizedCache._read

    def counted(self, L):
        reads.append(1)
        return original(self, L)

    monkeypatch.setattr(QuantizedCache, "_read", counted)
    return reads


@pytest.mark.parametrize("spec", QUANTISED)
def test_the_kvcache_attention_equals_sdpa_over_the_dequantised_history(spec):
    hf, _ = _pair()
    tokens = _tokens()
    got = _hf_logits(hf, kv_cache(hf, spec, max_len=tokens.size(1)), tokens)
    hf.set_attn_implementation("sdpa")
    want = _hf_logits(hf, kv_cache(hf, spec, max_len=tokens.size(1)), tokens)
    assert (got - want).abs().max() <= TOLERANCE * want.abs().max()


def test_a_quantised_layer_decodes_from_its_codes_with_no_float_copy(monkeypatch):
    hf, _ = _pair()
    tokens = _tokens()
    reads = _spy_reads(monkeypatch)
    for attention, copies in ((ATTENTION, 0), ("sdpa", 2 * STEPS)):
        hf.set_attn_implementation(attention)
        cache = kv_cache(hf, "int4:g8:kchan:r2")
        _hf_logits(hf, cache, tokens[:, :PROMPT], prompt=PROMPT)
        reads.clear()
        _hf_logits(hf, cache, tokens, prompt=PROMPT)  # the prompt again: a chunk, then steps
        # Under the kvcache attention only the chunk reads a copy (2 layers); each decoding
        # step reads the codes in place. Under SDPA every step dequantises every layer.
        assert len(reads) == 2 + copies, attention


def test_other_layers_and_other_caches_get_transformers_sdpa():
    hf, _ = _pair()
    tokens = _tokens()
    got = _hf_logits(hf, transformers.DynamicCache(config=hf.config), tokens)
    hf.set_attn_implementation("sdpa")
    want = _hf_logits(hf, transformers.DynamicCache(config=hf.config), tokens)
    assert torch.equal(got, want)


def test_a_hybrid_model_keeps_its_window_beside_an_evicting_kind():
    config = transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    tokens = torch.randint(0, 128, (1, 14))
    want = _hf_logits(model, transformers.DynamicCache(config=model.config), tokens, 8)
    model.set_attn_implementation(ATTENTION)
    for sliding in ("model", "full"):
        # A window longer than the text evicts nothing: exact on either sliding choice.
        got = _hf_logits(model, kv_cache(model, "window:32", sliding=sliding), tokens, 8)
        assert (got - want).abs().max() <= TOLERANCE * want.abs().max(), sliding
        quantised = _hf_logits(model, kv_cache(model, "int8:g8", sliding=sliding), tokens, 8)
        assert (quantised - want).abs().max() <= 0.05 * want.abs().max(), sliding


def test_an_evicting_kind_under_another_attention_is_refused_in_one_line():
    hf, _ = _pair()
    hf.set_attn_implementation("sdpa")
    with pytest.raises(BridgeError, match=r"^cache 'window:8' keeps keys out of position "
                       r"order.*set_attn_implementation\(\"kvcache\"\)$"):
        _hf_logits(hf, kv_cache(hf, "window:8"), _tokens())


@pytest.mark.parametrize("spec, message", [
    ("sink:2+6:rerotate", r"rerotate turns kept keys .* drop :rerotate"),
    ("snapkv:8:pyramid", r"pyramid shares one budget .* drop :pyramid"),
    ("knorm:8", r"allocates max_len positions up front: pass max_len"),
    ("paged-int8", r"the bridge holds static, .*; serve's block pools and the peers"),
])
def test_what_a_cache_of_one_layer_cannot_hold_is_refused_in_one_line(spec, message):
    hf, _ = _pair()
    with pytest.raises(BridgeError, match=message) as error:
        kv_cache(hf, spec)
    assert "\n" not in str(error.value)


def test_padded_rows_are_refused_in_one_line():
    hf, _ = _pair()
    tokens = _tokens().expand(2, -1)
    mask = torch.ones_like(tokens)
    mask[1, :3] = 0  # the second row left-padded
    with pytest.raises(BridgeError, match=r"a mask beyond the causal order \(padded rows"):
        hf(input_ids=tokens[:, :PROMPT], attention_mask=mask[:, :PROMPT],
           cache=kv_cache(hf, "window:8"))


def test_a_model_that_caps_its_logits_is_refused_in_one_line():
    config = transformers.Gemma2Config(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.set_attn_implementation(ATTENTION)
    with pytest.raises(BridgeError, match=r"a logit cap \(softcap\), which the kvcache "
                                          r"attention does not compute"):
        _hf_logits(model, kv_cache(model, "window:8"), torch.zeros(1, 10, dtype=torch.long), 8)


def test_assisted_generation_crops_a_ring_with_spare_slots():
    hf, _ = _pair()
    assistant = tiny_hf(seed=8)
    prompt = _tokens(PROMPT)
    spec = "window:12:k24"  # assisted generation rejects up to its 20 drafted tokens
    want = hf.generate(prompt, cache=kv_cache(hf, spec), max_new_tokens=10, do_sample=False)
    cache = kv_cache(hf, spec)
    got = hf.generate(prompt, cache=cache, assistant_model=assistant, max_new_tokens=10,
                      do_sample=False)
    assert torch.equal(got, want)
    assert cache.get_seq_length() == got.size(1) - 1


def test_a_rollback_the_kind_cannot_make_is_refused_in_one_line():
    hf, _ = _pair()
    ring = kv_cache(hf, "window:8")
    _hf_logits(hf, ring, _tokens())
    with pytest.raises(RollbackError, match=r"cannot crop from 26 to 20 positions") as error:
        ring.crop(-6)
    assert "\n" not in str(error.value)
    heavy = kv_cache(hf, "h2o:3+5")
    _hf_logits(hf, heavy, _tokens())
    assert not heavy.layers[0].is_croppable
    with pytest.raises(RollbackError, match=r"h2o:3\+5 cannot crop from 26 to 25 positions"):
        heavy.crop(-1)
    compressed = kv_cache(hf, "knorm:8", max_len=PROMPT + STEPS)
    _hf_logits(hf, compressed, _tokens())
    compressed.crop(-STEPS)  # back to the compressed prompt: the appended tokens go
    assert compressed.get_seq_length() == PROMPT
    with pytest.raises(RollbackError, match=re.escape("expected 20..20 (or 0)")):
        compressed.crop(-1)


def test_the_api_pages_attention_example_runs_as_written(capsys):
    page = (Path(__file__).resolve().parent.parent / "docs" / "python-api.md").read_text(
        encoding="utf-8")
    example = page.split("```python\n")[2].split("```", 1)[0]
    exec(compile(example, "docs/python-api.md", "exec"), {})  # noqa: S102
    lines = capsys.readouterr().out.splitlines()
    # 48 tokens, 47 fed back; 16 slots x 2 layers x K and V x 2 KV heads x 16 x 4 bytes.
    assert lines[0] == "torch.Size([1, 48]) 47 8192"
    snap, codes = (int(x) for x in lines[1].split())
    # SnapKV: 10 prompt keys kept + room for 8, each K, V and an int64 position per KV head.
    assert snap == 18 * 2 * 2 * (2 * 16 * 4 + 8) < codes < 47 * 2 * 2 * 2 * 16 * 4
