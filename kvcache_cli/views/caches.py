"""`kvcache caches`: the cache kinds `--cache` accepts, what each keeps and supports, and
how each rolls back k tokens, from the torch-free rows of `caches.spec.kinds_table`."""

from rich import box
from rich.table import Column, Table
from rich.text import Text

from kvcache_cli.views.style import mark

HYBRID = ("on a model with sliding-window layers (-m gemma3) a spec holds the full-attention "
          "layers; the sliding ones hold exact rings of their window (size and eval: "
          "--sliding full gives them the spec too, to see the waste; caches -m MODEL: which "
          "layers)")


def layers_line(r) -> str:
    """Which layers of `r.model` (a `SpecLayers`) the spec holds, in a sentence."""
    def listed(layers: tuple[int, ...]) -> str:
        shown = ", ".join(map(str, layers[:6]))
        return shown + (f", … ({len(layers)} layers)" if len(layers) > 6 else "")

    if r.windowed_kind is None:
        return f"on {r.model}: a spec holds every layer ({len(r.spec_layers)}, all full attention)"
    rings = (f"the {len(r.windowed_layers)} {r.windowed_kind} layers hold exact rings of "
             f"their window, {r.window:,} positions")
    if not r.spec_layers:
        return (f"on {r.model}: a spec holds no layer: {rings} (--sliding full in size and "
                "eval gives them the spec)")
    return (f"on {r.model}: a spec holds the {len(r.spec_layers)} full-attention layers "
            f"({listed(r.spec_layers)}); {rings} (--sliding full: the spec on them too)")


def kinds_view(rows, peers: tuple[str, ...] = (), layers=None) -> Table:
    """One row per kind: how to spell it, what it keeps, its traits and its rollback; the
    peers' own caches `eval --cache` also accepts under the table, and which layers of a
    model (`layers`, a `SpecLayers`) a spec holds, or how hybrid models take one."""
    table = Table(Column("spec", no_wrap=True), "what it keeps", "is",
                  "rollback of k tokens: how; bytes touched", box=box.SIMPLE_HEAD,
                  title="cache kinds (--cache SPEC)", title_justify="left", title_style="bold",
                  caption_justify="left",
                  caption="bounded kinds keep each key's absolute position (GPT-2 learns "
                  "them), so they run within the model's context window"
                  + "".join(f"\n{peer}" for peer in peers)
                  + f"\n{HYBRID if layers is None else layers_line(layers)}")
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
