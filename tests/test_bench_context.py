"""`bench --context`: each cache's decode step at long contexts, beside llama.cpp's step with
the matched cache type, and the cache bytes each step reads (what `size` counts)."""

import json

import pytest
from typer.testing import CliRunner

from kvcache_cli.bench import context as bench_context
from kvcache_cli.caches.spec import layer_bytes, parse_cache_list
from kvcache_cli.cli import app
from kvcache_cli.models import load_model
from kvcache_cli.models.llama_cpp import llama_available

CONTEXTS = [24, 48]


@pytest.fixture(scope="module")
def model():
    return load_model("stdlib-bytes").model


def _run(model, caches: str, with_llama: bool = False, **kwargs):
    options = dict(contexts=CONTEXTS, steps=3, repeats=2, threads=1,
                   model_name="stdlib-bytes", weights="fp32", with_llama=with_llama)
    return bench_context.run_context(model, parse_cache_list(caches), **{**options, **kwargs})


def test_every_cache_is_timed_at_every_context_with_the_bytes_size_counts(model):
    caches = "static,int8,int4:r0,window:16"
    r = _run(model, caches)
    c = model.config
    assert [s.cache for s in r.series] == [str(s) for s in parse_cache_list(caches)]
    for s, spec in zip(r.series, parse_cache_list(caches)):
        assert s.engine == "kvcache"
        assert [p.context for p in s.points] == CONTEXTS
        for p in s.points:
            assert p.step_ms > 0 and p.spread_ms[0] <= p.spread_ms[1]
            assert p.cache_bytes == c.n_layer * layer_bytes(spec, p.context, c.n_kv_head,
                                                            c.head_size, 4)
    static, window = r.series[0].points, r.series[3].points
    assert static[1].cache_bytes == 2 * static[0].cache_bytes  # every token, twice the tokens
    assert window[0].cache_bytes == window[1].cache_bytes  # 16 newest, at both contexts
    assert r.series[2].points[1].cache_bytes < static[1].cache_bytes / 2  # int4 codes, scales
    assert r.llama_file is None and r.llama_note == "not asked for"


def test_each_round_starts_from_the_context_again(model, monkeypatch):
    """Every timed step runs at the listed context, never past it: a cache that can crop is
    cropped back, a window that wrapped is filled again."""
    positions = []
    forward = type(model).forward

    def spy(self, idx, pos, cache, *args, **kwargs):
        if idx.shape[-1] == 1:
            positions.append(pos)
        return forward(self, idx, pos, cache, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", spy)
    for caches in ("static", "window:8"):
        positions.clear()
        _run(model, caches)
        assert positions == [n + i for n in CONTEXTS for _ in range(2) for i in range(3)]


@pytest.mark.parametrize("caches, contexts, steps, words", [
    ("h2o:8+8", [24], 3, "chooses its keys by attention"),
    ("snapkv:16", [24], 3, "chooses its keys by attention"),
    ("static", [48, 24], 3, "increasing"),
    ("static", [24, 24], 3, "increasing"),
    ("static", [2044], 8, "needs 2,052 positions"),
])
def test_a_plan_that_cannot_run_is_refused_before_any_timing(model, caches, contexts, steps,
                                                              words):
    with pytest.raises(ValueError, match=words):
        bench_context.check_context(model.config, parse_cache_list(caches), contexts, steps)


@pytest.mark.skipif(not llama_available(), reason="llama-cpp-python is not installed")
def test_llama_cpp_runs_the_matched_cache_type_on_the_same_weights(model):
    r = _run(model, "static,int8,window:16", with_llama=True)
    assert r.llama_file is not None and r.llama_file.endswith(".gguf")
    mine = {s.cache: s.matches for s in r.series if s.engine == "kvcache"}
    assert mine == {"static": "f16", "int8:g32:ktok:r0": "q8_0", "window:16": None}
    theirs = {s.cache: s for s in r.series if s.engine == "llama.cpp"}
    assert set(theirs) == {"f16", "q8_0"}  # q4_0 was not asked for
    c = model.config
    per_token = 2 * c.n_layer * c.n_kv_head * c.head_size
    for kind, s in theirs.items():
        assert [p.context for p in s.points] == CONTEXTS
        for p in s.points:
            assert p.step_ms > 0
            assert p.cache_bytes == round(per_token * p.context
                                          * bench_context.LLAMA_ELEMENT_BYTES[kind])


def test_the_command_prints_json_with_every_series():
    out = CliRunner().invoke(app, ["bench", "-m", "stdlib-bytes", "--context", "16,32",
                                   "--cache", "static,int8", "--new-tokens", "2",
                                   "--repeats", "1", "--threads", "1", "--json"])
    assert out.exit_code == 0, out.output
    r = json.loads(out.stdout)
    ours = [s for s in r["series"] if s["engine"] == "kvcache"]
    assert [s["cache"] for s in ours] == ["static", "int8:g32:ktok:r0"]
    assert r["contexts"] == [16, 32] and r["steps"] == 2 and r["repeats"] == 1


def test_the_command_prints_a_table_per_context_and_draws_its_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "context.png"
    out = CliRunner().invoke(app, ["bench", "-m", "stdlib-bytes", "--context", "16,32",
                                   "--cache", "static,window:8", "--new-tokens", "2",
                                   "--repeats", "1", "--threads", "1", "--plot", str(png)])
    assert out.exit_code == 0, out.output
    assert "one decode step at each context" in out.stdout
    assert "window:8" in out.stdout and "÷static" in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_table_divides_by_the_half_precision_cache_where_it_ran():
    out = CliRunner().invoke(app, ["bench", "-m", "stdlib-bytes", "--context", "16",
                                   "--cache", "static,fp16,int8", "--new-tokens", "2",
                                   "--repeats", "1", "--threads", "1"])
    assert out.exit_code == 0, out.output
    assert "÷fp16" in out.stdout and "÷static" not in out.stdout


def test_the_absent_peers_install_hint_keeps_its_brackets(model):
    import dataclasses
    import io

    from rich.console import Console

    from kvcache_cli.views.bench_context import context_view

    r = dataclasses.replace(_run(model, "static"), llama_file=None,
                            llama_note="llama.cpp is not installed: pip install 'kvcache[llama]'")
    console = Console(width=120, record=True, file=io.StringIO())
    console.print(context_view(r))
    assert "pip install 'kvcache[llama]'" in console.export_text()


def test_the_view_states_the_vocabulary_heads_share_of_the_weights(model):
    import io

    from rich.console import Console

    from kvcache_cli.measure import head_bytes
    from kvcache_cli.views.bench import decimal_bytes
    from kvcache_cli.views.bench_context import context_view

    r = _run(model, "static")
    assert r.head_bytes == head_bytes(model) > 0
    console = Console(width=120, record=True, file=io.StringIO())
    console.print(context_view(r))
    share = f"{decimal_bytes(r.head_bytes)} of those weights ({r.head_bytes / r.weight_bytes:.0%})"
    assert share in console.export_text()


def test_replay_steps_the_caches_with_fixed_buffers_replayed_and_says_which(tmp_path):
    """--replay: our steps as `generate` runs them, each series marked where they were
    replayed; a cache without fixed buffers (int8 rotated) steps eager and the note says
    why."""
    from kvcache_cli.generate import REPLAY_NOTE
    from kvcache_cli.models import fused, linear, llama

    if fused.library() is None or linear.products() is None:
        pytest.skip("no native kernels here: every step runs eager")
    tiny = llama.Llama(llama.LlamaConfig(n_layer=2, n_head=6, n_kv_head=2, n_embd=192,
                                         intermediate=96, vocab_size=96, context=64))
    tiny = linear.arrange_weights(llama.init_random(tiny, 0.3, 0)).eval()
    REPLAY_NOTE.clear()
    r = _run(tiny, "static,fp16,int8,int8:rot", model_name="tiny", replay=True)
    assert r.replay and [s.replayed for s in r.series] == [True, True, True, False]
    assert "a QuantizedCache has no fixed buffers" in r.kernel_note
    assert not any(s.replayed for s in _run(tiny, "static,fp16", model_name="tiny").series)


def test_the_view_marks_a_replayed_series(model):
    import dataclasses
    import io

    from rich.console import Console

    from kvcache_cli.views.bench_context import context_view

    r = _run(model, "static,int8")
    r = dataclasses.replace(r, replay=True,
                            series=(dataclasses.replace(r.series[0], replayed=True),
                                    r.series[1]))
    console = Console(width=160, record=True, file=io.StringIO())
    console.print(context_view(r))
    text = console.export_text()
    assert "static (replayed)" in text and "int8:g32:ktok:r0 (replayed)" not in text
    assert "as `generate` runs them" in text


@pytest.mark.parametrize("args, words", [
    (["--context", "0"], "--context '0' is not a whole number"),
    (["--context", "64,32"], "expected increasing"),
    (["--context", "x"], "--context 'x'"),
    (["--context", "2044"], "needs 2,052 positions"),
    (["--context", "32", "--cache", "h2o:8+8"], "chooses its keys by attention"),
    (["--context", "32", "--cache", "nonsense"], "--cache"),
    (["--context", "32", "--modes", "static"], "--modes does not apply with --context"),
    (["--context", "32", "--repeats", "0"], "--repeats 0"),
    (["--context", "32", "--new-tokens", "0"], "--new-tokens '0'"),
    (["--replay"], "--replay applies to --context"),
])
def test_bad_context_input_is_one_line_before_the_model_loads(args, words, no_model_loads):
    out = CliRunner().invoke(app, ["bench", "-m", "stdlib-bytes", *args])
    assert out.exit_code == 2, out.output
    assert words in out.output and out.output.strip().count("\n") == 0, out.output
