"""A run's death, as the report shows it: what killed it and the user's frames.

Two kinds, both ``meta["crash"]``:

* an exception the script raised (``"exception"``): recorded when it ended
  (trainprof.capture.launcher's ``describe_exception``, the API's ``profile()`` block
  alike), its frames already the user's in a traceback's order, with the step it was in.
  The terminal's traceback is gone once the run is over: this is what is left of it.
* a fatal signal (``"signal"``), read back below.

For a fatal signal the record holds faulthandler's dump as read by
:func:`trainprof.fault_dump.read_fault_dump` (``meta["crash"]``): every frame of the
crashing thread, trainprof's and runpy's included (the launcher runs the script from
inside them). The report wants what a
Python traceback would show, so those frames are left out here, and the frames are
put in a traceback's order (most recent call last).
"""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

#: The folder of the trainprof package: frames from it are the launcher's, not the user's.
_OWN_DIR = str(Path(__file__).resolve().parents[1]) + "/"
_RUNPY = (runpy.__file__, "<frozen runpy>")
#: Frames the report shows, the innermost ones.
MAX_FRAMES = 12


def summarize_crash(crash: Any) -> dict[str, Any] | None:
    """``{"signal", "message", "frames": [[file, line, function], ...], "more": n}`` for a
    fatal signal, ``{"exception", "message", "site", "step", "frames", "more"}`` for an
    exception, with the frames outermost first (the crash site last), at most
    :data:`MAX_FRAMES` of them (``more`` counts those left out); None if the record holds
    neither."""
    if isinstance(crash, dict) and crash.get("exception"):
        return _summarize_exception(crash)
    if not isinstance(crash, dict) or not crash.get("signal"):
        return None
    frames = [f for f in crash.get("frames") or []
              if isinstance(f, list) and len(f) == 3
              and not str(f[0]).startswith(_OWN_DIR) and f[0] not in _RUNPY]
    frames.reverse()
    shown = frames[-MAX_FRAMES:]
    return {"signal": str(crash["signal"]), "message": str(crash.get("message") or ""),
            "frames": shown, "more": len(frames) - len(shown),
            "threads": int(crash.get("threads") or 0)}


def _summarize_exception(crash: dict[str, Any]) -> dict[str, Any]:
    """The exception's record as the report shows it: its frames are the user's already
    (left out when it was recorded), in a traceback's order."""
    frames = [f for f in crash.get("frames") or [] if isinstance(f, list) and len(f) == 3]
    shown = frames[-MAX_FRAMES:]
    site = crash.get("site")
    step = crash.get("step")
    return {"exception": str(crash["exception"]), "message": str(crash.get("message") or ""),
            "site": site if isinstance(site, dict) else None,
            "step": step if isinstance(step, int) else None,
            "frames": shown, "more": len(frames) - len(shown) + int(crash.get("more") or 0)}
