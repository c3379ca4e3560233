"""A run's death by a fatal signal, as the report shows it: the signal and the user's frames.

The record holds faulthandler's dump as read by :func:`trainprof.fault_dump.read_fault_dump`
(``meta["crash"]``): every frame of the crashing thread, trainprof's and runpy's
included (the launcher runs the script from inside them). The report wants what a
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
    """``{"signal", "message", "frames": [[file, line, function], ...], "more": n}`` with
    the frames outermost first (the crash site last), at most :data:`MAX_FRAMES` of them
    (``more`` counts those left out); None if the record holds no dump."""
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
