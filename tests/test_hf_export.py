"""SmolLM2's converted GGUF written as a transformers folder (`models.gguf.hf_export`), what
vLLM serves in `scripts/vllm_cpu.sh`: transformers' own LlamaForCausalLM, built from the
files written, computes what kvcache's SmolLM2 computes.

The parity test minGPT's HF import test sets: the same weights, logits within a stated
tolerance, then greedy tokens exactly. The converted folder is linked into a temporary one,
so nothing is written to the user's cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from llamakit import smollm2_or_skip

from kvcache_cli.models.gguf.hf_export import hf_dir, hf_files, write_hf_folder

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """SmolLM2's converted folder, linked file by file into a temporary one."""
    smollm2_or_skip()
    from kvcache_cli.models.llama_loading import _gguf_folder

    real, _ = _gguf_folder("smollm2")
    folder = tmp_path_factory.mktemp("converted") / real.name
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (folder / name).symlink_to(real / name)
    return folder


def test_the_folder_says_llama_in_float32_with_its_template_and_tokens(converted):
    out = write_hf_folder(converted)
    assert out.written and out.path == hf_dir(converted)
    config = json.loads((out.path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"]) == (30, 9, 3, 64)
    assert config["torch_dtype"] == "float32" and config["tie_word_embeddings"] is True
    tokens = json.loads((out.path / "tokenizer_config.json").read_text())
    assert (tokens["bos_token"], tokens["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert tokens["chat_template"].startswith("{% for message in messages %}")
    assert json.loads((out.path / "generation_config.json").read_text())["eos_token_id"] == 2
    assert (out.path / "model.safetensors").resolve() == \
        (converted / "model.safetensors").resolve()  # linked, not copied
    assert not write_hf_folder(converted).written  # found whole the second time


def test_kvcache_reads_the_folder_back_as_the_same_model(converted):
    from kvcache_cli.models.llama_loading import _hf_config, llama_config

    ours = llama_config("smollm2")
    back = _hf_config(write_hf_folder(converted).path)
    for field in ("n_layer", "n_head", "n_kv_head", "n_embd", "intermediate", "vocab_size",
                  "context", "rope_theta", "rms_eps", "tie_word_embeddings", "eos_ids",
                  "chat_template"):
        assert getattr(back, field) == getattr(ours, field), field


def test_transformers_computes_what_kvcache_computes_from_the_files(converted):
    from transformers import LlamaForCausalLM

    from kvcache_cli.models import load_model

    folder = write_hf_folder(converted).path
    theirs = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load_model("smollm2", "pretrained", "cpu", torch.float32).model
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 2, 198, 1, 4093, 198, 504, 3575]
    idx = torch.tensor([prompt])  # (1, T)
    with torch.inference_mode():
        want = theirs(idx).logits[0, -1]  # (vocab,)
        got = ours(idx, 0, None, last_only=True)[0, -1]
    # Two float32 implementations of one function: sums in another order, ~1e-5 apart.
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    generated = theirs.generate(idx, max_new_tokens=8, do_sample=False)[0, len(prompt):]
    from kvcache_cli.generate import stream_tokens

    assert list(stream_tokens(ours, prompt, 8, "static")) == generated.tolist()
    assert len(set(generated.tolist())) > 1  # tokens that vary: agreeing proves something


def test_special_tokens_come_from_the_gguf_ids():
    config = {"n_embd": 64, "n_head": 4, "n_kv_head": 2, "n_layer": 2, "intermediate": 128,
              "context": 256, "rms_eps": 1e-5, "rope_theta": 1e4, "vocab_size": 10,
              "bos_id": 1, "eos_ids": [2, 3]}
    tokenizer = {"added_tokens": [{"id": 1, "content": "<s>"}, {"id": 2, "content": "</s>"}],
                 "model": {"vocab": {"a": 5}}}
    files = hf_files(config, tokenizer, {"unk": 5})
    assert files["config.json"]["eos_token_id"] == [2, 3]  # several: a list, as HF writes
    assert files["tokenizer_config.json"]["unk_token"] == "a"
    assert "pad_token" not in files["tokenizer_config.json"]
    assert "chat_template" not in files["tokenizer_config.json"]


def _gemma3_converted() -> dict:
    """A converted Gemma 3 config.json as kvcache writes it (gemma3_loading._convert)."""
    return {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
            "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 1,
            "hidden_size": 64, "intermediate_size": 128, "vocab_size": 10,
            "max_position_embeddings": 256, "head_dim": 16, "rms_norm_eps": 1e-6,
            "sliding_window": 8, "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
            "query_pre_attn_scalar": 16.0, "hidden_activation": "gelu_pytorch_tanh",
            "tie_word_embeddings": True, "name": "Gemma 3 tiny", "bos_token_id": 2,
            "eos_token_id": 1, "gguf": "/x/tiny.gguf", "source_types": {"a": "Q4_K"}}


def test_a_gemma3_folder_is_transformers_own_config_in_float32():
    from transformers import Gemma3TextConfig

    tokenizer = {"added_tokens": [{"id": i, "content": t} for i, t in
                                  enumerate(("<pad>", "<eos>", "<bos>", "<unk>"))]}
    files = hf_files(_gemma3_converted(), tokenizer, {"pad": 0, "unk": 3})
    config = files["config.json"]
    assert not {"gguf", "source_types", "name"} & set(config)  # kvcache's keys dropped
    # transformers' strict config refuses 16.0 where it wants an int.
    assert config["query_pre_attn_scalar"] == 16 and type(config["query_pre_attn_scalar"]) is int
    assert config["torch_dtype"] == "float32" and config["pad_token_id"] == 0
    theirs = Gemma3TextConfig(**config)
    assert theirs.layer_types[5] == "full_attention" and theirs.sliding_window == 8
    assert files["generation_config.json"] == {"bos_token_id": 2, "eos_token_id": 1,
                                               "pad_token_id": 0}
    tokens = files["tokenizer_config.json"]
    assert (tokens["bos_token"], tokens["eos_token"], tokens["pad_token"]) == (
        "<bos>", "<eos>", "<pad>")
    assert "chat_template" not in tokens  # the base model has none


def test_transformers_computes_what_kvcache_computes_from_gemma3s_folder(tmp_path):
    """The real Gemma 3 270M's folder, what vLLM serves: transformers' Gemma3ForCausalLM
    built from it gives kvcache's logits and greedy tokens."""
    from gemmakit import gemma3_or_skip
    from transformers import Gemma3ForCausalLM

    from kvcache_cli.models import load_model
    from kvcache_cli.models.gemma3_loading import _folder

    gemma3_or_skip()
    real = _folder("gemma3")[0]
    converted = tmp_path / real.name
    converted.mkdir()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (converted / name).symlink_to(real / name)
    folder = write_hf_folder(converted).path
    theirs = Gemma3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load_model("gemma3", "pretrained", "cpu", torch.float32).model
    prompt = [2, 818, 5279, 529, 7001, 563]  # <bos>The capital of France is
    idx = torch.tensor([prompt])  # (1, T)
    with torch.inference_mode():
        want = theirs(idx).logits[0, -1]  # (vocab,)
        got = ours(idx, 0, None, last_only=True)[0, -1]
    torch.testing.assert_close(got, want, atol=5e-4, rtol=1e-4)
    generated = theirs.generate(idx, max_new_tokens=8, do_sample=False)[0, len(prompt):]
    from kvcache_cli.generate import stream_tokens

    assert list(stream_tokens(ours, prompt, 8, "static")) == generated.tolist()
