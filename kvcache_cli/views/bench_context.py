"""Views of a `ContextResult` (`bench --context`): per context, each cache's decode step in
kvcache beside llama.cpp's with the matched cache type, the bytes each step reads of its
cache, and a plot of step time against context, one line per cache and engine."""

from __future__ import annotations

from pathlib import Path

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvcache_cli.bench.context import ContextResult
from kvcache_cli.views.bench import decimal_bytes, load_line
from kvcache_cli.views.plot import finish_png, line_axes
from kvcache_cli.views.style import figures_table, label_grid

WEIGHTS = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16",
           "int8": "int8 (one scale per output channel)", "q4": "the GGUF's own 4-bit blocks",
           "gguf": "the GGUF's blocks as stored",
           "gguf-q8": "the GGUF's blocks as stored, in llama.cpp's integer arithmetic",
           "q8_0": "llama.cpp's Q8_0 blocks, in its integer arithmetic"}


def _header(r: ContextResult) -> Table:
    grid = label_grid()
    grid.add_row("model", f"[bold]{r.model}[/], {WEIGHTS.get(r.weights, r.weights)} weights "
                 f"({decimal_bytes(r.weight_bytes)} a step), [bold]{r.threads} threads[/]")
    grid.add_row("head", f"the vocabulary's: {decimal_bytes(r.head_bytes)} of those weights "
                 f"({r.head_bytes / r.weight_bytes:.0%}), read whole every step")
    grid.add_row("run", f"at each context, {r.repeats} round{'s' * (r.repeats > 1)} of "
                 f"{r.steps} decode steps per engine, taking turns; medians over every step, "
                 "the rounds' spread beside them")
    grid.add_row("fill", "ours: seeded random keys and values written into every layer; "
                 "llama.cpp: the same number of tokens as one prefill (flash attention on)")
    if r.replay:
        grid.add_row("steps", "ours as `generate` runs them: replayed (each step's native "
                     "calls recorded once and run again) where the cache says so, eager "
                     "elsewhere")
    if r.llama_file:
        grid.add_row("llama.cpp", f"the same weights, {r.llama_file}")
    elif r.llama_note:
        grid.add_row("llama.cpp", Text(f"absent: {r.llama_note}", style="yellow"))
    if r.kernel_note:
        grid.add_row("note", Text(r.kernel_note, style="yellow"))
    if r.others_cpu_share is not None:
        grid.add_row("load", load_line(r.others_cpu_share))
    return grid


def _float_baseline(r: ContextResult):
    """Our float cache every other step is divided by: the half-precision one engines
    deploy (fp16, llama.cpp's default f16) where it ran, else the float32 one."""
    return r.of("kvcache", "fp16") or r.of("kvcache", "static")


def _name(s) -> str:
    """Our cache's spec, marked where its steps were replayed."""
    return f"{s.cache} (replayed)" if s.replayed else s.cache


def _rows(r: ContextResult) -> list[tuple[str, ...]]:
    """One row per (context, our cache): its step, against our float cache, and the
    matched llama.cpp cache's step and bytes beside it."""
    base = _float_baseline(r)
    rows = []
    for i, context in enumerate(r.contexts):
        for s in (s for s in r.series if s.engine == "kvcache"):
            p = s.points[i]
            over = "-" if base is None else f"{p.step_ms / base.points[i].step_ms:.2f}x"
            peer = r.of("llama.cpp", s.matches) if s.matches else None
            q = peer.points[i] if peer else None
            rows.append((f"{context:,}" if s is r.series[0] else "", _name(s),
                         f"{p.step_ms:.1f}", f"{p.spread_ms[0]:.1f}-{p.spread_ms[1]:.1f}",
                         decimal_bytes(p.cache_bytes), over,
                         s.matches or "-", "-" if q is None else f"{q.step_ms:.1f}",
                         "-" if q is None else decimal_bytes(q.cache_bytes),
                         "-" if q is None else f"{p.step_ms / q.step_ms:.2f}x"))
    return rows


def _table(r: ContextResult) -> Table:
    base = _float_baseline(r)
    table = figures_table("context", "cache", "ms/step", "spread", "cache read",
                          f"÷{base.cache if base else 'static'}",
                          "llama.cpp", "ms/step", "cache read", "÷llama.cpp",
                          title="one decode step at each context: ours, and llama.cpp's with "
                          "the matched cache type")
    table.columns[1].justify = table.columns[6].justify = "left"
    for row in _rows(r):
        table.add_row(*row)
    return table


def context_view(r: ContextResult) -> RenderableType:
    return Group(_header(r), _table(r))


def save_context_plot(r: ContextResult, path: str | Path) -> Path:
    """Step time against context: ours solid, llama.cpp dashed, one line per cache."""
    fig, ax = line_axes()
    for s in r.series:
        ours = s.engine == "kvcache"
        ax.plot([p.context for p in s.points], [p.step_ms for p in s.points],
                "o-" if ours else "s--", ms=4, lw=1.2,
                label=_name(s) if ours else f"llama.cpp {s.cache} cache")
    static = r.of("kvcache", "static")
    if static is not None:  # where a step reads more bytes of cache than of weights
        per_token = static.points[-1].cache_bytes / static.points[-1].context
        crossing = r.weight_bytes / per_token
        if crossing <= r.contexts[-1]:
            ax.axvline(crossing, color="grey", lw=0.8)
            ax.annotate(" float cache > weights", (crossing, 0), xycoords=("data", "axes "
                        "fraction"), xytext=(2, 4), textcoords="offset points", color="grey",
                        fontsize=8)
    ax.set_xlabel("cached tokens")
    ax.set_ylabel("ms per decode step")
    ax.set_ylim(bottom=0)
    threads = f"{r.threads} thread{'s' * (r.threads > 1)}"
    model = r.model.split(" (")[0]  # the name, not where it was read from
    ax.set_title(f"{model} · {r.weights} weights · {threads} · median of "
                 f"{r.repeats}×{r.steps} steps", fontsize=9)
    return finish_png(fig, ax, path)
