"""Views of a `QualityResult` (`kvcache eval`): a rich table for a terminal, plain text
for a pipe or a file; `--json` prints the same object. Both show the same cells, taken
from the result untouched but for formatting."""

from __future__ import annotations

import math
import textwrap

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvcache_cli.eval.quality import CacheQuality, QualityResult
from kvcache_cli.sizing.units import format_gib
from kvcache_cli.views.layout import text_line, text_table
from kvcache_cli.views.plot import BARS
from kvcache_cli.views.style import figures_table, label_grid

# The rich view splits the row in two tables (quality; memory and time) so each fits
# 100 columns beside a long spec such as int4:g32:kchan:r128; plain text keeps one.
QUALITY = ("cache", "perplexity", "Δ ppl", "bits/tok", "KL mean", "KL max", "at", "top-1")
COST = ("bytes/tok", "× exact", "held", "prefill ms", "compress", "ms/tok")
KINDS = "held: global · sliding"  # a column on a model with sliding layers only
SPARK_WIDTH = 24


def excess_lines(r: QualityResult, width: int = SPARK_WIDTH) -> tuple[dict[str, str], float]:
    """Each cache's loss above the exact cache's, by position, as bars (each the mean of its
    share of the tokens) on one scale from 0 to the highest bar of any; and that highest,
    in nats. The exact row is all lowest bars; a cache that collapses rises where it does.
    A peer's row is measured from its own exact cache's loss (llama.cpp's f32 cache)."""

    def bars(values: list[float]) -> list[float]:
        n = min(width, len(values))
        return [sum(b) / len(b) for b in
                (values[i * len(values) // n:(i + 1) * len(values) // n] for i in range(n))]

    means = {c.cache: bars([a - b for a, b in zip(c.loss_by_position,
                                                  r.against(c).loss_by_position, strict=True)])
             for c in r.caches}
    top = max(max(m) for m in means.values())
    scale = len(BARS) / top if top > 0 else 0.0
    lines = {name: "".join(BARS[min(len(BARS) - 1, max(0, int(h * scale)))] for h in m)
             for name, m in means.items()}
    return lines, top


def _share(x: float) -> str:
    """A percentage rounded down: 100.00% only when every position agreed."""
    return f"{math.floor(x * 10_000 + 1e-9) / 100:.2f}%"  # + 1e-9: 0.29 * 1e4 is 2899.99...


def _kl(x: float) -> str:
    return "0" if x == 0 else f"{x:.2e}"


def quality_cells(c: CacheQuality) -> tuple[str, ...]:
    """One cache's quality, in QUALITY's order."""
    change = "ref" if c.reference else f"{c.perplexity_change:+.3%}"
    return (c.cache, f"{c.perplexity:.3f}", change, f"{c.bits_per_token:.3f}", _kl(c.kl_mean),
            _kl(c.kl_max), f"@{c.kl_max_position}", _share(c.top1_agreement))


def cost_cells(c: CacheQuality) -> tuple[str, ...]:
    """What one cache holds, its prefill (and the prompt's compression, '-' for a kind
    that keeps the prompt) and how fast it decodes, in COST's order."""
    compress = f"{c.compress_ms:.1f}" if c.compress_ms else "-"
    # '-' where a row has no time: llama.cpp's rows are fed in chunks, not timed.
    timed = lambda ms, fmt: "-" if math.isnan(ms) else format(ms, fmt)  # noqa: E731
    return (f"{c.bytes_per_token:,.0f}", f"{c.bytes_ratio:.3f}", format_gib(c.bytes_held),
            timed(c.prefill_ms, ".1f"), compress, timed(c.decode_ms_per_token, ".2f"))


def has_kinds(r: QualityResult) -> bool:
    """Whether the model has sliding layers: a column of bytes per layer kind then."""
    return any(c.bytes_by_kind for c in r.caches)


def kind_cell(c: CacheQuality) -> str:
    """What the global and the sliding layers hold, '-' for a row that does not say."""
    if not c.bytes_by_kind:
        return "-"
    return " · ".join(format_gib(c.bytes_by_kind.get(k, 0)) for k in ("full", "sliding"))


def refused_lines(r: QualityResult) -> list[str]:
    """A line per cache a peer would not build for this model, with its reason."""
    return [f"{x.cache}: refused by {x.peer}: {x.reason}" for x in r.refused]


def residual_lines(r: QualityResult) -> list[str]:
    """Why a quantised cache can hold more than int8 at a short length: the tokens it still
    keeps at full precision (its residual, sinks, a group's incomplete tail), and what a
    token costs past them, from this run's bytes (the full-precision tokens at the exact
    cache's bytes per token, the rest over the codes)."""
    from kvcache_cli.caches.grammar import CacheSpecError
    from kvcache_cli.caches.spec import parse_cache_spec
    from kvcache_cli.caches.spec_quantized import quantised_split

    exact = next((c for c in r.caches if c.reference), None)
    lines = []
    for c in r.caches if exact is not None else ():
        try:
            params = dict(parse_cache_spec(c.cache).params)
        except CacheSpecError:
            continue  # a peer's or a test's cache: no spec of kvcache's
        if c.peer or "residual" not in params:
            continue
        codes, full = quantised_split(params, c.positions)
        if full == 0:
            continue
        full_bytes = format_gib(round(full * exact.bytes_per_token))
        said = (f"{c.cache}: {full:,} of its {c.positions:,} positions at full precision "
                f"(residual, sinks, an unfilled group), {full_bytes}")
        if codes == 0:
            lines.append(f"{said}: all of them; a longer text shows what its codes cost")
            continue
        per_token = (c.bytes_held - full * exact.bytes_per_token) / codes
        lines.append(f"{said}; past them a token costs {per_token:,.0f} bytes "
                     f"({per_token / exact.bytes_per_token:.3f}× exact)")
    return lines


def _run_line(r: QualityResult) -> str:
    return (f"{r.tokens:,} tokens of {r.text}: a prompt of {r.prompt_len} prefilled, then "
            f"{r.chunk} token{'s' if r.chunk > 1 else ''} a step; {r.scored:,} predictions "
            f"scored against the exact {r.reference} cache, every cache fed the same tokens")


# How each peer runs the same model, for the header (a peer's rows are named after it).
PEER_RUNS = {
    "llama.cpp": "llama.cpp's rows run the model's GGUF in llama.cpp (chunks of 256 tokens: "
                 "no ms/tok)",
    "transformers": "transformers' rows run its own model of the same weights",
    "kvpress": "kvpress's rows run its presses on transformers' model of the same weights, "
               "in kvpress's venv",
}


def _peer_line(r: QualityResult) -> str | None:
    """How the peers' rows ran and what each is scored against, when there are any."""
    own = {c.peer: c.against for c in r.caches if c.peer and c.against != r.reference}
    if not own:
        return None
    return "; ".join(f"{PEER_RUNS.get(peer, peer)}, on the same ids, each scored against its "
                     f"own exact {against} cache" for peer, against in sorted(own.items()))


def _sink_line(r: QualityResult) -> str:
    shares = " · ".join(f"L{i} {s:.3g} ({s / r.uniform_share:.1f}×)"
                        for i, s in enumerate(r.first_token_share))
    return (f"{shares}; × what uniform attention would give it ({r.uniform_share:.3g}); "
            "mean over heads and the scored queries, exact cache")


def _header(r: QualityResult) -> Table:
    grid = label_grid()
    grid.add_row("model", f"[bold]{r.model}[/]")
    if r.weights_note:
        grid.add_row("note", Text(r.weights_note, style="yellow"))
    grid.add_row("device", f"[bold]{r.device}[/] ({r.machine}), [bold]{r.dtype}[/], "
                 f"{r.threads} threads, torch {r.torch_version}")
    grid.add_row("run", _run_line(r))
    if _peer_line(r):
        grid.add_row("peers", _peer_line(r))
    grid.add_row("sink", "first token's share of attention, per layer: " + _sink_line(r))
    return grid


def _quality(r: QualityResult) -> Table:
    table = figures_table(*QUALITY, title="quality against the exact cache on the same "
                          "tokens (KL in nats, at: the position of the max)")
    table.columns[0].no_wrap = True
    for c in r.caches:
        row = quality_cells(c)
        table.add_row(f"[bold]{row[0]}[/]", f"[bold]{row[1]}[/]", *row[2:])
    return table


def _cost(r: QualityResult) -> Table:
    lines, top = excess_lines(r)
    table = figures_table("cache", *COST, f"loss above exact, 0 → {top:.2g} nats",
                          title=f"memory held after {r.tokens - 1:,} positions, prefill and "
                          f"compression ms, median decode step per token; loss at "
                          f"positions {r.prompt_len}→{r.tokens - 1}")
    table.columns[0].no_wrap = True
    table.columns[-1].justify = "left"
    kinds = has_kinds(r)
    if kinds:
        table.add_column(KINDS, justify="right")
    for c in r.caches:
        table.add_row(c.cache, *cost_cells(c), f"[cyan]{lines[c.cache]}[/]",
                      *((kind_cell(c),) if kinds else ()))
    return table


def render(r: QualityResult) -> RenderableType:
    from rich.text import Text

    notes = [Text(line, style="dim") for line in residual_lines(r)]
    refused = [Text(line, style="yellow") for line in refused_lines(r)]
    return Group(_header(r), _quality(r), _cost(r), *refused, *notes)


def plain(r: QualityResult, width: int) -> str:
    """The same figures as text at WIDTH columns: aligned columns (split into blocks that
    fit, each naming the cache), no colour, no box."""
    kinds = (KINDS,) if has_kinds(r) else ()
    rows = [QUALITY + COST + kinds, *(quality_cells(c) + cost_cells(c)
                                      + ((kind_cell(c),) if kinds else ())
                                      for c in r.caches)]
    lines = text_line("model", r.model, width)
    if r.weights_note:
        lines += text_line("note", r.weights_note, width)
    lines += [*text_line("device", f"{r.device} ({r.machine}), {r.dtype}, {r.threads} "
                         f"threads, torch {r.torch_version}", width),
              *text_line("run", _run_line(r), width),
              *(text_line("peers", _peer_line(r), width) if _peer_line(r) else []),
              *text_line("sink", f"first token's share of attention, per layer: "
                         f"{_sink_line(r)}", width), "",
              *text_table(rows, width)]
    notes = refused_lines(r) + residual_lines(r)
    lines += ([""] if notes else []) + [wrapped for line in notes for wrapped in
                                        textwrap.wrap(line, width, subsequent_indent="  ")]
    lines_by_cache, top = excess_lines(r, 2 * SPARK_WIDTH)
    lines += ["", *textwrap.wrap(f"loss above the exact cache's at positions {r.prompt_len}→"
                                 f"{r.tokens - 1}, one scale from 0 to {top:.2g} nats:", width)]
    name = max(len(c.cache) for c in r.caches)
    lines += [f"{c.cache.ljust(name)}  {lines_by_cache[c.cache]}" for c in r.caches]
    return "\n".join(lines)
