"""Time series of a Run, ready to plot: per-step phases, system samples, training telemetry.

The HTML report draws these; it computes nothing itself (DESIGN.md: "report never computes a
metric"), so everything that turns raw records into plotted numbers lives here, pure and tested.

**Downsampling.** A chart cannot show more points than it has pixels, and a report must stay small
(≤ 5 MB) for a million-step run. When a series has more than ``max_points`` points, consecutive
points are grouped into equal buckets of ``k = ceil(n / max_points)`` and each bucket keeps its
**mean** (what the stacked bars show: phase shares of the bucket stay exact, since the mean of
sums is the sum of means) and its **min/max envelope** (``lo``/``hi``), so a single slow step or a
periodic spike inside a bucket stays visible as the envelope's peak instead of being averaged away
(the M4/min-max idea of time-series visualisation). ``bucket`` says how many points each bucket
holds (1 = every point, nothing downsampled); buckets are contiguous, the last may be shorter.

**Units.** Times are seconds since the run's clock origin (``run.json`` ``clock_origin_s``: the
``perf_counter`` value at the start of capture), the clock both the step records and the system
samples use, so steps and samples align exactly. CPU is given in *cores busy* (100% of one core =
1.0): process, DataLoader-worker and whole-system CPU are then on one axis, and the machine's
usable cores are the ceiling. The terminal's "system 76%" (mean over cores) is ``sys_cores /
n_cores``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from trainprof.analysis.memory_growth import workers_private_bytes
from trainprof.analysis.steps import (
    BREAKDOWN_KEYS,
    PHASE_COLUMNS,
    complete_steps,
    detect_warmup,
)
from trainprof.analysis.system import load_samples
from trainprof.schema import FLAG_PARTIAL, FLAG_PROFILED
from trainprof.store import Run

__all__ = ["bucket_reduce", "sample_series", "step_series", "telemetry_series"]

#: Default cap on points per chart (see module docstring).
MAX_POINTS = 5000

#: Step-record columns (ns) that make up each plotted phase; same grouping as
#: :func:`trainprof.analysis.steps.step_statistics` ("breakdown").
_PHASE_COLUMNS = PHASE_COLUMNS
assert tuple(_PHASE_COLUMNS) == BREAKDOWN_KEYS


def _bucket_size(n: int, max_points: int) -> int:
    return max(1, math.ceil(n / max(1, max_points)))


def _to_list(values: np.ndarray, digits: int) -> list[float | None]:
    """Rounded floats for JSON; NaN (no data) becomes ``None``."""
    values = np.asarray(values, dtype=np.float64)
    out = np.round(values, digits).tolist()
    missing = np.flatnonzero(~np.isfinite(values))
    for i in missing.tolist():
        out[i] = None
    return out


def bucket_reduce(values: np.ndarray, k: int) -> dict[str, np.ndarray]:
    """Mean, min and max of consecutive buckets of ``k`` values, ignoring NaN.

    A bucket that is all NaN gives NaN in each output (a gap in the plotted line).
    """
    values = np.asarray(values, dtype=np.float64)
    n = len(values)
    if k <= 1 or n == 0:
        return {"mean": values, "min": values, "max": values}
    nb = math.ceil(n / k)
    padded = np.full(nb * k, np.nan)
    padded[:n] = values
    grid = padded.reshape(nb, k)
    valid = ~np.isnan(grid)
    count = valid.sum(axis=1)
    total = np.where(valid, grid, 0.0).sum(axis=1)
    has = count > 0
    mean = np.full(nb, np.nan)
    mean[has] = total[has] / count[has]
    lo = np.where(valid, grid, np.inf).min(axis=1)
    hi = np.where(valid, grid, -np.inf).max(axis=1)
    lo[~has] = np.nan
    hi[~has] = np.nan
    return {"mean": mean, "min": lo, "max": hi}


def step_series(run: Run, max_points: int = MAX_POINTS) -> dict[str, Any]:
    """Per-step duration and phase times (seconds), bucketed beyond ``max_points`` steps.

    Steps are the analysed ones (:func:`~trainprof.analysis.steps.complete_steps`: the cut-off
    last step dropped, a manual run's automatic prefix merged); ``warmup`` is the same count the
    summary reports (:func:`~trainprof.analysis.steps.detect_warmup`), and the steady state
    starts at step number ``steady_step``, time ``steady_t``. Per bucket: ``step``/``step_last``
    (first and last step number), ``t0``/``t1`` (start of its first and end of its last step),
    ``dur`` (mean step time) with ``dur_lo``/``dur_hi`` (fastest/slowest step), and ``phases``
    (mean time per phase; they stack to ``dur``). ``profiled`` lists the windows of steps left
    out of the analysis because a heavy tool ran during them (``first``, ``last`` step number,
    ``t0``, ``t1``): a chart shows them as gaps, marked.
    """
    done = complete_steps(run.steps)
    n = len(done)
    out: dict[str, Any] = {
        "count": n,
        "bucket": 1,
        "warmup": 0,
        "steady_step": None,
        "steady_t": None,
        "profiled": _profiled_windows(run.steps),
        "step": [],
        "step_last": [],
        "t0": [],
        "t1": [],
        "dur": [],
        "dur_lo": [],
        "dur_hi": [],
        "phases": {key: [] for key in BREAKDOWN_KEYS},
    }
    if n == 0:
        return out
    dur = done["dur_ns"].astype(np.float64) / 1e9
    start = done["t_start_ns"].astype(np.float64) / 1e9
    end = start + dur
    k = _bucket_size(n, max_points)
    idx = np.arange(0, n, k)
    last = np.minimum(idx + k, n) - 1
    d = bucket_reduce(dur, k)
    warm = detect_warmup(dur)
    out.update(
        bucket=k,
        warmup=warm,
        steady_step=int(done["step"][warm]) if warm < n else None,
        steady_t=round(float(start[warm]), 6) if warm < n else None,
        step=done["step"][idx].astype(int).tolist(),
        step_last=done["step"][last].astype(int).tolist(),
        t0=_to_list(start[idx], 6),
        t1=_to_list(end[last], 6),
        dur=_to_list(d["mean"], 7),
        dur_lo=_to_list(d["min"], 7),
        dur_hi=_to_list(d["max"], 7),
    )
    for key, columns in _PHASE_COLUMNS.items():
        phase = sum(done[c].astype(np.float64) for c in columns) / 1e9
        out["phases"][key] = _to_list(bucket_reduce(phase, k)["mean"], 7)
    return out


_NUMBER_TYPES = (int, float)


def _profiled_windows(steps: np.ndarray, limit: int = 200) -> list[dict[str, Any]]:
    """Runs of consecutive complete steps flagged FLAG_PROFILED (at most ``limit``)."""
    if len(steps) == 0:
        return []
    flags = steps["flags"]
    prof = steps[((flags & FLAG_PROFILED) != 0) & ((flags & FLAG_PARTIAL) == 0)]
    if len(prof) == 0:
        return []
    numbers = prof["step"].astype(np.int64)
    breaks = np.flatnonzero(np.diff(numbers) != 1)
    firsts = np.concatenate([[0], breaks + 1])[:limit]
    lasts = np.concatenate([breaks, [len(prof) - 1]])[:limit]
    return [
        {
            "first": int(numbers[a]),
            "last": int(numbers[b]),
            "t0": round(float(prof["t_start_ns"][a]) / 1e9, 6),
            "t1": round(float(prof["t_start_ns"][b] + prof["dur_ns"][b]) / 1e9, 6),
        }
        for a, b in zip(firsts.tolist(), lasts.tolist(), strict=True)
    ]


def _num(value: Any) -> float:
    """A number as float; anything else (None, bool, text) is NaN: a gap, not a zero."""
    return float(value) if type(value) in _NUMBER_TYPES else math.nan


def _cores(value: Any) -> float:
    """A CPU percentage (100 = one core) in cores; NaN when not a number."""
    return float(value) / 100.0 if type(value) in _NUMBER_TYPES else math.nan


#: Series of :func:`sample_series`: name -> unit. Units: "cores", "%", "B/s", "B", "/s".
SAMPLE_UNITS: dict[str, str] = {
    "proc_cores": "cores",
    "workers_cores": "cores",
    "children_cores": "cores",
    "sys_cores": "cores",
    "iowait_pct": "%",
    "disk_read_bps": "B/s",
    "rss_bytes": "B",
    "workers_rss_bytes": "B",
    "ctx_switches_ps": "/s",
}
#: The workers' memory as the memory chart shows it (memory_growth.workers_private_bytes).
WORKERS_PRIVATE = "workers_private_bytes"


def _sample_row(s: dict[str, Any]) -> tuple[float, ...]:
    """One sample's values, in :data:`SAMPLE_UNITS` order (one pass: long runs have 10^5+)."""
    workers = s.get("workers")
    if isinstance(workers, dict):
        w = sum(v for v in workers.values() if isinstance(v, int | float)) / 100.0
    else:
        w = math.nan
    cores = s.get("sys_cpu_pct")
    if isinstance(cores, list) and cores:
        sys_cores = sum(c for c in cores if isinstance(c, int | float)) / 100.0
    else:
        sys_cores = math.nan
    return (
        _cores(s.get("proc_cpu_pct")),
        w,
        _cores(s.get("children_cpu_pct")),
        sys_cores,
        _num(s.get("iowait_pct")),
        _num(s.get("disk_read_bps")),
        _num(s.get("rss_bytes")),
        _num(s.get("workers_rss_bytes")),
        _num(s.get("ctx_switches_ps")),
    )


def sample_series(
    run: Run, max_points: int = MAX_POINTS, samples: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """System samples as plottable series on the step clock (see the module docstring).

    ``series`` maps a name to ``{"unit", "y"}`` plus ``lo``/``hi`` envelopes when bucketed;
    a field with no value in any sample is left out, so a chart is drawn only for what was
    measured. GPU fields are ``gpu{index}_util_pct`` and ``gpu{index}_mem_bytes``
    (``gpu_mem_total`` gives each device's memory size). ``n_cores`` is the usable cores of
    the fingerprint.
    """
    if samples is None:
        samples = load_samples(run.samples_path)
    fp = run.meta.get("fingerprint") or {}
    cpu = fp.get("cpu") if isinstance(fp, dict) else None
    n_cores = cpu.get("usable_cores") if isinstance(cpu, dict) else None
    out: dict[str, Any] = {
        "count": len(samples),
        "bucket": 1,
        "n_cores": n_cores,
        "t": [],
        "series": {},
        "gpu_mem_total": {},
    }
    if not samples:
        return out
    samples = sorted(samples, key=lambda s: s["t"])
    origin = run.meta.get("clock_origin_s")
    if not isinstance(origin, int | float):
        origin = float(samples[0]["t"])
    k = _bucket_size(len(samples), max_points)
    out["bucket"] = k
    t = np.array([float(s["t"]) for s in samples]) - origin
    out["t"] = _to_list(bucket_reduce(t, k)["mean"], 4)
    columns: dict[str, tuple[str, np.ndarray]] = {}
    table = np.array([_sample_row(s) for s in samples], dtype=np.float64)
    for j, (name, unit) in enumerate(SAMPLE_UNITS.items()):
        columns[name] = (unit, table[:, j])
    columns[WORKERS_PRIVATE] = ("B", np.array([math.nan if v is None else float(v)
                                               for v in workers_private_bytes(samples)]))
    gpus: dict[int, dict[str, np.ndarray]] = {}
    for row, s in enumerate(samples):
        for dev in s.get("gpu") or []:
            if not isinstance(dev, dict) or not isinstance(dev.get("index"), int):
                continue
            cols = gpus.get(dev["index"])
            if cols is None:
                cols = gpus[dev["index"]] = {
                    key: np.full(len(samples), np.nan)
                    for key in ("util_pct", "mem_used_bytes", "mem_total_bytes")
                }
            for key, col in cols.items():
                col[row] = _num(dev.get(key))
    for i, cols in sorted(gpus.items()):
        columns[f"gpu{i}_util_pct"] = ("%", cols["util_pct"])
        columns[f"gpu{i}_mem_bytes"] = ("B", cols["mem_used_bytes"])
        if not np.isnan(cols["mem_total_bytes"]).all():
            out["gpu_mem_total"][str(i)] = float(np.nanmax(cols["mem_total_bytes"]))
    for name, (unit, values) in columns.items():
        if np.isnan(values).all():
            continue
        digits = 3 if unit == "cores" else 1
        r = bucket_reduce(values, k)
        entry: dict[str, Any] = {"unit": unit, "y": _to_list(r["mean"], digits)}
        if k > 1:
            entry["lo"] = _to_list(r["min"], digits)
            entry["hi"] = _to_list(r["max"], digits)
        out["series"][name] = entry
    return out


def _xy_from(value: Any) -> tuple[list[Any], list[Any]] | None:
    """(x, y) of one telemetry series in any of the shapes :func:`telemetry_series` accepts."""
    if isinstance(value, dict):
        x = next((value[k] for k in ("step", "steps", "x", "t") if k in value), None)
        y = next((value[k] for k in ("value", "values", "y") if k in value), None)
        if isinstance(y, list):
            return (x if isinstance(x, list) and len(x) == len(y) else list(range(len(y))), y)
        return None
    if isinstance(value, list) and value:
        if all(isinstance(v, list | tuple) and len(v) >= 2 for v in value):
            return [v[0] for v in value], [v[1] for v in value]
        return list(range(len(value))), value
    return None


def telemetry_series(telemetry: Any, max_points: int = MAX_POINTS) -> list[dict[str, Any]]:
    """Training telemetry (loss, learning rate, ...) as ``[{"name", "x", "y", "bucket"}]``.

    The producer of the ``telemetry`` summary key is free in its shape; accepted are a mapping
    ``name -> [y, ...]``, ``name -> [[x, y], ...]``, ``name -> {"step": [...], "value": [...]}``,
    and a list of records ``[{"step": 1, "loss": 2.3, "lr": 0.1}, ...]`` (every numeric key other
    than the step becomes a series). Non-numeric values become gaps; series are bucketed like
    the others (mean per bucket, x of the bucket's first point, ``lo``/``hi`` envelopes).
    """
    pairs: list[tuple[str, tuple[list[Any], list[Any]]]] = []
    if isinstance(telemetry, dict):
        for name, value in telemetry.items():
            xy = _xy_from(value)
            if xy is not None:
                pairs.append((str(name), xy))
    elif isinstance(telemetry, list) and telemetry and all(isinstance(r, dict) for r in telemetry):
        xkey = next((k for k in ("step", "x", "t") if k in telemetry[0]), None)
        names: list[str] = []
        for rec in telemetry:
            for key, v in rec.items():
                if key != xkey and isinstance(v, int | float) and key not in names:
                    names.append(key)
        xs = [rec.get(xkey, i) if xkey else i for i, rec in enumerate(telemetry)]
        for name in names:
            pairs.append((str(name), (xs, [rec.get(name) for rec in telemetry])))
    out: list[dict[str, Any]] = []
    for name, (xs, ys) in pairs:
        y = np.array([_num(v) for v in ys], dtype=np.float64)
        x = np.array([_num(v) for v in xs], dtype=np.float64)
        if len(y) == 0 or np.isnan(y).all():
            continue
        k = _bucket_size(len(y), max_points)
        r = bucket_reduce(y, k)
        entry: dict[str, Any] = {
            "name": name,
            "bucket": k,
            "x": _to_list(x[::k], 6),
            "y": _to_sig(r["mean"]),
        }
        if k > 1:
            entry["lo"] = _to_sig(r["min"])
            entry["hi"] = _to_sig(r["max"])
        out.append(entry)
    return out


def _to_sig(values: np.ndarray | Sequence[float]) -> list[float | None]:
    """6 significant digits (a learning rate of 3e-5 must not round to 0)."""
    return [
        None if (v is None or math.isnan(v) or math.isinf(v)) else float(f"{v:.6g}")
        for v in np.asarray(values, dtype=np.float64).tolist()
    ]
