"""`kvcache bench` on a tiny random GPT-2, on the CPU.

What is checked is what the bench counts and reports: every mode runs, their tokens
agree, steps and tokens are counted right, the bytes add up, the JSON and the plot
are complete. Timings are never asserted: they depend on the machine.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvcache_cli import measure
from kvcache_cli.bench import modes as bench_modes
from kvcache_cli.bench import results as bench_results
from kvcache_cli.bench import run as bench_run
from kvcache_cli.bench import runners as bench_runners
from kvcache_cli.bench import summary as bench_summary
from kvcache_cli.cli import app
from kvcache_cli.models.gpt2 import load_gpt2
from kvcache_cli.views.plot import sparkline

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

PROMPT, NEW, REPEATS = 6, 12, 2


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A real transformers checkpoint of a tiny GPT-2.

    initializer_range 0.3 instead of GPT-2's 0.02: at 0.02 a tiny model repeats one
    token forever, and tokens that agree would prove nothing.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=96, n_positions=64,
                        initializer_range=0.3)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


def _run(checkpoint: Path, **kwargs) -> bench_results.BenchResult:
    model = load_gpt2(str(checkpoint), weights="pretrained").model
    options = dict(prompt_len=PROMPT, new_tokens=NEW, repeats=REPEATS, bandwidth_mib=4)
    return bench_run.run_bench(model, **{**options, **kwargs})


def _cli(*args: str):
    return CliRunner().invoke(app, ["bench", *args])


def test_every_mode_runs_and_generates_the_same_varied_tokens(checkpoint):
    result = _run(checkpoint)
    assert [m.mode for m in result.modes] == list(bench_modes.DEFAULT_MODES)
    naive = result.mode("naive").tokens
    assert len(set(naive)) > 2, f"a tiny model stuck on one token proves nothing: {naive}"
    for m in result.modes:
        assert m.tokens == naive, m.mode
        assert m.same_tokens and m.first_difference is None, m.mode
    assert result.tokens_agree
    assert result.reference_mode == "naive"


def test_steps_and_tokens_are_counted_per_repeat(checkpoint):
    result = _run(checkpoint)
    for m in result.modes:
        assert m.tokens_generated == NEW, m.mode
        # The first token comes from the prefill; every later one is one decode step.
        assert len(m.step_ms) == REPEATS, m.mode
        assert all(len(steps) == NEW - 1 for steps in m.step_ms), m.mode
        assert len(m.median_step_ms) == NEW - 1, m.mode
        assert len(m.ttft_ms) == len(m.tokens_per_s) == REPEATS, m.mode
        assert all(ms > 0 for steps in m.step_ms for ms in steps), m.mode
    assert result.warmup_tokens == min(bench_runners.WARMUP_TOKENS, NEW)
    assert result.profile_lengths[0] == PROMPT + 1
    assert result.profile_lengths[-1] == PROMPT + NEW - 1


def test_tokens_per_second_is_decode_steps_over_decode_time(checkpoint):
    result = _run(checkpoint)
    for m in result.modes:
        for steps, tps in zip(m.step_ms, m.tokens_per_s, strict=True):
            assert tps == pytest.approx((NEW - 1) / (sum(steps) / 1e3))
        assert m.tokens_per_s_median == pytest.approx(sorted(m.tokens_per_s)[0] / 2
                                                      + sorted(m.tokens_per_s)[1] / 2)
    assert result.mode("naive").speedup_over_naive == pytest.approx(1.0)
    assert result.mode("hf").ratio_to_hf == pytest.approx(1.0)
    static = result.mode("static")
    assert static.speedup_over_naive == pytest.approx(
        static.tokens_per_s_median / result.mode("naive").tokens_per_s_median)


def test_static_appends_copy_only_the_new_tokens_concat_the_whole_cache(checkpoint):
    result = _run(checkpoint)
    kv_token = result.kv_bytes_per_token  # 2 * layers * n_embd * 4 bytes
    assert kv_token == 2 * 2 * 32 * 4
    final = PROMPT + NEW - 1  # the last token is never fed back
    # static writes each position once; concat re-copies the whole history each step.
    assert result.mode("static").bytes_copied == kv_token * final
    concat = sum(range(PROMPT + 1, final + 1)) + PROMPT
    assert result.mode("concat").bytes_copied == kv_token * concat
    assert result.mode("naive").bytes_copied is None
    assert result.mode("hf").bytes_copied is None


def test_the_limit_counts_weights_once_and_the_cache_at_each_length(checkpoint):
    result = _run(checkpoint)
    model = load_gpt2(str(checkpoint), weights="pretrained").model
    C, V, L = 32, 96, 2
    # wte (tied to lm_head, so once) + one row of wpe + ln_f + per layer: attn, mlp, 2 LNs.
    layer = (C * 3 * C + 3 * C) + (C * C + C) + (C * 4 * C + 4 * C) + (4 * C * C + C) + 4 * C
    assert result.weight_bytes == 4 * (V * C + C + 2 * C + L * layer)
    assert result.weight_bytes == measure.weight_bytes(model)
    assert result.head_bytes == 4 * V * C  # the tied head: every row of the vocabulary
    assert result.step_bytes_first == result.weight_bytes + result.kv_bytes_per_token * (PROMPT + 1)
    assert result.step_bytes_last == result.weight_bytes + result.kv_bytes_per_token * (
        PROMPT + NEW - 1)
    probes = {p.name: p for p in result.probes}
    assert set(probes) == {"read", "copy", "product"}
    assert probes["read"].bytes_per_run == 4 * 2**20  # read once
    assert probes["copy"].bytes_per_run == 2 * 4 * 2**20  # read + write
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 4 * L + 1  # the tied head once
    assert probes["product"].bytes_per_run == 4 * sum(
        p.numel() for m in linears for p in m.parameters())
    for p in probes.values():
        assert len(p.seconds) == REPEATS * measure.BANDWIDTH_REPEATS, p.name  # once a repeat
        assert p.best_gbps == pytest.approx(p.bytes_per_run / min(p.seconds) / 1e9), p.name
        assert p.best_gbps >= p.median_gbps > 0, p.name
    best = max(result.probes, key=lambda p: p.best_gbps)
    assert (result.limit_probe, result.limit_gbps) == (best.name, best.best_gbps)
    mean_bytes = (result.step_bytes_first + result.step_bytes_last) / 2  # linear in length
    assert result.ceiling_tokens_per_s == pytest.approx(best.best_gbps * 1e9 / mean_bytes)
    for m in result.modes:
        assert m.achieved_gbps == pytest.approx(mean_bytes * m.tokens_per_s_median / 1e9)
        assert m.mbu == pytest.approx(m.achieved_gbps / best.best_gbps)


def test_threads_are_set_for_the_run_and_restored(checkpoint):
    before = torch.get_num_threads()
    result = _run(checkpoint, modes=("static",), threads=1, repeats=1)
    assert result.threads == 1
    assert torch.get_num_threads() == before


def test_a_subset_of_modes_compares_with_the_first_one(checkpoint):
    result = _run(checkpoint, modes=("static", "concat"))
    assert [m.mode for m in result.modes] == ["static", "concat"]
    assert result.reference_mode == "static"
    assert result.tokens_agree
    assert all(m.speedup_over_naive is None and m.ratio_to_hf is None for m in result.modes)


def test_the_clock_synchronises_cuda_before_every_reading(monkeypatch):
    # No GPU here: a CUDA device object is enough to take the CUDA branch, with
    # torch.cuda.synchronize replaced by a recorder.
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    monkeypatch.setattr(bench_runners.time, "perf_counter", lambda: events.append("clock") or 0.0)
    clock = bench_runners._Clock(torch.device("cuda"), on_token=lambda: events.append("token"))
    clock.tick()
    assert events == ["sync", "clock", "sync", "clock", "token", "clock"]
    events.clear()
    bench_runners._Clock(torch.device("cpu"), on_token=lambda: None).tick()
    assert "sync" not in events


def test_bookkeeping_between_tokens_is_not_timed():
    timeline = bench_runners._Timeline(start=0.0, marks=[1.0, 3.0, 6.0], resumes=[1.5, 3.5, 6.5])
    assert timeline.ttft_ms() == 1000.0
    assert timeline.step_ms() == [1500.0, 2500.0]


def test_bandwidth_counts_the_read_and_the_write():
    bw = measure.measure_bandwidth(torch.device("cpu"), mib=2, repeats=3)
    assert bw.copy_bytes == 2 * 2**20
    assert bw.bytes_moved == 2 * bw.copy_bytes
    assert len(bw.seconds) == 3
    assert bw.best_gbps == pytest.approx(bw.bytes_moved / min(bw.seconds) / 1e9)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("naive,bogus", f"unknown mode 'bogus'; valid modes: {', '.join(bench_modes.MODES)}, "
                        "or a cache spec such as window:128, sink:4+124, h2o:64+64"),
        ("", f"no modes given; valid modes: {', '.join(bench_modes.MODES)}, or a cache spec such "
             "as window:128, sink:4+124, h2o:64+64"),
        ("static,static", "mode 'static' given twice"),
    ],
)
def test_parse_modes_rejects_bad_lists(text, message):
    with pytest.raises(ValueError) as err:
        bench_modes.parse_modes(text)
    assert str(err.value) == message


def test_run_bench_refuses_lengths_past_the_window(checkpoint):
    with pytest.raises(ValueError,
                       match=r"--prompt-len 32 \+ --new-tokens 40 = 72 past context window 64"):
        _run(checkpoint, prompt_len=32, new_tokens=40)


def test_sparkline_is_flat_for_flat_and_climbs_for_rising():
    assert sparkline([5.0] * 10) == "█" * 10
    rising = sparkline([float(i) for i in range(1, 65)], width=8)
    assert len(rising) == 8
    assert list(rising) == sorted(rising) and rising[0] != rising[-1]
    assert sparkline([1.0, 2.0, 3.0], width=40) == sparkline([1.0, 2.0, 3.0], width=3)
    assert sparkline([]) == ""


def test_cli_json_has_every_key(checkpoint):
    out = _cli("--model", str(checkpoint), "--weights", "pretrained", "--device", "cpu",
               "--prompt-len", str(PROMPT), "--new-tokens", str(NEW), "--repeats", "1", "--json")
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert set(data) == {
        "model", "weights_note", "kernel_note", "device", "device_name", "cpus", "others_cpu_share",
        "dtype", "cpu_half_support", "threads", "torch_version",
        "transformers_version", "n_params", "prompt_len", "new_tokens", "repeats",
        "warmup_tokens", "naive_samples", "reference_mode", "tokens_agree", "weight_bytes",
        "kv_bytes_per_token", "head_bytes", "step_bytes_first", "step_bytes_last", "probes",
        "limit_probe", "limit_gbps", "ceiling_tokens_per_s", "profile_lengths", "modes",
        "weights_format", "weights_check", "llama_cpp_version",
    }
    for probe in data["probes"]:
        assert set(probe) == {"name", "what", "bytes_per_run", "seconds", "best_gbps",
                              "median_gbps"}
    assert [m["mode"] for m in data["modes"]] == list(bench_modes.DEFAULT_MODES)
    for m in data["modes"]:
        assert set(m) == {
            "mode", "tokens", "tokens_generated", "same_tokens", "first_difference", "ttft_ms",
            "steps", "step_ms",
            "median_step_ms", "tokens_per_s", "tokens_per_s_median", "ms_per_token_median",
            "ttft_ms_median", "profile_ms", "speedup_over_naive", "ratio_to_hf",
            "cache_bytes_held", "bytes_copied", "achieved_gbps", "mbu", "compile_s",
            "weight_bytes", "difference_margin",
        }
        assert len(m["median_step_ms"]) == NEW - 1
        assert all(math.isfinite(x) for x in m["median_step_ms"])
    assert data["device"] == "cpu" and data["dtype"] == "float32"
    assert data["tokens_agree"] is True


def test_cli_table_and_plot(checkpoint, tmp_path):
    png = tmp_path / "steps.png"
    out = _cli("--model", str(checkpoint), "--weights", "pretrained", "--device", "cpu",
               "--prompt-len", str(PROMPT), "--new-tokens", str(NEW), "--repeats", "1",
               "--modes", "naive,static", "--threads", "1", "--plot", str(png))
    assert out.exit_code == 0, out.output
    shown = " ".join(out.stdout.split())  # rich wraps long lines at the test's 80 columns
    for text in ("naive", "static", "tokens/s", "the limit", "GB/s", "1 threads", "float32",
                 f"per-step plot written to {png}", "the vocabulary's head"):
        assert text in shown, text
    assert "×naive" in shown and "×hf" not in shown  # a ratio column only where its base ran
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    # One repeat reads as one run, not "median of 1 repeats"; no heading reads "@n".
    assert "one run per mode, so no spread" in shown and "of 1 repeats" not in shown
    assert "@n" not in shown and f"(@{PROMPT + 1}: {PROMPT + 1} tokens attended)" in shown


def test_cli_bad_modes_is_one_line_and_exit_2():
    out = _cli("--modes", "naive,fast", "--device", "cpu")
    assert out.exit_code == 2, out.output
    valid = ', '.join(bench_modes.MODES)
    assert out.stderr == (f"error: unknown mode 'fast'; valid modes: {valid}, "
                          "or a cache spec such as window:128, sink:4+124, h2o:64+64\n")


def test_cli_plot_into_a_missing_directory_is_refused_before_running(tmp_path):
    out = _cli("--device", "cpu", "--plot", str(tmp_path / "nope" / "x.png"))
    assert out.exit_code == 2, out.output
    assert out.stderr.startswith("error: --plot: no directory") and out.stderr.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cli_cuda_without_a_gpu_is_one_line_and_exit_2():
    out = _cli("--device", "cuda")
    assert out.exit_code == 2, out.output
    assert out.stderr == "error: CUDA is not available (torch sees no GPU); use --device cpu\n"


def test_other_processes_share_is_their_busy_time_over_all_cpus(monkeypatch):
    # 2 CPUs for 10 s: 20 CPU-seconds. All CPUs were busy 13 s, 8 of them ours: others 5.
    clock = iter([100.0, 110.0])
    busy = iter([1000.0, 1013.0])
    ours = iter([50.0, 58.0])
    from kvcache_cli import measure

    monkeypatch.setattr(measure.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(measure.time, "process_time", lambda: next(ours))
    monkeypatch.setattr(measure, "_busy_seconds", lambda: next(busy))
    monkeypatch.setattr(measure.os, "cpu_count", lambda: 2)
    assert measure.OtherProcesses().share() == pytest.approx(5 / 20)


@pytest.mark.parametrize("in_out", [True, False])
@pytest.mark.parametrize(("out_features", "threads"), [(96, 2), (97, 2), (97, 3), (5, 8)])
def test_one_row_linear_equals_nn_linear_in_either_layout(out_features, threads, in_out):
    # linear.Linear stored (in, out) splits a one-row product into a block of columns per
    # thread; columns that do not divide evenly go on their own. (out, in) is nn.Linear.
    from kvcache_cli.models.linear import Linear

    torch.manual_seed(0)
    layer = Linear(32, out_features)
    plain = torch.nn.Linear(32, out_features)
    plain.load_state_dict(layer.state_dict())
    if in_out:
        layer.weight.data = layer.weight.data.t().contiguous().t()
    assert layer.weight.shape == plain.weight.shape  # the layout changes strides only
    x = torch.randn(1, 1, 32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, x2_got = layer(x), layer(x2 := torch.randn(1, 3, 32))
    finally:
        torch.set_num_threads(before)
    # float32: the blocks sum in a different order than one gemm, ~1e-6 apart.
    torch.testing.assert_close(got, plain(x), rtol=1e-5, atol=1e-5)
    assert got.shape == (1, 1, out_features)
    # prefill: several rows take F.linear's own path
    torch.testing.assert_close(x2_got, plain(x2), rtol=1e-5, atol=1e-5)


@pytest.fixture
def torch_products(monkeypatch):
    """Linear's torch path, as where the native products cannot be built."""
    from kvcache_cli.models import linear

    monkeypatch.setattr(linear, "_products", [None])


@pytest.mark.usefixtures("torch_products")
def test_a_compiled_product_splits_for_the_threads_pinned_before_compiling(monkeypatch):
    # Under torch.compile the forward cannot ask torch for its thread count: pin_threads
    # fixes it beforehand, and the split then runs on those blocks with no torch call.
    from kvcache_cli.models.gpt2 import GPT, GPTConfig
    from kvcache_cli.models.linear import Linear, arrange_weights, pin_threads

    model = arrange_weights(GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=1, n_head=2,
                                          n_embd=32)))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        pin_threads(model)
    finally:
        torch.set_num_threads(before)
    layer = model.transformer.h[0].mlp.c_fc
    assert {m.threads for m in model.modules() if isinstance(m, Linear)} == {2}
    x = torch.randn(1, 1, 32)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(torch, "get_num_threads", lambda: pytest.fail("asked torch"))
    split = []
    monkeypatch.setattr(torch, "baddbmm", lambda *a: split.append(a) or torch.ops.aten.baddbmm(*a))
    got = layer(x)
    assert len(split) == 1 and split[0][2].shape == (2, 32, 64)  # two blocks of 64 columns
    torch.testing.assert_close(got, torch.nn.functional.linear(x, layer.weight, layer.bias),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("torch_products")
def test_float32_cpu_weights_are_stored_in_out_and_load_the_same_values(checkpoint):
    """Without the native products, whose kernel reads (out, in) rows."""
    from transformers import GPT2LMHeadModel

    from kvcache_cli.models.linear import Linear

    model = load_gpt2(str(checkpoint), weights="pretrained").model
    hf = GPT2LMHeadModel.from_pretrained(checkpoint)
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            assert module.weight.stride(0) == 1, name  # (in, out) in memory
    attn = model.transformer.h[0].attn.c_attn.weight
    torch.testing.assert_close(attn, hf.transformer.h[0].attn.c_attn.weight.t(), rtol=0, atol=0)
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    half = load_gpt2(str(checkpoint), weights="pretrained", dtype=torch.bfloat16).model
    assert half.lm_head.weight.is_contiguous()  # (out, in): nn.Linear's own order


def test_cli_lengths_past_the_window_are_one_line_and_exit_2(checkpoint):
    out = _cli("--model", str(checkpoint), "--weights", "pretrained", "--device", "cpu",
               "--prompt-len", "32", "--new-tokens", "40")
    assert out.exit_code == 2, out.output
    assert out.stderr == (
        "error: --prompt-len 32 + --new-tokens 40 = 72 past context window 64\n"), out.stderr


def test_first_difference_is_the_first_differing_token():
    assert bench_summary._first_difference([1, 2, 3], [1, 2, 3]) is None
    assert bench_summary._first_difference([1, 9, 3], [1, 2, 3]) == 1
    assert bench_summary._first_difference([1, 2], [1, 2, 3]) == 2  # a run that stopped early


def test_naive_is_timed_at_sampled_steps_fed_the_reference_tokens(checkpoint):
    result = _run(checkpoint, modes=("naive", "static"), naive_samples=4)
    naive, static = result.mode("naive"), result.mode("static")
    steps = bench_runners.sampled_steps(NEW - 1, 4)
    assert steps == [0, 3, 7, 10]
    assert naive.steps == tuple(steps) and static.steps == tuple(range(NEW - 1))
    assert all(len(ms) == len(steps) for ms in naive.step_ms)
    assert result.reference_mode == "static" and result.naive_samples == 4
    # The prefill's token, then each timed step's: the tokens naive chose at those places.
    assert naive.tokens == (static.tokens[0], *(static.tokens[i + 1] for i in steps))
    assert naive.same_tokens and result.tokens_agree
    assert len(set(static.tokens)) > 2, static.tokens
    # The first and last sampled steps are the run's first and last: @first and @last.
    assert naive.profile_ms[0] == naive.median_step_ms[0]
    assert naive.profile_ms[-1] == naive.median_step_ms[-1]


def test_naive_samples_zero_or_alone_times_every_step(checkpoint):
    every = _run(checkpoint, modes=("naive", "static"), naive_samples=0, repeats=1)
    assert every.naive_samples is None and every.reference_mode == "naive"
    assert len(every.mode("naive").steps) == NEW - 1
    alone = _run(checkpoint, modes=("naive",), naive_samples=4, repeats=1)
    assert alone.naive_samples is None and len(alone.mode("naive").steps) == NEW - 1


def test_sampled_steps_spread_evenly_from_first_to_last():
    steps = bench_runners.sampled_steps(255, 16)
    assert len(steps) == 16 and steps[0] == 0 and steps[-1] == 254
    assert steps == sorted(steps)
    assert bench_runners.sampled_steps(10, 0) == list(range(10))
    assert bench_runners.sampled_steps(10, 20) == list(range(10))


def test_a_sampled_run_names_the_position_of_its_first_different_token():
    run = bench_results.TimedRun(tokens=[5, 6, 0], ttft_ms=1.0, steps=[0, 4], step_ms=[2.0, 3.0],
                     cache_bytes_held=None, bytes_copied=None)
    reference = [5, 6, 1, 1, 1, 9]  # the token at position 5 (after step 4) is 9, not 0
    result = bench_summary._summarise("naive", [run], reference, [100] * 5, 1.0, None, 100)
    assert not result.same_tokens and result.first_difference == 5


def test_every_timed_run_is_reported_as_it_ends(checkpoint):
    heard = []
    _run(checkpoint, modes=("naive", "static"), naive_samples=3,
         finished=lambda label, tps: heard.append((label, tps > 0)))
    assert heard == [("static 1/2", True), ("naive 1/2", True),
                     ("static 2/2", True), ("naive 2/2", True)]


def test_compiled_modes_compile_once_and_report_the_compile_apart(checkpoint, monkeypatch):
    # torch.compile of even a tiny model takes many seconds on 2 cores; the wiring is
    # what is checked: what gets compiled, how, and that its time lands in compile_s.
    compiled = []

    def fake_compile(fn, **options):
        compiled.append((fn, options.get("mode")))
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    from kvcache_cli import caches

    whole, make_cache = [], caches.make_cache  # a compiled model's cache keeps one shape
    monkeypatch.setattr(caches, "make_cache",
                        lambda *a, **k: whole.append(k.get("whole")) or make_cache(*a, **k))
    result = _run(checkpoint, modes=("static-compiled", "hf-static-compiled"), repeats=1)
    assert whole and all(whole), whole
    from kvcache_cli.generate import _decode_step

    ours = [fn for fn, _ in compiled if fn is _decode_step]
    assert len(ours) == 1  # our decode step, compiled once; the prefill runs eager
    assert all(mode == bench_modes.COMPILE_MODE["cpu"] for _, mode in compiled)
    assert len(compiled) >= 2, "transformers' generate() did not compile its forward"
    for m in result.modes:
        assert m.compile_s is not None and m.compile_s > 0, m.mode
        assert m.same_tokens, m.mode
    whole.clear()
    assert _run(checkpoint, modes=("static",), repeats=1).mode("static").compile_s is None
    assert whole and not any(whole), whole  # eager reads only the filled prefix


def test_cli_compile_without_a_static_mode_is_one_line_and_exit_2():
    out = _cli("--device", "cpu", "--modes", "naive,hf", "--compile")
    assert out.exit_code == 2, out.output
    assert out.stderr == "error: --compile needs mode static or hf-static in --modes\n"


def test_cli_bfloat16_runs_and_states_the_cpu_half_precision_support(checkpoint):
    out = _cli("--model", str(checkpoint), "--weights", "pretrained", "--device", "cpu",
               "--prompt-len", str(PROMPT), "--new-tokens", str(NEW), "--repeats", "1",
               "--modes", "static,hf", "--dtype", "bf16", "--json")
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["dtype"] == "bfloat16"
    assert data["kv_bytes_per_token"] == 2 * 2 * 32 * 2  # 2 bytes an element
    assert "avx512_bf16" in data["cpu_half_support"]
    # Off a terminal, each finished run is one line on stderr.
    assert "static 1/1: " in out.stderr and "hf 1/1: " in out.stderr


def test_cpu_half_support_reads_the_flags(monkeypatch, tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 avx_vnni\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(
        cpuinfo if path == "/proc/cpuinfo" else path, *a, **k))
    support = bench_modes.cpu_half_support()
    assert support == "has avx512_bf16; lacks amx_bf16, avx512_fp16, amx_fp16"


def test_bounded_caches_bench_beside_the_exact_ones_with_their_own_bytes(checkpoint):
    r = _run(checkpoint, modes=("static", "window:8", "h2o:4+4"), new_tokens=24, repeats=1)
    window, static = r.mode("window:8"), r.mode("static")
    assert bench_modes.parse_modes("static, WINDOW:8") == ("static", "window:8")
    # 2 layers x K and V x 8 slots x 32 wide x 4 bytes, whatever the length
    assert window.cache_bytes_held == 2 * 2 * 8 * 32 * 4 < static.cache_bytes_held
    assert len(window.median_step_ms) == 23
    # Evicting, the window may part from the exact tokens: not a failed run.
    assert r.tokens_agree and static.same_tokens
    with pytest.raises(ValueError, match="beyond the model's context window of 64"):
        _run(checkpoint, modes=("window:65",))


def test_hf_quanto_runs_transformers_own_quantised_cache_in_its_own_model(tmp_path):
    """generate() through transformers' QuantizedCache (quanto int4, g64, r128) on the
    transformers copy of the model: the same tokens as that quantiser's layers run inside
    kvcache's Llama (`quanto-int4`), whose greedy path it is."""
    pytest.importorskip("optimum.quanto")
    from llamakit import tiny_hf, write_tiny_gguf

    from kvcache_cli.models import load_model

    hf = tiny_hf(seed=1, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                 max_position_embeddings=256)
    model = load_model(str(write_tiny_gguf(hf, tmp_path / "tiny.gguf"))).model
    result = bench_run.run_bench(model, modes=("quanto-int4", "hf-quanto"), prompt_len=8,
                             new_tokens=140, repeats=1, bandwidth_mib=4)
    ours, theirs = result.mode("quanto-int4:g64:r128"), result.mode("hf-quanto")
    assert len(theirs.tokens) == 140  # past its residual of 128: the codes were read
    assert theirs.tokens == ours.tokens and theirs.tokens_per_s_median > 0
