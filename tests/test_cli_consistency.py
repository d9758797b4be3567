"""The command line as a new user meets it: one spelling of each option everywhere, click's
own refusals in the project's one style, units where numbers are large, suggestions for
near misses, and output off a terminal that matches the README (whole tables, no wrapped
formulas, no trailing spaces, --help summaries not cut with '...')."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvcache_cli.cli import app

runner = CliRunner()


def one_line_error(args: list[str]) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_every_model_option_is_also_spelled_m():
    command = typer.main.get_command(app)
    for name, sub in command.commands.items():
        for param in sub.params:
            if "--model" in getattr(param, "opts", []):
                assert "-m" in param.opts, f"kvcache {name} --model has no -m"
    assert {n for n, sub in command.commands.items()
            if any("--model" in getattr(p, "opts", []) for p in sub.params)} == {
        "break", "size", "bench", "serve", "generate", "eval", "compress", "caches"}


@pytest.mark.parametrize(("args", "line"), [
    (["generate", "--ids", "1", "--dtype", "fp64"],
     "error: --dtype 'fp64': expected one of fp32, bf16, fp16 (did you mean fp16?)"),
    (["size", "--layers", "x", "--kv-heads", "2"], "error: --layers 'x': expected a whole number"),
    (["generate", "--ids", "1", "-n", "0"], "error: --max-new-tokens 0: expected a whole number, "
                                            "1 or more"),
    (["generate", "--ids", "1", "--temperature", "abc"],
     "error: --temperature 'abc': expected a number"),
    (["generate", "--ids", "1", "--device", "gpu"],
     "error: --device 'gpu': expected one of cpu, cuda"),
    (["bench", "--modez", "x"], "error: unknown option --modez (did you mean --modes"),
    (["size", "--layers"], "error: --layers: expected a value after it"),
    (["generate", "The", "KV", "cache"], "error: unexpected argument(s) 'KV cache'"),
])
def test_clicks_refusals_read_as_the_projects_one_line(args, line):
    message = one_line_error(args)
    assert message.startswith(line), message
    assert "Invalid value" not in message and "is not a valid" not in message


@pytest.mark.parametrize(("seq", "tokens"), [("32k", 32_768), ("32K", 32_768), ("1M", 2**20),
                                             ("32_768", 32_768), ("4096", 4096)])
def test_seq_takes_units_as_gpu_mem_does(seq, tokens):
    result = runner.invoke(app, ["size", "--layers", "2", "--kv-heads", "2", "--seq", seq,
                                 "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["seq"] == tokens


@pytest.mark.parametrize(("seq", "line"), [
    ("32q", "error: --seq '32q': expected a whole number of tokens such as 4096, 32k"),
    ("0", "error: --seq 0: expected a whole number from 1 to"),
    ("9" * 5000, "expected a whole number from 1 to 1,000,000,000,000"),
])
def test_seq_refuses_what_is_no_token_count(seq, line):
    assert line in one_line_error(["size", "--layers", "2", "--kv-heads", "2", "--seq", seq])


@pytest.mark.parametrize(("args", "line"), [
    (["demo", "MASK"], "error: unknown demo 'MASK': expected all or one of macs, exact, mask, "),
    (["break", "no_mask"], "(did you mean no-mask"),
])
def test_demo_and_break_names_suggest_the_close_ones(args, line):
    message = one_line_error(args)
    assert line in message and "mask" in message.split("did you mean")[-1], message


def test_size_model_takes_a_folder_or_a_config_file(tmp_path):
    config = {"model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 8,
              "num_key_value_heads": 2, "hidden_size": 512, "max_position_embeddings": 2048}
    (tmp_path / "config.json").write_text(json.dumps(config))
    by_config = runner.invoke(app, ["size", "--config", str(tmp_path), "--json"])
    for spelling in (str(tmp_path), str(tmp_path / "config.json")):
        by_model = runner.invoke(app, ["size", "-m", spelling, "--json"])
        assert by_model.exit_code == 0, by_model.output
        assert json.loads(by_model.stdout)["total_bytes"] == json.loads(by_config.stdout)[
            "total_bytes"] == 4 * 2 * 2 * 64 * 2048 * 2


def test_size_model_folder_that_does_not_exist_is_one_line():
    assert "not found" in one_line_error(["size", "-m", "./no-such-folder"])


def test_help_summaries_are_whole_sentences():
    result = runner.invoke(app, ["--help"], env={"COLUMNS": "80"})
    commands = result.stdout.split("Commands:")[1].strip().splitlines()
    assert len(commands) >= 8
    for line in commands:
        assert not line.rstrip().endswith("..."), line


@pytest.mark.parametrize("args", [["models"], ["size", "-m", "deepseek-v3"], ["demo", "memory"]])
def test_off_a_terminal_views_are_whole_and_end_no_line_in_spaces(args):
    # No COLUMNS, no terminal: a file or a pipe, as a user saving the output has.
    result = runner.invoke(app, args, env={"COLUMNS": None})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert all(line == line.rstrip() for line in lines)
    assert "…" not in result.stdout  # no header or cell cut short


def test_off_a_terminal_the_models_table_keeps_one_row_per_preset():
    from kvcache_cli.sizing import PRESETS

    result = runner.invoke(app, ["models"], env={"COLUMNS": None})
    rows = [line for line in result.stdout.splitlines() if re.match(r"^ [a-z]", line)]
    assert [row.split()[0] for row in rows[1:]] == list(PRESETS)  # rows[0]: the headings
    assert "attention" in rows[0] and "KV / token" in rows[0]


def test_a_formula_too_long_for_the_width_breaks_only_before_an_operator(tmp_path):
    cfg = {"model_type": "deepseek_v32", "num_hidden_layers": 4, "num_attention_heads": 8,
           "hidden_size": 512, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
           "qk_nope_head_dim": 128, "v_head_dim": 128, "index_head_dim": 128,
           "max_position_embeddings": 4096}
    path = Path(tmp_path) / "config.json"
    path.write_text(json.dumps(cfg))
    whole = ("bytes = layers × (kv_lora_rank + qk_rope_head_dim + index_head_dim) × seq_len × "
             "dtype_bytes × batch")
    for columns in ("100", "80", "50"):
        result = runner.invoke(app, ["size", "--config", str(path)], env={"COLUMNS": columns})
        assert result.exit_code == 0, result.output
        lines = result.stdout.splitlines()
        first = next(i for i, line in enumerate(lines) if "bytes = layers" in line)
        pieces = lines[first:first + 1 + sum(
            1 for line in lines[first + 1:first + 6] if line.lstrip().startswith(("×", "+")))]
        assert all(len(line) <= int(columns) for line in pieces), pieces
        assert " ".join(p.strip() for p in pieces) == whole, pieces


def test_break_help_names_every_break_the_registry_lists():
    from kvcache_cli.breaks.registry import registry

    result = CliRunner().invoke(app, ["break", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    # click wraps the paragraph, breaking after a hyphen: join those back
    text = re.sub(r"-\s+", "-", " ".join(result.output.split()))
    missing = [name for name in registry() if name not in text]
    assert not missing, f"break --help does not name {missing}"
