"""Hostile input by class, generated: every number inside a spec or an option string, every
int and float option of every command, every cache kind's numeric fields, every count and
rate of a run. Each class is drawn from the registry or the command line itself (the kinds'
grammars, the commands' own options), so an option or a kind added later is tried too.

Each case must end in one line naming the user's text, exit 2, nothing on stdout, no
traceback, and quickly: every refusal here comes before a model loads.
"""

from __future__ import annotations

import re
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvcache_cli import numbers
from kvcache_cli.caches.grammar import CacheSpecError
from kvcache_cli.caches.spec import KINDS, parse_cache_spec
from kvcache_cli.cli import COMMANDS, app

runner = CliRunner()
FAST = settings(max_examples=15, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])

# Digits that str.isdigit or int() take but a command line should not: other scripts'
# (Arabic-Indic, Devanagari, fullwidth, ...), superscripts and circled digits.
FOREIGN_DIGITS = st.characters(categories=["Nd", "No"]).filter(
    lambda c: c not in string.digits)
# What no range allows: text with a foreign digit, past the int-string limit, negative,
# a fraction, empty, a word.
HOSTILE = st.one_of(
    st.builds(lambda a, d, b: a + d + b, st.text(string.digits, max_size=3), FOREIGN_DIGITS,
              st.text(string.digits, max_size=3)),
    st.integers(41, 6000).map(lambda n: "9" * n),
    st.integers(1, 10**6).map(lambda n: f"-{n}"),
    st.sampled_from(["", "1.5", "1e3", "nan", "inf", "0x10", "ten", "1 2"]),
)


def one_line_refusal(args: list[str]) -> str:
    """The one line a refused command prints, after checking the rest of the contract."""
    result = runner.invoke(app, args, env={"COLUMNS": "80"})
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        args, repr(result.exception))
    assert result.exit_code == 2, (args, result.output)
    assert result.stdout == "", (args, result.stdout)  # nothing half-written
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (args, result.stderr)
    return lines[0]


# --- the one reader --------------------------------------------------------------------


@given(st.integers(0, 10**12))
def test_an_ascii_whole_number_in_range_reads_as_itself(n):
    assert numbers.whole(str(n), "x", 0, 10**12) == n


@given(HOSTILE)
def test_text_no_range_allows_is_refused_naming_the_text_and_the_range(text):
    with pytest.raises(numbers.NumberError) as err:
        numbers.whole(text, "block size", 1, 4096)
    assert f"block size {text!r} is not a whole number from 1 to 4,096" == str(err.value)


def test_a_range_with_no_value_says_so_rather_than_from_1_to_0():
    with pytest.raises(numbers.NumberError, match="no value fits"):
        numbers.whole("1", "layers", 1, 0)


# --- every numeric field of every cache kind -------------------------------------------

# A value each placeholder of a grammar parses with, when another is the one tried.
FILL = {"N": "16", "W": "252", "S": "4", "H": "128", "B": "256"}


def numeric_fields(kind) -> list[str]:
    """'sink:S+W[:kN]' -> ['sink:{}+252', 'sink:4+{}', 'sink:4+252:k{}']: each numeric
    placeholder of the kind's grammar in turn, the others filled in."""
    grammar = kind.grammar.split(" (")[0]
    templates = []
    for i, m in enumerate(re.finditer(r"[NWSHB]\b", grammar)):
        text = grammar[:m.start()] + "\0" + grammar[m.end():]
        # Keep the optional group holding the placeholder tried; drop the others.
        text = re.sub(r"\[([^\]]*)\]", lambda g: g[1] if "\0" in g[1] else "", text)
        text = re.sub(r"[NWSHB]\b", lambda p: FILL[p[0]], text).replace("\0", "{}")
        templates.append(text)
        assert i < 8
    return templates


TEMPLATES = [t for kind in KINDS.values() for t in numeric_fields(kind)]


def test_the_generated_templates_cover_every_kind_with_a_number():
    assert {"paged:b{}", "int4:g{}", "int4:r{}", "int4:s{}", "quanto-int2:r{}", "window:{}",
            "window:252:k{}", "sink:{}+252", "sink:4+252:k{}", "h2o:128+{}"} <= set(TEMPLATES)


@pytest.mark.parametrize("template", TEMPLATES)
@FAST
@given(value=HOSTILE)
def test_a_hostile_number_in_any_spec_field_is_one_cache_spec_error(template, value):
    text = template.format(value)
    with pytest.raises(CacheSpecError) as err:
        parse_cache_spec(text)
    message = str(err.value)
    assert "\n" not in message and repr(text.strip()) in message, message


@pytest.mark.parametrize("template", TEMPLATES)
def test_every_spec_field_given_twice_is_refused(template):
    spec = template.format("8")
    field = spec.rsplit(":", 1)[-1]
    if not re.fullmatch(r"[a-z]\d+", field):  # 'window:{}', 'sink:4+{}': no letter to repeat
        return
    with pytest.raises(CacheSpecError, match="given twice"):
        parse_cache_spec(f"{spec}:{field}")


# --- every int and float option of every command ---------------------------------------


def number_options() -> list[tuple[str, str, str]]:
    """(command, option, 'integer' or 'float') for every number option of every command."""
    import typer

    group = typer.main.get_command(app)
    found = []
    for name in COMMANDS:
        for param in group.commands[name].params:
            classes = {c.__name__ for c in type(param.type).__mro__}
            kind = ("integer" if "IntParamType" in classes
                    else "float" if "FloatParamType" in classes else None)
            if kind and param.opts[0].startswith("--"):
                found.append((name, param.opts[0], kind))
    return found


OPTIONS = number_options()


def test_the_options_found_include_the_newer_ones():
    assert {("serve", "--requests", "integer"), ("bench", "--repeats", "integer"),
            ("eval", "--tokens", "integer"), ("serve", "--burstiness", "float")} <= set(OPTIONS)


@pytest.mark.parametrize(("command", "option", "kind"), OPTIONS)
@FAST
@given(value=st.one_of(
    st.builds(lambda a, d: a + d, st.text(string.digits, max_size=3), FOREIGN_DIGITS),
    st.integers(5000, 6000).map(lambda n: "1" * n)))
def test_a_number_option_refuses_foreign_digits_and_endless_digits_in_one_line(
        command, option, kind, value):
    line = one_line_refusal([command, option, value])
    assert line.startswith(f"error: {option} "), line
    assert "set_int_max_str_digits" not in line and "Exceeds the limit" not in line


# --- numbers inside option strings -----------------------------------------------------


def _serve(*args: str) -> list[str]:
    return ["serve", "-m", "stdlib-bytes", *args]


# Each option that holds numbers in its text, with where the hostile number goes.
STRING_OPTIONS = [
    (_serve("--prompt-len", "{}"), "--prompt-len"),
    (_serve("--prompt-len", "4:{}"), "--prompt-len"),
    (_serve("--output-len", "{}:64"), "--output-len"),
    (_serve("--rate", "1,{}"), "--rate"),
    (_serve("--token-budget", "{}"), "--token-budget"),
    (_serve("--batch", "1,{}"), "--batch"),
    (_serve("--goodput", "ttft:{}"), "--goodput"),
    (_serve("--kv-mem", "{}MiB"), "--kv-mem"),
    (["size", "--model", "gpt2", "--seq", "{}"], "--seq"),
    (["size", "--model", "gpt2", "--seq", "8", "--cache", "paged:b{}"], "paged:b"),
    (["bench", "-m", "stdlib-bytes", "--draft", "lookup", "--speculate", "{}"], "--speculate"),
    (["bench", "-m", "stdlib-bytes", "--modes", "window:{}"], "window:"),
    (["bench", "-m", "stdlib-bytes", "--cache", "int4:g{}"], "int4:g"),
    (["generate", "-m", "stdlib-bytes", "--draft", "layers:{}", "hi"], "layers:"),
    (["generate", "-m", "stdlib-bytes", "--draft", "lookup:{}", "hi"], "lookup:"),
    (["generate", "-m", "stdlib-bytes", "--cache", "window:{}", "hi"], "window:"),
    (["eval", "-m", "stdlib-bytes", "--cache", "static,sink:4+{}"], "sink:4+"),
    (["eval", "-m", "stdlib-bytes", "--task", "retrieval", "--lengths", "64,{}"], "--lengths"),
]


@pytest.mark.parametrize(("template", "named"), STRING_OPTIONS)
@settings(max_examples=12, deadline=None)
# '1.5', '1e3' and 'inf' are rates, sizes or targets some of these options accept.
@given(value=HOSTILE.filter(lambda v: v.strip() and v not in ("1.5", "1e3", "inf")))
def test_a_hostile_number_inside_an_option_string_is_one_line_naming_it(template, named, value):
    args = [part.replace("{}", value) for part in template]
    line = one_line_refusal(args)
    assert named in line, line


# --- every run has an end --------------------------------------------------------------


@pytest.mark.parametrize(("args", "bound"), [
    (_serve("--requests", "100001"), "from 1 to 100,000"),
    (_serve("--rate", "0.0001"), "within 3,600 s"),
    (_serve("--rate", "1e-300"), "within 3,600 s"),
    (_serve("--rate", "2e9"), "at most 1,000,000,000"),
    (_serve("--batch", "1,5000"), "from 1 to 4,096"),
    (_serve("--token-budget", "9999999"), "to 1,048,576"),
    (_serve("--goodput", "ttft:1e12"), "at most 86,400,000"),
    (_serve("--kv-mem", "1PiB"), "of memory: expected at most that"),
    # Checked before any engine runs, in the project's words rather than transformers'.
    (_serve("--block-size", "2", "--token-budget", "64"), "pages at least 4 tokens a block"),
    (_serve("--block-size", "100000"), "from 1 to 2,048 (the context window)"),
    (["break", "--max-new-tokens", "99999999"], "from 1 to 1,015"),
    (["bench", "-m", "stdlib-bytes", "--repeats", "1001"], "from 1 to 1,000"),
    (["bench", "-m", "stdlib-bytes", "--draft", "lookup", "--repeats", "10000"],
     "from 1 to 1,000"),
    (["eval", "-m", "stdlib-bytes", "--prompt-len", "5000"], "from 1 to 2,047"),
])
def test_a_count_or_rate_no_run_could_finish_is_refused_with_its_bound(args, bound):
    line = one_line_refusal(args)
    assert bound in line, line


@FAST
@given(requests=st.integers(1, 1000), rate=st.floats(1e-300, 1e9))
def test_every_accepted_rate_has_its_arrivals_within_the_bound(requests, rate):
    from kvcache_cli.serving import workload

    spec = workload.WorkloadSpec(requests, (4, 8), (4, 8), 0, rate, 0)
    try:
        workload.check_spec(spec, 1024)
    except ValueError as err:
        assert str(err).startswith(f"--rate {rate:g}: "), err
        return
    assert requests / rate <= workload.MAX_ARRIVAL_SPAN_S


# --- names in any case ------------------------------------------------------------------


@pytest.mark.parametrize("args", [
    ["size", "--model", "gpt2", "--seq", "8", "--dtype", "FP16"],
    ["size", "--model", "gpt2", "--seq", "8", "--cache", "WINDOW:4"],
])
def test_names_are_read_in_any_case(args):
    result = runner.invoke(app, args, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output


def test_serve_and_bench_name_lists_are_read_in_any_case():
    from kvcache_cli.bench.modes import parse_modes
    from kvcache_cli.serving.plan import parse_engines
    from kvcache_cli.serving.scheduler import parse_policy

    assert parse_modes("NAIVE,Static") == ("naive", "static")
    assert parse_engines("Sequential,PAGED") == ("sequential", "paged")
    assert parse_policy("Decode-First") == ("decode-first",)


@pytest.mark.parametrize("argv", [["--bogus"], ["--demo"], ["--break"], ["stray"]])
def test_the_reference_script_refuses_bad_arguments_in_one_line(argv, capsys):
    import kv_cache_from_scratch as ref

    with pytest.raises(SystemExit) as exited:
        ref.main(argv)
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
