"""The run folder: torn writes, schema checks, and the size/speed of a 1,000,000-step record."""

from __future__ import annotations

import io
import time

import numpy as np
import orjson
import pytest

from trainprof.analysis.steps import detect_warmup, step_statistics
from trainprof.errors import UsageError
from trainprof.schema import FLAG_PARTIAL
from trainprof.store import STEP_DTYPE, RunWriter, load_run


def _records(n: int, dur_ms: float = 10.0, data_ms: float = 4.0) -> list[tuple[int, ...]]:
    recs = []
    for i in range(n):
        dur = int(dur_ms * 1e6)
        data = int(data_ms * 1e6)
        rec = [0] * len(STEP_DTYPE.names)
        rec[0], rec[1], rec[2] = i, i * dur, dur
        rec[3] = dur - data  # other
        rec[4] = data  # data_wait
        rec[STEP_DTYPE.names.index("samples")] = 32
        recs.append(tuple(rec))
    return recs


def test_torn_last_record_and_line_are_dropped(tmp_path):
    w = RunWriter(tmp_path / "r", {"name": "t"})
    w.append_step_bytes(np.array(_records(5), dtype=STEP_DTYPE).tobytes())
    w.event("dataloader", batch_size=32)
    w.close("finished", 0)
    with open(tmp_path / "r" / "steps.bin", "ab") as f:
        f.write(b"\x01" * 17)  # half a record, as a crash mid-write would leave
    with open(tmp_path / "r" / "events.jsonl", "ab") as f:
        f.write(b'{"kind": "regi')
    run = load_run(tmp_path / "r")
    assert len(run.steps) == 5 and run.events == [{"kind": "dataloader", "batch_size": 32}]
    stats = step_statistics(run.steps)
    assert stats["breakdown"]["data_wait"] == pytest.approx(0.4)
    assert stats["samples_per_s"] == pytest.approx(3200)


def test_a_steps_file_shorter_than_the_closed_record_is_noted(tmp_path):
    """A closed record says how many steps it wrote: a steps.bin cut short (a full disk,
    a copy taken mid-run) or left behind reads as a note, not as "no step ran"."""
    w = RunWriter(tmp_path / "r", {"name": "t"})
    w.append_step_bytes(np.array(_records(8), dtype=STEP_DTYPE).tobytes())
    w.close("finished", 0, steps_recorded=8)
    assert load_run(tmp_path / "r").meta.get("notes", []) == []
    steps = tmp_path / "r" / "steps.bin"
    steps.write_bytes(steps.read_bytes()[: 3 * STEP_DTYPE.itemsize])
    run = load_run(tmp_path / "r")
    assert len(run.steps) == 3
    assert run.meta["notes"] == ["the run recorded 8 steps but steps.bin holds only 3 of them "
                                 "(cut short: a full disk, or copied while the run was "
                                 "writing it)"]
    steps.unlink()
    assert load_run(tmp_path / "r").meta["notes"] == [
        "the run recorded 8 steps but steps.bin is missing (not copied with the folder?)"]
    # the summary says none is readable, not that the script ran no step
    from trainprof.analysis.summary import summarize_run
    from trainprof.report.terminal import render_summary

    summary = summarize_run(load_run(tmp_path / "r"))
    assert summary["steps"]["count"] == 0 and summary["steps"]["recorded"] == 8
    out = io.StringIO()
    render_summary({**summary, "run_dir": str(tmp_path / "r")}, file=out)
    text = " ".join(out.getvalue().split())
    assert "none readable: the run recorded 8" in text and "is it a training script" not in text


def test_schema_errors_are_usage_errors(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "run.json").write_text("{not json")
    with pytest.raises(UsageError):
        load_run(tmp_path / "a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "run.json").write_bytes(orjson.dumps({"schema_version": 99}))
    with pytest.raises(UsageError, match="newer trainprof"):
        load_run(tmp_path / "b")


def test_million_step_record_is_small_and_fast(tmp_path):
    w = RunWriter(tmp_path / "r", {"name": "big"})
    chunk = np.array(_records(100_000), dtype=STEP_DTYPE).tobytes()
    for _ in range(10):
        w.append_step_bytes(chunk)
    w.close("finished", 0)
    size = (tmp_path / "r" / "steps.bin").stat().st_size
    assert size == 1_000_000 * STEP_DTYPE.itemsize
    assert size < 200e6
    t0 = time.perf_counter()
    run = load_run(tmp_path / "r")
    stats = step_statistics(run.steps)
    elapsed = time.perf_counter() - t0
    assert stats["steps"]["count"] == 1_000_000
    assert elapsed < 5, elapsed


def test_partial_last_step_is_not_counted():
    recs = np.array(_records(4), dtype=STEP_DTYPE)
    recs["flags"][-1] = FLAG_PARTIAL
    assert step_statistics(recs)["steps"]["count"] == 3


def test_warmup_detection():
    rng = np.random.default_rng(0)
    steady = 0.010 + rng.normal(0, 0.0003, 200)
    d = np.concatenate([[2.0, 0.5, 0.05, 0.02], steady])
    assert detect_warmup(d) == 4
    assert detect_warmup(steady) == 0
    # a periodic spike (eval every 50 steps) is not warm-up
    spiky = steady.copy()
    spiky[::50] = 0.2
    spiky[0] = 0.010
    assert detect_warmup(spiky) == 0
    assert detect_warmup(np.array([1.0, 0.01])) == 0
    # steps that alternate between two levels are steady once settled, not warm for half the
    # run (a band around the one median put every even-length window's median outside it)
    warm = [0.5, 0.1]
    assert detect_warmup(np.concatenate([warm, np.tile([0.010, 0.020], 200)])) == 2
    assert detect_warmup(np.concatenate([warm, np.tile([0.010, 0.010, 0.020, 0.020], 100)])) == 2
    mixed = np.where(rng.random(400) < 0.5, 0.010, 0.020)
    assert detect_warmup(np.concatenate([warm, mixed])) <= 3
    # ... while a real warm-up before them still counts
    slow_start = [2.0, 0.5, 0.05, 0.04]
    assert detect_warmup(np.concatenate([slow_start, np.tile([0.010, 0.020], 100)])) == 4


def test_steps_written_in_another_layout_read_through_run_json(tmp_path):
    """A folder from a trainprof whose step layout differed (int32 counters, a field fewer)."""
    old_fields = [(n, "<i4" if n in ("samples", "flags") else "<i8")
                  for n in STEP_DTYPE.names if n != "gc_gen2_n"]
    old = np.dtype(old_fields)
    recs = np.zeros(3, dtype=old)
    recs["step"] = [0, 1, 2]
    recs["dur_ns"] = recs["other_ns"] = 5_000_000
    recs["samples"] = 16
    w = RunWriter(tmp_path / "r", {"name": "old"})
    w.close("finished", 0)
    meta = orjson.loads((tmp_path / "r" / "run.json").read_bytes())
    meta["step_fields"] = [[n, old[n].str] for n in old.names]
    (tmp_path / "r" / "run.json").write_bytes(orjson.dumps(meta))
    (tmp_path / "r" / "steps.bin").write_bytes(recs.tobytes())
    steps = load_run(tmp_path / "r").steps
    assert steps.dtype == STEP_DTYPE
    assert steps["samples"].tolist() == [16, 16, 16]
    assert steps["gc_gen2_n"].tolist() == [0, 0, 0]
    assert step_statistics(steps)["samples_per_s"] == pytest.approx(3200)


def test_default_run_dir_gives_processes_starting_together_a_folder_each(tmp_path):
    """The ranks of a job, each with trainprof.profile(), start in the same second with the
    same name: each must get its own folder (checking then creating raced)."""
    import threading

    from trainprof.store import default_run_dir

    got: list = []
    start = threading.Barrier(8)

    def claim() -> None:
        start.wait()
        got.append(default_run_dir("train", root=tmp_path))

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 8 and all(p.is_dir() for p in got)
