"""`kvcache eval --replot`: a saved --json checked whole when it is read. A damaged file, one
that is not JSON, or an option --replot would ignore is one line naming the value and what
was expected, exit 2, before anything is drawn; a sound one reads back as the result it was."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from kvcache_cli.cli import app
from kvcache_cli.eval.quality import CacheQuality, QualityResult, Refusal, result_from_json
from kvcache_cli.views import to_json

pytest.importorskip("torch")  # eval's extra; --replot itself runs no model
runner = CliRunner()
TOKENS, PROMPT = 12, 4  # 8 scored tokens


def _row(cache: str, kl: float, **rest) -> CacheQuality:
    return CacheQuality(
        cache=cache, reference=cache == "static", perplexity=3.0 + kl, bits_per_token=1.6,
        perplexity_change=kl, kl_mean=kl, kl_max=2 * kl, kl_max_position=PROMPT + 1,
        top1_agreement=1.0 - kl, bytes_held=4_096, positions=TOKENS - 1,
        bytes_per_token=4_096 / (TOKENS - 1), bytes_ratio=1.0 - kl, prefill_ms=1.5,
        compress_ms=0.0, decode_ms_per_token=0.25,
        loss_by_position=tuple(1.0 + kl + i / 10 for i in range(TOKENS - PROMPT)), **rest)


RESULT = QualityResult(
    model="tiny", weights_note=None, text="t.txt (bytes)", tokens=TOKENS, prompt_len=PROMPT,
    chunk=1, device="cpu", dtype="float32", threads=1, torch_version="2", machine="x86_64",
    reference="static",
    caches=(_row("static", 0.0), _row("int8", 0.01, bytes_by_kind={"full": 2_048})),
    first_token_share=(0.5, 0.25), uniform_share=0.1,
    refused=(Refusal("transformers:quanto-int4", "transformers", "no"),))


def saved() -> dict:
    """RESULT as `kvcache eval --json` prints it, read back by json."""
    return json.loads(to_json(RESULT))


def replot(tmp_path, data, *options: str):
    path = tmp_path / "saved.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return runner.invoke(app, ["eval", "--replot", str(path), "--plot",
                               str(tmp_path / "out.png"), *options], env={"COLUMNS": "100"})


def assert_refused(result, tmp_path, said: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert result.stdout == ""
    line, = result.stderr.strip().splitlines()
    assert line.startswith("error: --"), line
    assert said in line and "expected" in line, line
    assert not (tmp_path / "out.png").exists()  # nothing drawn


def test_a_saved_result_reads_back_as_the_result_it_was():
    assert result_from_json(saved()) == RESULT


def test_a_row_with_no_time_reads_back_with_nan_there():
    data = saved()
    data["caches"][1]["prefill_ms"] = data["caches"][1]["decode_ms_per_token"] = None
    row = result_from_json(data).caches[1]
    assert math.isnan(row.prefill_ms) and math.isnan(row.decode_ms_per_token)


def test_a_sound_saved_run_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    result = replot(tmp_path, saved())
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"plot written to {tmp_path / 'out.png'}")
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _set(path: tuple, value):
    def change(data):
        *inner, last = path
        for key in inner:
            data = data[key]
        data[last] = value
    return change


@pytest.mark.parametrize(("change", "said"), [
    (_set(("caches", 0), 5), "(caches[0] is 5: expected an object, a cache's row)"),
    (_set(("prompt_len",), "x"), "(prompt_len is 'x': expected a whole number"),
    (_set(("tokens",), 10**400), "tokens is a whole number of some 400 digits: expected"),
    (_set(("caches", 1, "kl_mean"), math.nan), "caches[1].kl_mean is nan: expected a finite"),
    (_set(("caches", 1, "kl_mean"), None), "caches[1].kl_mean is null: expected a finite"),
    (_set(("caches", 0, "perplexity"), math.inf), "caches[0].perplexity is inf: expected"),
    (_set(("caches", 1, "prefill_ms"), math.inf),
     "caches[1].prefill_ms is inf: expected a finite number or null"),
    (_set(("caches", 1, "loss_by_position"), []),
     "caches[1].loss_by_position has 0 values: expected 8 (tokens - prompt_len)"),
    (_set(("caches", 0, "loss_by_position"), [1.0] * 9),
     "caches[0].loss_by_position has 9 values: expected 8"),
    (_set(("caches", 1, "loss_by_position", 3), "a"),
     "caches[1].loss_by_position[3] is 'a': expected a finite number"),
    (_set(("caches", 1, "reference"), "yes"), "caches[1].reference is 'yes': expected true"),
    (_set(("caches", 1, "against"), "nope"),
     "caches[1].against is 'nope': expected the name of a cache in the file"),
    (_set(("caches", 1, "bytes_by_kind"), {"full": 1.5}),
     "caches[1].bytes_by_kind['full'] is 1.5: expected a whole number"),
    (_set(("caches", 1, "unknown"), 1), "caches[1] has 'unknown': expected only the fields"),
    (lambda data: data["caches"][1].pop("kl_max"), "caches[1] has no 'kl_max': expected"),
    (_set(("caches",), []), "caches is []: expected a row per cache"),
    (_set(("prompt_len",), TOKENS), "prompt_len is 12 of 12 tokens: expected at least 1"),
    (_set(("first_token_share",), "abc"), "first_token_share is 'abc': expected a list"),
    (_set(("refused", 0), 5), "refused[0] is 5: expected an object, a refusal"),
    (_set(("weights_note",), 3), "weights_note is 3: expected a string or null"),
])
def test_a_damaged_saved_run_is_one_line_naming_the_value_exit_2(tmp_path, change, said):
    data = saved()
    change(data)
    result = replot(tmp_path, data)
    assert_refused(result, tmp_path, said)
    assert "not the --json of a kvcache eval text run" in result.stderr


@pytest.mark.parametrize(("content", "said"), [
    ("hello", "not a JSON file (Expecting value: line 1 column 1 (char 0)); expected a saved "
              "kvcache eval --json"),
    ("[" * 100_000, "not a JSON file (maximum recursion depth exceeded"),
    ("[1, 2]", "(the file is [1, 2]: expected an object, a kvcache eval result)"),
])
def test_a_file_that_is_not_a_saved_run_is_one_line_exit_2(tmp_path, content, said):
    assert_refused(replot(tmp_path, content), tmp_path, said)


@pytest.mark.parametrize(("options", "named"), [
    (["--cache", "int4"], "--cache applies"),
    (["-m", "gpt2", "--json"], "--model, --json apply"),
    (["--tokens", "5", "--device", "cpu"], "--tokens, --device apply"),
])
def test_an_option_replot_would_ignore_is_refused_in_one_line(tmp_path, options, named):
    assert_refused(replot(tmp_path, saved(), *options), tmp_path,
                   f"error: {named} to a run, not to --replot")
