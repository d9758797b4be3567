"""Rich views of the reference script's demo and break results.

One function per result type; `render` picks it. The numbers come from the
result objects untouched, so the rich view, the script's plain text and
`--json` always agree.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from rich import box
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

import kv_cache_from_scratch as ref
from kvcache_cli.views.style import BAD, figures_table, mark


def _tokens(tokens) -> str:
    return " ".join(str(t) for t in tokens)


def _grid(m: np.ndarray, title: str) -> Table:
    """An attention matrix as an aligned grid; masked (exactly zero) cells dimmed."""
    grid = Table(box=None, title=title, title_justify="left", title_style="italic",
                 header_style="dim", padding=(0, 1), pad_edge=False)
    grid.add_column("", style="dim", justify="right")
    for j in range(m.shape[1]):
        grid.add_column(str(j), justify="right")
    for i, row in enumerate(m):
        grid.add_row(str(i), *(f"[dim]{x:.3f}[/]" if x == 0.0 else f"{x:.3f}" for x in row))
    return grid


def macs(r: ref.MacsDemo) -> RenderableType:
    head = Text.from_markup(
        f"toy model: {r.n_layers} layers, {r.n_heads} heads, d_model {r.d_model}, seq {r.seq}\n"
        f"naive  loop total MACs  [bold]{r.naive_total:>12,}[/]\n"
        f"cached loop total MACs  [bold]{r.cached_total:>12,}[/]\n"
        f"ratio                   [bold cyan]{r.ratio:>11.1f}x[/]")
    table = figures_table("step", "naive MACs", "cached MACs", "naive / cached",
                   title="per step: naive grows, cached stays nearly flat")
    table.columns[0].justify = "right"
    for step, naive, cached in r.rows:
        table.add_row(str(step), f"{naive:,}", f"{cached:,}", f"{naive / cached:.1f}x")
    return Group(head, table)


def exact(r: ref.ExactDemo) -> RenderableType:
    table = figures_table("loop", "generated tokens", title=f"prompt {_tokens(r.prompt)}")
    table.columns[1].justify = "left"
    table.add_row("naive", _tokens(r.naive_tokens))
    table.add_row("cached", _tokens(r.cached_tokens))
    return Group(table, Text.from_markup(
        f"same tokens {mark(r.same_tokens)}   ({r.distinct_tokens} distinct)\n"
        f"max |naive - cached| logits = [bold]{r.max_logit_diff:.3e}[/] "
        f"{mark(r.max_logit_diff <= 1e-12)} float64 noise"))


def mask(r: ref.MaskDemo) -> RenderableType:
    parts: list[RenderableType] = []
    for case in (r.masked, r.unmasked):
        label = "WITH the causal mask" if case.use_mask else "NO mask (bidirectional)"
        grids = Table.grid(padding=(0, 3))
        grids.add_row(_grid(case.before, "before: 4 tokens"),
                      _grid(case.after, "after a 5th: first 4 rows"))
        verdict = (f"max change in the first 4 rows: [bold]{case.max_change:.3e}[/] "
                   + (mark(True) + " exactly zero" if case.max_change == 0.0
                      else "[yellow]every earlier row moved[/]"))
        parts += [Text(f"{label}: layer 0, head 0 attention weights", style="bold"), grids,
                  Text.from_markup(verdict), Text("")]
    flipped = r.argmax_cached != r.argmax_recomputed
    parts.append(Text.from_markup(
        f"no mask, token 5 from a cache vs recomputed: max |Δlogit| "
        f"[bold red]{r.unmasked_cache_logit_diff:.4f}[/], argmax {r.argmax_recomputed} vs "
        f"{r.argmax_cached}" + (" [bold red](flipped)[/]" if flipped else "")))
    return Group(*parts)


def memory(r: ref.MemoryDemo) -> RenderableType:
    head = Text.from_markup(
        f"Llama-2-7B shape: {r.layers} layers × {r.kv_heads} KV heads × head_dim {r.head_dim}"
        f" × {r.dtype_bytes} bytes\n"
        f"weights ({r.params:,} params, fp16): [bold]{r.weights_gib:.2f} GiB[/]\n"
        f"cache per token: [bold]{r.bytes_per_token:,} bytes = {r.bytes_per_token // 1024} KiB[/]")
    table = figures_table("seq_len", "batch 1", f"batch {r.batch}", f"batch {r.batch} ÷ weights")
    for seq, b1, bn, ratio in r.rows:
        style = "bold red" if ratio > 1 else ""
        table.add_row(f"{seq:,}", f"{b1:.2f} GiB", f"{bn:.1f} GiB", f"[{style}]{ratio:.1f}x[/]"
                      if style else f"{ratio:.1f}x")
    return Group(head, table)


def gqa(r: ref.GqaDemo) -> RenderableType:
    table = figures_table("variant", "kv_heads", "4k × b32", "32k × b32", "bytes/token",
                          "reduction")
    for g in r.rows:
        table.add_row(g.variant, str(g.kv_heads), f"{g.gib_4k_b32:.1f} GiB",
                      f"{g.gib_32k_b32:.1f} GiB", f"{g.bytes_per_token:,}", f"{g.reduction:.0f}x")
    return Group(table, Text(f"reduction = n_heads / kv_heads (n_heads = {r.n_heads});"
                             " Q is never cached, so it is never shrunk"))


def intensity(r: ref.IntensityDemo) -> RenderableType:
    table = figures_table("", "MACs", "weights read")
    table.add_row("prefill, one batched pass", f"{r.prefill_macs:,}", "once")
    table.add_row(f"{r.prompt_len} sequential decode steps", f"{r.decode_total_macs:,}",
                  f"{r.prompt_len}×")
    table.add_row("one decode step", f"{r.decode_step_macs:,}", "once per token")
    return Group(
        Text(f"Llama-2-7B shape, d_ff = 4·d_model, {r.prompt_len}-token prompt"), table,
        Text.from_markup(
            f"bytes moved: {r.weight_bytes:,} (fp16 weights) + {r.kv_bytes:,} (cache)\n"
            f"MACs per byte: prefill [bold green]{r.prefill_macs_per_byte:.1f}[/] "
            f"(compute-bound) · decode [bold red]{r.decode_macs_per_byte:.2f}[/] "
            f"(memory-bound)"))


def paged(r: ref.PagedDemo) -> RenderableType:
    gib = r.bytes_per_token / 2**30
    table = figures_table("scheme", "reserved", "GiB", "holds tokens")
    table.add_row(f"contiguous, {r.max_len:,} per request", f"{r.contiguous_reserved:,} tokens",
                  f"{r.contiguous_reserved * gib:.1f}", f"{r.contiguous_utilisation:.1%}")
    table.add_row(f"paged, {r.page_size}-token pages", f"{r.paged_pages:,} pages",
                  f"{r.paged_pages * r.page_size * gib:.1f}", f"{r.paged_utilisation:.1%}")
    table.add_row("paged + shared prefix", f"{r.shared_pages:,} pages",
                  f"{r.shared_pages * r.page_size * gib:.1f}", f"{r.shared_utilisation:.1%}")
    return Group(
        Text(f"{r.n_requests} requests: a {r.shared_prefix}-token shared system prompt, a user "
             f"turn and a seeded random reply; {r.tokens_held:,} tokens "
             f"({r.tokens_stored:,} with the prefix stored once), "
             f"{r.bytes_per_token // 1024} KiB per token"),
        table,
        Text.from_markup(
            f"sharing the prefix saves [bold]{r.pages_saved_by_sharing}[/] pages; "
            f"{r.pages_free_after:,}/{r.n_pages:,} pages free after every request finishes "
            f"{mark(r.pages_free_after == r.n_pages)}\n"
            f"request {r.example_request}'s block table ({r.example_length} tokens): "
            f"[cyan]{_tokens(r.example_block_table)}[/]"))


def no_mask(r: ref.NoMaskBreak) -> RenderableType:
    table = figures_table("loop", "tokens chosen")
    table.columns[1].justify = "left"
    table.add_row("recomputed", _tokens(r.recomputed_tokens))
    table.add_row("cached", _tokens(r.cached_tokens))
    return Group(Text.from_markup(
        f"earlier attention rows move by [bold]{r.earlier_rows_change:.3e}[/] when a token "
        f"arrives\ncached vs recomputed logits: max |Δ| [bold red]{r.max_logit_diff:.4f}[/]; "
        f"argmax differs at [bold red]{r.argmax_flips}[/] of {r.steps} steps {BAD}"), table)


def no_append(r: ref.NoAppendBreak) -> RenderableType:
    table = figures_table("loop", "tokens", "distinct", "cache length")
    table.columns[1].justify = "left"
    table.add_row("correct", _tokens(r.correct_tokens), str(r.correct_distinct),
                  str(r.cache_len_correct))
    table.add_row("no append", _tokens(r.broken_tokens), f"[bold red]{r.broken_distinct}[/]",
                  f"[bold red]{r.cache_len_broken}[/]")
    return Group(table, Text("the cache never grows past the prompt: the model never sees "
                             "what it just wrote, and repeats itself"))


def cache_q(r: ref.CacheQBreak) -> RenderableType:
    table = figures_table("position", "‖q‖ (layer 0)", "reads of its q", "reads of its k")
    for i, (norm, q_reads, k_reads) in enumerate(zip(r.q_norms, r.q_reads, r.k_reads)):
        table.add_row(str(i), f"{norm:.3f}", str(q_reads), str(k_reads))
    return Group(table, Text.from_markup(
        f"a new q every step, each read once; tokens unchanged {mark(r.same_tokens)}; "
        f"bytes held {r.bytes_kv:,} → [bold red]{r.bytes_kv_and_q:,}[/] for nothing"))


def overflow(r: ref.OverflowBreak) -> RenderableType:
    return Text.from_markup(
        f"prompt {r.prompt_len}, window {r.window}: {r.tokens_before_error} tokens, then\n"
        f"[bold red]IndexError: {r.error}[/]\n"
        f"a wrapping position table would reuse row {r.wraps_to} for position {r.position}: "
        "no error, only garbage")


def wrong_cache(r: ref.WrongCacheBreak) -> RenderableType:
    table = figures_table("sequence A", "tokens")
    table.columns[1].justify = "left"
    table.add_row("own cache", _tokens(r.own_tokens))
    table.add_row("B's warm cache", f"[bold red]{_tokens(r.leaked_tokens)}[/]")
    where = "never" if r.first_divergence is None else f"from step {r.first_divergence}"
    return Group(Text(f"prompt A {_tokens(r.prompt_a)}; B's cache holds "
                      f"{r.foreign_tokens_attended} tokens of prompt {_tokens(r.prompt_b)} and "
                      "its reply"), table,
                 Text.from_markup(f"outputs differ {where} {BAD}: A reads another user's tokens"))


_VIEWS: dict[type, Callable[..., RenderableType]] = {
    ref.MacsDemo: macs, ref.ExactDemo: exact, ref.MaskDemo: mask, ref.MemoryDemo: memory,
    ref.GqaDemo: gqa, ref.IntensityDemo: intensity, ref.PagedDemo: paged,
    ref.NoMaskBreak: no_mask, ref.NoAppendBreak: no_append, ref.CacheQBreak: cache_q,
    ref.OverflowBreak: overflow, ref.WrongCacheBreak: wrong_cache,
}


def render(title: str, result: object) -> Panel:
    return Panel(_VIEWS[type(result)](result), title=f"[bold]{title}[/]", title_align="left",
                 border_style="cyan", expand=False)


def listing(names: dict[str, str], heading: str) -> Table:
    table = Table(box=box.SIMPLE_HEAD, title=heading, title_justify="left", title_style="bold")
    table.add_column("name", style="cyan")
    table.add_column("what it shows")
    for name, title in names.items():
        table.add_row(name, title)
    return table
