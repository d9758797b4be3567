"""Cache specs: the one registry of cache kinds, and the one parser of the strings naming them.

Every command that takes a cache (`generate`, `bench`, `eval`, `serve`, `size`) reads the
same spelling through `parse_cache_spec`, so each accepts the same names and refuses the
same mistakes the same way. A spec is a kind's name, then its fields, colon-separated:

    static                  the exact cache, every position kept (alias: full)
    concat                  the exact cache, appended with torch.cat
    window:W                the W newest positions, in a ring of W slots
    sink:S+W                the first S positions for good, then a ring of W (StreamingLLM)
    h2o:H+W                 per head, the H most-attended positions and the W newest (H2O)

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
    # params -> the most positions it holds (a bounded kind); None: every position.
    budget: Callable[[dict], int] | None = None

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


def _parse_window(spec: str, fields: tuple[str, ...]) -> dict:
    if len(fields) != 1:
        raise CacheSpecError(f"cache spec {spec!r}: expected window:W, the positions kept "
                             "(e.g. window:256)")
    return {"window": whole_number(spec, "window", fields[0])}


def _two_counts(spec: str, fields: tuple[str, ...], first: str, example: str
                ) -> tuple[int, int]:
    """'A+B' -> (A, B): A at least 1, B (the recent window) at least 1."""
    name = spec.split(":", 1)[0].lower()
    parts = fields[0].split("+") if len(fields) == 1 else []
    if len(parts) != 2:
        raise CacheSpecError(f"cache spec {spec!r}: expected {name}:{first[0].upper()}+W, "
                             f"{first} then the recent window (e.g. {example})")
    a = whole_number(spec, first, parts[0], low=0)
    w = whole_number(spec, "window", parts[1])
    if a == 0:
        raise CacheSpecError(f"cache spec {spec!r}: no {first}; expected at least 1, or "
                             f"window:{w} for a window alone")
    return a, w


def _parse_sink(spec: str, fields: tuple[str, ...]) -> dict:
    sinks, window = _two_counts(spec, fields, "sinks", "sink:4+252")
    if sinks > window:
        raise CacheSpecError(
            f"cache spec {spec!r}: more sinks ({sinks:,}) than window slots ({window:,}); "
            f"expected a few sinks before a larger window (StreamingLLM keeps 4: "
            f"sink:4+{sinks + window - 4})")
    return {"sinks": sinks, "window": window}


def _parse_h2o(spec: str, fields: tuple[str, ...]) -> dict:
    heavy, recent = _two_counts(spec, fields, "heavy hitters", "h2o:128+128")
    return {"heavy": heavy, "recent": recent}


def _held(params: dict) -> int:
    """The most positions a bounded kind holds."""
    return sum(params.values())


def _bounded_bytes(params: dict, tokens: int, kv_heads: int, head_dim: int, element: int
                   ) -> int:
    """K and V of min(tokens, the budget) positions: allocated once, then constant."""
    return every_token(params, min(tokens, _held(params)), kv_heads, head_dim, element)


# H2O keeps, per slot and head, its float32 score and its int64 position besides K and V.
H2O_SLOT_EXTRA = 4 + 8


def _h2o_bytes(params: dict, tokens: int, kv_heads: int, head_dim: int, element: int) -> int:
    slots = min(tokens, _held(params))
    return (every_token(params, slots, kv_heads, head_dim, element)
            + slots * kv_heads * H2O_SLOT_EXTRA)


_RING_ROLLBACK = ("resets its length while the next token's band is intact: any crop "
                  "before the ring wraps, one position after; else RollbackError")

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
            spell=lambda p: f"paged:b{p['block_size']}",
        ),
        CacheKind(
            name="window",
            summary="the W newest positions in a ring of W slots (Mistral's rolling "
                    "buffer); keys keep their absolute positions",
            grammar="window:W",
            factory="kvcache_cli.caches.bounded:RingCache",
            parse=_parse_window,
            layer_bytes=_bounded_bytes,
            exact=False, bounded=True, pages=False, compiles=False,
            rollback=_RING_ROLLBACK,
            spell=lambda p: f"window:{p['window']}",
            budget=_held,
        ),
        CacheKind(
            name="sink",
            summary="the first S positions for good, then the W newest in a ring "
                    "(StreamingLLM's attention sinks)",
            grammar="sink:S+W",
            factory="kvcache_cli.caches.bounded:RingCache",
            parse=_parse_sink,
            layer_bytes=_bounded_bytes,
            exact=False, bounded=True, pages=False, compiles=False,
            rollback=_RING_ROLLBACK,
            spell=lambda p: f"sink:{p['sinks']}+{p['window']}",
            budget=_held,
        ),
        CacheKind(
            name="h2o",
            summary="per layer and head, the H positions with the most attention so far "
                    "plus the W newest (H2O); attention computes explicit weights",
            grammar="h2o:H+W",
            factory="kvcache_cli.caches.bounded:HeavyHitterCache",
            parse=_parse_h2o,
            layer_bytes=_h2o_bytes,
            exact=False, bounded=True, pages=False, compiles=False,
            rollback="only to its own length: attention already summed into the scores "
                     "and the evictions it decided cannot be taken back",
            spell=lambda p: f"h2o:{p['heavy']}+{p['recent']}",
            budget=_held,
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


def check_context(spec: CacheSpec, context: int, model: str = "the model") -> None:
    """Refuse a bounded cache whose budget reaches past the model's context window: it
    could never evict, so it would be the exact cache under another name."""
    budget = spec.info.budget
    if budget is not None and budget(dict(spec.params)) > context:
        held = budget(dict(spec.params))
        raise CacheSpecError(
            f"cache {str(spec)!r} holds {held:,} positions, beyond {model}'s context window "
            f"of {context:,}; expected at most {context:,} (GPT-2's learned positions end "
            "there), or static for every position")


def layer_bytes(spec: CacheSpec, tokens: int, kv_heads: int, head_dim: int,
                element_bytes: int) -> int:
    """Bytes one attention layer's cache holds for one sequence of `tokens` tokens."""
    return spec.info.layer_bytes(dict(spec.params), tokens, kv_heads, head_dim, element_bytes)
