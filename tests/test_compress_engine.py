"""`kvcache compress --engine transformers`: the compressing kinds run inside a transformers
model through the bridge. On a tiny random Qwen2 (an architecture kvcache has no family for)
whose second layer slides, compress runs by itself on that engine, compresses the first layer
only, and keeping every key continues exactly as the exact cache; on a tiny Llama saved as a
transformers folder, the kept keys per layer, their positions and the prompt's bytes equal
kvcache's own model's; what the engine cannot do, refused in one line."""

from __future__ import annotations

import json

import pytest
from hfkit import ARCHITECTURES, save_folder, write_tokenizer
from typer.testing import CliRunner

from kvcache_cli.cli import app

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

runner = CliRunner()
PROMPT = "class Point:\n    x: int = 0\n    y: int = 0\n"  # fewer tokens than 64 - 6


def invoke(*args: str):
    return runner.invoke(app, ["compress", PROMPT, "-n", "6", *args], env={"COLUMNS": "100"})


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    """A Llama folder, and a hybrid Qwen2's: layer 0 attends in full, layer 1 slides
    (window 8, held in transformers' own sliding layer)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("compress-hf")
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen2", **ARCHITECTURES["qwen2"], use_sliding_window=True,
                                  sliding_window=8, max_window_layers=1)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "qwen2")
    write_tokenizer(root / "qwen2")
    return {"qwen2": str(root / "qwen2"), "llama": str(save_folder(root / "llama", "llama"))}


def _rows(out) -> dict[str, dict]:
    assert out.exit_code == 0, out.output
    result = json.loads(out.stdout)
    return {row["cache"]: row for row in result["rows"]} | {"": result}


def test_compress_runs_through_transformers_and_keeping_everything_is_exact(folders):
    rows = _rows(invoke("-m", folders["qwen2"], "--cache", "snapkv:1.0,knorm:1.0,recent:1.0",
                        "--json"))
    result = rows.pop("")
    assert result["model"].startswith("transformers Qwen2ForCausalLM")
    assert result["compressed_layers"] == [0] and result["sliding_window"] == 8
    P = result["prompt_tokens"]
    assert len(rows) == 3
    for name, row in rows.items():
        assert row["kept"] == [P], name
        sliding = next(b for b in row["bytes"] if b["kind"] == "sliding")
        assert 0 < sliding["held"] == sliding["exact"], name  # its window, the same in each
        assert row["continuation"]["tokens"] == result["exact"]["tokens"], name
        assert row["matching"] == 6 and row["top1_agreement"] == 1.0, name


def test_kept_keys_and_bytes_equal_kvcache_own_model_on_a_llama_folder(folders):
    specs = "snapkv:0.25,knorm:0.5,recent:8:s2"
    own = _rows(invoke("-m", folders["llama"], "--cache", specs, "--engine", "kvcache",
                       "--json"))
    bridged = _rows(invoke("-m", folders["llama"], "--cache", specs, "--engine",
                           "transformers", "--json"))
    assert own.pop("")["prompt_tokens"] == bridged.pop("")["prompt_tokens"]
    assert own.keys() == bridged.keys() and len(own) == 3
    for name, row in own.items():
        assert row["kept"] == bridged[name]["kept"], name
        assert row["bytes"] == bridged[name]["bytes"], name
        # The same positions too: the same keys ranked alike in both engines.
        assert row["kept_share"] == pytest.approx(bridged[name]["kept_share"]), name


def test_what_compress_cannot_do_on_transformers_is_refused_in_one_line(folders):
    for args, said in [(["--weights", "random"], "--weights with --engine transformers"),
                       (["--cache", "snapkv:0.25:pyramid"], "pyramid")]:
        out = invoke("-m", folders["qwen2"], *args)
        assert out.exit_code == 2 and len(out.output.strip().splitlines()) == 1, out.output
        assert said in out.output, out.output
