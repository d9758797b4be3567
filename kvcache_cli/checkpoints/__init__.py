"""Checkpoints shipped with the package, by name, and their held-out text.

`stdlib-bytes` is a small byte-level GPT-2 trained on the Python standard library's
sources (`kvcache_cli.models.training`, `scripts/train_checkpoint.py`): a model whose predictions
mean something on machines that cannot download GPT-2. Its `heldout.txt` is the text of
the standard-library files it never trained on (listed in its `recipe.json`), the default
text to evaluate it on. Torch-free, so `size` can resolve the names too.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAINED = "stdlib-bytes"  # the one shipped today
SHIPPED = (TRAINED,)


def shipped_dir(name: str) -> Path | None:
    """The directory of a shipped checkpoint, or None when `name` is not one."""
    return HERE / name if name in SHIPPED else None


def heldout_bytes(name: str = TRAINED) -> bytes:
    """The held-out text of a shipped checkpoint as bytes: its token ids, for `bytes`."""
    directory = shipped_dir(name)
    if directory is None:
        raise ValueError(f"unknown shipped checkpoint {name!r}: expected {', '.join(SHIPPED)}")
    return (directory / "heldout.txt").read_bytes()


def heldout_text(name: str = TRAINED) -> str:
    """The held-out text of a shipped checkpoint (standard-library Python, UTF-8)."""
    return heldout_bytes(name).decode("utf-8")
