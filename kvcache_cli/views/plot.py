"""What every plot shares: matplotlib asked for only when a plot is (an optional extra),
each mode's one colour, `plain_log_ticks` (every plot's one tick format on a log axis),
and `sparkline`, which draws a per-step curve in one line of text, so the terminal
shows its shape without matplotlib. Each command's PNG is drawn in its own module
(`bench_plot`, `eval_plot`, `serve_plot`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

BARS = "▁▂▃▄▅▆▇█"
# One colour per mode whatever subset ran, so plots from different runs compare.
COLORS = {
    "naive": "tab:blue", "concat": "tab:orange", "static": "tab:green", "hf": "tab:red",
    "hf-static": "tab:purple", "static-compiled": "tab:olive", "hf-static-compiled": "tab:pink",
    "hf-quanto": "darkgoldenrod",
}  # fmt: skip
# Any other cache spec is coloured by its kind, whatever its fields (window:128, window:256).
KIND_COLORS = {"paged": "tab:gray", "window": "tab:cyan", "sink": "tab:brown", "h2o": "black"}


def color(mode: str) -> str | None:
    return COLORS.get(mode) or KIND_COLORS.get(mode.split(":", 1)[0])


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def require_matplotlib() -> None:
    """Fail before a long benchmark, not after it, when the plot cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise PlotUnavailable(
            "--plot needs matplotlib: pip install 'kvcache[plot]' (or drop --plot)"
        ) from error


def line_axes(figsize: tuple[float, float] = (8, 4.5)):
    """(figure, axes) for a line plot: the object-oriented API on the Agg canvas, so no GUI
    backend and no pyplot state."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=120)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def finish_png(fig, ax, path) -> Path:
    """Grid, legend and tight layout, then the PNG at `path`."""
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    return path


def sparkline(values: Sequence[float], width: int = 48) -> str:
    """`values` as at most `width` bars, each the median of its share of the points.

    The scale starts at zero, not at the smallest value: a flat curve then reads as
    a flat row of tall bars, and a rising one climbs, instead of noise being
    stretched to fill the height.
    """
    if not values:
        return ""
    width = min(width, len(values))
    buckets = [
        values[i * len(values) // width : (i + 1) * len(values) // width] for i in range(width)
    ]
    heights = [statistics.median(bucket) for bucket in buckets]
    top = max(heights)
    if top <= 0:
        return BARS[0] * width
    return "".join(BARS[min(len(BARS) - 1, int(h / top * len(BARS)))] for h in heights)


def plain_number(v: float, tiny: bool = False) -> str:
    """A tick as a plain number: 1,000, 600 and 0.05, never 10³, 6×10² or 5×10⁻²; on an
    axis reaching below a thousandth (TINY), every tick under 1 as 5e-5, so 0.0001 and
    5e-05 never stand side by side."""
    if v >= 1:
        return f"{v:,.0f}"
    if tiny:
        mantissa, exponent = f"{v:.0e}".split("e")
        return f"{mantissa}e{int(exponent)}"
    return f"{v:g}"


def plain_log_ticks(ax, which: str = "y") -> None:
    """One tick format on a log axis of AX ('x' or 'y'), major and minor ticks alike:
    plain numbers (`plain_number`), where matplotlib writes its minor ticks as 6×10² beside
    a major 100. Between two powers of ten every tick is labelled on an axis spanning less
    than a decade, 2 and 5 on one spanning less than three, none on a wider one, so the
    labels never overprint."""
    import math

    from matplotlib.ticker import FuncFormatter

    low, high = ax.get_ylim() if which == "y" else ax.get_xlim()  # after the data: autoscaled
    decades = math.log10(high / low) if low > 0 else math.inf
    tiny = 0 < low < 1e-3

    def minor(v: float, _position=None) -> str:
        if v <= 0 or decades >= 3:
            return ""
        lead = round(v / 10 ** math.floor(math.log10(v)))
        return plain_number(v, tiny) if decades < 1 or lead in (2, 5) else ""

    axis = ax.yaxis if which == "y" else ax.xaxis
    axis.set_major_formatter(FuncFormatter(lambda v, _position=None: plain_number(v, tiny)))
    axis.set_minor_formatter(FuncFormatter(minor))


