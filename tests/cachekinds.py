"""Every registered cache kind as a spec the tests can build: its name alone where that
parses, else its grammar with the optional fields dropped and each placeholder a number
(`window:W` -> `window:16`), so tests iterate the registry and cover kinds added later.
A quantised kind's group is 4, which divides the narrow heads of the tests' tiny models."""

import re

from kvcache_cli.caches.grammar import CacheSpecError
from kvcache_cli.caches.spec import KINDS, parse_cache_spec


def example_spec(kind: str, n: int = 16) -> str:
    """A bounded kind's budget is n in all: `sink:S+W` -> `sink:8+8` for n = 16."""
    try:
        spec = parse_cache_spec(kind)
    except CacheSpecError:
        text = re.sub(r"\[.*?\]", "", KINDS[kind].grammar)
        each = str(max(1, n // 2)) if "+" in text else str(n)
        spec = parse_cache_spec(re.sub(r"[A-Z]+", each, text))
    if "group" in dict(spec.params):  # groups that fit the tests' narrow heads
        return str(parse_cache_spec(re.sub(r":g\d+", ":g4", str(spec))))
    return str(spec)


def rollback_specs(n: int = 16) -> list[str]:
    return [example_spec(name, n) for name, kind in KINDS.items() if kind.rollback]
