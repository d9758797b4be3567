"""The quantised kinds' specs (int8/int4/int2, fp8, the quantised pools, quanto): their
fields, defaults and spellings, and the bytes they hold, codes and scales counted. Torch-free."""

from __future__ import annotations

from kvcache_cli.caches.grammar import (
    CacheKind,
    CacheSpecError,
    Parse,
    every_token,
    give_once,
    lettered,
    parse_paged,
    whole_number,
)

SCALE_BYTES = 2  # scales and zero points of the integer kinds are float16

FP8_SCALE_BYTES = 4  # fp8 scales are float32 (vLLM's)

_INT_DEFAULTS = {8: ("ktok", 0), 4: ("kchan", 128), 2: ("kchan", 128)}


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
            give_once(spec, given, what, value)
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
        give_once(spec, given, what, 1 if what == "rotate" else f)
    return {"scale": "tensor", "init": "one", "rotate": 0, **given}


def _fp8_bytes(p: dict, tokens: int, kv_heads: int, head_dim: int, element: int) -> int:
    scales = 2 * (kv_heads if p["scale"] == "head" else 1)  # K's and V's
    return every_token(p, tokens, kv_heads, head_dim, 1) + FP8_SCALE_BYTES * scales


def _paged_quant_parser(fmt: str) -> Parse:
    def parse(spec: str, fields: tuple[str, ...]) -> dict:
        params = parse_paged(spec, fields)
        return {"bits": 8 if fmt == "fp8" else int(fmt[3:]), "fmt": fmt, **params}
    return parse


def _paged_quant_bytes(p: dict, tokens: int, kv_heads: int, head_dim: int, element: int) -> int:
    """Whole blocks of codes; int: one float16 scale and zero per head and token, K and V."""
    slots = -(-tokens // p["block_size"]) * p["block_size"]
    payload = 2 * slots * kv_heads * head_dim * p["bits"] // 8
    return payload + (0 if p["fmt"] == "fp8" else 2 * 2 * SCALE_BYTES * slots * kv_heads)


def quanto_parser(bits: int) -> Parse:
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


def quanto_bytes(p: dict, tokens: int, kv_heads: int, head_dim: int, element: int) -> int:
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


def int_kind(bits: int) -> CacheKind:
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


def fp8_kind(fmt: str, aliases: tuple[str, ...] = ()) -> CacheKind:
    return CacheKind(
        name=fmt,
        summary=f"float8 {fmt[4:]} codes over a float32 scale per tensor or head, 1.0 or "
                f"calibrated on the prompt; saturation counted (vLLM's fp8 cache); rot: "
                f"Hadamard-rotated first",
        grammar=f"{fmt}[:tensor|head][:one|calib][:rot]",
        factory="kvcache_cli.caches.fp8:Fp8Cache",
        parse=_fp8_parse,
        layer_bytes=_fp8_bytes,
        exact=False, bounded=False, pages=False, compiles=False,
        rollback="drops the newest tokens (each is stored alone; the scales stay)",
        rollback_bytes="none at the crop (views); the next append copies the kept "
                       "codes, as every append does",
        aliases=aliases,
        spell=lambda p: f"{fmt}:{p['scale']}:{p['init']}{_rot(p)}",
    )


def paged_quant_kind(fmt: str) -> CacheKind:
    return CacheKind(
        name=f"paged-{fmt}",
        summary=f"serve's block pool in {fmt}: every token quantised as written "
                f"({'scale 1.0' if fmt == 'fp8' else 'a float16 scale and zero per head'})",
        grammar=f"paged-{fmt}[:bN]",
        factory="kvcache_cli.caches.quantized_pool:QuantPagedCache",
        parse=_paged_quant_parser(fmt),
        layer_bytes=_paged_quant_bytes,
        exact=False, bounded=False, pages=True, compiles=False,
        rollback="resets its length; a pool frees the tail blocks no other sequence shares",
        rollback_bytes="none: whole blocks go back to the free list, the cut block's k "
                       "slots are overwritten later",
        spell=lambda p: f"paged-{fmt}:b{p['block_size']}",
    )
