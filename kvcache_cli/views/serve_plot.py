"""`kvcache serve --plot`: KV in use and running sequences over time, one colour per
engine; with several `--rate`s, the curve instead: output tokens/s against p99 TTFT
and p99 TPOT, a point per rate, a line per engine and policy; for `--batch`,
tokens/s against batch size beside the roofline. matplotlib is imported only here,
and only when a plot is asked for."""

from __future__ import annotations

from pathlib import Path

from kvcache_cli.serving.batching import SweepResult
from kvcache_cli.serving.results import ServeResult
from kvcache_cli.views.plot import plain_log_ticks

COLORS = {"sequential": "tab:blue", "padded": "tab:orange", "paged": "tab:green",
          "hf": "tab:red"}


def save_plot(result: ServeResult | SweepResult, path: str | Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = figure(result)
    FigureCanvasAgg(fig)
    path = Path(path)
    fig.savefig(path, format="png")
    return path


def figure(result: ServeResult | SweepResult):
    """The matplotlib Figure `save_plot` writes."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4.5), dpi=120)
    if isinstance(result, SweepResult):
        _sweep(fig, result)
    elif len(result.rates) > 1:
        _curve(fig, result)
    else:
        _timelines(fig, result)
    fig.tight_layout(rect=(0, 0.04 if fig.texts else 0, 1, 1))  # room for a note below
    return fig


def _sweep(fig, result: SweepResult) -> None:
    from matplotlib.ticker import NullFormatter

    ax = fig.add_subplot()
    batches = [p.batch for p in result.points]
    ax.plot(batches, [p.tokens_per_s for p in result.points], "o-", label="measured")
    ax.plot(batches, [p.batch / p.predicted_ms * 1e3 for p in result.points], "--",
            label="roofline")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    # Plain numbers on both log axes (1, 4, 16 and 100, 600, 1,000), not 2², 10² or 6×10²:
    # the batch sizes measured are the x ticks.
    ax.set_xticks(batches)
    plain_log_ticks(ax, "x")
    ax.xaxis.set_minor_formatter(NullFormatter())
    plain_log_ticks(ax, "y")
    ax.set_xlabel("batch (sequences decoded at once)")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"{result.model} · {result.device} ({result.threads} threads)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _timelines(fig, result: ServeResult) -> None:
    kv, running = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for e in result.engines:
        if not e.timeline:
            continue  # transformers' run shows no internals: noted below
        t = [s.t_s for s in e.timeline]
        color = COLORS.get(e.engine)
        # Steps, not slopes: a count or a reservation holds its value until the next step
        # changes it (where="post": each sample holds until the next one).
        kv.step(t, [s.kv_used_bytes / 2**20 for s in e.timeline], where="post", color=color,
                label=f"{e.engine} in use", lw=1.2)
        kv.step(t, [s.kv_real_bytes / 2**20 for s in e.timeline], where="post", color=color,
                ls=":", lw=1, label=f"{e.engine} real tokens")
        running.step(t, [s.running for s in e.timeline], where="post", color=color, lw=1.2,
                     label=f"{e.engine} ({e.tokens_per_s:.0f} tok/s)")
    kv.set_xlabel("time (s)")
    kv.set_ylabel("KV cache (MiB)")
    kv.set_title(f"KV memory, {result.kv_mem_bytes / 2**20:.0f} MiB budget", fontsize=9)
    running.set_xlabel("time (s)")
    running.set_ylabel("sequences running")
    running.set_title(f"{result.model} · {result.device}", fontsize=9)
    for ax in (kv, running):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    hidden = [e for e in result.engines if not e.timeline]
    if hidden:
        names = ", ".join(f"{e.engine} ({e.tokens_per_s:.0f} tok/s)" for e in hidden)
        who = ("a server (--target) and transformers report" if any(e.remote for e in hidden)
               else "transformers reports")
        fig.text(0.01, 0.01, f"not drawn: {names}: {who} no KV use or running sequences "
                 "over time", fontsize=7, color="dimgray")


def _curve(fig, result: ServeResult) -> None:
    ttft, tpot = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    names = list(dict.fromkeys(e.engine for e in result.engines))
    styles = ["o-", "s--", "^-.", "v:", "D-", "P--"]
    for i, name in enumerate(names):
        runs = [e for e in result.engines if e.engine == name]
        color = COLORS.get(runs[0].engine.split()[0])
        style = styles[i % len(styles)]
        tok_s = [e.tokens_per_s for e in runs]
        for ax, key in ((ttft, "ttft"), (tpot, "tpot")):
            p99 = [getattr(e.latency, key).p99 for e in runs]
            ax.plot(tok_s, p99, style, color=color, label=name, lw=1.2, ms=4)
            # Each point says the arrival rate it was served at: the curve is a sweep.
            for e, x, y in zip(runs, tok_s, p99, strict=True):
                ax.annotate("all at once" if e.rate is None else f"{e.rate:g}/s", (x, y),
                            textcoords="offset points", xytext=(3, 3), fontsize=6,
                            color=color)
    rates = ", ".join("inf" if r is None else f"{r:g}" for r in result.rates)
    fig.suptitle(f"{result.model} · {result.device} · arrival rates {rates} requests/s",
                 fontsize=9)
    for ax, what, key in ((ttft, "p99 TTFT", "ttft"), (tpot, "p99 TPOT", "tpot")):
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"{what} (ms)")
        ax.set_yscale("log")
        # Plain milliseconds (200, 500, 1,000), not 2×10² or 10³.
        plain_log_ticks(ax, "y")
        target = (result.goodput or {}).get(key)
        if target is not None:
            ax.axhline(target, color="grey", ls=":", lw=1, label=f"target {target:g} ms")
        ax.set_title(f"{what} against throughput", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
