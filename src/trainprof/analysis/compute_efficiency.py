"""How close the step's arithmetic runs to the machine's peak: a FLOPs utilization.

Definition: the time the step's FLOPs would take at the peak rate of the dtype each ran
in, over the time the step took. With one dtype that is achieved FLOP/s over peak FLOP/s,
PaLM's model FLOPs utilization (Chowdhery et al. 2022, appendix B), which Lightning's
``ThroughputMonitor`` and Composer's speed monitor report; with several (autocast's
bfloat16 products beside float32 ones) each kind's FLOPs are divided by its own peak.

The FLOPs are those torch's FLOP formulas give the op count's window of steps, forward and
backward (:mod:`trainprof.capture.flop_count`: matrix products, convolutions, attention;
recomputed forwards included). The peaks are measured on the run's machine with its
threads (:mod:`trainprof.capture.peak_flops`): an attainable peak, not a datasheet's, so
100% means "as fast as torch.mm runs here". Two figures: over the whole step, and over the
model's phases (forward + backward): a step at 5% whose model phases are at 60% waits on
something else (data, the optimizer, Python); one whose model phases are at 5% computes in
pieces too small for the hardware (a small batch, many small ops).

On a GPU that :mod:`trainprof.analysis.datasheet_peaks` lists, a third figure divides by
the datasheet's dense peaks instead (``datasheet_utilization``): the MFU as people
publish it.

A ``torch.compile``-d model is counted at the ops its compiled code calls (``compiled``:
true): cuBLAS/oneDNN products and convolutions, attention kernels. Products that
torch.compile writes as kernels of its own (max-autotune's Triton templates) and kernels
replayed as CUDA graphs (``mode="reduce-overhead"``) call no op and are not counted.

The section is None when the window saw no products (no model, a model replayed as CUDA
graphs); a utilization is None when the kinds with a known peak carry less than
:data:`MIN_COVERED` of the FLOPs.
"""

from __future__ import annotations

from typing import Any

from trainprof.analysis.datasheet_peaks import datasheet_peak

#: The least share of the FLOPs whose peak is known for a utilization to be given.
MIN_COVERED = 0.9


def compute_efficiency(ops: dict[str, Any] | None, peaks: dict[str, Any] | None,
                       step_s: float | None, breakdown: dict[str, float] | None,
                       gpu_name: str | None = None,
                       gpu_multiprocessors: int | None = None) -> dict[str, Any] | None:
    """The summary's ``compute`` section (see the module's docs). ``step_s``: the mean
    steady step (1 / steps per second, as throughput is counted: a step's time is what its
    FLOPs share, and a few slow steps count with their length); on a GPU in
    :mod:`~trainprof.analysis.datasheet_peaks`' table, also the utilization against its
    datasheet (``datasheet_utilization``: the MFU people publish)."""
    by_kind = (ops or {}).get("flops_by_kind_per_step")
    if not isinstance(by_kind, dict) or not step_s or step_s <= 0:
        return None
    total = sum(float(v) for v in by_kind.values())
    if total <= 0:
        return None
    peaks = peaks if isinstance(peaks, dict) else {}
    kinds = []
    for kind, flops in sorted(by_kind.items(), key=lambda kv: -float(kv[1])):
        flops = float(flops)
        peak = peaks.get(kind) if isinstance(peaks.get(kind), dict) else {}
        rate = peak.get("flops_per_s")
        entry: dict[str, Any] = {"kind": kind, "flops_per_step": flops,
                                 "share": flops / total, "peak_flops_per_s": None}
        if isinstance(rate, int | float) and rate > 0:
            entry.update(peak_flops_per_s=float(rate), peak_source=peak.get("source"),
                         ideal_s=flops / float(rate))
        elif peak.get("error"):
            entry["peak_error"] = peak["error"]
        sheet = datasheet_peak(gpu_name, kind, gpu_multiprocessors)
        if sheet is not None:
            entry.update(datasheet_gpu=sheet[0], datasheet_flops_per_s=sheet[1])
        kinds.append(entry)
    ideal, covered = _time_at(kinds, "peak_flops_per_s", total)
    sheet_ideal, _ = _time_at(kinds, "datasheet_flops_per_s", total)
    model = sum(float((breakdown or {}).get(p) or 0.0) for p in ("forward", "backward"))
    return {
        "flops_per_step": total,
        "flops_per_s": total / step_s,
        "kinds": kinds,
        "steps_sampled": (ops or {}).get("steps_sampled"),
        # counted at the ops a torch.compile-d model's code calls (see the module's docs)
        "compiled": bool((ops or {}).get("compiled")),
        "peak_covered_share": covered,
        "ideal_step_s": ideal,
        "utilization": None if ideal is None else ideal / step_s,
        "model_utilization": (ideal / (step_s * model)
                              if ideal is not None and model > 0 else None),
        "datasheet_utilization": None if sheet_ideal is None else sheet_ideal / step_s,
    }


def _time_at(kinds: list[dict[str, Any]], rate_key: str,
             total: float) -> tuple[float | None, float]:
    """(the step's FLOPs' time at each kind's ``rate_key`` rate, the share of the FLOPs
    that has one): the few FLOPs of kinds without a rate at the others' average rate; no
    time when those with one carry less than :data:`MIN_COVERED`."""
    timed = [k for k in kinds if k.get(rate_key)]
    covered = sum(k["flops_per_step"] for k in timed) / total
    if covered < MIN_COVERED:
        return None, covered
    return sum(k["flops_per_step"] / k[rate_key] for k in timed) / covered, covered
