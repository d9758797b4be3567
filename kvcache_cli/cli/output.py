"""How a command prints: the width every view is laid out at, the one rich console,
progress on and off a terminal, and a result printed before its plot is written.

Nothing here imports rich or matplotlib at module level: each is imported when it prints.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import typer

from kvcache_cli.cli.refusals import fail

# Off a terminal (a file, a pipe, CI) with no COLUMNS there is no edge to fit: lay out at
# the README's width, so what a user saves matches what the README shows.
OFF_TERMINAL_COLUMNS = 100
# Click lays out its help at no fewer columns; a narrower COLUMNS (0, 5) could not hold a
# heading beside its figure. Far wider than any screen: rich pads every line to the width.
MIN_COLUMNS, MAX_COLUMNS = 50, 1_000


def columns(stream=None) -> int:
    """The width every view is laid out at, one rule for every command and stream: COLUMNS
    where it is set (ASCII digits, kept within MIN_COLUMNS..MAX_COLUMNS), else the
    terminal's width, else OFF_TERMINAL_COLUMNS."""
    import os
    import sys

    from kvcache_cli import numbers

    text = os.environ.get("COLUMNS", "").strip()
    if numbers.is_whole(text):
        return min(max(int(text), MIN_COLUMNS), MAX_COLUMNS)
    stream = sys.stdout if stream is None else stream
    try:
        if stream.isatty():
            return max(os.get_terminal_size(stream.fileno()).columns, MIN_COLUMNS)
    except (AttributeError, ValueError, OSError):  # no file behind it (a test's buffer)
        pass
    return OFF_TERMINAL_COLUMNS


def console(stderr: bool = False):
    """The one rich console a command prints with, on stdout or stderr, COLUMNS wide by
    `columns`' rule. Its size is given, never read by rich from COLUMNS and LINES itself,
    which ends in a traceback for COLUMNS=² (str.isdigit passes it, int() does not)."""
    import sys

    from rich.console import Console

    return Console(stderr=stderr, width=columns(sys.stderr if stderr else sys.stdout),
                   height=25)


class Eta:
    """The time left, from the mean rate of the work done since the first unit of it
    finished: the first unit pays one-time costs (loading, warm-up, a prefill) that would
    make the rest look many times slower than it is, and a mean over all the rest does not
    swing with each step as a short window's rate does."""

    def __init__(self, clock=None):
        import time

        self.clock = clock or time.monotonic
        self.mark: tuple[float, int] | None = None

    def __call__(self, done: int, total: int | None, now: float | None = None) -> float | None:
        """Seconds left, or None while nothing after the first unit is measured."""
        now = self.clock() if now is None else now
        if not total or done <= 0:
            return None
        if self.mark is None or done < self.mark[1]:
            self.mark = (now, done)
            return None
        began, first = self.mark
        if done == first or now <= began:
            return None
        return (total - done) * (now - began) / (done - first)


class ProgressLines:
    """Progress off a terminal (a file, a pipe, CI): one line on stderr when a tenth more is
    done (and 10 s have passed since the last line), when a minute has passed, and at the
    end, with what runs now, the count, the time so far and an ETA (`Eta`): a long run says
    it is alive and when it will end, a quick one stays quiet."""

    def __init__(self, what: str, unit: str, every_s: float = 60.0, least_s: float = 10.0,
                 clock=None):
        import time

        self.what, self.unit, self.every_s, self.least_s = what, unit, every_s, least_s
        self.clock = clock or time.monotonic
        self.eta = Eta(self.clock)
        self.began = self.clock()
        self.shown_at, self.shown_done = self.began, 0

    def __call__(self, done: int, total: int | None, now_running: str | None = None) -> None:
        now = self.clock()
        left = self.eta(done, total, now)
        step = max(1, (total or 0) // 10)
        finished = total is not None and done >= total
        since = now - self.shown_at
        if done == 0 or self.shown_done == done or not (
                (finished and now - self.began >= self.least_s) or since >= self.every_s
                or (done - self.shown_done >= step and since >= self.least_s)):
            return
        elapsed = now - self.began
        what = now_running or self.what
        line = f"{what}: {done:,}/{total:,} {self.unit}" if total else f"{what}: {done:,}"
        line += f", {clock(elapsed)} elapsed"
        if left is not None and not finished:
            line += f", ETA {clock(left)}"
        typer.echo(line, err=True)
        self.shown_at, self.shown_done = now, done


def clock(seconds: float) -> str:
    """SECONDS as m:ss, or h:mm:ss from an hour."""
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{s:02d}" if minutes >= 60 else f"{minutes}:{s:02d}"


@contextlib.contextmanager
def progress(what: str, unit: str):
    """Progress of a long run on stderr, as `update(done, total, now_running=None)`: in a
    terminal a transient bar (what runs now, the count of UNIT, elapsed, ETA by `Eta`),
    off one `ProgressLines`. WHAT names the run until NOW_RUNNING names its part."""
    from rich.progress import BarColumn, MofNCompleteColumn, TimeElapsedColumn

    err_console = console(stderr=True)
    if not err_console.is_terminal:
        yield ProgressLines(what, unit)
        return
    eta = Eta()
    bar = progress_bar(err_console, "{task.description}", BarColumn(), MofNCompleteColumn(),
                       unit, TimeElapsedColumn(), "ETA {task.fields[eta]}")
    task = bar.add_task(what, total=None, eta="-:--")

    def update(done: int, total: int | None, now_running: str | None = None) -> None:
        left = eta(done, total)
        bar.update(task, completed=done, total=total, description=now_running or what,
                   eta="-:--" if left is None else clock(left))

    with bar:
        yield update


def progress_bar(console, *columns_):
    """A transient rich Progress on CONSOLE, redrawn twice a second (the redraw thread shares
    the CPUs being timed). Its text columns wrap at a narrow width, so the counts and
    times beside them stay whole, where rich would cut them ('0:00:…')."""
    from rich.progress import Progress, TextColumn
    from rich.table import Column

    shown = [TextColumn(c, table_column=Column(overflow="fold")) if isinstance(c, str) else c
             for c in columns_]
    return Progress(*shown, console=console, transient=True, refresh_per_second=2)


def print_view(renderable) -> None:
    """Print a view on stdout at `columns()`, in a terminal or not: every table laid out to
    fit (views.layout: split by columns or stacked, no number cut); off a terminal without
    colour, and no line ending in spaces, so what a user saves matches the README."""
    import sys

    from kvcache_cli.views.layout import fit

    out = console()
    shown = fit(renderable, out.width)
    if out.is_terminal:
        out.print(shown)
        return
    with out.capture() as captured:
        out.print(shown)
    sys.stdout.write("\n".join(line.rstrip() for line in captured.get().split("\n")))


# --- results and plots ------------------------------------------------------------------


def check_writable(path: Path) -> None:
    """--plot must be writable before the benchmark runs, without leaving a file behind.
    The permissions are asked first, for the usual reasons in plain words; then the file is
    opened for writing as the plot will be (and a new one removed at once), since root
    passes every permission check and /proc, a read-only mount or a name too long show only
    when a file is made."""
    import os

    shown = str(path)
    try:
        if path.is_dir():
            fail(f"--plot: {shown!r} is a directory: expected a file name such as bench.png")
        if not path.parent.is_dir():
            if path.parent.exists():
                fail(f"--plot: {str(path.parent)!r} is a file, not a directory: expected a "
                     f"folder to write {path.name!r} into")
            fail(f"--plot: no directory {str(path.parent)!r} to write {path.name!r} into")
        existed = path.exists()
        if existed and not os.access(path, os.W_OK):
            fail(f"--plot: {shown!r} is not writable: expected a path this user can write")
        if not existed and not os.access(path.parent, os.W_OK | os.X_OK):
            fail(f"--plot: directory {str(path.parent)!r} is not writable: expected one this "
                 "user can write")
        # O_NONBLOCK (POSIX only): a named pipe with no reader is refused, where the open
        # would wait for one.
        flags = os.O_WRONLY | getattr(os, "O_NONBLOCK", 0) | (
            os.O_APPEND if existed else os.O_CREAT | os.O_EXCL)
        os.close(os.open(path, flags))  # an existing file opened, not truncated
        if not existed:
            os.unlink(path)
    except (OSError, ValueError) as err:  # ValueError: a NUL byte in the path
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        fail(f"--plot: {shown!r} cannot be written ({reason}): expected a path this user can "
             "write")


def check_plot(plot: Path | None) -> None:
    """matplotlib present and the path writable, before minutes of measuring."""
    if plot is None:
        return
    from kvcache_cli.views.plot import PlotUnavailable, require_matplotlib

    try:
        require_matplotlib()
    except PlotUnavailable as err:
        fail(str(err))
    check_writable(plot)


def show_then_plot(result, view, as_json: bool, save, plot: Path | None, what: str) -> None:
    """Print a measured result (JSON, or VIEW's rendering: rich, or plain text as it is),
    then write its plot: a plot that fails to save after minutes of measuring loses
    nothing."""
    if as_json:
        from kvcache_cli.views import to_json

        typer.echo(to_json(result))
    else:
        shown = view(result)
        if isinstance(shown, str):  # a plain-text view, already laid out
            typer.echo(shown)
        else:
            print_view(shown)
    if plot is None:
        return
    try:
        save(result, plot)
    except (OSError, ValueError) as err:
        fail(f"--plot: the plot could not be written to {str(plot)!r} ({err}); the "
             "results are above", code=1)
    if not as_json:
        console().print(f"{what} written to {plot}")
