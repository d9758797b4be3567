"""Rich views of GPT-2 generation and the torch breaks.

`TokenStream` writes tokens to the terminal as they are made; `generation_view` and
`break_view` render the frozen results of `kvcache_cli.generate` (the same objects
`--json` dumps).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable

from rich import box
from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from kvcache_cli.breaks.base import BreakResult
from kvcache_cli.breaks.bounded import BoundedBreakResult
from kvcache_cli.breaks.gemma3 import WindowBreakResult
from kvcache_cli.breaks.llama import LlamaBreakResult
from kvcache_cli.generate import Generation
from kvcache_cli.views.style import BAD, OK


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def header(source: str, params: int, device: str, dtype: str, mode: str) -> Text:
    return Text.from_markup(
        f"[bold]{source}[/] · {params / 1e6:.1f}M params · {device} {dtype} · mode [bold]{mode}[/]"
    )


class TokenStream:
    """Write each token the moment it arrives: as text with a tokenizer, else as ids.

    GPT-2's byte-level tokens can split a UTF-8 character, so text goes through an
    incremental decoder that holds partial characters back until they are whole.
    """

    def __init__(self, console: Console, encoding=None, stop_ids: tuple[int, ...] = ()):
        self.console, self.encoding = console, encoding
        self.stop_ids = stop_ids  # the token that ends a turn ends it unseen, as in a chat
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def _write(self, text: str, style: str | None = None) -> None:
        self.console.print(text, end="", style=style, markup=False, highlight=False, soft_wrap=True)
        self.console.file.flush()

    def prompt(self, ids: list[int]) -> None:
        if self.encoding is not None:
            self._write(self.utf8.decode(self.encoding.decode_bytes(ids)), "dim")
        else:
            self._write(" ".join(map(str, ids)) + " |", "dim")

    def chat(self, question: str, rendered: str | None = None) -> None:
        """A chat's turn as a chat user reads it: the question, then the reply streams
        after "assistant:"; the prompt the template rendered first, when it is asked for."""
        if rendered is not None:
            self._write(rendered + "\n", "dim")
        self._write(f"user: {question}\nassistant: ", "dim")

    def __call__(self, token: int) -> None:
        if token in self.stop_ids:
            return
        if self.encoding is not None:
            self._write(self.utf8.decode(self.encoding.decode_single_token_bytes(token)), "bold")
        else:
            self._write(f" {token}", "bold")

    def end(self) -> None:
        self._write(self.utf8.decode(b"", final=True) + "\n")


def generation_view(g: Generation) -> RenderableType:
    table = Table(box=None, show_header=False, padding=(0, 2, 0, 0))
    table.add_column(style="dim")
    table.add_column()
    table.add_row("tokens", f"{len(g.tokens)} new after a {len(g.prompt_ids)}-token prompt")
    table.add_row("first token", f"{g.first_token_s * 1e3:.1f} ms (prefill + first choice)")
    rate = g.decode_tokens_per_s
    if rate == rate:  # not NaN: at least one decode step ran
        replayed = f", {g.steps_replayed} replayed" if g.steps_replayed else ""
        table.add_row("decode", f"{rate:.1f} tokens/s ({1e3 / rate:.1f} ms/token{replayed})")
    if g.mode == "naive":
        table.add_row("cache", "none: every step re-runs the whole sequence")
    else:
        table.add_row(
            "cache",
            f"{g.mode}: holds {_bytes(g.cache_bytes_held)}, "
            f"appends copied {_bytes(g.cache_bytes_copied)}",
        )
    return table


def token_text(tokens, first: int | None = None, piece: Callable[[int], str] | None = None) -> Text:
    """Token ids (or pieces), those from step `first` on in red."""
    text = Text()
    for i, t in enumerate(tokens):
        if i:
            text.append(" ")
        shown = repr(piece(t))[1:-1] if piece is not None else str(t)
        text.append(shown, style="bold red" if first is not None and i >= first else None)
    return text


def break_view(r: BreakResult, piece: Callable[[int], str] | None = None,
               family: str = "GPT-2", extra: Text | None = None) -> RenderableType:
    tokens = Table(box=box.SIMPLE_HEAD, padding=(0, 1))
    tokens.add_column("loop")
    tokens.add_column("tokens", ratio=1)
    tokens.add_row("prompt", token_text(r.prompt_ids, piece=piece))
    if r.earlier_ids:
        tokens.add_row("earlier request", token_text(r.earlier_ids, piece=piece))
    tokens.add_row("correct", token_text(r.correct, piece=piece))
    tokens.add_row("broken", token_text(r.broken, r.first_divergence, piece))
    gaps = " ".join(f"{g:.2f}" for g in r.step_logit_diff)
    if r.first_divergence is None:
        verdict = f"the tokens never diverge in {len(r.correct)} steps"
    else:
        verdict = (
            f"tokens diverge at step [bold red]{r.first_divergence}[/] "
            f"(0 = the first new token) of {len(r.correct)}"
        )
    against = ("every position under the band mask" if isinstance(r, BoundedBreakResult)
               else "full recompute")
    lines = Text.from_markup(
        f"{verdict}\n"
        f"largest |correct - broken| logit up to there: [bold]{r.max_logit_diff:.3g}[/] "
        f"(per step: {gaps})\n"
        f"control, correct {r.mode} loop vs {against}: max |Δ logit| "
        f"{r.naive_logit_diff:.1e} (rounding, on logits up to {r.max_abs_logit:.3g}), "
        f"same tokens {OK if r.naive_agrees else BAD}"
    )
    if isinstance(r, BoundedBreakResult):  # a bounded cache's break: where, how much worse
        wrong = ("never" if r.first_wrong_step is None
                 else f"at step [bold red]{r.first_wrong_step}[/]")
        lines.append_text(Text.from_markup(
            f"\nbudget {r.budget} positions; logits first move past rounding {wrong}\n"
            f"mean KL from the full cache past the budget (teacher-forced on the correct "
            f"text): fix {r.kl_fix:.3g} nats, broken [bold]{r.kl_broken:.3g}[/] nats"))
    if extra is not None:
        lines.append_text(extra)
    return Panel(
        Group(Text(r.bug), tokens, lines),
        title=f"{family} break: {r.name}",
        title_align="left",
        padding=(0, 1),
    )


def llama_break_view(r: LlamaBreakResult, piece: Callable[[int], str] | None = None
                     ) -> RenderableType:
    """A Llama break: the tokens and logits as GPT-2's, and the bytes each cache held,
    which is where `kv-expand-early` shows (its tokens do not move)."""
    ratio = r.broken_bytes_held / r.bytes_held if r.bytes_held else float("nan")
    style = "bold red" if r.broken_bytes_held != r.bytes_held else "bold"
    bytes_line = Text.from_markup(
        f"\ncache after {r.tokens_held} positions: correct {r.kv_heads} KV heads, "
        f"{_bytes(r.bytes_held)}; broken {r.broken_kv_heads} KV heads, "
        f"[{style}]{_bytes(r.broken_bytes_held)}[/] ({ratio:.1f}x)")
    return break_view(r, piece, family="Llama", extra=bytes_line)


# The prompt's tail a window break shows: its prompt is most of a window long.
PROMPT_TAIL = 12


def window_break_view(r: WindowBreakResult, piece: Callable[[int], str] | None = None
                      ) -> RenderableType:
    """A Gemma 3 break: the tokens and logits as the others', where the run crosses the
    window, and the bytes each cache held per layer kind."""
    from dataclasses import replace

    def kinds(held: dict[str, int]) -> str:
        return ", ".join(f"{kind} {_bytes(n)}" for kind, n in sorted(held.items()))

    wrong = ("never" if r.first_wrong_step is None
             else f"at step [bold red]{r.first_wrong_step}[/]")
    extra = Text.from_markup(
        f"\nprompt {len(r.prompt_ids):,} tokens (its last {PROMPT_TAIL} shown); sliding window "
        f"{r.window:,}: step {r.window_step} is the first whose query sits past it\n"
        f"logits first move past rounding {wrong}\n"
        f"cache held per layer kind: correct {kinds(r.bytes_by_kind)}; broken "
        f"{kinds(r.broken_bytes_by_kind)}")
    shown = replace(r, prompt_ids=r.prompt_ids[-PROMPT_TAIL:])
    return break_view(shown, piece, family="Gemma 3", extra=extra)
