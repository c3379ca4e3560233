"""The deep windows of a run (``RUN_DIR/deep/*.pt.trace.json.gz``), analysed like any trace.

Each window's trace goes through :func:`trainprof.analysis.trace.analyse_trace`
on its own (one file per window of one process: they are not ranks), so the
run summary carries the TensorBoard-plugin breakdown, GPU summary, HTA
temporal breakdown and top operators of every window, and the trace findings.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from trainprof.errors import UsageError

log = logging.getLogger(__name__)

DEEP_DIR = "deep"


def analyse_deep_windows(run_dir: Path) -> list[dict[str, Any]] | None:
    """One trace analysis per deep-window trace of the run, in step order; None if none."""
    folder = run_dir / DEEP_DIR
    if not folder.is_dir():
        return None
    from trainprof.analysis.trace import analyse_trace
    from trainprof.analysis.trace.analyse import trace_files

    out = []
    for path in sorted(trace_files(folder), key=_first_step):
        try:
            doc = analyse_trace(path)
        except UsageError as exc:  # a trace cut short by kill -9, say: report, go on
            out.append({"source": str(path), "error": str(exc)})
            continue
        doc["source"] = str(path)
        out.append(doc)
    return out or None


def _first_step(path: Path) -> int:
    """``...steps12-16.pt.trace.json.gz`` -> 12 (names written by capture/deep.py)."""
    name = path.name
    i = name.rfind(".steps")
    try:
        return int(name[i + 6 :].split("-", 1)[0]) if i >= 0 else 0
    except ValueError:
        return 0


def trace_findings(deep: list[dict[str, Any]] | None, run_categories: set[str]) -> list[dict]:
    """Findings of the deep windows that the run's own rules could not see.

    The run's measurements cover every step, a window only a few: where both
    speak of the same category (input pipeline, say), the run's finding stands
    and the trace's is dropped, so one bottleneck gets one finding. What only a
    trace shows (tensor cores unused, launch-bound, pageable copies, blocking
    syncs) is kept, from the last window (the most settled one).
    """
    if not deep:
        return []
    last = next((d for d in reversed(deep) if "findings" in d), None)
    if last is None:
        return []
    kept = []
    for f in last.get("findings") or []:
        if f.get("category") in run_categories:
            continue
        f = dict(f)
        f["evidence"] = {**(f.get("evidence") or {}), "deep_window": Path(last["source"]).name}
        kept.append(f)
    return kept
