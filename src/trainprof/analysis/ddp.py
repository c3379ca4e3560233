"""DistributedDataParallel's gradient communication per step, from DDP's own timing.

Reads ``run.json``'s ``ddp`` (:mod:`trainprof.capture.ddp_stats`: the figures DDP's reducer
measures on its sampled iterations) and states, per DDP model, the medians over the
*steady* samples of:

* ``forward_ms``: DDP's forward compute (its forward start to the backward's start);
* ``backward_compute_ms``: the backward pass's compute, to the last gradient ready;
* ``comm_ms``: the gradient all-reduce, from the first bucket's launch to the last one's
  completion (``backward_comm_time``);
* ``overlap_ms``: the part of it that ran while the backward still computed
  (``backward_compute_comm_overlap_time``: from the first launch to the compute's end);
* ``exposed_ms``: ``comm_ms - overlap_ms`` per sample, the communication the step waits
  for after its backward compute is done - what the PyTorch-profiler TensorBoard plugin
  calls the step's Communication (the part not hidden behind kernels), measured here by DDP
  instead of a trace, on every rank, with no profiler on;
* ``exposed_share``: the share of a step the step waits for it: per sample,
  ``exposed`` over the longer of the run's median steady step and the sample's own
  *span* (``forward + backward_compute + exposed``: DDP's forward start to the
  all-reduce's end, a lower bound on that iteration's step), then the median over the
  usable samples (below). Never above 1.

Steady samples: DDP samples iterations 1-10 and then every 100th; the first ten include
the first iterations' bucket rebuilding and caches warming, so those after the tenth are
used where there are any, else iterations 3-10 (a run shorter than 100 iterations), which
``samples_from`` says. A DDP iteration is a forward pass, so with gradient accumulation
(``no_sync()``) only one in N of them all-reduces: the medians are then taken over the
iterations that communicated.

Usable samples: DDP's figures come from single iterations of its choosing, and the
median step from the run's steady steps; an iteration that was not a steady one says
nothing about them. Measured: a 60-iteration run of two gloo ranks on CPU had only
iteration 10 (the flush thread reads DDP once a second, and only the first ten were
sampled): the run's 10th step, among its slow first steps (3-12 ms against a 1.1 ms
median) and inside trainprof's op-count window on both ranks (steps 8-10, left out of
the step statistics), each rank's all-reduce waiting for the other's. It read "1.9 ms
exposed (167% of step)"; "397%" on another run. So a sample whose span is over
:data:`MAX_SPAN_RATIO` times the median
step is not used; where none is left, the figures of the samples there are stay (what
DDP measured) but ``exposed_share`` is None and ``share_withheld`` says why.
"""

from __future__ import annotations

import statistics
from typing import Any

#: DDP samples iterations 1..FIRST_SAMPLED, then every 100th.
FIRST_SAMPLED = 10
#: The first iterations left out when only the first ten were sampled.
SKIP_FIRST = 2
#: A sampled iteration whose own span (forward start to the all-reduce's end) exceeds the
#: median steady step by this factor was no steady iteration (warm-up, a profiled or
#: descheduled step): its figures are not set against the median step.
MAX_SPAN_RATIO = 1.5


def _span_ns(s: list[int]) -> int:
    """DDP's forward start to its all-reduce's end in one sampled iteration: forward,
    backward compute, and the all-reduce not hidden behind it."""
    return s[1] + s[2] + max(0, s[3] - s[4])


def _buckets(settings: dict[str, Any]) -> list[int]:
    text = settings.get("rebuilt_bucket_sizes") or settings.get("bucket_sizes") or ""
    try:
        return [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        return []


def summarize_model(entry: dict[str, Any], step_median_s: float | None) -> dict[str, Any]:
    """One DDP model's settings and its communication per step (see the module docstring)."""
    settings = dict(entry.get("settings") or {})
    samples = [s for s in entry.get("samples") or []
               if isinstance(s, list) and len(s) >= 5 and all(isinstance(x, int) for x in s)]
    later = [s for s in samples if s[0] > FIRST_SAMPLED]
    used, source = (later, "steady") if later else (
        [s for s in samples if s[0] > SKIP_FIRST], "first_iterations")
    communicated = [s for s in used if s[3] > 0]  # no_sync() iterations: no all-reduce
    step_ns = step_median_s * 1e9 if step_median_s else None
    usable = ([s for s in communicated if _span_ns(s) <= MAX_SPAN_RATIO * step_ns]
              if step_ns else [])
    buckets = _buckets(settings)
    out: dict[str, Any] = {
        "module": settings.get("module_name"),
        "backend": settings.get("backend_name"),
        "world_size": settings.get("world_size"),
        "buckets": len(buckets) or None,
        "bucket_bytes": buckets,
        "bucket_cap_bytes": settings.get("bucket_cap_bytes"),
        "gradient_bytes": settings.get("total_parameter_size_bytes"),
        "find_unused_parameters": _flag(settings.get("find_unused_parameters")),
        "unused_parameter_bytes": settings.get("unused_parameter_size"),
        "gradient_as_bucket_view": _flag(settings.get("gradient_as_bucket_view")),
        "static_graph": _flag(settings.get("static_graph")),
        "comm_hook": settings.get("comm_hook"),
        "dtypes": settings.get("dtypes"),
        "samples": len(communicated),
        "iterations": [s[0] for s in communicated],
        "samples_from": source,
    }
    if not communicated:
        return out

    def med(values: list[float]) -> float:
        return float(statistics.median(values))

    # the figures and the share of the same samples: the usable ones where there are any
    shown = usable or communicated
    out.update(
        forward_ms=med([s[1] / 1e6 for s in shown]),
        backward_compute_ms=med([s[2] / 1e6 for s in shown]),
        comm_ms=med([s[3] / 1e6 for s in shown]),
        overlap_ms=med([s[4] / 1e6 for s in shown]),
        exposed_ms=med([max(0, s[3] - s[4]) / 1e6 for s in shown]),
        usable_samples=len(usable),  # of ``samples``, the iterations that communicated
        iterations=[s[0] for s in shown],
    )
    if usable and step_ns:
        out["exposed_share"] = med([max(0, s[3] - s[4]) / max(step_ns, _span_ns(s))
                                    for s in usable])
        return out
    out["exposed_share"] = None
    if step_ns:
        ran = ", ".join(f"iteration {s[0]} {_span_ns(s) / 1e6:.1f} ms"
                        for s in communicated[:3])
        out["share_withheld"] = (
            f"DDP timed {ran} from its forward to the all-reduce's end, over "
            f"{MAX_SPAN_RATIO:g}x the median steady step ({step_median_s * 1e3:.1f} ms): "
            "no steady iteration, so no share of the step is given")
    return out


#: DDP's own timings needed, where none is past its warm-up iterations, to judge its
#: all-reduce (diagnosis/ddp.py; the summary's DDP row says when there are fewer).
MIN_WARMUP_SAMPLES = 3


def judgeable(model: dict[str, Any]) -> bool:
    """Do DDP's sampled iterations of ``model`` tell its all-reduce's cost: some past its
    first ten iterations (bucket rebuilding, caches warming), or three at least? A 30-step
    run's single sample of iteration 10 once put 39% of the step on the all-reduce."""
    return (model.get("samples_from") == "steady"
            or int(model.get("usable_samples", model.get("samples")) or 0) >= MIN_WARMUP_SAMPLES)


def summarize_ddp(meta: dict[str, Any], step_median_s: float | None) -> list[dict[str, Any]]:
    """The ``ddp`` section of a run summary: one entry per DDP model that reported."""
    entries = meta.get("ddp")
    if not isinstance(entries, list):
        return []
    return [summarize_model(e, step_median_s) for e in entries if isinstance(e, dict)]


def _flag(value: Any) -> bool | None:
    return None if value is None else bool(value)
