"""Gemma 3 written to GGUF by kvcache's writer (`models.gguf.gemma3_export`): read back by
kvcache's own reader to the same state, and run by llama.cpp to the same greedy tokens as
kvcache's model. The llama.cpp runs need the `llama` extra and skip without it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcache_cli.bench import run as bench_run
from kvcache_cli.models import llama_cpp as llama_peer
from kvcache_cli.models.gguf.export import export_gguf
from kvcache_cli.models.gguf.reader import read_gemma3
from kvcache_cli.models.linear import arrange_weights, float_state

gguf = pytest.importorskip("gguf")
from test_gemma3 import HS, ours, tiny_hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
has_llama = pytest.mark.skipif(not llama_peer.llama_available(),
                               reason="needs the llama extra (llama-cpp-python, gguf)")
# llama.cpp's Gemma 3: every 6th layer global, queries scaled by 1/sqrt(head_dim).
AS_LLAMA_CPP = dict(layer_types=["sliding_attention"] * 5 + ["full_attention"],
                    query_pre_attn_scalar=HS)
PROMPT, NEW = 6, 12  # 18 positions: past the window of 8, so llama.cpp's band is exercised


@pytest.fixture(scope="module")
def model():
    return arrange_weights(ours(tiny_hf(**AS_LLAMA_CPP)))


def test_the_f32_file_reads_back_to_the_same_state_and_shape(model, tmp_path):
    written = export_gguf(float_state(model), model.config, "f32", tmp_path)
    back = read_gemma3(written.path)
    state = float_state(model)
    state.pop("lm_head.weight", None)  # tied: the file holds the embedding once
    assert set(back.tensors) == set(state)
    for name, t in state.items():  # norms went in as 1 + w and come back as w
        np.testing.assert_allclose(back.tensors[name], t.numpy(), atol=1e-6, err_msg=name)
    c, r = model.config, back.config
    assert (r.layer_types, r.query_pre_attn_scalar, r.n_kv_head, r.head_dim) == (
        c.layer_types, c.query_pre_attn_scalar, c.n_kv_head, c.head_dim)
    assert r.rms_eps == pytest.approx(c.rms_eps)  # stored as a float32
    names = {t.name for t in gguf.GGUFReader(written.path).tensors}
    assert "output.weight" not in names and "blk.0.attn_q_norm.weight" in names


@pytest.mark.parametrize(("overrides", "why"), [
    (dict(layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2),
     "layer pattern"),
    (dict(query_pre_attn_scalar=24), "query_pre_attn_scalar is 24"),
])
def test_a_model_llama_cpp_would_read_otherwise_is_refused_before_writing(overrides, why,
                                                                         tmp_path):
    m = ours(tiny_hf(**{**AS_LLAMA_CPP, **overrides}))
    with pytest.raises(ValueError, match=why) as err:
        export_gguf(float_state(m), m.config, "f32", tmp_path)
    assert "\n" not in str(err.value)
    assert not list(tmp_path.iterdir())


@has_llama
def test_llama_cpp_gives_kvcaches_greedy_tokens_on_the_f32_file(model, tmp_path):
    from decoding import tokens

    from kvcache_cli.generate import stream_tokens

    prompt = tokens(PROMPT, model.config.vocab_size)[0].tolist()
    with torch.no_grad():
        mine = list(stream_tokens(model, prompt, NEW, "static"))
    runner = llama_peer.LlamaRunner(llama_peer.prepare(model, "llama.cpp", tmp_path),
                                    PROMPT + NEW, threads=1)
    try:
        theirs = list(runner.stream(prompt, NEW))
    finally:
        runner.close()
    assert len(set(mine)) > 2  # the tokens vary, so agreement means something
    assert theirs == mine


@has_llama
def test_bench_runs_gemma3_beside_llama_cpp_at_each_written_format(model, tmp_path):
    modes = ("static", "llama.cpp", "llama.cpp-f16", "llama.cpp-q8_0")
    result = bench_run.run_bench(model, modes=modes, prompt_len=PROMPT, new_tokens=NEW,
                                 repeats=1, bandwidth_mib=4, gguf_dir=tmp_path)
    f32, f16, q8 = (result.mode(m) for m in modes[1:])
    for m in (f32, f16, q8):
        assert m.tokens_generated == NEW
        assert m.same_tokens or m.difference_margin.near_tie, (m.mode, m.difference_margin)
    assert q8.weight_bytes < f16.weight_bytes < f32.weight_bytes
    assert len(list(tmp_path.glob("gemma3-*.gguf"))) == 3


@has_llama
def test_the_real_270m_written_f32_gives_llama_cpp_the_same_tokens_and_its_tokenizer(tmp_path):
    """The real file's weights as `-m gemma3` runs them, written F32 (1.1 GB; about 2
    minutes on 2 busy cores, beside the conversion `test_gemma3_real` shares): llama.cpp
    continues "The capital of France is" as kvcache does, the source's tokenizer copied."""
    import gemmakit

    from kvcache_cli.generate import stream_tokens
    from kvcache_cli.models import load_model

    source = gemmakit.gemma3_or_skip()
    model = load_model("gemma3").model
    prompt = [2, 818, 5279, 529, 7001, 563]  # <bos>The capital of France is
    with torch.no_grad():
        mine = list(stream_tokens(model, prompt, 8, "static"))
    file = llama_peer.prepare(model, "llama.cpp", tmp_path)
    written, original = (gguf.GGUFReader(p).fields for p in (file.path, source))
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.bos_token_id",
                "gemma3.attention.sliding_window", "gemma3.rope.freq_base"):
        assert written[key].contents() == original[key].contents(), key
    runner = llama_peer.LlamaRunner(file, len(prompt) + 8, threads=1)
    try:
        assert list(runner.stream(prompt, 8)) == mine
    finally:
        runner.close()


@has_llama
def test_llama_cpp_evicting_its_sliding_cells_still_gives_kvcaches_tokens(tmp_path):
    """A prompt of 1,000: past llama.cpp's sliding cells (window + a batch of 512, rounded
    to 256), so its sliding layers drop old positions as kvcache's rings do."""
    from decoding import tokens

    from kvcache_cli.generate import stream_tokens

    model = arrange_weights(ours(tiny_hf(**AS_LLAMA_CPP, max_position_embeddings=2048)))
    prompt = tokens(1_000, model.config.vocab_size, seed=1)[0].tolist()
    with torch.no_grad():
        mine = list(stream_tokens(model, prompt, 8, "static"))
    runner = llama_peer.LlamaRunner(llama_peer.prepare(model, "llama.cpp", tmp_path),
                                    len(prompt) + 8, threads=1)
    try:
        assert list(runner.stream(prompt, 8)) == mine
    finally:
        runner.close()
