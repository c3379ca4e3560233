"""DistributedDataParallel's own timing of its all-reduce: read, summarised, diagnosed, tuned.

In this process on one gloo rank (a ``HashStore``, no second process): the record of a
real DDP model's sampled iterations, the knobs that change its buckets and its compression
hook, and the exposed-communication rule on summaries with known numbers. The two-rank run
whose all-reduce is really exposed is in ``test_ranks.py``.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from test_diagnosis import make_steps, make_summary
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainprof
from trainprof.analysis.ddp import summarize_model
from trainprof.capture.knobs import Knobs, parse_value
from trainprof.commands import analyse
from trainprof.diagnosis import diagnose
from trainprof.errors import UsageError
from trainprof.experiments.tune import _actual
from trainprof.store import load_run

MS = 1e6  # ns


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_run_keeps_ddps_sampled_iterations_and_settings(one_rank, tmp_path):
    with trainprof.profile(tmp_path / "r", report=False):
        # by keyword, as PyTorch Lightning builds it (a wrapper whose first parameter was
        # named `module` refused it: "got multiple values for argument 'module'")
        model = DDP(module=nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)),
                    bucket_cap_mb=1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(130):
            model(torch.randn(8, 64)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    run = load_run(tmp_path / "r")
    (entry,) = run.meta["ddp"]
    settings = entry["settings"]
    assert settings["backend_name"] == "gloo" and settings["world_size"] == 1
    assert settings["bucket_cap_bytes"] == 2**20
    assert settings["total_parameter_size_bytes"] == 4 * (64 * 64 + 64 + 64 + 1)
    assert settings["find_unused_parameters"] == 0
    iterations = [s[0] for s in entry["samples"]]
    # DDP samples iterations 1-10 and every 100th; the last poll (at the end) saw 100
    assert iterations == sorted(set(iterations)) and iterations[-1] == 100
    assert all(s[2] > 0 and s[3] > 0 for s in entry["samples"])  # backward compute, comm

    doc = analyse(run)
    (m,) = doc["ddp"]
    assert m["samples_from"] == "steady" and m["iterations"] == [100]
    assert m["buckets"] >= 1 and m["gradient_bytes"] == settings["total_parameter_size_bytes"]
    sample = entry["samples"][-1]
    assert m["comm_ms"] == pytest.approx(sample[3] / 1e6)
    assert m["exposed_ms"] == pytest.approx(max(0, sample[3] - sample[4]) / 1e6)
    assert m["exposed_share"] == pytest.approx(m["exposed_ms"] / 1e3 / doc["steps"]["median_s"])

    # TensorBoard: each sampled iteration at its step (DDP counts forwards from 1)
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    from trainprof.report.tensorboard import write_run

    write_run(run, tmp_path / "tb", label="r")
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    acc.Reload()
    events = acc.Tensors("ddp/allreduce_ms")
    assert [e.step for e in events] == [i - 1 for i in iterations]
    assert [float(tensor_util.make_ndarray(e.tensor_proto)) for e in events] == pytest.approx(
        [s[3] / 1e6 for s in entry["samples"]], rel=1e-6)
    # the wall time of a point is when its step ended
    from trainprof.analysis.scalars import ddp_points, wall_origin
    from trainprof.analysis.steps import complete_steps

    steps = complete_steps(run.steps)
    origin = wall_origin(run)
    point = ddp_points(run, steps, origin)[-1]
    (row,) = steps[steps["step"] == 99]
    assert point.step == 99
    assert point.wall == pytest.approx(origin + (row["t_start_ns"] + row["dur_ns"]) / 1e9)
    # with 4 backward passes a step (accumulation), iteration N is step (N-1)//4
    ops = json.loads((run.path / "ops.json").read_text())
    (run.path / "ops.json").write_text(json.dumps({**ops, "backward_per_step": 4.0}))
    assert [p.step for p in ddp_points(run, steps, origin)] == [(i - 1) // 4 for i in iterations]


def test_a_dropped_model_is_not_kept_alive(one_rank):
    import gc

    from trainprof.capture.ddp_stats import DDPStats

    stats = DDPStats()
    model = DDP(nn.Linear(4, 1))
    stats.add(model)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
    assert stats.poll() and stats.record()[0]["settings"]["world_size"] == 1
    before = stats.record()
    for _ in range(2):  # two iterations more, then the model goes before any poll
        model(torch.randn(2, 4)).sum().backward()
    del model
    gc.collect()
    # read as it went (PyTorch Lightning drops its DDP wrapper at the end of fit(), often
    # less than a second after the last poll): its last sampled iteration is kept
    after = stats.record()
    assert after != before
    # (DDP sets an iteration's figures at the next forward: five forwards, iteration 4)
    assert [s[0] for s in after[0]["samples"]] == [s[0] for s in before[0]["samples"]] + [4]
    assert not stats.poll() and stats.record() == after  # and nothing is polled from it now


def test_knobs_set_the_bucket_size_and_the_compression_hook_over_the_scripts(one_rank):
    knobs = Knobs({"ddp_bucket_cap_mb": 2, "ddp_comm_hook": "fp16"}).install()
    try:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model = DDP(module=nn.Linear(8, 8), bucket_cap_mb=50)  # the script's size: replaced
        model.register_comm_hook(None, default_hooks.allreduce_hook)  # the script's: ignored
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
        data = model._get_ddp_logging_data()
        assert data["bucket_cap_bytes"] == 2 * 2**20
        assert data["comm_hook"] == "fp16_compress_hook"
    finally:
        record = knobs.uninstall()
    assert record["process"]["ddp"] == [{"script_bucket_cap_mb": 50, "bucket_cap_mb": 2,
                                         "comm_hook": "fp16"}]
    assert record["script_calls_ignored"] == [
        "DistributedDataParallel.register_comm_hook(allreduce_hook)"]
    # undone: the script's own arguments and hooks apply again
    plain = DDP(nn.Linear(8, 8), bucket_cap_mb=50)
    assert plain._get_ddp_logging_data()["bucket_cap_bytes"] == 50 * 2**20
    # tune reads back what DDP itself reports
    meta = {"ddp": [{"settings": {"comm_hook": "fp16_compress_hook",
                                  "bucket_cap_bytes": 2 * 2**20}}]}
    assert _actual("ddp_comm_hook", meta) == "fp16_compress_hook"
    assert _actual("ddp_bucket_cap_mb", meta) == "2 MiB"
    assert _actual("ddp_comm_hook", {"ddp": []}) == "no DDP model"
    with pytest.raises(UsageError, match="expected fp16, bf16, none"):
        parse_value("ddp_comm_hook", "int8")


def test_a_hook_ddp_refuses_leaves_the_script_training(one_rank):
    """bf16 compression needs NCCL: on gloo DDP raises, and the knob steps aside."""
    knobs = Knobs({"ddp_comm_hook": "bf16"}).install()
    try:
        model = DDP(nn.Linear(8, 8))
        model(torch.randn(4, 8)).sum().backward()
    finally:
        record = knobs.uninstall()
    assert record["process"]["ddp"] == [{"comm_hook": None}]
    assert "ddp_comm_hook=bf16" in record["errors"][0]


# --------------------------------------------------------------------------- the rule


def _model(comm: float, overlap: float, backward: float, **settings) -> dict:
    """A DDP model's summary from one steady sample, times in ms (a 1 ms forward: the
    iteration fits in make_steps' 10 ms step)."""
    entry = {"settings": {"module_name": "Net", "backend_name": "nccl", "world_size": 8,
                          "bucket_cap_bytes": 25 * 2**20, "rebuilt_bucket_sizes": "26214400, 1",
                          "total_parameter_size_bytes": 100 * 2**20, **settings},
             "samples": [[5, int(1 * MS), int(backward * MS), int(comm * MS),
                          int(overlap * MS)],  # the first iterations: left out
                         [200, int(1 * MS), int(backward * MS), int(comm * MS),
                          int(overlap * MS)]]}
    return summarize_model(entry, 0.010)  # make_steps' 10 ms step


def _found(ddp: list[dict], **parts) -> list[dict]:
    steps = make_steps(40)
    return [f for f in diagnose(make_summary(steps, ddp=ddp, **parts), steps)
            if f["cause"] == "exposed_communication"]


def test_exposed_communication_bands_and_fixes():
    from trainprof.experiments.verify import knob_role as verify_knob_role

    # 0.9 ms exposed of a 10 ms step: under the 10% band
    assert _found([_model(comm=2.9, overlap=2.0, backward=6.0)]) == []
    # 1.5 ms exposed, backward longer than the all-reduce: smaller buckets
    (f,) = _found([_model(comm=4.0, overlap=2.5, backward=6.0)])
    assert f["severity"] == "medium" and f["estimated_gain"] == pytest.approx(0.15, rel=0.05)
    assert "bucket_cap_mb=6" in f["fix"]["snippet"]
    assert "--knob ddp_bucket_cap_mb=script,6" in f["verify"]
    assert verify_knob_role(f["verify"]) == "fix"  # smaller buckets are the fix itself
    # the all-reduce longer than the backward: less often, fewer bytes (bf16 on CUDA)
    (f,) = _found([_model(comm=9.0, overlap=5.0, backward=5.0)],
                  device={"steps": 40})
    assert f["severity"] == "high" and f["estimated_gain"] == pytest.approx(0.4, rel=0.05)
    assert "model.no_sync()" in f["fix"]["snippet"]
    assert "default_hooks.bf16_compress_hook" in f["fix"]["snippet"]
    assert "--knob ddp_comm_hook=script,bf16" in f["verify"]
    # the fix is fewer all-reduces, a code change: the line leads with it and the hook is
    # an aside, judged as the knob's by trainprof verify (not "refuted" of the finding)
    from trainprof.experiments.verify import knob_role, main_measure

    assert knob_role(f["verify"]) == "aside"
    assert "model.no_sync()" in main_measure(f["verify"])
    assert "should fall" in main_measure(f["verify"])
    # GPUs over gloo: NCCL first
    (f,) = _found([_model(comm=9.0, overlap=5.0, backward=5.0, backend_name="gloo")],
                  device={"steps": 40})
    assert 'init_process_group("nccl")' in f["fix"]["snippet"]


def test_a_ddp_row_says_when_its_samples_are_too_few_for_a_finding():
    """A 40-step run: DDP's one sample, of iteration 10, showed "16.8 ms exposed (49% of
    step)" in the summary and no finding, unexplained."""
    from trainprof.report.terminal import _ddp_rows

    warm = {"settings": {"module_name": "Net", "backend_name": "gloo", "world_size": 2,
                         "bucket_cap_bytes": 25 * 2**20},
            "samples": [[10, int(1 * MS), int(6 * MS), int(9 * MS), int(4 * MS)]]}
    model = summarize_model(warm, 0.010)
    assert _found([model]) == []
    (row,) = _ddp_rows([model])
    assert row.endswith(": too few past DDP's warm-up for a finding (a longer run samples "
                        "more)"), row
    (row,) = _ddp_rows([_model(comm=9.0, overlap=5.0, backward=5.0)])
    assert "too few" not in row


def test_exposed_communication_is_the_rank_that_waits_least():
    """A straggler's delay shows as every other rank's communication: the rank that waits
    least says what the all-reduce itself costs."""
    model = _model(comm=9.0, overlap=1.0, backward=5.0)  # 8 ms exposed here
    ranks = [{"label": "0", "ddp_exposed_comm_s": 0.008},
             {"label": "1", "ddp_exposed_comm_s": 0.0005}]  # the straggler
    assert _found([model], ranks=ranks) == []
    ranks[1]["ddp_exposed_comm_s"] = 0.003
    (f,) = _found([model], ranks=ranks)
    assert f["evidence"]["rank_waiting_least"] == "1"
    assert f["estimated_gain"] == pytest.approx(0.3, rel=0.05)


#: rank 0's record of a 60-iteration run of two gloo ranks (torchrun, CPU): DDP timed only
#: iteration 10 (read once a second; it samples 1-10 and every 100th), the run's 10th
#: step - inside trainprof's op-count window (steps 8-10, left out of the step
#: statistics) and the slow first steps: forward 0.37 ms, backward 0.80 ms, all-reduce
#: 2.0 ms of which 0.12 ms under the backward, against a 1.13 ms median steady step
ITERATION_10 = [10, 366186, 799423, 2001436, 123834]


def test_an_iteration_longer_than_the_steady_step_gives_no_share_of_it():
    """DDP's figures come from single iterations of its choosing; one that ran far longer
    than the run's steady step (warm-up, a profiled step) is no share of it: it read
    "1.9 ms exposed (167% of step)", "397%" on another run."""
    entry = {"settings": {"module_name": "Sequential", "backend_name": "gloo",
                          "world_size": 2}, "samples": [ITERATION_10]}
    m = summarize_model(entry, 0.00113)
    assert m["exposed_share"] is None and m["usable_samples"] == 0
    assert "iteration 10 3.0 ms" in m["share_withheld"] and "1.1 ms" in m["share_withheld"]
    # DDP's figures stay, as measured
    assert m["exposed_ms"] == pytest.approx((2001436 - 123834) / 1e6)
    assert m["iterations"] == [10]
    assert _found([m]) == []  # nothing diagnosed from it
    from trainprof.report.terminal import _ddp_rows

    (row,) = _ddp_rows([m])
    assert "% of step" not in row and "no share of the step" in row
    # a steady sample later in the run is used, and only it
    m = summarize_model({**entry, "samples": [ITERATION_10, [100, 200_000, 500_000,
                                                               400_000, 100_000]]}, 0.00113)
    assert m["samples_from"] == "steady" and m["iterations"] == [100]
    assert m["exposed_share"] == pytest.approx(0.3 / 1.13)
    # an iteration longer than the median (within 1.5x): its share of its own span, <= 1
    m = summarize_model({**entry, "samples": [[100, 200_000, 500_000, 1_000_000, 100_000]]},
                        0.00113)
    assert m["exposed_share"] == pytest.approx(0.9 / (0.2 + 0.5 + 0.9))
    # of each rank: the share of its own step, no more than the step
    from trainprof.analysis.ranks import _ddp_exposed_s, _ddp_exposed_share

    withheld = summarize_model(entry, 0.00113)
    assert _ddp_exposed_s({"ddp": [withheld]}) is None
    assert _ddp_exposed_share({"ddp": [withheld]}) is None
    assert _ddp_exposed_share({"ddp": [m]}) == pytest.approx(m["exposed_share"])


def test_find_unused_parameters_that_found_none_is_named_and_its_knob_turns_it_off(
    one_rank, tmp_path
):
    from trainprof.diagnosis import diagnose

    with trainprof.profile(tmp_path / "r", report=False):
        model = DDP(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1)),
                    find_unused_parameters=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(20):
            model(torch.randn(4, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
    run = load_run(tmp_path / "r")
    doc = analyse(run)
    (m,) = doc["ddp"]
    assert m["find_unused_parameters"] is True and m["unused_parameter_bytes"] == 0
    (f,) = [f for f in doc["findings"] if f["cause"] == "find_unused_parameters"]
    assert (f["severity"], f["estimated_gain"]) == ("low", 0.0)
    assert "find_unused_parameters=False" in f["fix"]["snippet"]
    assert "--knob ddp_find_unused_parameters=script,false" in f["verify"]
    # a model with a parameter really unused: DDP counts its bytes, and nothing is said
    used = {**m, "unused_parameter_bytes": 68}
    assert not [f for f in diagnose({**doc, "ddp": [used]}, run.steps)
                if f["cause"] == "find_unused_parameters"]

    knobs = Knobs({"ddp_find_unused_parameters": False}).install()
    try:
        off = DDP(nn.Linear(8, 8), find_unused_parameters=True)
        assert off._get_ddp_logging_data()["find_unused_parameters"] == 0
    finally:
        record = knobs.uninstall()
    assert record["process"]["ddp"] == [{"script_find_unused_parameters": True,
                                         "find_unused_parameters": False}]
    assert _actual("ddp_find_unused_parameters",
                   {"ddp": [{"settings": {"find_unused_parameters": 0}}]}) == "false"


class _ModelDroppedWhileRead:
    """Stands in for a DDP model that the script lets go of while the flush thread reads it
    (a rank whose all-reduce failed: its frames go as the exception leaves the script)."""

    def __init__(self) -> None:
        import threading
        from types import SimpleNamespace

        self.reading, self.dropped = threading.Event(), threading.Event()
        data = SimpleNamespace(strs_map={"backend_name": "gloo"}, ints_map={"world_size": 2})
        self.logger = SimpleNamespace(_get_ddp_logging_data=lambda: data)

    def _get_ddp_logging_data(self) -> dict:
        self.reading.set()
        self.dropped.wait(5)
        return {"backend_name": "gloo", "world_size": 2, "iteration": 3,
                "forward_compute_time": 5, "backward_compute_time": 7}


def test_a_model_dropped_while_it_is_read_does_not_deadlock_the_poll():
    """The poller's reference is then the last one: the model goes, and its callback reads
    it once more, on the polling thread. That used to wait forever on the lock the poll
    held, and the record of the run never closed."""
    import threading

    from trainprof.capture.ddp_stats import DDPStats

    stats = DDPStats()
    model = _ModelDroppedWhileRead()
    reading, dropped = model.reading, model.dropped
    stats.add(model)
    result: list[bool] = []
    poller = threading.Thread(target=lambda: result.append(stats.poll()), daemon=True)
    poller.start()
    assert reading.wait(5)
    del model  # the script's reference goes while the poll holds the only other one
    dropped.set()
    poller.join(5)
    assert not poller.is_alive(), "the poll deadlocked on its own lock"
    assert result == [True]
    entry = stats.record()[0]
    assert entry["settings"] == {"backend_name": "gloo", "world_size": 2}
    assert entry["samples"] == [[3, 5, 7, 0, 0]]
    assert not stats.poll()  # gone: nothing more to read


def test_the_channels_last_knob_leaves_a_ddp_model_as_built(one_rank):
    """DDP laid its gradient buckets out for the parameters as they were when it was built:
    the knob converts neither the wrapper nor the module inside it, and says so."""
    knobs = Knobs({"channels_last": True}).install()
    try:
        model = DDP(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(144, 1)))
        for _ in range(2):
            model(torch.randn(2, 3, 8, 8)).sum().backward()
    finally:
        record = knobs.uninstall()
    assert model.module[0].weight.is_contiguous()  # NCHW, as built
    assert record["process"]["channels_last"] == {
        "value": True, "modules": 0, "calls": 0, "inputs": 0,
        "skipped": {"DistributedDataParallel": 2}}
    meta = {"knobs": {"process": record["process"]}}
    assert _actual("channels_last", meta) == "true (not applied: DistributedDataParallel)"
