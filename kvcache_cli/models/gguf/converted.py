"""Where a GGUF's converted folder lives, torch-free: `kvcache size -m smollm2` reads the
shape from the converted config.json without paying for torch (`loading` writes it)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

CONVERTED_FORMAT = 2  # bumped when what a converted folder holds changes


def cache_root() -> Path:
    """Where converted models live: $KVCACHE_CACHE, else $XDG_CACHE_HOME/kvcache, else
    ~/.cache/kvcache."""
    if os.environ.get("KVCACHE_CACHE"):
        return Path(os.environ["KVCACHE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvcache"


def converted_dir(gguf: Path) -> Path:
    info = gguf.stat()
    key = f"{gguf.resolve()}:{info.st_size}:{info.st_mtime_ns}:{CONVERTED_FORMAT}"
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    return cache_root() / "converted" / f"{gguf.stem}-{digest}"
