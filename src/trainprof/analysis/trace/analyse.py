"""One trace file, or a directory of them (one per rank), to one JSON-ready document.

The document (``trainprof trace --json``) holds, for a file: the source and its format
facts, the analysed ``steps``, the TensorBoard plugin's step-time breakdown
(``breakdown_us``, average per step), the GPU summary per device (``gpu``), HTA's
temporal and idle-time breakdowns per rank (``temporal``), top operators and kernels,
memory per operator and per device (``memory``; None without ``profile_memory``),
kernel-launch statistics, memcpy kinds, syncs, communication overlap, warnings and
notes. For a directory, ``ranks`` holds each rank's document and the top level holds
the merged view: the breakdown averaged over ranks, every rank's devices and temporal
breakdown, and the spread of step times across ranks. The caller adds ``findings``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from trainprof.analysis.trace import tb_breakdown as tb
from trainprof.analysis.trace.attention import eager_attention
from trainprof.analysis.trace.correlate import Links
from trainprof.analysis.trace.events import Events, Kind, load_events
from trainprof.analysis.trace.gpu_metrics import gpu_summary
from trainprof.analysis.trace.hta_temporal import temporal_breakdown
from trainprof.analysis.trace.launches import launch_stats, memcpy_stats, sync_stats
from trainprof.analysis.trace.loader import LoadInfo
from trainprof.analysis.trace.op_flops import op_flops
from trainprof.analysis.trace.operators import operators_and_kernels
from trainprof.analysis.trace.steps import find_steps
from trainprof.errors import UsageError

SCHEMA_VERSION = 1
TRACE_SUFFIXES = (".json", ".json.gz")
_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.I)


def _rank_of(info: LoadInfo, fallback: int) -> int:
    dist = info.metadata.get("distributedInfo")
    if isinstance(dist, dict) and isinstance(dist.get("rank"), int):
        return int(dist["rank"])
    m = _RANK_IN_NAME.search(info.path.name)
    return int(m.group(1)) if m else fallback


def _distributed_info(info: LoadInfo) -> dict[str, Any] | None:
    dist = info.metadata.get("distributedInfo")
    return ({k: dist.get(k) for k in ("backend", "rank", "world_size")}
            if isinstance(dist, dict) else None)


def _one_job(docs: list[dict[str, Any]]) -> bool:
    """Whether the traces of a folder are ranks of one job: they say so (torch.profiler's
    ``distributedInfo``, one world size over 1), or one of them communicates. Traces of
    separate runs put side by side (two settings of one script) are neither, and have no
    collective at which one would wait for another."""
    if any(d.get("communication") for d in docs):
        return True
    infos = [d.get("distributed_info") for d in docs]
    sizes = {i.get("world_size") for i in infos if isinstance(i, dict)}
    return (all(isinstance(i, dict) for i in infos) and len(sizes) == 1
            and isinstance(next(iter(sizes)), int) and next(iter(sizes)) > 1)


def _device_type(ev: Events, info: LoadInfo) -> str:
    cats = {c.lower() for c in ev.categories}
    if any(c.startswith("mtia") for c in cats):
        return "MTIA"
    has_device = bool(np.isin(ev.kind, [Kind.KERNEL, Kind.MEMCPY, Kind.MEMSET]).any())
    # a trace cut before its device events (they come after the host's in the file) that
    # launched kernels is a GPU trace still: it had read "CPU only", its FLOP rate over CPU
    # time, beside aten::cudnn_convolution in its own operator table
    launched = bool(np.isin(ev.kind, [Kind.RUNTIME, Kind.DEVICE_SYNC]).any()) or any(
        "cudnn" in n or n.startswith(("cuda", "hip")) for n in ev.names)
    if not has_device and not (info.truncated and launched):
        return "CPU only"
    props = info.metadata.get("deviceProperties") or []
    names = " ".join(str(p.get("name", "")) for p in props if isinstance(p, dict))
    if "AMD" in names or "Radeon" in names or "Instinct" in names:
        return "ROCm"
    if any(n.startswith("hip") for n in ev.names[:2000]):
        return "ROCm"
    if "xpu_runtime" in cats:
        return "XPU"
    return "CUDA"


def _format_facts(ev: Events, info: LoadInfo) -> dict[str, Any]:
    cats = sorted(ev.categories)
    old = any(c in ("Operator", "Runtime", "Kernel") for c in cats)
    return {
        "layout": info.layout,
        "compressed": info.compressed,
        "size_bytes": info.size_bytes,
        "json_bytes": info.json_bytes,
        "events": ev.n_all,
        "complete_events": len(ev),
        "categories": cats,
        "generation": "old (Operator/Runtime/Kernel)" if old else "modern (cpu_op/cuda_runtime)",
        "float_timestamps": ev.float_timestamps,
        "string_pids": any(isinstance(p, str) for p in ev.pids),
        "device_type": _device_type(ev, info),
        "schema_version": info.metadata.get("schemaVersion"),
        "truncated": info.truncated,
    }


def analyse_file(path: Path, fallback_rank: int = 0) -> dict[str, Any]:
    """The analysis document of one trace file (without findings)."""
    ev, info = load_events(path)
    warnings = list(info.warnings)
    notes: list[str] = []
    if len(ev) == 0:
        if ev.n_all == 0:
            raise UsageError(f"{path}: the trace has no events")
        raise UsageError(
            f"{path}: none of its {ev.n_all} items is a complete ('X') trace event with a "
            "timestamp: nothing to analyse"
        )
    links = Links(ev)
    steps = find_steps(ev, links)
    if steps is None:
        raise UsageError(f"{path}: the trace has no CPU or device events to analyse")
    rank = _rank_of(info, fallback_rank)
    facts = _format_facts(ev, info)
    if not steps.found:
        notes.append(
            "no ProfilerStep#N ranges: the whole trace is analysed as one window "
            "(record with torch.profiler's schedule and call prof.step() to get steps)"
        )
    if steps.removed_tail:
        notes.append(
            f"last step(s) {', '.join(steps.removed_tail)} left out, as the TensorBoard plugin "
            "does: the profiler stopped before all their device work was recorded"
        )
    if ev.n_negative_dur:
        warnings.append(f"{ev.n_negative_dur} events with a negative duration were read as 0")

    flags = tb.name_flags(ev)
    roles = tb.role_sets(ev, links, flags)
    bd = tb.breakdown(steps, roles)
    lo, hi = steps.window
    props = info.metadata.get("deviceProperties")
    gpu = gpu_summary(ev, links, (lo, hi), props if isinstance(props, list) else [],
                      ev.process_labels)
    if facts["device_type"] not in ("CUDA", "ROCm"):
        for g in gpu.values():  # kernel names say nothing about matrix units elsewhere
            g["tensor_core_pct"] = None
    temporal = temporal_breakdown(ev, links)
    opk = operators_and_kernels(ev, links, steps)
    first_gpu = (props[0] if isinstance(props, list) and props and isinstance(props[0], dict)
                 else {})
    timing = opk.pop("kernel_ns_of_shaped_rows")
    if facts["device_type"] == "CPU only":  # no kernels: the op's own time is its compute
        timing = {r: float(ev.dur[r]) for r in ev.shapes if ev.dur[r] > 0}
    flops = op_flops(ev.names, ev.name, ev.shapes, timing,
                     first_gpu.get("name") if facts["device_type"] == "CUDA" else None,
                     time_basis="cpu op" if facts["device_type"] == "CPU only" else "kernels")
    kernel_rows = ev.kind == Kind.KERNEL
    attention = eager_attention(
        ev.names, ev.name, ev.shapes, timing,
        first_gpu.get("name") if facts["device_type"] == "CUDA" else None,
        float(ev.dur[kernel_rows].sum()) if kernel_rows.any() else sum(timing.values()))
    cpu_only = facts["device_type"] == "CPU only"
    if cpu_only:
        notes.append("CPU-only trace: no device timeline; the breakdown is DataLoader, "
                     "CPU ops and the rest")
    step_totals = [s["Total"] for s in bd["per_step_us"]]
    dl_rows = np.flatnonzero(
        flags["dataloader"][ev.name] & np.isin(ev.kind, [Kind.CPU_OP, Kind.ANNOTATION])
    )
    dl_names = sorted({ev.names[i] for i in ev.name[dl_rows].tolist()})
    sync = sync_stats(ev, links, steps)
    if sync.get("profiler_stop"):
        stop = sync["profiler_stop"]
        notes.append(
            f"the {stop['name']} after the last step is the profiler's own (Kineto "
            "synchronizes the device when it stops): left out of the syncs"
        )
    doc: dict[str, Any] = {
        "kind": "trace",
        "schema_version": SCHEMA_VERSION,
        "source": str(path),
        "rank": rank,
        "format": facts,
        "steps": list(steps.names),
        "steps_found": steps.found,
        "window": {
            "start_us": lo / 1000.0,
            "end_us": hi / 1000.0,
            "duration_us": (hi - lo) / 1000.0,
            "on_device_timeline": steps.on_device,
            "removed_tail_steps": steps.removed_tail,
        },
        "step_time_us": {
            "mean": float(np.mean(step_totals)) if step_totals else 0.0,
            "min": float(np.min(step_totals)) if step_totals else 0.0,
            "max": float(np.max(step_totals)) if step_totals else 0.0,
        },
        "breakdown_us": bd["avg_us"],
        "breakdown_pct": bd["pct"],
        "breakdown_per_step_us": bd["per_step_us"],
        "dataloader": {
            "iterators": dl_names,
            "calls": int(dl_rows.size),
            "mean_us": float(ev.dur[dl_rows].mean() / 1000.0) if dl_rows.size else 0.0,
        },
        "gpu": gpu,
        "temporal": {str(rank): temporal} if temporal is not None else {},
        "operators": opk["operators"],
        "operator_count": opk["operator_count"],
        "kernels": opk["kernels"],
        "tc_eligible_kernel_pct": opk["tc_eligible_kernel_pct"],
        # matrix products' and attention's FLOPs and rates, from the shapes (op_flops.py)
        "flops": flops,
        # attention computed op by op: score shapes and the kernel time on them
        "attention": attention,
        "memory": opk["memory"],
        "launch": launch_stats(ev, links, steps),
        "memcpy": memcpy_stats(ev, links, steps),
        "sync": sync,
        "communication": tb.communication_overlap(steps, roles),
        # torch.profiler's record of the process group (backend, rank, world size)
        "distributed_info": _distributed_info(info),
        "device_properties": props if isinstance(props, list) else [],
        "cpu_only": cpu_only,
        "warnings": warnings,
        "notes": notes,
    }
    return doc


def trace_files(directory: Path) -> list[Path]:
    """The trace files of a directory (one per rank): ``*.json`` and ``*.json.gz``, sorted."""
    try:
        entries = sorted(p for p in directory.iterdir() if p.is_file())
    except OSError as exc:
        raise UsageError(f"cannot list {directory}: {exc.strerror or exc}") from None
    return [p for p in entries if p.name.endswith(TRACE_SUFFIXES)]


def drop_copies(docs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """``docs`` without the traces that are copies of an earlier one (same rank, same events,
    same step times: a file copied, or a ``tensorboard_trace_handler`` folder that kept a
    cycle twice), and a warning naming them. A folder of one trace twice had read as "2
    ranks", "slowest rank 0, fastest 0"."""
    seen: dict[tuple[Any, ...], str] = {}
    kept, copies = [], []
    for d in docs:
        # the rank the trace says (a trace without distributedInfo is numbered by file order)
        said = (d.get("distributed_info") or {}).get("rank")
        key = (said, d["format"].get("events"), d["format"].get("complete_events"),
               d["step_time_us"].get("mean"), tuple(d.get("steps") or ()))
        if key in seen:
            copies.append(f"{Path(d['source']).name} is a copy of {seen[key]} (the same rank, "
                          "events and step times): counted once")
            continue
        seen[key] = Path(d["source"]).name
        kept.append(d)
    return kept, copies


def merge_ranks(directory: Path, docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The merged view of several ranks (see the module docstring)."""
    docs = sorted(docs, key=lambda d: d["rank"])
    ranks = [d["rank"] for d in docs]
    if len(set(ranks)) != len(ranks):  # duplicate ranks: number them by file order
        for i, d in enumerate(docs):
            d["rank"] = i
    cats = tb.CATEGORIES
    breakdown = {c: float(np.mean([d["breakdown_us"][c] for d in docs])) for c in cats}
    total = breakdown["Total"]
    pct = {c: (breakdown[c] / total * 100.0 if total else 0.0) for c in cats[:-1]}
    gpu = {f"{d['rank']}/{dev}": g for d in docs for dev, g in d["gpu"].items()}
    temporal = {k: v for d in docs for k, v in d["temporal"].items()}
    means = [d["step_time_us"]["mean"] for d in docs]
    first = docs[0]
    comm = [d["communication"] for d in docs if d["communication"]]
    warnings = [w for d in docs for w in d["warnings"]]
    notes = sorted({n for d in docs for n in d["notes"]})
    one_job = _one_job(docs)
    return {
        "kind": "trace",
        "schema_version": SCHEMA_VERSION,
        "source": str(directory),
        "rank": None,
        "format": {
            **first["format"],
            "events": sum(d["format"]["events"] for d in docs),
            "complete_events": sum(d["format"]["complete_events"] for d in docs),
            "size_bytes": sum(d["format"]["size_bytes"] for d in docs),
            "json_bytes": sum(d["format"]["json_bytes"] for d in docs),
            "truncated": any(d["format"]["truncated"] for d in docs),
        },
        "steps": first["steps"],
        "steps_found": all(d["steps_found"] for d in docs),
        "window": first["window"],
        "step_time_us": {
            "mean": float(np.mean(means)),
            "min": float(np.min([d["step_time_us"]["min"] for d in docs])),
            "max": float(np.max([d["step_time_us"]["max"] for d in docs])),
        },
        "breakdown_us": breakdown,
        "breakdown_pct": pct,
        "breakdown_per_step_us": [],
        "dataloader": first["dataloader"],
        "gpu": gpu,
        "temporal": temporal,
        "operators": first["operators"],
        "operator_count": first["operator_count"],
        "kernels": first["kernels"],
        "tc_eligible_kernel_pct": float(np.mean([d["tc_eligible_kernel_pct"] for d in docs])),
        "flops": first.get("flops"),  # the first rank's, as its operators (each rank's below)
        "memory": first["memory"],
        "launch": first["launch"],
        "memcpy": first["memcpy"],
        "sync": first["sync"],
        "communication": comm[0] if comm else None,
        "device_properties": first["device_properties"],
        "cpu_only": all(d["cpu_only"] for d in docs),
        "warnings": warnings,
        "notes": notes,
        "ranks": {str(d["rank"]): d for d in docs},
        "rank_spread": {
            # False: separate runs side by side, whose step times no collective ties
            "one_job": one_job,
            "step_time_mean_us": {str(d["rank"]): m for d, m in zip(docs, means, strict=True)},
            "slowest_rank": str(docs[int(np.argmax(means))]["rank"]),
            "fastest_rank": str(docs[int(np.argmin(means))]["rank"]),
            "spread_pct": float((max(means) - min(means)) / max(means) * 100.0)
            if max(means) > 0 else 0.0,
        },
        "merged_note": (
            f"{len(docs)} ranks: breakdown averaged over ranks; the DataLoader and "
            f"communication lines, operators, kernels, memory, launches, memcpy and syncs "
            f"are rank {first['rank']}'s (every rank's are under 'ranks')"
        ) if one_job else (
            f"{len(docs)} traces with no distributedInfo and no communication: separate runs "
            "rather than ranks of one job, shown side by side (each under 'ranks', by file "
            f"order); the breakdown is their average, the other lines (DataLoader, "
            f"operators, kernels...) those of {Path(first['source']).name}"
        ),
    }
