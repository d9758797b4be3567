"""`kvcache caches` on hybrid models: which layers a `--cache` spec holds (the full-attention
ones; the sliding ones hold exact rings of their window), with -m MODEL or in general,
without torch."""

import json

import pytest
from typer.testing import CliRunner

from kvcache_cli.cli import app
from tests.test_cli_demo import modules_after

runner = CliRunner()


def caches(*args: str):
    return runner.invoke(app, ["caches", "int8", *args], env={"COLUMNS": "100"})


def test_caches_m_gemma3_names_the_global_layers_and_the_sliding_rings():
    out = caches("-m", "gemma-3-270m")
    assert out.exit_code == 0, out.output
    text = " ".join(out.stdout.split())
    assert "a spec holds the 3 full-attention layers (5, 11, 17)" in text
    assert "the 15 sliding layers hold exact rings of their window, 512 positions" in text
    layers = json.loads(caches("-m", "gemma-3-270m", "--json").stdout)["layers"]
    assert (layers["spec_layers"], layers["window"]) == ([5, 11, 17], 512)


@pytest.mark.parametrize("model, says", [
    ("mistral-7b", "a spec holds no layer: the 32 sliding layers"),
    ("llama-3-8b", "a spec holds every layer (32, all full attention)"),
])
def test_caches_m_says_what_an_all_sliding_or_all_full_model_does(model, says):
    out = caches("-m", model)
    assert out.exit_code == 0 and says in " ".join(out.stdout.split())


def test_caches_without_a_model_says_how_hybrid_models_take_a_spec():
    text = " ".join(caches().stdout.split())
    assert "a spec holds the full-attention layers; the sliding ones hold exact rings" in text
    assert "--sliding full" in text


def test_an_unknown_model_is_one_line_and_exit_2():
    out = caches("-m", "nope")
    assert out.exit_code == 2 and out.output.count("\n") == 1 and "nope" in out.output


def test_caches_m_never_imports_torch():
    heavy = ("sorted(m for m in sys.modules "
             "if m.split('.')[0] in ('torch', 'transformers', 'tiktoken'))")
    assert modules_after(["caches", "-m", "gemma-3-270m"], heavy) == "[]"
