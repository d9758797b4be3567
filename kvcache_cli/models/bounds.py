"""The numbers a Llama's shape may hold, and how they must agree: one table, read by the GGUF
reader (naming its metadata keys), by the check of a converted folder's config.json and by
a safetensors folder's loader (naming their fields). Torch-free.

A number outside its range, a float that is NaN, infinite, zero or negative where the
model divides or takes a root, heads that do not divide the width, KV heads that do not
divide the heads, rotary dimensions that are not the head's: each is one ValueError naming
the key, the value and the bound. So is a shape whose weights, or whose static cache at the
full context (2 × layers × KV heads × head size × context × 4 bytes), would not fit in this
machine's memory: refused before anything is allocated, not left to the allocator.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

from kvcache_cli.sizing.units import shown

FLOAT_BYTES = 4  # kvcache reads every model in float32, and runs it so by default


@dataclass(frozen=True)
class Bound:
    field: str  # LlamaConfig's name, and a converted folder's config.json's
    key: str  # the GGUF metadata key, after "{architecture}."
    low: float  # the least value allowed (for a float: the value must be above it)
    high: float
    whole: bool = True


BOUNDS = {b.field: b for b in (
    Bound("n_layer", "block_count", 1, 1000),
    Bound("n_head", "attention.head_count", 1, 1024),
    Bound("n_kv_head", "attention.head_count_kv", 1, 1024),
    Bound("n_embd", "embedding_length", 1, 2**16),
    Bound("intermediate", "feed_forward_length", 1, 2**18),
    Bound("context", "context_length", 1, 2**20),
    Bound("head_dim", "attention.key_length", 2, 4096),
    Bound("vocab_size", "vocab_size", 1, 2**24),
    # theta^(-2i/hs) are the rotation's frequencies: at 1 or below they stop falling.
    Bound("rope_theta", "rope.freq_base", 1.0, 1e12, whole=False),
    Bound("rms_eps", "attention.layer_norm_rms_epsilon", 0.0, 1.0, whole=False),
)}


def expected(b: Bound) -> str:
    if b.whole:
        return f"a whole number from {b.low:,} to {b.high:,}"
    return f"a finite number above {b.low:g} and at most {b.high:g}"


def number(b: Bound, value, name: str) -> int | float:
    """`value` if it is a number of `b`'s kind within `b`, else a ValueError naming `name`."""
    ok = False
    if isinstance(value, bool):
        pass
    elif b.whole:
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # 128.0 stored as a float is still 128
        ok = isinstance(value, int) and b.low <= value <= b.high
    elif isinstance(value, (int, float)):
        value = float(value)
        ok = math.isfinite(value) and b.low < value <= b.high
    if not ok:
        raise ValueError(f"{name} is {shown(value)}; expected {expected(b)}")
    return value


def check_shape(f: dict, name: Callable[[str], str]) -> None:
    """Cross-checks of a shape's fields (already each within its bound); `name(field)` is
    how a refusal names a field (its GGUF key, or its config.json name)."""
    n_head, n_kv = f["n_head"], f["n_kv_head"]
    if n_head % n_kv:
        raise ValueError(f"{name('n_head')} {n_head:,} is not a multiple of "
                         f"{name('n_kv_head')} {n_kv:,}; expected query heads in equal "
                         "groups, one per KV head")
    if f.get("head_dim") is None and f["n_embd"] % n_head:
        raise ValueError(f"{name('n_embd')} {f['n_embd']:,} is not a multiple of "
                         f"{name('n_head')} {n_head:,}; expected whole heads")
    hs = head_size(f)
    if hs % 2:
        raise ValueError(f"head size {hs:,} ({name('head_dim')}, or {name('n_embd')} / "
                         f"{name('n_head')}) is odd; expected an even one: rotary positions "
                         "turn pairs")
    # The weights are read whole to convert a GGUF (and to size it); the whole context's
    # cache is checked by the loader only: `size` prices a 10M-token context, allocating none.
    check_weights_memory(f)


def head_size(f: dict) -> int:
    return f.get("head_dim") or f["n_embd"] // f["n_head"]


def physical_memory() -> int | None:
    """This machine's memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


def check_weights_memory(f: dict) -> int:
    """Refuse a shape whose float32 weights would not fit in memory; their bytes."""
    C, L, hs = f["n_embd"], f["n_layer"], head_size(f)
    params = (L * (C * hs * 2 * (f["n_head"] + f["n_kv_head"]) + 3 * C * f["intermediate"]
                   + 2 * C) + C + f["vocab_size"] * C)  # a tied head: the least it can be
    weights = params * FLOAT_BYTES
    memory = physical_memory()
    if memory is not None and weights > memory:
        raise ValueError(f"this shape's float32 weights take {gib(weights)} ({params:,} "
                         f"parameters), more than this machine's {gib(memory)} of memory; "
                         "expected a model that fits")
    return weights


def check_memory(f: dict, name: Callable[[str], str]) -> None:
    """Refuse, where a model is loaded to run, a shape whose float32 weights, or those and a
    static cache of its whole context (and the rotary tables, one row a position), would
    not fit in memory."""
    weights = check_weights_memory(f)
    memory = physical_memory()
    if memory is None:
        return
    L, hs, T = f["n_layer"], head_size(f), f["context"]
    cache = 2 * L * f["n_kv_head"] * hs * T * FLOAT_BYTES  # K and V, every layer
    rotary = 2 * T * hs * FLOAT_BYTES  # cos and sin, one row a position
    if weights + cache + rotary > memory:
        raise ValueError(f"{name('context')} {T:,}: a static cache of the whole context "
                         f"takes {gib(cache)} in float32 (2 × {L:,} layers × {f['n_kv_head']:,}"
                         f" KV heads × {hs:,} × {T:,} positions × 4 bytes), with the weights "
                         f"more than this machine's {gib(memory)} of memory; expected a "
                         "context whose cache fits")
