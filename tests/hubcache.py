"""A Hugging Face Hub cache laid out on disk, as huggingface_hub writes it, for tests and the
README's examples: models--ORG--NAME/snapshots/<commit>/config.json and refs/<branch>."""

from __future__ import annotations

import json
from pathlib import Path

# Qwen/Qwen2.5-7B-Instruct's published config.json, and the commit its main branch named.
QWEN_INSTRUCT_ID = "Qwen/Qwen2.5-7B-Instruct"
QWEN_INSTRUCT = json.loads(
    (Path(__file__).parent / "data" / "Qwen2.5-7B-Instruct-config.json").read_text())
QWEN_INSTRUCT_COMMIT = "a09a35458c702b33eeacc393d103063234e8bc28"


def add_snapshot(cache: Path, repo_id: str, commit: str, config: dict, ref: str | None) -> None:
    """One snapshot holding config.json (a plain file, not a symlink into blobs/), and the
    branch or tag REF pointing at it."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
