"""`serve --workload VALUE` on a model without a chat template: the value the user typed is
read and refused first, in one line naming it, not answered with the model's missing
template; a good file on such a model is refused naming the file, not "chat"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvcache_cli.cli import app

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def no_template(tmp_path_factory) -> Path:
    """A tiny llama safetensors folder with a tokenizer and no chat template."""
    from hfkit import save_folder

    return save_folder(tmp_path_factory.mktemp("plain") / "llama", "llama")


def _workloads(root: Path) -> dict[str, tuple[str, str]]:
    """Each bad --workload: its text, and what its refusal says about it."""
    (root / "prompts.txt").write_text("Hello there\n", encoding="utf-8")
    (root / "broken.json").write_text('{"system": "s", "prompts": [', encoding="utf-8")
    (root / "shape.json").write_text(json.dumps({"prompts": "not a list"}), encoding="utf-8")
    (root / "folder").mkdir()
    return {
        "unknown word": ("bogus", "no such file; expected chat, random or a JSON file"),
        "missing file": (str(root / "none.json"), "no such file"),
        "text file": (str(root / "prompts.txt"), "not JSON"),
        "directory": (str(root / "folder"), "cannot be read"),
        "malformed JSON": (str(root / "broken.json"), "not JSON"),
        "wrong shape": (str(root / "shape.json"), "every prompt a non-empty string"),
    }


@pytest.mark.parametrize("case", ["unknown word", "missing file", "text file", "directory",
                                  "malformed JSON", "wrong shape"])
def test_a_bad_workload_is_named_before_the_models_missing_template(
        no_template, tmp_path, case, no_model_loads):
    value, said = _workloads(tmp_path)[case]
    result = CliRunner().invoke(app, ["serve", "-m", str(no_template), "--workload", value])
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: --workload {value}: ") and said in lines[0], lines[0]
    assert "chat template" not in lines[0]


def test_a_good_workload_file_on_a_model_without_a_template_names_the_file(
        no_template, tmp_path, no_model_loads):
    path = tmp_path / "chat.json"
    path.write_text(json.dumps({"system": "Be brief.", "prompts": ["Hi"]}), encoding="utf-8")
    result = CliRunner().invoke(app, ["serve", "-m", str(no_template), "--workload", str(path)])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert line.startswith(f"error: --workload {path}: model {str(no_template)!r} has no "
                           "chat template; expected a chat model"), line
