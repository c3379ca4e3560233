"""A run, or a ``trainprof tune`` sweep, as TensorBoard event files.

``trainprof export RUN_DIR --tensorboard LOGDIR`` writes what the run recorded where people
already look at their training curves: ``tensorboard --logdir LOGDIR``. Written with
TensorBoard's own event writer (``tensorboard.summary.writer.event_file_writer``, the one
``torch.utils.tensorboard.SummaryWriter`` uses, without importing torch) and its own plugin
protobufs (text, hparams); nothing here re-implements the file format.

**Layout.** One TensorBoard *run* (a folder of event files) per trainprof record, named after
the run folder, so that several exports into one logdir sit side by side like any other runs:

* a run: ``LOGDIR/<run folder name>/``;
* a run of several ranks: ``LOGDIR/<name>/rank<k>/`` per rank, and ``LOGDIR/<name>/`` for the
  launching process's own steps when it trained too (PyTorch Lightning's DDP launcher);
* a ``trainprof tune`` folder: ``LOGDIR/<tune folder name>/<trial folder>/`` per trial, each
  tagged with its knob settings as **hparams** (TensorBoard's HParams dashboard then lists the
  trials with their mean step time and samples/s side by side), and the sweep's hparams
  configuration in ``LOGDIR/<tune folder name>/``.

**Scalars** (float32 tensors, as TF2's ``tf.summary.scalar`` writes them; the first event of
each tag carries the scalars plugin's metadata with a description of the series). Per step,
at the step's number and the wall time it ended:

* ``step/time_ms``, ``step/samples_per_s`` (the batch size seen / the step's time),
  ``step/syncs`` and ``step/sync_ms``, ``step/gc_collections`` where any step had one;
* ``phase/<name>_ms``: each phase's exclusive time in the step (the step record's phases,
  which add up to the step's time: :mod:`trainprof.schema`), for the phases the run had;
* ``device/<phase>_ms`` and ``device/idle_ms``: CUDA event times per step when recorded
  (:mod:`trainprof.capture.device_timer` defines them).

Per system sample (``≥ 5 Hz``; its wall time, and as its step the step in progress then, so
that the Step axis lines the samples up with the steps): ``process/cpu_pct``,
``process/rss_mib``, ``process/ctx_switches_per_s``, ``workers/cpu_pct`` (all DataLoader
workers together), ``workers/rss_mib``, ``system/cpu_pct`` (mean of the cores),
``system/iowait_pct``, ``system/disk_read_mb_per_s``, and per GPU ``gpu<i>/util_pct``,
``memory_used_mib``, ``power_w``, ``temperature_c``, ``sm_clock_mhz``.

Per DDP model, at each iteration DDP's reducer sampled (1-10, then every 100th; the
iteration number is the step's unless gradients accumulate): ``ddp/forward_ms``,
``backward_compute_ms``, ``allreduce_ms``, ``overlap_ms`` and ``exposed_ms``
(:mod:`trainprof.analysis.ddp` defines them).

Only complete steps are written: the cut-off last step and the steps recorded under a heavy
tool (``--deep``, ``--py``), whose times include the tool's cost, are left out, as every
trainprof report leaves them out (:func:`trainprof.analysis.steps.complete_steps`).

**Long runs.** TensorBoard's scalar dashboard keeps 1,000 points of a series by default
(``--samples_per_plugin``), so a million points would cost minutes to write and show nothing
more. Beyond :data:`MAX_POINTS` points a series is written as means of consecutive buckets
(each at its last step), and ``step/time_max_ms`` keeps each bucket's slowest step so that
spikes stay visible; the command says so.

**Text** (the Text dashboard, in the main record's run): ``trainprof/report``, the terminal
report exactly as ``trainprof report`` prints it; ``trainprof/findings``, each finding with its
evidence, fix, snippet and how to verify it, in Markdown; ``trainprof/environment``, the
fingerprint.

Exporting again replaces the event files an earlier export wrote (ours end in
``.trainprof``) and leaves every other file alone.
"""

from __future__ import annotations

import functools
import io
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from trainprof.analysis.steps import complete_steps
from trainprof.analysis.system import load_samples
from trainprof.errors import UsageError
from trainprof.schema import PHASE_NAMES
from trainprof.store import Run

__all__ = ["MAX_POINTS", "FILE_SUFFIX", "TensorBoardExport", "write_run", "write_tune_config"]

#: Points per series before buckets are averaged (10x what TensorBoard shows by default).
MAX_POINTS = 10_000

#: Our event files' name ends with this, so a second export can replace them (and only them).
FILE_SUFFIX = ".trainprof"

MIB = 1024 * 1024

_DESCRIPTIONS = {
    "step/time_ms": "Wall-clock time of the step (optimizer step to optimizer step), ms.",
    "step/time_max_ms": "Slowest step of each bucket of steps averaged into one point, ms.",
    "step/samples_per_s": "Batch size seen by the step (samples) / the step's time.",
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
    "workers/rss_mib": "Resident memory of all DataLoader workers together, MiB.",
    "system/cpu_pct": "Whole-machine CPU, mean over the cores, %.",
    "system/iowait_pct": "CPU time waiting for I/O, %.",
    "system/disk_read_mb_per_s": "Disk reads of the machine, MB/s.",
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


@functools.cache
def _tensorboard() -> SimpleNamespace:
    """TensorBoard's protobufs and writer, or a one-line error saying how to get them."""
    try:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
        from tensorboard.compat.proto.types_pb2 import DT_FLOAT
        from tensorboard.plugins.scalar.metadata import create_summary_metadata
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError as exc:
        raise UsageError(
            "--tensorboard needs the tensorboard package: pip install 'trainprof[tensorboard]' "
            f"({exc})"
        ) from exc
    return SimpleNamespace(Event=Event, Summary=Summary, TensorProto=TensorProto,
                           scalar_shape=TensorShapeProto(), DT_FLOAT=DT_FLOAT,
                           scalar_metadata=create_summary_metadata,
                           EventFileWriter=EventFileWriter)


@dataclass
class TensorBoardExport:
    """What one TensorBoard run received: its folder and counts, for the command to print."""

    logdir: Path
    label: str
    steps: int = 0
    samples: int = 0
    scalars: int = 0
    bucket: int = 1
    texts: list[str] = field(default_factory=list)


class _Writer:
    """An event file in one folder; values of one step go out as one event."""

    def __init__(self, folder: Path) -> None:
        self.tb = _tensorboard()
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob(f"events.out.tfevents.*{FILE_SUFFIX}"):
            old.unlink()  # an earlier export of this record: replaced, not shown twice
        self.file = self.tb.EventFileWriter(str(folder), filename_suffix=FILE_SUFFIX)
        self.described: set[str] = set()
        self.scalars = 0

    def _value(self, tag: str, number: float, description: str | None) -> Any:
        """A scalar as TF2's ``tf.summary.scalar`` writes it: a float32 tensor, the scalars
        plugin's metadata on a tag's first value. (A legacy ``simple_value`` would lose the
        description in TensorBoard's default Rust data server.)"""
        tb = self.tb
        value = tb.Summary.Value(tag=tag, tensor=tb.TensorProto(
            dtype=tb.DT_FLOAT, tensor_shape=tb.scalar_shape, float_val=[number]))
        if tag not in self.described:
            self.described.add(tag)
            text = description if description is not None else _DESCRIPTIONS.get(tag)
            value.metadata.CopyFrom(tb.scalar_metadata(display_name=tag, description=text or ""))
        return value

    def scalars_at(self, step: int, wall: float, values: Iterable[tuple[str, float]],
                   describe: Callable[[str], str | None] | None = None) -> None:
        out = []
        for tag, number in values:
            if number is None or not math.isfinite(number):
                continue
            out.append(self._value(tag, float(number), describe(tag) if describe else None))
        if out:
            self.scalars += len(out)
            self.file.add_event(self.tb.Event(wall_time=wall, step=int(step),
                                              summary=self.tb.Summary(value=out)))

    def summary(self, summary: Any, wall: float, step: int = 0) -> None:
        """A ready-made Summary protobuf (text, hparams)."""
        self.file.add_event(self.tb.Event(wall_time=wall, step=step, summary=summary))

    def close(self) -> None:
        self.file.close()


def _text_summary(tag: str, markdown: str, description: str) -> Any:
    from tensorboard.plugins.text.summary import text_pb

    return text_pb(tag, markdown, description=description)


# --------------------------------------------------------------------------- series


def _buckets(n: int, max_points: int) -> tuple[int, np.ndarray]:
    """(bucket size, start index of each bucket) for ``n`` points kept to ``max_points``."""
    size = max(1, math.ceil(n / max_points))
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


def _wall_origin(run: Run) -> float:
    """Wall-clock seconds at the step clock's origin (older records: the run's start)."""
    wall = run.meta.get("wall_origin_s")
    if isinstance(wall, int | float) and not isinstance(wall, bool):
        return float(wall)
    try:
        return float(Path(run.path / "run.json").stat().st_mtime)
    except OSError:
        return time.time()


def _step_series(run: Run, steps: np.ndarray) -> dict[str, np.ndarray]:
    """Per complete step: every scalar a step gets, as float arrays (NaN where none)."""
    dur = steps["dur_ns"].astype(np.float64)
    out: dict[str, np.ndarray] = {"step/time_ms": dur / 1e6}
    samples = steps["samples"].astype(np.float64)
    if samples.any():
        with np.errstate(invalid="ignore", divide="ignore"):
            out["step/samples_per_s"] = np.where((samples > 0) & (dur > 0),
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


def _describe(tag: str) -> str | None:
    if tag.startswith("phase/"):
        phase = tag[len("phase/"):-len("_ms")]
        return f"Exclusive time of the step in {_PHASE_TEXT.get(phase, phase)}, ms."
    if tag.startswith("gpu"):
        key = tag.split("/", 1)[1]
        for _, name, text, _scale in _GPU_FIELDS:
            if name == key:
                return text
    return _DESCRIPTIONS.get(tag)


def _write_steps(w: _Writer, run: Run, steps: np.ndarray, origin: float, max_points: int,
                 result: TensorBoardExport) -> None:
    if len(steps) == 0:
        return
    series = _step_series(run, steps)
    size, starts = _buckets(len(steps), max_points)
    ends = np.minimum(starts + size, len(steps)) - 1
    numbers = steps["step"][ends].tolist()
    walls = ((steps["t_start_ns"][ends] + steps["dur_ns"][ends]) / 1e9 + origin).tolist()
    reduced = {tag: _reduce(col, starts).tolist() for tag, col in series.items()}
    if size > 1:
        # a mean of samples/s would weigh a fast step like a slow one: samples / time instead
        if "step/samples_per_s" in series:
            samples = np.add.reduceat(steps["samples"].astype(np.float64), starts)
            seconds = np.add.reduceat(steps["dur_ns"].astype(np.float64), starts) / 1e9
            with np.errstate(invalid="ignore", divide="ignore"):
                reduced["step/samples_per_s"] = np.where(
                    (samples > 0) & (seconds > 0), samples / seconds, np.nan).tolist()
        reduced["step/time_max_ms"] = _reduce(series["step/time_ms"], starts, "max").tolist()
    tags = list(reduced)
    for i, (n, wall) in enumerate(zip(numbers, walls, strict=True)):
        w.scalars_at(n, wall, ((tag, reduced[tag][i]) for tag in tags), _describe)
    result.steps = len(steps)
    result.bucket = size


def _write_ddp(w: _Writer, run: Run, steps: np.ndarray, origin: float) -> None:
    """DDP's own timing of each sampled iteration (trainprof.capture.ddp_stats), at the
    iteration's number: a forward pass, the step's number unless gradients accumulate."""
    models = [m for m in run.meta.get("ddp") or [] if isinstance(m, dict)]
    end = (float(steps["t_start_ns"][-1] + steps["dur_ns"][-1]) / 1e9 if len(steps) else 0.0)
    for k, m in enumerate(models):
        prefix = "ddp" if len(models) == 1 else f"ddp{k}"
        for sample in m.get("samples") or []:
            if not (isinstance(sample, list) and len(sample) >= 5):
                continue
            it, fwd, bwd, comm, overlap = (int(x) for x in sample[:5])
            # DDP's figures are read once a second, not timed here: at the run's clock, when
            # the iteration's step ended if it is known, else at the run's end
            at = np.searchsorted(steps["step"], it) if len(steps) else 0
            wall = (origin + float(steps["t_start_ns"][at] + steps["dur_ns"][at]) / 1e9
                    if len(steps) and at < len(steps) and steps["step"][at] == it
                    else origin + end)
            w.scalars_at(it, wall, ((f"{prefix}/{name}", value / 1e6) for name, value in (
                ("forward_ms", fwd), ("backward_compute_ms", bwd), ("allreduce_ms", comm),
                ("overlap_ms", overlap), ("exposed_ms", max(0, comm - overlap)))),
                lambda tag: _DDP_TEXT.get(tag.split("/", 1)[1]))


_DDP_TEXT = {
    "forward_ms": "DDP's forward compute on this sampled iteration (its reducer's timer), ms.",
    "backward_compute_ms": "DDP's backward compute, to the last gradient ready, ms.",
    "allreduce_ms": "DDP's gradient all-reduce, first bucket's launch to the last's end, ms.",
    "overlap_ms": "The all-reduce's part that ran while the backward still computed, ms.",
    "exposed_ms": "The all-reduce's part the step waited for after the backward, ms.",
}


def _sample_values(s: dict[str, Any]) -> list[tuple[str, float]]:
    def num(x: Any) -> float | None:
        return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else None

    out: list[tuple[str, float | None]] = [
        ("process/cpu_pct", num(s.get("proc_cpu_pct"))),
        ("process/rss_mib", None if num(s.get("rss_bytes")) is None else s["rss_bytes"] / MIB),
        ("process/ctx_switches_per_s", num(s.get("ctx_switches_ps"))),
        ("system/iowait_pct", num(s.get("iowait_pct"))),
        ("system/disk_read_mb_per_s",
         None if num(s.get("disk_read_bps")) is None else s["disk_read_bps"] / 1e6),
    ]
    workers = s.get("workers")
    if isinstance(workers, dict) and workers:
        out.append(("workers/cpu_pct", sum(v for v in workers.values() if num(v) is not None)))
        out.append(("workers/rss_mib", None if num(s.get("workers_rss_bytes")) is None
                    else s["workers_rss_bytes"] / MIB))
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


def _write_samples(w: _Writer, run: Run, steps: np.ndarray, origin: float, max_points: int,
                   result: TensorBoardExport) -> None:
    samples = [s for s in load_samples(run.samples_path)
               if isinstance(s.get("t"), int | float)]
    if not samples:
        return
    clock = run.meta.get("clock_origin_s")
    clock = float(clock) if isinstance(clock, int | float) else float(samples[0]["t"])
    rel_ns = np.array([(s["t"] - clock) * 1e9 for s in samples])
    # the step in progress at each sample (0 before the first step)
    if len(steps):
        at = np.searchsorted(steps["t_start_ns"].astype(np.float64), rel_ns, side="right") - 1
        numbers = np.where(at >= 0, steps["step"][np.maximum(at, 0)], 0)
    else:
        numbers = np.zeros(len(samples), dtype=np.int64)
    rows = [_sample_values(s) for s in samples]
    tags = sorted({tag for row in rows for tag, _ in row})
    table = {tag: np.full(len(rows), np.nan) for tag in tags}
    for i, row in enumerate(rows):
        for tag, value in row:
            table[tag][i] = value
    size, starts = _buckets(len(rows), max_points)
    ends = np.minimum(starts + size, len(rows)) - 1
    reduced = {tag: _reduce(col, starts).tolist() for tag, col in table.items()}
    for i, end in enumerate(ends.tolist()):
        w.scalars_at(int(numbers[end]), origin + rel_ns[end] / 1e9,
                     ((tag, reduced[tag][i]) for tag in tags), _describe)
    result.samples = len(samples)


# --------------------------------------------------------------------------- text


def report_text(summary: dict[str, Any]) -> str:
    """The terminal report, as ``trainprof report`` prints it, for a Markdown code block."""
    from trainprof.report.terminal import render_summary

    buffer = io.StringIO()
    render_summary(summary, file=buffer)
    return buffer.getvalue().rstrip()


def findings_markdown(findings: list[dict[str, Any]]) -> str:
    """Each finding: title, severity and gain, evidence, fix with its snippet, verify."""
    if not findings:
        return "No finding: nothing in this run's measurements points at a change to make."
    parts = []
    for i, f in enumerate(findings, 1):
        gain = f.get("estimated_gain")
        gain_txt = (f"could save up to {gain:.0%} of step time" if isinstance(gain, int | float)
                    and gain > 0 else "no step-time gain claimed")
        lines = [f"### {i}. {f.get('title', '')}",
                 f"**{f.get('severity', '')}** · `{f.get('category', '')}`"
                 + (f" / `{f['cause']}`" if f.get("cause") else "") + f" · {gain_txt}", ""]
        evidence = f.get("evidence") or {}
        if evidence:
            lines.append("evidence: " + ", ".join(
                f"`{k}`={_short(v)}" for k, v in evidence.items() if not isinstance(v, dict)))
            lines.append("")
        fix = f.get("fix") or {}
        if fix.get("text"):
            lines += [f"**fix**: {fix['text']}", ""]
        if fix.get("snippet"):
            lines += ["```python", str(fix["snippet"]).rstrip(), "```", ""]
        if f.get("verify"):
            lines += [f"**verify**: `{f['verify']}`", ""]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def environment_markdown(run: Run, summary: dict[str, Any]) -> str:
    """The run's command and environment fingerprint as a two-column table."""
    env = summary.get("environment") or run.meta.get("fingerprint") or {}
    rows = [("command", " ".join(map(str, run.meta.get("command") or [])) or "?"),
            ("status", f"{summary.get('status')} (exit code {summary.get('exit_code')})"),
            ("started", str(run.meta.get("started_at", "?")))]
    rows += [(str(k), _short(v)) for k, v in env.items() if not isinstance(v, dict | list)]
    for k, v in env.items():
        if isinstance(v, dict):
            rows += [(f"{k}.{kk}", _short(vv)) for kk, vv in v.items()]
    return "| | |\n|---|---|\n" + "\n".join(f"| {_cell(a)} | {_cell(b)} |" for a, b in rows)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _write_texts(w: _Writer, run: Run, summary: dict[str, Any], wall: float,
                 result: TensorBoardExport) -> None:
    texts = [
        ("trainprof/report", "```\n" + report_text(summary) + "\n```",
         "The run's report, as `trainprof report` prints it."),
        ("trainprof/findings", findings_markdown(summary.get("findings") or []),
         "What to change, highest estimated gain first."),
        ("trainprof/environment", environment_markdown(run, summary),
         "The command and the environment fingerprint."),
    ]
    for tag, markdown, description in texts:
        w.summary(_text_summary(tag, markdown, description), wall)
        result.texts.append(tag)


# --------------------------------------------------------------------------- entry points


def write_run(
    run: Run,
    folder: Path,
    *,
    label: str,
    summary: dict[str, Any] | None = None,
    hparams: dict[str, Any] | None = None,
    metrics: dict[str, float] | None = None,
    max_points: int = MAX_POINTS,
) -> TensorBoardExport:
    """One record into one TensorBoard run folder (see the module's docstring).

    ``summary``: the report to put in the Text dashboard (the main record only).
    ``hparams`` and ``metrics``: a tune trial's knob settings and results, for HParams.
    """
    result = TensorBoardExport(logdir=folder, label=label)
    w = _Writer(folder)
    try:
        origin = _wall_origin(run)
        steps = complete_steps(run.steps)
        if hparams is not None:
            from tensorboard.plugins.hparams.summary_v2 import hparams_pb

            w.summary(hparams_pb(hparams, trial_id=label, start_time_secs=origin), origin)
        _write_steps(w, run, steps, origin, max_points, result)
        _write_samples(w, run, steps, origin, max_points, result)
        _write_ddp(w, run, steps, origin)
        if metrics:
            last = int(steps["step"][-1]) if len(steps) else 0
            w.scalars_at(last, origin + (float(steps["t_start_ns"][-1] + steps["dur_ns"][-1])
                                         / 1e9 if len(steps) else 0.0),
                         metrics.items(), lambda tag: _TUNE_METRICS.get(tag))
        if summary is not None:
            _write_texts(w, run, summary, origin, result)
        result.scalars = w.scalars
    finally:
        w.close()
    return result


#: A tune trial's results, the metrics of the HParams dashboard.
_TUNE_METRICS = {
    "tune/mean_step_ms": "The trial's mean steady-state step time (what trainprof tune "
                         "compares), ms.",
    "tune/median_step_ms": "The trial's median steady-state step time, ms.",
    "tune/samples_per_s": "The trial's samples per second over its steady-state steps.",
}


def tune_metrics(trial: dict[str, Any], summary: dict[str, Any]) -> dict[str, float]:
    """A tune trial's HParams metrics, from tune.json's trial entry and the run's summary."""
    out: dict[str, float] = {}
    if isinstance(trial.get("mean_s"), int | float):
        out["tune/mean_step_ms"] = float(trial["mean_s"]) * 1e3
    if isinstance(trial.get("median_s"), int | float):
        out["tune/median_step_ms"] = float(trial["median_s"]) * 1e3
    if isinstance(summary.get("samples_per_s"), int | float):
        out["tune/samples_per_s"] = float(summary["samples_per_s"])
    return out


def write_tune_config(folder: Path, knobs: dict[str, list[str]], wall: float) -> None:
    """The sweep's hparams configuration: its knobs, their values, and the metrics."""
    from tensorboard.plugins.hparams import summary_v2 as hp

    config = hp.hparams_config_pb(
        hparams=[hp.HParam(name, hp.Discrete(values)) for name, values in knobs.items()],
        metrics=[hp.Metric(tag, description=text) for tag, text in _TUNE_METRICS.items()],
        time_created_secs=wall,
    )
    w = _Writer(folder)
    try:
        w.summary(config, wall)
    finally:
        w.close()
