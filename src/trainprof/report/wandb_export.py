"""A run, or a ``trainprof tune`` sweep, as Weights & Biases runs.

``trainprof export RUN_DIR --wandb [ENTITY/]PROJECT`` puts what the run recorded where many
teams already compare their training runs. Written with W&B's own client (``wandb.init``,
``Run.log``, ``wandb.Table``, ``wandb.Html``), so W&B's settings and environment variables
apply as usual: ``WANDB_MODE=offline`` writes the runs under ``./wandb/`` (``WANDB_DIR``) for a
later ``wandb sync``, ``WANDB_API_KEY`` / ``wandb login`` log in, ``WANDB_BASE_URL`` picks a
server.

**Runs.** One W&B run per trainprof record, named after the run folder:

* a run: one W&B run, job type ``run``;
* a run of several ranks: a run per rank (``<name>/rank<k>``, job type ``rank``), plus the
  launching process's own steps when it trained too (PyTorch Lightning's DDP launcher), all in
  the group ``<name>`` so that W&B's grouping shows them side by side;
* a ``trainprof tune`` folder: a run per trial (``<tune>/<trial folder>``, job type ``trial``),
  in the group ``<tune>``, with the trial's knob settings at the top of its **config** (W&B's
  runs table and parallel-coordinates panel then compare the trials by them) and its results
  (:data:`~trainprof.analysis.scalars.TUNE_METRICS`) in its summary.

**History.** The series of :mod:`trainprof.analysis.scalars` (the same names as the
TensorBoard export: ``step/time_ms``, ``phase/<name>_ms``, ``device/*``, ``process/*``,
``workers/*``, ``system/*``, ``gpu<i>/*``, ``ddp/*``), one row per step point, system sample or
DDP sample, in the order they happened. Every row carries ``trainprof/step`` (the step, or
the step in progress for a sample) and ``trainprof/time_s`` (seconds since the run's clock
origin), and its ``_timestamp`` is the wall time it happened, so W&B's "Wall Time" axis shows
the training's own clock, not the export's. Each series is plotted against ``trainprof/step``
(``define_metric`` with a ``step_metric``), not W&B's own row counter, so steps and samples
line up; pick ``trainprof/time_s`` as a panel's x-axis for time. Beyond
:data:`~trainprof.analysis.scalars.MAX_POINTS` points a series is written as bucket means (W&B's
line plots sample 1,500 points), with ``step/time_max_ms`` for each bucket's slowest step.

**Summary** (the runs table's columns), from the run's report: ``trainprof/status``,
``trainprof/exit_code``, ``trainprof/steps``, ``trainprof/warmup_steps``,
``trainprof/median_step_ms`` / ``p10`` / ``p90`` / ``mean``, ``trainprof/samples_per_s`` and
``trainprof/steps_per_s`` (the steady steps' throughput; steps/s is the one a run without a
DataLoader has),
``trainprof/breakdown/<phase>`` (the steady-state shares, adding up to 1),
``trainprof/compute/flops_per_step``, ``flops_per_s``, ``utilization`` (of the measured
matmul peak), ``model_utilization`` and ``datasheet_utilization`` (the MFU, on a GPU with a
datasheet figure), ``trainprof/attention/share``, ``s_per_step`` and ``saving_share``
(attention computed op by op, and the fused kernel's measured saving, where found),
``trainprof/finding_count`` and ``trainprof/top_finding`` (its title); each series' mean of
its points (``summary="mean"``), except the per-step series (``step/*``, ``phase/*``,
``device/*``): their mean over the report's steady steps, as ``trainprof/mean_step_ms`` is
(a mean of every point counted the warm-up), and none for ``step/batch_samples_per_s``, a
step's own rate, whose mean is no throughput. **Media**, in the
last row: ``trainprof/findings`` as a table (each finding's severity, category, cause, title,
estimated gain, evidence, fix, snippet and how to verify it) and ``trainprof/report``, the
self-contained HTML report of ``trainprof report --html``.

**Config**: ``trainprof`` (command, status, run folder, host, start time, versions),
``environment`` (the fingerprint) and ``dataloaders`` (each loader's configuration).

What W&B would add on its own is switched off, because it would describe the machine that
exports rather than the one that trained: its system metrics, machine metadata, git state,
code and requirements, and console capture. Each export makes new W&B runs (W&B has no way to
replace a run's history); delete the old ones in W&B to re-export.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from trainprof.analysis.scalars import (
    MAX_POINTS,
    PER_STEP_GROUPS,
    ScalarSeries,
    scalar_series,
    steady_means,
)
from trainprof.errors import UsageError, missing_package
from trainprof.report.html import html_page
from trainprof.report.terminal import fmt_evidence_value
from trainprof.store import Run

__all__ = ["Destination", "WandbExport", "parse_project", "write_run"]

#: Characters W&B refuses in a project name (its server's check).
_BAD_PROJECT_CHARS = set("/\\#?%:")

#: The x-axis of every series.
STEP_KEY = "trainprof/step"
TIME_KEY = "trainprof/time_s"


@functools.cache
def _wandb() -> ModuleType:
    """The wandb package, or a one-line error saying how to get it."""
    try:
        import wandb
    except ImportError as exc:
        raise missing_package("--wandb", "wandb", "wandb", exc) from exc
    return wandb


@dataclass(frozen=True)
class Destination:
    """Where the runs go: a W&B project, and its entity (None: the login's default)."""

    project: str
    entity: str | None = None


def parse_project(text: str) -> Destination:
    """``PROJECT`` or ``ENTITY/PROJECT``, checked as W&B checks a project name."""
    parts = str(text).split("/")
    if len(parts) > 2 or not all(p.strip() for p in parts):
        raise UsageError(f"--wandb: expected PROJECT or ENTITY/PROJECT, got {text!r}")
    project = parts[-1].strip()
    bad = sorted(_BAD_PROJECT_CHARS & set(project))
    if bad or len(project) > 128:
        why = f"it contains {' '.join(bad)}" if bad else "it is over 128 characters"
        raise UsageError(f"--wandb: {project!r} is not a W&B project name: {why}")
    return Destination(project, parts[0].strip() if len(parts) == 2 else None)


@dataclass
class WandbExport:
    """What one W&B run received, for the command to print."""

    name: str
    run_id: str
    url: str | None  #: None when offline
    sync_dir: Path | None  #: the offline run's folder (for ``wandb sync``)
    disabled: bool = False  #: WANDB_MODE=disabled: W&B kept nothing
    steps: int = 0
    samples: int = 0
    rows: int = 0
    bucket: int = 1


def _rows(series: ScalarSeries) -> list[dict[str, Any]]:
    """Every point as a history row, in the order they happened (steps first on a tie)."""
    points = sorted([(p.wall, 0, p) for p in series.steps]
                    + [(p.wall, 1, p) for p in series.samples]
                    + [(p.wall, 2, p) for p in series.ddp], key=lambda x: (x[0], x[1]))
    rows = []
    for wall, _, point in points:
        if not point.values:
            continue
        row: dict[str, Any] = {STEP_KEY: point.step, TIME_KEY: round(wall - series.origin, 6),
                               "_timestamp": wall}
        row.update(point.values)
        rows.append(row)
    return rows


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def run_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """The report's headline figures, for the runs table (see the module's docstring)."""
    out: dict[str, Any] = {"trainprof/status": summary.get("status"),
                           "trainprof/exit_code": summary.get("exit_code")}
    steps = summary.get("steps") or {}
    if isinstance(steps.get("count"), int):
        out["trainprof/steps"] = steps["count"]
    if isinstance(steps.get("warmup"), int):
        out["trainprof/warmup_steps"] = steps["warmup"]
    for key in ("median", "p10", "p90", "mean"):
        value = _number(steps.get(f"{key}_s"))
        if value is not None:
            out[f"trainprof/{key}_step_ms"] = value * 1e3
    # the run's throughput: steps/s too, the only one a run without a DataLoader has
    for key in ("samples_per_s", "steps_per_s"):
        rate = _number(summary.get(key))
        if rate is not None:
            out[f"trainprof/{key}"] = rate
    for phase, share in (summary.get("breakdown") or {}).items():
        if _number(share) is not None:
            out[f"trainprof/breakdown/{phase}"] = float(share)
    compute = summary.get("compute") or {}
    for key in ("flops_per_step", "flops_per_s", "utilization", "model_utilization",
                "datasheet_utilization"):
        value = _number(compute.get(key))
        if value is not None:
            out[f"trainprof/compute/{key}"] = value
    attention = summary.get("attention") or {}
    for key in ("share", "s_per_step", "saving_share"):
        value = _number(attention.get(key))
        if value is not None:
            out[f"trainprof/attention/{key}"] = value
    findings = summary.get("findings") or []
    out["trainprof/finding_count"] = len(findings)
    if findings:
        out["trainprof/top_finding"] = str(findings[0].get("title", ""))
    return {k: v for k, v in out.items() if v is not None}


_FINDING_COLUMNS = ["rank", "severity", "category", "cause", "title", "estimated_gain",
                    "evidence", "fix", "snippet", "verify"]


def findings_rows(findings: list[dict[str, Any]]) -> list[list[Any]]:
    """Each finding as a row of :data:`_FINDING_COLUMNS` (evidence as ``key=value`` pairs,
    as the terminal report writes them)."""
    rows = []
    for i, f in enumerate(findings, 1):
        evidence = f.get("evidence") or {}
        fix = f.get("fix") or {}
        rows.append([
            i, str(f.get("severity", "")), str(f.get("category", "")), str(f.get("cause") or ""),
            str(f.get("title", "")), _number(f.get("estimated_gain")),
            "; ".join(f"{k}={fmt_evidence_value(v)}" for k, v in evidence.items()),
            str(fix.get("text") or ""), str(fix.get("snippet") or ""), str(f.get("verify") or ""),
        ])
    return rows


def run_config(run: Run, summary: dict[str, Any] | None,
               settings: dict[str, Any] | None) -> dict[str, Any]:
    """A trial's knob settings at the top, then the run's command, environment, loaders."""
    meta = run.meta
    config: dict[str, Any] = dict(settings or {})
    config["trainprof"] = {
        "command": " ".join(map(str, meta.get("command") or [])),
        "status": meta.get("status"),
        "exit_code": meta.get("exit_code"),
        "run_dir": str(Path(run.path).resolve()),
        "host": meta.get("hostname"),
        "started_at": meta.get("started_at"),
        "version": meta.get("trainprof_version"),
        "schema_version": meta.get("schema_version"),
    }
    env = (summary or {}).get("environment") or meta.get("fingerprint")
    if isinstance(env, dict):
        config["environment"] = env
    loaders = (summary or {}).get("dataloaders") or meta.get("dataloaders")
    if isinstance(loaders, list) and loaders:
        config["dataloaders"] = loaders
    return config


def _settings(wandb: ModuleType) -> Any:
    """W&B's own capture switched off: it would describe this machine, not the training's."""
    return wandb.Settings(console="off", silent=True, disable_git=True, save_code=False,
                          x_disable_stats=True, x_disable_meta=True,
                          x_save_requirements=False)


def write_run(
    run: Run,
    destination: Destination,
    *,
    name: str,
    group: str | None = None,
    job_type: str = "run",
    summary: dict[str, Any] | None = None,
    settings: dict[str, Any] | None = None,
    metrics: dict[str, float] | None = None,
    max_points: int = MAX_POINTS,
) -> WandbExport:
    """One record as one new W&B run (see the module's docstring).

    ``summary``: the report that goes with the record (its headline figures, findings and HTML
    report are added); ``settings`` and ``metrics``: a tune trial's knobs and results.
    """
    wandb = _wandb()
    series = scalar_series(run, max_points)
    rows = _rows(series)
    try:
        wb = wandb.init(project=destination.project, entity=destination.entity, name=name,
                        group=group, job_type=job_type, tags=["trainprof"],
                        config=run_config(run, summary, settings), settings=_settings(wandb))
    except wandb.errors.Error as exc:
        raise UsageError(f"W&B could not start a run: {_one_line(exc)} (WANDB_MODE=offline "
                         "writes it here, for `wandb sync` later)") from exc
    ok = False
    try:
        wb.define_metric(STEP_KEY)
        wb.define_metric(TIME_KEY, step_metric=STEP_KEY)
        groups = {k.split("/", 1)[0] for row in rows for k in row if "/" in k}
        for prefix in sorted(groups - {"trainprof"}):
            # a per-step series' summary is the steady steps' mean, written below: W&B's
            # mean of every point counted the warm-up steps, and averaged per-step rates
            # (2,787 samples/s beside the report's 787)
            wb.define_metric(f"{prefix}/*", step_metric=STEP_KEY,
                             summary="none" if prefix in PER_STEP_GROUPS else "mean")
        for row in rows:
            wb.log(row)
        # after everything else: samples go on past the last complete step
        end = max([series.end_wall, *(row["_timestamp"] for row in rows)])
        last: dict[str, Any] = {STEP_KEY: series.last_step,
                                TIME_KEY: round(end - series.origin, 6), "_timestamp": end}
        last.update(metrics or {})
        if summary is not None:
            last["trainprof/findings"] = wandb.Table(
                columns=_FINDING_COLUMNS, data=findings_rows(summary.get("findings") or []))
            last["trainprof/report"] = wandb.Html(html_page(summary, run), inject=False)
        if len(last) > 3:
            wb.log(last)
            rows.append(last)
        if summary is not None:
            wb.summary.update(run_summary(summary))
            warmup = (summary.get("steps") or {}).get("warmup")
            if isinstance(warmup, int):
                wb.summary.update({tag: {"mean": value} for tag, value
                                   in steady_means(run, warmup).items()})
        wb.summary.update(metrics or {})
        local = wb.offline or wb.disabled
        result = WandbExport(name=name, run_id=wb.id, url=None if local else wb.url,
                             sync_dir=Path(wb.settings.sync_dir) if wb.offline else None,
                             disabled=bool(wb.disabled),
                             steps=series.step_count, samples=series.sample_count,
                             rows=len(rows), bucket=series.bucket)
        ok = True
    except wandb.errors.Error as exc:
        raise UsageError(f"W&B run {name}: {_one_line(exc)}") from exc
    finally:
        wb.finish(exit_code=0 if ok else 1)
    return result


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__
