"""A DataLoader iterated in a thread of its own: the training thread's data wait is hidden.

A common way to "prefetch" (prefetch_generator's ``BackgroundGenerator``, hand-written
loader threads) iterates the DataLoader in a background thread that puts batches in a
queue; the training loop takes them from the queue. trainprof times the DataLoader's
``__next__`` in the training thread only (its clock measures that thread), so the
training thread's wait for the queue is not data wait but "other", and
:mod:`.input_pipeline` (which reads the data-wait share) stays silent however starved
the loop is. Capture names the thread that iterated each loader
(``iterated_in_thread``, :meth:`trainprof.capture.hooks.LoaderRegistry.note_threads`).

The rule: the training loader (:attr:`Context.train_loader`) iterated outside the
training thread, and "other" at least
:data:`MEDIUM` of step time. With ``num_workers=0`` the fetch timing
(:mod:`trainprof.analysis.workers`) measured what one batch costs in that thread
(``batch_size`` samples, each blocked plus CPU, and the collate): that cost against the
step time bounds the gain, as the loop cannot run faster than the thread delivers. With
workers, or unmeasured, the bound is the "other" share alone and the finding says so.

Severity bands are :mod:`.input_pipeline`'s (TF's input-pipeline analyzer: 20% / 5%):
the thread's loading is an input wait by another name. The fix is the standard one
(PyTorch's tuning guide, data-loading.md): worker processes load several batches in
parallel, outside the GIL, and the DataLoader prefetches them itself
(``prefetch_factor``), so the thread is not needed.
"""

from __future__ import annotations

from typing import Any

from trainprof.diagnosis.context import Context
from trainprof.diagnosis.finding import Finding, Fix, band, sweep
from trainprof.diagnosis.input_pipeline import (
    HIGH,
    MEDIUM,
    batch_cost_s,
    loader_snippet,
    suggest_workers,
)
from trainprof.diagnosis.registry import rule


@rule("input_pipeline.loader_in_thread")
def loader_in_thread(ctx: Context) -> Finding | None:
    other = float(ctx.breakdown.get("other") or 0.0)
    step_s = ctx.step_info.get("median_s")
    if other < MEDIUM or not isinstance(step_s, int | float) or step_s <= 0:
        return None
    # the loader that feeds training (not, say, an evaluation loader some thread iterates)
    loader = ctx.train_loader
    if loader is None or not loader.get("iterated_in_thread"):
        return None
    thread = str(loader["iterated_in_thread"])
    nw = int(loader.get("num_workers") or 0)
    w = ctx.worker_stats(loader)
    batch_s = batch_cost_s(loader, w) if nw == 0 else None
    split = (w or {}).get("fetch_split") or {}
    # loading mostly blocked (reads, latency): workers overlap it beyond the core count
    blocked = float(split.get("blocked") or 0.0) >= 0.5
    gain = other if batch_s is None else min(other, batch_s / step_s)
    severity = band(gain, HIGH, MEDIUM)
    if severity is None:
        return None
    evidence: dict[str, Any] = {
        "iterated_in_thread": thread,
        "other_share": other,
        "data_wait_share": float(ctx.breakdown.get("data_wait") or 0.0),
        "step_median_s": step_s,
        "loader": {k: loader.get(k) for k in ("index", "dataset", "len", "batch_size",
                                              "num_workers", "prefetch_factor")},
    }
    if batch_s is not None:
        evidence["batch_load_s"] = batch_s
    pct = f"{other * 100:.0f}%"
    title = (f"The DataLoader is iterated in thread {thread!r}: the training loop's wait "
             f"for its batches is hidden in \"other\" ({pct} of step time)")
    text = (
        f"The DataLoader is iterated in a thread of its own ({thread!r}), which hands the "
        "batches to the training loop (a queue, a prefetching generator). trainprof times "
        "data waits in the training thread, so the loop's wait for that thread shows as "
        f"\"other\": {pct} of step time."
    )
    if batch_s is not None:
        text += (
            f" Loading one batch takes {batch_s * 1e3:.1f} ms in that thread (measured) "
            f"against a step of {step_s * 1e3:.1f} ms: "
            + ("the loop waits for it." if batch_s >= 0.5 * step_s else
               "it keeps up with the loop only in part.")
        )
    cores = ctx.cores
    suggested = suggest_workers(nw, cores, int(ctx.environment.get("gpu_count") or 0),
                                blocked=blocked, on_cuda=ctx.on_cuda)
    if nw == 0:
        text += (
            " One thread loads one batch at a time and shares the GIL with training; "
            f"DataLoader worker processes load {suggested} batches in parallel, outside the "
            "GIL, and the DataLoader prefetches them itself (prefetch_factor), so the thread "
            "is not needed: iterate the loader in the training loop, with workers."
        )
        comment = "was 0; iterate it in the training loop, without the thread"
    else:
        text += (
            f" Its {nw} workers already prefetch (prefetch_factor batches each): the thread "
            "adds a hand-off, not parallelism. Iterate the loader in the training loop, "
            "so the data wait is measured, and tune num_workers from there."
        )
        comment = f"was {nw}; iterate it in the training loop, without the thread"
    snippet = loader_snippet(loader, num_workers=suggested, pin_memory=bool(
        loader.get("pin_memory")), comment=comment)
    snippet += "\nfor x, y in loader:  # not through the background thread's queue\n    ..."
    knob = ",".join(map(str, sweep(nw, suggested)))
    return Finding(
        category="input_pipeline",
        cause="loader_in_thread",
        title=title,
        severity=severity,
        evidence=evidence,
        estimated_gain=gain,
        fix=Fix(text=text, snippet=snippet),
        verify=f"trainprof tune --knob num_workers={knob} {ctx.script}",
        verify_commands=(f"trainprof tune --knob num_workers={knob} {ctx.script}",),
    )
