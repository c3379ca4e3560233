"""`trainprof export --perfetto`: one Chrome-trace JSON of a real run, loaded back and checked.

The run has everything the timeline merges: steps and phases, a named region, DataLoader
workers, system samples and a deep window (torch.profiler). The checks are the ones a viewer
relies on: every event well-formed, slices on one track properly nested, counters numeric,
one slice per step record, phases filling their step exactly, and the torch.profiler
``ProfilerStep#N`` slices landing on trainprof's step N.
"""

from __future__ import annotations

import gzip
import itertools
import json
import shutil
from collections import defaultdict
from pathlib import Path

import orjson
import pytest
from conftest import trainprof

from trainprof.errors import UsageError
from trainprof.report.perfetto import (
    TID_PROFILER_STEPS,
    TID_REGIONS,
    TID_STEPS,
    export_perfetto,
)
from trainprof.store import load_run


@pytest.fixture(scope="module")
def run_dir(export_run_dir: Path) -> Path:
    return export_run_dir


def _check_structure(doc: dict) -> None:
    """What Perfetto and chrome://tracing need of every event."""
    assert doc["displayTimeUnit"] == "ms"
    for ev in doc["traceEvents"]:
        assert {"ph", "ts", "pid", "tid"} <= ev.keys(), ev
        assert isinstance(ev["ts"], int | float)
        if ev["ph"] == "X":
            assert isinstance(ev["dur"], int | float) and ev["dur"] >= 0, ev
        if ev["ph"] == "C":
            assert ev["args"] and all(
                isinstance(v, int | float) and not isinstance(v, bool) for v in ev["args"].values()
            ), ev


def _check_nesting(doc: dict) -> None:
    """Slices on one thread must nest: a child never ends after its parent (to the ns)."""
    by_track = defaultdict(list)
    for ev in doc["traceEvents"]:
        if ev["ph"] == "X":
            start = round(ev["ts"] * 1000)
            by_track[(ev["pid"], ev["tid"])].append((start, -round(ev["dur"] * 1000)))
    for track, slices in by_track.items():
        stack: list[int] = []
        for start, neg_dur in sorted(slices):
            end = start - neg_dur
            while stack and stack[-1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1], (track, start, end, stack[-1])
            stack.append(end)


def test_export_merges_steps_phases_regions_counters_and_deep_trace(
    run_dir: Path, tmp_path: Path
) -> None:
    run = load_run(run_dir)
    path = tmp_path / "timeline.json"
    stats = export_perfetto(run, path)
    doc = json.loads(path.read_text())
    _check_structure(doc)
    _check_nesting(doc)
    events = doc["traceEvents"]
    assert stats["events"] == len(events)

    # one slice per step record, phases filling it exactly
    pid = run.meta["pid"]
    steps = [e for e in events if e.get("cat") == "step"]
    assert len(steps) == stats["steps"] == len(run.steps) >= 40
    assert all(e["pid"] == pid and e["tid"] == TID_STEPS for e in steps)
    phases = [e for e in events if e.get("cat") == "phase"]
    assert all(p["pid"] == pid and p["tid"] == TID_STEPS for p in phases)
    phase_ns = sorted((round(p["ts"] * 1000), round(p["dur"] * 1000)) for p in phases)
    for step in steps:
        n = step["args"]["step"]
        t0, t1 = round(step["ts"] * 1000), round((step["ts"] + step["dur"]) * 1000)
        mine = [(t, d) for t, d in phase_ns if t0 <= t and t + d <= t1]
        # laid end to end from the step's start, filling it exactly
        assert mine[0][0] == t0 and all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(mine))
        assert sum(d for _, d in mine) == round(step["dur"] * 1000)
        rec = run.steps[run.steps["step"] == n][0]
        assert round(step["ts"] * 1000) == int(rec["t_start_ns"])
        assert round(step["dur"] * 1000) == int(rec["dur_ns"])
    assert {"data_wait", "forward", "backward", "optimizer"} <= {p["name"] for p in phases}
    profiled = [e for e in steps if "recorded under a heavy tool (times include its cost)"
                in e["args"].get("notes", [])]
    assert len(profiled) >= 3

    # regions at their recorded times
    regions = [e for e in events if e.get("cat") == "region"]
    recorded = [e for e in run.events if e.get("kind") == "region"]
    assert len(regions) == stats["regions"] == len(recorded) == 4
    assert all(e["name"] == "eval" and e["tid"] == TID_REGIONS for e in regions)
    assert all(9.5 <= e["dur"] / 1000 < 60 for e in regions)  # ~10 ms sleeps, in µs

    # counters: process, workers, system; on the step timeline (same perf_counter clock)
    counters = defaultdict(list)
    for e in events:
        if e["ph"] == "C":
            for unit, value in e["args"].items():
                counters[f"{e['name']} {unit}"].append((e["ts"], value))
    assert {"process CPU %", "RSS MiB", "system CPU (mean of cores) %",
            "workers total CPU %"} <= counters.keys()
    assert any(k.startswith("worker ") and k.endswith(" CPU %") for k in counters)
    assert all(v > 0 for _, v in counters["RSS MiB"])
    first_step = min(e["ts"] for e in steps)
    last_end = max(e["ts"] + e["dur"] for e in steps)
    ts_cpu = [t for t, _ in counters["process CPU %"]]
    assert any(first_step <= t <= last_end for t in ts_cpu)
    assert min(ts_cpu) > -1e6 and max(ts_cpu) < last_end + 10e6

    # names for every group
    names = {(e["pid"], e["name"]): e["args"] for e in events if e["ph"] == "M"}
    assert names[(pid, "process_name")]["name"] == "train (training process)"
    assert any(k[1] == "process_name" and v["name"] == "DataLoader workers"
               for k, v in names.items())

    # the deep window, on the same timeline: ProfilerStep#N starts where trainprof's step N does
    (deep,) = stats["deep_traces"]
    assert deep["alignment"] == "wall_clock" and deep["events"] > 50
    assert abs(deep["residual_ms"]) < 5
    prof_steps = {int(e["name"].split("#")[1]): e for e in events
                  if e["ph"] == "X" and e.get("name", "").startswith("ProfilerStep#")}
    assert len(prof_steps) >= 2
    assert all(e["pid"] == pid and e["tid"] == TID_PROFILER_STEPS for e in prof_steps.values())
    starts = {e["args"]["step"]: e["ts"] for e in steps}
    ends = {e["args"]["step"]: e["ts"] + e["dur"] for e in steps}
    for n, e in prof_steps.items():
        # torch.profiler's step() runs just after trainprof's boundary, and the one that
        # starts recording starts the tracer too (a few ms; 16 ms seen beside two busy
        # loops): in step n, near its start, never before it (beyond the alignment's
        # residual)
        assert -5000 < e["ts"] - starts[n] < 50000, (n, e["ts"], starts[n])
        assert e["ts"] < ends[n], (n, e["ts"], ends[n])
    ops = [e for e in events if e["ph"] == "X" and e.get("cat") == "cpu_op"]
    assert ops and all(e["pid"] == pid for e in ops)


def test_gzip_output_and_unalignable_or_broken_traces(run_dir: Path, tmp_path: Path) -> None:
    """A trace without a wall clock is placed by its ProfilerStep#N; junk is left out, noted."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    run = load_run(copy)
    rec = run.steps[run.steps["step"] == 20][0]
    # a foreign trace on an unknown clock (ts from 0), with step 20 and 21 annotated
    foreign = {"traceEvents": [
        {"ph": "X", "name": "ProfilerStep#20", "ts": 1000.0, "dur": float(rec["dur_ns"]) / 1000,
         "pid": 7, "tid": 7, "cat": "user_annotation"},
        {"ph": "X", "name": "aten::mm", "ts": 1010.0, "dur": 5.0, "pid": 7, "tid": 7,
         "cat": "cpu_op"},
    ]}
    (copy / "deep" / "foreign.json").write_bytes(orjson.dumps(foreign))
    (copy / "deep" / "broken.pt.trace.json.gz").write_bytes(b"not gzip at all")
    path = tmp_path / "timeline.json.gz"
    stats = export_perfetto(load_run(copy), path)
    doc = json.loads(gzip.decompress(path.read_bytes()))
    _check_structure(doc)
    by_file = {d["file"]: d for d in stats["deep_traces"]}
    assert by_file["deep/foreign.json"]["alignment"] == "profiler_steps"
    assert by_file["deep/foreign.json"]["residual_ms"] == pytest.approx(0, abs=1e-3)
    placed = next(e for e in doc["traceEvents"] if e.get("name") == "aten::mm")
    assert placed["ts"] == pytest.approx(int(rec["t_start_ns"]) / 1000 + 10, abs=0.01)
    assert any("broken.pt.trace.json.gz" in n and "unreadable" in n for n in stats["notes"])
    assert len(stats["deep_traces"]) == 2


def test_step_range(run_dir: Path, tmp_path: Path) -> None:
    run = load_run(run_dir)
    path = tmp_path / "range.json"
    stats = export_perfetto(run, path, first_step=25, last_step=34)
    doc = json.loads(path.read_text())
    _check_structure(doc)
    steps = [e["args"]["step"] for e in doc["traceEvents"] if e.get("cat") == "step"]
    assert steps == list(range(25, 35)) and stats["steps"] == 10
    # regions after steps 29 and 39: only the first lies in the range's time span (+-1 s)
    regions = [e for e in doc["traceEvents"] if e.get("cat") == "region"]
    assert [e["args"]["step"] for e in regions] == [30]
    assert stats["deep_traces"] == []  # the deep window (steps 9-11) is outside
    stats = export_perfetto(run, path, max_steps=5)
    assert stats["steps"] == 5 and "left out" in stats["notes"][0]
    assert "--steps FIRST:LAST" in stats["notes"][0]  # the option the note names exists:
    res = trainprof("export", str(run_dir), "--perfetto", str(path), "--steps", "25:34",
                    cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    doc = json.loads(path.read_text())
    assert [e["args"]["step"] for e in doc["traceEvents"]
            if e.get("cat") == "step"] == list(range(25, 35))
    for bad in ("34:25", "x:3", "25", "-1:3"):
        res = trainprof("export", str(run_dir), "--perfetto", str(path), "--steps", bad,
                        cwd=tmp_path)
        assert res.returncode == 2 and "expected FIRST:LAST" in res.stderr, (bad, res.stderr)
    res = trainprof("export", str(run_dir), "--tensorboard", str(tmp_path / "tb"), "--steps",
                    "1:2", cwd=tmp_path)
    assert res.returncode == 2 and "give --perfetto PATH" in res.stderr


def test_unwritable_path_is_a_usage_error(run_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot write"):
        export_perfetto(load_run(run_dir), tmp_path / "no" / "such" / "dir" / "t.json")


def test_cli_export_makes_the_outputs_own_folder_and_no_more(
    run_dir: Path, tmp_path: Path,
) -> None:
    res = trainprof("export", str(run_dir), "--perfetto", "out/timeline.json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert json.loads((tmp_path / "out" / "timeline.json").read_text())["traceEvents"]
    res = trainprof("export", str(run_dir), "--perfetto", "a/b/timeline.json", cwd=tmp_path)
    assert (res.returncode, res.stderr) == (2, "error: --perfetto a/b/timeline.json: no folder a "
                                               "(only the output's own folder, b/, is created "
                                               "when missing)\n")
    assert not (tmp_path / "a").exists()


def test_cli_export(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli.json"
    res = trainprof("export", str(run_dir), "--perfetto", str(out), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout == ""
    doc = json.loads(out.read_text())
    assert sum(1 for e in doc["traceEvents"] if e.get("cat") == "step") == len(
        load_run(run_dir).steps)
    assert "perfetto" in res.stderr.lower()
    res = trainprof("export", str(tmp_path / "missing"), "--perfetto", str(out), cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip().startswith("error: no such run folder")
    assert len(res.stderr.strip().splitlines()) == 1


def test_a_profile_runs_first_step_is_one_step_as_the_summary_counts_it(tmp_path: Path) -> None:
    """The optimizer steps the clock saw before the script's first prof.step() belong to
    that first step: the summary counted 120 steps where Perfetto drew 121 (an extra
    'step 1' of other time only)."""
    import torch

    import trainprof

    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with trainprof.profile(tmp_path / "r", report=False) as prof:
        for _ in range(12):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    assert prof.summary["steps"]["count"] == 12
    path = tmp_path / "p.json"
    stats = export_perfetto(load_run(tmp_path / "r"), path)
    doc = json.loads(path.read_text())
    _check_structure(doc)
    steps = [e for e in doc["traceEvents"] if e.get("cat") == "step"]
    assert len(steps) == stats["steps"] == 12
