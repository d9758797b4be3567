"""`bench --plot`: the article's one-plot summary, per-step decode latency against context
length, one curve per mode, as a PNG (matplotlib, imported only when a plot is asked for)."""

from __future__ import annotations

from pathlib import Path

from kvcache_cli.bench.results import BenchResult
from kvcache_cli.views.plot import color, finish_png, line_axes


def save_plot(result: BenchResult, path: str | Path) -> Path:
    """Per-step latency (median over repeats) against context length, one line per mode."""
    fig, ax = line_axes()
    for mode in result.modes:
        # Decode step i runs at context length prompt + 1 + i.
        lengths = [result.prompt_len + 1 + i for i in mode.steps]
        sampled = len(mode.steps) < result.new_tokens - 1  # naive, timed at a few steps
        ax.plot(lengths, mode.median_step_ms,
                label=f"{mode.mode} ({mode.tokens_per_s_median:.1f} tok/s"
                + (f", {len(mode.steps)} steps timed)" if sampled else ")"),
                lw=1.2, color=color(mode.mode), marker="o" if sampled else None, ms=3)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode step latency (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title(
        f"{result.model} · {result.device} ({result.dtype}, {result.threads} threads) · "
        f"median of {result.repeats}",
        fontsize=9,
    )
    return finish_png(fig, ax, path)
