"""Views of a `CompressResult` (`kvcache compress`): a rich view for a terminal, plain text
for a pipe or a file; `--json` prints the same object. One row per compressing kind (keys
kept, the prompt's bytes, compression time, the continuation against the exact cache's,
KL), each continuation's text, and with --show-kept the prompt with what each kind kept
marked: shaded on a terminal, [bracketed] off one."""

from __future__ import annotations

import textwrap

from rich.console import Group, RenderableType
from rich.text import Text

from kvcache_cli.eval.compress import REFERENCE, Compressed, CompressResult
from kvcache_cli.views.layout import text_line, text_table
from kvcache_cli.views.style import figures_table, label_grid

HEADINGS = ("cache", "kept/layer", "bytes", "× exact", "compress ms", "same tokens",
            "KL mean", "KL max", "top-1")
MOST = 0.5  # a token kept by at least this share of (layer, KV head) pairs is marked kept


def cells(r: CompressResult, row: Compressed) -> tuple[str, ...]:
    low, high = min(row.kept), max(row.kept)
    kept = f"{low:,}" if low == high else f"{low:,}–{high:,}"
    return (row.cache, f"{kept} of {r.prompt_tokens:,}", f"{row.bytes_held:,}",
            f"{row.bytes_held / row.bytes_exact:.3f}", f"{row.compress_ms:.1f}",
            f"{row.matching}/{r.new_tokens}", f"{row.kl_mean:.4f}", f"{row.kl_max:.4f}",
            f"{row.top1_agreement:.1%}")


def header(r: CompressResult) -> list[tuple[str, str]]:
    """(label, line) pairs: the model, the prompt, the layers compressed, the exact cache."""
    exact_bytes = r.rows[0].bytes_exact if r.rows else 0
    lines = [("model", f"{r.model} on {r.device} ({r.dtype})"),
             ("prompt", f"{r.prompt_tokens:,} tokens, {r.prompt}, prefilled in one forward "
                        f"and compressed at its end; then {r.new_tokens} greedy tokens in "
                        "every cache")]
    if r.sliding_window is not None:
        sliding = next((b.held for b in r.rows[0].bytes if b.kind == "sliding"), 0)
        full = len(r.compressed_layers)
        lines.append(("layers", f"{full} of {r.n_layer} attend in full and are compressed; "
                                f"the other {r.n_layer - full} slide and keep their window of "
                                f"{r.sliding_window:,} (a ring, exact, allocated for the "
                                f"prompt and continuation) in every cache: {sliding:,} bytes "
                                "of each row's"))
    lines.append(("exact", f"{REFERENCE}, the exact cache, holds the prompt in "
                           f"{exact_bytes:,} bytes; × exact below is against it"))
    lines.append(("scored", f"same tokens: the greedy continuation's leading tokens equal "
                            f"to the exact cache's; KL (nats) and top-1 over the "
                            f"{r.new_tokens - 1} predictions after the first (the prefill's, "
                            "exact by construction), fed the exact continuation"))
    return lines


def _flat(text: str) -> str:
    return text.replace("\r", "\\r").replace("\n", "\\n")


def continuations(r: CompressResult) -> list[tuple[str, str]]:
    return [(REFERENCE, _flat(r.exact.text)),
            *((row.cache, _flat(row.continuation.text)) for row in r.rows)]


def _kept_title(r: CompressResult, row: Compressed) -> str:
    where = (f"layer {r.shown_layer}" if r.shown_layer is not None
             else f"{len(r.compressed_layers)} compressed layers")
    heads = f"{r.n_kv_head} KV head{'s' if r.n_kv_head != 1 else ''}"
    return f"kept by {row.cache} ({where} × {heads})"


def render(r: CompressResult, show_kept: bool = False) -> RenderableType:
    grid = label_grid()
    for label, line in header(r):
        grid.add_row(label, Text(line))
    table = figures_table(*HEADINGS, title="what each kind kept of the prompt, and what it "
                          "cost against the exact cache (times on a shared machine are "
                          "indicative)")
    table.columns[0].no_wrap = True
    for row in r.rows:
        table.add_row(*cells(r, row))
    said = label_grid()
    for label, text in continuations(r):
        said.add_row(label, Text(text))
    parts: list[RenderableType] = [grid, table, Text("continuations", style="bold"), said]
    if show_kept:
        parts.append(Text(f"kept: bold on green by at least {MOST:.0%} of the pairs, green "
                          "by fewer, dim by none", style="dim"))
        for row in r.rows:
            parts += [Text(_kept_title(r, row), style="bold"), _shaded(r.pieces, row)]
    return Group(*parts)


def _shaded(pieces: tuple[str, ...], row: Compressed) -> Text:
    text = Text()
    for piece, share in zip(pieces, row.kept_share, strict=True):
        style = ("bold black on green" if share >= MOST else "green" if share > 0 else "dim")
        text.append(piece, style=style)
    return text


def marked(pieces: tuple[str, ...], shares: tuple[float, ...], width: int) -> list[str]:
    """The prompt as lines of at most WIDTH, each run of tokens kept by at least MOST of the
    pairs in [brackets] (a bracket the text itself has is doubled: [[ ]])."""
    out, inside = [], False
    for piece, share in zip(pieces, shares, strict=True):
        kept = share >= MOST
        if kept != inside:
            out.append("[" if kept else "]")
            inside = kept
        out.append(piece.replace("[", "[[").replace("]", "]]"))
    if inside:
        out.append("]")
    lines = []
    for paragraph in "".join(out).split("\n"):
        lines += textwrap.wrap(paragraph, width, drop_whitespace=False) or [""]
    return [line.rstrip() for line in lines]


def plain(r: CompressResult, width: int, show_kept: bool = False) -> str:
    """The same figures as text at WIDTH columns (the table split into blocks that fit)."""
    lines: list[str] = []
    for label, line in header(r):
        lines += text_line(label, line, width)
    lines += ["", *text_table([HEADINGS, *(cells(r, row) for row in r.rows)], width), "",
              "continuations:"]
    for label, text in continuations(r):
        lines += text_line(f"  {label}", text, width)
    if show_kept:
        lines += ["", f"kept: [in brackets] by at least {MOST:.0%} of the (layer, KV head) "
                  "pairs"]
        for row in r.rows:
            lines += ["", _kept_title(r, row) + ":",
                      *marked(r.pieces, row.kept_share, width)]
    return "\n".join(lines)
