"""The README cannot drift: every example in it is run and compared with its text.

Exact blocks must match a real run line for line, timings aside; measured blocks (bench
figures from a quiet machine) are not run, because they take minutes, but their commands
must still parse and their table headings must still be printed (see readme_blocks.py).
After a change to any output, `python tests/readme_blocks.py --write` rewrites the exact
blocks from real runs.
"""

from __future__ import annotations

from readme_blocks import README, check, normalise, parse, write


def test_every_readme_example_matches_a_real_run():
    problems = check(README.read_text(encoding="utf-8"))
    assert not problems, "\n\n".join(problems)


def test_readme_has_exact_and_measured_blocks():
    blocks = parse(README.read_text(encoding="utf-8"))
    assert any(b.measured for b in blocks) and sum(not b.measured for b in blocks) >= 8
    commands = [e.command for b in blocks for e in b.examples]
    assert "kvcache models" in commands


def _size_block(block) -> bool:
    return any(e.command.startswith("kvcache size --layers 32 --kv-heads 8")
               for e in block.examples)


def test_a_changed_exact_figure_fails_the_check():
    text = README.read_text(encoding="utf-8")
    mutated = text.replace("per token: 131,072 bytes", "per token: 131,073 bytes", 1)
    assert mutated != text
    assert check(text, _size_block) == []
    problems = check(mutated, _size_block)
    assert len(problems) == 1 and "131,073" in problems[0], problems


def test_a_renamed_heading_in_a_measured_block_fails_the_check():
    text = README.read_text(encoding="utf-8")
    mutated = text.replace("  mode        tok/s      spread", "  mode        tk/s       spread", 1)
    assert mutated != text
    assert check(text, lambda block: block.measured) == []
    problems = check(mutated, lambda block: block.measured)
    assert any("'tk/s'" in p for p in problems), problems


def test_timings_are_normalised_but_other_figures_are_not():
    assert normalise(["first token  4.3 ms (prefill)  "]) == ["first token  <t> ms (prefill)"]
    assert normalise(["decode  568.8 tokens/s (1.8 ms/token)"]) == normalise(
        ["decode  3,325.1 tokens/s (0.3 ms/token)"])
    assert normalise(["per token: 131,072 bytes"]) != normalise(["per token: 131,073 bytes"])


def test_write_restores_a_changed_figure_and_keeps_the_rest():
    text = README.read_text(encoding="utf-8")
    mutated = text.replace("per token: 131,072 bytes", "per token: 131,073 bytes", 1)
    assert write(mutated, _size_block) == text


def test_float32_rounding_in_the_control_is_normalised_but_a_real_drift_is_not():
    line = "control, correct concat loop vs full recompute: max |Δ logit| {} (rounding"
    assert normalise([line.format("8.1e-06")]) == normalise([line.format("1.0e-05")])
    assert normalise([line.format("8.1e-06")]) != normalise([line.format("3.5e-01")])
