"""llama.cpp's cache types as eval rows: the spelling, the refusals before a model loads, and a
tiny GGUF scored through llama.cpp against its own exact cache, rotation on and off."""

from __future__ import annotations

import pytest
from llamakit import tiny_hf, write_tiny_gguf
from typer.testing import CliRunner

from kvcache_cli.cli import app
from kvcache_cli.eval.peer_llama_cpp import LlamaCppSpec, parse_llama_cpp

runner = CliRunner()


@pytest.mark.parametrize(("text", "k", "v", "rotate", "canonical"), [
    ("llama.cpp:q4_0", "q4_0", "q4_0", True, "llama.cpp:q4_0"),
    ("LLAMA.CPP:Q8_0:norot", "q8_0", "q8_0", False, "llama.cpp:q8_0:norot"),
    ("llama.cpp:kq8_0:vq4_0", "q8_0", "q4_0", True, "llama.cpp:kq8_0:vq4_0"),
    ("llama.cpp:kq4_0", "q4_0", "f16", True, "llama.cpp:kq4_0:vf16"),  # V at its default
    ("llama.cpp:kiq4_nl:viq4_nl", "iq4_nl", "iq4_nl", True, "llama.cpp:iq4_nl"),
])
def test_a_llama_cpp_spec_names_k_v_and_the_rotation(text, k, v, rotate, canonical):
    spec = parse_llama_cpp(text)
    assert (spec.k, spec.v, spec.rotate) == (k, v, rotate)
    assert str(spec) == canonical and parse_llama_cpp(canonical) == spec


@pytest.mark.parametrize(("text", "words"), [
    ("llama.cpp:q3_0", "'q3_0' is not a llama.cpp cache type; expected one of f32, f16"),
    ("llama.cpp", "no cache type"),
    ("llama.cpp:norot", "no cache type"),
    ("llama.cpp:q4_0:kq8_0", "K given twice"),
    ("llama.cpp:kq4_0:kq8_0", "K given twice"),
    ("llama.cpp:rot", "unknown field 'rot'"),
])
def test_a_malformed_llama_cpp_spec_is_one_line(text, words):
    with pytest.raises(ValueError, match="cache spec") as err:
        parse_llama_cpp(text)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_bytes_a_token_follow_ggml_s_blocks():
    from kvcache_cli.eval.peer_llama_cpp import layer_bytes

    # q8_0: 34 bytes a block of 32; q4_0: 18; f16: 2 an element. One KV head 64 wide.
    assert layer_bytes(LlamaCppSpec("q8_0", "q4_0", True), 10, 1, 64) == 10 * (2 * 34 + 2 * 18)
    assert layer_bytes(LlamaCppSpec("f16", "f16", True), 10, 1, 64) == 10 * 2 * 64 * 2
    assert LlamaCppSpec("q4_0", "q4_0", True).bits_per_value == 4.5


def invoke(*args: str):
    return runner.invoke(app, ["eval", *args], env={"COLUMNS": "100"})


@pytest.mark.parametrize(("args", "words"), [
    (["--cache", "int8,llama.cpp:q3_0"], "'q3_0' is not a llama.cpp cache type"),
    (["--cache", "llama.cpp:q4_0,llama.cpp:q4_0"], "'llama.cpp:q4_0' is listed twice"),
    (["-m", "stdlib-bytes", "--cache", "llama.cpp:q4_0"],
     "was not read from one (expected -m smollm2 or a .gguf)"),
])
def test_bad_llama_cpp_caches_are_one_line_exit_2_before_a_model_loads(no_model_loads, args,
                                                                        words):
    pytest.importorskip("torch")
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], result.stderr


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    # Heads 64 wide: llama.cpp rotates a quantised cache of such heads, so norot can differ.
    hf = tiny_hf(seed=1, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    return write_tiny_gguf(hf, tmp_path_factory.mktemp("gguf") / "tiny.gguf", "F32")


def test_a_cache_type_the_installed_build_lacks_is_one_line_exit_2(tiny_gguf, monkeypatch,
                                                                  no_model_loads):
    import llama_cpp

    monkeypatch.delattr(llama_cpp, "GGML_TYPE_Q5_1")
    text = tiny_gguf.parent / "t.txt"
    text.write_text("a b c d " * 100)
    result = invoke("-m", str(tiny_gguf), "--text", str(text), "--cache", "llama.cpp:q5_1")
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "the installed llama.cpp (llama-cpp-python" in lines[0]
    assert "has no cache type q5_1" in lines[0]


def test_llama_cpp_rows_are_scored_against_llama_cpp_s_exact_cache(tiny_gguf):
    import random

    from kvcache_cli.eval.peer_llama_cpp import evaluate
    from kvcache_cli.models import model_config

    config = model_config(str(tiny_gguf))
    ids = random.Random(0).choices(range(300), k=120)
    specs = [parse_llama_cpp(s) for s in ("llama.cpp:f16", "llama.cpp:q4_0",
                                          "llama.cpp:q4_0:norot")]
    rows = evaluate(str(tiny_gguf), ids, specs, config, prompt_len=16)
    ref, f16, rot, norot = rows
    assert ref.cache == "llama.cpp:f32" and ref.reference and ref.kl_mean == 0
    assert all(r.against == "llama.cpp:f32" and r.peer == "llama.cpp" for r in rows)
    assert len(ref.loss_by_position) == 120 - 16  # eval's count: the prefill's, then each fed
    # f16 rounds little or nothing (this tiny model's f16 and f32 rows agree); 4-bit
    # codes far more, and the rotation is really switched off.
    assert 0 <= f16.kl_mean < rot.kl_mean
    assert rot.kl_mean != norot.kl_mean
    assert rot.bytes_per_token == config.n_layer * 2 * 18 * 64 / 32  # q4_0: 18 bytes / 32


def test_a_prompt_longer_than_llama_cpp_s_batch_is_fed_in_chunks_and_scored_at_its_end(
        tiny_gguf):
    # The prompt's chunks before its last token are fed, not scored: eval's count again.
    import random

    from kvcache_cli.eval.peer_llama_cpp import CHUNK, evaluate
    from kvcache_cli.models import model_config

    config = model_config(str(tiny_gguf))
    prompt = CHUNK + 40
    ids = random.Random(1).choices(range(300), k=prompt + 20)
    ref, q8 = evaluate(str(tiny_gguf), ids, [parse_llama_cpp("llama.cpp:q8_0")], config,
                       prompt_len=prompt)
    assert len(ref.loss_by_position) == len(q8.loss_by_position) == 20
    assert ref.kl_mean == 0 and q8.kl_mean >= 0


def test_peer_rows_join_kvcache_s_table_and_bars_measure_from_their_own_reference(tiny_gguf):
    import dataclasses
    import random

    import torch

    from kvcache_cli.eval import quality
    from kvcache_cli.eval.peer_llama_cpp import evaluate
    from kvcache_cli.models import load_model
    from kvcache_cli.views.quality import excess_lines, plain

    model = load_model(str(tiny_gguf)).model
    ids = random.Random(0).choices(range(300), k=80)
    torch.manual_seed(0)
    ours = quality.evaluate(model, ids, ["int4"], prompt_len=16)
    peers = evaluate(str(tiny_gguf), ids, [parse_llama_cpp("llama.cpp:q4_0")], model.config,
                     prompt_len=16)
    result = dataclasses.replace(ours, caches=ours.caches + peers)
    text = plain(result, 200)
    assert "llama.cpp:q4_0" in text and "against its own exact llama.cpp:f32 cache" in text
    lines, _ = excess_lines(result)
    # llama.cpp's exact row is flat against itself, not against kvcache's static.
    assert set(lines["llama.cpp:f32"]) == {"▁"}


def test_the_plot_marks_the_peers_and_measures_them_from_their_own_reference(tiny_gguf,
                                                                          tmp_path):
    pytest.importorskip("matplotlib")
    import dataclasses
    import random

    import torch

    from kvcache_cli.eval import quality
    from kvcache_cli.eval.peer_llama_cpp import evaluate
    from kvcache_cli.models import load_model
    from kvcache_cli.views.eval_plot import save_plot

    model = load_model(str(tiny_gguf)).model
    ids = random.Random(1).choices(range(300), k=60)
    torch.manual_seed(0)
    ours = quality.evaluate(model, ids, ["window:16"], prompt_len=8)
    peers = evaluate(str(tiny_gguf), ids, [parse_llama_cpp("llama.cpp:q8_0")], model.config,
                     prompt_len=8)
    path = save_plot(dataclasses.replace(ours, caches=ours.caches + peers), tmp_path / "f.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
