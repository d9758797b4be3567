"""Views of speculative decoding, its table on chat tasks and its two breaks.

They render the frozen results of `kvcache_cli.speculative.decode` and `.tasks` (the same
objects `--json` dumps).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from rich import box
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from kvcache_cli.views.generate import token_text
from kvcache_cli.views.style import figures_table, mark


def _histogram(counts: tuple[int, ...]) -> str:
    """Steps that accepted 0, 1, ... k tokens, as '0:3 1:5 4:2' (empty counts left out)."""
    return " ".join(f"{n}:{c}" for n, c in enumerate(counts) if c)


def spec_run_view(run) -> RenderableType:
    mode = "greedy" if run.greedy else "sampled"
    t = figures_table("K", "accepted", "tokens a step (accepted: steps)", "target fwd/token",
                      "tokens/s", "× plain", "= plain greedy",
                      title=f"speculative decoding{', ' + run.target if run.target else ''}, "
                            f"draft {run.draft}, cache {run.cache}, {mode}")
    same_as_plain = run.identical if run.greedy else (None,) * len(run.runs)
    for s, speedup, same in zip(run.runs, run.speedups, same_as_plain, strict=True):
        rate = "—" if s.acceptance_rate != s.acceptance_rate else f"{s.acceptance_rate:.0%}"
        best = "bold" if s.k == run.best_k else None
        t.add_row(str(s.k), rate, _histogram(s.histogram), f"{s.forwards_per_token:.2f}",
                  f"{s.tokens_per_s:.1f}", f"{speedup:.2f}×",
                  mark(same) if run.greedy else "sampled", style=best)
    t.add_row("plain", "", "", "1.00", f"{run.plain_tokens_per_s:.1f}", "1.00×", "")
    median = f"median of {run.repeats} runs" if run.repeats > 1 else "one run"
    lines = [t, Text.from_markup(
        f"best K [bold]{run.best_k}[/]: {run.best_speedup:.2f}× plain decoding "
        f"({run.new_tokens} new tokens after a {run.prompt_tokens}-token prompt, {median}; "
        "tokens/s include the prefill and the draft's work)")]
    if run.note:
        lines.append(Text(f"note: {run.note}", style="yellow"))
    return Group(*lines)


def _diverges(first: int | None, n: int, what: str = "plain greedy") -> str:
    if first is None:
        return f"the tokens never diverge in {n} steps"
    return (f"tokens leave {what} at step [bold red]{first}[/] "
            f"(0 = the first new token) of {n}")


def no_rollback_view(r, piece: Callable[[int], str] | None = None) -> RenderableType:
    tokens = Table("loop", "tokens", box=box.SIMPLE_HEAD, padding=(0, 1))
    tokens.add_row("prompt", token_text(r.prompt_ids, piece=piece))
    tokens.add_row("plain greedy", token_text(r.correct, piece=piece))
    tokens.add_row("with rollback", token_text(r.fixed, piece=piece))
    tokens.add_row("no rollback", token_text(r.broken, r.first_divergence, piece))

    def rate(x: float) -> str:
        return "—" if x != x else f"{x:.0%}"

    lines = Text.from_markup(
        f"{_diverges(r.first_divergence, len(r.correct))}\n"
        f"acceptance rate: {rate(r.acceptance_fixed)} with the rollback, "
        f"{rate(r.acceptance_broken)} without (draft {r.draft}, K {r.k}, cache {r.cache})\n"
        f"with the rollback, the same tokens as plain greedy {mark(r.fixed == r.correct)}\n"
        f"{' and '.join(r.immune)} write at explicit positions and read only up to the "
        "newest: the next verification overwrites the rejected slots, so there the rollback "
        "is the length alone")
    return Panel(Group(Text(r.bug), tokens, lines), title=f"GPT-2 break: {r.name}",
                 title_align="left", padding=(0, 1))


def rollback_shared_view(r, piece: Callable[[int], str] | None = None) -> RenderableType:
    tokens = Table("sequence A", "tokens", box=box.SIMPLE_HEAD, padding=(0, 1))
    tokens.add_row("alone", token_text(r.reader_solo, piece=piece))
    tokens.add_row("B's trim drops its reference", token_text(r.reader_fixed, piece=piece))
    tokens.add_row("B's trim frees the block", token_text(r.reader_broken, r.first_divergence,
                                                       piece))
    lines = Text.from_markup(
        f"block {r.shared_block} (positions {2 * r.block_size}..{3 * r.block_size - 1}) is "
        f"shared by A and B when B rolls back to {2 * r.block_size} positions\n"
        f"freed anyway, it goes to request C (admitted {mark(r.third_admitted_broken)}; with "
        f"the correct trim C waits {mark(not r.third_admitted_fixed)}), whose keys overwrite "
        f"A's: {_diverges(r.first_divergence, len(r.reader_solo), 'its solo run')}\n"
        f"a rollback that would cut into a shared block is refused: [dim]{r.refused}[/]")
    return Panel(Group(Text(r.bug), tokens, lines), title=f"GPT-2 break: {r.name}",
                 title_align="left", padding=(0, 1))


def task_table_view(t) -> str:
    """`bench --tasks` (a speculative.tasks.TaskTable) as plain text: a line per task,
    then a row per (set, draft, K)."""
    lines = [f"{t.model}, cache {t.runs[0].cache}, {t.threads} threads, replies to the end "
             f"of turn or {t.cap} tokens, greedy"]
    for r in t.runs:
        end = "end of turn" if r.stopped else "cap"
        lines.append(f"  task {r.kind} {r.index}: prompt {r.prompt_tokens}, reply "
                     f"{r.reply_tokens} tokens ({end}), plain "
                     f"{r.reply_tokens / r.plain_s:.1f} tok/s")
    lines.append(f"{'set':6} {'draft':10} {'K':>2} {'tokens':>6} {'accept':>7} {'fwd/tok':>7} "
                 f"{'speed':>6} {'= greedy':>8}")
    for w in t.rows:
        acc = "-" if math.isnan(w.acceptance) else f"{w.acceptance:.1%}"
        lines.append(f"{w.kind:6} {w.draft:10} {w.k:>2} {w.tokens:>6} {acc:>7} "
                     f"{w.forwards_per_token:>7.3f} {w.speedup:>5.2f}x "
                     f"{w.identical:>4}/{w.tasks}")
    lines.append("every run gave plain greedy's tokens" if t.all_identical
                 else "SOME RUNS LEFT PLAIN GREEDY'S TOKENS: a bug")
    return "\n".join(lines)
