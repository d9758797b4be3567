"""Every comma-separated option refuses an empty item (two commas together, or one at an
end) in one line naming the option and its value, exit 2, before a model is looked for:
a slip is shown, never an item dropped in silence."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvcache_cli.cli import app
from kvcache_cli.cli.options import comma_items

# A model that does not exist: the refusal must come first, so the path is never read.
MISSING = "/nonexistent/kvcache-model"


@pytest.mark.parametrize("command, option, value, extra", [
    ("generate", "--ids", "1,2,,3", []),
    ("bench", "--modes", "static,,concat", []),
    ("bench", "--modes", ",static", []),
    ("bench", "--cache", "fp16,,int8:g16", []),
    ("bench", "--cache", "int8,", []),
    ("bench", "--speculate", "1,,2", ["--draft", "lookup"]),
    ("bench", "--context", "8,,16", []),
    ("bench", "--tasks", "copy,,other", []),
    ("bench", "--draft", "lookup,,lookup:2", ["--tasks", "copy"]),
    ("eval", "--cache", "static,,int8:g16", []),
    ("compress", "--cache", "snapkv:0.25,,knorm:0.25", ["a prompt"]),
    ("serve", "--engines", "paged,,sequential", []),
    ("serve", "--batch", "1,,4", []),
    ("serve", "--rate", "1,,2", []),
    ("serve", "--goodput", "ttft:500,,tpot:50", []),
    ("serve", "--policy", "decode-first,", []),
    ("serve", "--token-budget", "64,,256", []),
    ("serve", "--kv-dtype", "int8,,int4", []),
    ("serve", "--keep-windows", "0, ,64", []),
])
def test_an_empty_item_is_refused_in_one_line_naming_the_option_and_value(
        command, option, value, extra, no_model_loads):
    result = CliRunner().invoke(app, [command, *extra, option, value, "-m", MISSING],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert result.stdout == "", result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {option} {value!r}: an empty item; expected "
                               "comma-separated "), lines[0]
    assert "no such file" not in lines[0]  # refused before the model is looked for


def test_items_are_stripped_and_kept_in_order_when_none_is_empty():
    assert comma_items(" static, int8 ,window:256", "--cache", "specs") == [
        "static", "int8", "window:256"]


@pytest.mark.parametrize("text", ["a,,b", ",a", "a,", "a, ,b"])
def test_comma_items_names_the_option_and_text_of_an_empty_item(text):
    with pytest.raises(ValueError, match=r"^--x '.*': an empty item; expected x, y$"):
        comma_items(text, "--x", "x, y")


@pytest.mark.parametrize("text", ["", ",", " , "])
def test_a_list_of_no_items_is_left_to_the_options_own_refusal(text):
    # Each option already refuses an empty list, saying what it needs at least.
    assert comma_items(text, "--x", "x, y") == []


@pytest.mark.parametrize("args, said", [
    (["generate", "--ids", ",", "-m", MISSING], "at least one"),
    # These refuse an empty list after the model's config is read: a real one, not loaded.
    (["bench", "--modes", ",", "-m", "stdlib-bytes"], "no modes given"),
    (["serve", "--engines", ",", "-m", "stdlib-bytes"], "--engines: no engines"),
])
def test_an_option_given_only_commas_keeps_its_own_refusal(args, said, no_model_loads):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert said in result.stderr and "empty item" not in result.stderr, result.stderr


def test_a_well_formed_list_reaches_the_model_check():
    # The same option without the empty item passes the list check: the missing model is
    # what is refused next, so the check refuses only the empty item.
    result = CliRunner().invoke(app, ["serve", "--engines", "paged,sequential", "-m", MISSING])
    assert result.exit_code == 2, result.output
    assert "no such file" in result.stderr and "empty item" not in result.stderr
