"""Where a GGUF's converted folder lives, and whether the one there can be trusted, torch-free:
`kvcache size -m smollm2` reads the shape from the converted config.json without paying
for torch (`llama_loading` writes the folder).

A folder is used only when its stamp (stamp.json, written last, into a temporary folder
renamed when complete) says it was made by this format from this very file (its real
path, size, modification time and SHA-256) and its files are the ones written (each one's
size, modification time and SHA-256, of the first MiB for the weights), and its config.json
passes the same checks as the GGUF's metadata (`models.bounds`). A folder that is
half-written, corrupt or stale is converted again, never read; a cache root that is a
file is refused in one line.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import stat
from pathlib import Path

CONVERTED_FORMAT = 3  # bumped when what a converted folder holds changes
STAMP = "stamp.json"
FILES = ("config.json", "tokenizer.json", "model.safetensors")
_WEIGHTS_HEAD = 2**20  # the weights' header and first rows: hashing all would cost a second
_MAX_STAMP = 2**16


def cache_root() -> Path:
    """Where converted models live: $KVCACHE_CACHE, else $XDG_CACHE_HOME/kvcache, else
    ~/.cache/kvcache."""
    if os.environ.get("KVCACHE_CACHE"):
        return Path(os.environ["KVCACHE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvcache"


def converted_root() -> Path:
    """The folder converted models live in; a ValueError when it, or the cache root, is
    something other than a folder."""
    root = cache_root()
    for folder in (root, root / "converted"):
        if (folder.is_symlink() or folder.exists()) and not folder.is_dir():
            raise ValueError(f"the conversion cache {folder} is not a folder; expected a "
                             "folder (or KVCACHE_CACHE naming one)")
    return root / "converted"


def converted_dir(gguf: Path) -> Path:
    info = gguf.stat()
    key = f"{os.path.realpath(gguf)}:{info.st_size}:{info.st_mtime_ns}:{CONVERTED_FORMAT}"
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    return converted_root() / f"{gguf.stem}-{digest}"


def _digest(path: Path, limit: int | None = None) -> str:
    """SHA-256 of the file's bytes (its first `limit` bytes)."""
    h = hashlib.sha256()
    left = float("inf") if limit is None else limit
    with path.open("rb") as f:
        while left > 0 and (chunk := f.read(int(min(2**20, left)))):
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


@functools.lru_cache(maxsize=8)
def _gguf_digest(real: str, dev: int, ino: int, size: int, mtime_ns: int,
                 ctime_ns: int) -> str:
    # Keyed by what any change to the file changes (ctime moves on every write and utime),
    # so one process hashes a file once, not at every look-up of its shape.
    return _digest(Path(real))


def gguf_identity(gguf: Path) -> dict:
    """What a stamp records of the GGUF a folder was converted from; a ValueError for a
    path that is not a file kvcache could read (`layout.check_file`)."""
    from kvcache_cli.models.gguf.layout import check_file

    check_file(gguf)
    real = os.path.realpath(gguf)
    info = os.stat(real)
    digest = _gguf_digest(real, info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns,
                          info.st_ctime_ns)
    return {"format": CONVERTED_FORMAT, "gguf": real, "bytes": info.st_size,
            "mtime_ns": info.st_mtime_ns, "sha256": digest}


def _file_entry(path: Path) -> dict:
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path} is not a regular file")
    limit = _WEIGHTS_HEAD if path.name == "model.safetensors" else None
    return {"bytes": info.st_size, "mtime_ns": info.st_mtime_ns,
            "sha256": _digest(path, limit)}


def write_stamp(staging: Path, gguf: Path) -> None:
    """The stamp of a folder whose files are all written: the last file written to it."""
    stamp = {**gguf_identity(gguf),
             "files": {name: _file_entry(staging / name) for name in FILES}}
    (staging / STAMP).write_text(json.dumps(stamp, indent=1))


def converted_config(gguf: Path, check=None) -> dict | None:
    """The converted folder's config.json, checked (by `check(raw, where)`, a Llama's
    `check_config` unless given), when the folder is whole and was made from this very
    file; None when there is none, or none to trust (convert again). A ValueError for a
    GGUF path that is no file to read, or a cache root that is a file."""
    identity = gguf_identity(gguf)
    folder = converted_dir(gguf)
    try:
        stamp = _small_json(folder / STAMP)
        if {k: stamp.get(k) for k in identity} != identity:
            return None
        files = stamp["files"]
        if any(files[name] != _file_entry(folder / name) for name in FILES):
            return None
        raw = _small_json(folder / "config.json", 16 * 2**20)
        (check or check_config)(raw, folder / "config.json")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # half-written, corrupt, or another file's: converted again
    return raw


def _small_json(path: Path, limit: int = _MAX_STAMP) -> dict:
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
        raise ValueError(f"{path} is not a small regular file")
    value = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(value, dict):
        raise ValueError(f"{path} is not a JSON object")
    return value


def check_config(raw: dict, where) -> None:
    """A converted config.json's fields present, of their types, in range and consistent
    (`models.bounds`, as the GGUF's metadata was), or a ValueError naming the field."""
    from kvcache_cli.models.bounds import BOUNDS, check_shape, number, shown

    def fail(what: str):
        raise ValueError(f"{where}: {what}; expected the config of a converted GGUF")

    for field, bound in BOUNDS.items():
        if field not in raw:
            if field != "head_dim":
                fail(f"no {field}")
        elif not (field == "head_dim" and raw[field] is None):
            try:
                raw[field] = number(bound, raw[field], field)
            except ValueError as err:
                fail(str(err))
    eos, bos = raw.get("eos_ids"), raw.get("bos_id")
    if not isinstance(eos, list):
        fail(f"eos_ids is {shown(eos)}")
    for i in eos + ([] if bos is None else [bos]):
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < raw["vocab_size"]:
            fail(f"a special token id is {shown(i)}, not one of the "
                 f"{raw['vocab_size']:,} tokens")
    for field, kind in (("tie_word_embeddings", bool), ("name", str), ("gguf", str),
                        ("source_types", dict)):
        if not isinstance(raw.get(field), kind):
            fail(f"{field} is {shown(raw.get(field))}")
    if not isinstance(raw.get("chat_template"), (str, type(None))):
        fail(f"chat_template is {shown(raw.get('chat_template'))}")
    try:
        check_shape(raw, str)
    except ValueError as err:
        fail(str(err))
