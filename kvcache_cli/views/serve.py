"""Rich views of `kvcache serve`: the engines side by side, or the batching sweep.

Numbers come from the result untouched; `--json` prints the same object.
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvcache_cli.serving.batching import SweepResult
from kvcache_cli.serving.engines import ServeResult
from kvcache_cli.views.bench import _bytes, load_line
from kvcache_cli.views.style import BAD, OK, figures_table


def _opt(x, fmt: str = "{:,}") -> str:
    return "-" if x is None else fmt.format(x)


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _grid() -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="dim")
    grid.add_column()
    return grid


def _header(r: ServeResult) -> Table:
    w = r.workload
    grid = _grid()
    grid.add_row("model", f"[bold]{r.model}[/]")
    if r.weights_note:
        grid.add_row("note", f"[yellow]{r.weights_note}[/]")
    grid.add_row("device", f"[bold]{r.device}[/] ({r.device_name}, {r.cpus} CPUs), {r.dtype}, "
                 f"[bold]{r.threads} threads[/]")
    if r.others_cpu_share is not None:
        grid.add_row("load", load_line(r.others_cpu_share))
    arrivals = "all at once" if w.rate is None else f"Poisson, {w.rate:g} requests/s"
    prefix = f"a shared {w.shared_prefix}-token prefix + " if w.shared_prefix else ""
    grid.add_row("workload", f"{w.requests} requests, {prefix}prompts "
                 f"{w.prompt_len[0]}:{w.prompt_len[1]} and outputs "
                 f"{w.output_len[0]}:{w.output_len[1]} tokens (seed {w.seed}), {arrivals}: "
                 f"{r.prompt_tokens:,} prompt + {r.output_tokens:,} output tokens, greedy")
    sharing = "prefix sharing on" if r.prefix_sharing else "prefix sharing off"
    grid.add_row("KV memory", f"[bold]{_bytes(r.kv_mem_bytes)}[/] for every engine "
                 f"({_bytes(r.bytes_per_token)} a token): paged {r.n_blocks:,} blocks of "
                 f"{r.block_size} tokens, {sharing}; padded {r.padded_rows} rows of "
                 f"{r.slab_len} positions; at most {r.max_batch} sequences at once")
    return grid


def _named(table: Table) -> Table:
    table.columns[0].no_wrap = True  # "sequential" whole: the figures wrap instead
    return table


def _speed(r: ServeResult) -> Table:
    timed = r.workload.rate is not None
    table = figures_table(
        "engine", "tok/s", "run s", "setup s", "×seq", "×pad", "×hf",
        "TTFT s" + (" p50/99" if timed else ""), "ms/tok",
        title="throughput: output tokens over the run, set-up apart; medians per request")
    _named(table)
    for e in r.engines:
        ttft = f"{e.ttft_ms_p50 / 1e3:.1f}" + (f"/{e.ttft_ms_p99 / 1e3:.1f}" if timed else "")
        table.add_row(f"[bold]{e.engine}[/]", f"[bold]{e.tokens_per_s:,.1f}[/]",
                      f"{e.total_s:,.1f}", f"{e.setup_s:,.1f}", _ratio(e.over_sequential),
                      _ratio(e.over_padded), _ratio(e.over_hf), ttft, f"{e.tpot_ms_p50:,.1f}")
    return table


def _memory(r: ServeResult) -> Table:
    table = figures_table(
        "engine", "KV held", "tokens", "peak", "real", "seqs", "hits", "preempt", "= solo",
        title="KV memory: held, the tokens a pool holds, peak in use, the share holding real "
        "tokens; peak sequences running, prefix blocks hit, preemptions")
    _named(table)
    for e in r.engines:
        exact = f"{OK} {e.requests_exact}/{r.workload.requests}" if not e.mismatches else \
            f"{BAD} {e.requests_exact}/{r.workload.requests}"
        table.add_row(e.engine, _bytes(e.kv_reserved_bytes), _opt(e.pool_tokens),
                      _bytes(e.kv_peak_used_bytes),
                      _opt(e.kv_utilisation, "{:.1%}"), _opt(e.peak_running),
                      _opt(e.prefix_blocks_hit), _opt(e.preemptions), exact)
    return table


def _verdict(r: ServeResult) -> RenderableType:
    lines = []
    for e in r.engines:
        for m in e.mismatches:
            lines.append(Text.from_markup(
                f"{BAD} {e.engine}: request {m.request} left its solo tokens at new token "
                f"{m.step}: the solo top-2 logits are {m.top2_gap:.3g} apart, "
                f"{m.top2_gap / m.logit_scale:.1e} of the largest; "
                + ("a near-tie that float32 summation order can flip"
                   if m.near_tie else "not a near-tie: look for a bug")))
    if not lines:
        lines.append(Text.from_markup(
            f"{OK} every engine gave every request exactly its solo (static cache) tokens"))
    return Group(*lines)


def _sweep(r: SweepResult) -> RenderableType:
    grid = _grid()
    grid.add_row("model", f"[bold]{r.model}[/]")
    grid.add_row("device", f"[bold]{r.device}[/] ({r.device_name}), {r.dtype}, "
                 f"[bold]{r.threads} threads[/]")
    grid.add_row("roofline", f"{r.bandwidth_gbps:.1f} GB/s (copy), {r.peak_gflops:,.0f} GFLOP/s "
                 f"(matmul), both measured now: ridge at {r.ridge:.1f} FLOPs/byte")
    grid.add_row("run", f"{r.steps} timed decode steps per batch at context {r.context}, median")
    table = figures_table("batch", "step ms", "tokens/s", "×batch 1", "FLOPs/byte",
                          "roofline ms", title="decode step time against batch size")
    for p in r.points:
        table.add_row(str(p.batch), f"{p.step_ms:,.1f}", f"[bold]{p.tokens_per_s:,.1f}[/]",
                      f"{p.over_batch1:.2f}x", f"{p.intensity:.1f}", f"{p.predicted_ms:,.1f}")
    if r.measured_knee is None:
        line = (f"no knee measured: up to batch {r.points[-1].batch} a step stays under twice "
                f"batch 1's; the roofline puts it at batch {_opt(r.predicted_knee, '{:.0f}')}")
    else:
        verdict = {True: f"{OK} agrees (within 2x)", False: f"{BAD} disagrees",
                   None: "no roofline knee to compare"}[r.agrees]
        line = (f"batching is nearly free up to batch ~{r.measured_knee:.0f} (a step costs "
                f"twice batch 1's there); the roofline predicts batch "
                f"{_opt(r.predicted_knee, '{:.0f}')}: {verdict}")
    return Group(grid, table, Text.from_markup(line))


def render(r: ServeResult | SweepResult) -> RenderableType:
    if isinstance(r, SweepResult):
        return _sweep(r)
    return Group(_header(r), _speed(r), _memory(r), _verdict(r))
