"""A byte-level GPT-2 (256 ids) saved as a Hugging Face checkpoint with its held-out text
beside it, as the trained `stdlib-bytes` checkpoint ships: a real checkpoint, offline."""

import json
from pathlib import Path


def write_byte_checkpoint(directory: Path, block_size: int, n_embd: int, text: str) -> Path:
    from safetensors.torch import save_file

    from kvcache_cli.models.gpt2 import _CONV1D, GPT, GPTConfig

    config = GPTConfig(block_size=block_size, vocab_size=256, n_layer=2, n_head=2,
                       n_embd=n_embd)
    model = GPT(config, init_std=0.3, seed=0)  # a wide init: the greedy tokens vary
    # Hugging Face's layout: Conv1D weights (in, out), the LM head tied to the embedding.
    state = {k: (t.t() if k.endswith(_CONV1D) else t).contiguous()
             for k, t in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": n_embd, "vocab_size": 256,
        "n_positions": block_size, "tokenizer": "bytes"}))
    (directory / "heldout.txt").write_text(text)
    return directory
