"""`trainprof export --wandb`: offline W&B runs read back from W&B's own run files.

W&B is run for real in offline mode (``WANDB_MODE=offline``, every W&B folder in the test's
tmp), and its ``run-<id>.wandb`` file is read back (``wandb_records``): the history rows
against the run's step records, the summary against ``trainprof report --json``, the config,
the findings table and HTML report files, and what W&B must not add (its own system metrics
and machine metadata, which would describe the exporting machine).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import as_launch_folder, trainprof

pytest.importorskip("wandb")
from wandb_records import OfflineRun, offline_runs  # noqa: E402

from trainprof.analysis.scalars import scalar_series  # noqa: E402
from trainprof.analysis.steps import complete_steps  # noqa: E402
from trainprof.errors import UsageError  # noqa: E402
from trainprof.report import wandb_export  # noqa: E402
from trainprof.store import load_run  # noqa: E402


def wandb_env(root: Path, mode: str = "offline") -> dict[str, str]:
    """W&B offline, and every folder it would write (runs, cache, config) under ``root``."""
    return {"WANDB_MODE": mode, "WANDB_DIR": str(root), "WANDB_CACHE_DIR": str(root / "cache"),
            "WANDB_CONFIG_DIR": str(root / "config"), "WANDB_DATA_DIR": str(root / "data"),
            "WANDB_ARTIFACT_DIR": str(root / "artifacts")}


@pytest.fixture(scope="module")
def exported(export_run_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """conftest's export run (a worker, 8 samples a step, a deep window) exported once."""
    root = tmp_path_factory.mktemp("wandb")
    res = trainprof("export", str(export_run_dir), "--wandb", "perf-team/trainprof-tests",
                    cwd=root, env=wandb_env(root))
    assert res.returncode == 0, res.stderr
    (run,) = offline_runs(root)
    report = trainprof("report", str(export_run_dir), "--json", cwd=root)
    assert report.returncode == 0, report.stderr
    return {"res": res, "run": run, "summary": json.loads(report.stdout),
            "record": load_run(export_run_dir)}


def _column(run: OfflineRun, key: str) -> tuple[list[int], np.ndarray, np.ndarray]:
    rows = [r for r in run.history if key in r]
    return ([r["trainprof/step"] for r in rows], np.array([r[key] for r in rows], float),
            np.array([r["_timestamp"] for r in rows]))


def test_steps_and_samples_are_history_rows_on_the_runs_own_clock(exported) -> None:
    res, run, record = exported["res"], exported["run"], exported["record"]
    assert res.stdout == ""
    assert f"wandb sync {run.folder}" in res.stderr
    assert run.run.display_name == "run" and run.run.project == "trainprof-tests"
    assert run.run.entity == "perf-team" and run.run.job_type == "run"
    assert list(run.run.tags) == ["trainprof"] and run.run.run_group == ""

    steps = complete_steps(record.steps)
    assert len(steps) >= 30
    numbers, times, stamps = _column(run, "step/time_ms")
    assert numbers == steps["step"].tolist()  # every complete step, at its number
    np.testing.assert_allclose(times, steps["dur_ns"] / 1e6, rtol=1e-12)
    # W&B's wall time is when the step ended in training, not when it was exported
    ended = record.meta["wall_origin_s"] + (steps["t_start_ns"] + steps["dur_ns"]) / 1e9
    np.testing.assert_allclose(stamps, ended, atol=1e-6)
    phases = sorted({k for r in run.history for k in r if k.startswith("phase/")})
    assert {"phase/data_wait_ms", "phase/forward_ms", "phase/backward_ms",
            "phase/optimizer_ms", "phase/other_ms"} <= set(phases)
    rows = [r for r in run.history if "step/time_ms" in r]
    np.testing.assert_allclose([sum(r.get(p, 0.0) for p in phases) for r in rows], times,
                               rtol=1e-9)
    _, rate, _ = _column(run, "step/batch_samples_per_s")
    np.testing.assert_allclose(rate, 8 / (steps["dur_ns"] / 1e9), rtol=1e-12)

    # the system samples: a row each, at the step in progress, rows in time order
    sample_steps, cpu, _ = _column(run, "process/cpu_pct")
    series = scalar_series(record)
    with_cpu = [p for p in series.samples if any(t == "process/cpu_pct" for t, _ in p.values)]
    assert len(cpu) == len(with_cpu) >= 5 and cpu.max() > 10
    assert sample_steps == [p.step for p in with_cpu]
    _, workers, _ = _column(run, "workers/cpu_pct")
    assert workers.max() > 0
    order = [r["_timestamp"] for r in run.history]
    assert order == sorted(order)
    assert all("trainprof/step" in r and "trainprof/time_s" in r for r in run.history)
    # every series against trainprof/step, not W&B's row counter
    for group in ("step", "phase", "process", "workers", "system"):
        assert run.metrics[f"{group}/*"].step_metric == "trainprof/step"
    assert run.metrics["trainprof/time_s"].step_metric == "trainprof/step"
    # W&B's own capture would describe the exporting machine: none of it
    assert not {"stats", "environment", "output_raw"} & run.kinds


def test_summary_config_findings_and_report_come_from_the_runs_report(exported) -> None:
    run, summary = exported["run"], exported["summary"]
    s = run.summary
    steps = summary["steps"]
    assert s["trainprof/status"] == "finished" and s["trainprof/exit_code"] == 0
    assert s["trainprof/steps"] == steps["count"]
    assert s["trainprof/median_step_ms"] == pytest.approx(steps["median_s"] * 1e3, rel=1e-12)
    assert s["trainprof/p90_step_ms"] == pytest.approx(steps["p90_s"] * 1e3, rel=1e-12)
    assert s["trainprof/samples_per_s"] == pytest.approx(summary["samples_per_s"], rel=1e-12)
    shares = {k.rsplit("/", 1)[1]: v for k, v in s.items()
              if k.startswith("trainprof/breakdown/")}
    assert shares == pytest.approx(summary["breakdown"], rel=1e-12)
    assert sum(shares.values()) == pytest.approx(1.0)
    compute = summary["compute"]  # the FLOPs of a step and their share of the peak
    assert s["trainprof/compute/flops_per_step"] == compute["flops_per_step"] > 0
    assert s["trainprof/compute/utilization"] == pytest.approx(compute["utilization"])
    findings = summary["findings"]
    assert findings and s["trainprof/finding_count"] == len(findings)
    assert s["trainprof/top_finding"] == findings[0]["title"]
    assert s["trainprof/steps_per_s"] == pytest.approx(summary["steps_per_s"], rel=1e-12)
    # a per-step series' mean in the runs table is the steady steps', as the report's: the
    # mean of every point counted the warm-up (14.19 ms beside the report's 11.95 ms)
    assert s["step/time_ms"]["mean"] == pytest.approx(steps["mean_s"] * 1e3, rel=1e-9)
    assert s["trainprof/mean_step_ms"] == pytest.approx(s["step/time_ms"]["mean"], rel=1e-9)
    phases = {k: v["mean"] for k, v in s.items() if k.startswith("phase/")}
    assert sum(phases.values()) == pytest.approx(steps["mean_s"] * 1e3, rel=1e-6)
    # no mean of per-step rates (2,787 beside a throughput of 787 samples/s)
    assert "step/batch_samples_per_s" not in s and "step/samples_per_s" not in s
    # the other series: the mean of their points
    cpu = [r["process/cpu_pct"] for r in run.history if "process/cpu_pct" in r]
    assert s["process/cpu_pct"]["mean"] == pytest.approx(np.mean(cpu), rel=1e-9)

    config = run.config
    assert config["trainprof"]["status"] == "finished"
    assert config["trainprof"]["command"].endswith("train.py")
    assert config["trainprof"]["run_dir"] == str(exported["record"].path.resolve())
    assert config["environment"]["python"] == summary["environment"]["python"]
    (loader,) = config["dataloaders"]
    assert loader["num_workers"] == 1 and loader["batch_size"] == 8

    table = json.loads(run.media("trainprof/findings").read_text())
    assert table["columns"][:6] == ["rank", "severity", "category", "cause", "title",
                                    "estimated_gain"]
    assert [row[4] for row in table["data"]] == [f["title"] for f in findings]
    assert [row[1] for row in table["data"]] == [f["severity"] for f in findings]
    verify = table["columns"].index("verify")
    assert [row[verify] for row in table["data"]] == [f.get("verify") or "" for f in findings]
    # the evidence as the terminal report writes it: every key, floats to 3 digits
    column = table["columns"].index("evidence")
    for row, f in zip(table["data"], findings, strict=True):
        pairs = row[column].split("; ")
        assert [p.split("=", 1)[0] for p in pairs] == list(f["evidence"]), row[column]
        for key, value in f["evidence"].items():
            if isinstance(value, float):
                assert f"{key}={value:.3g}" in pairs
    html = run.media("trainprof/report").read_text()
    assert html.lstrip().lower().startswith("<!doctype html") and "Verdict" in html


def test_ranks_are_runs_of_one_group_and_the_report_goes_with_the_main_rank(
    export_run_dir: Path, tmp_path: Path
) -> None:
    """A torchrun-style folder (no record of its own, ``ranks/<k>/``)."""
    launch = as_launch_folder(export_run_dir, tmp_path / "launch")
    res = trainprof("export", str(launch), "--wandb", "ranks", cwd=tmp_path,
                    env=wandb_env(tmp_path))
    assert res.returncode == 0, res.stderr
    runs = offline_runs(tmp_path)
    assert sorted(r.run.display_name for r in runs) == ["launch/rank0", "launch/rank1"]
    assert {r.run.run_group for r in runs} == {"launch"}
    assert {r.run.job_type for r in runs} == {"rank"}
    assert sorted("trainprof/report/path" in r.summary for r in runs) == [False, True]
    assert "[1/2] W&B run launch/rank0" in res.stderr
    assert res.stderr.count("wandb sync") == 1  # one command for both


def test_a_long_run_is_bucket_means_with_each_buckets_slowest_step(exported) -> None:
    """The rows a run of many steps gets (without W&B: the rows are what is logged)."""
    record = exported["record"]
    steps = complete_steps(record.steps)
    series = scalar_series(record, max_points=7)
    rows = wandb_export._rows(series)
    step_rows = [r for r in rows if "step/time_ms" in r]
    size = series.bucket
    assert size == -(-len(steps) // 7) and len(step_rows) == len(range(0, len(steps), size))
    dur = steps["dur_ns"] / 1e6
    starts = range(0, len(steps), size)
    np.testing.assert_allclose([r["step/time_ms"] for r in step_rows],
                               [dur[s:s + size].mean() for s in starts], rtol=1e-12)
    np.testing.assert_allclose([r["step/time_max_ms"] for r in step_rows],
                               [dur[s:s + size].max() for s in starts], rtol=1e-12)
    assert len([r for r in rows if "process/cpu_pct" in r]) <= 7


def test_errors_are_one_line(export_run_dir: Path, tmp_path: Path, monkeypatch) -> None:
    for bad, why in (("a/b/c", "expected PROJECT or ENTITY/PROJECT"),
                     ("x:y", "'x:y' is not a W&B project name: it contains :"),
                     ("team/", "expected PROJECT or ENTITY/PROJECT")):
        res = trainprof("export", str(export_run_dir), "--wandb", bad, cwd=tmp_path,
                        env=wandb_env(tmp_path))
        assert res.returncode == 2 and res.stderr.startswith(f"error: --wandb: {why}"), bad
        assert len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "wandb").exists()  # refused before W&B started
    # online without a login: W&B's own reason, and the offline way
    env = {**wandb_env(tmp_path, mode="online"), "WANDB_API_KEY": "", "HOME": str(tmp_path),
           "NETRC": str(tmp_path / "no-netrc")}
    res = trainprof("export", str(export_run_dir), "--wandb", "p", cwd=tmp_path, env=env)
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith("error: W&B could not start a run: ")
    assert "WANDB_MODE=offline" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    # without the wandb package: how to get it
    monkeypatch.setitem(sys.modules, "wandb", None)
    wandb_export._wandb.cache_clear()
    try:
        with pytest.raises(UsageError, match=r"pip install 'trainprof\[wandb\]'"):
            wandb_export.write_run(load_run(export_run_dir), wandb_export.Destination("p"),
                                   name="x")
    finally:
        wandb_export._wandb.cache_clear()
