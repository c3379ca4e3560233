"""What DataLoader workers spend their time on, from the files they wrote (``RUN_DIR/workers/``).

The capture side (:mod:`trainprof.capture.worker`) writes one JSON file per process
that loaded data: each DataLoader worker, and the training process when a loader ran
with ``num_workers=0``. This module reads them, and nothing else: analysis never
imports capture, so the layout below is the contract.

``<pid>.json``: ``{"format": 1, "pid", "role": "worker"|"main", "updated_ns", "ended",
"streams": [stream, ...]}``, one stream per DataLoader the process loaded for. A
stream holds sums (``batches``, ``samples``, ``fetch_ns``, ``get_ns`` and
``get_cpu_ns`` — wall and thread-CPU time in the dataset's ``__getitem__`` —,
``collate_ns``, ``collate_cpu_ns``, ``runq_ns``: time runnable but waiting for a
core), timestamps on the run's clock (``time.perf_counter_ns``: ``requested_ns`` when
the DataLoader asked for workers, ``started_ns`` when the worker ran its
``worker_init_fn``, ``first_batch_ns``), a worker's ``dirty_after_first_batch``
(``[private, shared, ns]``: its memory at the end of its start-up, read by
trainprof.analysis.memory_growth), and histograms of per-sample blocked and CPU
time and per-batch collate time. ``<pid>.stacks.json`` (with ``--py``): per function
``[file, first_line, qualname, self_samples, total_samples]`` while inside ``fetch``.

Definitions:

* **blocked** time of a sample = wall − CPU time of the loading thread in
  ``__getitem__``: reads, sleeps, network, and waiting for a core. The last part is
  measured separately in workers where Linux exposes it (``/proc/thread-self/schedstat``,
  run delay; not in the training process, where it would cost the step a system call)
  and reported as ``waiting_for_cpu`` in ``fetch_split``: a worker that waits
  for a core is short of CPU, not slow to read.
* **busy share** of a worker = time in ``fetch`` / wall time since it started
  (``busy_share``), and from the start of its first batch to the end of its last
  (``busy_share_active``: start-up and the idle tail after training left out). Near 1:
  the worker fetched back to back, so the workers are the bottleneck; lower: it waited
  for the training loop to ask for more (``prefetch_factor`` batches per worker ahead).
* **same stream**: workers of one generation whose first batches have the same content
  (:func:`_same_stream`): an ``IterableDataset`` that every worker iterates whole. The
  loader's own first batch (:func:`_first_batch`) is compared across ranks the same way.
* **start-up** of a generation of workers = the DataLoader asking for workers → the
  first batch ready in a worker (the earliest one: the batch the loop waits for).
  Without ``persistent_workers`` every epoch starts a new generation, so all but the
  first start-up could be avoided (``avoidable_s``).

The sums may cover only a sample of the batches: cheap batches are timed one in
eight, and a stream then says how many were (``timed_batches``); each sum is scaled
to all ``batches`` (:func:`_scaled`, a ratio estimate). A stream without the field
timed every batch.

Percentiles come from log-linear histograms (16 bins per power of two), which merge
exactly across workers; a value is the bin's linear interpolation, within 3%. Samples
cheaper than 200 µs on average are timed per batch (each sample gets the batch mean;
``samples_timed`` counts those timed one by one), so their spread is that of batch means.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import orjson

__all__ = ["bin_bounds", "hist_quantile", "load_worker_files", "same_data_group",
           "summarize_workers"]

#: Must match trainprof.capture.worker.WORKERS_DIR / FORMAT.
WORKERS_DIR = "workers"
FORMAT = 1
#: Functions listed per loader.
TOP_FUNCTIONS = 15


def bin_bounds(i: int) -> tuple[int, int]:
    """[low, high) in ns of histogram bin ``i`` (exact below 32 ns, then 16 per power of two)."""
    if i < 32:
        return i, i + 1
    shift = (i >> 4) - 1
    m = (i & 15) + 16
    return m << shift, (m + 1) << shift


def hist_quantile(hist: dict[int, int], q: float) -> float | None:
    """The ``q`` quantile (0-1) of a histogram ``{bin: count}``, in ns, interpolated in its bin."""
    total = sum(hist.values())
    if total <= 0:
        return None
    target = q * total
    seen = 0
    for i in sorted(hist):
        c = hist[i]
        if seen + c >= target:
            lo, hi = bin_bounds(i)
            frac = (target - seen) / c if c else 0.0
            return lo + frac * (hi - lo)
        seen += c
    lo, hi = bin_bounds(max(hist))
    return float(hi)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        doc = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    return doc if isinstance(doc, dict) and doc.get("format") == FORMAT else None


def load_worker_files(run_dir: Path) -> tuple[list[dict[str, Any]], dict[int, dict[str, Any]]]:
    """(process documents, stacks documents by pid) from ``run_dir/workers``; unreadable skipped."""
    folder = Path(run_dir) / WORKERS_DIR
    procs: list[dict[str, Any]] = []
    stacks: dict[int, dict[str, Any]] = {}
    if not folder.is_dir():
        return procs, stacks
    for path in sorted(folder.iterdir()):
        name = path.name
        if name.startswith(".") or not name.endswith(".json"):
            continue  # a temporary file left by a kill mid-write
        doc = _read(path)
        if doc is None:
            continue
        if name.endswith(".stacks.json"):
            if isinstance(doc.get("pid"), int):
                stacks[doc["pid"]] = doc
        elif isinstance(doc.get("streams"), list):
            procs.append(doc)
    return procs, stacks


def _num(d: dict[str, Any], key: str) -> int:
    v = d.get(key)
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else 0


def _merge_hist(streams: Iterable[dict[str, Any]], name: str) -> dict[int, int]:
    out: dict[int, int] = defaultdict(int)
    for s in streams:
        for pair in (s.get("hist") or {}).get(name) or []:
            try:
                i, c = int(pair[0]), int(pair[1])
            except (TypeError, ValueError, IndexError):
                continue
            if i >= 0 and c > 0:
                out[i] += c
    return dict(out)


def _ms_stats(hist: dict[int, int], total_ns: int, count: int) -> dict[str, float | None]:
    med = hist_quantile(hist, 0.5)
    p90 = hist_quantile(hist, 0.9)
    return {
        "median": None if med is None else med / 1e6,
        "p90": None if p90 is None else p90 / 1e6,
        "mean": total_ns / count / 1e6 if count else None,
    }


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    v = sorted(values)
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def _short_file(path: str) -> str:
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return os.path.basename(path)


def _functions(pids: Iterable[int], stacks: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """Stack samples of these processes, merged per function (file, first line, name)."""
    ticks = 0
    self_n: dict[tuple[str, int, str], int] = defaultdict(int)
    total_n: dict[tuple[str, int, str], int] = defaultdict(int)
    found = False
    for pid in pids:
        doc = stacks.get(pid)
        if not doc:
            continue
        found = True
        ticks += _num(doc, "ticks_in_fetch")
        for row in doc.get("functions") or []:
            try:
                key = (str(row[0]), int(row[1]), str(row[2]))
                self_n[key] += int(row[3])
                total_n[key] += int(row[4])
            except (TypeError, ValueError, IndexError):
                continue
    if not found:
        return None
    top = sorted(total_n, key=lambda k: (-self_n.get(k, 0), -total_n[k]))[:TOP_FUNCTIONS]
    return {
        "samples_in_fetch": ticks,
        "top": [
            {
                "function": k[2],
                "file": k[0],
                "line": k[1],
                "where": f"{_short_file(k[0])}:{k[1]}",
                "self_samples": self_n.get(k, 0),
                "total_samples": total_n[k],
                "self_share": self_n.get(k, 0) / ticks if ticks else None,
                "total_share": total_n[k] / ticks if ticks else None,
            }
            for k in top
        ],
    }


def _startup(streams: list[dict[str, Any]], origin_ns: int | None,
             persistent: bool) -> dict[str, Any] | None:
    by_gen: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for s in streams:
        if _num(s, "requested_ns") and _num(s, "first_batch_ns"):
            by_gen[_num(s, "generation")].append(s)
    if not by_gen:
        return None
    gens = []
    for g in sorted(by_gen):
        ss = by_gen[g]
        first = [(_num(s, "first_batch_ns") - _num(s, "requested_ns")) / 1e9 for s in ss]
        launch = [(_num(s, "started_ns") - _num(s, "requested_ns")) / 1e9 for s in ss
                  if _num(s, "started_ns")]
        requested = min(_num(s, "requested_ns") for s in ss)
        gens.append({
            "generation": g,
            "workers": len(ss),
            "at_s": (requested - origin_ns) / 1e9 if origin_ns is not None else None,
            "first_batch_s": min(first),
            "median_s": _median(first),
            "launch_s": _median(launch),
            "init_s": _median([_num(s, "init_ns") / 1e9 for s in ss]),
        })
    firsts = [g["first_batch_s"] for g in gens]
    return {
        "per_generation": gens[:50],
        "median_s": _median(firsts),
        # every start-up after the first one: what persistent_workers=True saves
        "avoidable_s": 0.0 if persistent else sum(firsts[1:]),
    }


def same_data_group(fingerprints: dict[Any, tuple[str, bool]]) -> list[Any]:
    """The largest group of keys whose first batches have one fingerprint, or [].

    ``fingerprints``: per key (a worker, a rank), its first batch's digest and whether
    its data varied (a second batch unlike the first). A group counts only if one of its
    members saw its data vary: identical batches of one constant sample (synthetic data)
    are no evidence of one stream read twice. Groups of one are not groups.
    """
    groups: dict[str, list[Any]] = defaultdict(list)
    for key, (digest, _) in fingerprints.items():
        groups[digest].append(key)
    return max((keys for keys in groups.values()
                if len(keys) >= 2 and any(fingerprints[k][1] for k in keys)),
               key=len, default=[])


def _fingerprint(first_batches: Any) -> tuple[str, bool] | None:
    """``(digest of the first batch, data varied)`` from a stream's ``first_batches``."""
    fb = first_batches
    if not (isinstance(fb, list) and fb and isinstance(fb[0], str)):
        return None
    return fb[0], len(fb) > 1 and isinstance(fb[1], str) and fb[1] != fb[0]


def _same_stream(streams: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Workers of one generation that loaded the same data (an unsplit ``IterableDataset``).

    Each worker fingerprints its first two batches (``first_batches``,
    :mod:`trainprof.capture.batch_digest`); :func:`same_data_group` groups them. Returns
    the generation with the largest group (``identical_workers`` of
    ``workers_compared``; 1 when no two workers agree); None when fewer than two workers
    of a generation left fingerprints.
    """
    by_gen: dict[int, dict[int, tuple[str, bool]]] = defaultdict(dict)
    for k, s in enumerate(streams):
        fp = _fingerprint(s.get("first_batches"))
        if fp is not None:
            by_gen[_num(s, "generation")][k] = fp
    best: dict[str, Any] | None = None
    for g in sorted(by_gen):
        if len(by_gen[g]) < 2:
            continue
        same = max(1, len(same_data_group(by_gen[g])))
        if best is None or same > best["identical_workers"]:
            best = {"generation": g, "identical_workers": same,
                    "workers_compared": len(by_gen[g])}
    return best


def _first_batch(streams: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fingerprint of the loader's first batch, to compare across ranks.

    The first generation's worker 0 loads an epoch's first batch (the DataLoader asks
    its workers in turn); with ``num_workers=0``, the training process does (worker id
    None). ``varies``: that process's second batch differs from its first.
    """
    found = [(s, fp) for s in streams if (fp := _fingerprint(s.get("first_batches")))]
    if not found:
        return None
    first = min(_num(s, "generation") for s, _ in found)
    fp = next((fp for s, fp in found if _num(s, "generation") == first
               and s.get("worker_id") in (0, None)), None)
    return None if fp is None else {"digest": fp[0], "varies": fp[1]}


def _scaled(stream: dict[str, Any], key: str) -> float:
    """A sum of ``stream`` over all its batches (estimated where only some were timed)."""
    value = _num(stream, key)
    timed = _num(stream, "timed_batches")
    batches = _num(stream, "batches")
    if "timed_batches" not in stream or timed >= batches:
        return value
    return value * batches / timed if timed > 0 else 0


def _summarize_loader(index: int | None, mode: str, procs: list[tuple[dict[str, Any], dict]],
                      stacks: dict[int, dict[str, Any]], origin_ns: int | None) -> dict[str, Any]:
    streams = [s for _, s in procs]
    tot = {k: sum(_num(s, k) for s in streams) for k in ("batches", "samples", "samples_timed")}
    for k in ("fetch_ns", "get_ns", "get_cpu_ns", "collate_ns", "collate_cpu_ns"):
        tot[k] = round(sum(_scaled(s, k) for s in streams))
    measured = [s for s in streams if s.get("runq_measured")]
    runq = round(sum(_scaled(s, "runq_ns") for s in measured))
    fetch = tot["fetch_ns"]
    blocked_ns = max(0, tot["get_ns"] - tot["get_cpu_ns"])
    off_cpu = max(0, fetch - tot["get_cpu_ns"] - tot["collate_cpu_ns"])
    entry: dict[str, Any] = {
        "loader_index": index,
        "mode": mode,  # "workers", or "main": num_workers=0, loading in the training process
        "processes": len({doc.get("pid") for doc, _ in procs}),
        "num_workers": max((_num(s, "num_workers") for s in streams), default=0),
        "start_method": next((s.get("start_method") for s in streams
                              if s.get("start_method")), None),
        "generations": len({_num(s, "generation") for s in streams}),
        "batches": tot["batches"],
        "samples": tot["samples"],
        # counted on the timed batches and scaled to all of them: an estimate, not a count
        "samples_estimated": any(s.get("samples_scaled") for s in streams),
        "samples_timed": tot["samples_timed"],
        "sample_blocked_ms": _ms_stats(_merge_hist(streams, "blocked"), blocked_ns,
                                       tot["samples"]),
        "sample_cpu_ms": _ms_stats(_merge_hist(streams, "cpu"), tot["get_cpu_ns"],
                                   tot["samples"]),
        "collate_ms": _ms_stats(_merge_hist(streams, "collate"), tot["collate_ns"],
                                tot["batches"]),
        "cpu_wait_share": min(1.0, runq / off_cpu) if measured and off_cpu > 0 else None,
        "fetch_split": None,
        "busy_share": None,
        "busy_share_active": None,
        "startup": None,
        "functions": None,
        "capture_off": any(s.get("capture_off") for s in streams),
        "first_batch": _first_batch(streams),
    }
    if fetch > 0:
        runq_get = min(runq, blocked_ns)  # run-queue waits counted in the samples' blocked time
        entry["fetch_split"] = {
            "blocked": (blocked_ns - runq_get) / fetch,
            "waiting_for_cpu": runq_get / fetch,
            "cpu": tot["get_cpu_ns"] / fetch,
            "collate": tot["collate_ns"] / fetch,
        }
    if mode == "workers":
        busy, active = [], []
        for doc, s in procs:
            end = _num(doc, "updated_ns")
            f = _scaled(s, "fetch_ns")
            if end > _num(s, "started_ns") > 0:
                busy.append(min(1.0, f / (end - _num(s, "started_ns"))))
            last = _num(s, "last_fetch_end_ns")
            if last > _num(s, "first_fetch_ns") > 0:
                active.append(min(1.0, f / (last - _num(s, "first_fetch_ns"))))
        if busy:
            entry["busy_share"] = {"median": _median(busy), "min": min(busy), "max": max(busy)}
        if active:
            entry["busy_share_active"] = {"median": _median(active), "min": min(active),
                                          "max": max(active)}
        persistent = any(s.get("persistent_workers") for s in streams)
        entry["persistent_workers"] = persistent
        entry["startup"] = _startup(streams, origin_ns, persistent)
        entry["same_stream"] = _same_stream(streams)
    entry["functions"] = _functions({doc.get("pid") for doc, _ in procs}, stacks)  # type: ignore[arg-type]
    return entry


def _origin_ns(run_dir: Path, clock_origin_s: float | None) -> int | None:
    if clock_origin_s is None:
        try:
            meta = orjson.loads((Path(run_dir) / "run.json").read_bytes())
            clock_origin_s = meta.get("clock_origin_s")
        except (OSError, orjson.JSONDecodeError, AttributeError):
            return None
    if not isinstance(clock_origin_s, int | float) or not math.isfinite(clock_origin_s):
        return None
    return round(clock_origin_s * 1e9)


def summarize_workers(run_dir: Path, clock_origin_s: float | None = None,
                      files: tuple[list[dict[str, Any]], dict[int, dict[str, Any]]] | None = None,
                      ) -> dict[str, Any] | None:
    """Per DataLoader: blocked vs CPU time per sample, collate, busy share, start-up, functions.

    ``None`` when no process left a readable file (no DataLoader, or a run recorded
    before worker capture existed). ``clock_origin_s`` (run.json's) places the
    start-ups on the run's timeline; read from run.json when not given. ``files``: what
    :func:`load_worker_files` read already (the summary reads them once for this and the
    workers' memory).
    """
    procs, stacks = files if files is not None else load_worker_files(Path(run_dir))
    if not procs:
        return None
    origin = _origin_ns(Path(run_dir), clock_origin_s)
    groups: dict[tuple[int | None, str], list[tuple[dict[str, Any], dict]]] = defaultdict(list)
    for doc in procs:
        mode = "main" if doc.get("role") == "main" else "workers"
        for s in doc["streams"]:
            if not isinstance(s, dict):
                continue
            idx = s.get("loader_index")
            groups[(idx if isinstance(idx, int) else None, mode)].append((doc, s))
    loaders = [
        _summarize_loader(idx, mode, members, stacks, origin)
        for (idx, mode), members in sorted(groups.items(), key=lambda kv: (kv[0][0] or 0,
                                                                           kv[0][1]))
    ]
    return {"loaders": loaders, "sampled": bool(stacks), "files": len(procs)}
