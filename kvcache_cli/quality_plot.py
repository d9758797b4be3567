"""`kvcache eval --plot`: the frontier (KL divergence from the exact cache against bytes
per token, one point per cache) beside the loss above the exact cache's by position (one
smoothed line per cache, so a collapse shows where it starts). A colour per kind (every
int4 layout one colour), a marker per layout within it. matplotlib is imported only here,
and only when a plot is asked for."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvcache_cli.plot import plain_log_ticks, require_matplotlib
from kvcache_cli.quality import QualityResult

SMOOTH_POINTS = 60  # the loss curve is averaged over windows of about scored / this tokens
MARKERS = "osD^vP*Xh<>p"
# Qualitative colours no two alike (tab10, then Dark2's): a kind's colour never repeats
# another's, where a cycle of ten (or tab20's light-dark pairs) would.
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf", "#1b9e77", "#d95f02", "#7570b3", "#e7298a",
           "#66a61e", "#e6ab02", "#a6761d", "#000000")


def kind_styles(caches: Sequence[str]) -> list[tuple[str, str]]:
    """(colour, marker) per cache: a colour per kind (the spec before its first ':', so
    int4:g32:kchan:r128 and int4:g32:kchan:r64 share one), a marker per cache within its
    kind; a kind past the palette's colours takes grey and its own markers."""
    kinds: dict[str, int] = {}
    within: dict[str, int] = {}
    styles = []
    for cache in caches:
        kind = cache.split(":")[0]
        kinds.setdefault(kind, len(kinds))
        n = within[kind] = within.get(kind, -1) + 1
        index = kinds[kind]
        color = PALETTE[index] if index < len(PALETTE) else "#bbbbbb"
        styles.append((color, MARKERS[(n + (0 if index < len(PALETTE) else index)) %
                                      len(MARKERS)]))
    return styles


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """The mean of each `window` consecutive values (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def save_plot(result: QualityResult, path: str | Path) -> Path:
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    frontier, by_position = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    # Named in the legend: quantised caches crowd one corner of the frontier, where labels
    # beside the points would overprint each other.
    colors, markers = zip(*kind_styles([row.cache for row in result.caches]), strict=True)
    reference = result.caches[0]
    # KL from the exact distribution on a log axis: never negative (perplexity's change
    # is, for fp8, which needed a symmetric-log axis), and int8's 1e-5 beside a window's
    # 1 on one scale. A cache that changed nothing (the exact ones, a residual that held
    # every token) has KL 0: drawn on a floor line a decade under the lowest other.
    positive = [row.kl_mean for row in result.caches if row.kl_mean > 0]
    floor = min(positive, default=1e-3) / 10
    frontier.axhline(floor, color="black", lw=0.8, ls="--", zorder=2)
    frontier.annotate("KL 0: the exact distribution", (0, floor), xycoords=(
        "axes fraction", "data"), xytext=(4, 3), textcoords="offset points", fontsize=7)
    for row, color, marker in zip(result.caches, colors, markers, strict=True):
        frontier.scatter(row.bytes_per_token, max(row.kl_mean, floor), color=color,
                         marker=marker, zorder=3, label=row.cache)
    frontier.set_xlabel("bytes held per token of context")
    frontier.set_ylabel(f"mean KL from {reference.cache}'s next-token distribution, "
                        "nats (log)")
    frontier.set_yscale("log")
    plain_log_ticks(frontier, "y")
    frontier.set_xlim(0, 1.1 * max(row.bytes_per_token for row in result.caches))
    frontier.legend(fontsize=7, ncol=2)
    frontier.set_title("the frontier: quality against memory (lower left is better)",
                       fontsize=9)
    frontier.grid(alpha=0.3)

    # The loss above the exact cache's: every cache's raw loss is dominated by the text
    # (all lines on top of each other); the excess shows where one starts to fail.
    window = max(1, result.scored // SMOOTH_POINTS)
    positions = range(result.prompt_len, result.tokens)
    exact = reference.loss_by_position
    by_position.axhline(0.0, color="black", lw=0.8, ls="--", label=f"exact ({reference.cache})")
    for row, color, marker in zip(result.caches[1:], colors[1:], markers[1:], strict=True):
        excess = [a - b for a, b in zip(row.loss_by_position, exact, strict=True)]
        by_position.plot(positions, moving_average(excess, window), color=color, lw=1.1,
                         marker=marker, markevery=max(1, len(excess) // 8), ms=4,
                         label=row.cache)
    by_position.set_xlabel("token position")
    by_position.set_ylabel(f"loss − exact loss, nats (mean of {window} tokens)")
    by_position.set_title("loss above the exact cache's: where a cache starts to fail",
                          fontsize=9)
    by_position.grid(alpha=0.3)
    by_position.legend(fontsize=7, ncol=2)
    fig.suptitle(f"{result.model} · {result.text} · {result.tokens:,} tokens, prompt "
                 f"{result.prompt_len}, {result.device} {result.dtype}", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    return path
