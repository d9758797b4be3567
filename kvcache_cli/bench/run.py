"""Decode speed, measured: every generation mode side by side, against
transformers' `generate()` and against the memory-bandwidth limit.

The method is gpt-fast's: an untimed warm-up run of each mode first, the device
synchronised before every read of the clock, and every decode step timed on its
own, so the result holds the whole per-step curve (flat with a cache, rising
without one) rather than one average. Repeats interleave the modes, so a slow
patch of the machine lands on all of them; figures are medians over repeats with
the min-max spread beside them.

The limit: one decode step has to read every weight and the whole KV cache once,
and on a batch of one it does little else, so memory bandwidth divided by those
bytes is the tokens/s no implementation can beat on this device. The bandwidth is
probed in the same run, before each repeat, three ways: a reduction over a buffer
far larger than any cache (a pure read), a copy (read + write counted), and one pass
of one-row products over the model's own weights (what a decode step does). The
best of the three is the limit; each mode's share of it is its MBU (model
bandwidth utilisation).

The naive loop reruns the whole sequence every step, so timing all its steps costs
minutes; by default it is timed at a few decode steps spread over the run, each fed
the reference mode's tokens so far, which shows the same rising line.

Torch is imported by the functions that need it; this module is imported only by
the `bench` command and the tests.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kv_cache_from_scratch import kv_cache_bytes
from kvcache_cli import TORCH_INSTALL
from kvcache_cli.llama_peer import LLAMA_MODES, check_llama_modes, llama_version
from kvcache_cli.measure import (
    BANDWIDTH_MIB,
    BANDWIDTH_REPEATS,
    Bandwidth,
    OtherProcesses,
    device_name,
    linears,
    measure_bandwidth,
    quiet_transformers,
    synchronize,
    transformers_version,
    weight_bytes,
)

if TYPE_CHECKING:
    import torch

    from kvcache_cli.bench.weight_check import TokenMargin, WeightCheck
    from kvcache_cli.llama_peer import LlamaFile, LlamaRunner

# hf-static is transformers' generate() with its static cache; a "-compiled" mode is
# the same under torch.compile (the compile is paid in the untimed warm-up). hf-quanto is
# generate() with its QuantizedCache (quanto, int4, groups of 64, residual 128: its
# defaults), the peer of kvcache's quantised caches as a transformers user runs it.
# llama.cpp, llama.cpp-f16, llama.cpp-q8_0 run llama.cpp (the `llama` extra) on the
# same weights written to GGUF: the engine a CPU user would pick, as a peer;
# llama.cpp-gguf runs the very file a Llama-family model was read from.
MODES = (
    "naive", "concat", "static", "hf", "hf-static", "static-compiled", "hf-static-compiled",
    "hf-quanto", *LLAMA_MODES,
)  # fmt: skip
# The project's own loops; every other mode is a peer it is measured against.
OURS = ("naive", "concat", "static", "static-compiled")
DEFAULT_MODES = ("naive", "concat", "static", "hf", "hf-static")
COMPILED = {"static": "static-compiled", "hf-static": "hf-static-compiled"}
# torch.compile's mode per device: CUDA graphs remove the launch overhead on a GPU;
# the CPU has none to remove.
COMPILE_MODE = {"cpu": "default", "cuda": "reduce-overhead"}

# The naive loop is timed at this many decode steps spread over the run (0: all).
NAIVE_SAMPLES = 16

# A few untimed tokens per mode pay the one-time costs (lazy initialisation,
# kernel selection, the allocator's first blocks) that would otherwise land in
# the first timed steps; more only makes the naive loop's warm-up slow.
WARMUP_TOKENS = 16

# Larger than any last-level cache on either device, so the probes stream DRAM/HBM.

# Where along the generation the per-step latency is reported (fractions of the
# decode steps); 0 and 1 are the first and last decode steps.
PROFILE_POINTS = (0.0, 0.25, 0.5, 0.75, 1.0)

# A progress callback: (what is running, tokens done so far, tokens in all).
ProgressFn = Callable[[str, int, int], None]
# Called as each timed run ends: (which run, its decode tokens/s).
FinishedFn = Callable[[str, float], None]


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
    weights_format: str  # how the products' matrices are stored: fp32, bf16, fp16, int8, q4
    # The model's static loop against the same weights in float32 (None when it is float32).
    weights_check: WeightCheck | None
    llama_cpp_version: str | None  # llama-cpp-python's, where a llama.cpp mode ran
    weight_bytes: int  # read once per decode step
    kv_bytes_per_token: int  # K and V, all layers, batch 1
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


# ---------------------------------------------------------------------------
# Inputs


def parse_modes(text: str) -> tuple[str, ...]:
    """`"naive,static,window:128"` -> `("naive", "static", "window:128")`, in the order
    given: the modes above, or any other cache spec (`caches.spec`), spelled canonically."""
    from kvcache_cli.caches.spec import CacheSpecError, parse_cache_spec
    from kvcache_cli.caches.spec import names as kinds

    given = [part.strip() for part in text.split(",") if part.strip()]
    for part in given:  # a known kind with a bad field: the spec's own reason, not "unknown"
        if part.lower() not in MODES and part.split(":", 1)[0].lower() in kinds():
            try:
                parse_cache_spec(part)
            except CacheSpecError as err:
                raise ValueError(f"--modes: {err}") from None
    names = tuple(_mode_name(part) for part in given)
    unknown = [part for part, name in zip(given, names, strict=True) if name is None]
    if unknown or not names:
        what = f"unknown mode {', '.join(map(repr, unknown))}" if unknown else "no modes given"
        raise ValueError(f"{what}; valid modes: {', '.join(MODES)}, or a cache spec such as "
                         "window:128, sink:4+124, h2o:64+64")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"mode {', '.join(map(repr, repeated))} given twice")
    return names


def _mode_name(text: str) -> str | None:
    """A mode's name, a cache spec's canonical spelling, or None for neither."""
    from kvcache_cli.caches.spec import CacheSpecError, parse_cache_spec

    if text.lower() in MODES:  # names in any case, as cache specs are read
        return text.lower()
    try:
        return str(parse_cache_spec(text))
    except CacheSpecError:
        return None


def bounded_spec(mode: str):
    """The cache spec of a bounded mode (window, sink, h2o), else None."""
    from kvcache_cli.caches.spec import KINDS, parse_cache_spec

    if mode in MODES or mode.split(":", 1)[0] not in KINDS:
        return None
    spec = parse_cache_spec(mode)
    return spec if spec.info.bounded else None


def random_prompt(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    """Seeded random token ids: speed does not depend on what the prompt says."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


# ---------------------------------------------------------------------------
# Counting bytes


# ---------------------------------------------------------------------------
# Clocks


@dataclass
class _Timeline:
    """Clock readings of one run.

    `marks[i]` is read when token i is known on the host; `resumes[i]` when the
    bench's own bookkeeping after it (progress, list appends) is done. Decode
    step i+1 is `marks[i+1] - resumes[i]`: the generator's work only.
    """

    start: float
    marks: list[float]
    resumes: list[float]

    def ttft_ms(self) -> float:
        return (self.marks[0] - self.start) * 1e3

    def step_ms(self) -> list[float]:
        return [(m - r) * 1e3 for m, r in zip(self.marks[1:], self.resumes[:-1], strict=True)]


class _Clock:
    """Reads the clock once per token, after synchronising the device."""

    def __init__(self, device: torch.device, on_token: Callable[[], None]):
        self.device = device
        self.on_token = on_token
        synchronize(device)
        self.timeline = _Timeline(time.perf_counter(), [], [])

    def tick(self) -> None:
        synchronize(self.device)
        self.timeline.marks.append(time.perf_counter())
        self.on_token()
        self.timeline.resumes.append(time.perf_counter())


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


def _copy_probe(bandwidth: Bandwidth) -> Probe:
    return _probe("copy", f"copy of {bandwidth.copy_bytes // 2**20} MiB, read + write",
                  bandwidth.bytes_moved, bandwidth.seconds)  # fmt: skip


def _pooled(probes: Sequence[Probe]) -> Probe:
    """One figure from several probes of one kind: every run's time counts."""
    first = probes[0]
    seconds = [t for probe in probes for t in probe.seconds]
    return _probe(first.name, first.what, first.bytes_per_run, seconds)


# ---------------------------------------------------------------------------
# One timed run per mode


@dataclass
class _Run:
    tokens: list[int]
    ttft_ms: float
    steps: list[int]  # which decode steps were timed
    step_ms: list[float]
    cache_bytes_held: int | None
    bytes_copied: int | None


def _from_timeline(tokens, timeline: _Timeline, held=None, copied=None) -> _Run:
    step_ms = timeline.step_ms()
    return _Run(tokens, timeline.ttft_ms(), list(range(len(step_ms))), step_ms, held, copied)


def _run_ours(
    model, prompt_ids: list[int], new_tokens: int, mode: str, device, on_token, max_len: int
) -> _Run:
    """`max_len` sizes a static cache: the run's own length, also for a shorter warm-up,
    so a compiled model sees in the warm-up the cache shapes it is timed with."""
    from kvcache_cli.caches import make_cache
    from kvcache_cli.generate import stream_tokens

    # The bench owns the cache so it can read what the appends copied afterwards.
    cache = None
    if mode != "naive":
        # Compiled, the cache is read whole under a mask: one shape at every step.
        cache = make_cache(mode.removesuffix("-compiled"), model, max_len=max_len, batch=1,
                           whole=mode.endswith("-compiled"))
    tokens: list[int] = []
    clock = _Clock(device, on_token)
    for token in stream_tokens(model, prompt_ids, new_tokens, mode.removesuffix("-compiled"),
                               cache=cache):  # fmt: skip
        clock.tick()
        tokens.append(token)
    if cache is None:
        return _from_timeline(tokens, clock.timeline)
    return _from_timeline(tokens, clock.timeline, cache.bytes_held, cache.bytes_copied)


def _run_llama(runner: LlamaRunner, prompt_ids: list[int], new_tokens: int, device,
               on_token) -> _Run:  # fmt: skip
    """llama.cpp under the same clock: a tick as each token is known on the host."""
    tokens: list[int] = []
    clock = _Clock(device, on_token)
    for token in runner.stream(prompt_ids, new_tokens):
        clock.tick()
        tokens.append(token)
    return _from_timeline(tokens, clock.timeline)


def _run_naive_sampled(
    model, prompt_ids: list[int], reference: list[int], steps: Sequence[int], device, on_token
) -> _Run:
    """The naive loop timed at `steps` only: each a full forward over the prompt and the
    reference's tokens before it, as the naive loop would have run it there."""
    import torch

    def next_token(ids: list[int]) -> int:
        idx = torch.tensor([ids], dtype=torch.long, device=device)  # (1, T)
        with torch.inference_mode():
            logits = model(idx, 0, None, last_only=True)  # (1, 1, vocab)
        return int(logits[0, -1].argmax().item())  # .item() waits for the device

    def timed(ids: list[int]) -> tuple[int, float]:
        synchronize(device)
        start = time.perf_counter()
        token = next_token(ids)
        synchronize(device)
        ms = (time.perf_counter() - start) * 1e3
        on_token()
        return token, ms

    first, ttft = timed(prompt_ids)
    tokens, step_ms = [first], []
    for step in steps:
        # Decode step `step` chooses token step + 1 after the prompt and tokens 0 .. step.
        token, ms = timed(prompt_ids + reference[: step + 1])
        tokens.append(token)
        step_ms.append(ms)
    return _Run(tokens, ttft, list(steps), step_ms, None, None)


def sampled_steps(n_steps: int, samples: int) -> list[int]:
    """`samples` decode steps spread evenly from the first to the last (all if fewer)."""
    if samples <= 0 or samples >= n_steps:
        return list(range(n_steps))
    if samples == 1:
        return [0]
    return sorted({round(j * (n_steps - 1) / (samples - 1)) for j in range(samples)})


def _run_hf(
    hf_model, prompt_ids: list[int], new_tokens: int, mode: str, device, on_token,
    stop_after: int | None = None,
) -> _Run:  # fmt: skip
    """transformers' `generate()`: greedy, its own KV cache on, the same lengths.

    A stopping criterion is called once per step right after the step's token is
    appended, the same moment `stream_tokens` yields one: it reads the clock there
    and stops nothing, except a warm-up after `stop_after` tokens (the run is still
    set up for `new_tokens`, so a static cache has the timed run's size).
    """
    import torch
    from transformers import (
        CompileConfig,
        GenerationConfig,
        StoppingCriteria,
        StoppingCriteriaList,
    )

    class ClockCriterion(StoppingCriteria):
        def __init__(self, clock: _Clock):
            self.clock = clock
            self.count = 0

        def __call__(self, input_ids, scores, **kwargs):
            self.clock.tick()
            self.count += 1
            stop = stop_after is not None and self.count >= stop_after
            return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=device)

    ids = torch.tensor([prompt_ids], device=device)
    options: dict = dict(max_new_tokens=new_tokens, do_sample=False, use_cache=True,
                         pad_token_id=0)  # fmt: skip
    if mode.startswith("hf-static"):
        options["cache_implementation"] = "static"
    cache = {}
    if mode == "hf-quanto":  # a fresh one each run: generate() appends to what it is given
        from transformers import QuantizedCache

        from kvcache_cli.eval.peer_hf import cache_keyword

        cache[cache_keyword(hf_model)] = QuantizedCache(backend="quanto",
                                                        config=hf_model.config, nbits=4)
    if mode.endswith("-compiled"):
        compile_config = CompileConfig(mode=COMPILE_MODE[device.type])
        # generate() compiles only on accelerators unless told to compile everywhere.
        compile_config._compile_all_devices = True
        options["compile_config"] = compile_config
    else:
        options["disable_compile"] = True  # eager, even where generate() would compile
    clock = _Clock(device, on_token)
    with quiet_transformers():
        out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            generation_config=GenerationConfig(**options),
            stopping_criteria=StoppingCriteriaList([ClockCriterion(clock)]),
            **cache,
        )
    return _from_timeline(out[0, len(prompt_ids) :].tolist(), clock.timeline)


def _hf_copy(model, device):
    """The same weights as a transformers model, never stopping at an end-of-text token.

    Our modes always produce `new_tokens`; random weights may pick token 50256,
    which generate() would take as the end, and the runs would differ in length.
    """
    from kvcache_cli.models import to_hf

    hf_model = to_hf(model).to(device).eval()
    hf_model.generation_config.eos_token_id = None
    return hf_model


# ---------------------------------------------------------------------------
# Summaries


def _window_medians(steps: Sequence[float], points: Sequence[float]) -> tuple[float, ...]:
    """Median latency in a short window at each fraction of the run.

    One step is noisy; the median of the few around it is not, and the first and
    last windows start and end at the first and last step.
    """
    n = len(steps)
    width = max(1, min(8, n // 8))
    out = []
    for fraction in points:
        lo = min(max(0, round(fraction * (n - 1)) - width // 2), n - width)
        out.append(statistics.median(steps[lo : lo + width]))
    return tuple(out)


def _profile(steps: Sequence[int], ms: Sequence[float], n_steps: int) -> tuple[float, ...]:
    """Latency at each of PROFILE_POINTS: windowed over every step, or the nearest
    timed step where only some were timed (naive's are minutes apart in cost)."""
    if len(steps) == n_steps:
        return _window_medians(ms, PROFILE_POINTS)
    nearest = [min(range(len(steps)), key=lambda i: abs(steps[i] - f * (n_steps - 1)))
               for f in PROFILE_POINTS]  # fmt: skip
    return tuple(ms[i] for i in nearest)


def _summarise(
    mode: str,
    runs: list[_Run],
    reference: list[int],
    step_bytes: Sequence[int],
    limit_gbps: float,
    compile_s: float | None,
    weights: int,
) -> ModeResult:
    n_timed = min(len(run.step_ms) for run in runs)
    steps = tuple(runs[0].steps[:n_timed])
    step_ms = tuple(tuple(run.step_ms[:n_timed]) for run in runs)
    median_steps = tuple(statistics.median(column) for column in zip(*step_ms, strict=True))
    tokens_per_s = tuple(n_timed / (sum(ms) / 1e3) for ms in step_ms)
    tps = statistics.median(tokens_per_s)
    mean_step_bytes = sum(step_bytes[i] for i in steps) / n_timed
    achieved = mean_step_bytes * tps / 1e9
    # A sampled run's tokens sit at the prefill and at each timed step's position.
    positions = [0] + [i + 1 for i in steps] if n_timed < len(step_bytes) else None
    expected = reference if positions is None else [reference[i] for i in positions]

    def first_difference(tokens: list[int]) -> int | None:
        d = _first_difference(tokens, expected)
        return d if positions is None or d is None else positions[min(d, len(positions) - 1)]

    return ModeResult(
        mode=mode,
        tokens=tuple(runs[0].tokens),
        tokens_generated=min(len(run.tokens) for run in runs),
        same_tokens=all(run.tokens == expected for run in runs),
        first_difference=min(
            (d for run in runs if (d := first_difference(run.tokens)) is not None), default=None
        ),
        ttft_ms=tuple(run.ttft_ms for run in runs),
        steps=steps,
        step_ms=step_ms,
        median_step_ms=median_steps,
        tokens_per_s=tokens_per_s,
        tokens_per_s_median=tps,
        ms_per_token_median=statistics.median(median_steps),
        ttft_ms_median=statistics.median(run.ttft_ms for run in runs),
        profile_ms=_profile(steps, median_steps, len(step_bytes)),
        speedup_over_naive=None,
        ratio_to_hf=None,
        cache_bytes_held=runs[0].cache_bytes_held,
        bytes_copied=runs[0].bytes_copied,
        achieved_gbps=achieved,
        mbu=achieved / limit_gbps,
        compile_s=compile_s,
        weight_bytes=weights,
        difference_margin=None,
    )


def _with_margins(model, prompt: list[int], reference: list[int],
                  results: list[ModeResult]) -> list[ModeResult]:  # fmt: skip
    """Each mode that left the reference's tokens, with how close the reference model's
    own choice was where it left: a near-tie, or a real difference."""
    from dataclasses import replace

    from kvcache_cli.bench.weight_check import token_margin

    out = []
    for r in results:
        d = r.first_difference
        if d is not None and d < len(r.tokens) and len(r.tokens) == len(reference):
            r = replace(r, difference_margin=token_margin(model, prompt, reference, r.tokens))
        out.append(r)
    return out


def _first_difference(tokens: Sequence[int], reference: Sequence[int]) -> int | None:
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def _with_ratios(results: list[ModeResult]) -> tuple[ModeResult, ...]:
    from dataclasses import replace

    by_mode = {r.mode: r.tokens_per_s_median for r in results}

    def over(r: ModeResult, base: str) -> float | None:
        return r.tokens_per_s_median / by_mode[base] if base in by_mode else None

    return tuple(
        replace(r, speedup_over_naive=over(r, "naive"), ratio_to_hf=over(r, "hf")) for r in results
    )


# ---------------------------------------------------------------------------
# The benchmark


# Timed runs per mode: each is a whole generation, so past this a run takes days.
MAX_REPEATS = 1000


def check_bench_config(config, modes: Sequence[str], prompt_len: int, new_tokens: int,
                       repeats: int, threads: int | None, naive_samples: int = NAIVE_SAMPLES
                       ) -> None:
    """What `check_bench` can refuse from the model's config alone: before weights load.
    Each refusal names the option as the user typed it."""
    from kvcache_cli.caches.spec import check_context
    from kvcache_cli.numbers import span

    window = config.context
    if prompt_len < 1:
        raise ValueError(f"--prompt-len {prompt_len:,}: expected a whole number, 1 or more")
    if new_tokens < 2:
        raise ValueError(f"--new-tokens {new_tokens:,}: expected a whole number, 2 or more "
                         "(the prefill's and a decode)")
    if prompt_len + new_tokens > window:
        raise ValueError(f"--prompt-len {prompt_len:,} + --new-tokens {new_tokens:,} = "
                         f"{prompt_len + new_tokens:,} past context window {window:,}")
    for mode in modes:
        if (spec := bounded_spec(mode)) is not None:
            check_context(spec, window)
    if not 1 <= repeats <= MAX_REPEATS:
        raise ValueError(f"--repeats {repeats:,}: expected a whole number "
                         f"{span(1, MAX_REPEATS)}")
    if threads is not None and threads < 1:
        raise ValueError(f"--threads {threads:,}: expected a whole number, 1 or more")
    if naive_samples < 0:  # more than the decode steps is every step: not refused
        raise ValueError(f"--naive-samples {naive_samples:,}: expected a whole number, 0 "
                         "(every step) or more")


def check_bench(
    model,
    modes: Sequence[str],
    prompt_len: int,
    new_tokens: int,
    repeats: int,
    threads: int | None,
    naive_samples: int = NAIVE_SAMPLES,
) -> None:
    """Refuse, before any work, a benchmark that cannot run (`run_bench` calls it too)."""
    check_bench_config(model.config, modes, prompt_len, new_tokens, repeats, threads,
                       naive_samples)
    check_llama_modes(modes, next(model.parameters()).device.type)
    hf_modes = [m for m in modes if m.startswith("hf")]
    if hf_modes and transformers_version() is None:
        raise RuntimeError(f"mode {hf_modes[0]!r} needs transformers: {TORCH_INSTALL}")
    if "hf-quanto" in modes:
        from kvcache_cli.caches.peer import quanto_missing

        missing = quanto_missing()
        if missing:
            raise RuntimeError(f"mode 'hf-quanto': {missing}")


def run_bench(
    model,
    *,
    modes: Sequence[str] = DEFAULT_MODES,
    prompt_len: int = 32,
    new_tokens: int = 128,
    repeats: int = 3,
    threads: int | None = None,
    naive_samples: int = NAIVE_SAMPLES,
    model_name: str = "gpt2",
    weights_note: str | None = None,
    warmup_tokens: int = WARMUP_TOKENS,
    bandwidth_mib: int | None = None,
    seed: int = 0,
    progress: ProgressFn | None = None,
    finished: FinishedFn | None = None,
    reference=None,
    gguf_dir=None,
) -> BenchResult:
    """Time every mode on `model` (already on its device) and measure the limit.

    `threads` sets torch's intra-op threads for the run and restores them after.
    `naive_samples` times the naive loop at that many decode steps (0: every step);
    `finished` hears of each timed run as it ends. `reference`, the same weights in
    float32, is what a model in another weight format is checked against (logits and
    greedy tokens); `gguf_dir` holds the llama.cpp modes' files (default: the cache).
    """
    import torch

    modes = parse_modes(",".join(modes))
    check_bench(model, modes, prompt_len, new_tokens, repeats, threads, naive_samples)
    plan = _plan(modes, prompt_len, new_tokens, repeats, naive_samples, warmup_tokens,
                 random_prompt(model.config.vocab_size, prompt_len, seed))
    others = OtherProcesses()
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        counter = _Counter(plan.total, progress)
        check = None
        if reference is not None:
            from kvcache_cli.bench.weight_check import check_weights

            counter.show("checking the weights against float32")
            check = check_weights(reference, model, plan.prompt, new_tokens)
        with torch.inference_mode():
            measured = _measure(model, plan, bandwidth_mib, counter, finished, gguf_dir)
        used_threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(previous_threads)
    return _result(model, plan, measured, used_threads, others.share(), model_name,
                   weights_note, check)  # fmt: skip


@dataclass(frozen=True)
class _Plan:
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


def _plan(modes: tuple[str, ...], prompt_len: int, new_tokens: int, repeats: int,
          naive_samples: int, warmup_tokens: int, prompt: list[int]) -> _Plan:
    warmup = min(warmup_tokens, new_tokens)
    n_steps = new_tokens - 1
    # Naive needs another mode's tokens to be sampled; alone, it runs every step.
    sampled = "naive" in modes and len(modes) > 1 and 0 < naive_samples < n_steps
    naive_steps = sampled_steps(n_steps, naive_samples if sampled else 0)
    # Sampled naive runs last in each repeat: it follows the reference's tokens.
    order = [m for m in modes if not (sampled and m == "naive")] + (["naive"] if sampled else [])
    # The reference is the loop every other is checked against: naive when it runs every
    # step, else our static cache (itself checked against naive by the tests).
    reference_mode = "naive" if "naive" in modes and not sampled else (
        "static" if "static" in modes else order[0])
    per_run = {m: len(naive_steps) + 1 if m == "naive" else new_tokens for m in modes}
    # A compiled mode warms up over the whole run: every shape it will see is compiled
    # (and, with CUDA graphs, recorded) before the clock runs.
    warmups = {m: new_tokens if m.endswith("-compiled") else warmup for m in modes}
    total = sum(warmups.values()) + repeats * sum(per_run.values())
    return _Plan(modes, prompt, new_tokens, repeats, warmup, sampled, naive_steps, order,
                 reference_mode, warmups, total)  # fmt: skip


class _Counter:
    """Tokens made so far across every run, reported to the progress callback."""

    def __init__(self, total: int, progress: ProgressFn | None):
        self.total, self.progress, self.done = total, progress, 0

    def show(self, label: str) -> None:
        if self.progress is not None:
            self.progress(label, self.done, self.total)

    def on_token(self, label: str) -> Callable[[], None]:
        def tick() -> None:
            self.done += 1
            self.show(label)

        return tick


@dataclass
class _Measured:
    runs: dict[str, list[_Run]]  # per mode, one per repeat
    probes: dict[str, list[Probe]]  # per probe kind, one per repeat
    compile_s: dict[str, float]
    llama_files: dict[str, LlamaFile]  # per llama.cpp mode, what it ran


def _measure(model, plan: _Plan, bandwidth_mib: int | None, counter: _Counter,
             finished: FinishedFn | None, gguf_dir=None) -> _Measured:
    """The untimed warm-ups, then the repeats: each probes the bandwidth and runs every mode."""
    with contextlib.ExitStack() as stack:
        llama = _llama_runners(model, plan, counter, gguf_dir, stack)
        return _measure_with(model, plan, bandwidth_mib, counter, finished, llama)


def _llama_runners(model, plan: _Plan, counter: _Counter, gguf_dir,
                   stack: contextlib.ExitStack) -> dict[str, LlamaRunner]:  # fmt: skip
    """A llama.cpp model per llama.cpp mode, its GGUF written (or found) first, each
    closed when the stack unwinds; on torch's thread count, as our modes run."""
    import torch

    from kvcache_cli import llama_peer

    runners = {}
    for mode in (m for m in plan.modes if m in LLAMA_MODES):
        counter.show(f"GGUF for {mode} ({LLAMA_MODES[mode]})")
        file = llama_peer.prepare(model, mode, gguf_dir)
        runner = llama_peer.LlamaRunner(file, len(plan.prompt) + plan.new_tokens,
                                        torch.get_num_threads())  # fmt: skip
        stack.callback(runner.close)
        runners[mode] = runner
    return runners


def _measure_with(model, plan: _Plan, bandwidth_mib: int | None, counter: _Counter,
                  finished: FinishedFn | None, llama: dict[str, LlamaRunner]) -> _Measured:
    import torch

    from kvcache_cli.models.linear import pin_threads

    device = next(model.parameters()).device
    modes = plan.modes
    hf_model = _hf_copy(model, device) if any(m.startswith("hf") for m in modes) else None
    compiled = None
    if any(m.endswith("-compiled") and not m.startswith("hf") for m in modes):
        compiled = torch.compile(pin_threads(model), mode=COMPILE_MODE[device.type])
    measured = _Measured({mode: [] for mode in modes}, {"read": [], "copy": [], "product": []},
                         {}, {mode: runner.file for mode, runner in llama.items()})  # fmt: skip
    prompt, new_tokens = plan.prompt, plan.new_tokens

    def run(mode: str, n: int, label: str, warm: bool = False) -> _Run:
        on_token = counter.on_token(label)
        if mode in llama:
            return _run_llama(llama[mode], prompt, n, device, on_token)
        if mode.startswith("hf"):
            return _run_hf(hf_model, prompt, new_tokens, mode, device, on_token,
                           n if warm else None)  # fmt: skip
        if mode == "naive" and plan.sampled and not warm:
            reference = measured.runs[plan.reference_mode][0].tokens
            return _run_naive_sampled(model, prompt, reference, plan.naive_steps, device,
                                      on_token)  # fmt: skip
        forward = compiled if mode.endswith("-compiled") else model
        return _run_ours(forward, prompt, n, mode, device, on_token,
                         max_len=len(prompt) + new_tokens)  # fmt: skip

    for mode in modes:
        start = time.perf_counter()
        run(mode, plan.warmups[mode], f"warm-up {mode}", warm=True)
        if mode.endswith("-compiled"):
            measured.compile_s[mode] = time.perf_counter() - start
    # Interleaved, so drift on the machine reaches every mode alike, and the
    # bandwidth is probed once a repeat: on a shared host it drifts as well.
    for r in range(plan.repeats):
        counter.show(f"memory bandwidth {r + 1}/{plan.repeats}")
        measured.probes["read"].append(measure_read(device, bandwidth_mib))
        measured.probes["copy"].append(_copy_probe(measure_bandwidth(device, bandwidth_mib)))
        measured.probes["product"].append(measure_products(model))
        for mode in plan.order:
            label = f"{mode} {r + 1}/{plan.repeats}"
            result = run(mode, new_tokens, label)
            measured.runs[mode].append(result)
            if finished is not None:
                finished(label, len(result.step_ms) / (sum(result.step_ms) / 1e3))
    return measured


def _result(model, plan: _Plan, measured: _Measured, threads: int, others_share: float | None,
            model_name: str, weights_note: str | None, check: WeightCheck | None) -> BenchResult:
    """Each mode summarised against the reference's tokens and the measured limit."""
    import torch

    from kvcache_cli.models.linear import weights_format

    cfg = model.config
    param = next(model.parameters())
    device, element = param.device, param.element_size()
    prompt_len, n_steps = len(plan.prompt), plan.n_steps
    pooled = tuple(_pooled(p) for p in measured.probes.values())
    best = max(pooled, key=lambda p: p.best_gbps)
    w_bytes = weight_bytes(model)
    # The reference script's formula at seq 1, over the KV heads the cache holds.
    kv_token = kv_cache_bytes(cfg.n_layer, cfg.n_kv_head, cfg.head_size, 1, element)
    # Decode step i attends over the prompt, the prefill's token and i more.
    lengths = [prompt_len + 1 + i for i in range(n_steps)]
    step_bytes = [w_bytes + kv_token * length for length in lengths]
    reference = measured.runs[plan.reference_mode][0].tokens
    results = []
    for m in plan.modes:
        file = measured.llama_files.get(m)
        # A llama.cpp mode reads its own file's weights and a float16 KV cache.
        mode_bytes = (_mode_step_bytes(m, model, w_bytes, lengths, element, step_bytes)
                      if file is None else
                      [file.weight_bytes + file.kv_bytes_per_token * length
                       for length in lengths])
        results.append(_summarise(m, measured.runs[m], reference, mode_bytes, best.best_gbps,
                                  measured.compile_s.get(m),
                                  w_bytes if file is None else file.weight_bytes))
    results = _with_margins(model, plan.prompt, reference, results)
    mean_bytes = sum(step_bytes) / len(step_bytes)
    profile_lengths = tuple(
        lengths[min(max(0, round(f * (n_steps - 1))), n_steps - 1)] for f in PROFILE_POINTS
    )
    return BenchResult(
        model=model_name,
        weights_note=weights_note,
        device=device.type,
        device_name=device_name(device),
        cpus=os.cpu_count() or 1,
        others_cpu_share=others_share,
        dtype=str(param.dtype).removeprefix("torch."),
        # The int8 products multiply bfloat16 rows, so they too depend on these.
        cpu_half_support=cpu_half_support() if device.type == "cpu" and (
            element == 2 or weights_format(model) != "fp32") else None,
        threads=threads,
        torch_version=torch.__version__,
        transformers_version=transformers_version(),
        n_params=sum(p.numel() for p in {p.data_ptr(): p for p in model.parameters()}.values()),
        prompt_len=prompt_len,
        new_tokens=plan.new_tokens,
        repeats=plan.repeats,
        warmup_tokens=plan.warmup,
        naive_samples=len(plan.naive_steps) if plan.sampled else None,
        reference_mode=plan.reference_mode,
        # A bounded cache evicts, so its tokens may part from the exact ones: not a failure.
        tokens_agree=all(r.same_tokens for r in results if bounded_spec(r.mode) is None),
        weights_format=weights_format(model),
        weights_check=check,
        llama_cpp_version=llama_version() if measured.llama_files else None,
        weight_bytes=w_bytes,
        kv_bytes_per_token=kv_token,
        step_bytes_first=step_bytes[0],
        step_bytes_last=step_bytes[-1],
        probes=pooled,
        limit_probe=best.name,
        limit_gbps=best.best_gbps,
        ceiling_tokens_per_s=best.best_gbps * 1e9 / mean_bytes,
        profile_lengths=profile_lengths,
        modes=_with_ratios(results),
    )


def _mode_step_bytes(mode: str, model, w_bytes: int, lengths: Sequence[int], element: int,
                     exact: list[int]) -> list[int]:
    """Bytes decode step i reads: the weights and what the cache holds then, which a
    bounded cache caps at its budget (with H2O's scores and positions)."""
    from kvcache_cli.caches.spec import layer_bytes

    spec = bounded_spec(mode)
    if spec is None:
        return exact
    c = model.config
    return [w_bytes + c.n_layer * layer_bytes(spec, n, c.n_kv_head, c.head_size, element)
            for n in lengths]


def cpu_half_support() -> str:
    """The CPU's half-precision instructions, from /proc/cpuinfo's flags (Linux)."""
    flags: set[str] = set()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    wanted = ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16")
    has = [flag for flag in wanted if flag in flags]
    lacks = [flag for flag in wanted if flag not in flags]
    return (f"has {', '.join(has)}" if has else "has none of " + ", ".join(wanted)) + (
        f"; lacks {', '.join(lacks)}" if has and lacks else "")


