"""Windows of steps for heavy tools: schedule, runner, the clock's flags, --deep end to end."""

from __future__ import annotations

import gzip
import json

import pytest

from trainprof.analysis.steps import complete_steps
from trainprof.capture.clock import StepClock, StopTraining
from trainprof.capture.window import (
    Schedule,
    WindowRunner,
    looks_like_spec,
    parse_spec,
)
from trainprof.commands import analyse
from trainprof.errors import UsageError
from trainprof.schema import FLAG_PROFILED, FORWARD, RECORD_WIDTH
from trainprof.store import load_run


class LogTool:
    name = "log"

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.closed = False

    def prepare(self, step: int) -> None:
        self.calls.append(("prepare", step))

    def start(self, step: int) -> None:
        self.calls.append(("start", step))

    def boundary(self, step: int) -> None:
        self.calls.append(("boundary", step))

    def stop(self, step: int) -> None:
        self.calls.append(("stop", step))

    def close(self) -> None:
        self.closed = True


class MinimalTool:
    """Only start/stop/close: prepare and boundary are optional."""

    name = "minimal"

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def start(self, step: int) -> None:
        self.calls.append(("start", step))

    def stop(self, step: int) -> None:
        self.calls.append(("stop", step))

    def close(self) -> None:
        pass


def test_parse_spec_defaults_keys_and_flags() -> None:
    assert parse_spec("") == (Schedule(), frozenset())
    sched, flags = parse_spec("skip=3,warmup=0,active=4,repeat=2,memory", frozenset({"memory"}))
    assert sched == Schedule(skip_first=3, wait=0, warmup=0, active=4, repeat=2)
    assert flags == {"memory"}
    base = Schedule(skip_first=10, warmup=0, active=20)
    assert parse_spec("active=7", default=base)[0] == Schedule(skip_first=10, warmup=0, active=7)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("active=0", "--deep active=0: active takes a whole number >= 1 (recorded steps a cycle)"),
        ("active=-1",
         "--deep active=-1: active takes a whole number >= 1 (recorded steps a cycle)"),
        ("repeat=-1",
         "--deep repeat=-1: repeat takes a whole number >= 0 (cycles; 0: until the run ends)"),
        ("skip_first=1e3",
         "--deep skip_first=1e3: skip_first takes a whole number >= 0 (steps left alone first)"),
        ("skip=x", "--deep skip=x: skip_first takes a whole number >= 0 (steps left alone first)"),
        ("active=", "--deep active=: active takes a whole number >= 1 (recorded steps a cycle)"),
        ("bogus=3",
         "--deep: unknown window key 'bogus' (keys: skip_first, wait, warmup, active, repeat)"),
        ("skip_first=1,active=2,bogusflag",
         "--deep: unknown window flag 'bogusflag' (flags: memory)"),
    ],
)
def test_parse_spec_names_the_key_and_its_allowed_values(spec: str, message: str) -> None:
    with pytest.raises(UsageError) as err:
        parse_spec(spec, frozenset({"memory"}), option="--deep")
    assert str(err.value) == message


def test_looks_like_spec(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert looks_like_spec("active=3")
    assert looks_like_spec("skip_first=2,memory,shapes")
    assert looks_like_spec("memory")
    # key=value items with bad values are still a spec: its error says what is wrong
    for bad in ("active=-1", "repeat=-1", "skip_first=1e3", "skip_first=x",
                "skip_first=1,active=2,bogusflag", "foo=1"):
        assert looks_like_spec(bad), bad
    assert not looks_like_spec("train.py")
    assert not looks_like_spec("conf=a.py")  # ends in .py: a script, however named
    assert not looks_like_spec("-m")
    assert not looks_like_spec("train")  # a bare word that is not a flag
    assert not looks_like_spec("dir/x=1")  # a path, not a key
    (tmp_path / "memory").write_text("print(1)")
    assert not looks_like_spec("memory")  # an existing file is the script


def drive(runner: WindowRunner, n_steps: int) -> list[bool]:
    """Call the runner as the clock would; return whether each step ran under a tool."""
    nxt = runner.first_watch()
    profiled = []
    on = False
    for n in range(n_steps + 1):
        if n >= nxt:
            nxt = runner.at_boundary(n)
            on = runner.profiling
        profiled.append(on)
    return profiled[:n_steps]


def test_runner_one_cycle_calls_tools_at_the_right_steps() -> None:
    tool = LogTool()
    runner = WindowRunner(Schedule(skip_first=3, wait=1, warmup=2, active=3, repeat=1), [tool])
    profiled = drive(runner, 20)
    assert tool.calls == [
        ("prepare", 4), ("boundary", 5), ("start", 6), ("boundary", 7), ("boundary", 8),
        ("stop", 9),
    ]
    assert runner.windows == [(6, 9)]
    assert [i for i, p in enumerate(profiled) if p] == [4, 5, 6, 7, 8]
    runner.finish(20)
    assert tool.closed


def test_runner_repeats_and_finish_closes_an_open_window() -> None:
    tool = MinimalTool()
    runner = WindowRunner(Schedule(skip_first=0, wait=2, warmup=0, active=2, repeat=0), [tool])
    drive(runner, 11)
    # cycles of 4 steps: active at 2-3, 6-7, 10-...
    assert tool.calls == [("start", 2), ("stop", 4), ("start", 6), ("stop", 8), ("start", 10)]
    runner.finish(11)
    assert tool.calls[-1] == ("stop", 11)
    assert runner.windows == [(2, 4), (6, 8), (10, 11)]


def test_a_failing_tool_is_dropped_not_the_run() -> None:
    class Broken(LogTool):
        name = "broken"

        def start(self, step: int) -> None:
            raise RuntimeError("boom")

    good, bad = LogTool(), Broken()
    runner = WindowRunner(Schedule(skip_first=1, warmup=0, active=2), [bad, good])
    drive(runner, 6)
    assert runner.tools == [good]
    assert ("start", 1) in good.calls and ("stop", 3) in good.calls


def _step(clock: StepClock) -> None:
    """A manual step with some timed work in it (an empty one is not closed)."""
    clock.exit(clock.enter(FORWARD))
    clock.manual_step()


def test_clock_flags_profiled_steps_and_the_step_after() -> None:
    clock = StepClock()
    clock.add_window(WindowRunner(Schedule(skip_first=2, warmup=1, active=2), [LogTool()]))
    for _ in range(8):
        _step(clock)
    flags = list(clock.records[RECORD_WIDTH - 1 :: RECORD_WIDTH])
    # steps 2 (warm-up), 3-4 (active) and 5 (carries the stop) are flagged
    assert [i for i, f in enumerate(flags) if f & FLAG_PROFILED] == [2, 3, 4, 5]


def test_clock_max_steps_still_stops_with_windows() -> None:
    clock = StepClock(max_steps=4)
    tool = LogTool()
    clock.add_window(WindowRunner(Schedule(skip_first=1, warmup=0, active=10), [tool]))
    with pytest.raises(StopTraining):
        for _ in range(10):
            _step(clock)
    assert clock.n_steps == 4
    assert tool.calls[0] == ("start", 1)


DEEP_SCRIPT = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
ds = TensorDataset(torch.randn(1024, 16), torch.randint(0, 4, (1024,)))
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(2):
    for x, y in DataLoader(ds, batch_size=32):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
"""


def _trace_steps(path) -> list[str]:
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    return sorted({e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")})


def test_deep_window_writes_a_trace_of_the_chosen_steps(tp) -> None:
    res = tp(DEEP_SCRIPT, "--deep", "skip=5,warmup=1,active=3,shapes")
    assert res.returncode == 0, res.stderr
    assert "torch_profiler: steps 6-8 recorded after 1 warm-up steps" in res.stderr
    traces = sorted((res.run_dir / "deep").glob("*.pt.trace.json.gz"))
    assert len(traces) == 1 and traces[0].name.endswith(".steps6-8.pt.trace.json.gz")
    # the trace's step annotations carry trainprof's step indices
    assert _trace_steps(traces[0]) == ["ProfilerStep#6", "ProfilerStep#7", "ProfilerStep#8"]
    run = load_run(res.run_dir)
    flagged = run.steps["step"][(run.steps["flags"] & FLAG_PROFILED) != 0].tolist()
    # 5: warm-up, 6-8: recorded, 9: carries the stop; the op count's sample, moved clear
    # of the deep window, 9-10, and 11 its stop
    assert flagged == [5, 6, 7, 8, 9, 10, 11]
    assert not set(flagged) & set(complete_steps(run.steps)["step"].tolist())
    windows = [w for w in run.meta["windows"] if w["tools"] == ["torch_profiler"]]
    assert windows[0]["recorded"] == [[6, 9]]
    # the window's trace is analysed into the run summary, as `trainprof trace` would
    deep = analyse(run)["deep"]
    assert len(deep) == 1 and deep[0]["steps"] == ["6", "7", "8"]
    bd = deep[0]["breakdown_us"]
    assert bd["DataLoader"] > 0 and bd["CpuOp"] > 0 and bd["Kernel"] == 0
    assert abs(sum(v for k, v in bd.items() if k != "Total") - bd["Total"]) < 1e-6 * bd["Total"]
    assert deep[0]["cpu_only"] is True
    assert "Deep window  steps 6-8" in res.stdout


def test_deep_window_without_warm_up_records_its_first_step(tp) -> None:
    """With warmup=0 the profiler starts at the window's first step and records it.

    torch.profiler computes its first action at construction, for step 0 (before the
    window: WARMUP); left so, the first active step ran in warm-up, unrecorded.
    """
    res = tp(DEEP_SCRIPT, "--deep", "skip=5,warmup=0,active=3")
    assert res.returncode == 0, res.stderr
    traces = sorted((res.run_dir / "deep").glob("*.pt.trace.json.gz"))
    assert len(traces) == 1 and traces[0].name.endswith(".steps5-7.pt.trace.json.gz")
    assert _trace_steps(traces[0]) == ["ProfilerStep#5", "ProfilerStep#6", "ProfilerStep#7"]
    with gzip.open(traces[0]) as f:
        events = json.load(f)["traceEvents"]
    first = next(e for e in events if e.get("name") == "ProfilerStep#5")
    inside = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"
              and first["ts"] <= e["ts"] <= first["ts"] + first["dur"]]
    assert len(inside) > 10  # the step's ops were recorded, not only its annotation


def test_deep_window_cut_short_by_the_end_of_the_run_is_kept(tp) -> None:
    res = tp(DEEP_SCRIPT, "--max-steps", "8", "--deep", "skip=3,warmup=1,active=10", "--json")
    assert res.returncode == 0, res.stderr
    traces = list((res.run_dir / "deep").glob("*.pt.trace.json.gz"))
    assert len(traces) == 1 and traces[0].name.endswith(".steps4-7.pt.trace.json.gz")
    assert _trace_steps(traces[0])[:4] == [f"ProfilerStep#{i}" for i in range(4, 8)]
    assert res.json()["steps"]["profiled"] == 5  # steps 3 (warm-up) to 7


def test_deep_without_spec_takes_the_script_as_script(tp) -> None:
    res = tp(DEEP_SCRIPT, "--deep", "--json")
    assert res.returncode == 0, res.stderr
    assert "steps 12-16 recorded" in res.stderr
    assert len(list((res.run_dir / "deep").glob("*.steps12-16.pt.trace.json.gz"))) == 1


def test_a_windows_first_line_says_what_it_will_record() -> None:
    py = Schedule(skip_first=10, wait=0, warmup=0, active=20, repeat=1)
    assert py.describe() == "steps 10-29 recorded, once"
    assert Schedule().describe() == "steps 12-16 recorded after 2 warm-up steps, once"
    assert Schedule(repeat=3).describe() == (
        "steps 12-16 recorded after 2 warm-up steps, 3 times, every 7 steps")
    assert Schedule(repeat=0).describe() == (
        "steps 12-16 recorded after 2 warm-up steps, then every 7 steps until the run ends")
    assert py.describe(max_steps=11) == "steps 10-29 recorded, once"  # it opens, cut short
    assert py.describe(max_steps=10) == ("the window (steps 10-29) never opens: --max-steps 10 "
                                         "ends the run before step 10 (lower its skip_first)")


def test_a_window_that_max_steps_cuts_off_is_said_never_to_open(tp) -> None:
    res = tp(DEEP_SCRIPT, "--py", "--max-steps", "3", "--no-html")
    assert res.returncode == 0, res.stderr
    assert ("trainprof: cprofile: the window (steps 10-29) never opens: --max-steps 3 ends the "
            "run before step 10 (lower its skip_first)") in res.stderr.splitlines()
    assert "recorded, once" not in res.stderr


def test_bad_window_spec_is_a_usage_error(tp) -> None:
    res = tp(DEEP_SCRIPT, "--deep=active=0")
    assert res.returncode == 2
    assert res.stderr.strip() == ("error: --deep active=0: active takes a whole number >= 1 "
                                  "(recorded steps a cycle)")


def test_a_trace_finding_stands_beside_a_part_of_it_the_run_found() -> None:
    """Same category: the run's finding stands for a comparable gain (one bottleneck, one
    finding); a trace finding claiming more than twice as much is the whole of which the
    run saw a part (H100, 2026-11-26: launch-bound 94% vs the optimizer's launches 11%)."""
    from trainprof.analysis.deep import trace_findings

    def finding(category: str, cause: str, gain: float) -> dict:
        return {"category": category, "cause": cause, "estimated_gain": gain, "evidence": {}}

    deep = [{"source": "/r/deep/a.steps5-9.pt.trace.json.gz", "findings": [
        finding("host_launch", "launch_bound", 0.94),
        finding("input_pipeline", "too_few_workers", 0.25),
        finding("compute", "tensor_cores_unused", 0.10),
    ]}]
    run = [finding("host_launch", "foreach_optimizer", 0.11),
           finding("input_pipeline", "collate", 0.20)]
    kept = trace_findings(deep, run)
    assert [f["cause"] for f in kept] == ["launch_bound", "tensor_cores_unused"]
    assert kept[0]["evidence"]["deep_window"] == "a.steps5-9.pt.trace.json.gz"
    # the run's part claims half the trace's whole: the same bottleneck, the run's stands
    assert [f["cause"] for f in trace_findings(deep, [finding("host_launch", "x", 0.47)])] == [
        "too_few_workers", "tensor_cores_unused"]
    assert trace_findings(None, run) == [] and trace_findings([{"source": "x"}], run) == []


def test_a_launch_bound_claim_is_what_the_input_and_sync_findings_leave() -> None:
    """GPU idle time is the input pipeline's and the syncs' first (the device rules'
    ladder): H100, 2026-11-26, 14 kernels a step, the host reading loss.item() each step
    and loading its batches itself: the trace said launch-bound 16%, the run's sync
    finding claimed 28% and its input finding 20% of the same idle time."""
    from trainprof.analysis.deep import trace_findings

    def finding(category: str, cause: str, gain: float) -> dict:
        return {"category": category, "cause": cause, "estimated_gain": gain, "evidence": {}}

    deep = [{"source": "/r/deep/a.steps22-24.pt.trace.json.gz", "findings": [
        finding("host_launch", "launch_bound", 0.164)]}]
    run = [finding("synchronization", "host_reads", 0.284),
           finding("input_pipeline", "per_sample_overhead", 0.199),
           finding("host_launch", "loop_code", 0.073)]
    assert trace_findings(deep, run) == []
    # no other claim on the idle time: the trace's launch-bound finding stands
    assert [f["cause"] for f in trace_findings(deep, [])] == ["launch_bound"]
    # what the syncs leave is too little (under 5% of the step)
    assert trace_findings(deep, [finding("synchronization", "host_reads", 0.12)]) == []


def test_the_op_count_window_keeps_clear_of_the_heavy_tools_windows(tmp_path):
    from trainprof.capture.opcount import OPCOUNT_SCHEDULE, OpCountTool
    from trainprof.capture.tools import build_windows, clear_of, covers

    deep = Schedule(skip_first=8, wait=0, warmup=1, active=3, repeat=1)
    assert [s for s in range(20) if covers(deep, s)] == [8, 9, 10, 11]
    every = Schedule(skip_first=0, wait=3, warmup=0, active=2, repeat=0)
    assert [s for s in range(12) if covers(every, s)] == [3, 4, 8, 9]
    # the default (steps 8, 9) when nothing else is there; after the deep window otherwise
    assert clear_of(OPCOUNT_SCHEDULE, []) == OPCOUNT_SCHEDULE
    moved = clear_of(OPCOUNT_SCHEDULE, [deep])
    assert (moved.skip_first, moved.active) == (12, 2)
    # between the windows of a repeated one, where two steps fit (10, 11 here)
    assert clear_of(OPCOUNT_SCHEDULE, [every]).skip_first == 10
    # no two free steps: left where it was
    always = Schedule(skip_first=0, wait=1, warmup=0, active=1, repeat=0)
    assert clear_of(OPCOUNT_SCHEDULE, [always]) == OPCOUNT_SCHEDULE
    runners = build_windows(tmp_path, deep="skip_first=8,warmup=1,active=3")
    (op,) = [r for r in runners if isinstance(r.tools[0], OpCountTool)]
    assert op.schedule.phase_starts(0) == (12, 12, 14)
