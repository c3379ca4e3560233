"""Deep windows: ``torch.profiler`` over a bounded window of steps (``trainprof run --deep``).

One ``torch.profiler.profile`` per window cycle, driven by trainprof's own
step boundaries: the profiler's ``step()`` is called where the step clock
closes a step, so the trace's ``ProfilerStep#N`` annotations carry
trainprof's step indices and line up with ``steps.bin``. The profiler's
schedule is a function of the absolute step number (warm-up before the
window's first active step, record until its last, then save), which is
what ``torch.profiler.schedule`` computes for relative numbers.

With ``warmup=0`` torch.profiler misses the first step's ``ProfilerStep#N``
annotation (it warns that results are skewed without warm-up); the default
window has two warm-up steps.

Traces are written as ``RUN_DIR/deep/<host>_<pid>.steps<A>-<B>.pt.trace.json.gz``:
TensorBoard's profiler plugin and Perfetto open ``*.pt.trace.json.gz`` files
directly, and ``trainprof trace RUN_DIR/deep`` analyses them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from pathlib import Path
from typing import Any

from trainprof.capture import pyprof
from trainprof.capture.window import Schedule
from trainprof.store import DEEP_DIR

log = logging.getLogger(__name__)

#: Bare flags of ``--deep`` and what they turn on in ``torch.profiler.profile``.
DEEP_FLAGS = {
    "shapes": "record_shapes",
    "memory": "profile_memory",
    "stack": "with_stack",
    "flops": "with_flops",
    "modules": "with_modules",
}


class TorchProfilerTool:
    """A :class:`~trainprof.capture.window.WindowTool` running ``torch.profiler``."""

    name = "torch_profiler"

    def __init__(self, run_dir: Path, schedule: Schedule, flags: frozenset[str] = frozenset()):
        self.out_dir = run_dir / DEEP_DIR
        self.schedule = schedule
        self.options = {DEEP_FLAGS[f]: True for f in flags if f in DEEP_FLAGS}
        self.traces: list[dict[str, Any]] = []
        self._prof: Any = None
        self._window: tuple[int, int, int] = (0, 0, 0)

    def _cycle_of(self, step: int) -> tuple[int, int, int]:
        k = max(0, (step - self.schedule.skip_first) // max(1, self.schedule.cycle))
        return self.schedule.phase_starts(k)

    def _action(self, step: int) -> Any:
        from torch.profiler import ProfilerAction

        _, a_start, end = self._window
        if step >= end:
            return ProfilerAction.NONE
        if step < a_start:
            return ProfilerAction.WARMUP
        return ProfilerAction.RECORD_AND_SAVE if step == end - 1 else ProfilerAction.RECORD

    def _begin(self, step: int) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        self._window = self._cycle_of(step)
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_initialized():
            activities.append(ProfilerActivity.CUDA)
        if step >= self._window[1]:
            self._window = (step, step, self._window[2])
        self._prof = profile(
            activities=activities,
            schedule=self._action,
            on_trace_ready=self._save,
            **self.options,
        )
        # The schedule reads absolute step numbers, and torch.profiler takes its
        # first action at construction, for step 0: before the window, WARMUP.
        # Without a warm-up that would run the first active step unrecorded, so
        # the first action is the one of the step the profiler starts at.
        self._prof.step_num = step
        self._prof.current_action = self._action(step)
        if hasattr(self._prof, "_prev_schedule_action"):
            self._prof._prev_schedule_action = self._prof.current_action
        self._prof.start()

    def _save(self, prof: Any) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        _, a_start, end = self._window
        last = min(end, self._stopped_at) - 1 if self._stopped_at is not None else end - 1
        name = f"{socket.gethostname()}_{os.getpid()}.steps{a_start}-{last}.pt.trace.json.gz"
        path = self.out_dir / name
        prof.export_chrome_trace(str(path))
        self.traces.append({"path": str(path), "first_step": a_start, "last_step": last})

    # -- WindowTool -----------------------------------------------------------
    _stopped_at: int | None = None

    # Each call below runs with every cProfile window paused (``--py`` inside
    # ``--deep``): torch.profiler's step, stop and the trace's export are
    # trainprof's work, not the script's (writing the trace had been 36% of a
    # ``--py`` profile). Paused at the call's entry, not around the export
    # alone: a pause closes the frames cProfile holds open, and ``_save`` and
    # the profiler's own frames would be left in the table with part of their
    # time.
    def prepare(self, step: int) -> None:
        with pyprof.paused():
            self._stopped_at = None
            self._begin(step)

    def start(self, step: int) -> None:
        with pyprof.paused():
            if self._prof is None:
                self._stopped_at = None
                self._begin(step)
            else:
                self._prof.step()

    def boundary(self, step: int) -> None:
        if self._prof is not None:
            with pyprof.paused():
                self._prof.step()

    def stop(self, step: int) -> None:
        with pyprof.paused():
            self._stop(step)

    def _stop(self, step: int) -> None:
        prof, self._prof = self._prof, None
        if prof is None:
            return
        if step >= self._window[2]:
            prof.step()  # RECORD_AND_SAVE -> NONE: stops and saves the trace
        else:
            self._stopped_at = step  # the run ended inside the window: save what there is
        with contextlib.suppress(Exception):
            prof.stop()

    def close(self) -> None:
        if self._prof is not None:
            self.stop(self._window[2])
