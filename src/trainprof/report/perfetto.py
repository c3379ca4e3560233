"""One merged timeline of a run, as a Chrome-trace JSON that Perfetto and chrome://tracing open.

``trainprof export RUN_DIR --perfetto PATH`` writes the JSON object format of the Trace Event
Format (``{"traceEvents": [...], "displayTimeUnit": "ms"}``; Google's "Trace Event Format"
document): ``X`` complete events for slices, ``C`` counter events, ``i`` instants and ``M``
metadata events naming processes and threads. ``ts``/``dur`` are microseconds; ours are
computed from integer nanoseconds and written with at most three decimals, so slices nest
exactly (Perfetto reads the decimal digits as nanoseconds). Time 0 is the run's clock origin
(``clock_origin_s`` in run.json: the ``perf_counter`` instant step records count from).

What goes where (Perfetto shows one group per process, one track per thread or counter):

* **The training process** (its real pid, named after the run):

  - ``steps``: one slice per step record, every record including warm-up, profiled and
    cut-off steps (the flags are in the slice's args). Inside each step, its **phases**
    (``data_wait``, ``zero_grad``, ``forward``, ``backward``, ``optimizer``, ``gc``,
    ``region``, ``other``) as child slices laid end to end, in the order a typical loop runs
    them. The step records keep each phase's exclusive *total* per step, not when it ran
    (GC and "other" are scattered through the step), so the order inside a step is a layout,
    not a measurement; the widths are exact. One track with nested slices reads better than
    one track per phase: a step's composition is one glance, and the colours (Perfetto colours
    by name) make a phase that grows stand out along the run.
  - ``regions``: the ``prof.region(...)`` intervals from events.jsonl, at their real times.
  - counters: process CPU %, RSS, context switches/s.
  - when a deep window ran: the torch.profiler events of its traces on their own threads
    (the trace's own pid is the training process's, so they share the group), except the
    ``ProfilerStep#N`` slices, which get a track of their own next to ``steps``. There they
    line up with trainprof's steps at a glance, and they no longer cut through the ops: the
    profiler's ``step()`` runs from the optimizer's step hook, i.e. *inside* the
    ``Optimizer.step#...`` slice, so on the op thread ProfilerStep#N+1 would begin inside an
    op that began in step N, which is not a nesting a viewer can draw.

* **Every other rank** of a run recorded in several processes (``ranks/<k>/``): its steps,
  process counters and ``--deep`` traces, aligned as below on its own steps and then moved
  onto the main rank's timeline (:func:`_rank_offset_ns`).
* **DataLoader workers**: one CPU % counter per worker pid (from samples.jsonl; a worker that
  is gone drops to 0), the workers' total CPU % and RSS.
* **system**: mean CPU % over all cores, iowait %, disk read rate.
* **GPU n**: utilisation %, memory used, power, when NVML was sampled.

**Aligning torch.profiler traces.** Kineto writes ``baseTimeNanoseconds`` (Unix epoch, ns) in
the trace and event ``ts`` in µs relative to it: an event's wall-clock time is
``baseTimeNanoseconds + 1000 * ts`` (HolisticTraceAnalysis's
``trace_event_timestamp_to_unixtime_ns`` uses the same rule; older traces without the field
carry Unix-epoch µs in ``ts`` directly). The run records ``wall_origin_s`` (``time.time()``)
next to ``clock_origin_s``, so a Kineto event lands at ``ts + (base - wall_origin) / 1000``
µs on our timeline, no fitting needed: on a CPU run, trainprof's ``--deep`` ProfilerStep#N
slices start 0.1-1 ms after trainprof's step N (the profiler's own ``step()`` runs after the
step clock closes the step). The median of that difference is returned as ``residual_ms`` so
a bad alignment is visible. Only when a trace has no usable wall clock, or lands outside the
run altogether (a trace copied in from another run or machine), is it placed by matching its
``ProfilerStep#N`` slices to trainprof's step N (the median offset), and a trace that allows
neither is left out with a note.
"""

from __future__ import annotations

import gzip
import re
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from trainprof.analysis.memory_growth import workers_private_bytes
from trainprof.analysis.steps import complete_steps, detect_warmup, merge_auto_prefix
from trainprof.analysis.system import load_samples
from trainprof.errors import UsageError
from trainprof.schema import FLAG_BACKWARD, FLAG_MANUAL, FLAG_PARTIAL, FLAG_PROFILED, FLAG_SKIPPED
from trainprof.store import Run

#: Order in which a step's phase totals are laid out (a typical loop's order; see above).
PHASE_LAYOUT = (
    "data_wait", "zero_grad", "forward", "backward", "optimizer", "gc", "region", "other",
)

# Synthetic ids, above Linux's largest pid (2**22), so they never meet a real pid/tid that a
# torch.profiler trace brings along.
TID_STEPS = 1_000_000_001
TID_REGIONS = 1_000_000_002
TID_PROFILER_STEPS = 1_000_000_003
PID_WORKERS = 1_000_000_010
PID_SYSTEM = 1_000_000_011
PID_GPU0 = 1_000_000_100
PID_FALLBACK_TRAIN = 1_000_000_000

MIB = 1024 * 1024

#: Steps written by default (~600 bytes each with their phases): ~60 MB of JSON.
MAX_STEPS = 100_000

_PROFILER_STEP = re.compile(r"ProfilerStep#(\d+)$")


def _us(ns: int | float) -> float:
    """Nanoseconds to microseconds, rounded to the nanosecond (three decimals)."""
    return round(ns / 1000, 3)


def _meta(kind: str, pid: Any, tid: Any, **args: Any) -> dict[str, Any]:
    return {"ph": "M", "name": kind, "ts": 0, "pid": pid, "tid": tid, "args": args}


class _Builder:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.tracks: list[str] = []
        self.counters = 0

    def track(self, name: str) -> None:
        if name not in self.tracks:
            self.tracks.append(name)

    def counter(self, pid: int, name: str, unit: str, ts: float, value: Any) -> None:
        """One counter sample; Perfetto names the track ``"<name> <unit>"``."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            return
        if value != value:  # NaN is not JSON
            return
        self.events.append({"ph": "C", "name": name, "ts": ts, "pid": pid, "tid": pid,
                            "args": {unit: round(float(value), 3)}})
        self.counters += 1
        self.track(f"{name} {unit}")


# --------------------------------------------------------------------------- steps


def _flags_text(flags: int) -> list[str]:
    out = []
    for bit, name in ((FLAG_PARTIAL, "cut off by the end of the run"),
                      (FLAG_BACKWARD, "delimited by backward()"),
                      (FLAG_MANUAL, "delimited by prof.step()"),
                      (FLAG_PROFILED, "recorded under a heavy tool (times include its cost)"),
                      (FLAG_SKIPPED, "optimizer step skipped by GradScaler (inf/NaN gradients)")):
        if flags & bit:
            out.append(name)
    return out


def _add_steps(
    b: _Builder, run: Run, steps: np.ndarray, pid: int
) -> tuple[int, dict[int, int]]:
    """Step slices with their phase totals nested; returns (count, step number -> start ns)."""
    if len(steps) == 0:
        return 0, {}
    b.events.append(_meta("thread_name", pid, TID_STEPS,
                          name="steps (phases: each one's total in the step, laid end to end)"))
    b.events.append(_meta("thread_sort_index", pid, TID_STEPS, sort_index=-2))
    b.track("steps")
    # warm-up as the reports define it (on the analysed steps), to mark the steady state
    done = complete_steps(run.steps)
    warm = detect_warmup(done["dur_ns"].astype(np.float64) / 1e9) if len(done) else 0
    steady_from = int(done["step"][warm]) if len(done) > warm else None
    # columns as Python ints, converted once: a per-row dict would cost more than the JSON
    col = {name: steps[name].tolist() for name in steps.dtype.names}
    phase_cols = [(ph, col[f"{ph}_ns"]) for ph in PHASE_LAYOUT]
    extra = (("samples", "samples"), ("host_reads", "host_reads"), ("sync_n", "syncs"),
             ("gc_n", "gc_collections"))
    starts: dict[int, int] = {}
    append = b.events.append
    for i, n in enumerate(col["step"]):
        t0, dur, flags = col["t_start_ns"][i], col["dur_ns"][i], col["flags"][i]
        starts[n] = t0
        # the phases are the step's children; the step's args hold what they do not show
        args: dict[str, Any] = {"step": n}
        for field, label in extra:
            if col[field][i]:
                args[label] = col[field][i]
        if flags or (steady_from is not None and n < steady_from):
            notes = _flags_text(flags)
            if steady_from is not None and n < steady_from:
                notes.append("warm-up")
            args["notes"] = notes
        label = f"step {n} (cut off)" if flags & FLAG_PARTIAL else f"step {n}"
        append({"ph": "X", "cat": "step", "name": label, "ts": _us(t0), "dur": _us(dur),
                "pid": pid, "tid": TID_STEPS, "args": args})
        cursor = t0
        for ph, values in phase_cols:
            d = values[i]
            if d > 0:
                append({"ph": "X", "cat": "phase", "name": ph, "ts": _us(cursor), "dur": _us(d),
                        "pid": pid, "tid": TID_STEPS})
                cursor += d
    if steady_from is not None and steady_from in starts and warm:
        b.events.append({"ph": "i", "s": "p", "name": "steady state begins (end of warm-up)",
                         "ts": _us(starts[steady_from]), "pid": pid, "tid": TID_STEPS,
                         "args": {"step": steady_from}})
    return len(steps), starts


def _inside(window: tuple[float, float] | None, ts_us: float) -> bool:
    return window is None or window[0] <= ts_us <= window[1]


def _add_regions(
    b: _Builder, run: Run, pid: int, window: tuple[float, float] | None
) -> int:
    regions = [ev for ev in run.events if ev.get("kind") == "region"
               and isinstance(ev.get("t_start_ns"), int) and isinstance(ev.get("dur_ns"), int)
               and _inside(window, ev["t_start_ns"] / 1000)]
    if not regions:
        return 0
    b.events.append(_meta("thread_name", pid, TID_REGIONS, name="regions (prof.region)"))
    b.events.append(_meta("thread_sort_index", pid, TID_REGIONS, sort_index=-1))
    b.track("regions")
    for ev in regions:
        b.events.append({"ph": "X", "cat": "region", "name": str(ev.get("name")),
                         "ts": _us(ev["t_start_ns"]), "dur": _us(max(0, ev["dur_ns"])),
                         "pid": pid, "tid": TID_REGIONS, "args": {"step": ev.get("step")}})
    return len(regions)


# --------------------------------------------------------------------------- counters


def _add_samples(
    b: _Builder, run: Run, pid: int, origin_s: float, window: tuple[float, float] | None,
    process_only: bool = False,
) -> int:
    # one sampling period either side, so the counters cover the first and last step
    pad = float(run.meta.get("sample_interval_s") or 0.2) * 1e6
    padded = None if window is None else (window[0] - pad, window[1] + pad)
    samples = [s for s in load_samples(run.samples_path)
               if _inside(padded, (s["t"] - origin_s) * 1e6)]
    if not samples:
        return 0
    alive: set[str] = set()
    gpus_named: set[int] = set()
    system_named = False
    # no worker ever seen (num_workers=0): no workers group full of zeros
    any_workers = any(isinstance(s.get("workers"), dict) and s["workers"] for s in samples)
    workers_named = False
    # the workers' memory of their own (analysis/memory_growth.workers_private_bytes)
    workers_private = workers_private_bytes(samples)
    any_private = any(v is not None for v in workers_private)
    for row, s in enumerate(samples):
        ts = round((s["t"] - origin_s) * 1e6, 3)
        b.counter(pid, "process CPU", "%", ts, s.get("proc_cpu_pct"))
        rss = s.get("rss_bytes")
        b.counter(pid, "RSS", "MiB", ts, rss / MIB if isinstance(rss, int | float) else None)
        b.counter(pid, "context switches", "/s", ts, s.get("ctx_switches_ps"))
        if process_only:  # another rank of the run: the machine's counters come once
            continue

        workers = s.get("workers")
        if any_workers and isinstance(workers, dict):
            if not workers_named:
                b.events.append(_meta("process_name", PID_WORKERS, 0, name="DataLoader workers"))
                b.events.append(_meta("process_sort_index", PID_WORKERS, 0, sort_index=1))
                workers_named = True
            for wpid, pct in workers.items():
                b.counter(PID_WORKERS, f"worker {wpid} CPU", "%", ts, pct)
            for gone in alive - set(workers):
                b.counter(PID_WORKERS, f"worker {gone} CPU", "%", ts, 0.0)
            alive = set(workers)
            total = sum(v for v in workers.values() if isinstance(v, int | float))
            b.counter(PID_WORKERS, "workers total CPU", "%", ts, total)
            private = workers_private[row]
            wrss = s.get("workers_rss_bytes")
            if private is not None:  # not RSS: that counts a fork's shared pages per worker
                b.counter(PID_WORKERS, "workers private memory", "MiB", ts, private / MIB)
            elif not any_private and isinstance(wrss, int | float):
                b.counter(PID_WORKERS, "workers RSS (shared pages counted in each)", "MiB",
                          ts, wrss / MIB)

        cores = s.get("sys_cpu_pct")
        core_values = [c for c in cores if isinstance(c, int | float)] if isinstance(
            cores, list) else []
        if core_values or s.get("iowait_pct") is not None or s.get("disk_read_bps") is not None:
            if not system_named:
                b.events.append(_meta("process_name", PID_SYSTEM, 0, name="system"))
                b.events.append(_meta("process_sort_index", PID_SYSTEM, 0, sort_index=2))
                system_named = True
            if core_values:
                b.counter(PID_SYSTEM, "system CPU (mean of cores)", "%", ts,
                          sum(core_values) / len(core_values))
            b.counter(PID_SYSTEM, "iowait", "%", ts, s.get("iowait_pct"))
            rd = s.get("disk_read_bps")
            # MiB/s, as the HTML report's chart and every memory figure (it was decimal MB/s)
            b.counter(PID_SYSTEM, "disk read", "MiB/s",
                      ts, rd / MIB if isinstance(rd, int | float) else None)

        for dev in s.get("gpu") or []:
            if not isinstance(dev, dict) or not isinstance(dev.get("index"), int):
                continue
            i = dev["index"]
            gpid = PID_GPU0 + i
            if i not in gpus_named:
                b.events.append(_meta("process_name", gpid, 0, name=f"GPU {i} (NVML)"))
                b.events.append(_meta("process_sort_index", gpid, 0, sort_index=3 + i))
                gpus_named.add(i)
            b.counter(gpid, f"GPU {i} utilization", "%", ts, dev.get("util_pct"))
            mem = dev.get("mem_used_bytes")
            b.counter(gpid, f"GPU {i} memory used", "MiB", ts,
                      mem / MIB if isinstance(mem, int | float) else None)
            b.counter(gpid, f"GPU {i} power", "W", ts, dev.get("power_w"))
    return len(samples)


# --------------------------------------------------------------------------- deep traces


def find_deep_traces(run_dir: Path) -> list[Path]:
    """torch.profiler traces of a run: ``deep/*.json[.gz]`` and any ``*.pt.trace.json[.gz]``."""
    found = set()
    deep = run_dir / "deep"
    if deep.is_dir():
        found.update(p for p in deep.rglob("*") if p.is_file()
                     and (p.name.endswith(".json") or p.name.endswith(".json.gz")))
    found.update(p for p in run_dir.glob("*.pt.trace.json*")
                 if p.is_file() and p.name.endswith((".json", ".json.gz")))
    return sorted(found)


def _load_trace(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    if path.name.endswith(".gz"):
        raw = gzip.decompress(raw)
    data = orjson.loads(raw)
    if isinstance(data, list):  # the JSON array form of the format
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError("not a Chrome trace (no traceEvents list)")
    return data


def _number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _align(
    trace: dict[str, Any], events: list[dict[str, Any]], run: Run, starts_ns: dict[int, int],
    run_end_us: float,
) -> tuple[float | None, str, float | None]:
    """(shift in µs to add to the trace's ts, method, median ProfilerStep residual in ms)."""
    wall = run.meta.get("wall_origin_s")
    timed = [e for e in events if e.get("ph") != "M" and _number(e.get("ts"))]
    if not timed:
        return None, "empty", None
    psteps = []
    for e in timed:
        m = _PROFILER_STEP.match(str(e.get("name", "")))
        if m and e.get("ph") == "X" and int(m.group(1)) in starts_ns:
            psteps.append((int(m.group(1)), float(e["ts"])))
    base = trace.get("baseTimeNanoseconds")
    shift = None
    if _number(wall):
        if _number(base) and base > 0:
            shift = (int(base) - round(wall * 1e9)) / 1000
        elif statistics.median(float(e["ts"]) for e in timed) > 1e14:  # Unix-epoch µs
            shift = -wall * 1e6
    if shift is not None:
        lo = min(float(e["ts"]) for e in timed) + shift
        hi = max(float(e["ts"]) + float(e.get("dur") or 0) for e in timed) + shift
        margin = 60e6  # a minute either side: the sampler and the trace may outlive the steps
        if hi >= -margin and lo <= run_end_us + margin:
            residual = (
                statistics.median(ts + shift - starts_ns[n] / 1000 for n, ts in psteps) / 1000
                if psteps else None
            )
            return shift, "wall_clock", residual
    if psteps:
        shift = statistics.median(starts_ns[n] / 1000 - ts for n, ts in psteps)
        residual = statistics.median(ts + shift - starts_ns[n] / 1000 for n, ts in psteps) / 1000
        return shift, "profiler_steps", residual
    return None, "none", None


def _add_deep(
    b: _Builder, run: Run, train_pid: int, starts_ns: dict[int, int], run_end_us: float,
    window: tuple[float, float] | None, notes: list[str], *, offset_us: float = 0.0,
    flow_base: int = 0, label: str | None = None, pid_map: dict[Any, int] | None = None,
) -> list[dict[str, Any]]:
    """The run's torch.profiler traces, aligned on its steps (see :func:`_align`).

    For another rank: ``starts_ns`` and ``run_end_us`` are on the rank's own clock,
    ``offset_us`` moves them onto the main run's timeline, ``pid_map`` renames the rank's
    process when its pid was taken (ranks of other hosts), ``flow_base`` keeps flow ids
    of different traces apart, and ``label`` names the rank in the track names.
    """
    out = []
    pid_map = pid_map or {}
    for index, path in enumerate(find_deep_traces(run.path), start=flow_base):
        rel = str(path.relative_to(run.path))
        if label is not None:
            rel = f"rank {label}: {rel}"
        try:
            trace = _load_trace(path)
        except (OSError, ValueError, EOFError, gzip.BadGzipFile, orjson.JSONDecodeError) as exc:
            notes.append(f"{rel}: left out, unreadable ({exc})"[:300])
            continue
        events = [e for e in trace["traceEvents"] if isinstance(e, dict)
                  and isinstance(e.get("ph"), str) and "pid" in e]
        shift, method, residual = _align(trace, events, run, starts_ns, run_end_us)
        if shift is None:
            notes.append(f"{rel}: left out, it cannot be placed on the run's timeline "
                         "(no wall-clock base and no ProfilerStep#N matching the run's steps)")
            continue
        shift += offset_us
        if window is not None:
            span = [float(e["ts"]) + shift for e in events
                    if e["ph"] != "M" and _number(e.get("ts"))]
            if not span or max(span) < window[0] or min(span) > window[1]:
                continue  # outside the chosen steps
        kept = moved = 0
        for e in events:
            ph = e["ph"]
            if ph == "M":
                # our own name for the training process wins over Kineto's "python"
                if (pid_map.get(e.get("pid"), e.get("pid")) == train_pid
                        and e.get("name", "").startswith("process_")):
                    continue
                ev = {**e, "ts": 0}
            elif not _number(e.get("ts")):
                continue
            else:
                ev = {**e, "ts": round(float(e["ts"]) + shift, 3)}
                if ph == "X" and (not _number(e.get("dur")) or e["dur"] < 0):
                    ev["dur"] = 0
            ev.setdefault("tid", ev["pid"])
            if ev["pid"] in pid_map:
                ev["pid"] = pid_map[ev["pid"]]
            if (ph == "X" and ev["pid"] == train_pid
                    and _PROFILER_STEP.match(str(e.get("name", "")))):
                ev["tid"] = TID_PROFILER_STEPS
                moved += 1
            if ph in ("s", "t", "f") and isinstance(e.get("id"), int) and index:
                ev["id"] = e["id"] + index * 1_000_000_000  # flows of two traces stay apart
            b.events.append(ev)
            kept += 1
        steps_track = "torch.profiler steps" if label is None else (
            f"rank {label}: torch.profiler steps")
        if moved and steps_track not in b.tracks:
            b.events.append(_meta("thread_name", train_pid, TID_PROFILER_STEPS,
                                  name="torch.profiler steps (ProfilerStep#N)"))
            b.events.append(_meta("thread_sort_index", train_pid, TID_PROFILER_STEPS,
                                  sort_index=-1))
            b.track(steps_track)
        b.track(f"torch.profiler: {rel}")
        out.append({"file": rel, "events": kept, "alignment": method,
                    "residual_ms": None if residual is None else round(residual, 4)})
    return out


# --------------------------------------------------------------------------- entry point


def _select_steps(
    run: Run, first_step: int | None, last_step: int | None, max_steps: int, notes: list[str]
) -> tuple[np.ndarray, tuple[float, float] | None]:
    """The step records to export and, when that is not all of them, their time window (µs).
    A manual run's first step is one, its automatic prefix merged, as the summary counts it."""
    steps = merge_auto_prefix(run.steps)
    if first_step is not None:
        steps = steps[steps["step"] >= first_step]
    if last_step is not None:
        steps = steps[steps["step"] <= last_step]
    if len(steps) > max_steps:
        notes.append(
            f"{len(steps) - max_steps} steps after step {int(steps['step'][max_steps - 1])} "
            f"left out (at most {max_steps} steps per export; choose others with "
            "`trainprof export RUN --perfetto PATH --steps FIRST:LAST`)"
        )
        steps = steps[:max_steps]
    if len(steps) == len(merge_auto_prefix(run.steps)):
        return steps, None
    if len(steps) == 0:
        notes.append("no step in the chosen range")
        return steps, (0.0, 0.0)
    lo = int(steps["t_start_ns"][0])
    hi = int(steps["t_start_ns"][-1] + steps["dur_ns"][-1])
    return steps, (lo / 1000, hi / 1000)


def _rank_offset_ns(main: dict[str, Any], other: dict[str, Any]) -> int | None:
    """Where ``other``'s clock origin falls on ``main``'s timeline, in ns (None: unknown).

    On one host both origins are ``perf_counter`` readings of the same system-wide
    monotonic clock (CLOCK_MONOTONIC on Linux), so their difference is exact; across
    hosts only the wall clocks (``wall_origin_s``, NTP-synchronised at best) relate them.
    """
    if main.get("hostname") == other.get("hostname"):
        a, b = main.get("clock_origin_s"), other.get("clock_origin_s")
    else:
        a, b = main.get("wall_origin_s"), other.get("wall_origin_s")
    if not _number(a) or not _number(b):
        return None
    return round((float(b) - float(a)) * 1e9)


def _add_rank(
    b: _Builder, rank: tuple[str, Run], main: Run, sort_index: int,
    first_step: int | None, last_step: int | None, max_steps: int, notes: list[str],
) -> tuple[int, list[dict[str, Any]]]:
    """Another rank's steps, process counters and --deep traces, on the main run's
    timeline; (its steps, its merged traces)."""
    label, run = rank
    offset = _rank_offset_ns(main.meta, run.meta)
    if offset is None:
        notes.append(f"rank {label} left out: its record has no clock origin")
        return 0, []
    own_pid = run.meta.get("pid") if isinstance(run.meta.get("pid"), int) else None
    pid = own_pid
    if pid is None or pid == main.meta.get("pid"):  # another host's process of that pid
        pid = PID_FALLBACK_TRAIN + sort_index
    b.events.append(_meta("process_name", pid, 0, name=f"rank {label} (training process)"))
    b.events.append(_meta("process_sort_index", pid, 0, sort_index=sort_index))
    rank_notes: list[str] = []
    steps, window = _select_steps(run, first_step, last_step, max_steps, rank_notes)
    notes.extend(f"rank {label}: {n}" for n in rank_notes)
    shifted = steps.copy()
    shifted["t_start_ns"] += offset
    n, starts = _add_steps(b, run, shifted, pid)
    if window is not None:
        window = (window[0] + offset / 1000, window[1] + offset / 1000)
    origin = run.meta.get("clock_origin_s")
    if _number(origin):
        # samples carry the sampler's perf_counter: shift them as the steps
        _add_samples(b, run, pid, float(origin) - offset / 1e9, window, process_only=True)
    # its torch.profiler traces: aligned on its own steps, then moved as they were
    own_starts = {step: t - offset for step, t in starts.items()}
    end_us = _us(int(run.steps[-1]["t_start_ns"]) + int(run.steps[-1]["dur_ns"])) if len(
        run.steps) else 0.0
    deep = _add_deep(b, run, pid, own_starts, end_us, window, notes, offset_us=offset / 1000,
                     flow_base=100 * sort_index, label=label,
                     pid_map={own_pid: pid} if own_pid is not None and own_pid != pid else None)
    return n, deep


def export_perfetto(
    run: Run,
    path: Path,
    *,
    first_step: int | None = None,
    last_step: int | None = None,
    max_steps: int = MAX_STEPS,
    ranks: list[tuple[str, Run]] | None = None,
) -> dict[str, Any]:
    """Write the merged timeline of ``run`` to ``path`` (``.gz``: gzipped); return small stats.

    ``first_step``/``last_step`` (inclusive) choose a range of steps; regions, samples and
    deep traces are then kept to its time span. At most ``max_steps`` steps are written
    (each costs ~600 bytes of JSON with its phases; Perfetto's UI reads a few hundred MB).
    ``ranks``: the run's other ranks (``(label, Run)``, :mod:`trainprof.analysis.ranks`),
    each as a process group of its own with its steps and process counters, aligned on
    this run's clock (see :func:`_rank_offset_ns`): a straggler's long data wait lines up
    against the others' long backward.

    Stats: ``events`` written, ``steps``, ``regions``, ``samples``, ``counters`` (counter
    events), ``tracks`` (names), ``deep_traces`` (per merged trace: file, events, alignment
    method, residual_ms), ``bytes`` and ``notes`` (what was left out and why).
    """
    meta = run.meta
    origin_s = meta.get("clock_origin_s")
    if not _number(origin_s):
        raise UsageError(f"{run.path}: run.json has no clock_origin_s; cannot build a timeline")
    pid = meta.get("pid") if isinstance(meta.get("pid"), int) else PID_FALLBACK_TRAIN
    b = _Builder()
    notes: list[str] = []
    steps, window = _select_steps(run, first_step, last_step, max_steps, notes)
    main_label = next((lb for lb, r in ranks or [] if r.path == run.path), None)
    title = f"rank {main_label}" if main_label is not None else meta.get("name") or "run"
    b.events.append(_meta("process_name", pid, 0, name=f"{title} (training process)"))
    b.events.append(_meta("process_sort_index", pid, 0, sort_index=0))
    n_steps, starts = _add_steps(b, run, steps, pid)
    n_regions = _add_regions(b, run, pid, window)
    n_samples = _add_samples(b, run, pid, float(origin_s), window)
    if len(run.steps):
        last = run.steps[-1]
        run_end_us = _us(int(last["t_start_ns"]) + int(last["dur_ns"]))
    else:
        run_end_us = 0.0
    deep = _add_deep(b, run, pid, starts, run_end_us, window, notes, label=main_label)
    others = [r for r in ranks or [] if r[1].path != run.path]
    for i, rank in enumerate(others):
        n, rank_deep = _add_rank(b, rank, run, 10 + i, first_step, last_step, max_steps, notes)
        n_steps += n
        deep += rank_deep
    if not len(run.steps):
        notes.append("the run recorded no steps")
    if not n_samples and window is None:
        notes.append("no system samples in the run folder")
    document = {
        "traceEvents": b.events,
        "displayTimeUnit": "ms",
        "otherData": {
            "producer": f"trainprof {meta.get('trainprof_version', '')}".strip(),
            "run_dir": str(run.path),
            "run": meta.get("name"),
            "command": meta.get("command"),
            "time_zero": "clock_origin_s of the run (the step records' origin)",
            "wall_origin_s": meta.get("wall_origin_s"),
        },
    }
    data = orjson.dumps(document)
    if path.name.endswith(".gz"):
        data = gzip.compress(data, compresslevel=6)
    try:
        path.parent.mkdir(exist_ok=True)  # its folder, when missing (trainprof.output_paths)
        path.write_bytes(data)
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from exc
    return {
        "path": str(path),
        "events": len(b.events),
        "steps": n_steps,
        "regions": n_regions,
        "samples": n_samples,
        "counters": b.counters,
        "tracks": b.tracks,
        "deep_traces": deep,
        "bytes": len(data),
        "notes": notes,
    }
