"""Cache specs: the one registry of cache kinds, and the one parser of the strings naming them.

Every command that takes a cache (`generate`, `bench`, `eval`, `serve`, `size`) reads the
same spelling through `parse_cache_spec`, so each accepts the same names and refuses the
same mistakes the same way. A spec is a kind's name, then its fields, colon-separated:

    static                  the exact cache, every position kept (alias: full)
    concat                  the exact cache, appended with torch.cat
    paged[:bN]              blocks of N tokens in a pool (vLLM), N = 16 unless given
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
from collections.abc import Callable
from dataclasses import dataclass, field

from kvcache_cli import numbers


class CacheSpecError(ValueError):
    """A cache spec that names no known kind or has a malformed field (one line)."""


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
    # params -> the most positions it holds (a bounded kind); None: every position.
    budget: Callable[[dict], int] | None = None
    # It compresses the prompt once, at the prefill (its first forward), then appends:
    # its layer_bytes count a prompt of `tokens` tokens compressed, and check_prompt
    # refuses a budget or a window the prompt cannot fill.
    compresses: bool = False

    def canonical(self, params: dict) -> str:
        return self.spell(params) if self.spell else self.name


def whole_number(spec: str, what: str, text: str, low: int = 1, high: int = 1 << 20) -> int:
    """A field's integer, or a CacheSpecError naming the spec, the field and the range
    (`numbers.whole`: ASCII digits only, the length bounded before converting)."""
    try:
        return numbers.whole(text, what, low, high)
    except numbers.NumberError as err:
        raise CacheSpecError(f"cache spec {spec!r}: {err}") from None


def lettered(field: str, letters) -> str:
    """The letter of a field such as g32, r128 or b16 (among LETTERS; the number may be
    missing or wrong, its refusal names it), or '' where FIELD is not one: 'rot2' is an
    unknown word, not a residual of 'ot2', and is refused whole."""
    word = field[1:2].isascii() and field[1:2].isalpha()
    return field[0] if field[:1] and field[0] in letters and not word else ""


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
    given: dict = {}
    for f in fields:
        if not lettered(f, "b"):
            raise CacheSpecError(f"cache spec {spec!r}: unknown field {f!r}; expected bN, "
                                 "the block size in tokens (e.g. paged:b16)")
        _give_once(spec, given, "block size", whole_number(spec, "block size", f[1:], 1, 4096))
    return {"block_size": given.get("block size", DEFAULT_BLOCK_SIZE)}


def _paged_bytes(params: dict, tokens: int, kv_heads: int, head_dim: int, element: int) -> int:
    """Whole blocks: the last one is allocated before it is full."""
    block = params["block_size"]
    return every_token(params, -(-tokens // block) * block, kv_heads, head_dim, element)


# ---------------------------------------------------------------------------- quantised
# (the caches themselves: `kvcache_cli.caches.quantized`, whose docstring derives these)

SCALE_BYTES = 2  # scales and zero points of the integer kinds are float16
FP8_SCALE_BYTES = 4  # fp8 scales are float32 (vLLM's)
_INT_DEFAULTS = {8: ("ktok", 0), 4: ("kchan", 128), 2: ("kchan", 128)}


def _give_once(spec: str, given: dict, what: str, value) -> None:
    """Record a field's value, refusing a field given twice in one spec."""
    if what in given:
        raise CacheSpecError(f"cache spec {spec!r}: {what} given twice")
    given[what] = value


def _int_parser(bits: int) -> Parse:
    def parse(spec: str, fields: tuple[str, ...]) -> dict:
        keys, residual = _INT_DEFAULTS[bits]
        given: dict = {}
        for f in fields:
            if f in ("kchan", "ktok"):
                what, value = "keys", f
            elif f == "rot":
                what, value = "rotate", 1
            elif lettered(f, "grs"):
                what = {"g": "group", "r": "residual", "s": "sinks"}[f[0]]
                low = 2 if what == "group" else 0
                label = {"group": "group size", "residual": "residual", "sinks": "sinks"}[what]
                value = whole_number(spec, label, f[1:], low, 1 << 16)
            else:
                raise CacheSpecError(
                    f"cache spec {spec!r}: unknown field {f!r}; expected gN (group size), "
                    f"kchan or ktok (keys per channel or per token), rN (residual tokens), "
                    f"sN (sink tokens), rot (a Hadamard rotation), e.g. "
                    f"int{bits}:g32:kchan:r128")
            _give_once(spec, given, what, value)
        return {"bits": bits, "group": 32, "keys": keys, "residual": residual, "sinks": 0,
                "rotate": 0, **given}
    return parse


def _int_spell(p: dict) -> str:
    sinks = f":s{p['sinks']}" if p["sinks"] else ""
    return f"int{p['bits']}:g{p['group']}:{p['keys']}:r{p['residual']}{sinks}{_rot(p)}"


def _rot(p: dict) -> str:
    """The rotation's field as spelled: absent when off (the default)."""
    return ":rot" if p["rotate"] else ""


def quantised_split(p: dict, tokens: int) -> tuple[int, int]:
    """(tokens held as codes, tokens held at full precision) for an integer spec."""
    sinks = min(tokens, p["sinks"])
    chunk = p["group"] if p["keys"] == "kchan" else 1
    quantised = max(0, tokens - sinks - p["residual"]) // chunk * chunk
    return quantised, tokens - quantised


def _int_bytes(p: dict, tokens: int, kv_heads: int, head_dim: int, element: int) -> int:
    q, full = quantised_split(p, tokens)
    G = p["group"]
    payload = 2 * kv_heads * q * head_dim * p["bits"] // 8
    value_groups = kv_heads * q * (head_dim // G)
    key_groups = kv_heads * (q // G) * head_dim if p["keys"] == "kchan" else value_groups
    return (payload + 2 * SCALE_BYTES * (value_groups + key_groups)
            + every_token(p, full, kv_heads, head_dim, element))


def _fp8_parse(spec: str, fields: tuple[str, ...]) -> dict:
    given: dict = {}
    for f in fields:
        what = {"tensor": "scale", "head": "scale", "one": "init", "calib": "init",
                "rot": "rotate"}.get(f)
        if what is None:
            raise CacheSpecError(
                f"cache spec {spec!r}: unknown field {f!r}; expected tensor or head (one "
                f"scale per tensor or per head), one or calib (scale 1.0 or calibrated "
                f"on the prompt) and rot (a Hadamard rotation), e.g. fp8-e4m3:head:calib")
        _give_once(spec, given, what, 1 if what == "rotate" else f)
    return {"scale": "tensor", "init": "one", "rotate": 0, **given}


def _fp8_bytes(p: dict, tokens: int, kv_heads: int, head_dim: int, element: int) -> int:
    scales = 2 * (kv_heads if p["scale"] == "head" else 1)  # K's and V's
    return every_token(p, tokens, kv_heads, head_dim, 1) + FP8_SCALE_BYTES * scales


def _paged_quant_parser(fmt: str) -> Parse:
    def parse(spec: str, fields: tuple[str, ...]) -> dict:
        params = _parse_paged(spec, fields)
        return {"bits": 8 if fmt == "fp8" else int(fmt[3:]), "fmt": fmt, **params}
    return parse


def _paged_quant_bytes(p: dict, tokens: int, kv_heads: int, head_dim: int, element: int) -> int:
    """Whole blocks of codes; int: one float16 scale and zero per head and token, K and V."""
    slots = -(-tokens // p["block_size"]) * p["block_size"]
    payload = 2 * slots * kv_heads * head_dim * p["bits"] // 8
    return payload + (0 if p["fmt"] == "fp8" else 2 * 2 * SCALE_BYTES * slots * kv_heads)


def _quanto_parser(bits: int) -> Parse:
    def parse(spec: str, fields: tuple[str, ...]) -> dict:
        params = {"bits": bits, "group": 64, "residual": 128}
        seen: set[str] = set()
        for f in fields:
            what = {"g": "group", "r": "residual"}.get(lettered(f, "gr"))
            if what is None or what in seen:
                why = f"{what} given twice" if what else f"unknown field {f!r}; expected gN " \
                    f"(group size) or rN (residual tokens), e.g. quanto-int{bits}:g64:r128"
                raise CacheSpecError(f"cache spec {spec!r}: {why}")
            seen.add(what)
            label = "group size" if what == "group" else "residual"
            params[what] = whole_number(spec, label, f[1:], 2 if what == "group" else 1, 1 << 16)
        return params
    return parse


def _quanto_bytes(p: dict, tokens: int, kv_heads: int, head_dim: int, element: int) -> int:
    """Every token as codes, a scale and a shift (the model's dtype) per group: what it
    holds after a prefill; the residual of decoded tokens adds up to R - 1 full tokens."""
    groups = kv_heads * tokens * head_dim // p["group"]
    return 2 * (kv_heads * tokens * head_dim * p["bits"] // 8 + 2 * element * groups)


def check_head_dim(spec: str, params: dict, head_dim: int) -> None:
    """Refuse a quantised spec whose groups, packing or rotation do not fit heads
    `head_dim` wide."""
    group, bits = params.get("group"), params.get("bits")
    if group is not None and head_dim % group:
        fits = [g for g in (16, 32, 64, 128) if head_dim % g == 0]
        hint = f"; try g{fits[-1]}" if fits else ""
        raise CacheSpecError(f"cache spec {spec!r}: group size {group} does not divide the "
                             f"head width {head_dim}{hint}")
    if params.get("rotate") and head_dim & (head_dim - 1):
        raise CacheSpecError(f"cache spec {spec!r}: rot needs a head width that is a power "
                             f"of two (a Sylvester-Hadamard matrix), not {head_dim}; drop "
                             f":rot for this model")
    if bits is not None and head_dim * bits % 8:
        raise CacheSpecError(f"cache spec {spec!r}: {bits}-bit codes of a {head_dim}-wide head "
                             f"do not fill whole bytes (the head width must be a multiple of "
                             f"{8 // bits})")


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


def check_spec(spec: CacheSpec, head_dim: int) -> None:
    """`check_head_dim` for a parsed spec: call it before a model loads."""
    check_head_dim(spec.typed or str(spec), dict(spec.params), head_dim)


def _int_kind(bits: int) -> CacheKind:
    keys, residual = _INT_DEFAULTS[bits]
    return CacheKind(
        name=f"int{bits}",
        summary=f"{bits}-bit integer codes, affine per group (float16 scale and zero); "
                f"keys per channel or token, a full-precision residual (KIVI); rot: "
                f"Hadamard-rotated first (llama.cpp)",
        grammar=f"int{bits}[:gN][:kchan|ktok][:rN][:sN][:rot] (default "
                f"int{bits}:g32:{keys}:r{residual})",
        factory="kvcache_cli.caches.quantized:QuantizedCache",
        parse=_int_parser(bits),
        layer_bytes=_int_bytes,
        exact=False, bounded=False, pages=False, compiles=False,
        rollback="drops full-precision tokens, or whole quantised groups; refuses a cut "
                 "inside a per-channel key group",
        rollback_bytes="none at the crop (views); the next append copies the "
                       "full-precision tail, as every append does, and the next flush "
                       "the codes, freeing the dropped groups",
        spell=_int_spell,
    )


def _fp8_kind(fmt: str, aliases: tuple[str, ...] = ()) -> CacheKind:
    return CacheKind(
        name=fmt,
        summary=f"float8 {fmt[4:]} codes over a float32 scale per tensor or head, 1.0 or "
                f"calibrated on the prompt; saturation counted (vLLM's fp8 cache); rot: "
                f"Hadamard-rotated first",
        grammar=f"{fmt}[:tensor|head][:one|calib][:rot]",
        factory="kvcache_cli.caches.quantized:Fp8Cache",
        parse=_fp8_parse,
        layer_bytes=_fp8_bytes,
        exact=False, bounded=False, pages=False, compiles=False,
        rollback="drops the newest tokens (each is stored alone; the scales stay)",
        rollback_bytes="none at the crop (views); the next append copies the kept "
                       "codes, as every append does",
        aliases=aliases,
        spell=lambda p: f"{fmt}:{p['scale']}:{p['init']}{_rot(p)}",
    )


def _paged_quant_kind(fmt: str) -> CacheKind:
    return CacheKind(
        name=f"paged-{fmt}",
        summary=f"serve's block pool in {fmt}: every token quantised as written "
                f"({'scale 1.0' if fmt == 'fp8' else 'a float16 scale and zero per head'})",
        grammar=f"paged-{fmt}[:bN]",
        factory="kvcache_cli.caches.quantized:QuantPagedCache",
        parse=_paged_quant_parser(fmt),
        layer_bytes=_paged_quant_bytes,
        exact=False, bounded=False, pages=True, compiles=False,
        rollback="resets its length; a pool frees the tail blocks no other sequence shares",
        rollback_bytes="none: whole blocks go back to the free list, the cut block's k "
                       "slots are overwritten later",
        spell=lambda p: f"paged-{fmt}:b{p['block_size']}",
    )


# ---------------------------------------------------------------------------- bounded
# (the caches themselves: `kvcache_cli.caches.bounded`)

def _spare(spec: str, fields: tuple[str, ...], grammar: str) -> int:
    """The optional `kN` after a ring's counts: N spare slots for rollback (default 0)."""
    if not fields:
        return 0
    if len(fields) > 1 and all(lettered(f, "k") for f in fields):
        raise CacheSpecError(f"cache spec {spec!r}: spare slots given twice")
    if len(fields) > 1 or not lettered(fields[0], "k"):
        raise CacheSpecError(f"cache spec {spec!r}: unknown field {fields[0]!r}; expected "
                             f"{grammar}, kN the spare slots a crop can reach back into "
                             "(e.g. k8 for speculative decoding's k of 8)")
    return whole_number(spec, "spare slots", fields[0][1:], low=0)


def _parse_window(spec: str, fields: tuple[str, ...]) -> dict:
    if not fields:
        raise CacheSpecError(f"cache spec {spec!r}: expected window:W, the positions kept "
                             "(e.g. window:256)")
    if not numbers.is_whole(fields[0]) and fields[0].startswith("k"):
        raise CacheSpecError(f"cache spec {spec!r}: expected window:W first, the positions "
                             "kept (e.g. window:256:k8)")
    return {"window": whole_number(spec, "window", fields[0]),
            "spare": _spare(spec, fields[1:], "window:W[:kN]")}


def _two_counts(spec: str, fields: tuple[str, ...], first: str, example: str
                ) -> tuple[int, int]:
    """'A+B' -> (A, B): A at least 1, B (the recent window) at least 1."""
    name = spec.split(":", 1)[0].lower()
    parts = fields[0].split("+") if fields else []
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
    sinks, window = _two_counts(spec, fields[:1], "sinks", "sink:4+252")
    spare = _spare(spec, fields[1:], "sink:S+W[:kN]")
    if sinks > window:
        raise CacheSpecError(
            f"cache spec {spec!r}: more sinks ({sinks:,}) than window slots ({window:,}); "
            f"expected a few sinks before a larger window (StreamingLLM keeps 4: "
            f"sink:4+{sinks + window - 4})")
    return {"sinks": sinks, "window": window, "spare": spare}


def _parse_h2o(spec: str, fields: tuple[str, ...]) -> dict:
    if len(fields) > 1:
        raise CacheSpecError(f"cache spec {spec!r}: unknown field {fields[1]!r}; expected "
                             "h2o:H+W")
    heavy, recent = _two_counts(spec, fields, "heavy hitters", "h2o:128+128")
    return {"heavy": heavy, "recent": recent}


# A bounded kind's rotary position policy (`kvcache_cli.caches.bounded` says what each is).
POSITION_POLICIES = ("text", "rerotate")


def _with_positions(parse: Parse) -> Parse:
    """A bounded kind's parser that also takes `text` or `rerotate`, anywhere, once."""
    def parsed(spec: str, fields: tuple[str, ...]) -> dict:
        chosen = [f for f in fields if f in POSITION_POLICIES]
        if len(chosen) > 1:
            raise CacheSpecError(f"cache spec {spec!r}: positions given twice ({chosen[0]}, "
                                 f"{chosen[1]}); expected text or rerotate, once")
        params = parse(spec, tuple(f for f in fields if f not in POSITION_POLICIES))
        return {**params, "positions": chosen[0] if chosen else "text"}
    return parsed


def _positions(params: dict) -> str:
    """The policy's field as spelled: absent for text (the default)."""
    return "" if params["positions"] == "text" else f":{params['positions']}"


def _check_evicts(spec: str, kind: CacheKind, fields: tuple[str, ...]) -> None:
    """Refuse a position policy on a kind that keeps every key where the text put it."""
    policy = next((f for f in fields if f in POSITION_POLICIES), None)
    if policy is not None and not kind.bounded:
        raise CacheSpecError(
            f"cache spec {spec!r}: a rotary position policy ({policy}) is for a cache that "
            f"evicts (window, sink, h2o); {kind.name} keeps every key at its position in "
            f"the text")


def _held(params: dict) -> int:
    """The most positions a bounded kind holds."""
    return sum(n for name, n in params.items() if name != "positions")


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
                  "before the ring wraps, N + 1 positions after with :kN spare slots (1 "
                  "without); else RollbackError")
_RING_ROLLBACK_BYTES = ("none: one vector of slot positions is recomputed; the k slots are "
                        "overwritten by the next writes")


# ---------------------------------------------------------------------------- compressed
# (the caches themselves: `kvcache_cli.caches.compressed`)

SNAPKV_WINDOW = 32  # SnapKV's observation window: the last 32 prompt tokens (its paper's)
SNAPKV_KERNEL = 7  # its pooling kernel over the key axis (SnapKV's 7; kvpress uses 5)
PYRAMID_BETA = 20  # PyramidKV: the deepest layer keeps budget / beta (its paper's beta)
# Each kept slot also holds its int64 text position, per KV head (heads choose apart).
POSITION_BYTES = 8


def _budget(spec: str, text: str) -> int | float:
    """'256' -> 256 tokens; '0.25' -> a share of the prompt; CacheSpecError otherwise."""
    if "." in text:
        ratio = float(text) if numbers.is_decimal(text) else None  # ASCII digits only
        if ratio is None or not 0 < ratio <= 1:
            raise CacheSpecError(f"cache spec {spec!r}: ratio {text!r} is outside (0, 1]; "
                                 "expected a share of the prompt's keys such as 0.25, or a "
                                 "whole number of tokens such as 256")
        return ratio
    if numbers.is_whole(text) and int(text) == 0:
        raise CacheSpecError(f"cache spec {spec!r}: a budget of 0 keeps no key; expected a "
                             "whole number of tokens from 1 (e.g. 256) or a ratio in (0, 1]")
    return whole_number(spec, "budget", text)


def _compressed_parser(name: str, own: dict[str, str]) -> Parse:
    """`name:B` then the kind's own fields (letter -> what it is), the pooling for snapkv,
    and uniform|pyramid; each once."""
    def parse(spec: str, fields: tuple[str, ...]) -> dict:
        if not fields or not fields[0]:
            raise CacheSpecError(f"cache spec {spec!r}: expected {name}:B, the keys kept per "
                                 f"layer and head: tokens (e.g. {name}:256) or a share of the "
                                 f"prompt (e.g. {name}:0.25)")
        params: dict = {"budget": _budget(spec, fields[0]), "layers": "uniform"}
        if name == "snapkv":
            params.update(window=SNAPKV_WINDOW, kernel=SNAPKV_KERNEL, pool="max")
        if name == "recent":
            params["sinks"] = 0
        given: dict = {}
        for f in fields[1:]:
            if f in ("uniform", "pyramid"):
                _give_once(spec, given, "layers", f)
            elif name == "snapkv" and f in ("max", "avg"):
                _give_once(spec, given, "pool", f)
            elif lettered(f, "".join(own)):
                what = own[f[0]]
                low = 0 if what == "sinks" else 1
                _give_once(spec, given, what, whole_number(spec, what, f[1:], low, 1 << 16))
            else:
                extra = "".join(f"{k}N ({w}), " for k, w in own.items())
                pool = "max or avg (the pooling), " if name == "snapkv" else ""
                raise CacheSpecError(f"cache spec {spec!r}: unknown field {f!r}; expected "
                                     f"{extra}{pool}uniform or pyramid (the layers' budgets)")
        budget = params["budget"]
        if isinstance(budget, int) and name == "snapkv" and "window" not in given:
            params["window"] = min(SNAPKV_WINDOW, budget)  # the window is part of the budget
        params.update(given)
        held = params.get("window", 0) + params.get("sinks", 0)
        if isinstance(budget, int) and held > budget:
            what = "observation window" if name == "snapkv" else "sinks"
            raise CacheSpecError(f"cache spec {spec!r}: {name} always keeps its {what} of "
                                 f"{held:,} tokens, more than the budget of {budget:,}; "
                                 f"expected at most {budget:,}")
        if params.get("kernel", 1) % 2 == 0:
            raise CacheSpecError(f"cache spec {spec!r}: pooling kernel {params['kernel']} is "
                                 "even; expected an odd width, centred on each key (e.g. k7)")
        return params
    return parse


def _compressed_spell(name: str) -> Callable[[dict], str]:
    def spell(p: dict) -> str:
        text = f"{name}:{p['budget']}"
        if name == "snapkv":
            text += f":w{p['window']}:k{p['kernel']}:{p['pool']}"
        if p.get("sinks"):
            text += f":s{p['sinks']}"
        return text + (":pyramid" if p["layers"] == "pyramid" else "")
    return spell


def prompt_budget(params: dict, prompt: int) -> int:
    """Keys one layer keeps on average of a prompt of `prompt` tokens: B, or the ratio's
    share rounded (at least 1), never more than the prompt (a shorter one is kept whole)."""
    budget = params["budget"]
    keep = round(budget * prompt) if isinstance(budget, float) else budget
    return max(1, min(prompt, keep))


def layer_budgets(params: dict, prompt: int, n_layer: int) -> tuple[int, ...]:
    """Keys each layer keeps: the budget everywhere, or PyramidKV's linear descent from
    the first layer to the last (the last keeps budget / beta, at least the observation
    window), rounded to whole keys that add up to n_layer x the budget exactly."""
    b = prompt_budget(params, prompt)
    if params["layers"] == "uniform" or n_layer == 1:
        return (b,) * n_layer
    bottom = max(b / PYRAMID_BETA, min(params.get("window", 0) + params.get("sinks", 0), b))
    top = 2 * b - bottom
    if top > prompt:  # the first layer cannot keep more than the prompt: flatten
        top, bottom = prompt, 2 * b - prompt
    ideal = [top + (bottom - top) * i / (n_layer - 1) for i in range(n_layer)]
    whole = [int(x) for x in ideal]
    # The remainder, one key each, to the layers that lost most in the rounding.
    short = n_layer * b - sum(whole)
    for i in sorted(range(n_layer), key=lambda i: whole[i] - ideal[i])[:short]:
        whole[i] += 1
    return tuple(whole)


def _compressed_bytes(params: dict, tokens: int, kv_heads: int, head_dim: int, element: int
                      ) -> int:
    """A prompt of `tokens` tokens compressed: K, V and a position for each kept key. The
    mean over layers, which per-layer budgets leave at the uniform budget exactly."""
    kept = prompt_budget(params, tokens)
    return (every_token(params, kept, kv_heads, head_dim, element)
            + kept * kv_heads * POSITION_BYTES)


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


_COMPRESSED_ROLLBACK = ("resets its length back to the compressed prompt: the tokens "
                        "appended after it; a crop into the prompt raises RollbackError")
_COMPRESSED_ROLLBACK_BYTES = "none: the appended slots are overwritten by the next writes"


def _compressed_kind(name: str, summary: str, grammar: str, cls: str,
                     own: dict[str, str]) -> CacheKind:
    return CacheKind(
        name=name, summary=summary, grammar=grammar,
        factory=f"kvcache_cli.caches.compressed:{cls}",
        parse=_compressed_parser(name, own),
        layer_bytes=_compressed_bytes,
        exact=False, bounded=False, pages=False, compiles=False,
        rollback=_COMPRESSED_ROLLBACK, rollback_bytes=_COMPRESSED_ROLLBACK_BYTES,
        spell=_compressed_spell(name), compresses=True,
    )


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
        _int_kind(8), _int_kind(4), _int_kind(2),
        _fp8_kind("fp8-e4m3", aliases=("fp8",)), _fp8_kind("fp8-e5m2"),
        _paged_quant_kind("int8"), _paged_quant_kind("int4"), _paged_quant_kind("fp8"),
        *(CacheKind(
            name=f"quanto-int{bits}",
            summary=f"the peer: transformers' QuantizedCache, quanto backend, {bits} bits "
                    "(needs optimum-quanto)",
            grammar=f"quanto-int{bits}[:gN][:rN] (default quanto-int{bits}:g64:r128)",
            factory="kvcache_cli.caches.peer:QuantoCache",
            parse=_quanto_parser(bits),
            layer_bytes=_quanto_bytes,
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
            parse=_with_positions(_parse_window),
            layer_bytes=_bounded_bytes,
            exact=False, bounded=True, pages=False, compiles=False,
            rollback=_RING_ROLLBACK,
            rollback_bytes=_RING_ROLLBACK_BYTES,
            spell=lambda p: (f"window:{p['window']}" + (f":k{p['spare']}" if p["spare"] else "")
                             + _positions(p)),
            budget=_held,
        ),
        CacheKind(
            name="sink",
            summary="the first S positions for good, then the W newest in a ring "
                    "(StreamingLLM's attention sinks); rerotate: rotary keys at their "
                    "places in the cache",
            grammar="sink:S+W[:kN][:text|rerotate]",
            factory="kvcache_cli.caches.bounded:RingCache",
            parse=_with_positions(_parse_sink),
            layer_bytes=_bounded_bytes,
            exact=False, bounded=True, pages=False, compiles=False,
            rollback=_RING_ROLLBACK,
            rollback_bytes=_RING_ROLLBACK_BYTES,
            spell=lambda p: (f"sink:{p['sinks']}+{p['window']}"
                             + (f":k{p['spare']}" if p["spare"] else "") + _positions(p)),
            budget=_held,
        ),
        CacheKind(
            name="h2o",
            summary="per layer and head, the H positions with the most attention so far "
                    "plus the W newest (H2O); attention computes explicit weights; "
                    "rerotate: rotary keys at their places",
            grammar="h2o:H+W[:text|rerotate]",
            factory="kvcache_cli.caches.bounded:HeavyHitterCache",
            parse=_with_positions(_parse_h2o),
            layer_bytes=_h2o_bytes,
            exact=False, bounded=True, pages=False, compiles=False,
            # It cannot: the attention later tokens drew is summed into the scores, and the
            # evictions those scores decided cannot be taken back (crop refuses, one line).
            rollback="",
            spell=lambda p: f"h2o:{p['heavy']}+{p['recent']}{_positions(p)}",
            budget=_held,
        ),
        _compressed_kind(
            "snapkv", "the prompt compressed once at prefill to B keys per layer and KV head, "
            "chosen by the pooled attention of its last wN tokens (SnapKV); then appends",
            "snapkv:B[:wN][:kN][:avg][:pyramid]", "SnapKVCache",
            {"w": "window", "k": "kernel"}),
        _compressed_kind(
            "knorm", "the prompt compressed once at prefill to the B keys of lowest L2 norm "
            "per layer and KV head (kvpress's KnormPress); then appends",
            "knorm:B[:pyramid]", "KnormCache", {}),
        _compressed_kind(
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
    _check_evicts(spec, kind, tuple(f.lower() for f in fields))
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
            f"context window of {context:,}; expected at most {context:,} (GPT-2's learned "
            "positions end there), or static for every position")


def layer_bytes(spec: CacheSpec, tokens: int, kv_heads: int, head_dim: int,
                element_bytes: int) -> int:
    """Bytes one attention layer's cache holds for one sequence of `tokens` tokens."""
    return spec.info.layer_bytes(dict(spec.params), tokens, kv_heads, head_dim, element_bytes)
