"""The batching claim, measured: decode-step time against batch size, beside the roofline.

A decode step reads every weight once whatever the batch, and does 2 FLOPs per
weight per row: at batch 1 it is all memory traffic, and more rows ride along for
nearly nothing until the arithmetic catches up with the bytes. The roofline says
where: a step takes at least max(bytes / bandwidth, FLOPs / peak FLOP/s), both
measured on this device in the same run (a large copy, a large matmul). The knee
is the batch at which a step costs twice a batch-1 step: read off the measured
steps, and solved from the roofline.

The cache is filled with random keys and values instead of a prefill: a step's
time depends on the shapes only, and prefilling 64 rows would take the CPU longer
than the whole sweep.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcache_cli import numbers
from kvcache_cli.caches.exact import StaticCache
from kvcache_cli.models.base import FamilyConfig, FamilyModel

CONTEXT = 128  # tokens cached per row when the timed steps start (less in a shorter window)
STEPS = 8  # timed decode steps per batch size
WARMUP_STEPS = 2
# Rows of CONTEXT cached tokens: past this the sweep's caches alone outgrow a host's memory
# for the larger presets, and a step takes seconds.
MAX_BATCH = 4096
MATMUL_N = 2048  # square float32 matmul for the peak FLOP/s: large enough to be compute-bound
MATMUL_REPEATS = 5


@dataclass(frozen=True)
class BatchPoint:
    batch: int
    step_ms: float  # median of the timed steps
    tokens_per_s: float  # batch / step time
    over_batch1: float  # tokens/s against batch 1
    flops: float  # per step
    bytes: int  # per step: weights + every row's K and V
    intensity: float  # FLOPs per byte
    predicted_ms: float  # roofline: max(bytes / bandwidth, flops / peak)


@dataclass(frozen=True)
class SweepResult:
    model: str
    device: str
    device_name: str
    threads: int
    dtype: str
    context: int
    steps: int
    bandwidth_gbps: float  # best of a large copy, read + write
    peak_gflops: float  # best of a large matmul
    ridge: float  # FLOPs per byte where the roofline turns: peak / bandwidth
    points: tuple[BatchPoint, ...]
    measured_knee: float | None  # batch where a step costs 2x batch 1's; None: not reached
    predicted_knee: float | None
    agrees: bool | None  # the two knees within a factor of 2 (None: either missing)


def parse_sizes(text: str) -> tuple[int, ...]:
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not all(numbers.is_whole(part) for part in parts):
        raise ValueError(f"--batch {text!r}: expected batch sizes like 1,4,16,64")
    sizes = tuple(int(part) for part in parts)
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--batch {text!r}: expected batch sizes of at least 1")
    if max(sizes) > MAX_BATCH:
        raise ValueError(f"--batch {text!r}: expected batch sizes "
                         f"{numbers.span(1, MAX_BATCH)}")
    return tuple(sorted({1, *sizes}))  # batch 1 is what every other size is compared with


def _context(config: FamilyConfig) -> int:
    return min(CONTEXT, config.context - WARMUP_STEPS - STEPS)


def check_sweep(config: FamilyConfig) -> None:
    if _context(config) < 1:
        raise ValueError(f"the sweep needs more than {WARMUP_STEPS + STEPS} positions; the "
                         f"model's window is {config.context}")


def measure_peak_flops(device: torch.device, n: int = MATMUL_N) -> float:
    """FLOP/s of the best of a few large float32 matmuls."""
    from kvcache_cli.measure import synchronize

    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    a @ b  # untimed: the library's first-call set-up
    best = float("inf")
    for _ in range(MATMUL_REPEATS):
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def _step_ms(model: FamilyModel, batch: int, context: int) -> float:
    from kvcache_cli.measure import synchronize

    c, device = model.config, model.device
    cache = StaticCache(c.cache_shape, context + WARMUP_STEPS + STEPS, batch, device, model.dtype)
    for buffer in cache.k + cache.v:
        buffer.normal_()
    idx = torch.randint(0, c.vocab_size, (batch, 1), device=device)  # (B, 1)
    times = []
    with torch.inference_mode():
        for i in range(WARMUP_STEPS + STEPS):
            synchronize(device)
            start = time.perf_counter()
            model(idx, context + i, cache, last_only=True)
            synchronize(device)
            times.append(time.perf_counter() - start)
    return statistics.median(times[WARMUP_STEPS:]) * 1e3


def _knee(batches: Sequence[float], times: Sequence[float]) -> float | None:
    """Where time first reaches twice the first time, interpolated between points."""
    target = 2 * times[0]
    for (b0, t0), (b1, t1) in zip(zip(batches, times), zip(batches[1:], times[1:])):
        if t1 >= target:
            return b0 + (b1 - b0) * (target - t0) / (t1 - t0) if t1 > t0 else b1
    return None


def run_sweep(model: FamilyModel, sizes: Sequence[int], threads: int | None = None,
              model_name: str = "", bandwidth_mib: int | None = None,
              matmul_n: int = MATMUL_N) -> SweepResult:
    from kvcache_cli.caches.paged import block_bytes
    from kvcache_cli.measure import device_name, measure_bandwidth, weight_bytes

    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        device = model.device
        context = _context(model.config)
        bandwidth = measure_bandwidth(device, bandwidth_mib).best_gbps * 1e9
        peak = measure_peak_flops(device, matmul_n)
        measured = [_step_ms(model, b, context) for b in sizes]
        used_threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(previous)
    weights = weight_bytes(model)
    kv_row = context * block_bytes(model.config.cache_shape, 1, model.dtype)
    per_row = model.config.decode_flops(context)

    def predicted_ms(b: float) -> float:
        return max((weights + b * kv_row) / bandwidth, b * per_row / peak) * 1e3

    base = sizes[0] / measured[0]
    points = tuple(BatchPoint(
        batch=b, step_ms=ms, tokens_per_s=b / ms * 1e3, over_batch1=b / ms / base,
        flops=b * per_row, bytes=weights + b * kv_row,
        intensity=b * per_row / (weights + b * kv_row), predicted_ms=predicted_ms(b),
    ) for b, ms in zip(sizes, measured, strict=True))
    # The roofline's knee, solved: the smallest batch whose predicted step is twice
    # batch 1's (the curve is increasing, so bisection finds it).
    target = 2 * predicted_ms(1)
    lo, hi = 1.0, 1.0
    while predicted_ms(hi) < target and hi < 1e6:
        hi *= 2
    predicted_knee = None
    if predicted_ms(hi) >= target:
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if predicted_ms(mid) < target else (lo, mid)
        predicted_knee = hi
    measured_knee = _knee(sizes, measured)
    agrees = None
    if measured_knee is not None and predicted_knee is not None:
        agrees = 0.5 <= measured_knee / predicted_knee <= 2
    return SweepResult(
        model=model_name, device=device.type, device_name=device_name(device),
        threads=used_threads, dtype=str(model.dtype).removeprefix("torch."), context=context,
        steps=STEPS, bandwidth_gbps=bandwidth / 1e9, peak_gflops=peak / 1e9,
        ridge=peak / bandwidth, points=points, measured_knee=measured_knee,
        predicted_knee=predicted_knee, agrees=agrees)
