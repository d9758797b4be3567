"""The one reader of numbers a user types inside an option's text: cache specs, drafts,
--speculate's K, serve's workload, rates, budgets and batch sizes, sizing's token counts,
and (through `cli`'s option types) every int and float option.

Python's own readers are too lenient for a command line: `int` and `float` take the digits
of every script ('١٢' is 12, '１６' is 16), `str.isdigit` passes superscripts that `int`
then refuses ('²'), and `int` of more than 4,300 digits raises with advice about
`sys.set_int_max_str_digits`. Here a number is ASCII digits (an underscore between two, as
Python writes 1_000), its length is bounded before it is converted, and every value has a
range, so a refusal can say what was typed and what was expected, in one line.
"""

from __future__ import annotations

import math
import re

# ASCII only: [0-9], never \d (which matches every script's digits).
_WHOLE = re.compile(r"[0-9]+(?:_[0-9]+)*")
_DECIMAL = re.compile(r"[+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]{1,4})?")
# Far past any range below, and far below the digits that make int() slow or refuse.
MAX_DIGITS = 40


class NumberError(ValueError):
    """Text that is not a number in its range; the message names the text and the range."""


def span(low: int | float, high: int | float | None) -> str:
    """'from 1 to 4,096', '1 or more': a range in the words every refusal uses."""
    if high is None:
        return f"{low:,g} or more" if isinstance(low, float) else f"{low:,} or more"
    if isinstance(low, float) or isinstance(high, float):
        return f"from {low:,g} to {high:,g}"
    return f"from {low:,} to {high:,}"


def is_whole(text: str) -> bool:
    """ASCII digits (underscores between them), short enough to convert at once."""
    return len(text) <= MAX_DIGITS and _WHOLE.fullmatch(text) is not None


def is_decimal(text: str) -> bool:
    """ASCII digits with an optional fraction and exponent, short enough to read: never
    'nan', 'inf' or another script's digits."""
    return len(text) <= MAX_DIGITS and _DECIMAL.fullmatch(text) is not None


def whole(text: str, what: str, low: int, high: int) -> int:
    """TEXT as a whole number in [LOW, HIGH], or a NumberError:
    "WHAT 'TEXT' is not a whole number from LOW to HIGH"."""
    if low > high:  # a range a caller derived from a model that allows no value
        raise NumberError(f"{what} {text!r}: no value fits (at most {high:,}, at least {low:,})")
    if not is_whole(text) or not low <= int(text) <= high:
        raise NumberError(f"{what} {text!r} is not a whole number {span(low, high)}")
    return int(text)


def decimal(text: str, what: str, low: float, high: float, *, above: bool = False) -> float:
    """TEXT as a finite number in [LOW, HIGH] ((LOW, HIGH] when ABOVE), ASCII digits with
    an optional fraction and exponent, or a NumberError naming TEXT and the range."""
    value = float(text) if is_decimal(text) else math.nan
    if not (low < value if above else low <= value) or not value <= high:
        lower = f"more than {low:,g}" if above else f"{low:,g} or more"
        raise NumberError(f"{what} {text!r} is not a number {lower} and at most {high:,g}")
    return value
