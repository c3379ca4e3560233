"""A record as named scalar series: what the TensorBoard and W&B exports write.

Both exports (:mod:`trainprof.report.tensorboard`, :mod:`trainprof.report.wandb_export`) show
the same numbers under the same names, so that a run looks alike in either tool. They only
write what this module computes (DESIGN.md: "report never computes a metric").

**Points.** A :class:`Point` is one x position of several series: a step number, the wall
clock time (seconds since the epoch) and ``(tag, value)`` pairs, only finite values.

* **Steps** (:func:`step_points`), per complete step, at the step's number and the wall time
  it ended: ``step/time_ms``, ``step/batch_samples_per_s`` (the batch size seen / that one
  step's time: a step's own rate, which a 1 ms step sends to 29,810 in a run of 787 samples/s;
  it was ``step/samples_per_s``, which read as the run's throughput),
  ``step/syncs`` and ``step/sync_ms``, ``step/gc_collections`` where any step had one;
  ``phase/<name>_ms``, each phase's exclusive time in the step (the step record's phases, which
  add up to the step's time: :mod:`trainprof.schema`), for the phases the run had;
  ``device/<phase>_ms`` and ``device/idle_ms``, CUDA event times per step when recorded
  (:mod:`trainprof.capture.device_timer` defines them).
* **System samples** (:func:`sample_points`, ``≥ 5 Hz``), at the sample's wall time and, as
  its step, the step in progress then (0 before the first), so that a step axis lines the
  samples up with the steps: ``process/cpu_pct``, ``process/rss_mib``,
  ``process/ctx_switches_per_s``, ``workers/cpu_pct`` (all DataLoader workers together),
  ``workers/private_mib`` (the memory the workers hold alone, summed: the figure the HTML
  chart and the Perfetto timeline show,
  :func:`trainprof.analysis.memory_growth.workers_private_bytes`; the workers' summed
  RSS, once ``workers/rss_mib``, counted a fork worker's copy-on-write view of the
  training process's heap once per worker: 1,765 MiB of "workers" for 46 MiB of their
  own), ``system/cpu_pct`` (mean of the cores), ``system/iowait_pct``,
  ``system/disk_read_mib_per_s`` (MiB/s, as the HTML report; it was ``disk_read_mb_per_s``,
  decimal MB/s beside MiB everywhere else), and per GPU ``gpu<i>/util_pct``, ``memory_used_mib``,
  ``power_w``, ``temperature_c``, ``sm_clock_mhz``.
* **DDP** (:func:`ddp_points`), per DDP model, at the step of each iteration DDP's reducer
  sampled (1-10, then every 100th). DDP counts its forward passes from 1 (its reducer's
  ``num_iterations_``, raised in ``prepare_for_forward``), so iteration N is step N-1; with
  k backward passes a step (gradient accumulation, ``backward_per_step`` of the op count's
  window, one forward each; a run with one DDP model) it is step (N-1)//k:
  ``ddp/forward_ms``, ``backward_compute_ms``, ``allreduce_ms``, ``overlap_ms`` and
  ``exposed_ms`` (:mod:`trainprof.analysis.ddp` defines them).

Only complete steps count: the cut-off last step and the steps recorded under a heavy tool
(``--deep``, ``--py``), whose times include the tool's cost, are left out, as every trainprof
report leaves them out (:func:`trainprof.analysis.steps.complete_steps`).

**Long runs.** Dashboards show about a thousand points of a series (TensorBoard keeps 1,000 by
default, W&B's line plots sample 1,500), so a million points would cost minutes to write and
show nothing more. Beyond ``max_points`` points (default :data:`MAX_POINTS`) a series is cut
into equal buckets of consecutive points, each written as its mean at its last step
(samples/s as the bucket's samples over its seconds, not a mean of rates), and
``step/time_max_ms`` keeps each bucket's slowest step so that spikes stay visible.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainprof.analysis.memory_growth import workers_private_bytes
from trainprof.analysis.ops import load_ops
from trainprof.analysis.steps import complete_steps
from trainprof.analysis.system import load_samples
from trainprof.schema import PHASE_NAMES
from trainprof.store import Run

__all__ = ["MAX_POINTS", "PER_STEP_GROUPS", "Point", "ScalarSeries", "TUNE_METRICS", "describe",
           "scalar_series", "steady_means", "tune_metrics"]

#: Points per series before buckets are averaged (10x what the dashboards show by default).
MAX_POINTS = 10_000

MIB = 1024 * 1024

_DESCRIPTIONS = {
    "step/time_ms": "Wall-clock time of the step (optimizer step to optimizer step), ms.",
    "step/time_max_ms": "Slowest step of each bucket of steps averaged into one point, ms.",
    "step/batch_samples_per_s": ("Batch size seen by the step (samples) / that one step's "
                                 "time: a step's own rate, not the run's throughput "
                                 "(trainprof/samples_per_s: steady samples / steady time)."),
    "step/syncs": "Calls that made the host wait for the device (.item(), .cpu(), ...).",
    "step/sync_ms": "Time the host spent in those calls, ms.",
    "step/gc_collections": "Python garbage collections during the step.",
    "device/step_ms": "CUDA event time of the step on the device, ms.",
    "device/forward_ms": "CUDA event time of the forward pass, ms.",
    "device/backward_ms": "CUDA event time of the backward pass, ms.",
    "device/optimizer_ms": "CUDA event time of the optimizer step, ms.",
    "device/idle_ms": "Device time between the phases' work in the step (device idle), ms.",
    "process/cpu_pct": "CPU of the training process, % of one core.",
    "process/rss_mib": "Resident memory of the training process, MiB.",
    "process/ctx_switches_per_s": "Context switches of the training process per second.",
    "workers/cpu_pct": "CPU of all DataLoader worker processes together, % of one core.",
    "workers/private_mib": ("Memory the DataLoader workers hold alone (Private_Dirty), "
                            "summed over the live workers, MiB: pages a fork worker still "
                            "shares with the training process are not counted."),
    "system/cpu_pct": "Whole-machine CPU, mean over the cores, %.",
    "system/iowait_pct": "CPU time waiting for I/O, %.",
    "system/disk_read_mib_per_s": "Disk reads of the machine, MiB/s.",
}

_PHASE_TEXT = {
    "data_wait": "waiting for the DataLoader's next batch",
    "forward": "the outermost module call (forward pass)",
    "backward": "backward()",
    "optimizer": "optimizer.step()",
    "zero_grad": "zero_grad()",
    "gc": "Python garbage collection",
    "region": "named regions (prof.region)",
    "other": "the rest of the step (the loop's own code)",
}

_DEVICE_FIELDS = (("dev_step_ns", "device/step_ms"), ("dev_forward_ns", "device/forward_ms"),
                  ("dev_backward_ns", "device/backward_ms"),
                  ("dev_optimizer_ns", "device/optimizer_ms"), ("dev_gap_ns", "device/idle_ms"))

_GPU_FIELDS = (("util_pct", "util_pct", "GPU utilization (NVML), %.", 1.0),
               ("mem_used_bytes", "memory_used_mib", "GPU memory used (NVML), MiB.", 1 / MIB),
               ("power_w", "power_w", "GPU power draw (NVML), W.", 1.0),
               ("temp_c", "temperature_c", "GPU temperature (NVML), °C.", 1.0),
               ("sm_clock_mhz", "sm_clock_mhz", "GPU SM clock (NVML), MHz.", 1.0))

_DDP_TEXT = {
    "forward_ms": "DDP's forward compute on this sampled iteration (its reducer's timer), ms.",
    "backward_compute_ms": "DDP's backward compute, to the last gradient ready, ms.",
    "allreduce_ms": "DDP's gradient all-reduce, first bucket's launch to the last's end, ms.",
    "overlap_ms": "The all-reduce's part that ran while the backward still computed, ms.",
    "exposed_ms": "The all-reduce's part the step waited for after the backward, ms.",
}

#: A tune trial's results: the metrics a dashboard compares the trials by.
TUNE_METRICS = {
    "tune/mean_step_ms": "The trial's mean steady-state step time (what trainprof tune "
                         "compares), ms.",
    "tune/median_step_ms": "The trial's median steady-state step time, ms.",
    "tune/samples_per_s": "The trial's samples per second over its steady-state steps.",
}


def describe(tag: str) -> str | None:
    """What a series means, for a dashboard's tooltip; None for a tag of no known kind."""
    group, _, key = tag.partition("/")
    if group == "phase":
        phase = key[:-len("_ms")]
        return f"Exclusive time of the step in {_PHASE_TEXT.get(phase, phase)}, ms."
    if group.startswith("gpu"):
        for _, name, text, _scale in _GPU_FIELDS:
            if name == key:
                return text
    if group.startswith("ddp"):
        return _DDP_TEXT.get(key)
    return _DESCRIPTIONS.get(tag) or TUNE_METRICS.get(tag)


@dataclass
class Point:
    """One x position of several series: a step number, a wall time, finite values."""

    step: int
    wall: float
    values: list[tuple[str, float]]


@dataclass
class ScalarSeries:
    """Every series of one record (see the module's docstring)."""

    origin: float  #: wall-clock seconds at the step clock's origin
    steps: list[Point] = field(default_factory=list)
    step_count: int = 0  #: complete steps (before any bucketing)
    bucket: int = 1  #: steps per point (1: every step its own point)
    samples: list[Point] = field(default_factory=list)
    sample_count: int = 0
    ddp: list[Point] = field(default_factory=list)
    last_step: int = 0  #: the last complete step's number (0 without one)
    end_wall: float = 0.0  #: when the last complete step ended (the origin without one)


def scalar_series(run: Run, max_points: int = MAX_POINTS) -> ScalarSeries:
    """Every series of ``run``, each kept to ``max_points`` points."""
    origin = wall_origin(run)
    steps = complete_steps(run.steps)
    out = ScalarSeries(origin=origin, end_wall=origin)
    if len(steps):
        out.steps, out.bucket = step_points(run, steps, origin, max_points)
        out.step_count = len(steps)
        out.last_step = int(steps["step"][-1])
        out.end_wall = origin + float(steps["t_start_ns"][-1] + steps["dur_ns"][-1]) / 1e9
    out.samples, out.sample_count = sample_points(run, steps, origin, max_points)
    out.ddp = ddp_points(run, steps, origin)
    return out


#: Per-step series whose mean over the steps is a report figure: their dashboard summary is
#: the steady steps' mean (:func:`steady_means`), not the mean of every point.
PER_STEP_GROUPS = ("step", "phase", "device")


def steady_means(run: Run, warmup: int) -> dict[str, float]:
    """Each per-step series' mean over the steady steps (complete steps after the report's
    ``warmup``, :func:`trainprof.analysis.steps.step_statistics`), the figure the report's
    mean step time is: a mean over every point counted the warm-up steps (14.19 ms beside the
    report's 11.95 ms). The per-step rate ``step/batch_samples_per_s`` gets none: a mean of
    rates weighs a 1 ms step like a slow one (2,787 beside a throughput of 787 samples/s),
    and the run's throughput is the report's ``samples_per_s``."""
    steps = complete_steps(run.steps)[max(0, warmup):]
    if len(steps) == 0:
        return {}
    out = {}
    for tag, col in _step_columns(run, steps).items():
        present = col[~np.isnan(col)]
        if tag != "step/batch_samples_per_s" and len(present):
            out[tag] = float(present.mean())
    return out


def wall_origin(run: Run) -> float:
    """Wall-clock seconds at the step clock's origin (older records: the run's start)."""
    wall = run.meta.get("wall_origin_s")
    if isinstance(wall, int | float) and not isinstance(wall, bool):
        return float(wall)
    try:
        return float(Path(run.path / "run.json").stat().st_mtime)
    except OSError:
        return time.time()


def tune_metrics(trial: dict[str, Any], summary: dict[str, Any]) -> dict[str, float]:
    """A tune trial's results (:data:`TUNE_METRICS`), from tune.json's trial entry and the
    trial run's summary."""
    out: dict[str, float] = {}
    if isinstance(trial.get("mean_s"), int | float):
        out["tune/mean_step_ms"] = float(trial["mean_s"]) * 1e3
    if isinstance(trial.get("median_s"), int | float):
        out["tune/median_step_ms"] = float(trial["median_s"]) * 1e3
    if isinstance(summary.get("samples_per_s"), int | float):
        out["tune/samples_per_s"] = float(summary["samples_per_s"])
    return out


# --------------------------------------------------------------------------- buckets


def _buckets(n: int, max_points: int) -> tuple[int, np.ndarray]:
    """(bucket size, start index of each bucket) for ``n`` points kept to ``max_points``."""
    size = max(1, math.ceil(n / max(1, max_points)))
    return size, np.arange(0, n, size)


def _reduce(values: np.ndarray, starts: np.ndarray, how: str = "mean") -> np.ndarray:
    """Per-bucket mean (or max) of a float series; NaN (no value) is skipped."""
    if len(starts) == len(values):
        return values
    if how == "max":
        filled = np.where(np.isnan(values), -np.inf, values)
        out = np.maximum.reduceat(filled, starts)
        return np.where(np.isinf(out), np.nan, out)
    present = ~np.isnan(values)
    sums = np.add.reduceat(np.where(present, values, 0.0), starts)
    counts = np.add.reduceat(present.astype(np.int64), starts)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def _points(numbers: list[int], walls: list[float], table: dict[str, list[float]]) -> list[Point]:
    """Column-wise series into points, leaving out each point's missing (NaN) values."""
    tags = list(table)
    return [Point(n, wall, [(tag, table[tag][i]) for tag in tags if math.isfinite(table[tag][i])])
            for i, (n, wall) in enumerate(zip(numbers, walls, strict=True))]


# --------------------------------------------------------------------------- steps


def _step_columns(run: Run, steps: np.ndarray) -> dict[str, np.ndarray]:
    """Per complete step: every scalar a step gets, as float arrays (NaN where none)."""
    dur = steps["dur_ns"].astype(np.float64)
    out: dict[str, np.ndarray] = {"step/time_ms": dur / 1e6}
    samples = steps["samples"].astype(np.float64)
    if samples.any():
        with np.errstate(invalid="ignore", divide="ignore"):
            out["step/batch_samples_per_s"] = np.where((samples > 0) & (dur > 0),
                                                 samples / (dur / 1e9), np.nan)
    for phase in PHASE_NAMES:
        col = steps[f"{phase}_ns"].astype(np.float64)
        if col.any():
            out[f"phase/{phase}_ms"] = col / 1e6
    if steps["sync_n"].any():
        out["step/syncs"] = steps["sync_n"].astype(np.float64)
        out["step/sync_ms"] = steps["sync_ns"].astype(np.float64) / 1e6
    if steps["gc_n"].any():
        out["step/gc_collections"] = steps["gc_n"].astype(np.float64)
    if len(run.device):
        # device records by step number (complete steps are in ascending order)
        numbers = steps["step"]
        at = np.searchsorted(numbers, run.device["step"])
        found = at < len(numbers)
        found[found] = numbers[at[found]] == run.device["step"][found]
        for name, tag in _DEVICE_FIELDS:
            values = run.device[name][found].astype(np.float64)
            col = np.full(len(steps), np.nan)
            col[at[found]] = np.where(values >= 0, values / 1e6, np.nan)
            if not np.isnan(col).all():
                out[tag] = col
    return out


def step_points(run: Run, steps: np.ndarray, origin: float,
                max_points: int = MAX_POINTS) -> tuple[list[Point], int]:
    """The complete ``steps``' series as points, and the steps per point."""
    if len(steps) == 0:
        return [], 1
    series = _step_columns(run, steps)
    size, starts = _buckets(len(steps), max_points)
    ends = np.minimum(starts + size, len(steps)) - 1
    numbers = steps["step"][ends].tolist()
    walls = ((steps["t_start_ns"][ends] + steps["dur_ns"][ends]) / 1e9 + origin).tolist()
    reduced = {tag: _reduce(col, starts).tolist() for tag, col in series.items()}
    if size > 1:
        # a mean of samples/s would weigh a fast step like a slow one: samples / time instead
        if "step/batch_samples_per_s" in series:
            samples = np.add.reduceat(steps["samples"].astype(np.float64), starts)
            seconds = np.add.reduceat(steps["dur_ns"].astype(np.float64), starts) / 1e9
            with np.errstate(invalid="ignore", divide="ignore"):
                reduced["step/batch_samples_per_s"] = np.where(
                    (samples > 0) & (seconds > 0), samples / seconds, np.nan).tolist()
        reduced["step/time_max_ms"] = _reduce(series["step/time_ms"], starts, "max").tolist()
    return _points(numbers, walls, reduced), size


# --------------------------------------------------------------------------- system samples


def _sample_values(s: dict[str, Any], workers_private: int | None) -> list[tuple[str, float]]:
    """A sample's values; ``workers_private``: its workers' private bytes, which come from
    the readings of earlier samples too (:func:`workers_private_bytes`)."""
    def num(x: Any) -> float | None:
        return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else None

    out: list[tuple[str, float | None]] = [
        ("process/cpu_pct", num(s.get("proc_cpu_pct"))),
        ("process/rss_mib", None if num(s.get("rss_bytes")) is None else s["rss_bytes"] / MIB),
        ("process/ctx_switches_per_s", num(s.get("ctx_switches_ps"))),
        ("system/iowait_pct", num(s.get("iowait_pct"))),
        ("system/disk_read_mib_per_s",
         None if num(s.get("disk_read_bps")) is None else s["disk_read_bps"] / MIB),
    ]
    workers = s.get("workers")
    if isinstance(workers, dict) and workers:
        out.append(("workers/cpu_pct", sum(v for v in workers.values() if num(v) is not None)))
        out.append(("workers/private_mib",
                    None if workers_private is None else workers_private / MIB))
    cores = [c for c in s.get("sys_cpu_pct") or [] if num(c) is not None]
    if cores:
        out.append(("system/cpu_pct", sum(cores) / len(cores)))
    for dev in s.get("gpu") or []:
        if not isinstance(dev, dict) or not isinstance(dev.get("index"), int):
            continue
        for key, name, _text, scale in _GPU_FIELDS:
            value = num(dev.get(key))
            out.append((f"gpu{dev['index']}/{name}", None if value is None else value * scale))
    return [(tag, v) for tag, v in out if v is not None]


def sample_points(run: Run, steps: np.ndarray, origin: float,
                  max_points: int = MAX_POINTS) -> tuple[list[Point], int]:
    """The system samples' series as points (each at the step in progress), and how many
    samples there were."""
    samples = [s for s in load_samples(run.samples_path)
               if isinstance(s.get("t"), int | float)]
    if not samples:
        return [], 0
    clock = run.meta.get("clock_origin_s")
    clock = float(clock) if isinstance(clock, int | float) else float(samples[0]["t"])
    rel_ns = np.array([(s["t"] - clock) * 1e9 for s in samples])
    # the step in progress at each sample (0 before the first step)
    if len(steps):
        at = np.searchsorted(steps["t_start_ns"].astype(np.float64), rel_ns, side="right") - 1
        numbers = np.where(at >= 0, steps["step"][np.maximum(at, 0)], 0)
    else:
        numbers = np.zeros(len(samples), dtype=np.int64)
    rows = [_sample_values(s, private)
            for s, private in zip(samples, workers_private_bytes(samples), strict=True)]
    tags = sorted({tag for row in rows for tag, _ in row})
    table = {tag: np.full(len(rows), np.nan) for tag in tags}
    for i, row in enumerate(rows):
        for tag, value in row:
            table[tag][i] = value
    size, starts = _buckets(len(rows), max_points)
    ends = np.minimum(starts + size, len(rows)) - 1
    reduced = {tag: _reduce(col, starts).tolist() for tag, col in table.items()}
    return _points([int(numbers[e]) for e in ends.tolist()],
                   (origin + rel_ns[ends] / 1e9).tolist(), reduced), len(samples)


# --------------------------------------------------------------------------- DDP


def iteration_step(iteration: int, forwards_per_step: int) -> int:
    """The step (from 0) of DDP's iteration ``iteration`` (its forward passes, from 1)."""
    return max(0, iteration - 1) // max(1, forwards_per_step)


def ddp_points(run: Run, steps: np.ndarray, origin: float) -> list[Point]:
    """DDP's own timing of each sampled iteration (trainprof.capture.ddp_stats), at the
    iteration's step (:func:`iteration_step`). Several DDP models: ``ddp0/``, ``ddp1/``, ... ."""
    models = [m for m in run.meta.get("ddp") or [] if isinstance(m, dict)]
    per_step = 1
    if len(models) == 1:  # several models' forwards (a GAN's) need not be the backwards
        backward = (load_ops(run.path) or {}).get("backward_per_step")
        if isinstance(backward, (int, float)) and backward >= 1.5:
            per_step = round(backward)
    end = (float(steps["t_start_ns"][-1] + steps["dur_ns"][-1]) / 1e9 if len(steps) else 0.0)
    out = []
    for k, m in enumerate(models):
        prefix = "ddp" if len(models) == 1 else f"ddp{k}"
        for sample in m.get("samples") or []:
            if not (isinstance(sample, list) and len(sample) >= 5):
                continue
            it, fwd, bwd, comm, overlap = (int(x) for x in sample[:5])
            step = iteration_step(it, per_step)
            # DDP's figures are read once a second, not timed here: at the run's clock, when
            # the iteration's step ended if it is known, else at the run's end
            at = np.searchsorted(steps["step"], step) if len(steps) else 0
            wall = (origin + float(steps["t_start_ns"][at] + steps["dur_ns"][at]) / 1e9
                    if len(steps) and at < len(steps) and steps["step"][at] == step
                    else origin + end)
            out.append(Point(step, wall, [(f"{prefix}/{name}", value / 1e6) for name, value in (
                ("forward_ms", fwd), ("backward_compute_ms", bwd), ("allreduce_ms", comm),
                ("overlap_ms", overlap), ("exposed_ms", max(0, comm - overlap)))]))
    return out
