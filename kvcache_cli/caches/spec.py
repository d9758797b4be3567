"""Cache specs: the one registry of cache kinds, and the one parser of the strings naming them.

Every command that takes a cache (`generate`, `bench`, `eval`, `serve`, `size`) reads the
same spelling through `parse_cache_spec`, so each accepts the same names and refuses the
same mistakes the same way. A spec is a kind's name, then its fields, colon-separated:

    static                  the exact cache, every position kept (alias: full)
    concat                  the exact cache, appended with torch.cat

Each kind declares what it is (help text, grammar), how many bytes a layer holds for a
sequence of n tokens, and what it supports (a paged pool, rollback, a compiled step);
its code lives in one module of `kvcache_cli.caches`, imported only when a cache is made.
Torch-free: `kvcache size` and shell completion read this module without torch
(vLLM does the same with its KV-cache specs: allocator and memory figures from one spec).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, field


class CacheSpecError(ValueError):
    """A cache spec that names no known kind or has a malformed field (one line)."""


@dataclass(frozen=True)
class CacheSpec:
    """A parsed spec: the kind's name and its fields' values, with defaults filled in."""

    kind: str
    params: tuple[tuple[str, int | str], ...] = ()  # ordered (name, value): frozen, hashable
    text: str = ""  # the canonical spelling, e.g. 'int4:g32:kchan:r128'

    def __getitem__(self, name: str) -> int | str:
        return dict(self.params)[name]

    def __str__(self) -> str:
        return self.text or self.kind

    @property
    def info(self) -> CacheKind:
        return KINDS[self.kind]


# (params, tokens, kv_heads, head_dim, element_bytes) -> bytes one layer holds for one
# sequence of `tokens` tokens, keys and values together, at the model's element size.
LayerBytes = Callable[[dict, int, int, int, int], int]
# The fields after the kind's name -> its parameters (raise CacheSpecError when bad).
Parse = Callable[[str, tuple[str, ...]], dict]


@dataclass(frozen=True)
class CacheKind:
    name: str
    summary: str  # one line: --help, completion, `kvcache caches`
    grammar: str  # how to spell it, e.g. 'window:W'
    factory: str  # 'module:Class' that builds it; imported only when a cache is made
    parse: Parse
    layer_bytes: LayerBytes
    exact: bool  # logits equal the full-precision cache's, up to float noise
    bounded: bool  # memory stops growing once full
    pages: bool  # can be held in serve's block pool
    compiles: bool  # its decode step has one shape (torch.compile, CUDA graphs)
    rollback: str  # how crop(n) forgets the newest tokens; '' when it cannot
    aliases: tuple[str, ...] = field(default=())
    # params -> the spelling that parses back to them; None: the kind's name alone.
    spell: Callable[[dict], str] | None = None
    # What rolling back k tokens reads or writes (`kvcache caches`); '' when not stated.
    rollback_bytes: str = ""

    def canonical(self, params: dict) -> str:
        return self.spell(params) if self.spell else self.name


def whole_number(spec: str, what: str, text: str, low: int = 1, high: int = 1 << 20) -> int:
    """A field's integer, or a CacheSpecError naming the spec, the field and the range."""
    if not text.isdigit() or not low <= int(text) <= high:
        raise CacheSpecError(
            f"cache spec {spec!r}: {what} {text!r} is not a whole number from {low:,} to "
            f"{high:,}")
    return int(text)


def no_fields(spec: str, fields: tuple[str, ...]) -> dict:
    if fields:
        name = spec.split(":", 1)[0]
        raise CacheSpecError(f"cache spec {spec!r}: {name} takes no fields; expected {name!r}")
    return {}


def every_token(params: dict, tokens: int, kv_heads: int, head_dim: int, element: int) -> int:
    """K and V of every token at the model's element size: the exact cache's bytes."""
    return 2 * tokens * kv_heads * head_dim * element


# vLLM's default block size on GPUs, and serve's.
DEFAULT_BLOCK_SIZE = 16


def _parse_paged(spec: str, fields: tuple[str, ...]) -> dict:
    block_size = DEFAULT_BLOCK_SIZE
    for f in fields:
        if not f.startswith("b"):
            raise CacheSpecError(f"cache spec {spec!r}: unknown field {f!r}; expected bN, "
                                 "the block size in tokens (e.g. paged:b16)")
        block_size = whole_number(spec, "block size", f[1:], 1, 4096)
    return {"block_size": block_size}


def _paged_bytes(params: dict, tokens: int, kv_heads: int, head_dim: int, element: int) -> int:
    """Whole blocks: the last one is allocated before it is full."""
    block = params["block_size"]
    return every_token(params, -(-tokens // block) * block, kv_heads, head_dim, element)


KINDS: dict[str, CacheKind] = {
    kind.name: kind
    for kind in (
        CacheKind(
            name="static",
            summary="every position in two buffers allocated once, written in place (exact)",
            grammar="static",
            factory="kvcache_cli.caches.exact:StaticCache",
            parse=no_fields,
            layer_bytes=every_token,
            exact=True, bounded=False, pages=True, compiles=True,
            rollback="resets its length: the rejected slots are masked, later overwritten",
            rollback_bytes="none: the next write overwrites the k slots in place",
            aliases=("full",),
        ),
        CacheKind(
            name="concat",
            summary="every position, appended with torch.cat: the whole history copied "
                    "every step (exact)",
            grammar="concat",
            factory="kvcache_cli.caches.exact:ConcatCache",
            parse=no_fields,
            layer_bytes=every_token,
            exact=True, bounded=False, pages=False, compiles=False,
            rollback="slices each layer to the kept length (a view; the next append copies)",
            rollback_bytes="none at the crop; the next append copies the kept history, "
                           "as every append does",
        ),
        CacheKind(
            name="paged",
            summary="fixed-size blocks of a pool, read through block tables (vLLM); "
                    "bN sets the block size",
            grammar="paged[:bN]",
            factory="kvcache_cli.caches.paged:PagedCache",
            parse=_parse_paged,
            layer_bytes=_paged_bytes,
            exact=True, bounded=False, pages=True, compiles=False,
            rollback="resets its length; a pool frees the tail blocks no other "
                     "sequence shares",
            rollback_bytes="none: whole blocks go back to the free list, the cut block's "
                           "k slots are overwritten later",
            spell=lambda p: f"paged:b{p['block_size']}",
        ),
    )
}

_ALIASES = {alias: kind.name for kind in KINDS.values() for alias in kind.aliases}


def names() -> list[str]:
    """Every name a spec may start with: the kinds, then their aliases."""
    return [*KINDS, *_ALIASES]


def parse_cache_spec(text: str) -> CacheSpec:
    """'int4:g32:kchan' -> CacheSpec, or a CacheSpecError naming what is wrong."""
    spec = text.strip()
    name, *fields = spec.split(":")
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in KINDS:
        close = difflib.get_close_matches(name.lower(), names(), n=3, cutoff=0.5)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise CacheSpecError(
            f"unknown cache {spec!r}: expected one of {', '.join(KINDS)}{hint}")
    kind = KINDS[key]
    params = kind.parse(spec, tuple(f.lower() for f in fields))
    return CacheSpec(kind.name, tuple(params.items()), kind.canonical(params))


def parse_cache_list(text: str) -> list[CacheSpec]:
    """'static,int8,window:256' -> one spec each, in order, duplicates refused."""
    specs = [parse_cache_spec(part) for part in text.split(",") if part.strip()]
    if not specs:
        raise CacheSpecError(f"no cache in {text!r}: expected a comma-separated list such as "
                             "'static,int8'")
    seen: set[str] = set()
    for spec in specs:
        if str(spec) in seen:
            raise CacheSpecError(f"cache {str(spec)!r} is listed twice in {text!r}")
        seen.add(str(spec))
    return specs


@dataclass(frozen=True)
class KindRow:
    """One kind as `kvcache caches` shows it: what it is and whether it can roll back."""

    name: str
    grammar: str
    summary: str
    exact: bool
    bounded: bool
    pages: bool
    compiles: bool
    rolls_back: bool
    rollback: str  # how
    rollback_bytes: str  # what it reads or writes to forget k tokens


def kinds_table() -> tuple[KindRow, ...]:
    """Every registered kind, in registry order (torch-free)."""
    return tuple(
        KindRow(k.name, k.grammar, k.summary, k.exact, k.bounded, k.pages, k.compiles,
                bool(k.rollback), k.rollback or "cannot", k.rollback_bytes or "not stated")
        for k in KINDS.values())


def layer_bytes(spec: CacheSpec, tokens: int, kv_heads: int, head_dim: int,
                element_bytes: int) -> int:
    """Bytes one attention layer's cache holds for one sequence of `tokens` tokens."""
    return spec.info.layer_bytes(dict(spec.params), tokens, kv_heads, head_dim, element_bytes)
