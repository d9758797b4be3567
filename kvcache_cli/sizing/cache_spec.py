"""The bytes of a cache named by a spec (`int4:g32:kchan:r128`, `fp8`, `paged:b16`, ...) for a
real model: payload, scales and zero points, and the tokens kept at full precision, beside
the same cache in fp16, and what fits in a GPU's memory.

The bytes come from the cache family's own formulas (`kvcache_cli.caches.spec.layer_bytes`,
which the caches' `bytes_held` is tested against), so `size` and a running cache agree.
Torch-free, like the rest of `sizing`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcache_cli.caches.grammar import CacheSpecError, every_token
from kvcache_cli.caches.spec import (
    HALF_ENGINES,
    CacheSpec,
    check_context,
    check_spec,
    layer_bytes,
    ring_element,
)
from kvcache_cli.caches.spec_quantized import quantised_split
from kvcache_cli.sizing.arithmetic import _max_tokens, tokens_held
from kvcache_cli.sizing.params import NEED_PARAMS
from kvcache_cli.sizing.shape import ModelShape
from kvcache_cli.sizing.units import (
    DTYPE_BITS,
    SizingError,
    bytes_for_values,
    canonical_dtype,
    check_range,
)


@dataclass(frozen=True)
class SpecFit:
    gpu_mem_bytes: int
    weights_bytes: int
    room_bytes: int  # left for the cache
    max_tokens: int | None  # longest single sequence that fits
    max_sequences: int  # sequences of --seq tokens that fit at once
    fp16_max_sequences: int  # the same with the fp16 cache


@dataclass(frozen=True)
class SpecSize:
    """One cache spec's bytes for one model at `seq` tokens x `batch`."""

    model: str
    spec: str
    full_dtype: str  # the dtype of whatever the spec keeps at full precision
    seq: int
    batch: int
    layers: int  # attention layers counted
    quantised_tokens: int  # per layer and sequence, held as codes (0 for non-integer kinds)
    full_tokens: int  # per layer and sequence, held at full precision
    payload_bytes: int  # one sequence, every layer: the codes
    scale_bytes: int  # ... scales and zero points
    full_bytes: int  # ... residual, sinks and the incomplete tail at full precision
    bytes_per_sequence: int  # the three together
    total_bytes: int  # x batch
    bytes_per_token: float  # bytes_per_sequence / seq
    fp16_bytes_per_sequence: int
    ratio_to_fp16: float
    fit: SpecFit | None
    notes: tuple[str, ...]
    # Where the spec goes on a model with sliding (or chunked) layers: "model" puts it on the
    # full-attention layers, the windowed ones in exact rings of their window at `full_dtype`,
    # or a half kind's 2 bytes (kvcache's HybridCache); "full" puts it on every layer, each
    # holding every position.
    sliding: str = "model"
    spec_layers: int = 0  # the layers holding the spec's kind
    bytes_by_kind: tuple[tuple[str, int, int], ...] = ()  # (layer kind, layers, bytes a sequence)
    other_sliding_bytes: int | None = None  # a sequence under the other choice; None: no window
    ring_dtype: str = ""  # what the rings store: full_dtype, or a half kind's own (fp16, bf16)


def _parts(spec: CacheSpec, n: int, kv_heads: int, head_dim: int, element: int
           ) -> tuple[int, int, int, int, int]:
    """(quantised tokens, full tokens, payload, scales, full-precision bytes), one layer."""
    total = layer_bytes(spec, n, kv_heads, head_dim, element)
    params = dict(spec.params)
    if spec.kind.startswith("quanto-"):  # every token as codes after a prefill
        payload = 2 * kv_heads * n * head_dim * params["bits"] // 8
        return n, 0, payload, total - payload, 0
    if "residual" in params:  # integer kinds
        q, full = quantised_split(params, n)
        payload = 2 * kv_heads * q * head_dim * params["bits"] // 8
        full_bytes = every_token(params, full, kv_heads, head_dim, element)
        return q, full, payload, total - payload - full_bytes, full_bytes
    if spec.kind in HALF_ENGINES:  # every token in 2 bytes a number, not the model's
        return n, 0, total, 0, 0
    if spec.kind.startswith("fp8"):
        payload = every_token(params, n, kv_heads, head_dim, 1)
        return n, 0, payload, total - payload, 0
    if spec.kind.startswith("paged-"):
        slots = -(-n // params["block_size"]) * params["block_size"]
        payload = 2 * kv_heads * slots * head_dim * params["bits"] // 8
        return n, 0, payload, total - payload, 0
    if spec.info.budget is not None:  # a bounded kind holds at most its budget
        return 0, min(n, spec.info.budget(params)), 0, 0, total
    return 0, n, 0, 0, total


SLIDING = ("model", "full")
WINDOWED = ("sliding", "chunked")


def size_spec(shape: ModelShape, spec: CacheSpec, seq: int, batch: int = 1,
              dtype: str = "fp16", gpu_mem: int | None = None,
              weight_dtype: str = "fp16", sliding: str = "model") -> SpecSize:
    """What `spec` holds for `shape` at `seq` tokens x `batch`; `dtype` is the precision of
    the tokens it keeps unquantised (the model's). `sliding` (SLIDING) is where the spec goes
    on a model with windowed layers, as `make_cache(..., sliding=)` builds it."""
    if sliding not in SLIDING:
        raise SizingError(f"--sliding {sliding!r}: expected one of {', '.join(SLIDING)}")
    check_range("--seq", seq)
    check_range("--batch", batch)
    dtype = canonical_dtype(dtype)
    if DTYPE_BITS[dtype] < 16:
        raise SizingError(f"--dtype {dtype} with --cache: expected the model's precision "
                          "(fp32, fp16, bf16) for the tokens the cache keeps unquantised")
    element = DTYPE_BITS[dtype] // 8
    groups = [g for g in shape.layer_groups() if g.kind in ("full", "sliding", "chunked")]
    if "mla" in shape.layer_kinds:
        raise SizingError(f"--cache {spec}: {shape.name} caches an MLA latent, not K and V "
                          "heads; expected a model with multi-head or grouped-query attention")
    if not groups:
        raise SizingError(f"--cache {spec}: {shape.name} has no attention layers to cache")
    try:
        for g in groups:
            check_spec(spec, g.shape.head_dim)
        if shape.max_positions is not None:  # a window past the context is refused
            check_context(spec, shape.max_positions, shape.name)
    except CacheSpecError as error:
        raise SizingError(str(error)) from None

    windowed = any(g.kind in WINDOWED for g in groups)
    if sliding == "full" and not windowed:
        raise SizingError(f"--sliding full: {shape.name} has no sliding-window layers (every "
                          "layer attends in full); expected a model with them, e.g. -m gemma3")
    by_kind, q, full, payload, scales, full_bytes = _sums(shape, groups, seq, element, spec,
                                                          sliding)
    per_sequence = payload + scales + full_bytes
    fp16 = sum(_sums(shape, groups, seq, 2, None, sliding)[3:])
    layers = sum(g.layers for g in groups)
    spec_layers = sum(g.layers for g in groups if sliding == "full" or g.kind not in WINDOWED)
    other = None
    if windowed:
        other = sum(_sums(shape, groups, seq, element, spec,
                          "full" if sliding == "model" else "model")[3:])
    notes = []
    if spec_layers == 0:
        notes.append(f"every attention layer of {shape.name} slides over a window, so the "
                     "spec holds none: expected --sliding full to give them the spec")
    fit = None
    if gpu_mem is not None:
        if shape.params is None:
            raise SizingError(NEED_PARAMS)
        weights = bytes_for_values(shape.params, DTYPE_BITS[canonical_dtype(weight_dtype)])
        if weights >= gpu_mem:
            raise SizingError(f"--gpu-mem {gpu_mem:,} bytes is not more than the weights "
                              f"({weights:,} bytes); expected more memory")
        room = gpu_mem - weights

        def cost(n: int) -> int:
            return sum(_sums(shape, groups, n, element, spec, sliding)[3:])

        # A lower bound of the bytes each token adds (its codes alone) bounds the search.
        bits = dict(spec.params).get("bits", 8 if spec.kind.startswith("fp8") else 8 * element)
        growing = sum(g.layers * 2 * g.shape.kv_heads * g.shape.head_dim * bits
                      for g in groups if g.kind == "full" or (
                          sliding == "full" and g.kind in WINDOWED)) // 8
        budget = spec.info.budget(dict(spec.params)) if spec.info.budget else 0
        if budget:  # a bounded kind stops growing at its budget: no token adds for ever
            growing = 0
        longest = _max_tokens(cost, room, growing, max(shape.window or 0, budget, 1))
        fit = SpecFit(gpu_mem, weights, room, longest, room // per_sequence, room // fp16)
        if spec.kind.startswith("int"):
            notes.append("a group leaving the residual shrinks the cache, so the longest "
                         "sequence is exact only to within one group of tokens")
    return SpecSize(
        model=shape.name, spec=str(spec), full_dtype=dtype, seq=seq, batch=batch,
        layers=layers, quantised_tokens=q, full_tokens=full, payload_bytes=payload,
        scale_bytes=scales, full_bytes=full_bytes, bytes_per_sequence=per_sequence,
        total_bytes=per_sequence * batch, bytes_per_token=per_sequence / seq,
        fp16_bytes_per_sequence=fp16, ratio_to_fp16=per_sequence / fp16, fit=fit,
        notes=tuple(notes), sliding=sliding, spec_layers=spec_layers, bytes_by_kind=by_kind,
        other_sliding_bytes=other, ring_dtype=spec.kind if spec.kind in HALF_ENGINES else dtype,
    )


def _sums(shape: ModelShape, groups, n: int, elem: int, spec: CacheSpec | None,
          sliding: str) -> tuple:
    """((kind, layers, bytes) per layer kind, then the quantised and full-precision tokens
    of one layer holding the spec, payload, scales and full-precision bytes summed over the
    layers) at `n` tokens; spec None: the model's exact cache at `elem` bytes a number."""
    kinds: dict[str, list[int]] = {}
    q = full = 0
    out = [0, 0, 0]
    for g in groups:
        ring = g.kind in WINDOWED and sliding == "model"
        if spec is None or ring:  # the exact cache: a windowed layer holds its window
            held = tokens_held(shape, g.kind, n)
            window = every_token({}, held, g.shape.kv_heads, g.shape.head_dim,
                                 ring_element(spec, elem))
            # a half kind's rings: its 2 bytes a number, counted with its codes
            half = spec is not None and spec.kind in HALF_ENGINES
            parts = (0, held, window, 0, 0) if half else (0, held, 0, 0, window)
        else:  # the spec's kind; under "full" a windowed layer holds every position too
            parts = _parts(spec, n, g.shape.kv_heads, g.shape.head_dim, elem)
            q, full = parts[:2]
        out = [a + g.layers * b for a, b in zip(out, parts[2:])]
        entry = kinds.setdefault(g.kind, [0, 0])
        entry[0] += g.layers
        entry[1] += g.layers * sum(parts[2:])
    if spec is None or not q + full:  # no layer holds the spec: the first group's tokens
        q, full = 0, tokens_held(shape, groups[0].kind, n)
    return (tuple((k, c, b) for k, (c, b) in kinds.items()), q, full, *out)


@dataclass(frozen=True)
class SpecLayers:
    """Which layers of a model a `--cache` spec holds (`sliding="model"`): the
    full-attention ones; the windowed ones hold exact rings of their window."""

    model: str
    spec_layers: tuple[int, ...]  # layer indices holding the spec's kind
    windowed_layers: tuple[int, ...]  # sliding or chunked: rings of `window`
    windowed_kind: str | None  # "sliding" or "chunked"; None: every layer attends in full
    window: int | None


def spec_layers(shape: ModelShape) -> SpecLayers:
    """The layers a spec goes on for `shape`, as `make_cache(..., sliding="model")` builds
    it, and the windowed ones beside them."""
    kinds = shape.layer_kinds
    windowed = tuple(i for i, k in enumerate(kinds) if k in WINDOWED)
    return SpecLayers(shape.name, tuple(i for i, k in enumerate(kinds) if k == "full"),
                      windowed, kinds[windowed[0]] if windowed else None,
                      shape.window if windowed else None)
