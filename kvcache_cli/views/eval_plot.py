"""`kvcache eval --plot`: the frontier (KL divergence from the exact cache against bytes
per token, one point per cache, a peer library's hollow) beside the loss above the exact
cache's by position (one smoothed line per cache, a peer's dashed, so a collapse shows
where it starts). A colour per kind (every int4 layout one colour), a marker per layout
within it. matplotlib is imported only here, and only when a plot is asked for."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path

from kvcache_cli.eval.quality import QualityResult
from kvcache_cli.views.plot import plain_log_ticks, require_matplotlib

SMOOTH_POINTS = 60  # the loss curve is averaged over windows of about scored / this tokens
MARKERS = "osD^vP*Xh<>p"
CROWDED = 12  # caches past which the legend leaves the axes
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

    # Past CROWDED rows one legend goes below both plots (the colours are shared), and the
    # figure grows to hold it: inside the axes it would hide the points.
    crowded = len(result.caches) > CROWDED
    rows = -(-len(result.caches) // 4)
    fig = Figure(figsize=(11, 4.5 + (0.2 * rows if crowded else 0)), dpi=120)
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
        # A peer's point is hollow, ringed in its colour: another library's cache, its
        # change taken against that library's own exact cache.
        style = dict(facecolors="none", edgecolors=color, linewidths=1.4) if row.peer else \
            dict(color=color)
        label = row.cache if row.cache.startswith(row.peer) else f"{row.cache} ({row.peer})"
        frontier.scatter(row.bytes_per_token, max(row.kl_mean, floor), marker=marker,
                         zorder=3, label=label, **style)
    frontier.set_xlabel("bytes held per token of context")
    peers = any(row.peer for row in result.caches)
    # Two lines at most: one line of this overran the axes' height and was cut.
    frontier.set_ylabel(textwrap.fill(
        f"mean KL from {reference.cache}'s next-token distribution"
        + (" (a peer: its own)" if peers else "") + ", nats (log)", 48))
    frontier.set_yscale("log")
    plain_log_ticks(frontier, "y")
    frontier.set_xlim(0, 1.1 * max(row.bytes_per_token for row in result.caches))
    if not crowded:
        frontier.legend(fontsize=7, ncol=2)
    frontier.set_title("the frontier: quality against memory (lower left is better)",
                       fontsize=9)
    frontier.grid(alpha=0.3)

    # The loss above the exact cache's: every cache's raw loss is dominated by the text
    # (all lines on top of each other); the excess shows where one starts to fail.
    window = max(1, result.scored // SMOOTH_POINTS)
    positions = range(result.prompt_len, result.tokens)
    by_position.axhline(0.0, color="black", lw=0.8, ls="--", label=f"exact ({reference.cache})")
    for row, color, marker in zip(result.caches, colors, markers, strict=True):
        if row.reference:  # flat at 0 against itself: the dashed line
            continue
        exact = result.against(row).loss_by_position
        excess = [a - b for a, b in zip(row.loss_by_position, exact, strict=True)]
        by_position.plot(positions, moving_average(excess, window), color=color, lw=1.1,
                         ls="--" if row.peer else "-",
                         marker=marker, markevery=max(1, len(excess) // 8), ms=4,
                         label=row.cache)
    by_position.set_xlabel("token position")
    by_position.set_ylabel(f"loss − exact loss, nats (mean of {window} tokens)")
    by_position.set_title("loss above the exact cache's: where a cache starts to fail",
                          fontsize=9)
    by_position.grid(alpha=0.3)
    if crowded:
        handles, labels = frontier.get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7)
    else:
        by_position.legend(fontsize=7, ncol=2)
    title = (f"{result.model} · {result.text} · {result.tokens:,} tokens, prompt "
             f"{result.prompt_len}, {result.device} {result.dtype}")
    # A long path wraps: 140 characters of 9-point text fill the 11-inch figure.
    fig.suptitle("\n".join(textwrap.wrap(title, 140)), fontsize=9)
    fig.tight_layout(rect=(0, 0.2 * rows / (4.5 + 0.2 * rows) + 0.02, 1, 1) if crowded
                     else None)
    path = Path(path)
    fig.savefig(path, format="png")
    return path
