"""Tiny transformers model folders for the loader's tests (`kvcache_cli.hf.load`): a random
causal LM of a few architectures saved as transformers saves it (config.json,
model.safetensors), with a byte-level BPE tokenizer.json of its vocabulary, all offline."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 300
# The same small shape in each architecture's own field names: transformers' config classes
# name widths, heads and layers differently (GPT-2: n_embd, n_head, n_layer). Heads of 32,
# the cache kinds' default group, so that kv_cache(model, "int8") takes them.
ARCHITECTURES = {
    "llama": dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64),
    "qwen2": dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64),
    "gpt2": dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=2, n_positions=64),
}


def tiny_model(arch: str = "llama", seed: int = 0):
    """A random float32 causal LM of ARCH, weights drawn wide enough that logits differ."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(arch, **ARCHITECTURES[arch])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    return model


def write_tokenizer(folder: Path) -> None:
    """tokenizer.json: kvcache's synthetic byte-level BPE vocabulary of VOCAB tokens."""
    from kvcache_cli.models.gguf.export import synthetic_vocab
    from kvcache_cli.models.tokenizer import from_gguf

    tokens, types, merges = synthetic_vocab(VOCAB)
    from_gguf(tokens, types, merges, "smollm").save(str(folder / "tokenizer.json"))


def save_folder(folder: Path, arch: str = "llama", seed: int = 0, **save) -> Path:
    """A model folder as a user would have one; SAVE goes to save_pretrained (shards)."""
    folder.mkdir(parents=True, exist_ok=True)
    tiny_model(arch, seed).save_pretrained(folder, **save)
    write_tokenizer(folder)
    return folder
