"""How a command refuses: the one error line (`fail`), click's usage errors in the same
words, and the note that a refused option was the default, not typed.

Imported by every command and by `kvcache --help`'s error path: no torch, nothing heavy.
"""

from __future__ import annotations

import re
from typing import NoReturn

import typer


def fail(message: str, code: int = 2) -> NoReturn:
    """The one way a command reports an error: one line on stderr, then exit.

    Code 2 is bad input (the user can fix the command line); 1 is a failure at
    run time.
    """
    # One line, whatever it quotes: a file's name or a model's text may hold a newline or
    # a terminal's escape codes, shown escaped.
    typer.echo(on_stderr(f"error: {_escaped(message)}"), err=True)
    raise typer.Exit(code)


def print_note(message: str) -> None:
    """A note on stderr (a fallback, a choice made for the user): one line, as `fail`'s."""
    typer.echo(on_stderr(f"note: {_escaped(message)}"), err=True)


def _escaped(message: str) -> str:
    return "".join(repr(c)[1:-1] if ord(c) < 32 or 127 <= ord(c) < 160 or c in "\u2028\u2029"
                   else c for c in message)


def on_stderr(line: str) -> str:
    """LINE as stderr shows it: in a terminal, wrapped between words at the width every
    view is laid out at (`output.columns`), the rest indented; off one (a log, a pipe, a
    test) one line, so a program or grep reads it whole."""
    import sys
    import textwrap

    try:
        terminal = sys.stderr.isatty()
    except (AttributeError, ValueError):
        terminal = False
    if not terminal:
        return line
    from kvcache_cli.cli.output import columns

    return "\n".join(textwrap.wrap(line, columns(sys.stderr), subsequent_indent="  ",
                                   break_long_words=False, break_on_hyphens=False))


# Click's own messages for a value it refuses, and the project's line for each: the option,
# the value as typed, what was expected. Matched by text, as click keeps no value on the error;
# compiled only when an error is shown (re caches them), never at start-up.
_CLICK_MESSAGES = (
    (r"'(?P<v>.*)' is not one of (?P<c>.*)\.$", "choice"),
    (r"'(?P<v>.*)' is not a valid (int|integer)( range)?\.$", "a whole number"),
    (r"'(?P<v>.*)' is not a valid float( range)?\.$", "a number"),
    (r"'(?P<v>.*)' is not a valid boolean\.$", "true or false"),
    (r"(?P<v>.*) is not in the range (?P<r>.*)\.$", "range"),
)


def _range_words(bounds: str) -> str:
    """click's 'x>=1', '0<=x<=9', 'x>0' → '1 or more', 'from 0 to 9', 'more than 0'."""
    m = re.fullmatch(r"(?:(?P<lo>[-\d.]+)(?P<lop><=?))?x(?:(?P<hip><=?)(?P<hi>[-\d.]+))?"
                     r"|x(?P<gop>>=?)(?P<g>[-\d.]+)", bounds)
    if m is None:
        return bounds
    if m["g"] is not None:
        return f"{_figure(m['g'])} or more" if m["gop"] == ">=" else f"more than {_figure(m['g'])}"
    if m["lo"] is not None and m["hi"] is not None:
        return f"from {_figure(m['lo'])} to {_figure(m['hi'])}"
    if m["hi"] is not None:
        return f"{_figure(m['hi'])} or less" if m["hip"] == "<=" else f"less than {m['hi']}"
    return bounds


def _figure(text: str) -> str:
    return f"{int(text):,}" if text.lstrip("-").isdigit() else text


def usage_message(error) -> str:
    """One line for a usage error click raised: `--dtype 'fp64': expected one of fp32, ...`,
    `--seq '32k': expected a whole number`, `unknown option --promt (did you mean ...)`."""
    import difflib

    message = error.message.strip()
    param = getattr(error, "param", None)
    name = type(error).__name__
    if name == "NoSuchOption":
        # click's near misses, closest first.
        close = difflib.get_close_matches(error.option_name,
                                          getattr(error, "possibilities", None) or [], cutoff=0)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        return f"unknown option {error.option_name}{hint}"
    if message.endswith("requires an argument.") and getattr(error, "option_name", None):
        return f"{error.option_name}: expected a value after it"
    extra = re.fullmatch(r"Got unexpected extra argument(?:s|\(s\))? \((?P<a>.*)\)", message)
    if extra:
        return (f"unexpected argument(s) {extra['a']!r}: expected no more arguments; "
                "quote a value that holds spaces")
    if param is None:
        return message[:1].lower() + message[1:].rstrip(".")
    opts = [o for o in getattr(param, "opts", []) if o.startswith("--")]
    opt = opts[0] if opts else param.human_readable_name
    if name == "MissingParameter":
        return f"{opt}: expected a value"
    for pattern, expected in _CLICK_MESSAGES:
        m = re.match(pattern, message)
        if m is None:
            continue
        value = m["v"]
        if expected == "choice":
            choices = [c.strip().strip("'") for c in m["c"].split(",")]
            close = difflib.get_close_matches(value.lower(), choices, n=2, cutoff=0.6)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            return f"{opt} {value!r}: expected one of {', '.join(choices)}{hint}"
        if expected == "range":
            kind = "a number" if "float" in getattr(param.type, "name", "") else "a whole number"
            words = _range_words(m["r"])
            return f"{opt} {value}: expected {kind}{'' if words[:4] == 'from' else ','} {words}"
        return f"{opt} {value!r}: expected {expected}"
    return f"{opt}: {message}"


def defaults_in(ctx, message: str) -> str:
    """MESSAGE with a note for each option it names that the user did not type: a
    refusal must not read as if the user had given the default."""
    shown = []
    for param in ctx.command.params:
        flag = next((o for o in param.opts if o.startswith("--")), None)
        # By name: click's enum is vendored by later typer releases.
        source = getattr(ctx.get_parameter_source(param.name), "name", "DEFAULT")
        if (flag and source == "DEFAULT"
                and re.search(rf"{re.escape(flag)}(?![\w-])", message)):
            shown.append(flag)
    if not shown:
        return message
    return f"{message} ({', '.join(shown)}: the default, not given)"
