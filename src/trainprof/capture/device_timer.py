"""Device time per phase on CUDA, from ``torch.cuda.Event`` markers resolved lazily.

The host-side step clock says how long the *host* spent in forward, backward
and the optimizer; on a GPU those calls only enqueue kernels. This timer
records a CUDA event on the current stream at each phase boundary and at each
step end, and reads the elapsed times later, once ``event.query()`` says the
device has passed the step's last marker - so it never synchronizes.

Definitions (per step, device clock, nanoseconds):

* ``dev_step``: elapsed time between this step's end marker and the previous
  one - the device's step time.
* ``dev_forward`` / ``dev_backward`` / ``dev_optimizer``: elapsed time between
  the phase's begin and end markers (summed if the phase occurs several times,
  e.g. gradient accumulation). It includes device idle time inside the phase
  when the host cannot enqueue work fast enough (a launch-bound phase).
* ``dev_gap``: ``dev_step`` minus the three phase spans, floored at 0: the
  stream time outside the training phases - data wait, logging, syncs. When
  the GPU is starved by the input pipeline, this is where its idle time shows.

Markers are kept only for a bounded number of unresolved steps (the device
may run behind the host); beyond that, steps are skipped rather than letting
events pile up.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

FWD_BEGIN, FWD_END, BWD_BEGIN, BWD_END, OPT_BEGIN, OPT_END = range(6)
_PAIRS = ((FWD_BEGIN, FWD_END, 0), (BWD_BEGIN, BWD_END, 1), (OPT_BEGIN, OPT_END, 2))

#: Unresolved steps kept at most; more means the device is far behind the host.
MAX_PENDING = 64


class DeviceTimer:
    """Phase markers as device events; resolved off the critical path."""

    def __init__(self, make_event: Callable[[], Any]) -> None:
        self._make_event = make_event
        self._free: list[Any] = []
        self._marks: list[tuple[int, Any]] = []
        self._pending: deque[tuple[int, Any, list[tuple[int, Any]], Any]] = deque()
        self._last_end: Any = None
        self.records: deque[tuple[int, ...]] = deque()
        self.skipped = 0
        self._skipping = False

    @classmethod
    def for_cuda(cls) -> DeviceTimer:
        import torch

        return cls(lambda: torch.cuda.Event(enable_timing=True))

    def _event(self) -> Any:
        return self._free.pop() if self._free else self._make_event()

    def mark(self, kind: int) -> None:
        if self._skipping:
            return
        ev = self._event()
        ev.record()
        self._marks.append((kind, ev))

    def step_closed(self, step: int) -> None:
        """Record the step-end marker, queue the step, resolve what the device has finished."""
        if self._skipping:
            self._skipping = len(self._pending) >= MAX_PENDING // 2
            self.skipped += 1
            self._last_end = None  # the next step has no valid start marker
            self.resolve()
            return
        end = self._event()
        end.record()
        start, self._last_end = self._last_end, end
        marks, self._marks = self._marks, []
        if start is None:  # first step (or after a skip): no start marker to measure from
            self._recycle(marks)
        else:
            self._pending.append((step, start, marks, end))
        if len(self._pending) >= MAX_PENDING:
            self._skipping = True
        self.resolve()

    def resolve(self) -> None:
        """Turn finished steps into records; never waits for the device."""
        while self._pending and self._pending[0][3].query():
            step, start, marks, end = self._pending.popleft()
            dev_step = _ns(start.elapsed_time(end))
            spans = [0, 0, 0]
            opened: dict[int, Any] = {}
            for kind, ev in marks:
                for begin, finish, slot in _PAIRS:
                    if kind == begin:
                        opened[begin] = ev
                    elif kind == finish and begin in opened:
                        spans[slot] += _ns(opened.pop(begin).elapsed_time(ev))
            gap = max(0, dev_step - sum(spans))
            self.records.append((step, dev_step, *spans, gap))
            self._recycle(marks)
            self._free.append(start)  # the previous step's end: no step needs it any more

    def _recycle(self, marks: list[tuple[int, Any]]) -> None:
        self._free.extend(ev for _, ev in marks)


def _ns(ms: float) -> int:
    """``Event.elapsed_time`` is in milliseconds (float)."""
    return int(round(ms * 1e6))
