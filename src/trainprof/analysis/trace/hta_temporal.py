"""HTA's temporal breakdown and idle-time breakdown of a rank's GPU timeline.

Definitions (HolisticTraceAnalysis 0.5.0):

* Which device events count: kernels, memcpys and memsets, and ``cuda_sync`` waits on a
  stream (HTA keeps every event that has a stream). With at least two distinct
  ``ProfilerStep`` names, the last step is excluded (``hta/common/trace.py``,
  ``_filter_irrelevant_gpu_kernels``, default ``include_last_profiler_step=False``):
  only device work whose launching CPU event (same ``correlation``) starts before the
  last ``ProfilerStep`` range starts counts. That start is the latest start of any
  non-device event whose name contains "ProfilerStep", which in newer traces includes
  the ``gpu_user_annotation`` copy on the GPU row, as HTA's symbol filter does. Device
  work without a correlation id (MTIA's) counts when it starts before that point.
* Temporal breakdown (``hta/analyzers/breakdown_analysis.py``, ``get_temporal_breakdown``):
  span = last end - first start of those events; idle = span - |their union|;
  compute = |union of the computation kernels|; non-compute = span - idle - compute.
  A kernel is computation unless its name matches ``(^nccl.*Kernel)|(.*(Memcpy)|
  (Memset))|(.*Sync)`` (``hta/utils/utils.py``, ``is_compute_kernel``): communication,
  memory copies and sets, and sync events are not.
* Idle-time breakdown (``_analyze_idle_time_for_stream``, per stream, kernels sorted by
  start): the gap before each kernel is ``ts - end of the previous kernel``. It is
  **host wait** when the kernel's launching runtime call started after the previous
  kernel ended (the CPU had not enqueued it yet), else **kernel wait** when the gap is
  under ``consecutive_kernel_delay`` (HTA's default 30, compared with microsecond
  timestamps: 30 µs), else **other**. The categories are summed per stream.

One deliberate difference: HTA rounds float (nanosecond) timestamps to whole
microseconds (ceil of start, floor of end) before analysing; here they stay exact
to the nanosecond. On integer-microsecond traces the numbers are identical.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from trainprof.analysis.trace import intervals as iv
from trainprof.analysis.trace.correlate import Links
from trainprof.analysis.trace.events import DEVICE_KINDS, Events, Kind

#: HTA's ``NCCL_COMPUTE_KERNEL_RE`` (matched at the start of the name, as ``re.match``).
NON_COMPUTE = re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")
#: HTA's default ``consecutive_kernel_delay`` (30, in the trace's µs), in ns.
CONSECUTIVE_KERNEL_DELAY_NS = 30_000


_HTA_DEVICE_KINDS = np.array([int(k) for k in (*DEVICE_KINDS, Kind.DEVICE_SYNC)])


def hta_device_rows(ev: Events, links: Links) -> tuple[np.ndarray, np.ndarray, bool]:
    """(device rows HTA analyses, their launching runtime rows, whether the last step was cut).

    Device rows: kernels, memcpys, memsets, and ``cuda_sync`` waits on a stream (HTA keeps
    every event with a stream; its regular expression then calls the syncs non-compute).
    """
    dev = np.flatnonzero(np.isin(ev.kind, _HTA_DEVICE_KINDS))
    dev = dev[(ev.kind[dev] != Kind.DEVICE_SYNC) | (ev.stream[dev] >= 0)]
    rt = links.runtime_of(dev)
    step_name = np.fromiter(
        ("ProfilerStep" in n for n in ev.names), dtype=bool, count=len(ev.names)
    )
    if np.count_nonzero(step_name) < 2:
        return dev, rt, False
    not_device = ~np.isin(ev.kind, _HTA_DEVICE_KINDS)
    step_rows = np.flatnonzero(not_device & step_name[ev.name])
    if step_rows.size == 0:
        return dev, rt, False
    last_start = int(ev.ts[step_rows].max())
    has_corr = ev.corr[dev] >= 0
    keep = np.where(
        has_corr,
        (rt >= 0) & (ev.ts[np.maximum(rt, 0)] < last_start),
        ev.ts[dev] < last_start,
    )
    return dev[keep], rt[keep], True


def temporal_breakdown(ev: Events, links: Links) -> dict[str, Any] | None:
    """HTA's temporal breakdown and idle-time breakdown for one rank (None: no device work)."""
    rows, rt, last_step_cut = hta_device_rows(ev, links)
    if rows.size == 0:
        return None
    s, e = ev.ts[rows], ev.end[rows]
    span = int(e.max() - s.min())
    busy = iv.total(*iv.union(s, e))
    idle = span - busy
    compute_name = np.fromiter(
        (NON_COMPUTE.match(n) is None for n in ev.names), dtype=bool, count=len(ev.names)
    )
    comp = compute_name[ev.name[rows]]
    compute = iv.total(*iv.union(s[comp], e[comp]))
    non_compute = span - idle - compute
    out: dict[str, Any] = {
        "span_us": span / 1000.0,
        "idle_us": idle / 1000.0,
        "compute_us": compute / 1000.0,
        "non_compute_us": non_compute / 1000.0,
        "idle_pct": idle / span * 100.0 if span else 0.0,
        "compute_pct": compute / span * 100.0 if span else 0.0,
        "non_compute_pct": non_compute / span * 100.0 if span else 0.0,
        "last_step_excluded": last_step_cut,
        "device_events": int(rows.size),
    }
    # HTA's idle-time breakdown leaves the cuda_sync waits out (kernels, memcpys, memsets)
    waits = ev.kind[rows] == Kind.DEVICE_SYNC
    out["idle_breakdown"] = idle_time_breakdown(ev, rows[~waits], rt[~waits])
    return out


def idle_time_breakdown(ev: Events, rows: np.ndarray, rt: np.ndarray) -> dict[str, Any]:
    """HTA's idle-time breakdown (host wait / kernel wait / other), per stream and summed."""
    dev = ev.device[rows].astype(np.int64)
    stream = ev.stream[rows]
    s = ev.ts[rows]
    e = ev.end[rows]
    rt_ts = np.where(rt >= 0, ev.ts[np.maximum(rt, 0)], np.iinfo(np.int64).min)
    # sort by (device, stream, start): every stream's kernels in time order
    order = np.lexsort((s, stream, dev))
    dev, stream, s, e, rt_ts = dev[order], stream[order], s[order], e[order], rt_ts[order]
    same = np.r_[False, (dev[1:] == dev[:-1]) & (stream[1:] == stream[:-1])]
    prev_end = np.r_[0, e[:-1]]
    gap = (s - prev_end)[same]
    host = (rt_ts > prev_end)[same]
    kernel = ~host & (gap < CONSECUTIVE_KERNEL_DELAY_NS)
    other = ~host & ~kernel
    host_t, kern_t, other_t = int(gap[host].sum()), int(gap[kernel].sum()), int(gap[other].sum())
    total = host_t + kern_t + other_t
    per_stream = []
    keys = np.stack([dev, stream], axis=1)[same]
    if keys.size:
        uniq, inv = np.unique(keys, axis=0, return_inverse=True)
        inv = inv.reshape(-1)
        cats = np.where(host, 0, np.where(kernel, 1, 2))
        sums = np.zeros((uniq.shape[0], 3), dtype=np.float64)
        np.add.at(sums, (inv, cats), gap)
        for (d, st), (h, k, o) in zip(uniq.tolist(), sums.tolist(), strict=True):
            per_stream.append({
                "device": int(d), "stream": int(st),
                "host_wait_us": h / 1000.0, "kernel_wait_us": k / 1000.0, "other_us": o / 1000.0,
            })
    return {
        "host_wait_us": host_t / 1000.0,
        "kernel_wait_us": kern_t / 1000.0,
        "other_us": other_t / 1000.0,
        "host_wait_pct": host_t / total * 100.0 if total else 0.0,
        "kernel_wait_pct": kern_t / total * 100.0 if total else 0.0,
        "other_pct": other_t / total * 100.0 if total else 0.0,
        "per_stream": per_stream,
    }
