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
* ``exposed_share``: ``exposed_ms`` over the run's median steady step time.

Steady samples: DDP samples iterations 1-10 and then every 100th; the first ten include
the first iterations' bucket rebuilding and caches warming, so those after the tenth are
used where there are any, else iterations 3-10 (a run shorter than 100 iterations), which
``samples_from`` says. A DDP iteration is a forward pass, so with gradient accumulation
(``no_sync()``) only one in N of them all-reduces: the medians are then taken over the
iterations that communicated.
"""

from __future__ import annotations

import statistics
from typing import Any

#: DDP samples iterations 1..FIRST_SAMPLED, then every 100th.
FIRST_SAMPLED = 10
#: The first iterations left out when only the first ten were sampled.
SKIP_FIRST = 2


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

    out.update(
        forward_ms=med([s[1] / 1e6 for s in communicated]),
        backward_compute_ms=med([s[2] / 1e6 for s in communicated]),
        comm_ms=med([s[3] / 1e6 for s in communicated]),
        overlap_ms=med([s[4] / 1e6 for s in communicated]),
        exposed_ms=med([max(0, s[3] - s[4]) / 1e6 for s in communicated]),
    )
    out["exposed_share"] = (out["exposed_ms"] / 1e3 / step_median_s
                            if step_median_s else None)
    return out


def summarize_ddp(meta: dict[str, Any], step_median_s: float | None) -> list[dict[str, Any]]:
    """The ``ddp`` section of a run summary: one entry per DDP model that reported."""
    entries = meta.get("ddp")
    if not isinstance(entries, list):
        return []
    return [summarize_model(e, step_median_s) for e in entries if isinstance(e, dict)]


def _flag(value: Any) -> bool | None:
    return None if value is None else bool(value)
