"""Runs into figures: medians over repeats, the per-step profile, each mode's share of the
limit and its ratio to the others, the bytes a step reads, the result a run returns."""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kv_cache_from_scratch import kv_cache_bytes
from kvcache_cli.bench.bandwidth import pool_probes
from kvcache_cli.bench.modes import bounded_spec, cpu_half_support
from kvcache_cli.bench.results import BenchPlan, BenchResult, Measured, ModeResult
from kvcache_cli.bench.runners import TimedRun
from kvcache_cli.measure import device_name, head_bytes, transformers_version, weight_bytes
from kvcache_cli.models.llama_cpp import llama_version

if TYPE_CHECKING:
    from kvcache_cli.bench.weight_check import WeightCheck
    from kvcache_cli.caches.base import CacheShape
    from kvcache_cli.caches.spec import CacheSpec


# Where along the generation the per-step latency is reported (fractions of the
# decode steps); 0 and 1 are the first and last decode steps.
PROFILE_POINTS = (0.0, 0.25, 0.5, 0.75, 1.0)


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
    runs: list[TimedRun],
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


def kernel_note() -> str | None:
    """Why a C++ kernel this process asked for runs in torch instead, in one line (None:
    every one asked for was built): attention over codes, the products, the fused ops; or
    why a replayed mode's steps ran eager."""
    from kvcache_cli.caches import code_attention
    from kvcache_cli.generate import REPLAY_NOTE
    from kvcache_cli.models import fused, linear

    notes = (code_attention.NOTE, linear.NOTE, fused.NOTE, REPLAY_NOTE)
    return "; ".join(note[-1] for note in notes if note) or None


def bench_result(model, plan: BenchPlan, measured: Measured, threads: int,
                 others_share: float | None, model_name: str, weights_note: str | None,
                 check: WeightCheck | None) -> BenchResult:
    """Each mode summarised against the reference's tokens and the measured limit."""
    import torch

    from kvcache_cli.models.linear import weights_format

    cfg = model.config
    param = next(model.parameters())
    device, element = param.device, param.element_size()
    prompt_len, n_steps = len(plan.prompt), plan.n_steps
    pooled = tuple(pool_probes(p) for p in measured.probes.values())
    best = max(pooled, key=lambda p: p.best_gbps)
    w_bytes = weight_bytes(model)
    # The reference script's formula at seq 1, over the KV heads the cache holds.
    kv_token = kv_cache_bytes(cfg.n_layer, cfg.n_kv_head, cfg.head_size, 1, element)
    # Decode step i attends over the prompt, the prefill's token and i more.
    lengths = [prompt_len + 1 + i for i in range(n_steps)]
    step_bytes = [w_bytes + kv_bytes_read(model.config.cache_shape, length, element)
                  for length in lengths]
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
        kernel_note=kernel_note(),
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
        head_bytes=head_bytes(model),
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

    spec = bounded_spec(mode)
    if spec is None:
        return exact
    return [w_bytes + kv_bytes_read(model.config.cache_shape, n, element, spec)
            for n in lengths]


def kv_bytes_read(shape: CacheShape, n: int, element: int, spec: CacheSpec | None = None
                  ) -> int:
    """K and V a decode step reads at `n` positions: a sliding layer at most its window
    (the ring it holds, exact; a half kind's in its 2 bytes), a full-attention layer all
    `n`, or what a bounded `spec` keeps of them (the spec goes on the full-attention layers
    only, as `make_cache` puts it)."""
    from kvcache_cli.caches.spec import layer_bytes, ring_element

    per_position = 2 * shape.n_kv_head * shape.head_size * element  # K and V, one layer
    per_slot = 2 * shape.n_kv_head * shape.head_size * ring_element(spec, element)
    total = 0
    for t in shape.layer_types:
        if t.sliding:
            total += per_slot * min(n, t.window)
        elif spec is None:
            total += per_position * n
        else:
            total += layer_bytes(spec, n, shape.n_kv_head, shape.head_size, element)
    return total
