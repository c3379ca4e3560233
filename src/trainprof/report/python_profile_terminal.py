"""The Python-profile part of the terminal summary (``run --py`` / ``run --lines``).

Renders the ``python_profile`` section built by
:func:`trainprof.analysis.python_profile.summarize_python_profile`; it
computes nothing. The cProfile table has pstats' columns; the line profile is
laid out as kernprof prints it (Line #, Hits, Time, Per Hit, % Time, Line
Contents), with times in readable units and only the hot lines of long
functions (the whole listing is in ``lines.txt``).
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from trainprof.report.console import keep_numbers_whole


def fmt_time(seconds: float | None) -> str:
    """As ``report.terminal.fmt_time``, plus nanoseconds for per-hit line times.

    Not imported from there: ``report.terminal`` imports this module.
    """
    if seconds is None:
        return "—"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    if seconds >= 1e-6 or seconds == 0:
        return f"{seconds * 1e6:.0f} µs"
    return f"{seconds * 1e9:.0f} ns"


#: A function this long or shorter is shown whole; a longer one only around its hot lines.
_WHOLE_FUNCTION_LINES = 25


def _windows_text(windows: list[list[int]]) -> str:
    if not windows:
        return "no window"
    return ", ".join(f"{a}-{b - 1}" if b - 1 > a else f"{a}" for a, b in windows)


def _ncalls(row: dict[str, Any]) -> str:
    nc, cc = row.get("ncalls"), row.get("primitive_calls")
    return f"{nc}/{cc}" if cc is not None and nc != cc else str(nc)


def _short_location(row: dict[str, Any], width: int = 70) -> str:
    loc = str(row.get("location") or row.get("function"))
    return loc if len(loc) <= width else "…" + loc[-(width - 1):]


def _top_table(rows: list[dict[str, Any]], key: str, n: int) -> Table:
    title = "own time (tottime)" if key == "tottime" else "cumulative time (cumtime)"
    table = Table(title=f"Top {min(n, len(rows))} by {title}", title_justify="left",
                  box=None, padding=(0, 1), header_style="bold")
    table.add_column("tottime", justify="right")
    table.add_column("cumtime", justify="right")
    table.add_column(f"% {key}", justify="right")
    table.add_column("ncalls", justify="right")
    table.add_column("per call", justify="right")
    table.add_column("function (file:line)", overflow="fold")
    for r in rows[:n]:
        share = r.get(f"{key}_share")
        per_call = r.get("percall_tottime" if key == "tottime" else "percall_cumtime")
        style = "bold" if r.get("user") else None
        table.add_row(
            fmt_time(r.get("tottime")),
            fmt_time(r.get("cumtime")),
            "—" if share is None else f"{share * 100:.1f}%",
            _ncalls(r),
            fmt_time(per_call),
            Text(_short_location(r), style=style or ""),
        )
    return keep_numbers_whole(table)


def _line_style(percent: float) -> str:
    if percent >= 20:
        return "bold red"
    if percent >= 5:
        return "yellow"
    return ""


def _shown_lines(func: dict[str, Any]) -> list[dict[str, Any] | None]:
    """The lines to print: all of a short function; else the hot ones with a line of context.

    ``None`` marks a gap (printed as ``...``).
    """
    lines = func.get("lines") or []
    if len(lines) <= _WHOLE_FUNCTION_LINES:
        return list(lines)
    hot = {r["line"] for r in func.get("hot_lines") or [] if r.get("percent", 0) >= 1.0}
    keep = {lines[0]["line"]} | hot | {n - 1 for n in hot}
    out: list[dict[str, Any] | None] = []
    prev = None
    for r in lines:
        if r["line"] in keep:
            if prev is not None and r["line"] != prev + 1:
                out.append(None)
            out.append(r)
            prev = r["line"]
    return out


def _function_table(func: dict[str, Any]) -> Table:
    table = Table(box=None, padding=(0, 1), header_style="bold")
    for name in ("Line #", "Hits", "Time", "Per Hit", "% Time"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("Line Contents", no_wrap=True, overflow="ellipsis")
    for r in _shown_lines(func):
        if r is None:
            table.add_row("...", "", "", "", "", "")
            continue
        hits = r.get("hits") or 0
        pct = r.get("percent") or 0.0
        table.add_row(
            str(r["line"]),
            str(hits) if hits else "",
            fmt_time(r.get("time_s")) if hits else "",
            fmt_time(r.get("per_hit_s")) if hits else "",
            f"{pct:.1f}" if hits else "",
            Text(str(r.get("source", "")).rstrip(), style=_line_style(pct)),
        )
    return keep_numbers_whole(table, cut="Line Contents")


def render_python_profile(
    section: dict[str, Any] | None, console: Console, top_n: int = 10
) -> None:
    """Print the cProfile top tables, the call-graph path and the line profile."""
    if not section:
        return
    cp = section.get("cprofile")
    if cp:
        head = Text("\nPython profile (cProfile)", style="bold")
        if cp.get("windows"):
            head.append(
                f"  steps {_windows_text(cp['windows'])} · {cp.get('steps_profiled', 0)} steps · "
                f"{fmt_time(cp.get('wall_s'))} wall · {fmt_time(cp.get('profiled_s'))} inside "
                "profiled calls", style="")
        else:
            head.append("  nothing recorded (see the notes below)", style="")
        console.print(head)
        if cp.get("top_tottime"):
            console.print(_top_table(cp["top_tottime"], "tottime", top_n))
            console.print(_top_table(cp["top_cumtime"], "cumtime", top_n))
            console.print(Text("(bold: your code; % of the wall time profiled)", style="dim"))
        hu = section.get("hottest_user")
        if hu:
            line = Text("Hottest function of yours: ", style="bold cyan")
            line.append(f"{hu['function']} ({hu['file']}:{hu['line']})")
            line.append(f" · {fmt_time(hu['tottime'])} own time")
            if hu.get("share") is not None:
                line.append(f", {hu['share'] * 100:.0f}% of the profiled wall time")
            console.print(line)
        if cp.get("svg"):
            console.print(Text("Call graph   ", style="bold cyan").append(str(cp["svg"])))
        if cp.get("prof"):
            console.print(Text("pstats file  ", style="bold cyan").append(str(cp["prof"])))
    lp = section.get("lines")
    if lp:
        head = Text("\nLine profile (line_profiler)", style="bold")
        if lp.get("windows"):
            head.append(f"  steps {_windows_text(lp['windows'])} · "
                        f"{lp.get('steps_profiled', 0)} steps", style="")
        else:
            head.append("  nothing recorded (see the notes below)", style="")
        console.print(head)
        for func in lp.get("functions") or []:
            title = Text(f"Function: {func.get('label')} at line {func.get('first_line')}",
                         style="bold")
            title.append(f"  ({func.get('file')})  Total time: "
                         f"{fmt_time(func.get('total_time_s'))}", style="")
            console.print(title)
            if not func.get("hits"):
                console.print(Text("  not called inside the window", style="dim"))
                continue
            console.print(_function_table(func))
        if lp.get("text") and lp.get("functions"):
            console.print(Text("Full listing ", style="bold cyan").append(str(lp["text"])))
    for m in section.get("messages") or []:
        console.print(Text(f"Note: {m}", style="yellow"))
