"""What a benchmark returns: each mode's timed runs and summary, the bandwidth probes, the
whole result; and the plan a run follows. Data only: computation is in the other modules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcache_cli.bench.weight_check import TokenMargin, WeightCheck
    from kvcache_cli.models.llama_cpp import LlamaFile


# A progress callback: (what is running, tokens done so far, tokens in all).
ProgressFn = Callable[[str, int, int], None]

# Called as each timed run ends: (which run, its decode tokens/s).
FinishedFn = Callable[[str, float], None]


@dataclass
class TimedRun:
    tokens: list[int]
    ttft_ms: float
    steps: list[int]  # which decode steps were timed
    step_ms: list[float]
    cache_bytes_held: int | None
    bytes_copied: int | None


@dataclass(frozen=True)
class Probe:
    """One way of measuring the bandwidth: bytes it moves per run, and each run's time."""

    name: str  # "read", "copy" or "product"
    what: str  # what it does, in a few words
    bytes_per_run: int  # bytes read plus bytes written by one run
    seconds: tuple[float, ...]  # each timed run, over all repeats
    best_gbps: float  # GB = 10^9 bytes
    median_gbps: float


@dataclass(frozen=True)
class ModeResult:
    """One generation mode, timed `repeats` times."""

    mode: str
    tokens: tuple[int, ...]  # generated ids (the first repeat; greedy makes all repeats equal)
    tokens_generated: int  # counted from what the mode returned, not what was asked
    same_tokens: bool  # identical to the reference mode's tokens in every repeat
    # Index of the first token that differs from the reference (any repeat), else None.
    # In float32 a long greedy run can flip a near-tie: kernels sum in different orders.
    first_difference: int | None
    ttft_ms: tuple[float, ...]  # per repeat: prefill and the first token
    steps: tuple[int, ...]  # which decode steps were timed (0 is the first): all but naive's
    step_ms: tuple[tuple[float, ...], ...]  # per repeat, per timed decode step
    median_step_ms: tuple[float, ...]  # per timed decode step, median over repeats
    tokens_per_s: tuple[float, ...]  # per repeat: decode steps / decode seconds
    tokens_per_s_median: float
    ms_per_token_median: float  # median over steps of median_step_ms
    ttft_ms_median: float
    profile_ms: tuple[float, ...]  # median_step_ms around each of BenchResult.profile_lengths
    speedup_over_naive: float | None  # tokens/s ratio; None without a naive run
    ratio_to_hf: float | None  # tokens/s ratio; None without an hf run
    cache_bytes_held: int | None  # at the end of the run; None where not ours to count
    bytes_copied: int | None  # by cache appends over the whole run
    achieved_gbps: float  # bytes a decode step must read / its time
    mbu: float  # achieved_gbps / the limit: model bandwidth utilisation
    compile_s: float | None  # a compiled mode's warm-up, compiling included; else None
    weight_bytes: int  # a decode step's weights as this mode stores them
    # At first_difference, how close the reference model's own choice was (None if none).
    difference_margin: TokenMargin | None


@dataclass(frozen=True)
class BenchResult:
    model: str  # what was loaded, and from where
    weights_note: str | None  # e.g. why the weights are random
    # Why a C++ kernel was not used (None: every one asked for was): a quantised cache's
    # attention in torch (`caches.code_attention.NOTE`), the products in torch
    # (`models.linear.NOTE`), the fused small ops in torch (`models.fused.NOTE`).
    kernel_note: str | None
    device: str
    device_name: str
    cpus: int  # logical CPUs the OS reports
    # Share of all CPUs' time that other processes used while the bench ran (None
    # where /proc/stat is missing). Above a few percent, they competed for the cores.
    others_cpu_share: float | None
    dtype: str
    # For half precision on the CPU: which of its instructions the CPU has (AVX-512-BF16,
    # AMX, AVX-512-FP16); without them torch converts to float32 to multiply.
    cpu_half_support: str | None
    threads: int
    torch_version: str
    transformers_version: str | None
    n_params: int
    prompt_len: int
    new_tokens: int
    repeats: int
    warmup_tokens: int
    naive_samples: int | None  # decode steps naive was timed at; None: every step
    reference_mode: str  # the mode every other one's tokens are compared with
    tokens_agree: bool
    weights_format: str  # how the products' matrices are stored: fp32, bf16, fp16, int8, q4, gguf
    # The model's static loop against the same weights in float32 (None when it is float32).
    weights_check: WeightCheck | None
    llama_cpp_version: str | None  # llama-cpp-python's, where a llama.cpp mode ran
    weight_bytes: int  # read once per decode step
    kv_bytes_per_token: int  # K and V a position adds to every layer, batch 1 (a sliding
    # layer stops adding past its window: step_bytes_* count each layer up to it)
    head_bytes: int  # of weight_bytes, the LM head's: every row of the vocabulary
    step_bytes_first: int  # weights + KV cache a decode step reads at the first length
    step_bytes_last: int  # ... and at the last
    probes: tuple[Probe, ...]
    limit_probe: str  # the probe with the best bandwidth, which sets the limit
    limit_gbps: float
    ceiling_tokens_per_s: float  # the limit / mean bytes per decode step
    profile_lengths: tuple[int, ...]  # context lengths of ModeResult.profile_ms
    modes: tuple[ModeResult, ...]

    def mode(self, name: str) -> ModeResult:
        for result in self.modes:
            if result.mode == name:
                return result
        raise KeyError(f"mode {name!r} was not run (ran {', '.join(m.mode for m in self.modes)})")


@dataclass(frozen=True)
class BenchPlan:
    """What a benchmark runs, in which order, and how many tokens that makes."""

    modes: tuple[str, ...]
    prompt: list[int]
    new_tokens: int
    repeats: int
    warmup: int
    sampled: bool  # naive timed at `naive_steps` only, fed the reference's tokens
    naive_steps: list[int]
    order: list[str]  # the modes within one repeat
    reference_mode: str
    warmups: dict[str, int]  # untimed tokens per mode
    total: int  # tokens in all, warm-ups included, for the progress display

    @property
    def n_steps(self) -> int:
        return self.new_tokens - 1


@dataclass
class Measured:
    runs: dict[str, list[TimedRun]]  # per mode, one per repeat
    probes: dict[str, list[Probe]]  # per probe kind, one per repeat
    compile_s: dict[str, float]
    llama_files: dict[str, LlamaFile]  # per llama.cpp mode, what it ran
