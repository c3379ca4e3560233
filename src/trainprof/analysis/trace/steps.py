"""Training steps of a trace, moved onto the device timeline as the TensorBoard plugin does.

Definition (torch-tb-profiler 0.4.3, ``profiler/event_parser.py``, ``StepParser``):

* A step is a ``ProfilerStep#N`` CPU range (category ``Operator``/``cpu_op``, or
  ``user_annotation`` in newer traces; the ``gpu_user_annotation`` copy on the GPU row
  is not a step). With no such range, the whole CPU span (Python, CPU ops and steps,
  ``cpu_min_ts``..``cpu_max_ts``) is one window, named "0" by the plugin. Here user
  annotations count as CPU events too (as they do in the breakdown, see
  :mod:`.tb_breakdown`), so a window that starts with a DataLoader wait keeps it.
* ``_find_device_steps``: a runtime call belongs to the step whose host range contains
  it entirely; its device work (kernels, memcpys, memsets with the same correlation id)
  gives each step a device range [first device start, last device end].
* ``_update_steps_duration``: when any device work was matched, each step starts at
  ``max(previous step's end, its host start)`` (the first at its host start, or at the
  end of unmatched device work that finishes before step 0's device work) and ends at
  ``max(host end, device end)``. A step ending before it starts is set to zero length.
* Tail removal: the last steps with no matched device work are dropped, and the last
  step too when it matched fewer than 80% of the device events of the one before (the
  profiler stopped before all its kernels were recorded).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from trainprof.analysis.trace.correlate import Links
from trainprof.analysis.trace.events import Events, Kind

STEP_PREFIX = "ProfilerStep#"


@dataclass
class Steps:
    """The analysed steps (after the device-timeline move and tail removal), in ns."""

    names: list[str]
    starts: np.ndarray
    ends: np.ndarray
    host_starts: np.ndarray
    host_ends: np.ndarray
    found: bool  # ProfilerStep ranges exist (else one whole-trace window)
    on_device: bool  # steps were moved onto the device timeline
    removed_tail: list[str] = field(default_factory=list)

    @property
    def window(self) -> tuple[int, int]:
        return int(self.starts[0]), int(self.ends[-1])

    def __len__(self) -> int:
        return len(self.names)


def step_rows(ev: Events) -> np.ndarray:
    """Rows of CPU-side ``ProfilerStep#N`` ranges, sorted by start."""
    is_step_name = np.fromiter(
        (n.startswith(STEP_PREFIX) for n in ev.names), dtype=bool, count=len(ev.names)
    )
    cpu_side = (ev.kind == Kind.CPU_OP) | (ev.kind == Kind.ANNOTATION)
    rows = np.flatnonzero(cpu_side & is_step_name[ev.name])
    return rows[np.argsort(ev.ts[rows], kind="stable")]


def _step_label(name: str) -> str:
    label = name[len(STEP_PREFIX) :].strip()
    return label or name


def find_steps(ev: Events, links: Links) -> Steps | None:
    """The steps to analyse; None when the trace has no CPU or step events at all."""
    rows = step_rows(ev)
    found = rows.size > 0
    if found:
        names = [_step_label(ev.names[i]) for i in ev.name[rows].tolist()]
        host_s = ev.ts[rows].copy()
        host_e = ev.end[rows].copy()
    else:
        cpu = np.isin(ev.kind, [Kind.CPU_OP, Kind.PYTHON, Kind.ANNOTATION])
        if not cpu.any():
            cpu = ev.kind != Kind.TRACE  # no CPU events: the span of everything recorded
            if not cpu.any():
                return None
        names = ["0"]
        host_s = np.array([ev.ts[cpu].min()], dtype=np.int64)
        host_e = np.array([ev.end[cpu].max()], dtype=np.int64)
    n = host_s.size

    # Device work launched by runtime calls lying entirely inside a step's host range.
    dev = links.device_rows
    rt = links.runtime_of_device
    has_rt = rt >= 0
    dev_m, rt_m = dev[has_rt], rt[has_rt]
    rt_start, rt_end = ev.ts[rt_m], ev.end[rt_m]
    idx = np.searchsorted(host_s, rt_start, side="right") - 1
    inside = idx >= 0
    inside[inside] = rt_end[inside] <= host_e[idx[inside]]
    step_of = idx[inside]
    dev_in = dev_m[inside]
    matched = np.bincount(step_of, minlength=n)[:n] if step_of.size else np.zeros(n, np.int64)
    dev_min = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
    dev_max = np.full(n, np.iinfo(np.int64).min, dtype=np.int64)
    if step_of.size:
        np.minimum.at(dev_min, step_of, ev.ts[dev_in])
        np.maximum.at(dev_max, step_of, ev.end[dev_in])

    starts, ends = host_s.copy(), host_e.copy()
    on_device = bool(step_of.size)
    if on_device:
        prev_end = int(host_s[0])
        if matched[0] > 0:
            # device work not launched inside any step that ends before step 0's device work
            unmatched = np.ones(dev.size, dtype=bool)
            unmatched[np.flatnonzero(has_rt)[inside]] = False
            early = ev.end[dev[unmatched]]
            early = early[early < dev_min[0]]
            if early.size:
                prev_end = max(prev_end, int(early.max()))
        for i in range(n):
            start = max(prev_end, int(host_s[i]))
            end = int(host_e[i])
            if matched[i] == 0:
                end = max(end, start)
            else:
                end = max(end, int(dev_max[i]))
                if end < start:
                    end = start
            starts[i], ends[i] = start, end
            prev_end = end

    removed: list[str] = []
    keep = n
    if on_device and n > 1:
        last = np.flatnonzero(matched > 0)
        if last.size:
            i = int(last[-1])
            keep = i + 1
            if i > 0 and matched[i - 1] * 0.8 > matched[i]:
                keep = i
        removed = names[keep:]
    return Steps(
        names=names[:keep],
        starts=starts[:keep],
        ends=ends[:keep],
        host_starts=host_s[:keep],
        host_ends=host_e[:keep],
        found=found,
        on_device=on_device,
        removed_tail=removed,
    )
