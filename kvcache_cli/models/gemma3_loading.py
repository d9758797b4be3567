"""Loading a Gemma 3 (text) model from a safetensors folder: config.json (model_type
gemma3_text, as transformers writes it), tokenizer.json, model.safetensors.

The same trust as a Llama folder's (`llama_loading`, whose checks this reuses): JSON read
size-capped, each shape number bounded, weights from safetensors only, each tensor's name
and shape checked against the config and its values finite; no code from the folder.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvcache_cli.models.base import LoadedModel
from kvcache_cli.models.gemma3 import Gemma3, Gemma3Config, rotaries
from kvcache_cli.models.linear import arrange_weights
from kvcache_cli.models.llama import init_random
from kvcache_cli.models.llama_loading import (
    RANDOM_INIT_STD,
    _assign_state,
    _chat_template,
    _weights_file,
)
from kvcache_cli.models.weights_file import read_weights


def gemma3_config(name_or_path: str) -> Gemma3Config:
    """A Gemma 3 folder's config.json (and tokenizer files) as a Gemma3Config."""
    from kvcache_cli.sizing.config import ConfigError, load_config

    folder = Path(name_or_path)
    try:
        raw = load_config(folder / "config.json")
    except ConfigError as err:
        raise ValueError(str(err)) from None
    tokenizer = folder / "tokenizer.json"
    if not tokenizer.is_file():
        raise ValueError(f"no tokenizer.json in {folder}; expected the model's tokenizer")
    return Gemma3Config.from_hf(raw, str(folder / "config.json"), tokenizer=f"file:{tokenizer}",
                                chat_template=_chat_template(folder), name=folder.name)


def load_gemma3(name_or_path: str, weights: str, device, dtype: torch.dtype,
                config: Gemma3Config | None = None) -> LoadedModel:
    """The model a Gemma 3 folder holds; `config`: its `gemma3_config`, when read already."""
    if weights not in ("auto", "pretrained", "random"):
        raise ValueError(f"unknown weights {weights!r}: expected auto, pretrained or random")
    folder = Path(name_or_path)
    config = config if config is not None else gemma3_config(name_or_path)
    with torch.device("meta"):
        model = Gemma3(config)  # shapes only: no memory, no init to overwrite
    source = f"checkpoint {folder}"
    if weights == "random":
        model = model.to_empty(device="cpu")
        init_random(model, RANDOM_INIT_STD, seed=0)  # norm weights 1: gains of 2
        source = f"random weights ({config.name} shape, std {RANDOM_INIT_STD})"
    else:
        _assign_state(model, read_weights(_weights_file(folder)), folder)
    model.rotary = rotaries(config)  # the angle tables are made, not loaded
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = arrange_weights(model.to(device=device, dtype=dtype))
    return LoadedModel(model.eval(), source)
