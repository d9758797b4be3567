"""The cache kinds `--cache` accepts, as a table."""

from rich import box
from rich.table import Table


def kinds_view(rows: list[dict]) -> Table:
    """One row per kind: how to spell it, what it keeps, and what it supports."""
    table = Table("spec", "what it keeps", "exact", "bounded", "pages", "compiles",
                  box=box.SIMPLE_HEAD, title="cache kinds (--cache SPEC)", title_justify="left",
                  title_style="bold", caption_justify="left",
                  caption="bounded kinds keep each key's absolute position (GPT-2 learns "
                  "them), so they run within the model's context window")
    for row in rows:
        spell = row["spell"] + "".join(f" · {a}" for a in row["aliases"])
        table.add_row(spell, row["summary"], *("yes" if row[k] else "no"
                                               for k in ("exact", "bounded", "pages",
                                                         "compiles")))
    return table
