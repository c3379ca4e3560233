"""The Python profiles of a run (``run --py``, ``run --lines``), summarised for the reports.

Reads what the window tools wrote in ``RUN_DIR/python/``:

* ``top.json`` and ``profile.prof`` (cProfile): the top functions by
  ``tottime`` (own time, excluding calls) and ``cumtime`` (including calls),
  with the meanings of :mod:`pstats`; ``callgraph.svg`` (gprof2dot + GraphViz);
* ``lines.json`` (line_profiler): per function and line, hits and time, and
  "% Time" as line_profiler's ``show_func`` defines it (the line's share of
  the function's total time).

Also :func:`hottest_user_function`: the user function (not the standard
library, not an installed package such as torch, not trainprof) with the
largest own time, with its file and line, for a ``python_loop`` finding.
Own time (``tottime``) rather than ``cumtime``: cumulative time of user code
is mostly the torch calls it makes, which a Python-level fix does not remove.
"""

from __future__ import annotations

import json
import os
import pstats
import re
from pathlib import Path
from typing import Any

#: Paths of code that is not the user's, when top.json does not list the recording
#: machine's own library folders (a .prof from elsewhere).
_LIBRARY_PATTERNS = re.compile(
    r"([\\/](site|dist)-packages[\\/])|([\\/]lib[\\/]python\d+(\.\d+)?[\\/])"
    r"|([\\/]trainprof[\\/](capture|analysis|diagnosis|report)[\\/])"
)


def _load_json(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def is_user_code(filename: str, library_paths: list[str] | None = None) -> bool:
    """Whether ``filename`` (a pstats/line_profiler code file) is the user's own code.

    Builtins (pstats' ``~``) and generated code (``<frozen ...>``, ``<string>``)
    are not; neither is anything under the stdlib, site-packages or trainprof
    folders of the machine that recorded the profile.
    """
    if not filename or filename == "~" or filename.startswith("<"):
        return False
    if _LIBRARY_PATTERNS.search(filename) is not None:
        return False
    for name in {filename, os.path.realpath(filename)}:
        if any(name == p or name.startswith(p.rstrip("/") + "/") for p in library_paths or ()):
            return False
    return True


def _share(x: float | None, total: float | None) -> float | None:
    return x / total if x is not None and total else None


def _with_shares(rows: list[dict[str, Any]], wall_s: float, lib: list[str] | None) -> list[dict]:
    out = []
    for r in rows:
        r = dict(r)
        r["tottime_share"] = _share(r.get("tottime"), wall_s)
        r["cumtime_share"] = _share(r.get("cumtime"), wall_s)
        r["user"] = is_user_code(str(r.get("file", "")), lib)
        out.append(r)
    return out


def hottest_user_function(run_dir: Path) -> dict[str, Any] | None:
    """The user function with the most own time (``tottime``) in the run's cProfile window.

    Reads the whole ``profile.prof`` (every function, not only the top-N of
    ``top.json``); falls back to ``top.json``'s rows when the ``.prof`` cannot
    be read (e.g. written by another Python version). ``share`` is its
    ``tottime`` over the wall time profiled. When the same function was also
    line-profiled, ``hottest_line`` names its hottest line.
    """
    pdir = Path(run_dir) / "python"
    top = _load_json(pdir / "top.json")
    if top is None:
        return None
    lib = top.get("library_paths") or None
    best: dict[str, Any] | None = None
    try:
        stats = pstats.Stats(str(pdir / (top.get("prof") or "profile.prof")))
        for (filename, line, func), (cc, nc, tt, ct, _c) in stats.stats.items():  # type: ignore[attr-defined]
            if is_user_code(filename, lib) and (best is None or tt > best["tottime"]):
                best = {"function": func, "file": filename, "line": line, "ncalls": nc,
                        "primitive_calls": cc, "tottime": tt, "cumtime": ct}
    except Exception:  # unreadable .prof: the top-N rows still name the likely candidate
        for r in top.get("top_tottime") or []:
            if is_user_code(str(r.get("file", "")), lib) and (
                best is None or r["tottime"] > best["tottime"]
            ):
                best = {k: r.get(k) for k in ("function", "file", "line", "ncalls",
                                              "primitive_calls", "tottime", "cumtime")}
    if best is None:
        return None
    best["location"] = f"{best['file']}:{best['line']}({best['function']})"
    best["share"] = _share(best["tottime"], top.get("wall_s"))
    lines = _load_json(pdir / "lines.json")
    for f in (lines or {}).get("functions") or []:
        if f.get("file") == best["file"] and f.get("first_line") == best["line"]:
            hot = _hottest_lines(f, 1)
            best["hottest_line"] = hot[0] if hot else None
    return best


def _hottest_lines(func: dict[str, Any], n: int) -> list[dict[str, Any]]:
    rows = [r for r in func.get("lines") or [] if r.get("hits")]
    rows.sort(key=lambda r: r.get("time_s") or 0.0, reverse=True)
    return rows[:n]


def _summarize_lines(doc: dict[str, Any], hot_n: int) -> dict[str, Any]:
    functions = []
    hottest = None
    for f in doc.get("functions") or []:
        g = dict(f)
        g["hot_lines"] = _hottest_lines(f, hot_n)
        functions.append(g)
        for r in g["hot_lines"][:1]:
            if hottest is None or r["time_s"] > hottest["time_s"]:
                hottest = {"function": f.get("label") or f.get("function"), "file": f.get("file"),
                           **r}
    return {
        "steps_profiled": doc.get("steps_profiled", 0),
        "windows": doc.get("windows") or [],
        "wall_s": doc.get("wall_s"),
        "timer_unit_s": doc.get("timer_unit_s"),
        "targets": doc.get("targets") or [],
        "functions": functions,
        "hottest_line": hottest,
    }


def summarize_python_profile(
    run_dir: Path, top_n: int = 15, hot_lines: int = 8
) -> dict[str, Any] | None:
    """The ``python_profile`` section of a run summary, or None when neither tool ran.

    ``cprofile``: windows, steps and wall time profiled, ``profiled_s`` (time
    inside calls cProfile saw; the rest is code already running when the
    window opened, i.e. the training loop's own body), the top-N tables with
    each row's share of the profiled wall time and whether it is user code,
    and the paths of the ``.prof``, ``.dot`` and ``.svg``. ``lines``: per
    function, every line and the ``hot_lines``. ``messages``: what went wrong
    or is missing (no GraphViz, unresolved targets), for the reports to show.
    """
    pdir = Path(run_dir) / "python"
    top = _load_json(pdir / "top.json")
    lines = _load_json(pdir / "lines.json")
    if top is None and lines is None:
        return None
    section: dict[str, Any] = {"dir": str(pdir), "cprofile": None, "lines": None,
                               "hottest_user": None, "messages": []}
    if top is not None:
        wall = float(top.get("wall_s") or 0.0)
        lib = top.get("library_paths") or None

        def path_of(key: str) -> str | None:
            name = top.get(key)
            return str(pdir / name) if name and (pdir / name).exists() else None

        section["cprofile"] = {
            "steps_profiled": top.get("steps_profiled", 0),
            "windows": top.get("windows") or [],
            "wall_s": wall,
            "profiled_s": top.get("profiled_s"),
            "n_functions": top.get("n_functions", 0),
            "top_tottime": _with_shares((top.get("top_tottime") or [])[:top_n], wall, lib),
            "top_cumtime": _with_shares((top.get("top_cumtime") or [])[:top_n], wall, lib),
            "prof": path_of("prof"),
            "dot": path_of("dot"),
            "svg": path_of("svg"),
        }
        section["messages"] += list(top.get("messages") or [])
        section["hottest_user"] = hottest_user_function(run_dir)
    if lines is not None:
        section["lines"] = _summarize_lines(lines, hot_lines)
        section["lines"]["text"] = str(pdir / "lines.txt")
        section["messages"] += list(lines.get("messages") or [])
    return section
