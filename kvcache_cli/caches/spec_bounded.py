"""The bounded and compressed kinds' specs (window, sink, h2o; snapkv and kin): their
fields, position policy and budgets, and the bytes they hold. Torch-free."""

from __future__ import annotations

from collections.abc import Callable

from kvcache_cli import numbers
from kvcache_cli.caches.grammar import (
    CacheKind,
    CacheSpecError,
    Parse,
    every_token,
    give_once,
    lettered,
    whole_number,
)


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


def parse_window(spec: str, fields: tuple[str, ...]) -> dict:
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


def parse_sink(spec: str, fields: tuple[str, ...]) -> dict:
    sinks, window = _two_counts(spec, fields[:1], "sinks", "sink:4+252")
    spare = _spare(spec, fields[1:], "sink:S+W[:kN]")
    if sinks > window:
        raise CacheSpecError(
            f"cache spec {spec!r}: more sinks ({sinks:,}) than window slots ({window:,}); "
            f"expected a few sinks before a larger window (StreamingLLM keeps 4: "
            f"sink:4+{sinks + window - 4})")
    return {"sinks": sinks, "window": window, "spare": spare}


def parse_h2o(spec: str, fields: tuple[str, ...]) -> dict:
    if len(fields) > 1:
        raise CacheSpecError(f"cache spec {spec!r}: unknown field {fields[1]!r}; expected "
                             "h2o:H+W")
    heavy, recent = _two_counts(spec, fields, "heavy hitters", "h2o:128+128")
    return {"heavy": heavy, "recent": recent}


# A bounded kind's rotary position policy (`kvcache_cli.caches.bounded` says what each is).
POSITION_POLICIES = ("text", "rerotate")


def with_positions(parse: Parse) -> Parse:
    """A bounded kind's parser that also takes `text` or `rerotate`, anywhere, once."""
    def parsed(spec: str, fields: tuple[str, ...]) -> dict:
        chosen = [f for f in fields if f in POSITION_POLICIES]
        if len(chosen) > 1:
            raise CacheSpecError(f"cache spec {spec!r}: positions given twice ({chosen[0]}, "
                                 f"{chosen[1]}); expected text or rerotate, once")
        params = parse(spec, tuple(f for f in fields if f not in POSITION_POLICIES))
        return {**params, "positions": chosen[0] if chosen else "text"}
    return parsed


def position_policy(params: dict) -> str:
    """The policy's field as spelled: absent for text (the default)."""
    return "" if params["positions"] == "text" else f":{params['positions']}"


def check_evicts(spec: str, kind: CacheKind, fields: tuple[str, ...]) -> None:
    """Refuse a position policy on a kind that keeps every key where the text put it."""
    policy = next((f for f in fields if f in POSITION_POLICIES), None)
    if policy is not None and not kind.bounded:
        raise CacheSpecError(
            f"cache spec {spec!r}: a rotary position policy ({policy}) is for a cache that "
            f"evicts (window, sink, h2o); {kind.name} keeps every key at its position in "
            f"the text")


def ring_slots(params: dict) -> int:
    """The most positions a bounded kind holds."""
    return sum(n for name, n in params.items() if name != "positions")


def bounded_bytes(params: dict, tokens: int, kv_heads: int, head_dim: int, element: int
                   ) -> int:
    """K and V of min(tokens, the budget) positions: allocated once, then constant."""
    return every_token(params, min(tokens, ring_slots(params)), kv_heads, head_dim, element)


# H2O keeps, per slot and head, its float32 score and its int64 position besides K and V.
H2O_SLOT_EXTRA = 4 + 8


def h2o_bytes(params: dict, tokens: int, kv_heads: int, head_dim: int, element: int) -> int:
    slots = min(tokens, ring_slots(params))
    return (every_token(params, slots, kv_heads, head_dim, element)
            + slots * kv_heads * H2O_SLOT_EXTRA)


RING_ROLLBACK = ("resets its length while the next token's band is intact: any crop "
                  "before the ring wraps, N + 1 positions after with :kN spare slots (1 "
                  "without); else RollbackError")

RING_ROLLBACK_BYTES = ("none: one vector of slot positions is recomputed; the k slots are "
                        "overwritten by the next writes")

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
                give_once(spec, given, "layers", f)
            elif name == "snapkv" and f in ("max", "avg"):
                give_once(spec, given, "pool", f)
            elif lettered(f, "".join(own)):
                what = own[f[0]]
                low = 0 if what == "sinks" else 1
                give_once(spec, given, what, whole_number(spec, what, f[1:], low, 1 << 16))
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


_COMPRESSED_ROLLBACK = ("resets its length back to the compressed prompt: the tokens "
                        "appended after it; a crop into the prompt raises RollbackError")

_COMPRESSED_ROLLBACK_BYTES = "none: the appended slots are overwritten by the next writes"


def compressed_kind(name: str, summary: str, grammar: str, cls: str,
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
