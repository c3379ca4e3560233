"""Progress of long data tools on stderr: a bar on a terminal, a line every 10% in a log."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

from trainprof.report.console import make_console


@contextmanager
def progress_reporter(label: str, stream: IO[str]) -> Iterator[Callable[[int, int], None]]:
    """A ``progress(done, total)`` callback for the duration of the block."""
    if stream.isatty():
        bar = Progress(f"  {label}", BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                       console=make_console(stream), transient=True)
        task = bar.add_task(label, total=None)
        with bar:
            yield lambda done, total: bar.update(task, completed=done, total=total)
        return
    last = [-1]

    def line(done: int, total: int) -> None:
        tenth = done * 10 // max(total, 1)
        if tenth > last[0]:
            last[0] = tenth
            # the share done, not the tenth: 768 of 2,048 is 37%, not "30%" (floored, so
            # 100% means all of it)
            stream.write(f"  {label}: {done:,} / {total:,} ({done * 100 // max(total, 1)}%)\n")
            stream.flush()

    yield line
