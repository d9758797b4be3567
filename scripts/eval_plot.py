"""`kvcache eval --plot` from a saved `kvcache eval --json`: the same PNG (quality_plot),
without running the caches again. Runs on SmolLM2 cost minutes a cache on a shared CPU, so
docs/caches.md keeps their JSON and draws its figures from it:

    kvcache eval -m smollm2 --tokens 4096 --chunk 32 --cache ... --json > b.json
    python scripts/eval_plot.py b.json docs/eval-smollm2-bounded.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvcache_cli.eval.quality import CacheQuality, QualityResult
from kvcache_cli.views.eval_plot import save_plot


def load(path: Path) -> QualityResult:
    """A QualityResult from eval's --json (lists back to the tuples the dataclasses hold)."""
    data = json.loads(path.read_text())
    rows = tuple(CacheQuality(**{**c, "loss_by_position": tuple(c["loss_by_position"])})
                 for c in data.pop("caches"))
    share = tuple(data.pop("first_token_share"))
    return QualityResult(**data, caches=rows, first_token_share=share)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python scripts/eval_plot.py EVAL.json OUT.png")
    print(save_plot(load(Path(sys.argv[1])), sys.argv[2]))
