"""Without the torch extra, every command that needs it says so in one line and exits 2.

A module is made missing by putting None in sys.modules under its name: `import` then
raises ImportError and importlib's find_spec answers None, as for a module never installed.
(The same was checked by hand in a fresh venv holding only the base install.)
"""

from __future__ import annotations

import sys

import pytest
from typer.testing import CliRunner

import kv_cache_from_scratch as ref
from kvcache_cli.cli import app

runner = CliRunner()
INSTALL = "pip install 'kvcache[torch]'"


def without(monkeypatch, *modules: str) -> None:
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


def invoke(*args: str):
    return runner.invoke(app, list(args), env={"COLUMNS": "100"})


@pytest.mark.parametrize("args, missing, names", [
    (["generate", "--ids", "1,2"], ["torch"], "kvcache generate needs torch, which is"),
    # GPT-2's BPE is tiktoken's (SmolLM2, the default where installed, reads its own file)
    (["generate", "-m", "gpt2", "hello"], ["tiktoken"],
     "kvcache generate needs tiktoken, which is"),
    (["generate", "-m", "gpt2", "hello"], ["torch", "tiktoken"],
     "needs torch and tiktoken, which are"),
    (["bench", "--device", "cpu"], ["transformers"], "kvcache bench needs transformers"),
    (["bench"], ["torch", "safetensors"], "kvcache bench needs torch and safetensors"),
    (["serve", "--device", "cpu"], ["torch"], "kvcache serve needs torch, which is"),
    (["break", "causal-decode"], ["torch"], "the GPT-2 break causal-decode needs torch"),
    (["size", "--model", "gpt2", "--verify"], ["transformers"], "--verify needs transformers"),
])
def test_a_missing_module_is_one_line_naming_it_and_the_extra(monkeypatch, args, missing, names):
    without(monkeypatch, *missing)
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert names in result.stderr and INSTALL in result.stderr


def test_generate_with_token_ids_does_not_need_tiktoken(monkeypatch, tmp_path):
    without(monkeypatch, "tiktoken")
    # Past the extra check to the loader, which refuses a folder that holds no checkpoint.
    (tmp_path / "none").mkdir()  # there, so the path check before torch lets it by
    result = invoke("generate", "--ids", "1,2", "--model", str(tmp_path / "none"))
    assert result.exit_code == 2, result.output
    assert "tiktoken" not in result.stderr and "no config.json" in result.stderr


def test_break_all_without_torch_runs_the_numpy_breaks_then_says_what_was_skipped(monkeypatch):
    without(monkeypatch, "torch")
    result = invoke("break", "all")
    assert result.exit_code == 0, result.output
    for scenario in ref.BREAKS.values():
        assert scenario.title in result.stdout
    assert result.stderr.count("\n") == 1, result.stderr
    from kvcache_cli.breaks.registry import names

    assert result.stderr.startswith(
        f"note: the GPT-2 breaks ({', '.join(names('gpt2'))}), the Llama breaks "
        f"({', '.join(names('llama'))}) and the Gemma 3 breaks "
        f"({', '.join(names('gemma3'))}) need torch")
    assert INSTALL in result.stderr


def test_break_all_json_without_torch_holds_the_numpy_breaks(monkeypatch):
    import json

    without(monkeypatch, "torch")
    result = invoke("break", "all", "--json")
    assert result.exit_code == 0, result.output
    assert set(json.loads(result.stdout)) == set(ref.BREAKS)
    assert INSTALL in result.stderr
