"""`trainprof export --tensorboard`: event files read back with TensorBoard's own reader.

The values are checked against the run's records: every complete step's time and phases, the
samples/s the batch size gives, the system samples, CUDA event times and NVML counters of a
real H100 record, the report and findings in the Text dashboard, and the bucket means of a
long run. Read back through ``plugin_event_accumulator`` (the reader TensorBoard's Python
data path uses) so that a value TensorBoard would not show, or show under another plugin,
fails here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import as_launch_folder, trainprof

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.plugin_event_accumulator import (  # noqa: E402
    EventAccumulator,
)
from tensorboard.util import tensor_util  # noqa: E402

from trainprof.analysis.steps import complete_steps  # noqa: E402
from trainprof.errors import UsageError  # noqa: E402
from trainprof.report import tensorboard as tb  # noqa: E402
from trainprof.store import load_run  # noqa: E402

H100 = Path(__file__).resolve().parent / "data" / "h100" / "synced"

@pytest.fixture(scope="module")
def run_dir(export_run_dir: Path) -> Path:
    """conftest's run with a DataLoader worker, 8 samples a step, a deep window."""
    return export_run_dir


def _read(folder: Path) -> EventAccumulator:
    acc = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    acc.Reload()
    return acc


def _series(acc: EventAccumulator, tag: str) -> tuple[list[int], np.ndarray, list[float]]:
    events = acc.Tensors(tag)
    return ([e.step for e in events],
            np.array([float(tensor_util.make_ndarray(e.tensor_proto)) for e in events]),
            [e.wall_time for e in events])


def _text(acc: EventAccumulator, tag: str) -> str:
    (event,) = acc.Tensors(tag)
    return tensor_util.make_ndarray(event.tensor_proto).item().decode()


def test_steps_phases_samples_and_text_match_the_record(run_dir: Path, tmp_path: Path) -> None:
    res = trainprof("export", str(run_dir), "--tensorboard", str(tmp_path / "logs"),
                    cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout == ""
    assert f"tensorboard --logdir {tmp_path / 'logs'}" in res.stderr
    folder = tmp_path / "logs" / "run"  # the run folder's name
    acc = _read(folder)
    scalars = set(acc.PluginTagToContent("scalars"))
    run = load_run(run_dir)
    steps = complete_steps(run.steps)
    assert len(steps) >= 30  # 40, less the deep window's and the cut-off

    # every complete step, at its number, its time exact to float32
    numbers, times, walls = _series(acc, "step/time_ms")
    assert numbers == steps["step"].tolist()
    np.testing.assert_allclose(times, steps["dur_ns"] / 1e6, rtol=1e-6)
    # at the wall time the step ended
    end_wall = run.meta["wall_origin_s"] + (steps["t_start_ns"] + steps["dur_ns"]) / 1e9
    np.testing.assert_allclose(walls, end_wall, atol=1e-3)

    # the phases the run had, adding up to the step
    phases = {t for t in scalars if t.startswith("phase/")}
    assert {"phase/data_wait_ms", "phase/forward_ms", "phase/backward_ms",
            "phase/optimizer_ms", "phase/zero_grad_ms", "phase/other_ms"} <= phases
    total = sum(_series(acc, t)[1] for t in phases)
    np.testing.assert_allclose(total, times, rtol=1e-5)
    # 8 samples a step
    _, rate, _ = _series(acc, "step/batch_samples_per_s")
    np.testing.assert_allclose(rate, 8 / (steps["dur_ns"] / 1e9), rtol=1e-5)
    # a step's own rate, named so: "step/samples_per_s" read as the run's throughput (points
    # up to 29,810 in a run of 787 samples/s)
    assert "step/samples_per_s" not in scalars
    assert "throughput" in acc.SummaryMetadata("step/batch_samples_per_s").summary_description
    assert "step/syncs" not in scalars  # a CPU run: nothing waits for a device
    assert "step/time_max_ms" not in scalars  # one step a point: nothing averaged

    # system samples: one point each, at the step in progress
    sample_steps, cpu, _ = _series(acc, "process/cpu_pct")
    assert len(cpu) >= 5 and cpu.max() > 10
    assert sample_steps == sorted(sample_steps) and sample_steps[-1] <= numbers[-1] + 1
    assert {"process/rss_mib", "workers/cpu_pct", "system/cpu_pct"} <= scalars
    _, workers, _ = _series(acc, "workers/cpu_pct")
    assert workers.max() > 0  # one worker sleeping and building tensors

    # descriptions for the dashboard's tooltips
    assert "DataLoader" in acc.SummaryMetadata("phase/data_wait_ms").summary_description
    # the report and the findings in the Text dashboard
    assert set(acc.PluginTagToContent("text")) == {
        "trainprof/report", "trainprof/findings", "trainprof/environment"}
    report = _text(acc, "trainprof/report")
    assert report.startswith("```") and "steps" in report and "data wait" in report.lower()
    findings = _text(acc, "trainprof/findings")
    assert findings.startswith("### 1. ") and "**verify**" in findings
    from trainprof.commands import analyse_folder

    first = analyse_folder(run_dir)[0]["findings"][0]  # its evidence as the terminal shows it
    key, value = next((k, v) for k, v in first["evidence"].items() if isinstance(v, float))
    assert f"`{key}`={value:.3g}" in findings
    assert "train.py" in _text(acc, "trainprof/environment")

    # a second export replaces the first one's file rather than adding a copy
    before = list(folder.glob("events.out.tfevents.*"))
    assert len(before) == 1 and before[0].name.endswith(tb.FILE_SUFFIX)
    (folder / "events.out.tfevents.123.someone.else").write_bytes(b"")  # not ours: kept
    res = trainprof("export", str(run_dir), "--tensorboard", str(tmp_path / "logs"),
                    cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    ours = list(folder.glob(f"events.out.tfevents.*{tb.FILE_SUFFIX}"))
    assert len(ours) == 1 and ours != before
    assert (folder / "events.out.tfevents.123.someone.else").exists()


def test_a_long_run_is_written_as_bucket_means_with_each_buckets_slowest_step(
    run_dir: Path, tmp_path: Path
) -> None:
    run = load_run(run_dir)
    steps = complete_steps(run.steps)
    result = tb.write_run(run, tmp_path / "b", label="b", max_points=7)
    size = result.bucket
    assert size == -(-len(steps) // 7) and result.steps == len(steps)
    acc = _read(tmp_path / "b")
    numbers, means, _ = _series(acc, "step/time_ms")
    _, slowest, _ = _series(acc, "step/time_max_ms")
    _, rate, _ = _series(acc, "step/batch_samples_per_s")
    dur = steps["dur_ns"] / 1e6
    starts = range(0, len(steps), size)
    assert numbers == [int(steps["step"][min(s + size, len(steps)) - 1]) for s in starts]
    np.testing.assert_allclose(means, [dur[s:s + size].mean() for s in starts], rtol=1e-5)
    np.testing.assert_allclose(slowest, [dur[s:s + size].max() for s in starts], rtol=1e-6)
    # samples / seconds over the bucket, not a mean of per-step rates
    np.testing.assert_allclose(
        rate, [8 * len(dur[s:s + size]) / (dur[s:s + size].sum() / 1e3) for s in starts],
        rtol=1e-5)
    assert "text" not in _read(tmp_path / "b").ActivePlugins()  # no summary given


def test_a_cuda_record_gets_device_times_and_nvml_counters(tmp_path: Path) -> None:
    """A real H100 record (tests/data/h100): CUDA event times per phase, NVML counters."""
    run = load_run(H100)
    result = tb.write_run(run, tmp_path / "gpu", label="gpu")
    acc = _read(tmp_path / "gpu")
    scalars = set(acc.PluginTagToContent("scalars"))
    assert {"device/step_ms", "device/forward_ms", "device/backward_ms",
            "device/optimizer_ms", "device/idle_ms"} <= scalars
    assert {"gpu0/util_pct", "gpu0/memory_used_mib", "gpu0/power_w"} <= scalars
    # its .item() a step, counted and timed
    steps = complete_steps(run.steps)
    sync_steps, syncs, _ = _series(acc, "step/syncs")
    assert sync_steps == steps["step"].tolist()
    assert syncs.sum() == steps["sync_n"].sum() >= len(steps) - 1  # all but the first
    np.testing.assert_allclose(_series(acc, "step/sync_ms")[1], steps["sync_ns"] / 1e6,
                               rtol=1e-6)
    numbers, dev_step, _ = _series(acc, "device/step_ms")
    recorded = {int(r["step"]): r["dev_step_ns"] / 1e6 for r in run.device
                if r["dev_step_ns"] >= 0}
    assert numbers and all(n in recorded for n in numbers)
    np.testing.assert_allclose(dev_step, [recorded[n] for n in numbers], rtol=1e-6)
    # the synced loop's known device work: ~4.2 ms a step (test_h100_records)
    assert 3.5 < float(np.median(dev_step)) < 5
    _, util, _ = _series(acc, "gpu0/util_pct")
    assert util.max() > 50
    assert result.samples > 0
    assert not list(H100.rglob("events.out.tfevents.*"))  # nothing written into the record


def test_ranks_each_get_a_run_and_the_merged_report_goes_with_the_main_rank(
    run_dir: Path, tmp_path: Path
) -> None:
    """A torchrun-style folder (no record of its own, ``ranks/<k>/``)."""
    launch = as_launch_folder(run_dir, tmp_path / "launch")
    res = trainprof("export", str(launch), "--tensorboard", str(tmp_path / "logs"),
                    cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    folders = sorted(p.parent.relative_to(tmp_path / "logs").as_posix()
                     for p in (tmp_path / "logs").rglob("events.out.tfevents.*"))
    assert folders == ["launch/rank0", "launch/rank1"]
    with_text = ["text" in _read(tmp_path / "logs" / f).ActivePlugins() for f in folders]
    assert sorted(with_text) == [False, True]  # the report once, with the main rank


def test_errors_are_one_line(run_dir: Path, tmp_path: Path, monkeypatch) -> None:
    res = trainprof("export", str(run_dir), cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip() == ("error: say what to export: --perfetto PATH, --tensorboard "
                                  "LOGDIR and/or --wandb PROJECT")
    res = trainprof("export", str(tmp_path / "missing"), "--tensorboard", str(tmp_path),
                    cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.startswith("error: no such run folder")
    assert len(res.stderr.strip().splitlines()) == 1
    (tmp_path / "afile").write_text("x")  # a log folder that is a file
    res = trainprof("export", str(run_dir), "--tensorboard", str(tmp_path / "afile"),
                    cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.strip() == (
        f"error: --tensorboard {tmp_path / 'afile'}: a file, not a folder")
    # without the tensorboard package: how to get it
    monkeypatch.setitem(sys.modules, "tensorboard.summary.writer.event_file_writer", None)
    tb._tensorboard.cache_clear()
    try:
        with pytest.raises(UsageError, match=r"pip install 'trainprof\[tensorboard\]'"):
            tb.write_run(load_run(run_dir), tmp_path / "x", label="x")
    finally:
        tb._tensorboard.cache_clear()
