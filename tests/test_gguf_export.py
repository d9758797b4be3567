"""The GGUF writer, read back with the `gguf` package's own reader: the names, shapes,
types and values llama.cpp's gpt2 loader asks for, the metadata, the synthetic
tokenizer, and the cache by content hash. Pure Python: no llama.cpp needed."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from kvcache_cli.models import set_weights_dtype  # noqa: E402
from kvcache_cli.models.gguf import export as gguf_export  # noqa: E402
from kvcache_cli.models.gpt2 import GPT, GPTConfig  # noqa: E402
from kvcache_cli.models.linear import float_state  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = GPTConfig(block_size=64, vocab_size=300, n_layer=2, n_head=4, n_embd=64)


def tiny(seed: int = 0) -> GPT:
    return GPT(CONFIG, init_std=0.2, seed=seed).eval()


def fields(reader) -> dict:
    return {name: reader.get_field(name) for name in reader.fields}


def scalar(reader, key):
    return reader.get_field(key).contents()


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(the model, the reader of its F32 file); tests only read both."""
    model = tiny()
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    gguf_export.write_gguf(float_state(model), CONFIG, path)
    return model, gguf.GGUFReader(path)


def test_tensor_names_are_llama_cpps_gpt2_and_the_lm_head_is_left_to_the_tie(written):
    _, reader = written
    names = {t.name for t in reader.tensors}
    per_layer = ["attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down"]
    expected = {"token_embd.weight", "position_embd.weight", "output_norm.weight",
                "output_norm.bias"}  # fmt: skip
    for i in range(CONFIG.n_layer):
        for stem in per_layer:
            expected |= {f"blk.{i}.{stem}.weight", f"blk.{i}.{stem}.bias"}
    assert names == expected  # no output.weight: gpt2.cpp reuses token_embd as the head


def test_weights_are_float32_in_nn_linear_order_with_ggml_shapes_reversed(written):
    model, reader = written
    tensors = {t.name: t for t in reader.tensors}
    C, V = CONFIG.n_embd, CONFIG.vocab_size
    # ggml's shape lists the fastest dimension first: {in, out} for a product's weight.
    assert list(tensors["blk.0.attn_qkv.weight"].shape) == [C, 3 * C]
    assert list(tensors["blk.0.ffn_up.weight"].shape) == [C, 4 * C]
    assert list(tensors["blk.0.ffn_down.weight"].shape) == [4 * C, C]
    assert list(tensors["token_embd.weight"].shape) == [C, V]
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in reader.tensors)
    block = model.transformer.h[1]
    pairs = {
        "blk.1.attn_qkv.weight": block.attn.c_attn.weight,  # (3C, C): (out, in)
        "blk.1.ffn_down.weight": block.mlp.c_proj.weight,
        "blk.1.attn_norm.bias": block.ln_1.bias,
        "token_embd.weight": model.transformer.wte.weight,
        "position_embd.weight": model.transformer.wpe.weight,
    }
    for name, param in pairs.items():
        # Exact: float32 written and read back, no arithmetic in between.
        np.testing.assert_array_equal(tensors[name].data, param.detach().numpy(), err_msg=name)


def test_metadata_is_what_llama_cpps_gpt2_loader_reads(written):
    _, reader = written
    assert scalar(reader, "general.architecture") == "gpt2"
    assert scalar(reader, "gpt2.context_length") == CONFIG.block_size
    assert scalar(reader, "gpt2.embedding_length") == CONFIG.n_embd
    assert scalar(reader, "gpt2.feed_forward_length") == 4 * CONFIG.n_embd
    assert scalar(reader, "gpt2.block_count") == CONFIG.n_layer
    assert scalar(reader, "gpt2.attention.head_count") == CONFIG.n_head
    assert scalar(reader, "gpt2.attention.layer_norm_epsilon") == pytest.approx(1e-5)
    assert scalar(reader, "general.file_type") == int(gguf.LlamaFileType.ALL_F32)


def test_the_synthetic_tokenizer_has_the_models_vocabulary_size_and_a_merge(written):
    _, reader = written
    tokens = scalar(reader, "tokenizer.ggml.tokens")
    assert scalar(reader, "tokenizer.ggml.model") == "gpt2"
    assert len(tokens) == CONFIG.vocab_size and len(set(tokens)) == CONFIG.vocab_size
    assert tokens[:3] == ["!", '"', "#"] and tokens[256] == "Ġt"  # GPT-2's own first ids
    assert tokens[-1] == "<|endoftext|>"
    assert len(scalar(reader, "tokenizer.ggml.token_type")) == CONFIG.vocab_size
    # llama.cpp refuses a gpt2 tokenizer without merges (and gguf drops an empty list).
    assert scalar(reader, "tokenizer.ggml.merges") == ["Ġ t"]
    assert scalar(reader, "tokenizer.ggml.eos_token_id") == CONFIG.vocab_size - 1


def test_a_tiny_vocabulary_still_gets_distinct_tokens():
    tokens, types, _ = gguf_export.synthetic_vocab(5)
    assert len(set(tokens)) == 5 and len(types) == 5 and tokens[-1] == "<|endoftext|>"
    with pytest.raises(ValueError, match="vocabulary size 1"):
        gguf_export.synthetic_vocab(1)


def test_export_is_cached_by_content_and_new_weights_get_a_new_file(tmp_path):
    first = gguf_export.export_gguf(float_state(tiny()), CONFIG, "f32", tmp_path)
    again = gguf_export.export_gguf(float_state(tiny()), CONFIG, "f32", tmp_path)
    other = gguf_export.export_gguf(float_state(tiny(seed=1)), CONFIG, "f32", tmp_path)
    assert not first.cached and again.cached and again.path == first.path
    assert other.digest != first.digest and other.path != first.path
    assert not list(tmp_path.glob("*.partial"))  # written under a temporary name, renamed


def test_an_int8_model_is_written_with_its_dequantised_weights(tmp_path):
    model = set_weights_dtype(copy.deepcopy(tiny()), "int8")
    path = tmp_path / "int8.gguf"
    gguf_export.write_gguf(float_state(model), CONFIG, path)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    layer = model.transformer.h[0].mlp.c_fc
    np.testing.assert_array_equal(tensors["blk.0.ffn_up.weight"].data,
                                  layer.dequantized().numpy())  # fmt: skip


def test_an_unknown_format_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="unknown GGUF format 'q4_k'"):
        gguf_export.export_gguf(float_state(tiny()), CONFIG, "q4_k", tmp_path)
    assert not list(tmp_path.iterdir())


def test_a_failed_write_leaves_no_file(tmp_path):
    state = float_state(tiny())
    del state["transformer.h.1.mlp.c_fc.bias"]
    with pytest.raises(ValueError, match="c_fc.bias"):
        gguf_export.write_gguf(state, CONFIG, tmp_path / "bad.gguf")
    assert not list(tmp_path.iterdir())
