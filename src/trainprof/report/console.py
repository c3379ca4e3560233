"""The rich console every terminal renderer prints through.

On a terminal rich fits the terminal's width. In a log, a pipe or a file it
uses 120 columns rather than rich's default 80, so evidence and fix lines are
not chopped up; and there it drops the spaces rich pads table cells with up to
the full width, which would otherwise end every line of a saved report.

Rich wraps by writing newlines, so a command wrapped with the prose around it was cut in
two, and its first line pasted alone ran without its last arguments. A command for the user
to run is printed by :func:`print_command`, whole on a line of its own: a long one runs past
the width, the terminal folds it on screen, and copying the line copies the command. Prose
that quotes code in backticks is wrapped by :func:`print_prose`, which never breaks a quote.
"""

from __future__ import annotations

import math
import os
import re
from typing import IO

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

__all__ = ["keep_numbers_whole", "make_console", "print_command", "print_prose"]

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


def fmt_ratio(x: float | None) -> str:
    """A ratio of step times as ``×0.75``: two decimals from ×0.1 to ×10, three
    significant digits above; below ×0.1 two significant digits, which two decimals
    rounded away (a ×0.0091 change and its 95% CI ×0.0085-×0.0098 read "×0.01, 95% CI
    ×0.01-×0.01", an explorer's verify of synthetic data)."""
    if x is None:
        return "—"
    if 0 < x < 0.1:
        decimals = 1 - math.floor(math.log10(x))  # two significant digits
        return f"×{x:.{decimals}f}"
    return f"×{x:.2f}" if x < 10 else f"×{x:.3g}"


class _Console(Console):
    """rich's console, but a closed pipe is left to ``trainprof.cli.main``.

    rich answers a ``BrokenPipeError`` with ``SystemExit(1)``; raising the error on lets
    the CLI end every command's closed pipe one way (quietly, status 141), whether the
    output came through rich or through ``print``."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError


def make_console(out: IO[str]) -> Console:
    """A console on ``out``: the terminal's width on a terminal, else 120 columns, trimmed."""
    try:
        tty = out.isatty()
    except (AttributeError, ValueError):
        tty = False
    if tty:
        return _Console(file=out, highlight=False, soft_wrap=True)
    width = None if "COLUMNS" in os.environ else WIDTH_OFF_TERMINAL
    trimmed: IO[str] = _TrimmedLines(out)  # type: ignore[assignment]  # write/flush suffice
    return _Console(file=trimmed, highlight=False, soft_wrap=True, width=width)


#: A word of prose for :func:`print_prose`: a run of characters without a space, where a
#: backticked quote counts as one character however many spaces it holds.
_WORD = re.compile(r"(?:[^\s`]|`[^`]*`|`)+")


def wrap_prose(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width`` cells, broken between words, never inside a
    backticked quote (`trainprof run --py train.py`): a word or quote wider than a line
    gets a line of its own, whole. Its own line breaks stay; its runs of spaces become one."""
    lines: list[str] = []
    for paragraph in text.split("\n"):
        line = ""
        for word in _WORD.findall(paragraph):
            if line and cell_len(line) + 1 + cell_len(word) > width:
                lines.append(line)
                line = word
            else:
                line = f"{line} {word}" if line else word
        lines.append(line)
    return lines


def print_prose(console: Console, text: str, indent: int = 0, style: str = "") -> None:
    """``text`` wrapped at the console's width (less ``indent``), each line indented, with no
    quote in backticks broken (:func:`wrap_prose`); the lines are printed as they are, so
    rich adds no break of its own."""
    for line in wrap_prose(text, max(20, console.width - indent)):
        console.print(Text(" " * indent + line, style=style), soft_wrap=True)


def print_command(console: Console, command: str, indent: int = 0, style: str = "") -> None:
    """A command for the user to run, whole on one line however long: rich writes no break
    into it (soft wrap), the terminal folds it on screen, and copying the line copies all of
    it."""
    console.print(Text(" " * indent + command, style=style), soft_wrap=True)


def keep_numbers_whole(table: Table, cut: str | None = None,
                       keep: tuple[str, ...] = ()) -> Table:
    """``table`` with its numbers never cut, whatever the width: call it once its rows are in.

    Rich fits a table wider than the console by shrinking its wrappable columns first, and
    then, as a last resort, every column evenly, ``no_wrap`` ones too: numbers came out as
    ``5283…`` and ``Lin…`` at 80 columns while a source line kept its width. So the
    right-justified columns (numbers, in every table here) get ``no_wrap`` and a
    ``min_width`` of their widest cell; the text column named ``cut`` (a source line, an
    operator's name) becomes shrinkable, its cells still one line each, cut at the end, so
    that it gives up the room before any number does. The columns named in ``keep`` (a
    tune arm's name, its verdict) are kept whole like the numbers: a table too wide for the
    console then runs past its width (the console soft-wraps) rather than drop them.
    """
    for column in table.columns:
        cells = list(column.cells)
        if column.justify == "right" or column.header in keep:
            column.no_wrap = True
            column.min_width = max([cell_len(_plain(column.header))]
                                   + [cell_len(_plain(c)) for c in cells])
        elif cut is not None and column.header == cut:
            column.no_wrap = False
            column._cells = [_one_line(c) for c in cells]
    return table


def _plain(cell: object) -> str:
    return cell.plain if isinstance(cell, Text) else str(cell)


def _one_line(cell: object) -> object:
    """A cell kept to one line, cut at its end, in a column that may shrink."""
    if isinstance(cell, Text):
        cell = cell.copy()
    elif isinstance(cell, str):
        cell = Text.from_markup(cell)
    else:
        return cell
    cell.no_wrap, cell.overflow = True, "ellipsis"
    return cell
