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
from trainprof.store import DEEP_DIR

log = logging.getLogger(__name__)


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


#: A trace's finding stands beside the run's of the same category only where it claims
#: more than this many times their largest gain: then the run's rules saw a part of what
#: the trace shows whole (see :func:`trace_findings`).
WHOLE_OVER_PART = 2.0
#: Run categories that own the GPU's idle time before launches do: the device rules'
#: ladder (diagnosis/device.py) gives the device gap to the input pipeline and to blocking
#: syncs first; a trace's launch-bound claim is what is left of it.
IDLE_OWNERS = ("input_pipeline", "synchronization")
#: What must be left of a trace's launch-bound claim for it to stand (the device rules'
#: medium band on the idle share, diagnosis/device.py GAP_MEDIUM).
MIN_LAUNCH_CLAIM = 0.05


def trace_findings(deep: list[dict[str, Any]] | None,
                   run_findings: list[dict[str, Any]]) -> list[dict]:
    """Findings of the deep windows that the run's own rules could not see.

    The run's measurements cover every step, a window only a few: where both
    speak of the same bottleneck (input pipeline, say), the run's finding stands
    and the trace's is dropped, so one bottleneck gets one finding. What only a
    trace shows (tensor cores unused, launch-bound, pageable copies, blocking
    syncs) is kept, from the last window (the most settled one).

    "The same bottleneck" is the same category with a comparable gain. A category
    alone was too coarse: on an H100 a loop of 237 kernels of 1.7 µs a step had the
    GPU idle 94% of its time, the trace said launch-bound (host_launch, 94%), and the
    run's only host_launch finding was its AdamW's foreach step (11%); the trace's
    finding was dropped for it, and the device rules, which defer host_launch to the
    trace, were silent too. A trace finding claiming more than
    :data:`WHOLE_OVER_PART` times the run's largest gain in its category now stands.

    A launch-bound claim (host_launch) is GPU idle time, which the run's input
    pipeline and sync findings own first (:data:`IDLE_OWNERS`): what they claim is
    taken off it before the comparison. On the same H100, a loop of 14 kernels a step
    whose host read ``loss.item()`` each step and loaded its batches itself had the GPU
    waiting for the host 16% of the window; the run's sync finding (28%) and input
    finding (20%) already named why, and the fewer launches the trace proposed were
    not the cause.
    """
    if not deep:
        return []
    last = next((d for d in reversed(deep) if "findings" in d), None)
    if last is None:
        return []
    run_gain: dict[str, float] = {}
    for f in run_findings:
        cat = f.get("category")
        run_gain[cat] = max(run_gain.get(cat, 0.0), float(f.get("estimated_gain") or 0.0))
    kept = []
    for f in last.get("findings") or []:
        cat = f.get("category")
        claim = float(f.get("estimated_gain") or 0.0)
        if cat == "host_launch":
            claim -= sum(run_gain.get(owner, 0.0) for owner in IDLE_OWNERS)
            if claim < MIN_LAUNCH_CLAIM:
                continue
        if cat in run_gain and claim <= WHOLE_OVER_PART * run_gain[cat]:
            continue
        f = dict(f)
        f["evidence"] = {**(f.get("evidence") or {}), "deep_window": Path(last["source"]).name}
        kept.append(f)
    return kept
