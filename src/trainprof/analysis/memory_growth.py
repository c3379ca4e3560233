"""Memory that keeps growing through the steady state: the training process's RSS and
each GPU's used memory, from the system samples.

Why: after its first steps a training loop reaches a steady footprint (allocator pools,
a first epoch filling a cache, the pages of a memory-mapped dataset). Growth that goes
on to the end of the run is a leak, and it ends the run when memory runs out — most
often tensors kept with their autograd graph (``losses.append(loss)``,
``total_loss += loss``: every step's activations stay alive), or Python containers
that grow per step. expert-rules.md M3 (Scalene): "memory growth ≥ 1% and per-line
leak likelihood ≥ 0.95"; trainprof has no per-line allocation counts in its always-on
capture, so it reads the trend of the samples instead, and requires it to hold to the
end.

Which GPU series: the memory NVML lists for the training process on each GPU
(``proc_mem_used_bytes``: its CUDA context and allocations), not the device's used
memory, which counts every process on it: six test runs sharing one H200 made the
device's used memory swing 6.0 → 9.3 → 7.7 → 9.4 GB while the leaking run's own grew
steadily. The device's figure is the fallback where NVML lists the process on no GPU
(records from before; a container whose PID namespace hides it from NVML).

Method, per series (host RSS; each GPU's memory): the samples inside the
steady-state window are cut into four quarters of equal time; the series *grows* when
the quarters' medians rise from the second to the third and from the third to the
fourth quarter, the last rise at least :data:`MIN_LAST_RISE` of the one before (growth
that stopped halfway is a cache that filled, not a leak: one jump between the second and
third quarters, then flat at 445.6 MB twice, had read as "more in each quarter") and
the rise over the second half is at least :data:`MIN_GROWTH_BYTES` and
:data:`MIN_GROWTH_REL` of the first quarter's median. The quarters' *floors* (their
minima) must pass the same test: memory a leak holds is never freed, so it raises the
lowest reading too, while memory a step allocates and frees again (a 128 MB dense
embedding gradient made and dropped every step) only moves the readings between the
floor and the peak, by when the sampler happens to look. With RssAnon swinging 600-950
MiB within each step, quarter medians of 14 samples each rose 645 → 739 → 764 → 778 MiB
by chance (1 run in 3: "[high] Host memory grows 5,483 KiB a step ... full in about 14
minutes") while the floors of the last three went 615 → 597 → 603 MiB. This is the test
leak checkers make on a garbage-collected heap: the trend of the memory left after each
collection (the floor), not of the peaks between collections. A window shorter than
:data:`MIN_WINDOW_S` is not judged: a heap grows for a process's first seconds.
The rate is the Theil–Sen slope
(the median of pairwise slopes: robust to single jumps, such as a caching allocator's
new block) of the second half; per step, it is divided by the steady steps per
second. The time left is the headroom (host: the host's RAM less the last RSS; GPU:
its total less the last used) over the rate: an upper bound on the run's life, since
other processes use memory too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: the least growth over the second half of the steady window that counts
MIN_GROWTH_BYTES = 32 * 2**20
MIN_GROWTH_REL = 0.03
#: the last quarter's rise, at least this part of the third's: growth still going on
MIN_LAST_RISE = 0.25
#: samples needed in the window (four quarters of at least two each)
MIN_SAMPLES = 8
#: the shortest steady window judged: a process's heap keeps growing for its first
#: seconds before it settles (measured: a DataLoader loop's anonymous memory rose 190 →
#: 410 MB over its first 3 s, then stayed), which a shorter window cannot tell from a leak
MIN_WINDOW_S = 8.0
#: pairwise slopes at most (Theil-Sen on a subsample: O(n^2) otherwise)
MAX_PAIRS_POINTS = 400


def theil_sen_slope(t: np.ndarray, y: np.ndarray) -> float:
    """Median of the slopes between all pairs of points with distinct ``t`` (Sen 1968)."""
    if len(t) > MAX_PAIRS_POINTS:
        idx = np.linspace(0, len(t) - 1, MAX_PAIRS_POINTS).round().astype(int)
        t, y = t[idx], y[idx]
    i, j = np.triu_indices(len(t), k=1)
    dt = t[j] - t[i]
    ok = dt > 0
    if not ok.any():
        return 0.0
    return float(np.median((y[j] - y[i])[ok] / dt[ok]))


def _rising(levels: list[float]) -> bool:
    """Four quarters' levels rise from the second to the third and to the fourth, the last
    rise at least :data:`MIN_LAST_RISE` of the one before, the second half's rise at least
    :data:`MIN_GROWTH_BYTES` and :data:`MIN_GROWTH_REL` of the first quarter's level."""
    rise = levels[3] - levels[1]
    return (levels[1] < levels[2] < levels[3]
            and levels[3] - levels[2] >= MIN_LAST_RISE * (levels[2] - levels[1])
            and rise >= max(MIN_GROWTH_BYTES, MIN_GROWTH_REL * levels[0]))


def series_growth(t: np.ndarray, y: np.ndarray, steps_per_s: float | None,
                  capacity: float | None,
                  min_window_s: float = MIN_WINDOW_S) -> dict[str, Any] | None:
    """The growth of one series (module docstring); None when too few samples or a
    window shorter than ``min_window_s`` (not judged)."""
    keep = np.isfinite(y)
    t, y = t[keep], y[keep]
    if len(t) < MIN_SAMPLES or t[-1] - t[0] < max(min_window_s, 1e-9):
        return None
    edges = np.linspace(t[0], t[-1], 5)
    quarters = [y[(t >= edges[k]) & (t <= edges[k + 1])] for k in range(4)]
    if any(len(q) == 0 for q in quarters):
        return None
    medians = [float(np.median(q)) for q in quarters]
    floors = [float(np.min(q)) for q in quarters]
    late = t >= edges[2]
    slope = theil_sen_slope(t[late] - t[0], y[late])
    rise = medians[3] - medians[1]
    grows = slope > 0 and _rising(medians) and _rising(floors)
    out: dict[str, Any] = {
        "grows": bool(grows),
        "window_s": float(t[-1] - t[0]),
        "samples": int(len(t)),
        "quarter_medians_bytes": [int(m) for m in medians],
        "quarter_floors_bytes": [int(m) for m in floors],
        "first_bytes": int(medians[0]),
        "last_bytes": int(y[-1]),
        "late_rise_bytes": int(rise),
        "slope_bytes_per_s": slope,
    }
    if steps_per_s:
        out["bytes_per_step"] = slope / steps_per_s
    if capacity:
        out["capacity_bytes"] = int(capacity)
        headroom = float(capacity) - float(y[-1])
        if slope > 0 and headroom > 0:
            out["seconds_to_full"] = headroom / slope
    return out


#: start methods whose workers start a fresh interpreter: their memory at first sight
#: is a process still importing torch and unpickling its dataset, not a baseline
FRESH_INTERPRETER = ("spawn", "forkserver")


def worker_starts(procs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per DataLoader worker pid (as a string): when its start-up ended, from its own
    file (trainprof.analysis.workers.load_worker_files): ``start_method``; ``t`` (s,
    the samples' clock) and ``private``/``shared`` (bytes) where the worker read its
    dirty memory just after its first batch (``dirty_after_first_batch``); else ``t``
    of its first batch, where it had one."""
    out: dict[str, dict[str, Any]] = {}
    for doc in procs:
        if doc.get("role") != "worker" or not isinstance(doc.get("pid"), int):
            continue
        for st in doc.get("streams") or []:
            if not isinstance(st, dict):
                continue
            entry: dict[str, Any] = {"start_method": st.get("start_method")}
            after = st.get("dirty_after_first_batch")
            first_batch = st.get("first_batch_ns")
            if (isinstance(after, list) and len(after) == 3
                    and all(isinstance(v, int) for v in after)):
                entry.update(private=after[0], shared=after[1], t=after[2] / 1e9)
            elif isinstance(first_batch, int) and first_batch > 0:
                entry["t"] = first_batch / 1e9
            out[str(doc["pid"])] = entry
            break  # a worker loads for one DataLoader
    return out


def _baseline(start: dict[str, Any] | None,
              readings: list[tuple[float, int, int]]) -> tuple[float, int] | None:
    """(from when, private bytes) that a worker's growth is counted from; None: not known.

    Its own reading after its first batch where it made one. Otherwise, for a ``spawn``
    or ``forkserver`` worker, the sampler's first reading at or after its first batch
    (None without one: its readings are all start-up); for a forked worker (or one whose
    start method is not known) the sampler's first reading of it, since a fork child
    starts with its parent's interpreter and allocates little of its own to start.
    """
    if start and "private" in start:
        return float(start["t"]), int(start["private"])
    if start and start.get("start_method") in FRESH_INTERPRETER:
        since = start.get("t")
        after = [(t, p) for t, p, _ in readings if since is not None and t >= since]
        return after[0] if after else None
    return (readings[0][0], readings[0][1]) if readings else None


def workers_private_bytes(samples: list[dict[str, Any]]) -> list[int | None]:
    """Per sample, the private memory of the DataLoader workers alive then, summed.

    Why not ``workers_rss_bytes``: a worker's RSS counts every page it maps, and a
    ``fork`` worker maps the training process's whole heap, copy-on-write. Summed over
    workers, RSS counts that heap once per worker: 4 workers of a process holding a
    200 MB array read as ~1.1 GB of "workers" (measured) while each wrote ~10-20 MB of
    its own. The private dirty size (``Private_Dirty`` of ``/proc/<pid>/smaps_rollup``,
    the figure :func:`worker_memory` reads; the dirty part of the USS, ``Private_Clean``
    being the rare file pages mapped by this process alone) is memory the worker alone
    holds: summed over workers, nothing is counted twice, and pages still shared with
    the training process stay counted once, in its RSS.

    Readings come about once a second (``workers_dirty_bytes``); a sample between two
    holds each live worker's last reading (a step function, as the sampler saw it).
    None where no live worker has been read yet (no smaps_rollup: not Linux, an old
    kernel) or no worker runs.
    """
    last: dict[str, int] = {}
    out: list[int | None] = []
    for s in samples:
        dirty = s.get("workers_dirty_bytes")
        if isinstance(dirty, dict):
            for pid, pair in dirty.items():
                if isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], int):
                    last[pid] = pair[0]
        workers = s.get("workers")
        alive = [last[pid] for pid in workers if pid in last] if isinstance(workers, dict) else []
        out.append(sum(alive) if alive else None)
    return out


def worker_memory(samples: list[dict[str, Any]],
                  starts: dict[str, dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """What each DataLoader worker wrote into memory of its own over its life.

    From ``workers_dirty_bytes`` (about once a second, trainprof.capture.proc_stats):
    per worker the first and the largest private dirty size, and how much of the
    memory it shared dirty with the training process at first it no longer shares
    (pages copied on write: copy-on-read of the dataset's Python objects). Medians
    over workers.

    *Growth* is what a worker wrote after its start-up (``starts``, from
    :func:`worker_starts`; :func:`_baseline`): its largest private size from then on,
    less its size then. Why not from the first reading: a ``spawn``/``forkserver`` worker
    is first seen while its fresh interpreter imports torch and unpickles the dataset
    (measured: 17 MB, then 150 MB after its first batch, for a dataset holding nothing),
    which is no memory the dataset keeps; only a dataset that keeps what it loads (a
    cache) grows after its first batch, under any start method.

    Totals are over the workers alive at one time, never summed over every worker the
    run had (without ``persistent_workers`` each epoch starts new ones):
    ``concurrent_private_peak_bytes`` the largest sum of private sizes in one reading
    (``concurrent_private_peak_workers`` the workers in it) and
    ``concurrent_growth_peak_bytes`` the largest sum of growths
    (``concurrent_growth_peak_workers``), so that a per-worker figure and a total are
    of the same memory. None when no worker was read.
    """
    readings: dict[str, list[tuple[float, int, int]]] = {}
    per_sample: list[tuple[float, dict[str, int]]] = []
    for s in samples:
        dirty = s.get("workers_dirty_bytes")
        if not isinstance(dirty, dict) or not dirty:
            continue
        t = float(s.get("t") or 0.0)
        now: dict[str, int] = {}
        for pid, pair in dirty.items():
            if not isinstance(pair, list) or len(pair) != 2:
                continue
            private, shared = int(pair[0]), int(pair[1])
            readings.setdefault(pid, []).append((t, private, shared))
            now[pid] = private
        per_sample.append((t, now))
    if not readings:
        return None
    starts = starts or {}
    base = {pid: _baseline(starts.get(pid), r) for pid, r in readings.items()}
    first = {pid: r[0] for pid, r in readings.items()}
    peak = {pid: max(p for _, p, _ in r) for pid, r in readings.items()}
    growth: dict[str, int] = {}
    for pid, r in readings.items():
        b = base[pid]
        if b is not None:
            growth[pid] = max([0, *(p - b[1] for t, p, _ in r if t >= b[0])])
    private_peak = private_workers = growth_peak = growth_workers = 0
    for t, now in per_sample:
        if sum(now.values()) > private_peak:
            private_peak, private_workers = sum(now.values()), len(now)
        grown = [max(0, p - b[1]) for pid, p in now.items()
                 if (b := base[pid]) is not None and t >= b[0]]
        if sum(grown) > growth_peak:
            growth_peak, growth_workers = sum(grown), len(grown)
    return {
        "workers": len(readings),
        "private_first_median_bytes": int(np.median([first[p][1] for p in first])),
        "private_peak_median_bytes": int(np.median([peak[p] for p in first])),
        # after start-up, over the workers whose start-up end is known
        "private_baseline_median_bytes": (
            int(np.median([b[1] for b in base.values() if b is not None]))
            if growth else None),
        "private_growth_median_bytes": int(np.median(list(growth.values()))) if growth else 0,
        "growth_measured_workers": len(growth),
        "shared_dirty_drop_median_bytes": int(np.median(
            [first[p][2] - readings[p][-1][2] for p in first])),
        "concurrent_private_peak_bytes": int(private_peak),
        "concurrent_private_peak_workers": private_workers,
        "concurrent_growth_peak_bytes": int(growth_peak),
        "concurrent_growth_peak_workers": growth_workers,
    }


def memory_growth(samples: list[dict[str, Any]], t_start: float | None, t_end: float | None,
                  steps_per_s: float | None, host_memory: int | None,
                  starts: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """``{"host": growth of RSS, "gpus": {index: growth of used memory}}`` over the
    steady window ``[t_start, t_end]`` (series with too few samples are left out), and
    the DataLoader workers' own memory (:func:`worker_memory`; ``starts``:
    :func:`worker_starts`)."""
    out: dict[str, Any] = {"host": None, "gpus": {}, "workers": worker_memory(samples, starts),
                           "host_memory_bytes": host_memory}
    if t_start is None or t_end is None:
        return out
    window = [s for s in samples if t_start <= s.get("t", -1.0) <= t_end]
    if not window:
        return out
    t = np.array([s["t"] for s in window], dtype=np.float64)
    # anonymous memory where recorded: the file pages of a memory-mapped dataset also count
    # in RSS, and they grow through a first epoch without being a leak
    key = "rss_anon_bytes" if any(s.get("rss_anon_bytes") is not None for s in window) \
        else "rss_bytes"
    rss = np.array([s.get(key) if s.get(key) is not None else np.nan for s in window],
                   dtype=np.float64)
    out["host"] = series_growth(t, rss, steps_per_s, host_memory)
    if out["host"] is not None:
        out["host"]["series"] = key
    # the process's own memory on each GPU where NVML lists it; the whole device's where it
    # lists the process on none (a record from before, or a container's PID namespace)
    own = any(isinstance(dev, dict) and dev.get("proc_mem_used_bytes") is not None
              for s in window for dev in s.get("gpu") or [])
    series = "proc_mem_used_bytes" if own else "mem_used_bytes"
    per_gpu: dict[str, list[tuple[float, float, Any]]] = {}
    for s in window:
        for dev in s.get("gpu") or []:
            if isinstance(dev, dict) and dev.get(series) is not None:
                per_gpu.setdefault(str(dev.get("index")), []).append(
                    (float(s["t"]), float(dev[series]), dev.get("mem_total_bytes")))
    for index, points in per_gpu.items():
        totals = [p[2] for p in points if p[2]]
        growth = series_growth(np.array([p[0] for p in points]),
                               np.array([p[1] for p in points]), steps_per_s,
                               max(totals) if totals else None)
        if growth is not None:
            growth["series"] = series
            out["gpus"][index] = growth
    return out
