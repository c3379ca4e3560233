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
each tag carries the scalars plugin's metadata with a description of the series): the series
:mod:`trainprof.analysis.scalars` defines, each point an event at its step and wall time:
``step/*`` and ``phase/*`` per complete step, ``device/*`` CUDA event times, system samples
(``process/*``, ``workers/*``, ``system/*``, ``gpu<i>/*``) at the step in progress, and DDP's
sampled iterations (``ddp/*``). Beyond :data:`~trainprof.analysis.scalars.MAX_POINTS` points
a series is written as bucket means (TensorBoard keeps 1,000 points of a series by default,
``--samples_per_plugin``), with ``step/time_max_ms`` for each bucket's slowest step; the
command says so.

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
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from trainprof.analysis.scalars import MAX_POINTS, TUNE_METRICS, describe, scalar_series
from trainprof.errors import missing_package
from trainprof.report.command_lines import verify_parts
from trainprof.report.terminal import fmt_evidence_value
from trainprof.store import Run

__all__ = ["MAX_POINTS", "FILE_SUFFIX", "TensorBoardExport", "write_run", "write_tune_config"]

#: Our event files' name ends with this, so a second export can replace them (and only them).
FILE_SUFFIX = ".trainprof"


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
        raise missing_package("--tensorboard", "tensorboard", "tensorboard", exc) from exc
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

    def _value(self, tag: str, number: float) -> Any:
        """A scalar as TF2's ``tf.summary.scalar`` writes it: a float32 tensor, the scalars
        plugin's metadata on a tag's first value. (A legacy ``simple_value`` would lose the
        description in TensorBoard's default Rust data server.)"""
        tb = self.tb
        value = tb.Summary.Value(tag=tag, tensor=tb.TensorProto(
            dtype=tb.DT_FLOAT, tensor_shape=tb.scalar_shape, float_val=[number]))
        if tag not in self.described:
            self.described.add(tag)
            value.metadata.CopyFrom(tb.scalar_metadata(display_name=tag,
                                                       description=describe(tag) or ""))
        return value

    def scalars_at(self, step: int, wall: float, values: Iterable[tuple[str, float]]) -> None:
        out = [self._value(tag, float(number)) for tag, number in values
               if number is not None and math.isfinite(number)]
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


# --------------------------------------------------------------------------- text


def report_text(summary: dict[str, Any]) -> str:
    """The terminal report, as ``trainprof report`` prints it, for a Markdown code block."""
    from trainprof.report.terminal import render_summary

    buffer = io.StringIO()
    render_summary(summary, file=buffer)
    return buffer.getvalue().rstrip()


def findings_markdown(findings: list[dict[str, Any]]) -> str:
    """Each finding: title, severity and gain, evidence (as the terminal report shows it),
    fix with its snippet, verify."""
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
            lines.append("evidence: " + "; ".join(
                f"`{k}`={_cell(fmt_evidence_value(v))}" for k, v in evidence.items()))
            lines.append("")
        fix = f.get("fix") or {}
        if fix.get("text"):
            lines += [f"**fix**: {fix['text']}", ""]
        if fix.get("snippet"):
            lines += ["```python", str(fix["snippet"]).rstrip(), "```", ""]
        if f.get("verify"):
            lines += _verify_markdown(f)
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def _verify_markdown(finding: dict[str, Any]) -> list[str]:
    """The verify line as the terminal prints it: its prose as text, each command in a code
    block of its own (the whole line in one inline code span broke at the backticks it
    quotes commands with)."""
    lines: list[str] = []
    label = "**verify**:"
    for part, is_command in verify_parts(finding):
        if is_command:
            if label:
                lines += [label, ""]
                label = ""
            lines += ["```sh", part, "```", ""]
        else:
            lines += [f"{label} {part}" if label else part, ""]
            label = ""
    return lines


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
    series = scalar_series(run, max_points)
    w = _Writer(folder)
    try:
        origin = series.origin
        if hparams is not None:
            from tensorboard.plugins.hparams.summary_v2 import hparams_pb

            w.summary(hparams_pb(hparams, trial_id=label, start_time_secs=origin), origin)
        for point in (*series.steps, *series.samples, *series.ddp):
            w.scalars_at(point.step, point.wall, point.values)
        if metrics:
            w.scalars_at(series.last_step, series.end_wall, metrics.items())
        if summary is not None:
            _write_texts(w, run, summary, origin, result)
        result.steps, result.bucket = series.step_count, series.bucket
        result.samples = series.sample_count
        result.scalars = w.scalars
    finally:
        w.close()
    return result


def write_tune_config(folder: Path, knobs: dict[str, list[str]], wall: float) -> None:
    """The sweep's hparams configuration: its knobs, their values, and the metrics."""
    from tensorboard.plugins.hparams import summary_v2 as hp

    config = hp.hparams_config_pb(
        hparams=[hp.HParam(name, hp.Discrete(values)) for name, values in knobs.items()],
        metrics=[hp.Metric(tag, description=text) for tag, text in TUNE_METRICS.items()],
        time_created_secs=wall,
    )
    w = _Writer(folder)
    try:
        w.summary(config, wall)
    finally:
        w.close()
