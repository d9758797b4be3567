"""`kvcache caches`: the cache kinds `--cache` accepts, what each keeps and supports, and
how each rolls back k tokens, from the torch-free rows of `caches.spec.kinds_table`."""

from rich import box
from rich.table import Column, Table
from rich.text import Text

from kvcache_cli.views.style import mark


def kinds_view(rows, peers: tuple[str, ...] = ()) -> Table:
    """One row per kind: how to spell it, what it keeps, its traits and its rollback; the
    peers' own caches `eval --cache` also accepts under the table."""
    table = Table(Column("spec", no_wrap=True), "what it keeps", "is",
                  "rollback of k tokens: how; bytes touched", box=box.SIMPLE_HEAD,
                  title="cache kinds (--cache SPEC)", title_justify="left", title_style="bold",
                  caption_justify="left",
                  caption="bounded kinds keep each key's absolute position (GPT-2 learns "
                  "them), so they run within the model's context window"
                  + "".join(f"\n{peer}" for peer in peers))
    for r in rows:
        traits = [name for name, on in (("exact", r.exact), ("bounded", r.bounded),
                                        ("pools", r.pages), ("compiles", r.compiles)) if on]
        how = Text.from_markup(f"{mark(r.rolls_back)} ")
        how.append(r.rollback)
        how.append(f"\nbytes: {r.rollback_bytes}", style="dim")
        # The spelling whole (no_wrap), its defaults on a line of their own.
        spell = r.grammar.replace(" (default", "\n(default")
        table.add_row(spell, r.summary, ", ".join(traits), how)
    return table
