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
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvcache_cli import TORCH_INSTALL
from kvcache_cli.bench.bandwidth import copy_probe, measure_products, measure_read
from kvcache_cli.bench.modes import (
    COMPILE_MODE,
    DEFAULT_MODES,
    bounded_spec,
    parse_modes,
    random_prompt,
)
from kvcache_cli.bench.results import (
    BenchPlan,
    BenchResult,
    FinishedFn,
    Measured,
    ProgressFn,
)
from kvcache_cli.bench.runners import (
    NAIVE_SAMPLES,
    WARMUP_TOKENS,
    TimedRun,
    hf_copy,
    run_hf,
    run_llama,
    run_naive_sampled,
    run_ours,
    sampled_steps,
)
from kvcache_cli.bench.summary import bench_result
from kvcache_cli.measure import (
    OtherProcesses,
    measure_bandwidth,
    transformers_version,
)
from kvcache_cli.models.llama_cpp import LLAMA_MODES, check_llama_modes

if TYPE_CHECKING:

    from kvcache_cli.models.llama_cpp import LlamaRunner


# Larger than any last-level cache on either device, so the probes stream DRAM/HBM.


# ---------------------------------------------------------------------------
# Inputs


# ---------------------------------------------------------------------------
# Counting bytes


# ---------------------------------------------------------------------------
# Clocks


# ---------------------------------------------------------------------------
# One timed run per mode


# ---------------------------------------------------------------------------
# Summaries


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
    return bench_result(model, plan, measured, used_threads, others.share(), model_name,
                   weights_note, check)  # fmt: skip


def _plan(modes: tuple[str, ...], prompt_len: int, new_tokens: int, repeats: int,
          naive_samples: int, warmup_tokens: int, prompt: list[int]) -> BenchPlan:
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
    return BenchPlan(modes, prompt, new_tokens, repeats, warmup, sampled, naive_steps, order,
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


def _measure(model, plan: BenchPlan, bandwidth_mib: int | None, counter: _Counter,
             finished: FinishedFn | None, gguf_dir=None) -> Measured:
    """The untimed warm-ups, then the repeats: each probes the bandwidth and runs every mode."""
    with contextlib.ExitStack() as stack:
        llama = _llama_runners(model, plan, counter, gguf_dir, stack)
        return _measure_with(model, plan, bandwidth_mib, counter, finished, llama)


def _llama_runners(model, plan: BenchPlan, counter: _Counter, gguf_dir,
                   stack: contextlib.ExitStack) -> dict[str, LlamaRunner]:  # fmt: skip
    """A llama.cpp model per llama.cpp mode, its GGUF written (or found) first, each
    closed when the stack unwinds; on torch's thread count, as our modes run."""
    import torch

    from kvcache_cli.models import llama_cpp as llama_peer

    runners = {}
    for mode in (m for m in plan.modes if m in LLAMA_MODES):
        counter.show(f"GGUF for {mode} ({LLAMA_MODES[mode]})")
        file = llama_peer.prepare(model, mode, gguf_dir)
        runner = llama_peer.LlamaRunner(file, len(plan.prompt) + plan.new_tokens,
                                        torch.get_num_threads())  # fmt: skip
        stack.callback(runner.close)
        runners[mode] = runner
    return runners


def _measure_with(model, plan: BenchPlan, bandwidth_mib: int | None, counter: _Counter,
                  finished: FinishedFn | None, llama: dict[str, LlamaRunner]) -> Measured:

    from kvcache_cli.generate import CompiledDecode, ReplayedDecode

    device = next(model.parameters()).device
    modes = plan.modes
    hf_model = hf_copy(model, device) if any(m.startswith("hf") for m in modes) else None
    compiled = None
    if any(m.endswith("-compiled") and not m.startswith("hf") for m in modes):
        compiled = CompiledDecode(model, COMPILE_MODE[device.type])
    replayed = ReplayedDecode(model) if "static-replayed" in modes else None
    measured = Measured({mode: [] for mode in modes}, {"read": [], "copy": [], "product": []},
                         {}, {mode: runner.file for mode, runner in llama.items()})  # fmt: skip
    prompt, new_tokens = plan.prompt, plan.new_tokens

    def run(mode: str, n: int, label: str, warm: bool = False) -> TimedRun:
        on_token = counter.on_token(label)
        if mode in llama:
            return run_llama(llama[mode], prompt, n, device, on_token)
        if mode.startswith("hf"):
            return run_hf(hf_model, prompt, new_tokens, mode, device, on_token,
                           n if warm else None)  # fmt: skip
        if mode == "naive" and plan.sampled and not warm:
            reference = measured.runs[plan.reference_mode][0].tokens
            return run_naive_sampled(model, prompt, reference, plan.naive_steps, device,
                                      on_token)  # fmt: skip
        return run_ours(model, prompt, n, mode, device, on_token,
                        max_len=len(prompt) + new_tokens,
                        forward=compiled if mode.endswith("-compiled") else
                        replayed if mode == "static-replayed" else None)

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
        measured.probes["copy"].append(copy_probe(measure_bandwidth(device, bandwidth_mib)))
        measured.probes["product"].append(measure_products(model))
        for mode in plan.order:
            label = f"{mode} {r + 1}/{plan.repeats}"
            result = run(mode, new_tokens, label)
            measured.runs[mode].append(result)
            if finished is not None:
                finished(label, len(result.step_ms) / (sum(result.step_ms) / 1e3))
    return measured


