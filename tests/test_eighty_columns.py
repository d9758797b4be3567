"""Every command's output at 80 columns, in a terminal and piped: no line wider, and no
number cut ('13.6…', '0:00:…'). One case per command and variant (each break, each size
form, the llama.cpp and chat paths), on the small models: a byte-level GPT-2 checkpoint and
a tiny GGUF Llama, so the whole file runs in seconds. A table or column added later is
checked by the same rule, whatever the view.
"""

from __future__ import annotations

import importlib
import re

import pytest
from typer.testing import CliRunner

from kvcache_cli.cli import app

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

WIDTH = 80
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
# What rich writes where it cuts a cell: '…' after (or inside) a number.
CUT_NUMBER = re.compile(r"[0-9]…|…[0-9]")
TEXT = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n" * 8

WORKLOAD = ["--requests", "3", "--prompt-len", "4:12", "--output-len", "2:6",
            "--shared-prefix", "4", "--kv-mem", "1MiB"]
BENCH = ["--new-tokens", "6", "--repeats", "1", "--prompt-len", "8"]
GPT_BREAKS = ["position-offset", "causal-decode", "stale-cache", "no-rollback",
              "rollback-shared", "kv-outlier-keys", "kv-sink-token", "fp8-range",
              "evict-sink", "ring-mask", "ring-off-by-one"]
LLAMA_BREAKS = ["rope-decode", "kv-expand-early", "gqa-interleave", "rope-twice"]

# {gpt}: the byte-level GPT-2 checkpoint; {llama}: the tiny GGUF Llama.
CASES = {
    "models": ["models"],
    "caches": ["caches"],
    "demo": ["demo"],
    "break-list": ["break", "--list"],
    "break-toy": ["break", "no-mask"],
    "size-preset": ["size", "--model", "gemma-2-9b", "--seq", "8192"],
    "size-flags": ["size", "--layers", "32", "--kv-heads", "8", "--seq", "32768"],
    "size-fit": ["size", "--model", "llama-3-70b", "--seq", "128k", "--batch", "8",
                 "--params", "70B", "--gpu-mem", "80GiB", "--tp", "8"],
    "size-mla": ["size", "--model", "deepseek-v3", "--seq", "4096"],
    "size-cache": ["size", "--model", "gpt2", "--seq", "1024", "--cache", "int4:rot"],
    "size-gguf": ["size", "-m", "{llama}", "--seq", "512"],
    "eval": ["eval", "-m", "{gpt}", "--prompt-len", "40", "--tokens", "100", "--cache",
             "static,int8,int4:g32:kchan:r128,fp8-e4m3,window:32,sink:4+28,h2o:16+16,"
             "snapkv:0.25,knorm:0.25,recent:0.25"],
    "eval-llama": ["eval", "-m", "{llama}", "--prompt-len", "32", "--tokens", "96", "--cache",
                   "int4:g16:rot,sink:4+28:rerotate,snapkv:0.5"],
    "eval-retrieval": ["eval", "-m", "{llama}", "--task", "retrieval", "--lengths", "40"],
    "compress": ["compress", "-m", "{llama}", "--text", "{text}", "--question", "Why?",
                 "-n", "4", "--cache", "snapkv:0.25:w4,recent:0.25", "--show-kept"],
    "serve": ["serve", "-m", "{gpt}", *WORKLOAD, "--engines", "sequential,padded,paged"],
    "serve-rates": ["serve", "-m", "{gpt}", *WORKLOAD, "--rate", "50,inf", "--engines",
                    "sequential,paged", "--kv-dtype", "int8", "--goodput", "ttft:2000"],
    "serve-llama": ["serve", "-m", "{llama}", "--workload", "random", *WORKLOAD, "--engines",
                    "sequential,paged"],
    "serve-chat": ["serve", "-m", "{llama}", "--requests", "3", "--output-len", "6",
                   "--engines", "sequential,paged"],
    "serve-batch": ["serve", "-m", "{gpt}", "--batch", "1,2"],
    "bench": ["bench", "-m", "{gpt}", *BENCH, "--naive-samples", "2", "--modes",
              "naive,static,hf-static", "--cache", "int8,window:8"],
    "bench-llama.cpp": ["bench", "-m", "{llama}", *BENCH, "--naive-samples", "2", "--modes",
                        "static,llama.cpp,llama.cpp-gguf"],
    "bench-draft": ["bench", "-m", "{gpt}", *BENCH, "--draft", "lookup", "--speculate", "1,2"],
    "generate": ["generate", "-m", "{gpt}", "-n", "6", "Hello"],
    "generate-draft": ["generate", "-m", "{gpt}", "-n", "6", "--draft", "lookup",
                       "--speculate", "2", "Hello"],
    "generate-chat": ["generate", "-m", "{llama}", "--chat", "hi", "-n", "6"],
    **{f"break-{name}": ["break", name, "-m", "{gpt}", "--max-new-tokens", "6"]
       for name in GPT_BREAKS},
    **{f"break-{name}": ["break", name, "-m", "{llama}", "--max-new-tokens", "6"]
       for name in LLAMA_BREAKS},
}
NEEDS_LLAMA_CPP = {"bench-llama.cpp"}
# The measuring runs behind the slow commands: computed in the terminal run, replayed in the
# piped one, whose rendering is all that differs.
SLOW = ("kvcache_cli.eval.quality.evaluate", "kvcache_cli.eval.retrieval.run_retrieval",
        "kvcache_cli.serving.engines.run_serve", "kvcache_cli.serving.batching.run_sweep",
        "kvcache_cli.bench.run.run_bench", "kvcache_cli.breaks.quantized.quantised")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from bytecheckpoint import write_byte_checkpoint
    from llamakit import tiny_hf, write_tiny_gguf

    root = tmp_path_factory.mktemp("eighty")
    (root / "bytes").mkdir()
    gpt = write_byte_checkpoint(root / "bytes", 256, 128, TEXT)
    # A context of 1,024: the retrieval prompts (filler, template, question) need ~400.
    llama = write_tiny_gguf(tiny_hf(max_position_embeddings=1024), root / "tiny.gguf",
                            context=1024)
    (root / "text.txt").write_text(TEXT)
    return {"gpt": str(gpt), "llama": str(llama), "text": str(root / "text.txt")}


@pytest.fixture
def replay(monkeypatch):
    """Call `replay(False)` to make each SLOW function return, in order, what it returned
    while recording (the default) instead of measuring again."""
    state = {"recording": True}
    for path in SLOW:
        module, name = path.rsplit(".", 1)
        original = getattr(importlib.import_module(module), name)
        results: list = []

        def recorded(*args, _original=original, _results=results, **kwargs):
            if state["recording"]:
                _results.append(_original(*args, **kwargs))
                return _results[-1]
            return _results.pop(0)

        monkeypatch.setattr(f"{module}.{name}", recorded)
    return lambda recording: state.update(recording=recording)


def _check(output: str, where: str) -> None:
    text = ANSI.sub("", output).replace("\r", "\n")
    wide = [line for line in text.splitlines() if len(line) > WIDTH]
    assert not wide, f"{where}: {len(wide)} lines past {WIDTH} columns:\n" + "\n".join(wide)
    cut = [line for line in text.splitlines() if CUT_NUMBER.search(line)]
    assert not cut, f"{where}: a number cut:\n" + "\n".join(cut)


@pytest.mark.parametrize("case", list(CASES))
def test_every_command_is_whole_at_80_columns_in_a_terminal_and_piped(case, models, replay):
    if case in NEEDS_LLAMA_CPP:
        pytest.importorskip("llama_cpp")
    args = [a.format(**models) for a in CASES[case]]
    runner = CliRunner()
    # FORCE_COLOR: rich takes the output for a terminal (colour, live bars, the rich views).
    for where, env in (("terminal", {"COLUMNS": str(WIDTH), "FORCE_COLOR": "1"}),
                       ("piped", {"COLUMNS": str(WIDTH), "FORCE_COLOR": None})):
        result = runner.invoke(app, args, env=env)
        replay(False)
        assert result.exit_code == 0, (where, result.output)
        _check(result.stdout, f"{case}, {where}")
        # Progress and notes on stderr: their numbers are whole too (one-line errors and
        # notes may be longer than the width: a terminal wraps them).
        stderr = ANSI.sub("", result.stderr)
        assert not CUT_NUMBER.search(stderr), (case, where, stderr)


# --- the rule itself -----------------------------------------------------------------------


def _wide_table():
    from rich.table import Table

    table = Table(title="wide")
    for heading in ("cache", *(f"figure {i}" for i in range(12))):
        table.add_column(heading)
    table.add_row("[bold]int4:g32:kchan:r128[/]", *(f"{13.6421 * 10**i:,.4f}" for i in range(12)))
    return table


def test_a_table_too_wide_is_split_by_columns_each_part_naming_the_row():
    from kvcache_cli.views.layout import fit, rendered

    assert "…" in rendered(_wide_table(), WIDTH)  # rich cuts it as it stands
    text = rendered(fit(_wide_table(), WIDTH), WIDTH)
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= WIDTH
    for i in range(12):
        assert f"{13.6421 * 10**i:,.4f}" in text
    assert text.count("int4:g32:kchan:r128") > 1  # the row's name in every part


def test_a_column_too_wide_even_beside_the_name_stacks_the_table_one_record_a_row():
    from rich.table import Table

    from kvcache_cli.views.layout import fit, rendered

    table = Table("cache", "figure")
    table.add_row("[bold]int4[/]", "9" * 60 + ".5")
    text = rendered(fit(table, 50), 50)
    assert "[bold]" not in text and "int4" in text  # markup read, not printed
    assert "9" * 30 in text.replace("\n", "") and "…" not in text


def test_a_plain_text_table_too_wide_is_split_into_blocks_that_fit():
    from kvcache_cli.views.layout import text_table

    rows = [("cache", *(f"figure {i}" for i in range(12))),
            ("int4", *(f"{13.6421 * 10**i:,.4f}" for i in range(12)))]
    lines = text_table(rows, WIDTH)
    assert max(len(line) for line in lines) <= WIDTH
    assert sum(line.startswith("int4") for line in lines) > 1
    for i in range(12):
        assert any(f"{13.6421 * 10**i:,.4f}" in line for line in lines)


def test_a_formula_breaks_only_before_an_operator_and_reads_the_same():
    from kvcache_cli.views.layout import Formula

    line = "  bytes = layers × (kv_lora_rank + qk_rope_head_dim) × seq_len × dtype_bytes"
    for width in range(20, len(line) + 2):
        pieces = Formula.broken(line, width)
        assert " ".join(p.strip() for p in pieces) == line.strip(), (width, pieces)
        assert all(p.lstrip().startswith(("×", "+")) for p in pieces[1:]), pieces


@pytest.mark.parametrize("columns, width", [("80", 80), ("200", 200), ("5", 50), ("0", 50),
                                            ("²", 100), ("٨٠", 100), ("wide", 100)])
def test_every_console_is_columns_wide_and_a_bad_columns_is_no_traceback(columns, width):
    # Off a terminal: COLUMNS where it is ASCII digits (at least 50), else 100.
    result = CliRunner().invoke(app, ["models"], env={"COLUMNS": columns})
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.stdout.splitlines()) <= width
