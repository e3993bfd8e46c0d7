"""Progress for long engine work at load time (preloading records, deriving low-bit stores, warming kernels): a
rich bar or spinner on stderr when it is a terminal, else nothing."""

from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def progress_bar(description: str, total: int):
    """Yields `advance(done)`: call it with the count done so far."""
    if not sys.stderr.isatty():
        yield lambda done: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda done: bar.update(task, completed=done)


@contextlib.contextmanager
def status(description: str):
    """A spinner with `description` while the block runs."""
    if not sys.stderr.isatty():
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(description):
        yield
