"""cProfile over a bounded window of steps, rendered offline to a call graph (``run --py``).

The everyday recipe this replaces is ``python -m cProfile -o out.prof train.py``
then ``gprof2dot -f pstats out.prof | dot -Tsvg -o out.svg``: here the profiler
is on only inside the window's steps (so start-up, data-set building and the
warm-up do not drown the steady state), and the rendering happens at the end
of the run, in this process, from the saved ``.prof``:

* ``profile.prof``: the :mod:`pstats` dump (open it with ``pstats``, snakeviz,
  or gprof2dot yourself);
* ``callgraph.dot``: gprof2dot's graph, with gprof2dot's own defaults (the
  ``color`` theme: hot nodes red → orange → yellow → green → blue by total
  time; nodes under 0.5% and edges under 0.1% of the total pruned);
* ``callgraph.svg``: GraphViz ``dot -Tsvg`` of it, when ``dot`` is installed;
* ``top.json``: the top-N functions by ``tottime`` and by ``cumtime`` with
  ``pstats``'s columns (``ncalls``, ``tottime``, ``cumtime``, per call),
  the steps and wall time profiled, and messages for the summary.

What cProfile sees, and what it does not: :meth:`cProfile.Profile.enable`
starts at a step boundary, inside the optimizer-step hook, so functions that
were already running then (the training loop itself, ``main()``) are never
"called" inside the window: their own time is not attributed to them, only
the calls they make. ``top.json`` therefore records ``profiled_s`` (the sum of
``tottime``, time inside calls cProfile saw) next to ``wall_s``; the difference
is mostly the loop body's own Python code. cProfile's per-call overhead
inflates functions that make many small calls (roughly 0.1-1 µs per call).

Only the training thread is profiled (:meth:`cProfile.Profile.enable` sets
the profile function of the calling thread), which is where the step runs;
DataLoader workers are other processes.
"""

from __future__ import annotations

import contextlib
import cProfile
import json
import logging
import os
import pstats
import shutil
import site
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: gprof2dot's command-line defaults (``-n 0.5 -e 0.1``), as fractions.
NODE_THRES = 0.005
EDGE_THRES = 0.001
TOP_N = 30
DOT_MISSING = (
    "GraphViz 'dot' not found: install graphviz (apt-get install graphviz) to render callgraph.svg"
)
GPROF2DOT_MISSING = "gprof2dot is not installed (pip install gprof2dot): no call graph was drawn"


def library_paths() -> list[str]:
    """Folders whose code is not the user's: the stdlib, site-packages, the environment's
    console scripts (the ``trainprof`` command itself) and trainprof.

    Stored in ``top.json`` so that the analysis can tell user functions from
    library ones with the recording machine's own paths.
    """
    paths: set[str] = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib", "scripts"):
        p = sysconfig.get_paths().get(key)
        if p:
            paths.add(os.path.realpath(p))
    for p in [*site.getsitepackages(), site.getusersitepackages()]:
        paths.add(os.path.realpath(p))
    paths.add(str(Path(__file__).resolve().parents[1]))  # the trainprof package
    return sorted(paths)


def _row(key: tuple[str, int, str], value: tuple[Any, ...]) -> dict[str, Any]:
    cc, nc, tt, ct, _callers = value
    filename, line, func = key
    return {
        "function": func,
        "file": filename,
        "line": line,
        # pstats.func_std_string: "file:line(function)", or the bare name of a builtin
        "location": pstats.func_std_string(key),
        "ncalls": nc,
        "primitive_calls": cc,  # pstats prints "nc/cc" when they differ (recursion)
        "tottime": tt,
        "cumtime": ct,
        "percall_tottime": tt / nc if nc else 0.0,
        "percall_cumtime": ct / cc if cc else 0.0,
    }


def top_tables(stats: pstats.Stats, n: int = TOP_N) -> dict[str, Any]:
    """pstats' ``sort_stats('tottime')`` and ``sort_stats('cumulative')`` listings, as rows."""
    items = list(stats.stats.items())  # type: ignore[attr-defined]
    by_tt = sorted(items, key=lambda kv: kv[1][2], reverse=True)[:n]
    by_ct = sorted(items, key=lambda kv: kv[1][3], reverse=True)[:n]
    return {
        "n_functions": len(items),
        "profiled_s": stats.total_tt,  # type: ignore[attr-defined]
        "top_tottime": [_row(k, v) for k, v in by_tt],
        "top_cumtime": [_row(k, v) for k, v in by_ct],
    }


def render_callgraph(
    prof_path: Path,
    dot_path: Path,
    svg_path: Path,
    *,
    node_thres: float = NODE_THRES,
    edge_thres: float = EDGE_THRES,
    timeout_s: float = 120.0,
) -> list[str]:
    """pstats file → gprof2dot (library) → ``.dot`` → GraphViz ``dot -Tsvg`` → ``.svg``.

    Same as ``gprof2dot -f pstats -n 0.5 -e 0.1 -c color PROF | dot -Tsvg``.
    Returns messages for the summary (empty when both files were written).
    """
    try:
        import gprof2dot
    except ImportError:
        return [GPROF2DOT_MISSING]
    try:
        parser = gprof2dot.PstatsParser(str(prof_path))
    except SystemExit:  # gprof2dot exits on a .prof it cannot read
        return [f"gprof2dot could not read {prof_path.name}: no call graph was drawn"]
    profile = parser.parse()
    profile.prune(node_thres, edge_thres, None, False)
    tmp = dot_path.with_suffix(".dot.tmp")
    with open(tmp, "w", encoding="utf-8") as fp:
        writer = gprof2dot.DotWriter(fp)
        writer.graph(profile, gprof2dot.themes["color"])
    os.replace(tmp, dot_path)
    dot = shutil.which("dot")
    if dot is None:
        return [DOT_MISSING]
    try:
        proc = subprocess.run(
            [dot, "-Tsvg", "-o", str(svg_path), str(dot_path)],
            capture_output=True, text=True, timeout=timeout_s, check=False,
        )
    except subprocess.TimeoutExpired:
        return [f"GraphViz 'dot' took over {timeout_s:.0f} s: callgraph.svg not rendered "
                f"(render {dot_path.name} yourself)"]
    if proc.returncode != 0 or not svg_path.exists():
        err = (proc.stderr or "").strip().splitlines()
        return [f"GraphViz 'dot' failed (exit {proc.returncode})"
                + (f": {err[-1]}" if err else "")]
    return []


#: The cProfile profiles on right now (CProfileTool.start/stop), for :func:`paused`.
_ON: list[cProfile.Profile] = []


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Every cProfile window off for the block: trainprof's own work inside a step (the
    ``--deep`` window writing its trace, 36% of a ``--py`` profile's time when the two
    windows overlapped) is not the script's, and only the script's is profiled."""
    held = list(_ON)
    for prof in held:
        prof.disable()
    try:
        yield
    finally:
        for prof in held:
            with contextlib.suppress(ValueError):  # (3.12+: another tool took the id)
                prof.enable()


class CProfileTool:
    """A window tool: :class:`cProfile.Profile` on only inside active windows.

    Repeat windows accumulate into one profile (``Profile.enable`` after
    ``disable`` continues the same statistics), as ``pstats.Stats.add`` would.
    """

    name = "cprofile"

    def __init__(self, out_dir: Path, top_n: int = TOP_N) -> None:
        self.out_dir = Path(out_dir)
        self.top_n = top_n
        self.profile: cProfile.Profile | None = None
        self.windows: list[tuple[int, int]] = []
        self.wall_s = 0.0
        self.messages: list[str] = []
        self._since: float | None = None
        self._start_step = 0

    def prepare(self, step: int) -> None:
        """No warm-up is needed: cProfile costs the same from its first call."""

    def boundary(self, step: int) -> None:
        """Nothing per step: cProfile records continuously while on."""

    def start(self, step: int) -> None:
        if self._since is not None:
            return
        other = sys.getprofile()
        if other is not None:
            # on 3.11 enable() would silently replace it (another profiler, a debugger)
            self._note(f"cProfile not started at step {step}: another profile function is "
                       f"active in this thread ({other!r})")
            return
        if self.profile is None:
            self.profile = cProfile.Profile()
        try:
            self.profile.enable()
        except ValueError as exc:  # 3.12+: another tool holds sys.monitoring's profiler id
            holder = sys.monitoring.get_tool(sys.monitoring.PROFILER_ID)  # type: ignore[attr-defined]
            self._note(f"cProfile not started at step {step}: {exc} ({holder}); on Python 3.12+ "
                       "cProfile (--py) and line_profiler (--lines) cannot run in the same "
                       "window: give them separate windows or runs")
            return
        self._start_step = step
        self._since = time.perf_counter()
        _ON.append(self.profile)

    def stop(self, step: int) -> None:
        if self._since is None or self.profile is None:
            return
        if self.profile in _ON:
            _ON.remove(self.profile)
        try:
            self.profile.disable()
        except Exception as exc:
            self._note(f"cProfile stopped with an error at step {step}: {exc}")
        self.wall_s += time.perf_counter() - self._since
        self._since = None
        self.windows.append((self._start_step, step))

    def _note(self, message: str) -> None:
        if message not in self.messages:
            self.messages.append(message)

    def close(self) -> None:
        """Write ``profile.prof``, ``top.json``, ``callgraph.dot`` and ``callgraph.svg``."""
        try:
            self._close()
        except Exception as exc:  # never break the end of a run
            log.warning("trainprof: writing the cProfile results failed: %s", exc)

    def _close(self) -> None:
        if self._since is not None:  # the runner normally stops first
            self.stop(self._start_step + 1)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        doc: dict[str, Any] = {
            "tool": "cprofile",
            "version": 1,
            "windows": [list(w) for w in self.windows],
            "steps_profiled": sum(b - a for a, b in self.windows),
            "wall_s": self.wall_s,
            "prof": None,
            "dot": None,
            "svg": None,
            "node_thres": NODE_THRES,
            "edge_thres": EDGE_THRES,
            "library_paths": library_paths(),
            "python": sys.version.split()[0],
            "n_functions": 0,
            "profiled_s": 0.0,
            "top_tottime": [],
            "top_cumtime": [],
        }
        stats = None
        if self.profile is not None and self.windows:
            self.profile.create_stats()
            if self.profile.stats:  # type: ignore[attr-defined]
                stats = pstats.Stats(self.profile)
        if stats is None:
            if not self.messages:  # else they already say why
                self._note("cProfile recorded nothing: the run ended before the --py window began "
                           "(fewer steps than its skip_first; lower it, e.g. --py skip_first=2)"
                           if not self.windows else "cProfile recorded no function call")
        else:
            prof = self.out_dir / "profile.prof"
            stats.dump_stats(str(prof))
            doc["prof"] = prof.name
            doc.update(top_tables(stats, self.top_n))
            dot_path, svg_path = self.out_dir / "callgraph.dot", self.out_dir / "callgraph.svg"
            try:
                for m in render_callgraph(prof, dot_path, svg_path):
                    self._note(m)
            except Exception as exc:
                self._note(f"the call graph could not be drawn: {exc}")
            doc["dot"] = dot_path.name if dot_path.exists() else None
            doc["svg"] = svg_path.name if svg_path.exists() else None
        doc["messages"] = self.messages
        tmp = self.out_dir / "top.json.tmp"
        tmp.write_text(json.dumps(doc, indent=1), encoding="utf-8")
        os.replace(tmp, self.out_dir / "top.json")
