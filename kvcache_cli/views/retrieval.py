"""Views of a `RetrievalResult` (`kvcache eval --task retrieval`): a rich table for a
terminal, plain text for a pipe or a file, and the plot (accuracy against bytes per token);
`--json` prints the same object. One row per cache: accuracy overall and by depth, bytes
held per token, and the prefill, compression and decode times."""

from __future__ import annotations

from pathlib import Path

from rich.console import Group, RenderableType

from kvcache_cli.eval.retrieval import CacheScore, RetrievalResult
from kvcache_cli.views.layout import text_line, text_table
from kvcache_cli.views.style import figures_table, label_grid


def columns(r: RetrievalResult) -> tuple[str, ...]:
    return ("cache", "accuracy", *(f"@{d:.0%}" for d in r.depths), "bytes/tok", "× exact",
            "prefill ms", "compress ms", "compress %", "ms/tok")


def cells(s: CacheScore) -> tuple[str, ...]:
    share = f"{s.compress_ms / s.prefill_ms:.1%}" if s.compress_ms else "-"
    return (s.cache, f"{s.accuracy:.0%}", *(f"{a:.0%}" for _, a in s.by_depth),
            f"{s.bytes_per_token:,.0f}", f"{s.bytes_ratio:.3f}", f"{s.prefill_ms:.0f}",
            f"{s.compress_ms:.1f}" if s.compress_ms else "-", share,
            f"{s.decode_ms_per_token:.1f}")


def _run_line(r: RetrievalResult) -> str:
    lengths = ", ".join(f"{n:,} ({p:,} with the template)"
                        for n, p in zip(r.lengths, r.prompt_tokens, strict=True))
    prompts = len(r.answers) // len(r.scores)
    return (f"{prompts} prompts: a pass key at depths "
            f"{', '.join(f'{d:.0%}' for d in r.depths)} of {lengths} filler tokens, asked "
            f"through {r.prompter}; greedy replies, exact match on the key; each prompt "
            "prefilled in one forward (a compressing cache compresses it then)")


def render(r: RetrievalResult) -> RenderableType:
    grid = label_grid()
    grid.add_row("model", f"[bold]{r.model}[/] on {r.device}")
    grid.add_row("run", _run_line(r))
    table = figures_table(*columns(r), title="retrieval accuracy against bytes held and "
                          "time (medians over prompts; times on a shared machine are "
                          "indicative)")
    table.columns[0].no_wrap = True
    for s in r.scores:
        table.add_row(*cells(s))
    return Group(grid, table)


def plain(r: RetrievalResult, width: int) -> str:
    """The same figures as text at WIDTH columns (the table split into blocks that fit)."""
    rows = [columns(r), *(cells(s) for s in r.scores)]
    return "\n".join([*text_line("model", f"{r.model} on {r.device}", width),
                      *text_line("run", _run_line(r), width), "", *text_table(rows, width)])


def save_plot(r: RetrievalResult, path: str | Path) -> Path:
    """Accuracy against bytes held per token, one point per cache, and accuracy by depth."""
    from kvcache_cli.views.plot import require_matplotlib

    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    frontier, by_depth = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for i, s in enumerate(r.scores):
        color = f"C{i % 10}"
        frontier.scatter(s.bytes_per_token, 100 * s.accuracy, color=color, label=s.cache)
        by_depth.plot([100 * d for d, _ in s.by_depth], [100 * a for _, a in s.by_depth],
                      marker="o", color=color, label=s.cache)
    frontier.set_xlabel("bytes held per token of context")
    frontier.set_ylabel("pass-key accuracy, %")
    by_depth.set_xlabel("depth of the key in the filler, %")
    by_depth.set_ylabel("accuracy, %")
    for ax in (frontier, by_depth):
        ax.set_ylim(-5, 105)
        ax.grid(alpha=0.3)
    by_depth.legend(fontsize=7)
    fig.suptitle(f"{r.model}: pass-key retrieval, {', '.join(map(str, r.lengths))} tokens")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    return out
