"""What every view shares: the ✓/✗ marks and the table style."""

from rich import box
from rich.table import Table

OK = "[bold green]✓[/]"
BAD = "[bold red]✗[/]"


def mark(good: bool) -> str:
    return OK if good else BAD


def figures_table(*columns: str, title: str | None = None) -> Table:
    """A table whose first column is a label and whose other columns are figures."""
    t = Table(*columns, box=box.SIMPLE_HEAD, title=title, title_justify="left",
              title_style="bold")
    for col in t.columns[1:]:
        col.justify = "right"
    return t


def label_grid() -> Table:
    """Two borderless columns: a dim label, then its value (a view's header lines)."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="dim")
    grid.add_column()
    return grid
