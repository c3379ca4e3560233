"""torch.compile's compilations over a run: how many, when, how long, and why again.

Reads run.json's ``compiles`` (:mod:`trainprof.capture.compile_events`). A compilation in
the warm-up is the price of compiling; one after it stalled a training step: a
*recompilation* (Dynamo's guards failed: another input shape, autograd or the module's
train/eval mode switched, a Python value changed). Dynamo numbers compilations
``frame/attempt`` (``0/3``: the 4th compilation of the first frame it compiled); a frame
compiled ``recompile_limit`` times (8 by default) is not compiled again - it runs
eagerly, uncompiled, from then on (``limit_hit``).

The reasons are Dynamo's own guard-failure texts, grouped by kind: ``shape`` (``size
mismatch``, ``stride mismatch``), ``grad_mode`` (``GLOBAL_STATE changed: grad_mode``),
``module_mode`` (a module's ``training`` flag), ``other``. Dynamo notes, at each
recompilation, why each compiled version failed; so a recompilation for a new shape after
one for ``no_grad`` counts both kinds: the counts say which kinds occur, not how many
recompilations each caused.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

_SEP = os.sep
#: A compile id's attempt number (``"0/3"`` -> 3; ``"[0/3]"`` in some versions).
_COMPILE_ID = re.compile(r"(\d+)/(\d+)")
#: Reason kinds by the words of Dynamo's guard-failure texts.
_KINDS = (("shape", ("size mismatch", "stride mismatch", "dimensionality", "rank")),
          ("grad_mode", ("grad_mode",)),
          ("module_mode", (".training", "training ==", "___check_obj_id")))


def _attempt(event: dict[str, Any]) -> int:
    """Which compilation of its frame an event is (0: the first), from its compile id."""
    m = _COMPILE_ID.search(str(event.get("compile_id") or ""))
    return int(m.group(2)) if m else 0


def reason_kind(text: str) -> str:
    low = text.lower()
    for kind, words in _KINDS:
        if any(w in low for w in words):
            return kind
    return "other"


def summarize_compiles(record: dict[str, Any] | None, steps: np.ndarray, warmup: int
                       ) -> dict[str, Any] | None:
    """The summary's ``compiles`` (None without a compilation). ``steps``: the run's
    complete steps (the step clock's records); ``warmup``: how many of them are warm-up."""
    if not isinstance(record, dict) or not record.get("events"):
        return None
    events = [e for e in record["events"] if isinstance(e, dict)]
    # recompilations (a frame's attempt 1 and on: a frame compiled first late in the run -
    # an evaluation function - pays its one compilation like any other) in the steady steps
    # the share is of (not those under a heavy tool, which the statistics leave out)
    steady = set(steps["step"][warmup:].tolist()) if len(steps) > warmup else set()
    after = [e for e in events if int(e.get("step") or 0) in steady and _attempt(e) >= 1]
    # attempts per frame: Dynamo's own compilations (a deferred backward shares the id)
    attempts: dict[str, int] = {}
    for e in events:
        m = _COMPILE_ID.search(str(e.get("compile_id") or ""))
        if m and e.get("trigger") == "dynamo":
            attempts[m.group(1)] = max(attempts.get(m.group(1), 0), int(m.group(2)) + 1)
    limit = record.get("recompile_limit")
    limit_frames = sorted(f for f, n in attempts.items()
                          if isinstance(limit, int) and n >= limit)
    limit_step = None
    if limit_frames:
        last = [int(e.get("step") or 0) for e in events
                if (m := _COMPILE_ID.search(str(e.get("compile_id") or "")))
                and m.group(1) in limit_frames and int(m.group(2)) + 1 >= limit]
        limit_step = max(last) if last else None
    steady_s = float(steps["dur_ns"][warmup:].sum()) / 1e9 if len(steps) > warmup else 0.0
    after_s = sum(float(e.get("dur_s") or 0.0) for e in after)
    kinds: dict[str, int] = {}
    examples: dict[str, str] = {}
    for entry in record.get("reasons") or []:
        # distinct texts with their counts (the capture left out which cache entry failed)
        for reason in entry.get("reasons") or []:
            text = str(reason.get("text") or "")
            kind = reason_kind(text)
            kinds[kind] = kinds.get(kind, 0) + int(reason.get("count") or 1)
            examples.setdefault(kind, text)
    return {
        "count": sum(1 for e in events if e.get("trigger") == "dynamo"),
        "seconds": sum(float(e.get("dur_s") or 0.0) for e in events),
        # recompilations in the steady steps (a frame's first compilation is not one)
        "after_warmup": sum(1 for e in after if e.get("trigger") == "dynamo"),
        "after_warmup_s": after_s,
        # the compilations' seconds after the warm-up, as a share of the steady steps' time
        "after_warmup_share": after_s / steady_s if steady_s > 0 else None,
        "steps_after_warmup": sorted({int(e.get("step") or 0) for e in after}),
        "steps": sorted({int(e.get("step") or 0) for e in events}),
        "frames": len(attempts),
        "recompile_limit": limit,
        "limit_hit": bool(limit_frames),
        # the last compilation of a frame that hit the limit: eager from the next step
        "limit_hit_step": limit_step,
        "reason_kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        "reason_examples": examples,
        # the compiled functions that compiled again (torch's own wrappers left out)
        "functions": [{k: r.get(k) for k in ("function", "file", "line", "count")}
                      for r in (record.get("reasons") or [])[:5]
                      if f"{_SEP}torch{_SEP}" not in str(r.get("file") or "")],
        "dropped": record.get("dropped") or 0,
    }
