"""Activation checkpointing, summarised: the share of step time its regions' first pass took.

From run.json's ``activation_checkpointing`` (:mod:`trainprof.capture.checkpointing`:
the training thread's outermost ``torch.utils.checkpoint.checkpoint`` calls, timed).
``share`` is their time over the time of all complete steps (warm-up included: the
record keeps run totals, as the hand-over's does; calls in steps recorded under a heavy
tool are left out of both, the capture keeping their time apart as ``profiled_s``),
which is what the backward pass's
recomputation of those regions costs, about: see the capture's docstring.
"""

from __future__ import annotations

from typing import Any


def summarize_checkpointing(rec: dict[str, Any] | None, steps_total_s: float,
                            steps: int) -> dict[str, Any] | None:
    """``activation_checkpointing`` of the summary; None when no call was made."""
    if not rec or not rec.get("calls"):
        return None
    calls, total = int(rec["calls"]), float(rec.get("total_s") or 0.0)
    first, last = rec.get("first_step"), rec.get("last_step")
    # over the steps from the first call to the last (regions checkpointed from the start
    # of a step on; a run that turns it on mid-way is counted from there)
    span = (last - first + 1 if isinstance(first, int) and isinstance(last, int)
            and last >= first else steps)
    return {
        "calls": calls,
        "calls_per_step": calls / span if span else None,
        "total_s": total,
        "share": total / steps_total_s if steps_total_s > 0 else None,
        "use_reentrant": rec.get("use_reentrant") or {},
    }
