"""The code map (docs/code-map.md) names every module of the package, one line each, and
nothing that is gone: a reader finds any command's or cache kind's code by its name."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _code_map() -> list[str]:
    page = (REPO / "docs" / "code-map.md").read_text(encoding="utf-8")
    block = page.split("```text\n", 1)[1].split("```", 1)[0]
    return block.splitlines()


def test_every_module_has_one_line_in_the_code_map():
    package = REPO / "kvcache_cli"
    modules = sorted(str(p.relative_to(package)) for p in package.rglob("*.py"))
    named = [m.group(1) for line in _code_map()
             if (m := re.match(r"^  (\S+\.py)\s", line))]
    assert sorted(named) == modules
    assert len(named) == len(set(named))
