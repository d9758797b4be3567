"""Cache specs: the one registry of cache kinds, and the one parser of the strings naming them.

Every command that takes a cache (`generate`, `bench`, `eval`, `serve`, `size`) reads the
same spelling through `parse_cache_spec`, so each accepts the same names and refuses the
same mistakes the same way. A spec is a kind's name, then its fields, colon-separated:

    static                  the exact cache, every position kept (alias: full)
    concat                  the exact cache, appended with torch.cat
    paged[:bN]              blocks of N tokens in a pool (vLLM), N = 16 unless given
    fp16, bf16              every position, each number stored in 2 bytes, attention in
                            float32 (llama.cpp's default f16 cache)
    int8[:gN][:kchan|ktok][:rN][:sN][:rot]  integer codes, affine per group of N (default
    int4[...], int2[...]                32), keys per channel (kchan) or per token (ktok),
                                        the newest rN tokens and the first sN at full
                                        precision, rot: Hadamard-rotated before rounding;
                                        int8 = int8:g32:ktok:r0,
                                        int4 = int4:g32:kchan:r128, int2 likewise
    fp8-e4m3[:tensor|head][:one|calib][:rot]  float8 over a scale per tensor or per head,
    fp8-e5m2[...]                       1.0 or calibrated on the prompt (alias fp8 = e4m3)
    paged-int8[:bN], paged-int4[:bN], paged-fp8[:bN]   serve's pool, quantised blocks
    quanto-int4[:gN][:rN], quanto-int2[...]   the peer: transformers' QuantizedCache
                                        (quanto backend), default g64:r128
    window:W                the W newest positions, in a ring of W slots
    sink:S+W                the first S positions for good, then a ring of W (StreamingLLM)
    h2o:H+W                 per head, the H most-attended positions and the W newest (H2O)
    snapkv:B[:wN][:kN][:avg][:pyramid]   the prompt compressed once to B keys
                            per layer and KV head, chosen by the pooled attention the last
                            N prompt tokens pay (SnapKV; default w32, k7, max); B is a
                            token count (256) or a share of the prompt (0.25); pyramid:
                            budgets shrinking with depth, the same total (PyramidKV)
    knorm:B[:pyramid]                  the prompt compressed once to the B keys of lowest
                                       L2 norm (kvpress's KnormPress)
    recent:B[:sN][:pyramid]            the prompt compressed once to its B newest keys
                                       (the first N kept too, as sinks; default s0)
    ...[:text|rerotate]     a bounded kind's rotary positions: a kept key keeps its
                            position in the text (text, the default), or takes its place
                            in the cache, re-rotated (rerotate: StreamingLLM's choice)

Each kind declares what it is (help text, grammar), how many bytes a layer holds for a
sequence of n tokens, and what it supports (a paged pool, rollback, a compiled step);
its code lives in one module of `kvcache_cli.caches`, imported only when a cache is made.
Torch-free: `kvcache size` and shell completion read this module without torch
(vLLM does the same with its KV-cache specs: allocator and memory figures from one spec).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from kvcache_cli.caches.grammar import (
    CacheKind,
    CacheSpecError,
    every_token,
    no_fields,
    parse_paged,
)
from kvcache_cli.caches.spec_bounded import (
    RING_ROLLBACK,
    RING_ROLLBACK_BYTES,
    bounded_bytes,
    check_evicts,
    compressed_kind,
    h2o_bytes,
    parse_h2o,
    parse_sink,
    parse_window,
    position_policy,
    ring_slots,
    with_positions,
)
from kvcache_cli.caches.spec_quantized import (
    check_head_dim,
    fp8_kind,
    int_kind,
    paged_quant_kind,
    quanto_bytes,
    quanto_parser,
)


def _paged_bytes(params: dict, tokens: int, kv_heads: int, head_dim: int, element: int) -> int:
    """Whole blocks: the last one is allocated before it is full."""
    block = params["block_size"]
    return every_token(params, -(-tokens // block) * block, kv_heads, head_dim, element)


# ---------------------------------------------------------------------------- half
# (the caches themselves: `kvcache_cli.caches.half`)

HALF_BYTES = 2  # fp16 and bf16 alike, whatever the model's element size
# Each half kind, and the engine whose float cache it is.
HALF_ENGINES = {"fp16": "llama.cpp's default f16 cache", "bf16": "vLLM's auto cache under a "
                "bf16 model"}


def _half_bytes(params: dict, tokens: int, kv_heads: int, head_dim: int, element: int) -> int:
    return every_token(params, tokens, kv_heads, head_dim, HALF_BYTES)


def ring_element(spec: CacheSpec | None, element: int) -> int:
    """Bytes a number of a hybrid model's sliding ring takes under `spec` (None: the exact
    cache): a half kind's 2, as it stores the full-attention layers (`make_cache`), else the
    model's `element`."""
    return HALF_BYTES if spec is not None and spec.kind in HALF_ENGINES else element


# ---------------------------------------------------------------------------- quantised
# (the caches themselves: `kvcache_cli.caches.quantized`, whose docstring derives these)


def fitted(spec: CacheSpec, head_dim: int) -> CacheSpec:
    """A default spec (one the user did not type) laid out for heads HEAD_DIM wide: where
    its group size does not divide them, the largest that does. A spec the user typed is
    refused instead, naming it (`check_head_dim`); a default must not be."""
    group = dict(spec.params).get("group")
    if not isinstance(group, int) or head_dim % group == 0:
        return spec
    fits = [g for g in range(group, 1, -1) if head_dim % g == 0]
    if not fits:
        return spec
    others = [f for f in str(spec).split(":") if f != f"g{group}"]
    return parse_cache_spec(":".join([*others, f"g{fits[0]}"]))


# ---------------------------------------------------------------------------- bounded
# (the caches themselves: `kvcache_cli.caches.bounded`)


# ---------------------------------------------------------------------------- compressed
# (the caches themselves: `kvcache_cli.caches.compressed`)


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
            parse=parse_paged,
            layer_bytes=_paged_bytes,
            exact=True, bounded=False, pages=True, compiles=False,
            rollback="resets its length; a pool frees the tail blocks no other "
                     "sequence shares",
            rollback_bytes="none: whole blocks go back to the free list, the cut block's "
                           "k slots are overwritten later",
            spell=lambda p: f"paged:b{p['block_size']}",
        ),
        *(CacheKind(
            name=fmt,
            summary=f"every position in two buffers allocated once, each number stored as "
                    f"{fmt} (2 bytes), attention in float32 ({engine})",
            grammar=fmt,
            factory="kvcache_cli.caches.half:HalfCache",
            parse=no_fields,
            layer_bytes=_half_bytes,
            exact=False, bounded=False, pages=False, compiles=False,
            rollback="resets its length: the rejected slots are masked, later overwritten",
            rollback_bytes="none: the next write overwrites the k slots in place",
        ) for fmt, engine in HALF_ENGINES.items()),
        int_kind(8), int_kind(4), int_kind(2),
        fp8_kind("fp8-e4m3", aliases=("fp8",)), fp8_kind("fp8-e5m2"),
        paged_quant_kind("int8"), paged_quant_kind("int4"), paged_quant_kind("fp8"),
        *(CacheKind(
            name=f"quanto-int{bits}",
            summary=f"the peer: transformers' QuantizedCache, quanto backend, {bits} bits "
                    "(needs optimum-quanto)",
            grammar=f"quanto-int{bits}[:gN][:rN] (default quanto-int{bits}:g64:r128)",
            factory="kvcache_cli.caches.peer:QuantoCache",
            parse=quanto_parser(bits),
            layer_bytes=quanto_bytes,
            exact=False, bounded=False, pages=False, compiles=False,
            rollback="",
            spell=lambda p: f"quanto-int{p['bits']}:g{p['group']}:r{p['residual']}",
        ) for bits in (4, 2)),
        CacheKind(
            name="window",
            summary="the W newest positions in a ring of W slots (Mistral's rolling "
                    "buffer); keys keep their text positions (rerotate: the same, "
                    "without sinks); kN: N spare slots a crop can reach back into",
            grammar="window:W[:kN][:text|rerotate]",
            factory="kvcache_cli.caches.bounded:RingCache",
            parse=with_positions(parse_window),
            layer_bytes=bounded_bytes,
            exact=False, bounded=True, pages=False, compiles=False,
            rollback=RING_ROLLBACK,
            rollback_bytes=RING_ROLLBACK_BYTES,
            spell=lambda p: (f"window:{p['window']}" + (f":k{p['spare']}" if p["spare"] else "")
                             + position_policy(p)),
            budget=ring_slots,
        ),
        CacheKind(
            name="sink",
            summary="the first S positions for good, then the W newest in a ring "
                    "(StreamingLLM's attention sinks); rerotate: rotary keys at their "
                    "places in the cache",
            grammar="sink:S+W[:kN][:text|rerotate]",
            factory="kvcache_cli.caches.bounded:RingCache",
            parse=with_positions(parse_sink),
            layer_bytes=bounded_bytes,
            exact=False, bounded=True, pages=False, compiles=False,
            rollback=RING_ROLLBACK,
            rollback_bytes=RING_ROLLBACK_BYTES,
            spell=lambda p: (f"sink:{p['sinks']}+{p['window']}"
                             + (f":k{p['spare']}" if p["spare"] else "") + position_policy(p)),
            budget=ring_slots,
        ),
        CacheKind(
            name="h2o",
            summary="per layer and head, the H positions with the most attention so far "
                    "plus the W newest (H2O); attention computes explicit weights; "
                    "rerotate: rotary keys at their places",
            grammar="h2o:H+W[:text|rerotate]",
            factory="kvcache_cli.caches.bounded:HeavyHitterCache",
            parse=with_positions(parse_h2o),
            layer_bytes=h2o_bytes,
            exact=False, bounded=True, pages=False, compiles=False,
            # It cannot: the attention later tokens drew is summed into the scores, and the
            # evictions those scores decided cannot be taken back (crop refuses, one line).
            rollback="",
            spell=lambda p: f"h2o:{p['heavy']}+{p['recent']}{position_policy(p)}",
            budget=ring_slots,
        ),
        compressed_kind(
            "snapkv", "the prompt compressed once at prefill to B keys per layer and KV head, "
            "chosen by the pooled attention of its last wN tokens (SnapKV); then appends",
            "snapkv:B[:wN][:kN][:avg][:pyramid]", "SnapKVCache",
            {"w": "window", "k": "kernel"}),
        compressed_kind(
            "knorm", "the prompt compressed once at prefill to the B keys of lowest L2 norm "
            "per layer and KV head (kvpress's KnormPress); then appends",
            "knorm:B[:pyramid]", "KnormCache", {}),
        compressed_kind(
            "recent", "the prompt compressed once at prefill to its B newest keys (sN: the "
            "first N kept too); then appends",
            "recent:B[:sN][:pyramid]", "RecentCache", {"s": "sinks"}),
    )
}

_ALIASES = {alias: kind.name for kind in KINDS.values() for alias in kind.aliases}


def names() -> list[str]:
    """Every name a spec may start with: the kinds, then their aliases."""
    return [*KINDS, *_ALIASES]


def parse_cache_spec(text: str) -> CacheSpec:
    """'int4:g32:kchan' -> CacheSpec, or a CacheSpecError naming what is wrong."""
    spec = text.strip()
    if "," in spec:  # a list where one spec goes: say so, not "unknown field 'rot,window'"
        first = spec.split(",")[0].strip() or "static"
        raise CacheSpecError(f"cache {spec!r} lists several caches: expected one spec "
                             f"here, such as {first!r}")
    name, *fields = spec.split(":")
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in KINDS:
        close = difflib.get_close_matches(name.lower(), names(), n=3, cutoff=0.5)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise CacheSpecError(
            f"unknown cache {spec!r}: expected one of {', '.join(KINDS)}{hint}")
    kind = KINDS[key]
    check_evicts(spec, kind, tuple(f.lower() for f in fields))
    params = kind.parse(spec, tuple(f.lower() for f in fields))
    return CacheSpec(kind.name, tuple(params.items()), kind.canonical(params), spec)


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
                bool(k.rollback), k.rollback or "cannot",
                k.rollback_bytes or ("not stated" if k.rollback else "none: it refuses"))
        for k in KINDS.values())


def check_context(spec: CacheSpec, context: int, model: str = "the model") -> None:
    """Refuse a bounded cache whose budget reaches past the model's context window: it
    could never evict, so it would be the exact cache under another name."""
    budget = spec.info.budget
    if budget is not None and budget(dict(spec.params)) > context:
        held = budget(dict(spec.params))
        raise CacheSpecError(
            f"cache {spec.typed or str(spec)!r} holds {held:,} positions, beyond {model}'s "
            f"context window of {context:,}; expected at most {context:,} (no position past "
            "it is ever held), or static for every position")


def layer_bytes(spec: CacheSpec, tokens: int, kv_heads: int, head_dim: int,
                element_bytes: int) -> int:
    """Bytes one attention layer's cache holds for one sequence of `tokens` tokens."""
    return spec.info.layer_bytes(dict(spec.params), tokens, kv_heads, head_dim, element_bytes)


@dataclass(frozen=True)
class CacheSpec:
    """A parsed spec: the kind's name and its fields' values, with defaults filled in."""

    kind: str
    params: tuple[tuple[str, int | str], ...] = ()  # ordered (name, value): frozen, hashable
    text: str = ""  # the canonical spelling, e.g. 'int4:g32:kchan:r128'
    # As the user typed it ('INT4:g32'): what a refusal names. Not part of its identity.
    typed: str = field(default="", compare=False)

    def __getitem__(self, name: str) -> int | str:
        return dict(self.params)[name]

    def __str__(self) -> str:
        return self.text or self.kind

    @property
    def info(self) -> CacheKind:
        return KINDS[self.kind]


def check_spec(spec: CacheSpec, head_dim: int) -> None:
    """`check_head_dim` for a parsed spec: call it before a model loads."""
    check_head_dim(spec.typed or str(spec), dict(spec.params), head_dim)


def check_prompt(spec: CacheSpec, prompt: int) -> None:
    """Refuse a compressing cache a prompt of `prompt` tokens cannot fill: a token budget
    larger than it, or an observation window (or sinks) longer than it."""
    if not spec.info.compresses:
        return
    p = dict(spec.params)
    budget = p["budget"]
    if isinstance(budget, int) and budget > prompt:
        raise CacheSpecError(f"cache {str(spec)!r} keeps {budget:,} keys of a prompt of "
                             f"{prompt:,} tokens: expected a budget of at most {prompt:,} "
                             "(or a ratio such as 0.25)")
    held = p.get("window", 0) + p.get("sinks", 0)
    if held > prompt:
        what = "observation window" if "window" in p else "sinks"
        raise CacheSpecError(f"cache {str(spec)!r}: the {what} of {held:,} tokens is longer "
                             f"than the prompt of {prompt:,}; expected at most {prompt:,}")
