"""The README and the docs pages cannot drift: every example on them is run and compared with
its text.

Exact blocks must match a real run line for line, timings aside; measured blocks (bench
figures from a quiet machine) are not run, because they take minutes, but their commands
must still parse and their table headings must still be printed (see readme_blocks.py).
After a change to any output, `python tests/readme_blocks.py --write` rewrites the exact
blocks from real runs.
"""

from __future__ import annotations

import re

from readme_blocks import REPO, check, normalise, pages, parse, write


def _page_with(piece: str) -> tuple[str, str]:
    """The first page (name, text) that holds PIECE: the tests below follow a block wherever
    the docs move it."""
    return next((name, text) for name, text in pages().items() if piece in text)


def test_every_example_on_every_page_matches_a_real_run():
    problems = check(pages())
    assert not problems, "\n\n".join(problems)


def test_the_pages_have_exact_and_measured_blocks():
    texts = pages()
    assert "README.md" in texts and "docs/models.md" in texts
    blocks = [b for text in texts.values() for b in parse(text)]
    assert any(b.measured for b in blocks) and sum(not b.measured for b in blocks) >= 8
    commands = [e.command for b in blocks for e in b.examples]
    assert "kvcache models" in commands


def _size_block(block) -> bool:
    return any(e.command.startswith("kvcache size --layers 32 --kv-heads 8")
               for e in block.examples)


def test_a_changed_exact_figure_fails_the_check():
    page, text = _page_with("per token: 131,072 bytes")
    mutated = text.replace("per token: 131,072 bytes", "per token: 131,073 bytes", 1)
    assert check({page: text}, _size_block) == []
    problems = check({page: mutated}, _size_block)
    assert len(problems) == 1 and "131,073" in problems[0] and page in problems[0], problems


def test_a_renamed_heading_in_a_measured_block_fails_the_check():
    heading = "  mode        tok/s      spread"
    page, text = _page_with(heading)
    mutated = text.replace(heading, "  mode        tk/s       spread", 1)
    assert check({page: text}, lambda block: block.measured) == []
    problems = check({page: mutated}, lambda block: block.measured)
    assert any("'tk/s'" in p for p in problems), problems


def test_timings_are_normalised_but_other_figures_are_not():
    assert normalise(["first token  4.3 ms (prefill)  "]) == ["first token  <t> ms (prefill)"]
    assert normalise(["decode  568.8 tokens/s (1.8 ms/token)"]) == normalise(
        ["decode  3,325.1 tokens/s (0.3 ms/token)"])
    assert normalise(["per token: 131,072 bytes"]) != normalise(["per token: 131,073 bytes"])


def test_write_restores_a_changed_figure_and_keeps_the_rest():
    page, text = _page_with("per token: 131,072 bytes")
    mutated = text.replace("per token: 131,072 bytes", "per token: 131,073 bytes", 1)
    assert write({page: mutated}, _size_block) == {page: text}


def test_a_block_may_use_what_a_recipe_on_a_later_page_makes():
    # The recipe sleeps first: a block that did not wait for it would find no file.
    recipe = ("python3 -c \"import json, time; time.sleep(1); json.dump({'n_layer': 2, "
              "'n_head': 2, 'n_embd': 64}, open('tiny.json', 'w'))\"")
    texts = {"README.md": "```text\n$ kvcache size --config tiny.json --seq 8\n```\n",
             "docs/recipe.md": f"```text\n$ {recipe}\n```\n"}
    written = write(texts)
    assert "per token: 512 bytes" in written["README.md"], written["README.md"]
    assert written["docs/recipe.md"] == texts["docs/recipe.md"]


def test_float32_rounding_in_the_control_is_normalised_but_a_real_drift_is_not():
    line = "control, correct concat loop vs full recompute: max |Δ logit| {} (rounding"
    assert normalise([line.format("8.1e-06")]) == normalise([line.format("1.0e-05")])
    assert normalise([line.format("8.1e-06")]) != normalise([line.format("3.5e-01")])


def _shell_steps(command: str) -> list[str]:
    """A shell line's steps, `&&` apart, as pip's own command: continuations joined, `python3
    -m pip` read as `pip`, `--quiet` dropped."""
    steps = command.replace("\\\n", " ").replace("python3 -m pip", "pip").split("&&")
    return [" ".join(step.replace("--quiet", "").split()) for step in steps if step.strip()]


def test_the_pages_test_command_is_what_ci_runs():
    # CI's script installs from nothing, one step a line; the README, install.md and
    # testing.md give the same steps as one line, less pip's upgrade and the lint.
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").split("\n")
    steps = [s for line in ci if not line.startswith(("#", "set ", "cd ")) and line.strip()
             for s in _shell_steps(line)]
    want = [s for s in steps if s not in ("pip install --upgrade pip", "python3 -m ruff check .")]
    assert want[-1] == "python3 -m pytest -q", want
    texts = pages()
    for page in ("README.md", "docs/install.md", "docs/testing.md"):
        blocks = re.findall(r"```bash\n(.*?)```", texts[page], re.S)
        given = [_shell_steps(b) for b in blocks if "pytest" in b]
        assert given == [want], (page, given, want)
