"""The heavy tools asked for on the command line, each as a runner over its window of steps.

``trainprof run --deep/--py/--lines`` and ``trainprof.profile(deep=..., ...)`` name
tools and their schedules; this turns them into :class:`WindowRunner` objects for the
Recorder (and, in a process the script starts, for that process's Recorder:
:mod:`trainprof.capture.ranks`). Each tool's module is imported only when asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainprof.capture.window import Schedule, WindowRunner, parse_spec

#: Default window of cProfile / line_profiler: no warm-up needed, more steps than torch.profiler
#: (a sampled call graph needs many calls; cProfile's own cost is per call, not per window).
PY_DEFAULT_SCHEDULE = Schedule(skip_first=10, wait=0, warmup=0, active=20, repeat=1)


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
    runners: list[WindowRunner] = []
    if op_count:
        from trainprof.capture.opcount import OPCOUNT_SCHEDULE, OpCountTool

        runners.append(WindowRunner(OPCOUNT_SCHEDULE, [OpCountTool(run_dir)]))
    if deep is not None:
        from trainprof.capture.deep import DEEP_FLAGS, TorchProfilerTool

        schedule, flags = parse_spec(deep, frozenset(DEEP_FLAGS))
        runners.append(WindowRunner(schedule, [TorchProfilerTool(run_dir, schedule, flags)]))
    if py is not None or lines is not None:
        schedule, _ = parse_spec(py, default=PY_DEFAULT_SCHEDULE)
        tools: list[Any] = []
        if lines is not None:
            # first: resolving its targets must not land inside cProfile's window
            from trainprof.capture.lineprof import (
                SHARES_WINDOW_WITH_CPROFILE,
                LineProfileTool,
                parse_targets,
            )

            line_tool = LineProfileTool(run_dir / "python", parse_targets(lines))
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

            tools.append(CProfileTool(run_dir / "python"))
        runners.append(WindowRunner(schedule, tools))
    return runners
