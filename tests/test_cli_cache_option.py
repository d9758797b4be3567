"""`--cache SPEC`: parsed once by caches.spec as the option is read, completed from the
registry, refused in one line; `kvcache caches` lists the registry; `generate --cache`
runs any kind and picks the same greedy tokens as --mode static."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvcache_cli.caches.spec import KINDS
from kvcache_cli.cli import app
from kvcache_cli.cli.options import complete_cache, parse_cache_option

runner = CliRunner()


def test_cache_option_parses_through_the_registry():
    spec = parse_cache_option("paged:b32")
    assert (spec.kind, spec["block_size"], str(spec)) == ("paged", 32, "paged:b32")
    assert parse_cache_option("full").kind == "static"  # an alias


def test_caches_shows_the_kinds_asked_for_by_any_spelling_and_names_the_peers():
    asked = runner.invoke(app, ["caches", "full", "int4:g64", "--json"])
    assert asked.exit_code == 0, asked.output
    assert [r["name"] for r in json.loads(asked.stdout)] == ["static", "int4"]
    shown = runner.invoke(app, ["caches", "window"], env={"COLUMNS": "100"})
    assert shown.exit_code == 0 and "window:W" in shown.stdout and "sink:" not in shown.stdout
    # the peers eval --cache accepts, which are no kind of ours
    assert "llama.cpp:TYPE" in shown.stdout and "transformers:KIND" in shown.stdout
    bad = runner.invoke(app, ["caches", "bogus"])
    assert bad.exit_code == 2 and bad.stderr.startswith("error: unknown cache kind 'bogus'")


def test_completion_offers_every_kind_with_its_summary():
    assert [name for name, _ in complete_cache("")] == list(KINDS)
    offered = complete_cache("pa")
    assert offered[0] == ("paged", KINDS["paged"].summary)
    assert [name for name, _ in offered] == [name for name in KINDS if name.startswith("pa")]
    assert complete_cache("wi") == [("window", KINDS["window"].summary)]


def test_caches_lists_every_registered_kind():
    result = runner.invoke(app, ["caches", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [r["name"] for r in rows] == list(KINDS)
    assert all(r["summary"] == KINDS[r["name"]].summary for r in rows)
    table = runner.invoke(app, ["caches"])
    # Each spelling whole; a kind's defaults, when its grammar names them, on the next line.
    assert table.exit_code == 0 and all(k.grammar.split(" (default")[0] in table.stdout
                                        for k in KINDS.values())


@pytest.mark.parametrize(("spec", "words"), [
    ("statc", f"--cache: unknown cache 'statc': expected one of {', '.join(KINDS)} "
              "(did you mean static?)"),
    ("window:0", "--cache: cache spec 'window:0': window '0' is not a whole number from 1"),
    ("sink:8+4", "more sinks (8) than window slots (4)"),
    ("paged:x", "--cache: cache spec 'paged:x': unknown field 'x'"),
    ("static:3", "static takes no fields"),
])
def test_a_bad_cache_spec_is_one_line_before_any_model(spec, words):
    # /nonexistent: the spec must be refused before a model is looked for.
    result = runner.invoke(app, ["generate", "--ids", "1,2", "--cache", spec,
                                 "--model", "/nonexistent"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --cache: "), result.stderr
    assert words in lines[0], lines[0]
    assert result.stdout == ""


def test_mode_and_cache_together_are_refused():
    result = runner.invoke(app, ["generate", "--ids", "1", "--mode", "concat", "--cache",
                                 "static", "--model", "/nonexistent"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: --mode concat and --cache static both choose")


def test_generate_with_a_cache_spec_picks_the_static_tokens(tmp_path):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=64,
                                     vocab_size=256, initializer_range=0.3,
                                     bos_token_id=None, eos_token_id=None)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    runs = {}
    for args in (["--mode", "static"], ["--cache", "paged:b4"], ["--cache", "concat"]):
        result = runner.invoke(app, ["generate", "--ids", "17,200,3", "-n", "12", "--json",
                                     "-m", str(tmp_path), *args])
        assert result.exit_code == 0, result.output
        runs[args[1]] = json.loads(result.stdout)
    assert runs["paged:b4"]["mode"] == "paged:b4"
    assert len(set(runs["static"]["tokens"])) > 1  # varied, so agreeing means something
    assert runs["paged:b4"]["tokens"] == runs["static"]["tokens"] == runs["concat"]["tokens"]
