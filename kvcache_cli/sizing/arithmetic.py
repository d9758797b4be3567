"""The arithmetic: bytes per token for each layer kind, the recurrent state, the cache at a
length and batch, tensor parallel, and what fits on one GPU. Pure computation on Python ints
(exact, never overflowing) returning frozen dataclasses; `kvcache_cli.views.sizing` renders them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcache_cli.sizing.params import NEED_PARAMS
from kvcache_cli.sizing.shape import LayerGroup, ModelShape
from kvcache_cli.sizing.units import (
    DTYPE_BITS,
    SizingError,
    bytes_for_values,
    canonical_dtype,
    check_range,
    format_bytes,
)

if TYPE_CHECKING:
    from kvcache_cli.sizing.reports import EngineFit, LiveKinds, Verification




def values_per_token(shape: ModelShape, kind: str, kv_heads: int | None = None) -> int:
    """Numbers one layer of `kind` caches per token (K and V together)."""
    if kind in ("recurrent", "none"):
        return 0
    if kind == "mla" or _windowed_latent(shape, kind):
        # One latent c_KV, decompressed into both K and V at attention time, plus the rotary
        # key shared by every head: no factor 2, no heads. A sparse-attention indexer
        # (DeepSeek-V3.2) adds its own single-head key.
        return shape.kv_lora_rank + shape.qk_rope_head_dim + shape.index_head_dim
    # K and V, each kv_heads × its width (V's width differs from K's in a few models).
    heads = shape.kv_heads if kv_heads is None else kv_heads
    return heads * (shape.head_dim + (shape.v_head_dim or shape.head_dim)) + shape.index_head_dim


def _windowed_latent(shape: ModelShape, kind: str) -> bool:
    """A sliding or chunked layer of an MLA model: the latent, held for the window only
    (rednote-hilab's dots3 note models)."""
    return kind in ("sliding", "chunked") and bool(shape.kv_lora_rank)


def mha_values_per_token(shape: ModelShape, kind: str) -> int:
    """The same layer with one K and one V per query head: the multi-head baseline."""
    if kind in ("recurrent", "none"):
        return 0
    if kind == "mla" or _windowed_latent(shape, kind):
        # What an implementation that decompresses the latent would cache per head.
        return shape.heads * (shape.qk_nope_head_dim + shape.qk_rope_head_dim + shape.v_head_dim)
    return shape.heads * (shape.head_dim + (shape.v_head_dim or shape.head_dim))


def tokens_held(shape: ModelShape, kind: str, seq: int, bound: int | None = None) -> int:
    """Tokens a layer of `kind` holds once a sequence is `seq` tokens long; `bound` caps
    every attention layer (a bounded cache: `--window W --sinks S` holds S + W)."""
    if kind in ("recurrent", "none"):
        return 0
    held = min(seq, shape.window) if kind in ("sliding", "chunked") else seq
    return held if bound is None else min(held, bound)


def check_bound(window: int | None, sinks: int, max_positions: int | None) -> int | None:
    """The positions a bounded cache keeps (sinks + window), or None for an exact cache;
    a SizingError for a bound that cannot be meant."""
    if window is None:
        if sinks:
            raise SizingError(f"--sinks {sinks:,} given without --window: expected both, the "
                              "sinks are kept before a window (e.g. --window 1020 --sinks 4)")
        return None
    check_range("--window", window)
    check_range("--sinks", sinks, low=0)
    if sinks > window:
        raise SizingError(f"--sinks {sinks:,} is more than --window {window:,}: expected a few "
                          "sinks before a larger window (StreamingLLM keeps 4)")
    if max_positions is not None and sinks + window > max_positions:
        asked = f"--window {window:,}" + (
            f" + --sinks {sinks:,} = {sinks + window:,} positions" if sinks else "")
        raise SizingError(f"{asked} is beyond the context window of {max_positions:,}; "
                          f"expected at most {max_positions:,} positions in all")
    return sinks + window


def state_bytes_per_sequence(shape: ModelShape, bits: int) -> int:
    """Bytes of recurrent state (convolution + SSM) one sequence keeps, whatever its length."""
    ssm_bits = shape.ssm_state_bits or bits
    return shape.state_layers * (bytes_for_values(shape.conv_state_values, bits)
                                 + bytes_for_values(shape.ssm_state_values, ssm_bits))


def _round_up(n: int, block: int | None) -> int:
    return n if not block else -(-n // block) * block


@dataclass(frozen=True)
class KindRow:
    """One kind of layer in the model: how many there are and what each holds."""

    kind: str
    layers: int
    values_per_token: int  # numbers one layer caches per token (K and V together)
    bytes_per_token_per_layer: int
    tokens_held: int  # per sequence, at --seq
    total_bytes: int  # all layers of this kind, seq × batch
    formula: str  # the formula for this kind, in symbols ('' for layers without KV)
    substituted: str  # the same with this model's numbers


@dataclass(frozen=True)
class TensorParallel:
    """The cache of one GPU when attention heads are split across `tp` GPUs."""

    tp: int
    kv_heads_per_gpu: int  # standard attention layers; 0 when the model has none
    replicas: int  # GPUs that hold a copy of each KV head (1 = no replication)
    bytes_per_token_per_gpu: int
    total_bytes_per_gpu: int  # seq × batch, one GPU
    total_bytes_all_gpus: int  # counting replicas: what the cluster actually allocates
    note: str


@dataclass(frozen=True)
class Fit:
    """What fits on one GPU of `gpu_mem` bytes beside the weights."""

    gpu_mem_bytes: int
    weight_dtype: str
    params: int
    weights_bytes: int  # whole model
    weights_bytes_per_gpu: int  # split across --tp GPUs
    room_bytes: int  # left for the cache on one GPU
    state_bytes_per_sequence: int  # recurrent state one sequence takes on this GPU, any length
    max_tokens: int | None  # longest single sequence whose cache fits; None: no limit
    max_sequences: int | None  # concurrent sequences of --seq tokens; None: no limit
    batch_bytes_per_gpu: int  # the --batch × --seq cache this GPU would hold
    batch_fits: bool
    block_size: int | None
    paged_bytes_per_sequence: int | None  # one --seq sequence rounded up to whole blocks
    paged_waste_bytes_per_sequence: int | None
    max_sequences_paged: int | None
    max_tokens_paged: int | None


@dataclass(frozen=True)
class SizeResult:
    """Everything `kvcache size` shows, as raw numbers; the views format them."""

    model: str
    source: str
    shape: ModelShape
    dtype: str
    dtype_bits: int
    seq: int
    batch: int
    bytes_per_token: int  # whole model, one token in every KV layer, batch 1
    bytes_per_token_per_layer: int  # one layer of the model's main attention kind
    total_bytes: int  # KV cache, seq × batch, whole model (unique bytes, no TP replicas)
    state_bytes_per_sequence: int  # recurrent state (conv + SSM) of one sequence, any length
    state_bytes: int  # recurrent state × batch; memory beside total_bytes
    kinds: tuple[KindRow, ...]
    formula: tuple[str, ...]
    mha_bytes_per_token: int | None
    mha_total_bytes: int | None
    reduction: float | None  # multi-head bytes / these bytes
    tp: TensorParallel | None
    fit: Fit | None
    notes: tuple[str, ...]
    verify: Verification | None = None
    window: int | None = None  # a bounded cache (--window): the recent positions it keeps
    sinks: int = 0  # ... and the first positions it keeps for good (--sinks)
    # A model kvcache runs (-m smollm2): what every cache kind holds for it (sizing.live).
    live: LiveKinds | None = None
    # --engine: what vLLM, SGLang or llama.cpp allocates, and the command (sizing.engines).
    engine: EngineFit | None = None


def _kind_formula(shape: ModelShape, kind: str, n: int, seq: int, bits: int,
                  batch: int, bound: int | None = None) -> tuple[str, str]:
    """The formula for one kind of layer, in symbols and with this model's numbers."""
    size = f"{bits // 8}" if bits >= 8 else f"{bits / 8:g}"
    caps, values = ["seq_len"], [f"{seq:,}"]
    if kind in ("sliding", "chunked"):
        caps.append("window")
        values.append(f"{shape.window:,}")
    if bound is not None:  # a bounded cache's budget caps every layer
        caps.append("sinks + cache_window")
        values.append(f"{bound:,}")
    tokens = f"min({', '.join(caps)})" if len(caps) > 1 else caps[0]
    held = f"min({', '.join(values)})" if len(values) > 1 else values[0]
    # DeepSeek-V3.2's indexer key: one more single-head key per token, beside the K/V.
    index, index_n = ("", "") if not shape.index_head_dim else (
        " + index_head_dim", f" + {shape.index_head_dim}")
    if kind == "mla" or _windowed_latent(shape, kind):
        return (
            f"layers × (kv_lora_rank + qk_rope_head_dim{index}) × {tokens} × dtype_bytes × "
            "batch",
            f"{n} × ({shape.kv_lora_rank} + {shape.qk_rope_head_dim}{index_n}) × {held} × "
            f"{size} × {batch:,}",
        )
    if index:
        return (
            f"layers × (kv_heads × (head_dim + v_head_dim){index}) × {tokens} × dtype_bytes × "
            "batch",
            f"{n} × ({shape.kv_heads} × ({shape.head_dim} + {shape.v_head_dim or shape.head_dim})"
            f"{index_n}) × {held} × {size} × {batch:,}",
        )
    if shape.v_head_dim and shape.v_head_dim != shape.head_dim:
        return (
            f"layers × kv_heads × (head_dim + v_head_dim) × {tokens} × dtype_bytes × batch",
            f"{n} × {shape.kv_heads} × ({shape.head_dim} + {shape.v_head_dim}) × {held} × {size} "
            f"× {batch:,}",
        )
    return (
        f"2 × layers × kv_heads × head_dim × {tokens} × dtype_bytes × batch",
        f"2 × {n} × {shape.kv_heads} × {shape.head_dim} × {held} × {size} × {batch:,}",
    )


def _max_tokens(cost, room: int, growing: int, bounded_at: int) -> int | None:
    """Longest sequence n with cost(n) ≤ room; None when the cost stops growing below room.

    cost is non-decreasing in n, so a binary search finds it exactly for any mix of full,
    sliding and paged layers.
    """
    if growing == 0:
        if cost(bounded_at) <= room:
            return None
        hi = bounded_at
    else:
        hi = room // growing + 1  # cost(n) ≥ growing · n, so hi cannot fit
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(mid) <= room:
            lo = mid
        else:
            hi = mid - 1
    return lo


def size_cache(
    shape: ModelShape,
    seq: int | None = None,
    batch: int = 1,
    dtype: str = "fp16",
    tp: int = 1,
    gpu_mem: int | None = None,
    weight_dtype: str = "fp16",
    block_size: int | None = None,
    window: int | None = None,
    sinks: int = 0,
) -> SizeResult:
    """The KV cache of `shape` at `seq` tokens × `batch`, per GPU under `tp`, and what fits.

    seq defaults to the model's context window when the config declares one. `window`
    (and `sinks`) size a bounded cache instead: every attention layer keeps at most the
    `sinks` first and `window` newest positions (kvcache's `window:W`, `sink:S+W`).
    """
    notes: list[str] = []
    bound = check_bound(window, sinks, shape.max_positions)
    seq = _checked_request(shape, seq, batch, tp, gpu_mem, block_size, notes)
    dtype = canonical_dtype(dtype)
    bits = DTYPE_BITS[dtype]
    weight_dtype = canonical_dtype(weight_dtype)
    if shape.max_positions is not None and seq > shape.max_positions:
        notes.append(
            f"--seq {seq:,} is past the context window the config declares "
            f"({shape.max_positions:,}); the bytes are still what such a cache would hold"
        )

    groups = shape.layer_groups()
    kinds = _kind_rows(shape, groups, seq, bits, batch, bound)
    total_bytes = sum(row.total_bytes for row in kinds)
    bytes_per_token = sum(row.layers * row.bytes_per_token_per_layer for row in kinds)
    main = max(kinds, key=lambda row: (row.values_per_token > 0, row.layers))
    formula = _formula(kinds, total_bytes)
    notes.extend(shape.notes)
    state_per_sequence = state_bytes_per_sequence(shape, bits)
    notes += _held_notes(shape, bound, window, sinks, state_per_sequence, dtype, bits)
    mha_per_token, mha_total, reduction = _mha_baseline(shape, groups, seq, bits, batch, bound,
                                                        total_bytes, notes)

    tp_result = (_tensor_parallel(shape, groups, bits, seq, batch, tp, bound) if tp > 1
                 else None)
    state_per_gpu = -(-state_per_sequence // tp)
    per_gpu = _per_gpu_bytes_per_token(groups, bits, tp)

    fit = None
    if gpu_mem is not None:
        fit = _fit(shape, groups, per_gpu, state_per_gpu, seq, batch, tp, gpu_mem, weight_dtype,
                   block_size, bound)

    return SizeResult(
        model=shape.name,
        source=shape.source,
        shape=shape,
        dtype=dtype,
        dtype_bits=bits,
        seq=seq,
        batch=batch,
        bytes_per_token=bytes_per_token,
        bytes_per_token_per_layer=main.bytes_per_token_per_layer,
        total_bytes=total_bytes,
        state_bytes_per_sequence=state_per_sequence,
        state_bytes=state_per_sequence * batch,
        kinds=tuple(kinds),
        formula=tuple(formula),
        mha_bytes_per_token=mha_per_token,
        mha_total_bytes=mha_total,
        reduction=reduction,
        tp=tp_result,
        fit=fit,
        notes=tuple(notes),
        window=window,
        sinks=sinks if window is not None else 0,
    )


def _checked_request(shape: ModelShape, seq: int | None, batch: int, tp: int,
                     gpu_mem: int | None, block_size: int | None, notes: list[str]) -> int:
    """The sequence length to size (the context window when none is given), every count
    checked against its range."""
    if seq is None:
        if shape.max_positions is None:
            raise SizingError("no --seq given and the model declares no context window; "
                              "expected --seq N")
        seq = shape.max_positions
        notes.append(f"--seq defaults to the model's context window, {seq:,} tokens")
    check_range("--seq", seq)
    check_range("--batch", batch)
    check_range("--tp", tp)
    if block_size is not None:
        check_range("--block-size", block_size)
        if gpu_mem is None:
            raise SizingError(f"--block-size {block_size} given without --gpu-mem: expected "
                              "both, the block size only changes what fits")
    return seq


def _kind_rows(shape: ModelShape, groups, seq: int, bits: int, batch: int,
               bound: int | None) -> list[KindRow]:
    """One row per kind of layer: its values and bytes per token, positions held, total."""
    kinds: list[KindRow] = []
    for g in groups:
        values = values_per_token(g.shape, g.kind)
        per_layer = bytes_for_values(values, bits)
        held = tokens_held(shape, g.kind, seq, bound)
        total = g.layers * per_layer * held * batch
        symbols, numbers = ("", "") if not values else _kind_formula(
            g.shape, g.kind, g.layers, seq, bits, batch, bound)
        kinds.append(KindRow(g.kind, g.layers, values, per_layer, held, total, symbols, numbers))
    return kinds


def _formula(kinds: list[KindRow], total_bytes: int) -> list[str]:
    """The formula's lines: each kind's, substituted and summed, then the total of several."""
    with_kv = [row for row in kinds if row.formula]
    formula = []
    for row in with_kv:
        indent = ""
        if len(with_kv) > 1:
            formula.append(f"{row.kind} ({row.layers} layers):")
            indent = "  "
        formula += [f"{indent}bytes = {row.formula}", f"{indent}      = {row.substituted}",
                    f"{indent}      = {row.total_bytes:,}"]
    if len(with_kv) > 1:
        formula.append(f"total = {' + '.join(f'{r.total_bytes:,}' for r in with_kv)} "
                       f"= {total_bytes:,} bytes")
    return formula


def _held_notes(shape: ModelShape, bound: int | None, window: int | None, sinks: int,
                state_per_sequence: int, dtype: str, bits: int) -> list[str]:
    """What the bytes do not say by themselves: a bound, no attention, a recurrent state,
    values counted without their scales."""
    notes = []
    if bound is not None:
        kept = f"the first {sinks:,} and the newest {window:,}" if sinks else (
            f"the newest {window:,}")
        notes.append(f"a bounded cache: every attention layer keeps {kept} positions, so its "
                     f"bytes stop growing at {bound:,} tokens; the positions past it are "
                     "evicted, not free (quality depends on what attention needed)")
    if not shape.has_kv:
        notes.append("the model has no attention layers: its KV cache is 0 bytes at any length")
    if state_per_sequence:
        notes.append(
            f"{shape.state_layers} recurrent layers keep {format_bytes(state_per_sequence)} of "
            "state per sequence (convolution + SSM), the same at any length"
        )
        if not shape.ssm_state_bits and bits < 32:
            notes.append(f"the SSM state is counted at {dtype}; implementations that keep it in "
                         "fp32 (transformers' Jamba, or mamba_ssm_cache_dtype) hold more")
    if bits < 16:
        notes.append(
            f"{dtype} counts the values only; per-group scales add a few percent in practice"
        )
    return notes


def _mha_baseline(shape: ModelShape, groups, seq: int, bits: int, batch: int, bound: int | None,
                  total_bytes: int, notes: list[str]
                  ) -> tuple[int | None, int | None, float | None]:
    """(bytes per token, total bytes, this cache's reduction) of the same model with one KV
    head per query head: the baseline GQA and MLA are measured against. None without heads."""
    if shape.heads is None:
        return None, None, None
    mha_per_layer = [bytes_for_values(mha_values_per_token(g.shape, g.kind), bits)
                     for g in groups]
    mha_per_token = sum(g.layers * b for g, b in zip(groups, mha_per_layer, strict=True))
    mha_total = sum(g.layers * b * tokens_held(shape, g.kind, seq, bound) * batch
                    for g, b in zip(groups, mha_per_layer, strict=True))
    reduction = mha_total / total_bytes if total_bytes else None
    if shape.is_mla:
        notes.append(
            "the multi-head baseline for MLA is the decompressed cache: "
            f"{shape.heads} heads × ({shape.qk_nope_head_dim} + {shape.qk_rope_head_dim} key "
            f"+ {shape.v_head_dim} value) per token per layer"
        )
    return mha_per_token, mha_total, reduction


def _kv_heads_per_gpu(shape: ModelShape, tp: int) -> int:
    """KV heads on each GPU: split evenly, or one replicated head when there are fewer than GPUs.

    These are the rules vLLM enforces: query heads must split evenly, and KV heads either
    split evenly or divide the GPU count so that whole groups of GPUs share one head.
    """
    if shape.heads is not None and shape.heads % tp:
        raise SizingError(
            f"--tp {tp} does not divide the {shape.heads} attention heads: expected a divisor "
            f"of {shape.heads}"
        )
    if shape.is_mla or not shape.has_kv:
        return 0
    if shape.kv_heads >= tp:
        if shape.kv_heads % tp:
            raise SizingError(
                f"--tp {tp} does not divide the {shape.kv_heads} KV heads: expected a divisor of "
                f"{shape.kv_heads}, or a multiple of it to replicate them"
            )
        return shape.kv_heads // tp
    if tp % shape.kv_heads:
        raise SizingError(
            f"--tp {tp} is not a multiple of the {shape.kv_heads} KV heads: with fewer KV heads "
            "than GPUs each head is replicated, so expected a multiple"
        )
    return 1


def _per_gpu_bytes_per_token(groups: tuple[LayerGroup, ...], bits: int, tp: int) -> list[int]:
    """Bytes per token per layer on one GPU, for each group of layers."""
    return [
        # The MLA latent belongs to no head, so it cannot be split: every GPU keeps all of it.
        bytes_for_values(values_per_token(
            g.shape, g.kind, kv_heads=None if g.shape.is_mla else _kv_heads_per_gpu(g.shape, tp)
        ), bits)
        for g in groups
    ]


def _tensor_parallel(shape: ModelShape, groups: tuple[LayerGroup, ...], bits: int, seq: int,
                     batch: int, tp: int, bound: int | None = None) -> TensorParallel:
    heads = _kv_heads_per_gpu(shape, tp)
    per_layer = _per_gpu_bytes_per_token(groups, bits, tp)
    per_token = sum(g.layers * b for g, b in zip(groups, per_layer, strict=True))
    per_gpu = sum(g.layers * b * tokens_held(shape, g.kind, seq, bound) * batch
                  for g, b in zip(groups, per_layer, strict=True))
    if shape.is_mla:
        replicas = tp
        note = (f"the MLA latent is shared by all heads, so it cannot be split: each of the {tp} "
                "GPUs holds the whole latent cache")
    elif heads and shape.kv_heads < tp:
        replicas = tp // shape.kv_heads
        note = (f"{shape.kv_heads} KV heads over {tp} GPUs: each head is replicated on "
                f"{replicas} GPUs, so each GPU holds 1 head")
    else:
        replicas = 1
        note = f"{shape.kv_heads} KV heads split {heads} per GPU; no replication"
    return TensorParallel(tp, heads, replicas, per_token, per_gpu, per_gpu * tp, note)


def _fit(shape: ModelShape, groups: tuple[LayerGroup, ...], per_layer: list[int], state: int,
         seq: int, batch: int, tp: int, gpu_mem: int, weight_dtype: str,
         block_size: int | None, bound: int | None = None) -> Fit:
    if shape.params is None:
        raise SizingError(NEED_PARAMS)
    weights = bytes_for_values(shape.params, DTYPE_BITS[weight_dtype])
    # Tensor parallel splits every weight matrix; the norms it replicates are negligible.
    weights_per_gpu = -(-weights // tp)
    if weights_per_gpu >= gpu_mem:
        split = f" per GPU at --tp {tp}" if tp > 1 else ""
        raise SizingError(
            f"--gpu-mem {format_bytes(gpu_mem)} ({gpu_mem:,} bytes) is not more than the "
            f"weights{split}: {shape.params:,} params × {weight_dtype} = "
            f"{format_bytes(weights_per_gpu)}; expected more memory, a smaller --weight-dtype "
            "or a larger --tp"
        )
    room = gpu_mem - weights_per_gpu

    def cost(n: int, block: int | None = None) -> int:
        # A sequence's recurrent state is allocated whole as soon as it starts.
        return (state if n else 0) + sum(
            g.layers * b * _round_up(tokens_held(shape, g.kind, n, bound), block)
            for g, b in zip(groups, per_layer, strict=True))

    # Bytes one more token adds for ever: none once every layer is bounded.
    growing = 0 if bound is not None else sum(
        g.layers * b for g, b in zip(groups, per_layer, strict=True) if g.kind in ("full", "mla"))
    bounded_at = max(max(shape.window or 0, bound or 0) + (block_size or 0), 1)
    per_sequence = cost(seq)
    max_sequences = room // per_sequence if per_sequence else None
    paged = waste = paged_sequences = paged_tokens = None
    if block_size is not None:
        paged = cost(seq, block_size)
        waste = paged - per_sequence
        paged_sequences = room // paged if paged else None
        paged_tokens = _max_tokens(lambda n: cost(n, block_size), room, growing, bounded_at)
    return Fit(
        gpu_mem_bytes=gpu_mem,
        weight_dtype=weight_dtype,
        params=shape.params,
        weights_bytes=weights,
        weights_bytes_per_gpu=weights_per_gpu,
        room_bytes=room,
        state_bytes_per_sequence=state,
        max_tokens=_max_tokens(cost, room, growing, bounded_at),
        max_sequences=max_sequences,
        batch_bytes_per_gpu=per_sequence * batch,
        batch_fits=per_sequence * batch <= room,
        block_size=block_size,
        paged_bytes_per_sequence=paged,
        paged_waste_bytes_per_sequence=waste,
        max_sequences_paged=paged_sequences,
        max_tokens_paged=paged_tokens,
    )

