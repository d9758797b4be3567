"""Units and numbers: cache dtypes, byte formatting (GiB and GB), and parsing the sizes,
counts and whole numbers a user types, each refused with its range when it makes no sense."""

from __future__ import annotations

import difflib
import re
from decimal import Decimal, DecimalException


class SizingError(ValueError):
    """Bad input to the calculator: the message names the value and what was expected."""


class ConfigError(SizingError):
    """A config.json that is missing, malformed, or lacks a field the cache size needs."""


def shown(value, width: int = 40) -> str:
    """A value as a refusal quotes it: repr, cut to `width` characters (a whole number
    with thousands separators; one too long to print, by its count of digits)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value.bit_length() > 3 * width:  # str() of thousands of digits is refused
            return f"a whole number of some {int(value.bit_length() * 0.30103):,} digits"
        text = f"{value:,}"
    else:
        text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


# ---------------------------------------------------------------------------------------------
# Dtypes and units
# ---------------------------------------------------------------------------------------------

# Bits, not bytes, so int4 (two values per byte) stays an exact integer.
DTYPE_BITS: dict[str, int] = {
    "fp32": 32,
    "fp16": 16,
    "bf16": 16,
    "fp8": 8,
    "int8": 8,
    "int4": 4,
}
_DTYPE_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "float8": "fp8",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
}


def nearest(name: str, choices: list[str], n: int = 3) -> str:
    """' (did you mean a, b?)' for a mistyped name, or '' when nothing is close."""
    close = difflib.get_close_matches(name.lower(), choices, n=n, cutoff=0.5)
    return f" (did you mean {', '.join(close)}?)" if close else ""


def dtype_bits(name: str) -> int:
    """Bits per cached value for a dtype name such as 'fp16' or 'bfloat16'."""
    key = _DTYPE_ALIASES.get(name.lower(), name.lower())
    if key not in DTYPE_BITS:
        names = list(DTYPE_BITS)
        raise SizingError(
            f"unknown dtype {name!r}: expected one of {', '.join(names)}"
            + nearest(name, names + list(_DTYPE_ALIASES))
        )
    return DTYPE_BITS[key]


def canonical_dtype(name: str) -> str:
    dtype_bits(name)  # validates
    return _DTYPE_ALIASES.get(name.lower(), name.lower())


def bytes_for_values(values: int, bits: int) -> int:
    """Bytes to store `values` numbers of `bits` bits each.

    Rounded up: int4 packs two values per byte within a row, so a row with an odd count
    still occupies its last byte whole.
    """
    return -(-values * bits // 8)


_BINARY_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB")
_DECIMAL_UNITS = ("kB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB")


def _scaled(n: int, base: int, units: tuple[str, ...]) -> str:
    """`n` bytes in the largest unit that keeps the number ≥ 1, two decimals.

    Integer arithmetic throughout: a float conversion would overflow past 1.8e308 bytes, and
    the calculator accepts sizes that large.
    """
    if n < base:
        return f"{n:,} bytes"
    power = 1
    while power < len(units) and n >= base ** (power + 1):
        power += 1
    unit = base**power
    hundredths = (n * 100 + unit // 2) // unit  # rounded half up
    return f"{hundredths // 100:,}.{hundredths % 100:02d} {units[power - 1]}"


def format_gib(n: int) -> str:
    """Binary units: 4294967296 -> '4.00 GiB'."""
    return _scaled(n, 1024, _BINARY_UNITS)


def format_gb(n: int) -> str:
    """Decimal units: 4294967296 -> '4.29 GB'."""
    return _scaled(n, 1000, _DECIMAL_UNITS)


def format_bytes(n: int) -> str:
    """Both, because GiB and GB differ by 7 % and people mean either: '4.00 GiB (4.29 GB)'."""
    if n < 1000:
        return f"{n:,} bytes"
    return f"{format_gib(n)} ({format_gb(n)})"


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    **{u.lower(): 1000 ** (i + 1) for i, u in enumerate(_DECIMAL_UNITS)},
    **{u.lower(): 1024 ** (i + 1) for i, u in enumerate(_BINARY_UNITS)},
}
_SIZE_RE = re.compile(r"^\s*([0-9][0-9_,]*(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str, what: str = "--gpu-mem") -> int:
    """'80GiB' -> 85899345920, '80GB' -> 80000000000, '1024' -> 1024 (plain bytes)."""
    match = _SIZE_RE.match(text)
    if not match:
        raise SizingError(
            f"{what} {text!r}: expected a positive size such as 80GiB, 80GB or 85899345920 (bytes)"
        )
    number, unit = match.group(1).replace("_", "").replace(",", ""), match.group(2).lower()
    if unit in {"k", "m", "g", "t", "p", "e"}:
        raise SizingError(
            f"{what} {text!r}: unit {match.group(2)!r} is ambiguous; "
            f"expected {unit.upper()}iB (powers of 1024) or {unit.upper()}B (powers of 1000)"
        )
    if unit not in _SIZE_UNITS:
        raise SizingError(
            f"{what} {text!r}: unknown unit {match.group(2)!r}; expected one of "
            "B, KB, MB, GB, TB, PB, KiB, MiB, GiB, TiB, PiB"
        )
    value = Decimal(number) * _SIZE_UNITS[unit]  # Decimal: '79.5GiB' is exact, no float
    if value < 1 or value > LIMITS["--gpu-mem"]:
        raise SizingError(f"{what} {text!r}: expected a size from 1 byte to 1 EiB (2^60 bytes)")
    if value != value.to_integral_value():
        raise SizingError(f"{what} {text!r} is {value} bytes: expected a whole number of bytes")
    return int(value)


_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def parse_count(text: str, what: str = "--params") -> int:
    """A parameter count: '6738415616', '6.74B', '70e9', '405_853_388_800'."""
    cleaned = text.strip().replace("_", "").replace(",", "")
    suffix = cleaned[-1:].lower() if cleaned[-1:].isalpha() and cleaned[-1:].lower() != "e" else ""
    try:
        if not cleaned.isascii():  # Decimal reads every script's digits: '７B' is not 7B
            raise DecimalException
        value = Decimal(cleaned[: len(cleaned) - len(suffix)]) * _COUNT_SUFFIX[suffix]
    except (DecimalException, KeyError):  # not a number, or one past Decimal's exponent range
        raise SizingError(
            f"{what} {text!r}: expected a whole number such as 6738415616, 6.74B or 70e9"
        ) from None
    if not value.is_finite() or value != value.to_integral_value() or value < 0:
        raise SizingError(f"{what} {text!r}: expected a whole number of parameters, 0 or more")
    if value > LIMITS[what]:  # compared before int(): '1e999999999' would take minutes
        raise SizingError(f"{what} {text!r}: expected at most {LIMITS[what]:,} parameters")
    return int(value)


# Context lengths are powers of two: a "32k" model holds 32,768 tokens, "128k" 131,072.
_TOKEN_SUFFIX = {"": 1, "k": 2**10, "m": 2**20}


def parse_tokens(text: str, what: str = "--seq") -> int:
    """A token count: '32768', '32k' (32,768), '1M' (1,048,576), '32_768'."""
    cleaned = text.strip().replace("_", "").replace(",", "")
    suffix = cleaned[-1:].lower() if cleaned[-1:].isalpha() else ""
    digits = cleaned[: len(cleaned) - len(suffix)]
    # ASCII digits of any length here (isdigit alone passes '²' and '١٢'); the length next.
    if suffix not in _TOKEN_SUFFIX or not (digits.isascii() and digits.isdigit()):
        raise SizingError(f"{what} {text!r}: expected a whole number of tokens such as 4096, "
                          "32k (32,768) or 1M (1,048,576)")
    if len(digits) > 20:  # int() of thousands of digits is slow, or refused outright
        raise SizingError(f"{what} {text!r}: expected a whole number from 1 to "
                          f"{LIMITS[what]:,}")
    return check_range(what, int(digits) * _TOKEN_SUFFIX[suffix])


# Upper bounds on what a user (or a config.json) may ask for. Each is far past any real model
# or machine, and low enough that every figure stays short and every loop over layers is quick.
LIMITS: dict[str, int] = {
    "--layers": 100_000,  # Llama-3.1-405B has 126
    "--heads": 65_536,
    "--kv-heads": 65_536,
    "--head-dim": 65_536,
    "--seq": 10**12,  # a trillion tokens per sequence
    "--max-model-len": 10**12,  # --engine's name for the same
    "--batch": 10**9,
    "--tp": 65_536,
    "--block-size": 10**6,
    "--window": 10**12,  # a bounded cache's recent positions, like --seq
    "--sinks": 10**12,
    "--params": 10**15,  # a quadrillion parameters, 1,500× DeepSeek-V3
    "--gpu-mem": 2**60,  # 1 EiB on one GPU
}


def check_range(name: str, value: int, low: int = 1, high: int | None = None) -> int:
    """`value` as given when it is a whole number in [low, high]; else a SizingError naming it."""
    high = LIMITS.get(name) if high is None else high
    if isinstance(value, bool) or not isinstance(value, int):
        raise SizingError(f"{name} {value!r}: expected a whole number")
    if value < low or (high is not None and value > high):
        span = f"from {low:,} to {high:,}" if high is not None else f"{low:,} or more"
        raise SizingError(f"{name} {value:,}: expected a whole number {span}")
    return value
