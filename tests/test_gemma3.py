"""Gemma 3 (text) beside Llama and GPT-2: exact against transformers' Gemma3ForCausalLM with
the same weights, through the naive loop and every exact cache, its sliding layers held in
rings of their window (`caches.hybrid`)."""

from __future__ import annotations

import pytest
import torch
from decoding import tokens

from kvcache_cli.caches import make_cache
from kvcache_cli.caches.base import LayerType
from kvcache_cli.generate import generate
from kvcache_cli.models.gemma3 import Gemma3, Gemma3Config, to_hf
from kvcache_cli.models.llama import RopeShift

W = 8  # the sliding window: a prompt of 40 is five windows
PATTERN = ("sliding_attention",) * 2 + ("full_attention",)
LOGIT_TOLERANCE = 1e-4  # float32, logits of magnitude ~10: what summation order leaves
VOCAB, NKV, HS = 211, 1, 32


def tiny_hf(seed: int = 0, **overrides):
    """A random transformers Gemma3ForCausalLM, float32, 6 layers (sliding, sliding, full)
    x 2, one KV head. Norm gains random too (the (1 + weight) is exercised), the embedding
    small and the post-norms' gains near 2 so the tied head does not just echo the input
    token: greedy tokens vary."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(**{
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": NKV,
        "head_dim": HS, "max_position_embeddings": 512, "sliding_window": W,
        "layer_types": list(PATTERN * 2), "query_pre_attn_scalar": 24,
        "initializer_range": 0.3, "pad_token_id": None, "bos_token_id": 2,
        "eos_token_id": 1, **overrides})
    torch.manual_seed(seed)
    hf = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0 if ".post_" in name else 0.0, 0.3)
        hf.model.embed_tokens.weight.normal_(0, 0.05)
    return hf


def ours(hf) -> Gemma3:
    """kvcache's Gemma3 from the config dict and state dict of a transformers one."""
    model = Gemma3(Gemma3Config.from_hf(hf.config.to_dict()))
    model.load_state_dict(hf.state_dict())
    return model.eval()


def greedy(model, cache, prompt: torch.Tensor, n: int) -> list[int]:
    """n greedy tokens after the prompt (1, T): prefilled in one forward, then one a step
    (the last one made is not fed back: the cache holds T + n - 1 positions)."""
    with torch.no_grad():
        made = [int(model(prompt, 0, cache, last_only=True)[0, -1].argmax())]
        for pos in range(prompt.size(1), prompt.size(1) + n - 1):
            made.append(int(model(torch.tensor([[made[-1]]]), pos, cache)[0, -1].argmax()))
    return made


@pytest.fixture(scope="module")
def pair():
    hf = tiny_hf()
    return hf, ours(hf)


@pytest.fixture(scope="module")
def hf_tokens(pair):
    """transformers' own greedy generation: 64 tokens after a prompt of five windows."""
    hf, _ = pair
    prompt = tokens(5 * W, VOCAB)
    with torch.no_grad():
        # No end token: 64 tokens whatever they are (min_new_tokens would mask one).
        out = hf.generate(prompt, max_new_tokens=64, do_sample=False, eos_token_id=None)
    assert out.size(1) == prompt.size(1) + 64
    return prompt, out[0, prompt.size(1):].tolist()


def test_the_config_reads_transformers_layer_types_and_bases_and_goes_back(pair):
    _, model = pair
    c = model.config
    assert (c.n_layer, c.n_head, c.n_kv_head, c.head_size, c.query_pre_attn_scalar) == (
        6, 4, 1, 32, 24)
    sliding, full = LayerType(W, 10_000.0), LayerType(None, 1_000_000.0)
    assert c.layer_types == (sliding, sliding, full) * 2
    shape = c.cache_shape
    assert shape.hybrid and shape.layer_types == c.layer_types
    assert shape.rope == RopeShift(HS, 1_000_000.0)  # the global layers' rotation
    assert c.tie_word_embeddings and model.lm_head.weight is model.embedding.weight
    back = to_hf(model)  # transformers' model again, from ours: the peer bench compares with
    assert model.num_params() == c.param_count() == sum(p.numel() for p in back.parameters())
    idx = tokens(3 * W, VOCAB)
    with torch.no_grad():
        assert torch.equal(back(idx).logits, pair[0](idx).logits)


def test_the_self_draft_keeps_the_first_layers_types_and_shares_the_weights(pair):
    _, model = pair
    draft = model.first_layers(3)
    assert draft.config.layer_types == model.config.layer_types[:3]
    assert draft.lm_head.weight is model.lm_head.weight
    idx = tokens(3 * W, VOCAB)
    cache = make_cache("static", draft, idx.size(1))
    assert [type(c).__name__ for c in cache.caches] == ["RingCache", "StaticCache"]
    with torch.no_grad():
        assert torch.allclose(draft(idx, 0, cache), draft(idx, 0), atol=LOGIT_TOLERANCE)


@pytest.mark.parametrize("overrides", [
    {},
    # The larger models' scaled global layers, and a soft cap on the logits.
    {"rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}},
     "final_logit_softcapping": 30.0},
], ids=["gemma3", "linear-rope-softcap"])
def test_logits_equal_transformers_over_a_prompt_longer_than_the_window(overrides):
    hf = tiny_hf(1, **overrides)
    model = ours(hf)
    idx = torch.cat([tokens(6 * W, VOCAB, seed=1), tokens(6 * W, VOCAB, seed=2)])  # (2, 48)
    with torch.no_grad():
        expected = hf(idx).logits
        naive = model(idx, 0)
        cached = model(idx, 0, make_cache("static", model, idx.size(1), batch=2))
    assert expected.abs().max() > 1.0  # logits of some size: the tolerance means something
    assert (naive - expected).abs().max() < LOGIT_TOLERANCE
    assert (cached - expected).abs().max() < LOGIT_TOLERANCE


@pytest.mark.parametrize("spec", ["static", "concat", "paged", "naive"])
def test_64_greedy_tokens_equal_transformers_through_each_cache_and_the_loop(pair, hf_tokens,
                                                                             spec):
    _, model = pair
    prompt, expected = hf_tokens
    assert len(set(expected)) >= 8  # tokens that vary: a repeated one would prove little
    with torch.no_grad():
        made = generate(model, prompt[0].tolist(), 64, spec)
    assert list(made.tokens) == expected


def test_sliding_full_gives_the_same_tokens_holding_more_bytes(pair, hf_tokens):
    _, model = pair
    prompt, expected = hf_tokens
    n = prompt.size(1) + 64
    rings = make_cache("concat", model, n)
    full = make_cache("concat", model, n, sliding="full")
    assert greedy(model, rings, prompt, 64) == expected
    assert greedy(model, full, prompt, 64) == expected
    assert full.bytes_held > rings.bytes_held


def test_sliding_layers_hold_their_window_and_global_ones_the_whole_context(pair, hf_tokens):
    _, model = pair
    prompt, _ = hf_tokens
    n = prompt.size(1) + 16
    per_token = 2 * NKV * HS * 4  # K and V x one KV head x 32 dims x float32, one layer
    rings = make_cache("concat", model, n)
    full = make_cache("concat", model, n, sliding="full")
    for cache in (rings, full):
        greedy(model, cache, prompt, 17)  # 16 fed back: n positions held
        assert cache.length == n
    assert rings.bytes_by_kind() == {"sliding": 4 * W * per_token, "full": 2 * n * per_token}
    assert full.bytes_by_kind() == {"sliding": 4 * n * per_token, "full": 2 * n * per_token}


@pytest.mark.parametrize("override, message", [
    ({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                          "full_attention": {"rope_type": "yarn", "rope_theta": 1e6,
                                             "factor": 8.0}}},
     "rope_type 'yarn' on the full layers; Gemma 3 runs default and linear"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping is set"),
    ({"hidden_activation": "silu"}, "hidden_activation 'silu'; Gemma 3 runs tanh GELU"),
])
def test_what_it_does_not_run_is_refused_in_one_line(override, message):
    from transformers import Gemma3TextConfig

    raw = {**Gemma3TextConfig(num_hidden_layers=6, layer_types=list(PATTERN * 2)).to_dict(),
           **override}
    with pytest.raises(ValueError, match=message) as refused:
        Gemma3Config.from_hf(raw)
    assert "\n" not in str(refused.value)


def test_gemma3_as_first_published_reads_the_local_base_and_the_global_scaling():
    raw = {"model_type": "gemma3_text", "num_hidden_layers": 6, "num_attention_heads": 4,
           "num_key_value_heads": 1, "head_dim": 256, "hidden_size": 640,
           "intermediate_size": 2048, "vocab_size": 262_144, "max_position_embeddings": 32_768,
           "sliding_window": 512, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
           "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    c = Gemma3Config.from_hf(raw)
    assert c.layer_types == (LayerType(512, 10_000.0),) * 5 + (LayerType(None, 1e6),)
    assert (c.rotation("full"), c.rotation("sliding")) == ((1e6, 8.0), (10_000.0, 1.0))
    assert c.cache_shape.rope == RopeShift(256, 1e6, 8.0)


@pytest.mark.parametrize("spec", ["static", "paged"])
def test_kvcache_generate_runs_a_gemma3_folder_as_transformers_does(tmp_path, pair, hf_tokens,
                                                                    spec):
    import json

    from typer.testing import CliRunner

    from kvcache_cli.cli import app
    from kvcache_cli.models import family_of
    from kvcache_cli.models.gguf.export import synthetic_vocab
    from kvcache_cli.models.tokenizer import from_gguf

    hf, _ = pair
    prompt, expected = hf_tokens
    hf.save_pretrained(tmp_path)  # config.json (model_type gemma3_text), model.safetensors
    # A vocabulary of 300 strings (the synthetic one needs GPT-2's first bytes and merge):
    # the ids are given, the strings only shown.
    from_gguf(*synthetic_vocab(300), "smollm").save(str(tmp_path / "tokenizer.json"))
    assert family_of(str(tmp_path)) == "gemma3"
    ids = ",".join(map(str, prompt[0].tolist()))
    run = CliRunner().invoke(app, ["generate", "-m", str(tmp_path), "--ids", ids, "-n", "64",
                                   "--cache", spec, "--ignore-eos", "--json"])
    assert run.exit_code == 0, run.output
    result = json.loads(run.stdout)
    assert result["model"] == f"checkpoint {tmp_path}"
    assert result["tokens"] == expected


def test_a_gemma3_folder_with_a_bad_config_is_refused_in_one_line(tmp_path, pair):
    import json

    from typer.testing import CliRunner

    from kvcache_cli.cli import app

    hf, _ = pair
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_key_value_heads"] = 3  # 4 query heads do not share 3 KV heads
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_text("{}")
    run = CliRunner().invoke(app, ["generate", "-m", str(tmp_path), "--ids", "1,2,3"])
    assert run.exit_code == 2
    assert run.stderr.count("\n") == 1 and "num_attention_heads 4 is not a multiple of" in (
        run.stderr)
