"""Every registered cache kind as a spec the tests can build: its name alone where that
parses, else its grammar with the optional fields dropped and each placeholder a number
(`window:W` -> `window:16`), so tests iterate the registry and cover kinds added later."""

import re

from kvcache_cli.caches.spec import KINDS, CacheSpecError, parse_cache_spec


def example_spec(kind: str, n: int = 16) -> str:
    """A bounded kind's budget is n in all: `sink:S+W` -> `sink:8+8` for n = 16."""
    try:
        return str(parse_cache_spec(kind))
    except CacheSpecError:
        text = re.sub(r"\[.*?\]", "", KINDS[kind].grammar)
        each = str(max(1, n // 2)) if "+" in text else str(n)
        return str(parse_cache_spec(re.sub(r"[A-Z]+", each, text)))


def rollback_specs(n: int = 16) -> list[str]:
    return [example_spec(name, n) for name, kind in KINDS.items() if kind.rollback]
