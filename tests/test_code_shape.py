"""No function body in kvcache_cli runs past 80 lines unless a one-line comment directly
above it says why: a function that no longer reads in one screen is split along its steps."""

from __future__ import annotations

import ast
from pathlib import Path

import kvcache_cli

LIMIT = 80  # lines of a function's body, its docstring included
PACKAGE = Path(kvcache_cli.__file__).parent


def long_functions(source: str, name: str) -> list[str]:
    """'module:function (N lines)' for each function in SOURCE whose body passes LIMIT with
    no comment on the line directly above its first line (its first decorator's, if any)."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        length = node.end_lineno - node.body[0].lineno + 1
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        above = lines[first - 2].strip() if first >= 2 else ""
        if length > LIMIT and not above.startswith("#"):
            found.append(f"{name}:{node.name} ({length} lines)")
    return found


def test_no_function_body_over_80_lines_without_a_reason():
    found = [f for path in sorted(PACKAGE.rglob("*.py"))
             for f in long_functions(path.read_text(encoding="utf-8"),
                                     str(path.relative_to(PACKAGE.parent)))]
    assert not found, f"over {LIMIT} lines with no reason comment above: {', '.join(found)}"


def test_the_check_names_a_long_function_and_its_length():
    body = "".join(f"    x{i} = {i}\n" for i in range(LIMIT + 1))
    source = f"def long():\n{body}\n\ndef short():\n    return 1\n"
    assert long_functions(source, "m") == [f"m:long ({LIMIT + 1} lines)"]
    reasoned = f"# one table, read top to bottom\ndef long():\n{body}"
    assert long_functions(reasoned, "m") == []
