"""Step-time breakdown exactly as the PyTorch-profiler TensorBoard plugin defined it.

Definition (torch-tb-profiler 0.4.3: ``profiler/event_parser.py`` ``StepParser._parse_step``
for the role ranges, ``profiler/overall_parser.py`` ``OverallParser`` for the
aggregation):

* Role ranges, each merged into a disjoint set: **Kernel** (GPU kernels, except those
  of communication ops), **Memcpy**, **Memset**, **Communication** (kernels whose
  external id is a NCCL/Gloo op's, and the CPU ranges of those ops), **Runtime**
  (CUDA runtime/driver calls), **DataLoader** (CPU ranges named
  ``enumerate(DataLoader)#...__next__`` or ``enumerate(DataPipe)#...``), **CpuOp**
  (every other CPU op, Python op and user annotation: the plugin's "CPU Exec").
* Within the steps (:mod:`.steps`, moved onto the device timeline), time is given to
  the roles in that priority order, each taking the part of the step that no earlier
  role took; the rest is **Other**. **Total** is the step's length. The breakdown is the
  average over the steps.

Two deliberate departures from 0.4.3, both for newer traces only (the shared
ResNet-50 traces are unaffected and reproduce the plugin's numbers):

* ``user_annotation`` ranges count: the DataLoader's ``enumerate(DataLoader)#...``
  (0.4.3 drops every user annotation except steps, so it reports DataLoader = 0 on
  modern traces) and other annotations as CPU Exec, as later plugin versions do.
  ``gpu_user_annotation`` copies are not CPU work and are ignored.
* Runtime includes ``cuda_driver`` calls (``cuLaunchKernel``) and the runtimes of other
  devices (MTIA, XPU); communication kernels are also recognised by name (NCCL/RCCL
  ``nccl...Kernel``) and communication ops by the ``nccl:``/``gloo:`` prefix, which
  covers the collectives 0.4.3's fixed name list misses (all_to_all, send/recv, ...).

Computed on elementary segments between all range boundaries (numpy), which is the
same as the plugin's sequence of intersections and subtractions, point by point.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from trainprof.analysis.trace import intervals as iv
from trainprof.analysis.trace.correlate import Links
from trainprof.analysis.trace.events import Events, Kind
from trainprof.analysis.trace.steps import STEP_PREFIX, Steps

ROLES = ("Kernel", "Memcpy", "Memset", "Communication", "Runtime", "DataLoader", "CpuOp")
CATEGORIES = (*ROLES, "Other", "Total")

_COMM_OP = re.compile(r"^(nccl|gloo|rccl|hccl|xccl):")
#: NCCL/RCCL kernels (HTA's ``^nccl.*Kernel``; RCCL keeps the nccl prefix).
COMM_KERNEL = re.compile(r"^(nccl|rccl).*Kernel|^ncclDevKernel|^ncclKernel")


def is_dataloader(name: str) -> bool:
    return (
        name.startswith("enumerate(DataLoader)#") and name.endswith(".__next__")
    ) or name.startswith("enumerate(DataPipe)#")


def name_flags(ev: Events) -> dict[str, np.ndarray]:
    """Per distinct name: is it a DataLoader range, a communication op, a comm kernel, a step."""
    names = ev.names
    n = len(names)
    return {
        "dataloader": np.fromiter((is_dataloader(s) for s in names), bool, count=n),
        "comm_op": np.fromiter((_COMM_OP.match(s) is not None for s in names), bool, count=n),
        "comm_kernel": np.fromiter(
            (COMM_KERNEL.match(s) is not None for s in names), bool, count=n
        ),
        "step": np.fromiter((s.startswith(STEP_PREFIX) for s in names), bool, count=n),
    }


def role_sets(ev: Events, links: Links, flags: dict[str, np.ndarray]) -> dict[str, Any]:
    """The merged (disjoint) range set of every role, keyed by role name."""
    kind = ev.kind
    name = ev.name
    ts, end = ev.ts, ev.end
    cpu_side = (kind == Kind.CPU_OP) | (kind == Kind.ANNOTATION) | (kind == Kind.PYTHON)
    is_step = flags["step"][name] & ((kind == Kind.CPU_OP) | (kind == Kind.ANNOTATION))
    comm_op_row = cpu_side & flags["comm_op"][name]
    dataloader = ((kind == Kind.CPU_OP) | (kind == Kind.ANNOTATION)) & flags["dataloader"][name]

    kernels = kind == Kind.KERNEL
    comm_kernel = np.zeros(kind.shape, dtype=bool)
    krows = links.kernel_rows
    if krows.size:
        comm_ext = np.unique(ev.ext[comm_op_row & (ev.ext >= 0)])
        by_ext = np.isin(ev.ext[krows], comm_ext) & (ev.ext[krows] >= 0)
        by_name = flags["comm_kernel"][name[krows]]
        comm_kernel[krows] = by_ext | by_name

    masks = {
        "Kernel": kernels & ~comm_kernel,
        "Memcpy": kind == Kind.MEMCPY,
        "Memset": kind == Kind.MEMSET,
        "Communication": comm_kernel | comm_op_row,
        "Runtime": kind == Kind.RUNTIME,
        "DataLoader": dataloader,
        "CpuOp": cpu_side & ~is_step & ~dataloader & ~comm_op_row,
    }
    return {role: iv.union(ts[m], end[m]) for role, m in masks.items()}


#: Range boundaries handled at once; steps are processed in batches of about this many,
#: so the temporaries stay bounded on traces with millions of events.
BATCH_BOUNDS = 1 << 18


def _step_batches(steps: Steps, roles: dict[str, Any]) -> list[tuple[int, int]]:
    """Consecutive step ranges [i, j) holding about :data:`BATCH_BOUNDS` role boundaries each."""
    n = len(steps)
    counts = np.zeros(n, dtype=np.int64)
    for s, _ in roles.values():
        counts += np.searchsorted(s, steps.ends, "right") - np.searchsorted(s, steps.starts)
    batches, i, acc = [], 0, 0
    for j in range(n):
        acc += int(counts[j])
        if acc >= BATCH_BOUNDS // 2:
            batches.append((i, j + 1))
            i, acc = j + 1, 0
    if i < n:
        batches.append((i, n))
    return batches


def _window(role: tuple[np.ndarray, np.ndarray], lo: int, hi: int) -> list[np.ndarray]:
    """The boundaries of a disjoint set that matter in [lo, hi) (views, then clipped)."""
    s, e = role
    a = max(0, int(np.searchsorted(e, lo, "right")))
    b = int(np.searchsorted(s, hi, "left"))
    return [np.clip(s[a:b], lo, hi), np.clip(e[a:b], lo, hi)]


def breakdown(steps: Steps, roles: dict[str, Any]) -> dict[str, Any]:
    """Per-step and average breakdown in µs (floats; the plugin rounds only for display)."""
    n = len(steps)
    st_s, st_e = steps.starts, steps.ends
    per_step = np.zeros((n, len(CATEGORIES)), dtype=np.float64)
    per_step[:, -1] = (st_e - st_s) / 1000.0
    for i, j in _step_batches(steps, roles):
        lo, hi = int(st_s[i]), int(st_e[j - 1])
        if hi <= lo:
            continue
        window = {key: _window(r, lo, hi) for key, r in roles.items()}
        bounds = [st_s[i:j], st_e[i:j]] + [a for pair in window.values() for a in pair]
        b = np.unique(np.concatenate(bounds))
        if b.size < 2:
            continue
        left = b[:-1]
        length = np.diff(b)
        # which step each elementary segment lies in (steps are disjoint and sorted)
        sidx = np.searchsorted(st_s[i:j], left, side="right") - 1
        in_step = sidx >= 0
        in_step[in_step] = left[in_step] < st_e[i:j][sidx[in_step]]
        left, length, sidx = left[in_step], length[in_step], sidx[in_step]
        role = np.full(left.shape, len(ROLES), dtype=np.int64)  # Other
        free = np.ones(left.shape, dtype=bool)
        for r, key in enumerate(ROLES):
            s, e = window[key]
            hit = free & iv.covered(left, s, e)
            role[hit] = r
            free &= ~hit
        flat = np.bincount(
            sidx * len(CATEGORIES) + role, weights=length, minlength=(j - i) * len(CATEGORIES)
        )
        per_step[i:j, :-1] = flat.reshape(j - i, len(CATEGORIES))[:, :-1] / 1000.0
    avg = per_step.mean(axis=0) if n else np.zeros(len(CATEGORIES))
    total = avg[-1]
    return {
        "avg_us": {c: float(avg[i]) for i, c in enumerate(CATEGORIES)},
        "pct": {
            c: (float(avg[i] / total * 100.0) if total > 0 else 0.0)
            for i, c in enumerate(CATEGORIES[:-1])
        },
        "per_step_us": [
            {"step": steps.names[j], **{c: float(per_step[j, i]) for i, c in enumerate(CATEGORIES)}}
            for j in range(n)
        ],
    }


def communication_overlap(steps: Steps, roles: dict[str, Any]) -> dict[str, float] | None:
    """The plugin's per-step computation/communication overlap (``StepCommunicationCosts``).

    Computation is the Kernel range (the CPU-op range on a CPU-only trace); overlap is its
    intersection with the Communication range. Returned as averages per step in µs, and
    the share of communication time hidden under computation. None without communication.
    """
    comm = roles["Communication"]
    if comm[0].size == 0:
        return None
    comp = roles["Kernel"] if roles["Kernel"][0].size else roles["CpuOp"]
    overlap = iv.intersect(comp, comm)
    window = iv.union(steps.starts, steps.ends)
    comm_t = iv.total(*iv.intersect(comm, window))
    comp_t = iv.total(*iv.intersect(comp, window))
    over_t = iv.total(*iv.intersect(overlap, window))
    n = max(1, len(steps))
    return {
        "computation_us": comp_t / 1000.0 / n,
        "communication_us": comm_t / 1000.0 / n,
        "overlap_us": over_t / 1000.0 / n,
        "exposed_communication_us": (comm_t - over_t) / 1000.0 / n,
        "overlap_pct_of_communication": (over_t / comm_t * 100.0) if comm_t else 0.0,
    }
