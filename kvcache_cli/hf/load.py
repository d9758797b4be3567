# placeholder: replaced by branch hf-load at merge
"""Loading any model transformers loads, offline (placeholder of hf-load's module)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class HFLoadError(ValueError):
    """One line: names the value and what was expected."""


class HFOffline(HFLoadError):
    """A Hub id not in the local Hub cache."""


@dataclass(frozen=True)
class HFModel:
    model: Any
    tokenizer: Any
    source: str
    architecture: str


def _hub_folder(source: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(source, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError):
        raise HFOffline(f"model {source!r}: not in the local Hub cache, and kvcache runs "
                        "offline; download it first (hf download " + source + ")") from None


def read_hf_config(source: str) -> dict:
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from gguf import GGUFReader

        field = GGUFReader(path).fields.get("general.architecture")
        arch = bytes(field.parts[field.data[0]]).decode() if field else "unknown"
        return {"model_type": arch, "architectures": [arch]}
    folder = path if path.is_dir() else _hub_folder(source)
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise HFLoadError(f"model {source!r}: no readable config.json ({err})") from None


def load_hf(source: str, *, device: str = "cpu", dtype=None) -> HFModel:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(source).expanduser()
    config = read_hf_config(source)
    gguf = {}
    where = source
    if path.is_file():
        where, gguf = str(path.parent), {"gguf_file": path.name}
    options = dict(local_files_only=True, trust_remote_code=False, **gguf)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype or torch.float32,
                                                 **options).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(where, **options)
    arch = (config.get("architectures") or [config.get("model_type", "?")])[0]
    return HFModel(model, tokenizer, source, arch)
