"""When torch.compile compiles, at which step, for how long, and why it compiled again.

Why: a compiled model pays its compilation once, in the first steps, which the warm-up
leaves out. It pays it again whenever a guard fails - a batch of another shape (the last
one of an epoch), ``model.eval()`` or ``no_grad`` for an evaluation, a Python number that
changed - and after ``torch._dynamo.config.recompile_limit`` (8) recompilations of a frame
it gives up and runs it eagerly. Each recompilation stalls a step for seconds; the step
clock sees a slow step ("other", or GC: Dynamo calls ``gc.collect(1)`` while it compiles)
but not why (expert-rules.md C8: "recompilation storms: shapes that change").

How: Dynamo's own compilation callbacks (``torch._dynamo.callback``, run at the start and
end of each compilation, Dynamo's and a deferred backward's) note the step and the
clock; they are registered when the script first calls ``torch.compile`` (Dynamo is
imported then; trainprof never imports it itself: ~1 s). At the end of the run the reasons
Dynamo gave for each recompilation are read from its record of guard failures
(``torch._dynamo.utils.guard_failures``, kept whether or not its ``recompiles`` log is
on). Costs nothing per step; a compilation costs two callbacks.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from typing import Any

#: Compilations kept in the record (a recompilation storm repeats itself).
MAX_EVENTS = 200
#: Distinct guard-failure reasons kept per compiled function, and characters per reason.
MAX_REASONS, REASON_CHARS = 50, 400
#: The leading ``0/1: `` (which cache entry failed) of a guard-failure text.
_ENTRY = re.compile(r"^\s*\d+/\d+:\s*")


class CompileEvents:
    """torch.compile's compilations in this process, by step (see the module's docs)."""

    def __init__(self, step: Any) -> None:
        self._step = step  # () -> the step counter
        self.events: list[dict[str, Any]] = []
        self.dropped = 0
        self._open: dict[str, tuple[int, int, str]] = {}
        self._callbacks: tuple[Any, Any] | None = None
        self._lock = threading.Lock()
        self._noted = -1  # guard failures Dynamo had noted when the reasons were last read
        self._reasons_cache: list[dict[str, Any]] = []

    def register(self) -> None:
        """Register Dynamo's compilation callbacks, once (Dynamo must be imported)."""
        if self._callbacks is not None:
            return
        try:
            from torch._dynamo.callback import callback_handler
        except Exception:  # noqa: BLE001 - a torch without them: compilations not timed
            self._callbacks = (None, None)
            return

        def on_start(args: Any) -> None:
            key = str(getattr(args, "compile_id", ""))
            trigger = getattr(getattr(args, "callback_trigger", None), "name", "?")
            self._open[key] = (time.perf_counter_ns(), int(self._step()), trigger)

        def on_end(args: Any) -> None:
            key = str(getattr(args, "compile_id", ""))
            begun = self._open.pop(key, None)
            if begun is None:
                return
            t0, step, trigger = begun
            with self._lock:
                if len(self.events) >= MAX_EVENTS:
                    self.dropped += 1
                    return
                self.events.append({"step": step, "t_ns": t0,
                                    "dur_s": (time.perf_counter_ns() - t0) / 1e9,
                                    "trigger": trigger.lower(), "compile_id": key})

        callback_handler.register_start_callback(on_start)
        callback_handler.register_end_callback(on_end)
        self._callbacks = (on_start, on_end)

    def unregister(self) -> None:
        if not self._callbacks or self._callbacks[0] is None:
            return
        try:
            from torch._dynamo.callback import callback_handler

            callback_handler.remove_start_callback(self._callbacks[0])
            callback_handler.remove_end_callback(self._callbacks[1])
        except Exception:  # noqa: BLE001, S110 - the process is ending its record anyway
            pass

    def _reasons(self) -> list[dict[str, Any]]:
        """:func:`recompile_reasons`, read again only when Dynamo has noted more failures:
        the record is rebuilt once a second, and a recompilation storm notes thousands."""
        dynamo = sys.modules.get("torch._dynamo")
        try:
            noted = sum(len(v) for v in list(dynamo.utils.guard_failures.values()))
        except Exception:  # noqa: BLE001 - Dynamo not imported, or without the record
            return []
        if noted != self._noted:
            self._noted, self._reasons_cache = noted, recompile_reasons()
        return self._reasons_cache

    def record(self, origin_ns: int) -> dict[str, Any] | None:
        """run.json's ``compiles``: the compilations (step, seconds, start on the step
        clock) and Dynamo's reasons for compiling again; None when nothing compiled."""
        if not self.events:
            return None
        events = [{"step": e["step"], "t_start_ns": e["t_ns"] - origin_ns,
                   "dur_s": e["dur_s"], "trigger": e["trigger"],
                   "compile_id": e["compile_id"]} for e in self.events]
        return {"events": events, "dropped": self.dropped, "reasons": self._reasons(),
                "recompile_limit": _recompile_limit()}


def recompile_reasons() -> list[dict[str, Any]]:
    """Dynamo's guard failures so far: per compiled function (its name and where it is),
    the reasons it compiled again, first ones first."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return []
    try:
        failures = dict(dynamo.utils.guard_failures)
    except Exception:  # noqa: BLE001 - a torch without the record
        return []
    out = []
    for code, reasons in failures.items():
        if not reasons:
            continue
        distinct: dict[str, int] = {}
        for reason in reasons:
            text = _ENTRY.sub("", str(reason)).strip()[:REASON_CHARS]
            if text in distinct or len(distinct) < MAX_REASONS:
                distinct[text] = distinct.get(text, 0) + 1
        out.append({
            "function": getattr(code, "co_name", str(code)),
            "file": getattr(code, "co_filename", None),
            "line": getattr(code, "co_firstlineno", None),
            "count": len(reasons),
            # each distinct reason (which cache entry failed left out) and how often
            "reasons": [{"text": t, "count": n}
                        for t, n in sorted(distinct.items(), key=lambda kv: -kv[1])],
        })
    return sorted(out, key=lambda r: -r["count"])


def _recompile_limit() -> int | None:
    dynamo = sys.modules.get("torch._dynamo")
    config = getattr(dynamo, "config", None)
    for name in ("recompile_limit", "cache_size_limit"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None
