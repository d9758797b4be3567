"""What a transformers model's files are, checked before transformers reads them, without torch:
where the model is (a folder, a GGUF file, a Hub id in the local Hub cache), its config, and
which weight files hold it.

A model folder is data from someone else. Nothing here runs its code or unpickles its weights:
a config asking for custom code (`auto_map`) is refused, and weights present only as a pickle
(`pytorch_model.bin`, `*.pt`, `*.ckpt`) are refused by their names, never opened. Each refusal
is one HFLoadError line naming the path or the key and what was expected. `hf/load.py` adds
what needs transformers (is the architecture one it has, do the weights fit the config).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvcache_cli.hub import is_hub_id
from kvcache_cli.models.bounds import shown

CONFIG = "config.json"
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Formats torch reads by unpickling, which can run any code the file names.
PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# A config.json is a few kB; the largest published ones (with a vocabulary inlined) a few MB.
MAX_CONFIG_BYTES = 16 << 20
KINDS = "a model folder (config.json and safetensors weights), a .gguf file, or an ORG/NAME " \
        "Hub id in the local Hub cache"


class HFLoadError(ValueError):
    """A model transformers cannot load as asked, or must not: one line naming the value and
    what was expected."""


class HFOffline(HFLoadError):
    """A Hub id that is not in the local Hub cache; models are loaded offline."""


@dataclass(frozen=True)
class Located:
    """Where a model's files are: `folder` holds config.json (or the GGUF file, `gguf`)."""

    source: str  # as the user gave it
    folder: Path
    gguf: str | None = None  # the GGUF file's name inside `folder`


def locate(source: str) -> Located:
    """The folder (and GGUF file) SOURCE names: a path, or a Hub id's snapshot in the cache."""
    path = Path(source).expanduser()
    if path.is_dir():
        return Located(source, path)
    if path.is_file():
        try:
            with path.open("rb") as f:
                magic = f.read(4)
        except OSError as error:
            raise HFLoadError(f"{source}: cannot be read ({error.strerror}); expected "
                              f"{KINDS}") from None
        if magic != b"GGUF":
            raise HFLoadError(f"{source}: a file that is not GGUF (it starts {magic!r}); "
                              f"expected {KINDS}")
        return Located(source, path.parent, path.name)
    if path.exists():
        raise HFLoadError(f"{source}: neither a folder nor a regular file; expected {KINDS}")
    if is_hub_id(source):
        return Located(source, _cached_snapshot(source))
    raise HFLoadError(f"{source}: no such file or folder; expected {KINDS}")


def _cached_snapshot(repo_id: str) -> Path:
    """The folder of REPO_ID's main snapshot in the local Hub cache; never the network."""
    try:
        from huggingface_hub import errors as hub_errors
        from huggingface_hub import snapshot_download
    except ImportError:
        raise HFLoadError(f"{repo_id}: reading a Hub id needs huggingface_hub, which is not "
                          "installed: pip install 'kvcache[hub]', or pass a model folder") from None
    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (hub_errors.LocalEntryNotFoundError, FileNotFoundError):
        # hub.config_json's offline refusal, worded for a whole model.
        raise HFOffline(
            f"{repo_id!r} is not in the local Hub cache and models are loaded offline: "
            f"download it once online (hf download {repo_id}), or pass the path of a model "
            "folder") from None
    except hub_errors.HFValidationError as error:
        raise HFLoadError(f"{repo_id!r}: not a valid Hub id ({error})") from None


def folder_config(folder: Path) -> dict:
    """FOLDER's config.json as a dict, refused when transformers would run code for it or
    could not tell which model it is."""
    path = folder / CONFIG
    if not path.is_file():
        raise HFLoadError(f"{folder}: no {CONFIG}; expected a transformers model folder "
                          "(config.json and model.safetensors)")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise HFLoadError(f"{path}: {path.stat().st_size:,} bytes; expected a config.json of "
                          f"at most {MAX_CONFIG_BYTES:,}")
    try:
        config = json.loads(path.read_bytes())
    except OSError as error:
        raise HFLoadError(f"{path}: cannot be read ({error.strerror}); expected a JSON "
                          "object") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        first = str(error).splitlines()[0][:200]
        raise HFLoadError(f"{path}: not JSON ({first}); expected a JSON object") from None
    if not isinstance(config, dict):
        raise HFLoadError(f"{path}: a JSON {type(config).__name__}; expected a JSON object")
    return _checked_config(config, str(path))


def _checked_config(config: dict, where: str) -> dict:
    """CONFIG, refused for custom code or a model type it does not name."""
    if "auto_map" in config:
        named = ", ".join(sorted(map(str, config["auto_map"])))[:200] \
            if isinstance(config["auto_map"], dict) else type(config["auto_map"]).__name__
        raise HFLoadError(f"{where}: 'auto_map' asks for the folder's own code ({named}); "
                          "kvcache never runs a model's code: expected a model transformers "
                          "has built in")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise HFLoadError(f"{where}: 'model_type' is {shown(model_type)}; expected the name "
                          "of a transformers model type, such as 'llama'")
    for where_in, value in _numbers(config):
        if not math.isfinite(value) or (where_in.endswith("rope_theta") and value <= 0):
            raise HFLoadError(f"{where}: {where_in!r} is {value!r}; expected a finite "
                              f"{'positive ' if where_in.endswith('rope_theta') else ''}"
                              "number (JSON has no NaN or infinity)")
    names = config.get("architectures")
    if names is not None and (not isinstance(names, list) or not names
                              or not all(isinstance(n, str) and n for n in names)):
        raise HFLoadError(f"{where}: 'architectures' is {shown(names)}; expected a list of "
                          "class names, such as ['LlamaForCausalLM']")
    return config


def _numbers(doc, above: str = "") -> Iterator[tuple[str, int | float]]:
    """Every number in DOC (nested objects and lists), with its dotted path. transformers
    passes a NaN rotary base or epsilon to the model, whose SDPA then hides it."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc)
    for key, value in items:
        path = f"{above}.{key}" if above else str(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            yield path, value
        elif isinstance(value, dict | list):
            yield from _numbers(value, path)


def safetensors_files(folder: Path) -> list[Path]:
    """The safetensors files holding FOLDER's weights (one, or the index's shards), each
    header checked; refused when the weights are only a pickle, or absent."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        files = [folder / name for name in _shards(index)]
    elif (folder / SAFETENSORS).is_file():
        files = [folder / SAFETENSORS]
    else:
        try:
            pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLES)
        except OSError as error:
            raise HFLoadError(f"{folder}: cannot be listed ({error.strerror}); expected a "
                              "readable model folder") from None
        if pickles:
            raise HFLoadError(f"{folder / pickles[0]}: weights only as a pickle, which kvcache "
                              "never opens (unpickling can run code); expected "
                              f"{SAFETENSORS} (convert it where you trust the file)")
        raise HFLoadError(f"{folder}: no weights; expected {SAFETENSORS} or "
                          f"{SAFETENSORS_INDEX} with its shards")
    for path in files:
        _check_header(path)
    return files


def _shards(index: Path) -> list[str]:
    """The shard file names an index lists, each a plain name inside its folder."""
    try:
        weight_map = json.loads(index.read_bytes()).get("weight_map")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError, AttributeError):
        weight_map = None
    if not isinstance(weight_map, dict) or not weight_map \
            or not all(isinstance(v, str) for v in weight_map.values()):
        raise HFLoadError(f"{index}: expected a JSON object whose 'weight_map' maps tensor "
                          "names to shard files")
    names = sorted(set(weight_map.values()))
    for name in names:
        if Path(name).name != name or not name.endswith(".safetensors"):
            raise HFLoadError(f"{index}: shard {shown(name)}; expected a .safetensors file "
                              "name in the index's folder")
        if not (index.parent / name).is_file():
            raise HFLoadError(f"{index.parent / name}: missing; the index lists it as a shard")
    return names


def _check_header(path: Path) -> None:
    """Refuse a safetensors file whose header does not parse or does not cover the file
    (truncated, an unknown dtype, overlapping tensors): safetensors' own checks, no torch."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            f.keys()
    except SafetensorError as error:
        first = str(error).splitlines()[0][:200]
        raise HFLoadError(f"{path}: not a readable safetensors file ({first})") from None


def gguf_config(path: Path) -> dict:
    """The config transformers builds from a GGUF file's metadata: its model type and the
    fields transformers maps, read through kvcache's checked GGUF layout (no torch)."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    from kvcache_cli.models.gguf.layout import open_file, read_layout

    try:
        data, size = open_file(path)
        meta = read_layout(path, data, size).metadata
    except ValueError as error:
        raise HFLoadError(str(error).splitlines()[0]) from None
    arch = meta.get("general.architecture")
    name = _GGUF_NAMES.get(arch, arch) if isinstance(arch, str) else None
    if name not in GGUF_CONFIG_MAPPING or name in ("general", "tokenizer"):
        known = ", ".join(a for a in GGUF_CONFIG_MAPPING if a not in ("general", "tokenizer"))
        raise HFLoadError(f"{path}: general.architecture is {shown(arch)}; transformers "
                          f"reads GGUF files of {known}")
    config = {"model_type": _TEXT_ONLY.get(name, name)}
    for key, field in GGUF_CONFIG_MAPPING[name].items():
        if isinstance(field, str) and f"{arch}.{key}" in meta:
            config[field] = meta[f"{arch}.{key}"]
    return _checked_config(config, str(path))


# What transformers' GGUF loader renames (modeling_gguf_pytorch_utils.load_gguf_checkpoint):
# llama.cpp's architecture names spelled as transformers' model types, and the multimodal
# families whose GGUF holds only the text model.
_GGUF_NAMES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss",
               "minimax-m2": "minimax_m2"}
_TEXT_ONLY = {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}
