"""Rich view of a `BenchResult`: what ran, every mode side by side, the limit,
and the per-step curve as sparklines.

Numbers are taken from the result untouched; `--json` prints the same object.
"""

from __future__ import annotations

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvcache_cli.bench import BenchResult
from kvcache_cli.plot import sparkline

OK = "[bold green]✓[/]"
BAD = "[bold red]✗[/]"


def _table(*columns: str, title: str | None = None) -> Table:
    table = Table(*columns, box=box.SIMPLE_HEAD, title=title, title_justify="left",
                  title_style="bold")
    for col in table.columns[1:]:
        col.justify = "right"
    return table


def _bytes(n: int | float | None) -> str:
    """Decimal units, like the GB/s beside them."""
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _header(r: BenchResult) -> Text:
    lines = [
        f"model   [bold]{r.model}[/], {r.n_params / 1e6:.1f}M parameters",
        f"device  [bold]{r.device}[/] ({r.device_name}), {r.dtype}, {r.threads} threads, "
        f"torch {r.torch_version}"
        + (f", transformers {r.transformers_version}" if r.transformers_version else ""),
        f"run     prompt {r.prompt_len} random token ids + {r.new_tokens} new tokens, greedy; "
        f"median of {r.repeats} repeats (spread min-max), {r.warmup_tokens}-token warm-up "
        "per mode not timed",
    ]
    if r.weights_note:
        lines.append(f"[yellow]note    {r.weights_note}[/]")
    return Text.from_markup("\n".join(lines))


def _modes(r: BenchResult) -> Table:
    table = _table(
        "mode", "tokens/s", "spread", "ms/token", "TTFT ms", "first step", "last step",
        "vs naive", "vs hf", "GB/s", "of bw", "appends copied", "tokens",
        title=f"decode, {r.modes[0].tokens_generated} tokens per run "
        f"({len(r.modes[0].median_step_ms)} decode steps after the prefill)",
    )
    for m in r.modes:
        lo, hi = min(m.tokens_per_s), max(m.tokens_per_s)
        same = OK if m.same_tokens else BAD
        if m.mode == r.reference_mode:
            same += " ref"
        table.add_row(
            f"[bold]{m.mode}[/]",
            f"[bold]{m.tokens_per_s_median:.1f}[/]",
            f"{lo:.1f}-{hi:.1f}",
            f"{m.ms_per_token_median:.1f}",
            f"{m.ttft_ms_median:.1f}",
            f"{m.profile_ms[0]:.1f} ms",
            f"{m.profile_ms[-1]:.1f} ms",
            _ratio(m.speedup_over_naive),
            _ratio(m.ratio_to_hf),
            f"{m.achieved_gbps:.1f}",
            f"{m.fraction_of_bandwidth:.0%}",
            _bytes(m.bytes_copied),
            same,
        )
    return table


def _limit(r: BenchResult) -> Text:
    bw = r.bandwidth
    return Text.from_markup(
        f"[bold]the limit[/]  memory bandwidth, measured now: copying "
        f"{bw.copy_bytes / 2**20:.0f} MiB (read + write = {_bytes(bw.bytes_moved)} a copy) "
        f"best [bold]{bw.best_gbps:.1f} GB/s[/], "
        f"median {bw.median_gbps:.1f} GB/s\n"
        f"           a decode step reads the weights ({_bytes(r.weight_bytes)}) + the KV cache "
        f"({_bytes(r.kv_bytes_per_token)}/token): {_bytes(r.step_bytes_first)} at "
        f"{r.profile_lengths[0]} tokens, {_bytes(r.step_bytes_last)} at {r.profile_lengths[-1]}\n"
        f"           ceiling [bold cyan]{r.ceiling_tokens_per_s:.1f} tokens/s[/] "
        "(best bandwidth / mean bytes per step); GB/s and 'of bw' above are those bytes "
        "over each mode's step time"
    )


def _profile(r: BenchResult) -> Table:
    table = _table("mode", *(f"@{n}" for n in r.profile_lengths), "per step (0 ms = bottom)",
                   title="decode step latency (ms) by context length")
    table.columns[-1].justify = "left"
    for m in r.modes:
        table.add_row(m.mode, *(f"{ms:.1f}" for ms in m.profile_ms),
                      f"[cyan]{sparkline(m.median_step_ms)}[/]")
    return table


def _verdict(r: BenchResult) -> Text:
    if r.tokens_agree:
        return Text.from_markup(f"{OK} every mode generated the same {r.modes[0].tokens_generated} "
                                f"tokens as {r.reference_mode}")
    differ = ", ".join(m.mode for m in r.modes if not m.same_tokens)
    return Text.from_markup(f"{BAD} tokens differ from {r.reference_mode}'s: {differ}")


def bench(r: BenchResult) -> RenderableType:
    return Group(_header(r), _modes(r), _limit(r), Text(), _profile(r), _verdict(r))


def render(r: BenchResult) -> RenderableType:
    return bench(r)


