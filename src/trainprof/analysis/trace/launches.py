"""Kernel launches, memory copies and host-device synchronisation seen in a trace.

* **Launch delay** of a kernel = its start on the device - the start of the runtime
  call that launched it (same correlation id). Small delays while the GPU idles mean
  the GPU waits for the host (launch-bound); large ones mean a deep queue (the host
  runs ahead, which is healthy).
* **Short kernels**: shorter than :data:`SHORT_KERNEL_US` (10 µs, TraceLens's default
  short-kernel threshold): at that size the ~5-10 µs launch cost is comparable to the
  work, so many of them make a step launch-bound (CUDA graphs and fusion are the fix).
* **Memcpy kinds** from Kineto's names, ``Memcpy HtoD (Pageable -> Device)``: direction,
  and the host memory kind where the trace says it (pageable copies are staged by the
  driver and cannot overlap compute; pinned ones can).
* **Syncs**: runtime calls that block the host until the device catches up:
  ``cudaDeviceSynchronize``, ``cudaStreamSynchronize``, ``cudaEventSynchronize``, and
  synchronous (non-``Async``) ``cudaMemcpy*``; the HIP equivalents on ROCm. A
  ``cudaMemcpyAsync`` whose copy goes from the device into *pageable* host memory
  (``Memcpy DtoH (Device -> Pageable)``, what ``.cpu()`` / ``.item()`` / ``.tolist()``
  make) blocks too: the driver cannot DMA into pageable memory, so the call returns only
  once the copy, and everything queued before it on the stream, is done. It counts by its
  host time, under its own label, so its fix (a pinned destination, fewer reads) can be
  told apart from a synchronous ``cudaMemcpy``'s.
* **The profiler's own synchronize**: Kineto synchronizes the device when the profiler
  stops, so nearly every CUDA trace ends with one ``cudaDeviceSynchronize`` starting tens
  of µs after the last ``ProfilerStep``'s host end, waiting for that step's queued work.
  It is no part of the user's loop: a device synchronize that starts after the end of the
  last step's host range (outside every step) is set apart (``profiler_stop``), not
  counted in the syncs per step, their share or the finding.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from trainprof.analysis.trace import intervals as iv
from trainprof.analysis.trace.correlate import Links
from trainprof.analysis.trace.events import Events, Kind
from trainprof.analysis.trace.steps import Steps, step_rows

SHORT_KERNEL_US = 10.0
_MEMCPY = re.compile(r"^Memcpy\s+(\w+)(?:\s*\((\w+)\s*->\s*(\w+)\))?")
_LAUNCH = re.compile(r"(Launch\w*Kernel|LaunchCooperative|ModuleLaunch|cuLaunch|GraphLaunch)", re.I)
_SYNC = re.compile(
    r"^(cuda|hip)(DeviceSynchronize|StreamSynchronize|EventSynchronize|CtxSynchronize|"
    r"Memcpy(2D|3D)?(ToArray|FromArray|ToSymbol|FromSymbol)?|MemcpyWithStream|"
    r"Memcpy(Dto|Hto)\w*)$|^cu(CtxSynchronize|StreamSynchronize|EventSynchronize|"
    r"Memcpy\w*)$"
)


_DEVICE_SYNC = re.compile(r"^((cuda|hip)DeviceSynchronize|cuCtxSynchronize)$")
#: label of the asynchronous copies into pageable host memory that block (module docstring)
PAGEABLE_DTOH = "(DtoH to pageable)"


def _is_sync_call(name: str) -> bool:
    """A runtime call that blocks the host: explicit syncs and synchronous memcpys."""
    if _SYNC.match(name) is None:
        return False
    return not name.endswith("Async")


def _pct(a: np.ndarray, q: float) -> float:
    return float(np.percentile(a, q)) if a.size else 0.0


def launch_stats(ev: Events, links: Links, steps: Steps) -> dict[str, Any]:
    """Kernel counts and sizes, launch delays and launch-call costs, per step where it helps."""
    n_steps = max(1, len(steps))
    lo, hi = steps.window
    krows = links.kernel_rows
    out: dict[str, Any] = {"kernels": int(krows.size)}
    if krows.size == 0:
        return out
    kdur = ev.dur[krows] / 1000.0
    in_win = (ev.ts[krows] >= lo) & (ev.ts[krows] < hi)
    short = kdur < SHORT_KERNEL_US
    out.update({
        "kernels_per_step": float(in_win.sum() / n_steps),
        "kernel_median_us": float(np.median(kdur)),
        "kernel_mean_us": float(kdur.mean()),
        "short_kernel_threshold_us": SHORT_KERNEL_US,
        "short_kernels": int(short.sum()),
        "short_kernel_pct": float(short.mean() * 100.0),
        "short_kernel_time_pct": float(kdur[short].sum() / kdur.sum() * 100.0)
        if kdur.sum() > 0 else 0.0,
    })
    dev = links.device_rows
    is_k = ev.kind[dev] == Kind.KERNEL
    rt = links.runtime_of_device[is_k]
    k = dev[is_k]
    ok = rt >= 0
    if ok.any():
        delay = (ev.ts[k[ok]] - ev.ts[rt[ok]]) / 1000.0
        out["launch_delay_us"] = {
            "median": _pct(delay, 50), "p90": _pct(delay, 90), "p99": _pct(delay, 99),
            "max": float(delay.max()), "mean": float(delay.mean()),
        }
        out["kernels_with_launch"] = int(ok.sum())
    rrows = links.runtime_rows
    launch_name = np.fromiter(
        (_LAUNCH.search(n) is not None for n in ev.names), bool, count=len(ev.names)
    )
    launches = rrows[launch_name[ev.name[rrows]]]
    if launches.size:
        ldur = ev.dur[launches] / 1000.0
        lin = (ev.ts[launches] >= lo) & (ev.ts[launches] < hi)
        out["launch_calls"] = int(launches.size)
        out["launch_call_mean_us"] = float(ldur.mean())
        out["launch_call_time_per_step_us"] = float(ldur[lin].sum() / n_steps)
    return out


def memcpy_stats(ev: Events, links: Links, steps: Steps) -> dict[str, Any]:
    """Memory copies by kind (direction and host memory), with time per step and bandwidth."""
    rows = ev.where(Kind.MEMCPY)
    if rows.size == 0:
        return {"kinds": []}
    n_steps = max(1, len(steps))
    lo, hi = steps.window
    nid = ev.name[rows]
    uniq, inv = np.unique(nid, return_inverse=True)
    labels = []
    for u in uniq.tolist():
        name = ev.names[u]
        m = _MEMCPY.match(name)
        if m is None:
            labels.append((name if name != "dma_request" else "DMA", None, None))
        else:
            labels.append((m.group(1), m.group(2), m.group(3)))
    dur = ev.dur[rows].astype(np.float64)
    nbytes = ev.nbytes[rows].astype(np.float64)
    win = ((ev.ts[rows] >= lo) & (ev.ts[rows] < hi)).astype(np.float64)
    count = np.bincount(inv, minlength=uniq.size)
    count_in_steps = np.bincount(inv, weights=win, minlength=uniq.size)
    total = np.bincount(inv, weights=dur, minlength=uniq.size)
    per_step = np.bincount(inv, weights=dur * win, minlength=uniq.size) / n_steps
    byt = np.bincount(inv, weights=np.where(nbytes >= 0, nbytes, 0.0), minlength=uniq.size)
    kinds = []
    for j, (direction, src, dst) in enumerate(labels):
        host_mem = src if direction == "HtoD" else dst if direction == "DtoH" else None
        kinds.append({
            "kind": direction,
            "src": src,
            "dst": dst,
            "pageable": bool(host_mem == "Pageable"),
            "pinned": bool(host_mem == "Pinned"),
            "count": int(count[j]),  # in the whole trace
            # in the analysed steps, a step: as the time beside it (the count had been the
            # trace's beside a time a step, "12×, 1.9 ms per step")
            "count_per_step": float(count_in_steps[j] / n_steps),
            "total_us": float(total[j] / 1000.0),
            "per_step_us": float(per_step[j] / 1000.0),
            "bytes": int(byt[j]),
            "gb_per_s": float(byt[j] / total[j]) if total[j] > 0 else None,  # bytes/ns = GB/s
        })
    kinds.sort(key=lambda k: -k["total_us"])
    return {"kinds": kinds}


def _pageable_dtoh_calls(ev: Events, links: Links) -> np.ndarray:
    """``*MemcpyAsync`` runtime rows whose copy goes from the device into pageable memory.

    These block the host as a synchronous copy does (module docstring), though their name
    says ``Async``; a pinned destination makes them truly asynchronous."""
    rows = ev.where(Kind.MEMCPY)
    if rows.size == 0:
        return rows
    pageable_dtoh = np.fromiter(
        (_host_memory(n, "DtoH") == "Pageable" for n in ev.names), bool, count=len(ev.names)
    )
    rows = rows[pageable_dtoh[ev.name[rows]]]
    rt = links.runtime_of(rows)
    rt = rt[rt >= 0]
    is_async = np.fromiter(
        (n.endswith("Async") and _SYNC.match(n[: -len("Async")]) is not None for n in ev.names),
        bool, count=len(ev.names),
    )
    return np.unique(rt[is_async[ev.name[rt]]])


def _host_memory(name: str, direction: str) -> str | None:
    """The host memory kind of a Kineto memcpy name in ``direction`` (None: other kind)."""
    m = _MEMCPY.match(name)
    if m is None or m.group(1) != direction:
        return None
    return m.group(3) if direction == "DtoH" else m.group(2)


def _profiler_stop_syncs(ev: Events, rows: np.ndarray, steps: Steps) -> np.ndarray:
    """Which of the sync ``rows`` are the profiler's closing device synchronize.

    Only with ProfilerStep ranges: after the last one's host end (kept or left-out tail
    step alike, so that a user's sync inside a step is never taken for the profiler's),
    the user's loop is over and what the host still does is the profiler stopping."""
    out = np.zeros(rows.size, dtype=bool)
    srows = step_rows(ev)
    if not steps.found or srows.size == 0:
        return out
    last_host_end = int(ev.end[srows].max())
    device_sync = np.fromiter(
        (_DEVICE_SYNC.match(n) is not None for n in ev.names), bool, count=len(ev.names)
    )
    return device_sync[ev.name[rows]] & (ev.ts[rows] >= last_host_end)


def sync_stats(ev: Events, links: Links, steps: Steps) -> dict[str, Any]:
    """Blocking runtime calls: count and time per name, per step, and share of step time."""
    rrows = links.runtime_rows
    if rrows.size == 0:
        return {"calls": []}
    sync_name = np.fromiter((_is_sync_call(n) for n in ev.names), bool, count=len(ev.names))
    rows = rrows[sync_name[ev.name[rrows]]]
    pageable = _pageable_dtoh_calls(ev, links)
    rows = np.union1d(rows, pageable)
    stop = _profiler_stop_syncs(ev, rows, steps)
    profiler_stop = (
        {"name": ev.names[int(ev.name[rows[stop][0]])], "count": int(stop.sum()),
         "total_us": float(ev.dur[rows[stop]].sum() / 1000.0)}
        if stop.any() else None
    )
    rows = rows[~stop]
    if rows.size == 0:
        return {"calls": [], "per_step_us": 0.0, "share_pct": 0.0,
                "profiler_stop": profiler_stop}
    n_steps = max(1, len(steps))
    windows = iv.union(steps.starts, steps.ends)
    step_total = iv.total(*windows)
    s, e = iv.union(ev.ts[rows], ev.end[rows])
    in_steps = iv.total(*iv.intersect((s, e), windows))
    is_pageable = np.isin(rows, pageable)
    labels = [ev.names[int(n)] + (f" {PAGEABLE_DTOH}" if p else "")
              for n, p in zip(ev.name[rows].tolist(), is_pageable.tolist(), strict=True)]
    uniq, inv = np.unique(np.array(labels, dtype=object), return_inverse=True)
    dur = ev.dur[rows].astype(np.float64)
    mid = ev.ts[rows] + ev.dur[rows] // 2
    inside = iv.covered(mid, *windows)
    calls = []
    for j, label in enumerate(uniq.tolist()):
        sel = inv == j
        calls.append({
            "name": label,
            "pageable_dtoh": label.endswith(PAGEABLE_DTOH),
            "count": int(sel.sum()),
            "per_step": float(inside[sel].sum() / n_steps),
            "total_us": float(dur[sel].sum() / 1000.0),
            "per_step_us": float(dur[sel & inside].sum() / 1000.0 / n_steps),
        })
    calls.sort(key=lambda c: -c["total_us"])
    return {
        "calls": calls,
        "per_step_us": in_steps / 1000.0 / n_steps,
        "share_pct": in_steps / step_total * 100.0 if step_total else 0.0,
        "profiler_stop": profiler_stop,
    }
