"""Reading and summarising the system samples written by the capture-side sampler.

The file format (one JSON object per line, see ``trainprof.capture.sampler``) is the only
contract: analysis never imports capture, so reports can be built on a machine without psutil,
NVML or the training environment.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import orjson

__all__ = ["load_samples", "outside_cores", "outside_cores_during", "summarize_system"]


def load_samples(path: Path) -> list[dict[str, Any]]:
    """Load samples from a JSON-lines file, tolerating the ways a profiled run can end.

    A run killed mid-write leaves a truncated last line, and a run that died before its first
    tick leaves no file at all; neither should make the report fail.  Any line that is not a JSON
    object is skipped (not only the last one: one bad line must not cost the rest of the run).
    """
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    samples: list[dict[str, Any]] = []
    for line in data.splitlines():
        if not line.strip():
            continue
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("t"), int | float):
            samples.append(obj)
    return samples


def _mean(values: Iterable[Any]) -> float | None:
    """Mean of the numeric values, ignoring ``None`` (a field the sampler could not read)."""
    nums = [v for v in values if isinstance(v, int | float)]
    return sum(nums) / len(nums) if nums else None


def _max(values: Iterable[Any]) -> float | None:
    nums = [v for v in values if isinstance(v, int | float)]
    return max(nums) if nums else None


def _workers_total(sample: dict[str, Any]) -> float | None:
    """Total worker CPU % of one sample; ``{}`` (no workers alive, e.g. between epochs) is 0."""
    workers = sample.get("workers")
    if not isinstance(workers, dict):
        return None
    return float(sum(v for v in workers.values() if isinstance(v, int | float)))


def _core_mean(sample: dict[str, Any]) -> float | None:
    cores = sample.get("sys_cpu_pct")
    if not isinstance(cores, list):
        return None
    return _mean(cores)


def _summarize_gpus(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-device utilisation/power means and memory/temperature peaks, ordered by index.

    Memory is a peak, not a mean, because the question it answers is "how close to OOM did we
    get", and temperature is a max because throttling happens at the peak.
    """
    by_index: dict[int, list[dict[str, Any]]] = {}
    for sample in samples:
        for dev in sample.get("gpu") or []:
            if isinstance(dev, dict) and isinstance(dev.get("index"), int):
                by_index.setdefault(dev["index"], []).append(dev)
    return [
        {
            "index": index,
            "util_pct": _mean(d.get("util_pct") for d in devs),
            "mem_used_bytes": _max(d.get("mem_used_bytes") for d in devs),
            "mem_total_bytes": _max(d.get("mem_total_bytes") for d in devs),
            "power_w": _mean(d.get("power_w") for d in devs),
            "temp_c": _max(d.get("temp_c") for d in devs),
        }
        for index, devs in sorted(by_index.items())
    ]


def summarize_system(
    samples: list[dict[str, Any]], t_start: float | None = None, t_end: float | None = None
) -> dict[str, Any]:
    """Summarise samples, optionally restricted to ``t_start <= t <= t_end``.

    The window lets the report summarise exactly the steps it measured (e.g. excluding warm-up),
    using the same ``perf_counter`` clock as the step timeline.  Means skip ``null`` fields, so a
    value the sampler could not read lowers the sample count for that field rather than pulling
    the mean towards zero; a field that is null everywhere summarises to ``None``.
    """
    window = [
        s
        for s in samples
        if (t_start is None or s["t"] >= t_start) and (t_end is None or s["t"] <= t_end)
    ]
    worker_pids = {
        pid for s in window if isinstance(s.get("workers"), dict) for pid in s["workers"]
    }
    rss_peak = _max(s.get("rss_bytes") for s in window)
    return {
        "n_samples": len(window),
        "proc_cpu_pct": _mean(s.get("proc_cpu_pct") for s in window),
        "workers_cpu_pct": _mean(_workers_total(s) for s in window),
        "n_workers_seen": len(worker_pids) if window else None,
        "sys_cpu_pct": _mean(_core_mean(s) for s in window),
        "iowait_pct": _mean(s.get("iowait_pct") for s in window),
        "rss_peak_bytes": None if rss_peak is None else int(rss_peak),
        "disk_read_bps": _mean(s.get("disk_read_bps") for s in window),
        "ctx_switches_ps": _mean(s.get("ctx_switches_ps") for s in window),
        "gpu": _summarize_gpus(window),
    }


#: Cores of other processes' work on the machine from which trainprof says so: the noise
#: rule's ``external_load``, an op-time window ``disturbed``, a note in compare and tune.
OUTSIDE_LOAD_CORES = 0.5


def outside_cores(system: dict[str, Any], cores: int | None) -> float | None:
    """Cores other processes kept busy over a summary's samples: the system's CPU (its mean
    per core, times the usable cores) less this run's process and its DataLoader workers.
    None without a core count or system CPU samples."""
    sys_pct = system.get("sys_cpu_pct")
    if not cores or not isinstance(sys_pct, int | float):
        return None
    ours = (system.get("proc_cpu_pct") or 0) / 100 + (system.get("workers_cpu_pct") or 0) / 100
    return max(0.0, sys_pct / 100 * cores - ours)


#: A sample's CPU figures cover the interval since the one before (the sampler's period,
#: 0.2 s at its default 5 Hz): a span is read up to this long after its end.
SAMPLE_REACH_S = 0.25


def outside_cores_during(samples: list[dict[str, Any]], spans: list[tuple[float, float]],
                         cores: int | None) -> float | None:
    """:func:`outside_cores` over the samples taken during ``spans`` (seconds on the
    samples' clock): the load other processes put on the machine while a few steps ran
    (the op count's window, whose op times it would inflate). None without samples."""
    inside = [s for s in samples
              if any(t0 <= s["t"] <= t1 + SAMPLE_REACH_S for t0, t1 in spans)]
    return outside_cores(summarize_system(inside), cores) if inside else None
