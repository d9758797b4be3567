"""The memory-bandwidth probes that set the limit: a pure read, a copy, and one pass of
one-row products over the model's own weights, each timed the same way."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvcache_cli.bench.results import Probe
from kvcache_cli.measure import BANDWIDTH_MIB, BANDWIDTH_REPEATS, Bandwidth, linears, synchronize

if TYPE_CHECKING:
    import torch


def _probe(name: str, what: str, bytes_per_run: int, seconds: Sequence[float]) -> Probe:
    return Probe(
        name=name,
        what=what,
        bytes_per_run=bytes_per_run,
        seconds=tuple(seconds),
        best_gbps=bytes_per_run / min(seconds) / 1e9,
        median_gbps=bytes_per_run / statistics.median(seconds) / 1e9,
    )


def _timed(device: torch.device, run: Callable[[], object], repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls, after one untimed call (first touch, caches)."""
    run()
    seconds = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return seconds


def measure_read(
    device: torch.device, mib: int | None = None, repeats: int = BANDWIDTH_REPEATS
) -> Probe:
    """Sum a `mib`-MiB float32 buffer: every byte read once, nothing written back."""
    import torch

    mib = BANDWIDTH_MIB[device.type] if mib is None else mib
    buffer = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)
    seconds = _timed(device, buffer.sum, repeats)
    return _probe("read", f"sum over {mib} MiB", buffer.numel() * 4, seconds)


def measure_products(model: torch.nn.Module, repeats: int = BANDWIDTH_REPEATS) -> Probe:
    """One pass of one-row products over every weight matrix of `model`, as a decode step.

    The same modules, layout and dtype the model runs with, so this is the speed its
    products reach with nothing else in the step.
    """
    import torch

    layers = linears(model)
    param = next(model.parameters())
    # One row per matrix, (1, 1, in), the shape a decode step hands each of them.
    rows = [torch.ones(1, 1, m.in_features, dtype=param.dtype, device=param.device)
            for m in layers]  # fmt: skip

    def one_pass() -> None:
        for layer, x in zip(layers, rows, strict=True):
            layer(x)

    with torch.inference_mode():
        seconds = _timed(param.device, one_pass, repeats)
    nbytes = sum(t.numel() * t.element_size() for m in layers
                 for t in (*m.parameters(), *m.buffers()))  # fmt: skip
    return _probe("product", f"one-row products over the model's {len(layers)} matrices",
                  nbytes, seconds)  # fmt: skip


def copy_probe(bandwidth: Bandwidth) -> Probe:
    return _probe("copy", f"copy of {bandwidth.copy_bytes // 2**20} MiB, read + write",
                  bandwidth.bytes_moved, bandwidth.seconds)  # fmt: skip


def pool_probes(probes: Sequence[Probe]) -> Probe:
    """One figure from several probes of one kind: every run's time counts."""
    first = probes[0]
    seconds = [t for probe in probes for t in probe.seconds]
    return _probe(first.name, first.what, first.bytes_per_run, seconds)
