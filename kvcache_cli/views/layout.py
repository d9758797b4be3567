"""A view laid out at the width it is printed at, so no number is ever cut.

Rich fits a table too wide for its console by squeezing columns, and marks what it then
cuts with '…' ('13.6…'); plain text has no edge at all. Every view goes through here
instead: a table that fits (its prose wrapped at spaces, no cell cut) stays as it is; one
that does not is split into tables of as many columns as fit, each repeating the first
column (the row's name); one whose single column cannot fit beside that name is stacked,
one record per row. Tables added later inherit the rule: nothing here knows a column.
"""

from __future__ import annotations

import copy
import io
import textwrap

from rich.console import Console, Group, RenderableType
from rich.measure import Measurement
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

# Rich pads a panel's content with a border and a space each side.
PANEL_EDGES = 4
# Columns between two cells of a plain-text table.
GAP = 2


def rendered(renderable: RenderableType, width: int) -> str:
    """RENDERABLE as plain text at WIDTH columns, as a terminal that wide would show it."""
    console = Console(width=width, height=25, file=io.StringIO(), color_system=None,
                      force_terminal=False)
    with console.capture() as captured:
        console.print(renderable)
    return captured.get()


def fit(renderable: RenderableType, width: int) -> RenderableType:
    """RENDERABLE with every table inside it (groups and panels walked) laid out for WIDTH
    columns; anything else as it is (rich wraps prose at spaces)."""
    if isinstance(renderable, Group):
        return Group(*(fit(r, width) for r in renderable.renderables))
    if isinstance(renderable, Panel):
        panel = copy.copy(renderable)
        panel.renderable = fit(renderable.renderable, width - PANEL_EDGES)
        return panel
    if not isinstance(renderable, Table) or not renderable.columns:
        return renderable
    if _fits(renderable, width):
        return renderable
    parts = _split(renderable, width)
    if parts is None:
        return stacked(renderable)
    # The title and caption over the whole width, not wrapped to the first part's.
    title = [_text(renderable.title, renderable.title_style or "table.title")]
    caption = [_text(renderable.caption, renderable.caption_style or "table.caption")]
    return Group(*(title if renderable.title else []), *parts,
                 *(caption if renderable.caption else []))


def _natural(table: Table) -> int:
    """The columns TABLE takes with no cell wrapped."""
    console = Console(width=10_000, height=25, file=io.StringIO())
    return Measurement.get(console, console.options, table).maximum


def _fits(table: Table, width: int) -> bool:
    """TABLE is whole at WIDTH: nothing cut ('…', which no cell of ours holds), and its
    prose not squeezed to a word a line (it wants at most twice the room it has)."""
    return _natural(table) <= 2 * width and "…" not in rendered(table, width)


def _part(table: Table, columns: list[int]) -> Table:
    """TABLE with only COLUMNS, and no title or caption (they are the whole table's)."""
    part = copy.copy(table)
    part.columns = [copy.copy(table.columns[i]) for i in columns]
    part.title = part.caption = None
    return part


def _split(table: Table, width: int) -> list[Table] | None:
    """TABLE as tables of its key (its first column, or the first `key_columns` where the
    table names its rows by more than one: `size`'s layer count and kind) and as many of the
    others as fit WIDTH with no cell wrapped; a column too wide for that on its own beside
    the key takes a part of its own if it fits there wrapped. None where even that cuts it."""
    key = list(range(getattr(table, "key_columns", 1)))
    groups: list[list[int]] = []
    group = list(key)
    for i in range(len(key), len(table.columns)):
        if _natural(_part(table, group + [i])) <= width:
            group.append(i)
            continue
        if len(group) > len(key):  # column i starts the next part
            groups.append(group)
            group = list(key)
        if _natural(_part(table, [*key, i])) <= width:
            group = [*key, i]
        elif _fits(_part(table, [*key, i]), width):
            groups.append([*key, i])
        else:
            return None
    if len(group) > len(key):
        groups.append(group)
    return [_part(table, g) for g in groups]


class Formula:
    """Lines of arithmetic ('bytes = layers × (a + b) × seq_len'), each on one line where it
    fits, else broken only before an operator (outside brackets where one fits, never
    inside a word or a number), the continuation indented past the '=': a formula cut
    anywhere else reads as two wrong ones."""

    OPERATORS = (" × ", " + ")

    def __init__(self, lines: list[str], style: str = "") -> None:
        self.lines, self.style = lines, style

    def __rich_measure__(self, console, options) -> Measurement:
        longest = max((len(line) for line in self.lines), default=0)
        return Measurement(min(longest, options.max_width), longest)

    def __rich_console__(self, console, options):
        for line in self.lines:
            for piece in self.broken(line, options.max_width):
                yield Text(piece, style=self.style, no_wrap=True, overflow="fold")
        yield Text("")  # a blank line before what follows, as after a paragraph

    @classmethod
    def broken(cls, line: str, width: int) -> list[str]:
        """LINE in pieces of at most WIDTH columns, each after the first starting with the
        operator it was broken before; a piece with no operator to break at stays whole."""
        equals = line.find("= ")
        indent = " " * (equals + 2 if 0 <= equals < width // 2 else 4)
        pieces, rest, start = [], line, 0
        while len(rest) > width:
            # Past the operator a continuation starts with: a break there would leave it
            # empty.
            cut = max((i for i in cls._breaks(rest, top=True) if start < i <= width),
                      default=None)
            if cut is None:  # a bracket too long for the line: break inside it
                cut = max((i for i in cls._breaks(rest, top=False) if start < i <= width),
                          default=None)
            if cut is None:
                break
            pieces.append(rest[:cut].rstrip())
            rest = indent + rest[cut + 1:]
            start = len(indent) + 1
        return [*pieces, rest]

    @classmethod
    def _breaks(cls, line: str, top: bool):
        """Where LINE may break: the space before each operator (outside brackets if TOP)."""
        depth = 0
        for i, char in enumerate(line):
            depth += (char == "(") - (char == ")")
            if (depth == 0 or not top) and line.startswith(cls.OPERATORS, i):
                yield i


def _text(cell, style: str = "") -> Text:
    """A cell as rich shows it: markup read ('[bold]static[/]' is 'static', bold)."""
    text = (cell.copy() if isinstance(cell, Text) else
            Text.from_markup(cell) if isinstance(cell, str) else Text(str(cell)))
    if style:
        text.stylize(style)
    return text


def stacked(table: Table) -> Group:
    """TABLE as one record per row: the first cell as the record's title, then each other
    column's heading and value on a line, the value wrapping beside its heading."""
    headings = [_text(c.header).plain.replace("\n", " ") for c in table.columns]
    columns = [list(c.cells) for c in table.columns]
    records: list[RenderableType] = []
    if table.title:
        records.append(_text(table.title, table.title_style or "table.title"))
    for r in range(table.row_count):
        grid = Table.grid(padding=(0, 2))
        grid.add_column(no_wrap=True, style="dim")
        grid.add_column(overflow="fold")
        for heading, cells in zip(headings[1:], columns[1:], strict=True):
            if _text(cells[r]).plain.strip():
                grid.add_row(heading, _text(cells[r]))
        records += [Text(""), _text(columns[0][r], "bold"), grid]
    if table.caption:
        records += [Text(""), _text(table.caption, table.caption_style or "table.caption")]
    return Group(*records)


# --- plain text ---------------------------------------------------------------------------


def text_table(rows: list[tuple[str, ...]], width: int) -> list[str]:
    """ROWS (the first the headings) as aligned lines no wider than WIDTH: the first column
    left, the others right; split into blocks of columns that fit, each repeating the first
    column, with a blank line between; one record per line group where even one column
    beside the first does not fit."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]

    def block(columns: list[int]) -> list[str]:
        return ["  ".join(row[i].ljust(widths[i]) if i == 0 else row[i].rjust(widths[i])
                          for i in columns).rstrip() for row in rows]

    groups: list[list[int]] = []
    group = [0]
    for i in range(1, len(widths)):
        if widths[0] + GAP + widths[i] > width:
            return _records(rows, width)
        if sum(widths[j] for j in group) + GAP * len(group) + widths[i] > width:
            groups.append(group)
            group = [0]
        group.append(i)
    groups.append(group)
    lines: list[str] = []
    for g in groups:
        lines += ([""] if lines else []) + block(g)
    return lines


def _records(rows: list[tuple[str, ...]], width: int) -> list[str]:
    """ROWS as one record per row: its name, then 'heading  value' lines beneath."""
    headings, *body = rows
    label = max(len(h) for h in headings[1:])
    lines: list[str] = []
    for row in body:
        lines += ([""] if lines else []) + [row[0]]
        for heading, value in zip(headings[1:], row[1:], strict=True):
            lines += textwrap.wrap(value, width, initial_indent=f"  {heading.ljust(label)}  ",
                                   subsequent_indent=" " * (label + 4), break_long_words=False,
                                   break_on_hyphens=False)
    return lines


def text_line(label: str, text: str, width: int) -> list[str]:
    """'LABEL: TEXT' wrapped at spaces to WIDTH, its continuation lines indented."""
    return textwrap.wrap(f"{label}: {text}", width, subsequent_indent="  ",
                         break_long_words=False, break_on_hyphens=False) or [f"{label}:"]
