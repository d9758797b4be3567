"""Measuring tools that bench, serve and eval share: the device, its clock, the bytes a
decode step reads, the memory bandwidth, and what else ran on the machine meanwhile.

Torch is imported inside each function, as in bench: `kvcache size` and `--help` never pay
for it.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The bandwidth probe's buffer per device, and how many times it is timed.
BANDWIDTH_MIB = {"cpu": 256, "cuda": 1024}
BANDWIDTH_REPEATS = 7


@dataclass(frozen=True)
class Bandwidth:
    """Memory bandwidth from copying one large tensor into another."""

    copy_bytes: int  # size of the tensor copied
    bytes_moved: int  # per copy: the source read plus the destination written
    seconds: tuple[float, ...]  # each timed copy
    best_gbps: float  # GB = 10^9 bytes
    median_gbps: float


NO_CUDA = "CUDA is not available (torch sees no GPU); use --device cpu"


def torch_without_cuda() -> str | None:
    """The installed torch's version when it is a build without CUDA (or ROCm), read from
    its version.py without importing it (seconds); None when it has one, or is not there."""
    import re
    from importlib.util import find_spec
    from pathlib import Path

    spec = find_spec("torch")
    for folder in (spec.submodule_search_locations or []) if spec is not None else ():
        try:
            text = (Path(folder) / "version.py").read_text(encoding="utf-8")
        except OSError:
            return None
        built = {m[1]: m[2] for m in re.finditer(r"^(\w+)\b[^=\n]*=\s*(.+?)\s*$", text, re.M)}
        if built.get("cuda") == "None" and built.get("hip") == "None":
            return built.get("__version__", "").strip("'\"")
    return None


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA when there is one; asking for CUDA without one is an error."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {name!r}; valid devices: cpu, cuda, auto")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(NO_CUDA)
    return torch.device(name)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads.

    Every tensor of every product whole (an int8 one's scales included), each once, so
    the tied `wte`/`lm_head` counts once (the head reads all of it); an embedding not
    tied to a product counts one row, the only one a step looks up, and so does a table
    of rotary angles (a module marking itself `lookup`); norms whole.
    """
    import torch

    seen: set[int] = set()
    total = 0
    products = linears(model)
    for module in (*products, *model.modules()):
        embedding = isinstance(module, torch.nn.Embedding) or getattr(module, "lookup", False)
        for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            if tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
            rows = 1 if embedding else tensor.shape[0]
            total += rows * tensor[0].numel() * tensor.element_size()
    return total


def head_bytes(model: torch.nn.Module) -> int:
    """Bytes of the LM head a decode step reads: the vocabulary's whole matrix (its scales
    too), a row per token id, tied or not; `weight_bytes` counts it among the weights."""
    head = model.lm_head
    return sum(t.numel() * t.element_size() for t in (*head.parameters(), *head.buffers()))


def synchronize(device: torch.device) -> None:
    """Wait for the device: CUDA kernels are queued, and the clock must not run ahead."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(
    device: torch.device, mib: int | None = None, repeats: int = BANDWIDTH_REPEATS
) -> Bandwidth:
    """Copy a `mib`-MiB float32 tensor `repeats` times; count read + write bytes."""
    import torch

    mib = BANDWIDTH_MIB[device.type] if mib is None else mib
    n = mib * 2**20 // 4
    # Both buffers are written before timing, so no copy pays for first-touch page faults.
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.zeros(n, dtype=torch.float32, device=device)
    dst.copy_(src)
    seconds = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    copy_bytes = n * 4
    moved = 2 * copy_bytes  # the source is read and the destination written
    return Bandwidth(
        copy_bytes=copy_bytes,
        bytes_moved=moved,
        seconds=tuple(seconds),
        best_gbps=moved / min(seconds) / 1e9,
        median_gbps=moved / statistics.median(seconds) / 1e9,
    )


def linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every matrix a decode step multiplies by, each once (the tied head is one of them)."""
    import torch

    from kvcache_cli.models.gguf.blocks import BlockLinear
    from kvcache_cli.models.linear import Int4Linear, Int8Linear

    kinds = torch.nn.Linear | Int8Linear | Int4Linear | BlockLinear
    return [m for m in model.modules() if isinstance(m, kinds)]


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Library code prints nothing: silence transformers' advice for an hf run, and the
    logger of its continuous batching (serve's hf engine)."""
    import logging

    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    batching = logging.getLogger("ContinuousBatchingLogger")
    batching_level = batching.level
    hf_logging.set_verbosity_error()
    batching.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        batching.setLevel(batching_level)


class OtherProcesses:
    """How much CPU time processes other than this one took since it was made.

    /proc/stat counts every CPU's busy time; this process's own (all threads,
    spinning included) is `time.process_time()`; the rest belongs to others.
    """

    def __init__(self):
        self.wall, self.busy, self.ours = time.perf_counter(), _busy_seconds(), time.process_time()

    def share(self) -> float | None:
        busy = _busy_seconds()
        if busy is None or self.busy is None:
            return None
        others = (busy - self.busy) - (time.process_time() - self.ours)
        capacity = (time.perf_counter() - self.wall) * (os.cpu_count() or 1)
        return min(1.0, max(0.0, others / capacity))


# How long a command that runs a model watches the CPUs before it picks its threads: short
# next to any run, long enough for /proc/stat's ticks (10 ms each) to count.
FREE_CORES_SAMPLE_S = 0.1


def free_cores(sample_s: float = FREE_CORES_SAMPLE_S) -> tuple[int, float] | None:
    """(the cores other processes leave free, at least 1; the cores' worth of CPU time they
    took), from a short sample while this process waits; None where /proc/stat is not.
    A thread per core spins against another process's work: a decode then runs several
    times slower than on the cores it has to itself."""
    others = OtherProcesses()
    time.sleep(sample_s)
    share = others.share()
    if share is None:
        return None
    cores = os.cpu_count() or 1
    busy = share * cores
    return max(1, cores - round(busy)), busy


def _busy_seconds() -> float | None:
    """Busy time of all CPUs since boot (Linux); idle and iowait are not busy."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    # guest time is already inside user time; counting fields 8+ would count it twice
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def device_name(device: torch.device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    # platform.processor() is often empty on Linux; /proc/cpuinfo names the part.
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    return name


def transformers_version() -> str | None:
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__
