"""``gc.collect()`` calls made while training: which line, how often, how long.

CPython's ``gc.callbacks`` (which time every collection, :mod:`trainprof.capture.hooks`)
do not say why a collection ran. A script that calls ``gc.collect()`` every N steps
(to keep memory down, out of habit, or through a library) pays a *full* collection
each time, which walks every tracked object: on this project's VM, a small model's
script with torch imported took 129 ms a call (174 ms under trainprof run), 61% of its
time when called every 20 steps of 4 ms. Automatic
collections are a different problem with a different fix (``gc.freeze()``, higher
thresholds), so the training thread's explicit calls are told apart here: the hooks
replace ``gc.collect`` (the module attribute, which ``gc.collect()`` and
``import gc`` callers use) with a wrapper that times the call and notes the caller's
line. Calls from trainprof itself (the ``gc_freeze`` knob) are not counted. A call
costs its caller one frame lookup; the collection costs milliseconds.
"""

from __future__ import annotations

import linecache
import os
import sys
from typing import Any

#: trainprof's own source folder: its calls are not the script's
_OWN = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: torch.compile's own packages
_COMPILER_DIRS = (f"torch{os.sep}_dynamo{os.sep}", f"torch{os.sep}_inductor{os.sep}")
#: At most this many call sites are kept (a collect inside a loop over files, say).
MAX_SITES = 20


class ExplicitCollects:
    """The training thread's ``gc.collect()`` calls, by call site."""

    def __init__(self) -> None:
        self.calls = 0
        self.ns = 0
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.sites: dict[str, dict[str, Any]] = {}

    @staticmethod
    def is_own(filename: str) -> bool:
        return filename.startswith(_OWN)

    @staticmethod
    def is_compiler(filename: str) -> bool:
        """A call of torch.compile's while it compiles (Dynamo's ``gc.collect(1)``): the
        compilation's cost (capture/compile_events.py), not the script's habit."""
        return any(part in filename for part in _COMPILER_DIRS)

    @staticmethod
    def caller(depth: int = 1) -> Any:
        """The frame that called ``gc.collect``, past trainprof's own ``collect`` wrappers
        (the hooks' timing one around the ``explicit_gc`` knob's, or the reverse); None
        when no Python code called it (``atexit.register(gc.collect)``: called from C)."""
        try:
            frame = sys._getframe(depth + 1)
        except ValueError:  # the call stack is not that deep
            return None
        while (frame.f_code.co_name == "collect"
               and frame.f_code.co_filename.startswith(_OWN)):
            if frame.f_back is None:
                return None
            frame = frame.f_back
        return frame

    def add(self, filename: str, lineno: int, ns: int, step: int) -> None:
        self.calls += 1
        self.ns += ns
        if self.first_step is None:
            self.first_step = step
        self.last_step = step
        site = f"{filename}:{lineno}"
        entry = self.sites.get(site)
        if entry is None and len(self.sites) < MAX_SITES:
            entry = self.sites[site] = {
                "calls": 0, "total_s": 0.0,
                "code": linecache.getline(filename, lineno).strip() or None,
            }
        if entry is not None:
            entry["calls"] += 1
            entry["total_s"] += ns / 1e9

    def record(self) -> dict[str, Any] | None:
        """run.json's ``explicit_gc``; None while no call was made."""
        if not self.calls:
            return None
        return {
            "calls": self.calls,
            "total_s": self.ns / 1e9,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "sites": {k: dict(v) for k, v in self.sites.items()},
        }
