"""`kvcache demo` and `kvcache break` for the NumPy scenarios: rich, --json, --list, bad names."""

import json
import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

import kv_cache_from_scratch as ref
from kvcache_cli.breaks.registry import FAMILIES, registry
from kvcache_cli.cli import app

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args), terminal_width=120)


@pytest.mark.parametrize("name", list(ref.DEMOS))
def test_demo_renders_each_demo_with_its_title(name):
    result = invoke("demo", name)
    assert result.exit_code == 0, result.output
    assert ref.DEMOS[name].title in result.output


def test_demo_macs_shows_the_spec_figures():
    out = invoke("demo", "macs").output
    assert "62,566,400" in out and "1,839,104" in out and "34.0x" in out


def test_demo_mask_shows_exact_zero_with_the_mask():
    out = invoke("demo", "mask").output
    assert "0.000e+00 ✓ exactly zero" in out
    assert "every earlier row moved" in out


def test_demo_all_renders_every_demo():
    result = invoke("demo")
    assert result.exit_code == 0, result.output
    assert all(s.title in result.output for s in ref.DEMOS.values())


def test_demo_json_is_the_result_object():
    result = invoke("demo", "memory", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["bytes_per_token"] == 524_288
    assert data["rows"][0][:2] == [1024, 0.5]


def test_demo_all_json_maps_names_to_results():
    data = json.loads(invoke("demo", "all", "--json").output)
    assert list(data) == list(ref.DEMOS)
    assert data["exact"]["same_tokens"] is True
    assert data["mask"]["masked"]["max_change"] == 0.0


def test_demo_list_names_every_demo():
    data = json.loads(invoke("demo", "--list", "--json").output)
    assert data == {n: s.title for n, s in ref.DEMOS.items()}


@pytest.mark.parametrize("command", ["demo", "break"])
def test_unknown_name_is_one_line_listing_the_valid_ones(command):
    result = invoke(command, "nope")
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "'nope'" in lines[0]
    valid = ref.DEMOS if command == "demo" else registry()
    assert all(name in lines[0] for name in valid)


@pytest.mark.parametrize("name", list(ref.BREAKS))
def test_break_renders_each_numpy_break(name):
    result = invoke("break", name)
    assert result.exit_code == 0, result.output
    assert ref.BREAKS[name].title in result.output


def test_break_overflow_json_names_position_and_window():
    data = json.loads(invoke("break", "overflow", "--json").output)
    assert data["error"] == "position 128 past context window 128"


def test_break_list_is_the_registry_toy_gpt2_and_llama():
    data = json.loads(invoke("break", "--list", "--json").output)
    assert data == {name: b.title for name, b in registry().items()}
    assert set(ref.BREAKS) < set(data)
    families = [b.family for b in registry().values()]
    assert families == sorted(families, key=FAMILIES.index)  # toy, then gpt2, then llama
    assert {"rope-decode", "kv-expand-early", "gqa-interleave", "rope-twice"} <= set(data)


def modules_after(args: list[str], listing: str) -> str:
    """Run the CLI with `args` in a fresh interpreter; print `listing` (an expression over
    sys.modules and the command table) once it has run."""
    probe = ("import sys; from kvcache_cli.cli import app, COMMANDS; "
             "from typer.testing import CliRunner; "
             f"r = CliRunner().invoke(app, {args!r}); assert r.exit_code == 0, r.output; "
             f"print({listing})")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("args", [["--help"], ["demo", "mask"], ["break", "no-mask"],
                                  ["break", "--list"]])
def test_help_demo_and_numpy_break_never_import_torch(args):
    heavy = ("sorted(m for m in sys.modules "
             "if m.split('.')[0] in ('torch', 'transformers', 'tiktoken'))")
    assert modules_after(args, heavy) == "[]"


@pytest.mark.parametrize(("args", "loaded"), [(["--help"], []), (["size", "-m", "gpt2"], ["size"]),
                                              (["demo", "mask"], ["demo"])])
def test_only_the_command_that_runs_is_imported(args, loaded):
    commands = ("sorted(n for n, c in COMMANDS.items() "
                "if 'kvcache_cli.cli.' + c.module in sys.modules)")
    assert modules_after(args, commands) == repr(loaded)


def test_help_lists_each_commands_own_line_uncut():
    from kvcache_cli.cli import COMMANDS

    listing = invoke("--help").output
    widest = max(map(len, COMMANDS))
    group = typer.main.get_command(app)
    for name, entry in COMMANDS.items():
        command = group.get_command(None, name)
        # click cuts a line at the help width less the names' column (80 columns here)
        assert command.get_short_help_str(limit=80 - 6 - widest) == entry.short_help
        assert f"  {name.ljust(widest)}  {entry.short_help}" in listing
