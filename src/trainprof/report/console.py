"""The rich console every terminal renderer prints through.

On a terminal rich fits the terminal's width. In a log, a pipe or a file it
uses 120 columns rather than rich's default 80, so evidence and fix lines are
not chopped up; and there it drops the spaces rich pads table cells with up to
the full width, which would otherwise end every line of a saved report.
"""

from __future__ import annotations

import os
from typing import IO

from rich.console import Console

__all__ = ["make_console"]

#: Columns off a terminal (unless COLUMNS says otherwise).
WIDTH_OFF_TERMINAL = 120


class _TrimmedLines:
    """A text stream that writes ``out`` line by line, without trailing blanks."""

    def __init__(self, out: IO[str]) -> None:
        self._out = out
        self._pending = ""

    def write(self, text: str) -> int:
        lines = (self._pending + text).split("\n")
        self._pending = lines.pop()
        if lines:
            self._out.write("".join(line.rstrip(" ") + "\n" for line in lines))
        return len(text)

    def flush(self) -> None:
        if self._pending:
            self._out.write(self._pending.rstrip(" "))
            self._pending = ""
        self._out.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._out.fileno()


def make_console(out: IO[str]) -> Console:
    """A console on ``out``: the terminal's width on a terminal, else 120 columns, trimmed."""
    try:
        tty = out.isatty()
    except (AttributeError, ValueError):
        tty = False
    if tty:
        return Console(file=out, highlight=False, soft_wrap=True)
    width = None if "COLUMNS" in os.environ else WIDTH_OFF_TERMINAL
    trimmed: IO[str] = _TrimmedLines(out)  # type: ignore[assignment]  # write/flush suffice
    return Console(file=trimmed, highlight=False, soft_wrap=True, width=width)
