"""The heavy tools asked for on the command line, each as a runner over its window of steps.

``trainprof run --deep/--py/--lines`` and ``trainprof.profile(deep=..., ...)`` name
tools and their schedules; this turns them into :class:`WindowRunner` objects for the
Recorder (and, in a process the script starts, for that process's Recorder:
:mod:`trainprof.capture.ranks`). Each tool's module is imported only when asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from trainprof.capture.window import Schedule, WindowRunner, parse_spec
from trainprof.store import PYTHON_DIR

#: Default window of cProfile / line_profiler: no warm-up needed, more steps than torch.profiler
#: (a sampled call graph needs many calls; cProfile's own cost is per call, not per window).
PY_DEFAULT_SCHEDULE = Schedule(skip_first=10, wait=0, warmup=0, active=20, repeat=1)


@dataclass(frozen=True)
class ToolOptions:
    """``--deep``/``--py``/``--lines`` parsed: what :func:`build_windows` runs."""

    deep: Schedule | None  #: torch.profiler's window (None: no --deep)
    deep_flags: frozenset[str]
    py: Schedule  #: cProfile's window, and line_profiler's
    lines: list[str] | None  #: line_profiler's targets (None: no --lines)


def parse_tools(deep: str | None, py: str | None, lines: str | None) -> ToolOptions:
    """The tools' options parsed; a bad SPEC or target raises UsageError.

    ``trainprof run`` calls it before it creates the run folder, so that a bad option
    leaves no empty folder behind.
    """
    from trainprof.capture.deep import DEEP_FLAGS
    from trainprof.capture.lineprof import parse_targets

    deep_schedule, flags = (None, frozenset()) if deep is None else parse_spec(
        deep, frozenset(DEEP_FLAGS), option="--deep")
    py_schedule, _ = parse_spec(py, default=PY_DEFAULT_SCHEDULE, option="--py")
    targets = None if lines is None else parse_targets(lines)
    return ToolOptions(deep_schedule, flags, py_schedule, targets)


def build_windows(
    run_dir: Path,
    *,
    deep: str | None = None,
    py: str | None = None,
    lines: str | None = None,
    op_count: bool = True,
) -> list[WindowRunner]:
    """The heavy tools asked for on the command line, each over its window of steps.

    ``op_count``: the always-on sample of torch calls per step (two steps; see
    :mod:`trainprof.capture.opcount`). Option errors (a bad SPEC, a malformed
    target) are raised here as UsageError, before the script starts.
    """
    options = parse_tools(deep, py, lines)
    runners: list[WindowRunner] = []
    if options.deep is not None:
        from trainprof.capture.deep import TorchProfilerTool

        runners.append(WindowRunner(options.deep, [
            TorchProfilerTool(run_dir, options.deep, options.deep_flags)]))
    if py is not None or options.lines is not None:
        schedule = options.py
        tools: list[Any] = []
        if options.lines is not None:
            # first: resolving its targets must not land inside cProfile's window
            from trainprof.capture.lineprof import SHARES_WINDOW_WITH_CPROFILE, LineProfileTool

            line_tool = LineProfileTool(run_dir / PYTHON_DIR, options.lines)
            if py is not None and not SHARES_WINDOW_WITH_CPROFILE:
                # Python 3.12+: both need sys.monitoring's profiler slot; lines go
                # in a window of their own, right after cProfile's
                first = schedule.phase_starts(0)
                later = Schedule(skip_first=first[2] + 1, wait=0, warmup=0,
                                 active=schedule.active, repeat=1)
                runners.append(WindowRunner(later, [line_tool]))
            else:
                tools.append(line_tool)
        if py is not None:
            from trainprof.capture.pyprof import CProfileTool

            tools.append(CProfileTool(run_dir / PYTHON_DIR))
        runners.append(WindowRunner(schedule, tools))
    if op_count:
        from trainprof.capture.opcount import OPCOUNT_SCHEDULE, OpCountTool

        schedule = clear_of(OPCOUNT_SCHEDULE, [r.schedule for r in runners])
        runners.insert(0, WindowRunner(schedule, [OpCountTool(run_dir)]))
    return runners


def covers(schedule: Schedule, step: int) -> bool:
    """Whether ``step`` falls in one of the schedule's windows (warm-up or active)."""
    if step < schedule.skip_first or schedule.cycle <= 0:
        return False
    k, pos = divmod(step - schedule.skip_first, schedule.cycle)
    return (schedule.repeat == 0 or k < schedule.repeat) and pos >= schedule.wait


#: How far the op count's window is moved at most to keep clear of the other windows.
_LOOK_AHEAD = 1000


def clear_of(own: Schedule, others: list[Schedule]) -> Schedule:
    """``own`` (a one-off window) moved to the first steps from its own start that no other
    window covers: the op count's modes add Python to every op, which a torch.profiler or
    cProfile window would record as the step's own time (and the dispatch mode's
    re-dispatched ops came out of Kineto's trace badly nested). Unchanged when no such
    steps come within :data:`_LOOK_AHEAD` steps (a window repeated every step)."""
    span = own.cycle
    for start in range(own.skip_first, own.skip_first + _LOOK_AHEAD):
        if not any(covers(o, step) for o in others for step in range(start, start + span)):
            return replace(own, skip_first=start)
    return own
