"""The hand-over of workers' batches, summarised: what receiving each tensor cost.

From run.json's ``batch_handoff`` (:mod:`trainprof.capture.handoff`: every
shared-memory storage the training process rebuilt, timed) and the workers' own
batch counts (:mod:`trainprof.analysis.workers`). Percentiles come from the same
log-linear histograms as the workers' (:func:`trainprof.analysis.workers.hist_quantile`).

``training_thread_share`` is the training thread's receiving time over the time of
all complete steps (warm-up included: the record keeps run totals, not per-step
ones), so it is the share of step time the loop itself spent receiving tensors.

``loaders``: the same, per loader whose batches the tensors came in (the record's
``loaders``, where the capture found the receiving iterator): a loader iterated inside
the loop besides the training one (an evaluation pass every N steps) has a hand-over of
its own, which pooled passed for the training loader's.
"""

from __future__ import annotations

from typing import Any

from trainprof.analysis.workers import hist_quantile
from trainprof.schema import MAX_DESCRIBED


def summarize_handoff(rec: dict[str, Any] | None, workers: dict[str, Any] | None,
                      steps_total_s: float,
                      batch_tensors: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """``batch_handoff`` of the summary; None when no worker's batch was received.

    ``tensors_per_batch``: the tensors of the workers' loaders' first batch as the
    training process received it (``batch_tensors``, :func:`trainprof.analysis.padding.
    batch_tensors`), where they all have the same count. Dividing the tensors received by
    the batches the workers made is only an estimate (``tensors_per_batch_estimated``):
    the workers make batches ahead (``prefetch_factor`` each) that a loop which stops
    never receives, 2 tensors a batch came out as 1.9 (120 tensors, 64 batches made for
    60 steps)."""
    if not rec or not rec.get("tensors"):
        return None
    out = _summarize(rec, workers, steps_total_s, batch_tensors, None)
    out["loaders"] = [
        {"loader_index": int(e["loader_index"]),
         **_summarize({**e, "strategies": rec.get("strategies")}, workers, steps_total_s,
                      batch_tensors, int(e["loader_index"]))}
        for e in rec.get("loaders") or []
        if isinstance(e, dict) and e.get("tensors") and e.get("loader_index") is not None
    ]
    return out


def handoff_of_loader(handoff: dict[str, Any] | None,
                      index: int | None) -> dict[str, Any] | None:
    """The hand-over of loader ``index``'s batches: its own entry where the record has one,
    else the pooled one when no other loader's batches were counted (records made before
    the capture kept them per loader, or a single loader); None otherwise."""
    if not handoff:
        return None
    entries = handoff.get("loaders") or []
    own = next((e for e in entries if e.get("loader_index") == index), None)
    if own is not None:
        return {**own, "strategies": handoff.get("strategies") or []}
    if entries:  # other loaders' batches were counted, none of this one's
        return None
    return handoff


def _summarize(rec: dict[str, Any], workers: dict[str, Any] | None, steps_total_s: float,
               batch_tensors: list[dict[str, Any]] | None,
               index: int | None) -> dict[str, Any]:
    """One hand-over record (the run's, or one loader's when ``index`` is given)."""
    n = int(rec["tensors"])
    hist = {int(i): int(c) for i, c in rec.get("hist") or []}
    thread = rec.get("training_thread") or {}
    thread_s = float(thread.get("total_s") or 0.0)
    batches = sum(int(ld.get("batches") or 0) for ld in (workers or {}).get("loaders") or []
                  if ld.get("mode") == "workers"
                  and (index is None or ld.get("loader_index") == index))
    median, p90 = hist_quantile(hist, 0.5), hist_quantile(hist, 0.9)
    per_batch = _tensors_in_a_batch(workers, batch_tensors, index)
    return {
        "strategies": rec.get("strategies") or [],
        "tensors": n,
        "total_s": float(rec.get("total_s") or 0.0),
        "mean_ms": float(rec.get("total_s") or 0.0) / n * 1e3,
        "median_ms": median / 1e6 if median is not None else None,
        "p90_ms": p90 / 1e6 if p90 is not None else None,
        # batches the workers made: each batch's tensors are received one by one
        "tensors_per_batch": per_batch if per_batch else (n / batches if batches else None),
        "tensors_per_batch_estimated": not per_batch and bool(batches),
        "training_thread_s": thread_s,
        "training_thread_share": thread_s / steps_total_s if steps_total_s > 0 else None,
    }


def _tensors_in_a_batch(workers: dict[str, Any] | None,
                        batch_tensors: list[dict[str, Any]] | None,
                        index: int | None = None) -> int | None:
    """The tensors of a batch of the workers' loaders (loader ``index``'s only, when given),
    counted in their first batch; None unless every such loader's was described, whole,
    with the same count."""
    indices = {ld.get("loader_index") for ld in (workers or {}).get("loaders") or []
               if ld.get("mode") == "workers" and ld.get("batches")
               and (index is None or ld.get("loader_index") == index)}
    described = {e.get("loader_index"): e.get("tensors") for e in batch_tensors or []
                 if isinstance(e, dict)}
    counts = set()
    for index in indices:
        tensors = described.get(index)
        if not isinstance(tensors, list) or len(tensors) >= MAX_DESCRIBED:
            return None
        counts.add(sum(1 for t in tensors if not t.get("array")))
    return counts.pop() if len(counts) == 1 and min(counts) > 0 else None
