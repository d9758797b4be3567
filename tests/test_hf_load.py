"""`kvcache_cli.hf.load`: any transformers causal LM loaded offline from a folder, a GGUF file or
the local Hub cache, computing what the model it was saved from computes; and each way a
folder can be wrong or unsafe refused in one line, before code runs or a pickle is opened.
(`test_hostile_hf_folder.py` generates the wrong folders from the formats.)"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hfkit import save_folder, tiny_model
from hubcache import add_snapshot

from kvcache_cli.hf.load import HFLoadError, HFOffline, load_hf, read_hf_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = torch.tensor([[5, 17, 99, 250, 3, 42, 7]])  # (1, T)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_folder(tmp_path_factory.mktemp("hf") / "tiny-llama", "llama", seed=1)


def logits(model) -> torch.Tensor:
    with torch.inference_mode():
        return model(PROMPT).logits  # (1, T, vocab)


def refusal(source, *, match: str) -> str:
    """The one line load_hf refuses SOURCE with, which must contain MATCH."""
    with pytest.raises(HFLoadError) as err:
        load_hf(str(source))
    line = str(err.value)
    assert "\n" not in line and match in line, line
    return line


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_a_folder_loads_as_the_model_it_was_saved_from(tmp_path, arch, capfd):
    from tokenizers import Tokenizer

    save_folder(tmp_path, arch, seed=2)
    capfd.readouterr()  # save_pretrained's own progress bar
    loaded = load_hf(str(tmp_path))
    assert capfd.readouterr().err == ""  # no warnings, no progress bars
    assert (loaded.source, loaded.architecture) == (str(tmp_path), type(loaded.model).__name__)
    assert not loaded.model.training and loaded.model.dtype == torch.float32
    # The same class and the same float32 weights: the same operations, bit for bit.
    assert torch.equal(logits(loaded.model), logits(tiny_model(arch, seed=2)))
    own = Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode("hi there").ids
    assert loaded.tokenizer("hi there")["input_ids"] == own and len(own) > 2


def test_a_sharded_folder_loads_every_shard(tmp_path):
    save_folder(tmp_path, "llama", seed=3, max_shard_size="20KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert torch.equal(logits(load_hf(str(tmp_path)).model), logits(tiny_model("llama", 3)))


def test_dtype_and_device_are_what_was_asked(folder):
    loaded = load_hf(str(folder), device="cpu", dtype=torch.bfloat16)
    assert loaded.model.dtype == torch.bfloat16 and loaded.model.device.type == "cpu"
    with pytest.raises(HFLoadError, match="^device 'nowhere': "):
        load_hf(str(folder), device="nowhere")


def test_a_gguf_file_loads_as_the_llama_it_was_written_from(tmp_path, capfd):
    from llamakit import tiny_hf, write_tiny_gguf

    hf = tiny_hf(seed=4)
    path = write_tiny_gguf(hf, tmp_path / "tiny.gguf")
    config = read_hf_config(str(path))
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == \
        ("llama", 2, 64)
    capfd.readouterr()
    loaded = load_hf(str(path))
    assert capfd.readouterr().err == ""  # transformers' dequantising bar silenced too
    assert loaded.architecture == "llama"
    # transformers un-permutes q and k rows written in llama.cpp's order: the same float32
    # weights, summed in the same order; 1e-5 allows a different kernel path.
    torch.testing.assert_close(logits(loaded.model), logits(hf), atol=1e-5, rtol=1e-5)
    assert loaded.tokenizer.convert_ids_to_tokens([0, 1]) == ["!", '"']


def hub_cache(tmp_path: Path, monkeypatch, folder: Path | None) -> Path:
    """A local Hub cache holding FOLDER's files as the snapshot of org/tiny's main branch
    (nothing when FOLDER is None), used offline."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir(parents=True)
    if folder is not None:
        add_snapshot(cache, "org/tiny", "a" * 40, json.loads((folder / "config.json")
                                                            .read_text()), "main")
        snapshot = cache / "models--org--tiny" / "snapshots" / ("a" * 40)
        for path in folder.iterdir():
            if path.name != "config.json":
                shutil.copy(path, snapshot / path.name)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_hub_id_in_the_local_cache_loads_offline(tmp_path, monkeypatch, folder):
    hub_cache(tmp_path, monkeypatch, folder)
    assert read_hf_config("org/tiny")["model_type"] == "llama"
    loaded = load_hf("org/tiny")
    assert loaded.source == "org/tiny"
    assert torch.equal(logits(loaded.model), logits(tiny_model("llama", 1)))


def test_a_hub_id_not_in_the_cache_is_one_line_with_the_offline_way(tmp_path, monkeypatch):
    hub_cache(tmp_path, monkeypatch, None)
    with pytest.raises(HFOffline) as err:
        read_hf_config("org/absent")
    assert str(err.value) == (
        "'org/absent' is not in the local Hub cache and models are loaded offline: download "
        "it once online (hf download org/absent), or pass the path of a model folder")


def test_reading_a_config_never_imports_torch(tmp_path, folder):
    from llamakit import tiny_hf, write_tiny_gguf

    gguf = write_tiny_gguf(tiny_hf(), tmp_path / "tiny.gguf")
    # The package defers its transformers imports to first use, so a command that only
    # reads a config (to pick the engine) pays for no torch.
    script = "\n".join([
        "import sys",
        "from kvcache_cli.hf.load import read_hf_config",
        f"for source in ({str(folder)!r}, {str(gguf)!r}):",
        "    assert read_hf_config(source)['model_type'] == 'llama'",
        "from kvcache_cli.hf.load import HFOffline",
        "try:",
        "    read_hf_config('org/absent')",
        "    sys.exit('org/absent read from an empty cache')",
        "except HFOffline:",
        "    pass",
        "assert 'torch' not in sys.modules, 'torch imported'"])
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, env=env)
    assert run.returncode == 0, run.stderr


def copy_of(folder: Path, tmp_path: Path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(folder, target)
    return target


def edit_config(folder: Path, **fields) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}))


def test_custom_code_is_refused_naming_auto_map(folder, tmp_path):
    model = copy_of(folder, tmp_path)
    edit_config(model, auto_map={"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    (model / "modeling_evil.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    line = refusal(model, match="'auto_map' asks for the folder's own code")
    assert "AutoModelForCausalLM" in line and not (tmp_path / "ran").exists()


class Planted:
    """Unpickling this creates the file it names: the proof that a pickle was opened."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_weights_only_as_a_pickle_are_refused_unopened(folder, tmp_path):
    model = copy_of(folder, tmp_path)
    (model / "model.safetensors").unlink()
    (model / "pytorch_model.bin").write_bytes(pickle.dumps(Planted(tmp_path / "unpickled")))
    refusal(model, match="pytorch_model.bin: weights only as a pickle")
    assert not (tmp_path / "unpickled").exists()


@pytest.mark.parametrize("fields, match", [
    ({"model_type": "no_such_model"}, "model_type 'no_such_model' is not one transformers"),
    ({"model_type": "t5"}, "model_type 't5' has no causal LM in transformers"),
    ({"architectures": ["NoSuchForCausalLM"]}, "architectures names 'NoSuchForCausalLM'"),
    ({"hidden_size": 128}, "the weights hold model.embed_tokens.weight as [300, 64], the "
                           "config makes it [300, 128]"),
    ({"num_hidden_layers": 3}, "describes a model of 131,008 weights and its files hold 100,160"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers is 1,000,000,000"),
    ({"rms_norm_eps": float("nan")}, "'rms_norm_eps' is nan; expected a finite number"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}},
     "'rope_parameters.rope_theta' is 0; expected a finite positive number"),
    ({"vocab_size": 200}, "model.embed_tokens.weight as [300, 64], the config makes it [200"),
])
def test_a_config_transformers_cannot_serve_from_these_files_is_one_line(
        folder, tmp_path, fields, match):
    model = copy_of(folder, tmp_path)
    edit_config(model, **fields)
    refusal(model, match=match)


@pytest.mark.parametrize("text, match", [
    ("{not json", "config.json: not JSON"),
    ("[1, 2]", "config.json: a JSON list; expected a JSON object"),
])
def test_a_config_that_is_not_a_json_object_is_one_line(folder, tmp_path, text, match):
    model = copy_of(folder, tmp_path)
    (model / "config.json").write_text(text)
    refusal(model, match=match)


def test_a_folder_without_a_model_is_one_line(tmp_path):
    refusal(tmp_path, match="no config.json; expected a transformers model folder")
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    refusal(tmp_path, match="no weights; expected model.safetensors")


def test_a_tokenizer_that_does_not_load_is_one_line(folder, tmp_path):
    model = copy_of(folder, tmp_path)
    (model / "tokenizer.json").write_text("{corrupt")
    refusal(model, match="the tokenizer does not load")
    (model / "tokenizer.json").unlink()
    refusal(model, match="tokenizer")


def test_a_path_that_is_no_model_is_one_line_naming_what_is_accepted(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    refusal(tmp_path / "notes.txt", match="a file that is not GGUF")
    refusal(tmp_path / "absent", match="no such file or folder; expected a model folder")



def page_example() -> str:
    page = (Path(__file__).parents[1] / "docs" / "python-api.md").read_text(encoding="utf-8")
    section = page.split("## Loading a model offline", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_pages_loading_example_runs_offline_both_ways(tmp_path, monkeypatch, capsys,
                                                         folder):
    hub_cache(tmp_path / "empty", monkeypatch, None)
    exec(compile(page_example(), "docs/python-api.md", "exec"), {})  # noqa: S102
    assert capsys.readouterr().out == (
        "error: 'HuggingFaceTB/SmolLM2-135M-Instruct' is not in the local Hub cache and models "
        "are loaded offline: download it once online (hf download "
        "HuggingFaceTB/SmolLM2-135M-Instruct), or pass the path of a model folder\n")
    cache = hub_cache(tmp_path / "planted", monkeypatch, folder)
    (cache / "models--org--tiny").rename(cache / "models--HuggingFaceTB--SmolLM2-135M-Instruct")
    exec(compile(page_example(), "docs/python-api.md", "exec"), {})  # noqa: S102
    text, held = capsys.readouterr().out.rsplit(" ", 1)
    assert int(held) > 0 and len(text) > 0  # eight tokens of a random model, and its bytes


def test_weights_that_compute_no_numbers_are_one_line(folder, tmp_path):
    from safetensors.numpy import load_file, save_file

    model = copy_of(folder, tmp_path)
    tensors = load_file(model / "model.safetensors")
    tensors["model.norm.weight"][:] = float("nan")
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    refusal(model, match="the model's logits on its first tokens are not finite")
