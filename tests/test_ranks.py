"""Training in several processes: one record per rank, merged (DESIGN.md).

Real runs in subprocesses: ``torch.multiprocessing.spawn`` and ``multiprocessing``
processes started by the script, and a ``torchrun`` launch of ``trainprof run``
with DistributedDataParallel over gloo. The uneven-ranks scripts give one rank a
dataset that sleeps a known time per sample, so the merged view must name that rank.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
from conftest import trainprof, write_script

from trainprof.analysis.ranks import (
    common_step_durations,
    common_step_means,
    load_ranks,
    merge_ranks,
    merged_status,
    rank_spread,
)
from trainprof.capture.ranks import default_launch_dir, launcher_rank
from trainprof.commands import analyse_folder
from trainprof.diagnosis.distributed import straggler_rank, uneven_input_pipeline
from trainprof.report.perfetto import export_perfetto
from trainprof.store import RUN_JSON, STEP_DTYPE, load_run

#: Two ranks of DDP over gloo (CPU); rank 1's dataset sleeps SLOW_S per sample.
#: Run by torch.multiprocessing.spawn (``spawn``) or as a torchrun script (``env``).
DDP = """
import os, sys, time
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

SLOW_S = 0.002
BATCH = 8


class Samples(Dataset):
    def __init__(self, delay):
        self.delay = delay

    def __len__(self):
        return 24 * BATCH

    def __getitem__(self, i):
        if self.delay:
            time.sleep(self.delay)
        return torch.full((16,), float(i)), torch.ones(1) * (i % 3)


def train(rank, world_size, port):
    if port:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world_size)
    else:
        dist.init_process_group("gloo")  # torchrun's environment
    rank = dist.get_rank()
    torch.set_num_threads(1)
    loader = DataLoader(Samples(SLOW_S if rank == 1 else 0.0), batch_size=BATCH)
    model = DDP(nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "spawn":
        mp.spawn(train, args=(2, int(sys.argv[2])), nprocs=2)
    elif sys.argv[1] == "relaunch":  # PyTorch Lightning's DDP launcher: rank 0 starts the
        import subprocess            # others as `python <script> <args>`, LOCAL_RANK set
        child = None
        if "LOCAL_RANK" not in os.environ:
            os.environ["LOCAL_RANK"] = "0"
            child = subprocess.Popen([sys.executable, os.path.abspath(sys.argv[0])]
                                     + sys.argv[1:], env={**os.environ, "LOCAL_RANK": "1"})
        train(int(os.environ["LOCAL_RANK"]), 2, int(sys.argv[2]))
        if child is not None:
            sys.exit(child.wait())
    elif sys.argv[1] == "slurm":  # a task of `srun --ntasks 2`: SLURM_PROCID of SLURM_NTASKS
        train(int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"]),
              int(sys.argv[2]))
    else:
        train(0, 0, 0)
"""


#: Two spawned ranks that train until stopped (--max-steps, Ctrl-C).
ENDLESS_SPAWN = """
import torch
import torch.multiprocessing as mp
from torch import nn


def train(rank):
    model = nn.Linear(64, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    while True:
        loss = model(torch.randn(32, 64)).sum()
        opt.zero_grad(); loss.backward(); opt.step()


if __name__ == "__main__":
    mp.spawn(train, nprocs=2)
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _check_uneven_ranks(doc: dict) -> None:
    """The merged view of DDP: rank 1 waits ~24 x 2 ms... for data, rank 0 waits in backward."""
    rows = {r["label"]: r for r in doc["ranks"]}
    assert set(rows) == {"0", "1"}
    assert doc["main_rank"] == "0"
    for label, row in rows.items():
        assert row["status"] == "finished" and row["steps"] == 24, row
        assert row["rank"] == int(label) and row["world_size"] == 2
    # rank 1 loads 8 samples of 2 ms per step: >= 16 ms of data wait; rank 0 almost none
    assert rows["1"]["data_wait_s"] >= 0.016, rows["1"]
    assert rows["0"]["data_wait_s"] < 0.005, rows["0"]
    # synchronous data parallelism: both step at the slow rank's pace
    # (each rank's own steady steps: where warm-up ended may differ by a step or two)
    assert rows["0"]["mean_s"] == pytest.approx(rows["1"]["mean_s"], rel=0.25)
    assert doc["rank_spread"].get("spread_pct", 0) < 10
    assert "straggler_rank" not in [f["cause"] for f in doc["findings"]]
    # ...rank 0 waiting inside backward (the gradient all-reduce)
    assert doc["breakdown"]["backward"] > 0.5, doc["breakdown"]
    spread = doc["rank_spread"]
    assert spread["most_data_wait_rank"] == "1" and spread["data_wait_spread_s"] >= 0.015
    total = rows["0"]["samples_per_s"] + rows["1"]["samples_per_s"]
    assert doc["samples_per_s_all_ranks"] == pytest.approx(total)
    top = doc["findings"][0]
    assert (top["category"], top["cause"]) == ("distributed", "uneven_input_pipeline"), top
    assert top["title"].startswith("Rank 1 waits") and top["estimated_gain"] > 0.5


def test_spawned_ranks_are_recorded_one_folder_each_and_merged(tp):
    res = tp(DDP, "--json", args=("spawn", str(_free_port())), timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = res.json()
    _check_uneven_ranks(doc)
    assert doc["run_dir"] == str(res.run_dir)
    # the ranks' loaders have torch's SequentialSampler: each rank reads all of the data,
    # and their first batches (fingerprinted where they were loaded) show it
    assert doc["rank_data"] == {"loader_index": 0, "identical_ranks": ["0", "1"],
                                "ranks_compared": 2}
    (f,) = [f for f in doc["findings"] if f["cause"] == "every_rank_reads_all_data"]
    assert (f["severity"], f["estimated_gain"]) == ("high", 0.0)
    assert (f["evidence"]["world_size"], f["evidence"]["wrapper"]) == (
        2, "DistributedDataParallel")
    assert f["title"].startswith("The first batches of Samples are identical on all 2 ranks")
    assert "DistributedSampler(dataset, shuffle=False)" in f["fix"]["snippet"]
    assert any("2 ranks recorded under ranks/" in n for n in doc["notes"]), doc["notes"]
    # each rank is a complete run folder of its own, readable on its own
    for label in ("0", "1"):
        run = load_run(res.run_dir / "ranks" / label)
        assert run.status == "finished"
        assert run.meta["distributed"] == {"rank": int(label), "world_size": 2,
                                           "backend": "gloo"}
        # system samples, unless the rank (0.4 s of training) ended before its sampler's
        # first one - a busy machine slows the sampler's start - which the record says
        if (res.run_dir / "ranks" / label / "samples.jsonl").stat().st_size == 0:
            assert "system samples: none, the run ended before the sampler's first one" in (
                run.meta["missing"])
    # the HTML report and the stored summary are the merged ones, in the run's folder
    assert ">Ranks</h2>" in (res.run_dir / "report.html").read_text()
    assert not (res.run_dir / "ranks" / "0" / "report.html").exists()
    stored = json.loads((res.run_dir / RUN_JSON).read_text())["summary"]
    assert [r["label"] for r in stored["ranks"]] == ["0", "1"]
    # `trainprof report` of the run merges again; of one rank, shows that rank
    rep = trainprof("report", str(res.run_dir), "--json", cwd=res.run_dir.parent)
    assert rep.returncode == 0, rep.stderr
    assert rep.json()["rank_spread"]["most_data_wait_rank"] == "1"
    one = trainprof("report", str(res.run_dir / "ranks" / "1"), "--json", cwd=res.run_dir.parent)
    assert one.json()["breakdown"]["data_wait"] > 0.5 and "ranks" not in one.json()
    # one Perfetto timeline with both ranks, aligned on the host's monotonic clock: in
    # lock-step, each step begins at nearly the same moment on both
    out = res.run_dir.parent / "timeline.json"
    exp = trainprof("export", str(res.run_dir), "--perfetto", str(out), cwd=res.run_dir.parent)
    assert exp.returncode == 0, exp.stderr
    events = json.loads(out.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e["name"] == "process_name"}
    starts: dict[str, dict[int, float]] = {}
    for e in events:
        if e.get("cat") == "step":
            starts.setdefault(names[e["pid"]], {})[e["args"]["step"]] = e["ts"]
    assert set(starts) == {"rank 0 (training process)", "rank 1 (training process)"}
    a, b = starts.values()
    assert len(a) == len(b) == 25  # 24 steps and the cut-off end of each
    # µs; a step is ~20 ms (the median over the steps: one step of one rank may start a
    # few ms late on a busy machine, 3.1 ms once)
    assert float(np.median([abs(a[n] - b[n]) for n in a if n in b])) < 3000, (a, b)
    rank1_waits = [e["dur"] for e in events if e.get("name") == "data_wait"
                   and names[e["pid"]].startswith("rank 1")]
    assert sum(rank1_waits) / len(rank1_waits) > 10_000  # µs per step: 8 samples x 2 ms
    # TensorBoard: one run per rank; the parent process (it trained no step) has none
    logs = res.run_dir.parent / "tb"
    exp = trainprof("export", str(res.run_dir), "--tensorboard", str(logs),
                    cwd=res.run_dir.parent)
    assert exp.returncode == 0, exp.stderr
    assert sorted(p.parent.relative_to(logs).as_posix()
                  for p in logs.rglob("events.out.tfevents.*")) == [
        f"{res.run_dir.name}/rank0", f"{res.run_dir.name}/rank1"]


def test_torchrun_launch_records_each_rank_and_rank_0_prints_the_merge(tmp_path):
    write_script(tmp_path, "train.py", DDP)
    out = tmp_path / "launch"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--no-python", sys.executable, "-m", "trainprof", "run", "--json", "--out", str(out),
         "train.py", "env"],
        cwd=tmp_path, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)  # one document: local rank 0's, the others print none
    _check_uneven_ranks(doc)
    assert doc["status"] == "finished" and doc["exit_code"] == 0
    assert "trainprof: rank 1 recorded to" in proc.stderr
    assert not (out / RUN_JSON).exists()  # a launch has no process of its own
    assert (out / "report.html").exists()
    for label in ("0", "1"):
        assert (out / "ranks" / label / RUN_JSON).exists()
        assert (out / "ranks" / label / "findings.json").exists()


def test_trainprof_run_of_torchrun_records_the_ranks_it_launches(tmp_path):
    """``trainprof run -m torch.distributed.run ... train.py``, the command a user types
    with ``trainprof run`` in front: the launcher runs under trainprof, its ranks are
    started as ``trainprof run`` of the script into ranks/<RANK>/, and the launcher prints
    them merged. Before, the ranks ran unrecorded and the run said "nothing to measure"."""
    write_script(tmp_path, "train.py", DDP)
    res = trainprof("run", "--json", "--no-html", "--out", str(tmp_path / "launch"), "-m",
                    "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    "train.py", "env", cwd=tmp_path, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = res.json()
    _check_uneven_ranks(doc)
    assert "nothing to measure" not in res.stderr
    assert res.stderr.count("trainprof: rank ") == 2  # each rank's one line
    out = tmp_path / "launch"
    for label in ("0", "1"):
        meta = json.loads((out / "ranks" / label / RUN_JSON).read_text())
        assert meta["distributed"]["rank"] == int(label)
        assert meta["command"][-2:] == ["train.py", "env"]  # the script, not -u
        # the rank's own helpers (its system sampler) inherit the launch's environment and
        # must stay helpers: a sampler recorded as a rank never stopped in time
        assert not [m for m in meta["missing"] if "did not stop" in m], meta["missing"]
        assert not (out / "ranks" / label / "ranks").exists()
    own = json.loads((out / RUN_JSON).read_text())  # the launcher's: no step of its own
    assert own["steps_recorded"] == 0


def test_a_rank_never_takes_its_own_children_for_launched_ranks(monkeypatch, tmp_path):
    from trainprof.capture.ranks import ChildRuns

    runs = ChildRuns(tmp_path / "run", name="train", command=["train.py"],
                     sample_interval_s=0.2, max_steps=None)
    env = {"TORCHELASTIC_RUN_ID": "x", "RANK": "1"}
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    cmd = runs.launched_rank([sys.executable, "-u", "-m", "pkg.train", "--lr", "1"], env)
    assert cmd is not None and cmd[-4:] == ["-m", "pkg.train", "--lr", "1"]
    assert f"--out={tmp_path / 'run'}" in cmd and runs.launched == [("1", "pkg.train")]
    assert runs.launched_rank([sys.executable, "-u", "train.py"], {"RANK": "0"}) is None
    monkeypatch.setenv("RANK", "0")  # this process is a rank: its children are helpers
    assert runs.launched_rank([sys.executable, "-m", "trainprof.capture.sampler_process"],
                              env) is None


def test_a_script_that_runs_itself_again_records_each_run_as_a_rank(tp):
    """PyTorch Lightning's DDP launcher trains as rank 0 and starts ranks 1.. as
    ``python <script> <args>`` with LOCAL_RANK set: those run under ``trainprof run``
    into ranks/<LOCAL_RANK> of the run (they ran unrecorded, with a note), and the
    summary merges them with the run's own record as rank 0."""
    res = tp(DDP, "--json", args=("relaunch", str(_free_port())), timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = res.json()
    _check_uneven_ranks(doc)
    assert [r["label"] for r in doc["ranks"]] == ["0", "1"]
    assert doc["ranks"][0]["run_dir"] == str(res.run_dir)  # rank 0 is the run's own record
    assert doc["status"] == "finished" and doc["exit_code"] == 0
    # the run's own first batch is rank 0's, compared with rank 1's (no DistributedSampler)
    assert doc["rank_data"]["identical_ranks"] == ["0", "1"]
    rank1 = json.loads((res.run_dir / "ranks" / "1" / RUN_JSON).read_text())
    assert rank1["status"] == "finished" and rank1["rank_label"] == "1"
    assert rank1["command"][1:] == [str(res.run_dir.parent / "train.py"), "relaunch",
                                    rank1["command"][-1]]  # the same script and arguments
    assert "trainprof: rank 1 of " in res.stderr and res.stderr.count("Steps ") == 0
    assert [n for n in doc["notes"] if "ran itself again" in n] == [
        "the script ran itself again in 1 process (LOCAL_RANK 1), as PyTorch Lightning's DDP "
        "launcher does: each recorded in ranks/<k>/ of this run (k = 1); this process is "
        "rank 0, the figures above are its own"]
    # `report` merges the folder the same way
    rep = trainprof("report", "--json", str(res.run_dir), cwd=res.run_dir.parent)
    assert rep.returncode == 0 and [r["label"] for r in rep.json()["ranks"]] == ["0", "1"]


def test_profile_api_records_a_script_that_runs_itself_again_as_ranks(tmp_path):
    """The same under ``with trainprof.profile()`` and plain ``python train.py``: the run
    of itself records under ``trainprof run`` (where the script's profile() attaches to
    it), and the profile's summary waits for it and merges it."""
    write_script(tmp_path, "train.py", """
    import json, os, subprocess, sys
    import torch
    import trainprof
    with trainprof.profile("prof", report=False) as prof:
        if "LOCAL_RANK" not in os.environ:
            child = subprocess.Popen([sys.executable, os.path.abspath(sys.argv[0])]
                                     + sys.argv[1:], env={**os.environ, "LOCAL_RANK": "1"})
        w = torch.zeros(4, requires_grad=True)
        opt = torch.optim.SGD([w], lr=0.1)
        for _ in range(int(sys.argv[1])):
            (w * 2).sum().backward(); opt.step(); opt.zero_grad()
    if "LOCAL_RANK" not in os.environ:
        print(json.dumps([(r["label"], r["steps"], r["status"]) for r in prof.summary["ranks"]]))
        sys.exit(child.wait())
    """)
    proc = subprocess.run([sys.executable, "train.py", "20"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout) == [["0", 20, "finished"], ["1", 20, "finished"]]
    assert (tmp_path / "prof" / "ranks" / "1" / RUN_JSON).exists()


def test_a_forked_process_that_crashes_leaves_a_crashed_rank(tp):
    body = """
    import multiprocessing as mp
    import torch
    from torch import nn

    def train(n):
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(n):
            loss = model(torch.randn(2, 4)).sum()
            opt.zero_grad(); loss.backward(); opt.step()
        raise RuntimeError("out of data")

    if __name__ == "__main__":
        ctx = mp.get_context("fork")
        p = ctx.Process(target=train, args=(7,), name="trainer")
        p.start(); p.join()
        print("child exit", p.exitcode)
    """
    res = tp(body, "--json")
    assert res.returncode == 0, res.stderr
    assert "RuntimeError: out of data" in res.stderr  # multiprocessing prints it, as before
    assert "trainprof/capture" not in res.stderr  # ...with the user's frames only
    assert "child exit 1" in res.stderr  # (--json: the script's stdout goes to stderr)
    doc = res.json()
    assert doc["status"] == "finished" and doc["main_rank"] == "0"
    assert doc["steps"]["count"] == 7
    (row,) = doc["ranks"]
    assert (row["status"], row["exit_code"], row["steps"]) == ("crashed", 1, 7)


def test_max_steps_stops_every_spawned_rank(tp):
    res = tp(ENDLESS_SPAWN, "--json", "--max-steps", "15", "--py", "skip_first=2,active=5",
             timeout=120)
    assert res.returncode == 0, res.stderr
    doc = res.json()
    # profiled steps are counted, not timed: 15 steps each, 5 of them under cProfile
    assert [(r["steps"], r["status"]) for r in doc["ranks"]] == [(15, "finished")] * 2
    assert "trainprof: stopped process 0: reached --max-steps after 15 steps" in res.stderr
    # every rank runs the heavy tools asked for (here cProfile over steps 2-6)
    for label in ("0", "1"):
        top = json.loads((res.run_dir / "ranks" / label / "python" / "top.json").read_text())
        assert top, label
    assert doc["python_profile"] is not None  # rank 0's, in the merged view


def test_helper_processes_are_not_recorded(tp):
    body = """
    import multiprocessing as mp
    import torch
    from torch import nn

    if __name__ == "__main__":
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with mp.get_context("spawn").Pool(2) as pool:
            print(sum(pool.map(abs, range(-4, 4))))
        for step in range(6):
            loss = model(torch.randn(2, 4)).sum()
            opt.zero_grad(); loss.backward(); opt.step()
    """
    res = tp(body, "--json")
    assert res.returncode == 0, res.stderr
    doc = res.json()
    assert doc["steps"]["count"] == 6 and "ranks" not in doc
    assert not (res.run_dir / "ranks").exists()
    assert any("2 other processes" in n and "not measured" in n for n in doc["notes"]), doc


# -- the pieces, on their own ---------------------------------------------------------


def test_launcher_rank_reads_the_torch_distributed_environment():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    r = launcher_rank(env)
    assert r is not None and (r.rank, r.world_size, r.local_rank, r.local_world_size) == (
        3, 8, 1, 4)
    assert launcher_rank({"RANK": "0", "WORLD_SIZE": "1"}) is None  # a world of one
    assert launcher_rank({"RANK": "x", "WORLD_SIZE": "2"}) is None
    assert launcher_rank({"RANK": "2", "WORLD_SIZE": "2"}) is None  # out of range
    assert launcher_rank({}) is None
    # no LOCAL_*: a single-host launch
    r = launcher_rank({"RANK": "1", "WORLD_SIZE": "2"})
    assert r is not None and (r.local_rank, r.local_world_size) == (1, 2)


def test_launcher_rank_reads_srun_tasks_of_a_job_step():
    from trainprof.capture.ranks import slurm_tasks_on_node

    step = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "3", "SLURM_PROCID": "5",
            "SLURM_STEP_NUM_TASKS": "7", "SLURM_NTASKS": "7", "SLURM_LOCALID": "1",
            "SLURM_NODEID": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
            "SLURM_JOB_START_TIME": "1700000000"}
    r = launcher_rank(step)
    assert r is not None and (r.rank, r.world_size, r.local_rank, r.local_world_size) == (
        5, 7, 1, 2)
    assert (r.launcher, r.started, r.launch_id) == ("slurm", 1700000000.0, "slurm4242.3")
    # torchrun inside an allocation: its RANK wins over the task's SLURM_PROCID
    r = launcher_rank({**step, "RANK": "9", "WORLD_SIZE": "16"})
    assert r is not None and (r.rank, r.launcher) == (9, "torchrun")
    # an sbatch script itself (no step of srun's): one process, an ordinary run
    batch = {k: v for k, v in step.items() if not k.startswith("SLURM_STEP")}
    assert launcher_rank(batch) is None
    assert launcher_rank({**step, "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}) is None
    assert slurm_tasks_on_node("2(x3),1", "3") == 1
    assert slurm_tasks_on_node("4", "0") == 4
    assert slurm_tasks_on_node("2(x3),1", "4") is None
    assert slurm_tasks_on_node("", "0") is None
    r = launcher_rank({**step, "SLURM_STEP_TASKS_PER_NODE": "garbage"})
    assert r is not None and r.local_world_size == 7  # unknown: the whole step


def test_default_launch_dir_of_a_slurm_step_is_the_same_on_every_node(tmp_path):
    step = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_JOB_START_TIME": "1700000000"}
    a = default_launch_dir("train", 0, root=tmp_path,
                           launch=launcher_rank({**step, "SLURM_PROCID": "0"}))
    b = default_launch_dir("train", 1, root=tmp_path,
                           launch=launcher_rank({**step, "SLURM_PROCID": "1"}))
    stamp = datetime.fromtimestamp(1700000000).strftime("%Y%m%d-%H%M%S")
    assert a == b == tmp_path / f"{stamp}-train-slurm77.0"
    # another step of the job (the same job start) gets a folder of its own
    c = default_launch_dir("train", 0, root=tmp_path, launch=launcher_rank(
        {**step, "SLURM_STEP_ID": "1", "SLURM_PROCID": "0"}))
    assert c == tmp_path / f"{stamp}-train-slurm77.1"


def test_default_launch_dir_is_shared_and_skips_an_earlier_launch(tmp_path):
    a = default_launch_dir("train", 0, root=tmp_path)
    assert default_launch_dir("train", 1, root=tmp_path) == a  # every rank picks the same
    (a / "ranks" / "1").mkdir(parents=True)
    (a / "ranks" / "1" / RUN_JSON).write_text("{}")
    b = default_launch_dir("train", 1, root=tmp_path)
    assert b == a.with_name(a.name + "-2")


def _row(label: str, mean: float, wait: float) -> dict:
    return {"label": label, "mean_s": mean, "data_wait_s": wait, "samples_per_s": 10.0}


def _steps(durations_ms: list[float], first: int = 0) -> np.ndarray:
    out = np.zeros(len(durations_ms), dtype=STEP_DTYPE)
    out["step"] = np.arange(first, first + len(durations_ms))
    out["dur_ns"] = np.asarray(durations_ms) * 1e6
    return out


def test_rank_spread_follows_the_trace_definition_over_shared_steps():
    # rank 0 has a slow warm-up of 3 steps, rank 1 of 1: the means cover steps 3..32 of both
    steps = {"0": (_steps([50.0] * 3 + [10.0] * 30), 3), "1": (_steps([90.0] + [8.0] * 40), 1)}
    durations, n = common_step_durations(steps)
    means = common_step_means(durations)
    assert n == 30 and means == pytest.approx({"0": 0.010, "1": 0.008})
    rows = [_row("0", 0.010, 0.001), _row("1", 0.008, 0.004), _row("2", 0.0, 0)]
    spread = rank_spread(rows, means, n)
    assert spread is not None
    # (slowest - fastest) / slowest, as merged torch.profiler traces (analysis.trace)
    assert spread["spread_pct"] == pytest.approx(20.0)
    assert (spread["slowest_rank"], spread["fastest_rank"]) == ("0", "1")
    assert spread["data_wait_spread_s"] == pytest.approx(0.003)
    assert spread["most_data_wait_rank"] == "1"
    # too few shared steps: no step-time spread (a spike would decide it)
    short, n_short = common_step_durations({k: (d[:15], w) for k, (d, w) in steps.items()})
    few = rank_spread(rows, common_step_means(short), n_short)
    assert few is not None and "spread_pct" not in few
    assert rank_spread([_row("0", 0.01, 0.0)]) is None


def test_merged_status_of_a_launch_is_its_worst_rank():
    assert merged_status([("0", {"status": "finished", "exit_code": 0}),
                          ("1", {"status": "crashed", "exit_code": 1})]) == ("crashed", 1)
    assert merged_status([("0", {"status": "finished", "exit_code": 0})]) == ("finished", 0)


class _Ctx:
    def __init__(self, summary: dict) -> None:
        self.summary = summary
        self.step_info = summary["steps"]
        self.train_loader = (summary.get("dataloaders") or [None])[0]


def _merged(waits: tuple[float, float], medians: tuple[float, float] = (0.02, 0.02),
            per_step: tuple[np.ndarray, np.ndarray] | None = None,
            durations_ms: tuple[list[float], list[float]] | None = None,
            world_size: int | None = 2) -> dict:
    """Two ranks' merged summary: mean data waits ``waits`` (s), each step waiting the mean
    give or take 5% unless ``per_step`` gives each rank's waits (s); 50 steps of the median
    each unless ``durations_ms`` gives each rank's; ranks of a process group of
    ``world_size`` (None: processes that never joined one)."""
    own = None
    ranks = []
    durations_ms = durations_ms or tuple([m * 1e3] * 50 for m in medians)
    steps = {str(k): (_steps(list(d)), 0) for k, d in enumerate(durations_ms)}
    rng = np.random.default_rng(0)
    for k, (d, _) in steps.items():
        wait = waits[int(k)]
        d["data_wait_ns"] = (per_step[int(k)] if per_step is not None
                             else rng.normal(wait, 0.05 * wait, len(d))) * 1e9
    for label, (wait, median) in enumerate(zip(waits, medians, strict=True)):
        summary = {"run_dir": f"r/{label}", "status": "finished", "exit_code": 0,
                   "steps": {"count": 50, "median_s": median, "mean_s": median,
                             "p10_s": median, "p90_s": median},
                   "breakdown": {"data_wait": wait / median}, "samples_per_s": 100.0,
                   "notes": [], "findings": []}
        dist = ({"distributed": {"rank": label, "world_size": world_size}}
                if world_size else {})
        ranks.append((str(label), summary, {"pid": 1, **dist}))
    return merge_ranks(Path("r"), own, ranks, steps)


def test_distributed_rules_fire_on_uneven_ranks_only():
    even = _Ctx(_merged((0.001, 0.0015)))
    assert uneven_input_pipeline(even) is None and straggler_rank(even) is None
    uneven = uneven_input_pipeline(_Ctx(_merged((0.001, 0.009))))
    assert uneven is not None and uneven.severity == "high"  # 8 ms of a 20 ms step: 40%
    assert uneven.estimated_gain == pytest.approx(0.4)
    assert uneven_input_pipeline(_Ctx(_merged((0.0, 0.0012)))).severity == "low"  # 6%
    assert "sampler = DistributedSampler(dataset" in uneven.fix.snippet
    # where a framework adds the sampler itself, the fix is the loader's settings alone
    for by, says in (("lightning", "Lightning adds a DistributedSampler itself"),
                     ("transformers.Trainer", "dataloader_num_workers=workers_per_rank")):
        merged = _merged((0.001, 0.009))
        merged["dataloaders"] = [{"driven_by": by}]
        fix = uneven_input_pipeline(_Ctx(merged)).fix.snippet
        assert says in fix and "DistributedSampler(" not in fix
    # a few long waits on one rank of a busy machine: as much extra wait on average, by chance
    quiet = np.full(50, 0.0003)
    spiky = quiet.copy()
    spiky[[7, 31]] = 0.012  # two waits of 12 ms in 50 steps: +0.47 ms a step on average
    # (of an 8 ms step: 6%, a low finding were it the rank's pace)
    merged = _merged((float(quiet.mean()), float(spiky.mean())), (0.008, 0.008), (quiet, spiky))
    lo, hi = merged["rank_spread"]["data_wait_spread_ci_s"]
    assert lo <= 0 < merged["rank_spread"]["data_wait_spread_s"] < hi
    assert uneven_input_pipeline(_Ctx(merged)) is None
    # the same extra wait in every step: the rank's pace, found with its interval
    steady = quiet + 0.00047
    merged = _merged((float(quiet.mean()), float(steady.mean())), (0.008, 0.008),
                     (quiet, steady))
    found = uneven_input_pipeline(_Ctx(merged))
    assert found is not None and found.severity == "low"
    assert found.evidence["difference_ci_s"][0] == pytest.approx(0.00047, rel=0.01)
    # one rank's two slow steps in 50 (a busy machine): 22% apart on average, by chance
    spiky_steps = [20.0] * 50
    spiky_steps[12] = spiky_steps[40] = 160.0
    merged = _merged((0.0, 0.0), durations_ms=([20.0] * 50, spiky_steps))
    assert merged["rank_spread"]["spread_pct"] == pytest.approx(21.9, abs=0.1)
    assert merged["rank_spread"]["spread_ci_pct"][0] <= 0
    assert straggler_rank(_Ctx(merged)) is None
    slow = straggler_rank(_Ctx(_merged((0.0, 0.0), medians=(0.02, 0.026))))
    assert slow is not None and slow.evidence["spread_ci_pct"][0] > 20
    assert slow is not None and slow.severity == "medium" and "Rank 1" in slow.title
    assert slow.estimated_gain == pytest.approx(0.23, abs=0.01)  # 6 ms of the slowest 26
    # the same two processes with no process group: neither waits for the other
    alone = straggler_rank(_Ctx(_merged((0.0, 0.0), medians=(0.02, 0.026), world_size=None)))
    assert alone is not None and alone.severity == "low" and alone.estimated_gain == 0
    assert "Process 1" in alone.title and "neither waits for the other" in alone.title
    assert "collective" not in alone.fix.text


def test_a_launch_folder_with_ranks_only_merges(tmp_path, tp):
    """`trainprof report` on a launch folder (no run.json of its own) merges its ranks."""
    body = """
    import torch
    from torch import nn
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(12):
        loss = model(torch.randn(2, 4)).sum()
        opt.zero_grad(); loss.backward(); opt.step()
    """
    launch = tmp_path / "launch"
    for rank in ("0", "1"):
        res = tp(body, "--out", str(launch / "ranks" / rank))
        assert res.returncode == 0, res.stderr
    summary, main = analyse_folder(launch)
    assert summary["main_rank"] == "0" and main.path == launch / "ranks" / "0"
    assert [r["steps"] for r in summary["ranks"]] == [12, 12]
    assert summary["status"] == "finished" and summary["run_dir"] == str(launch)
    rep = trainprof("report", str(launch), cwd=tmp_path)
    assert rep.returncode == 0, rep.stderr
    assert "Rank 1" in rep.stdout and "finished · 12 steps" in rep.stdout
    # the commands that read one record take the main rank's
    cmp = trainprof("compare", str(launch), str(launch / "ranks" / "1"), "--json", cwd=tmp_path)
    assert cmp.returncode == 0, cmp.stderr
    assert cmp.json()["a"]["run_dir"] == str(launch / "ranks" / "0")
    exp = trainprof("export", str(launch), "--perfetto", str(tmp_path / "t.json"), cwd=tmp_path)
    assert exp.returncode == 0 and (tmp_path / "t.json").exists(), exp.stderr


def test_example_ddp_straggler_names_the_slow_rank_and_its_fix_clears_it(tmp_path):
    example = Path(__file__).resolve().parent.parent / "examples" / "ddp_straggler.py"
    res = trainprof("run", "--json", str(example), "--steps", "30", cwd=tmp_path, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = res.json()
    assert [r["steps"] for r in doc["ranks"]] == [30, 30]
    top = doc["findings"][0]
    assert (top["category"], top["cause"], top["severity"]) == (
        "distributed", "uneven_input_pipeline", "high")
    # 16 samples of 1 ms a step on rank 1 (sleep() overshoots under load), little on rank 0
    assert 0.014 < top["evidence"]["difference_s"] < 0.05
    fixed = trainprof("run", "--json", str(example), "--steps", "30", "--slow-ms", "0",
                      cwd=tmp_path, timeout=180)
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    left = [f"{f['cause']}: {f['title']}" for f in fixed.json()["findings"]
            if f["category"] == "distributed"]
    assert not left, left
    assert fixed.json()["samples_per_s_all_ranks"] > 2 * doc["samples_per_s_all_ranks"]


def test_torchrun_rank_that_crashes_leaves_a_crashed_launch(tmp_path):
    """Rank 1 raises at step 20; rank 0 then fails in its all-reduce (gloo sees the peer
    gone). Every record is closed as crashed, and rank 0 still prints the merge."""
    write_script(tmp_path, "train.py", """
        import torch, torch.distributed as dist
        from torch import nn
        from torch.nn.parallel import DistributedDataParallel as DDP
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        model = DDP(nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(1000):
            if rank == 1 and step == 20:
                raise RuntimeError("rank 1 failed")
            loss = model(torch.randn(8, 16)).sum()
            opt.zero_grad(); loss.backward(); opt.step()
    """)
    out = tmp_path / "launch"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--no-python", sys.executable, "-m", "trainprof", "run", "--json", "--out", str(out),
         "train.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode != 0
    assert "RuntimeError: rank 1 failed" in proc.stderr
    assert proc.stdout.strip(), proc.stderr[-4000:]  # rank 0's merged JSON
    doc = json.loads(proc.stdout)
    assert (doc["status"], doc["exit_code"]) == ("crashed", 1)
    rows = {r["label"]: r for r in doc["ranks"]}
    assert (rows["1"]["status"], rows["1"]["steps"]) == ("crashed", 20)
    assert rows["0"]["status"] == "crashed" and rows["0"]["steps"] >= 19
    # too few shared steps for a step-time spread: no straggler from a crash
    assert "straggler_rank" not in [f.get("cause") for f in doc["findings"]]


def test_wait_for_ranks_returns_those_still_open_when_time_runs_out(tmp_path):
    import os
    import socket

    from trainprof.capture.ranks import wait_for_ranks

    def record(label: str, status: str, pid: int) -> None:
        (tmp_path / "ranks" / label).mkdir(parents=True)
        (tmp_path / "ranks" / label / RUN_JSON).write_text(json.dumps(
            {"status": status, "pid": pid, "hostname": socket.gethostname()}))

    record("0", "finished", os.getpid())
    record("1", "running", os.getpid())  # alive: still open
    assert wait_for_ranks(tmp_path, 3, timeout_s=0.3) == ["1", "1 not started"]
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout
    (tmp_path / "ranks" / "1" / RUN_JSON).write_text(json.dumps(
        {"status": "running", "pid": int(dead), "hostname": socket.gethostname()}))
    assert wait_for_ranks(tmp_path, 2, timeout_s=5) == []  # a dead writer's record is closed
    # once every record is closed, a rank that never started is waited for a grace only
    t0 = time.monotonic()
    assert wait_for_ranks(tmp_path, 3, timeout_s=30, start_grace_s=0.5) == ["1 not started"]
    assert time.monotonic() - t0 < 5


def test_the_terminal_lists_ranks_and_folds_helpers_that_ran_no_step():
    from trainprof.report.terminal import MAX_RANK_ROWS, _rank_reports, _rank_rows

    def row(label: str, steps: int, status: str = "finished") -> dict:
        return {"label": label, "status": status, "exit_code": 0, "steps": steps,
                "median_s": 0.01 if steps else None, "p90_s": 0.012 if steps else None,
                "data_wait": 0.1 if steps else None, "samples_per_s": 100.0 if steps else None}

    ranks = [row("0", 50), row("1", 50), row("2", 0), row("3", 0), row("4", 0, "crashed")]
    ranks[1]["findings"] = ["input_pipeline/too_few_workers", "gc/full_collections"]
    ranks[1]["run_dir"] = "r/ranks/1"
    merged = {"steps": {"count": 50}, "ranks": ranks, "main_rank": "0",
              "findings": [{"category": "gc", "cause": "full_collections"}]}
    rows = _rank_rows(merged)
    assert [label for label, _ in rows] == ["Rank 0", "Rank 1", "Rank 4", "Processes"]
    assert rows[0][1] == "finished · 50 steps · median 10.0 ms (p90 12.0 ms) · data wait 10.0% " \
                         "· 100 samples/s"
    # another rank's own findings, less those the merged view already shows; the command
    # for its report under the table, whole (a cell would wrap it)
    assert rows[1][1].endswith("· its own findings: input_pipeline/too_few_workers "
                               "(its report: below)")
    assert _rank_reports(merged) == ["trainprof report r/ranks/1"]
    assert rows[2][1].startswith("crashed · no step")  # a helper that crashed stays in view
    assert rows[3][1] == "2 started by the script ran no step (ranks/ 2, 3): helpers, not training"
    # nothing stepped anywhere: every process is shown
    assert len(_rank_rows({"steps": {"count": 0}, "ranks": [row("0", 0), row("1", 0)]})) == 2
    many = _rank_rows({"steps": {"count": 5}, "ranks": [row(str(k), 5) for k in range(40)]})
    assert len(many) == MAX_RANK_ROWS + 1 and "24 more ranks" in many[-1][1]


def _host_summary(threads: list[int], cores: int = 8, workers_pct: float = 0.0,
                  cuda: bool = False) -> dict:
    rows = [{"label": str(k), "steps": 50, "host": "node1", "torch_num_threads": t,
             "on_cuda": cuda, "workers_cpu_pct": workers_pct} for k, t in enumerate(threads)]
    return {"ranks": rows, "environment": {"usable_cores": cores, "torch_num_threads": threads[0]},
            "breakdown": {"data_wait": 0.0, "forward": 0.3, "backward": 0.5, "optimizer": 0.1,
                          "gc": 0.0, "other": 0.1},
            "steps": {"count": 50, "median_s": 0.01}, "command": ["python", "train.py"]}


def test_ranks_that_oversubscribe_their_host_are_named():
    from trainprof.diagnosis.context import Context
    from trainprof.diagnosis.distributed import ranks_oversubscribe_cores

    # four CPU ranks, each with a pool sized for the 8-core machine: 32 threads on 8 cores
    f = ranks_oversubscribe_cores(Context(_host_summary([8, 8, 8, 8]), None))
    assert f is not None and f.cause == "ranks_oversubscribe_cores" and f.severity == "high"
    assert f.estimated_gain == pytest.approx(0.9 * (1 - 8 / 32))
    assert f.evidence["core_demand"] == 32 and "torch.set_num_threads(2)" in f.fix.snippet
    assert "--knob torch_threads=2,4,8" in f.verify
    # a share each: nothing to report; nor for ranks on CUDA (one launching thread each)
    assert ranks_oversubscribe_cores(Context(_host_summary([2, 2, 2, 2]), None)) is None
    assert ranks_oversubscribe_cores(Context(_host_summary([8] * 4, cuda=True), None)) is None
    # measured DataLoader workers count in the budget: 4 x 1 thread + 4 x 1.5 cores > 8;
    # the threads are at one each already, so the fix is fewer workers: 1 core a rank
    # beside its thread, for workers measured at 1.5 cores - 2 of the 3
    summary = _host_summary([1] * 4, workers_pct=150.0)
    summary["dataloaders"] = [{"index": 0, "num_workers": 3, "dataset": "__main__.Images"}]
    f = ranks_oversubscribe_cores(Context(summary, None))
    assert f is not None and f.evidence["core_demand"] == pytest.approx(10.0)
    assert f.evidence["suggested_num_workers"] == 2 and "set_num_threads" not in f.fix.snippet
    assert "num_workers=2)  # was 3" in f.fix.snippet
    assert "--knob num_workers=2,3 " in f.verify
    assert "run 1 op thread each already" in f.fix.text
    del summary["dataloaders"]  # without workers to count, no fix to give
    assert ranks_oversubscribe_cores(Context(summary, None)) is None


def test_ranks_whose_loaders_are_iterated_together_count_all_their_workers():
    """zip(a, b) in each rank: the workers measured at 1.5 cores a rank are both loaders'
    (2 + 4), and the budget of 1 core a rank beside its thread scales all 6 of them: 4 a
    rank, not 2 of the training loader's 3 (num_workers=1 had been suggested)."""
    from trainprof.diagnosis.context import Context
    from trainprof.diagnosis.distributed import ranks_oversubscribe_cores

    summary = _host_summary([1] * 4, workers_pct=150.0)
    summary["dataloaders"] = [
        {"index": 0, "num_workers": 2, "dataset": "__main__.Images", "iterated_with": [1],
         "sampler": "torch.utils.data.sampler.RandomSampler"},
        {"index": 1, "num_workers": 4, "dataset": "__main__.Unlabeled", "iterated_with": [0],
         "sampler": "torch.utils.data.sampler.RandomSampler"},
        {"index": 2, "num_workers": 3, "dataset": "__main__.Eval"},  # iterated after: apart
    ]
    f = ranks_oversubscribe_cores(Context(summary, None))
    assert f is not None
    assert f.evidence["num_workers"] == 6 and f.evidence["suggested_num_workers"] == 4
    assert f.evidence["loaders_iterated_together"] == [0, 1]
    assert "4 workers a rank instead of 6 (of the 2 DataLoaders it iterates together" in f.fix.text
    # the knob sets every loader's workers: 2 each, against the script's own 2 and 4
    assert "# each of the 2 loaders iterated together: 2 workers (4 a rank in all, now 6: " \
        "2, 4)\nloader = DataLoader(dataset, ..., num_workers=2)" in f.fix.snippet
    assert "--knob num_workers=2,script " in f.verify


def test_spawned_ranks_with_default_thread_pools_oversubscribe_the_host(tp):
    """Each spawned rank sizes its intra-op pool for the whole machine (spawn, unlike
    torchrun, leaves OMP_NUM_THREADS alone): two of them ask for twice the cores. On this
    machine `trainprof tune --knob torch_threads=2,1` measured 4.6x faster steps with 1."""
    import os

    import torch

    if 2 * torch.get_num_threads() <= len(os.sched_getaffinity(0)):
        pytest.skip("torch's default pool is half the logical cores here (hyper-threads)")
    body = """
    import os, torch, torch.distributed as dist, torch.multiprocessing as mp
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    def train(rank, port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=2)
        model = DDP(nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256)))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(40):
            loss = model(torch.randn(64, 256)).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
        dist.destroy_process_group()

    if __name__ == "__main__":
        import sys
        mp.spawn(train, args=(int(sys.argv[1]),), nprocs=2)
    """
    res = tp(body, "--json", args=(str(_free_port()),), timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = res.json()
    threads = [r["torch_num_threads"] for r in doc["ranks"]]
    assert threads[0] == threads[1] >= 1
    found = [f for f in doc["findings"] if f["cause"] == "ranks_oversubscribe_cores"]
    assert found, [(f["cause"], f["estimated_gain"]) for f in doc["findings"]]
    assert found[0]["evidence"]["intra_op_threads"] == 2 * threads[0]
    assert found[0]["evidence"]["usable_cores"] < 2 * threads[0]


def test_child_runs_decide_what_is_recorded_and_where(tmp_path):
    import importlib
    from types import SimpleNamespace

    from trainprof.capture.ranks import MAX_RECORDED, ChildRuns, RecordedTarget

    # (the module, not torch.multiprocessing.spawn the function that shadows it)
    torch_spawn = importlib.import_module("torch.multiprocessing.spawn")
    runs = ChildRuns(tmp_path, name="t", command=["t.py"], sample_interval_s=0.2,
                     max_steps=None)

    def proc(target, args=(), name="p"):
        return SimpleNamespace(_target=target, _args=args, name=name)

    def train(rank):
        return rank

    # spawn's _wrap(fn, i, args, error_file): fn is wrapped, its index is the label
    p = proc(torch_spawn._wrap, (train, 3, (), "/tmp/err"))
    runs.prepare(p)
    assert p._target is torch_spawn._wrap and isinstance(p._args[0], RecordedTarget)
    assert p._args[0].spec.run_dir == str(tmp_path / "ranks" / "3")
    assert p._args[1:] == (3, (), "/tmp/err")
    # a plain target gets the lowest free number; the same spawn index again, the next one
    q = proc(train)
    runs.prepare(q)
    assert isinstance(q._target, RecordedTarget) and q._target.spec.label == "0"
    r = proc(torch_spawn._wrap, (train, 3, (), "e"))
    runs.prepare(r)
    assert r._args[0].spec.label == "1"
    # helpers, subclasses with their own run(), and anything beyond the cap: untouched
    import multiprocessing.pool

    h = proc(multiprocessing.pool.worker)
    runs.prepare(h)
    assert h._target is multiprocessing.pool.worker
    s = proc(None)
    runs.prepare(s)
    assert s._target is None
    for i in range(MAX_RECORDED):
        runs.prepare(proc(train, name=f"x{i}"))
    assert len(runs.recorded) == MAX_RECORDED


def test_trace_of_a_run_folder_merges_the_ranks_deep_windows(tmp_path):
    """`trainprof trace RUN` on a run of several ranks recorded with --deep: each rank's
    torch.profiler window, merged like a folder of per-rank traces; the straggler shows
    there too (rank 0 in gloo's all-reduce, rank 1 in the DataLoader)."""
    example = Path(__file__).resolve().parent.parent / "examples" / "ddp_straggler.py"
    res = trainprof("run", "--deep", str(example), "--steps", "24", cwd=tmp_path, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    tr = trainprof("trace", str(res.run_dir), "--json", cwd=tmp_path)
    assert tr.returncode == 0, tr.stderr
    doc = tr.json()
    assert sorted(doc["ranks"]) == ["0", "1"]
    pct = {k: r["breakdown_pct"] for k, r in doc["ranks"].items()}
    assert pct["0"]["Communication"] > 50 and pct["1"]["DataLoader"] > 50, pct
    # the Perfetto export carries every rank's trace, each on its own rank's steps
    out = tmp_path / "timeline.json"
    exp = trainprof("export", str(res.run_dir), "--perfetto", str(out), cwd=tmp_path)
    assert exp.returncode == 0, exp.stderr
    assert "merged rank 1: deep/" in exp.stderr, exp.stderr
    main, ranks = load_ranks(res.run_dir)
    merged = export_perfetto(main, out, ranks=ranks)["deep_traces"]
    assert sorted(t["file"].split(":")[0] for t in merged) == ["rank 0", "rank 1"], merged
    for t in merged:  # Kineto's step N begins just after trainprof's step N, on both ranks
        # (-0.0007 ms once: the run's wall and step clock origins are read a moment apart)
        assert t["alignment"] == "wall_clock" and -0.05 <= t["residual_ms"] < 5, merged
    events = json.loads(out.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e["name"] == "process_name"}
    starts = {}
    for e in events:
        m = re.match(r"ProfilerStep#(\d+)$", str(e.get("name", "")))
        if m and e.get("ph") == "X":
            starts.setdefault(names[e["pid"]], {})[int(m.group(1))] = e["ts"]
    assert set(starts) == {"rank 0 (training process)", "rank 1 (training process)"}, starts
    (a, b) = starts.values()
    shared = sorted(set(a) & set(b))
    assert shared, starts
    # in lock-step, both ranks' profiled steps begin within a few ms (a step is ~20 ms; on
    # a loaded machine one step of one rank started 15 ms late: the median is compared)
    assert float(np.median([abs(a[n] - b[n]) for n in shared])) < 5000, (a, b)
    # a run folder without a trace: one line saying what to do
    plain = tmp_path / "plain"
    write_script(tmp_path, "t.py", "print('no training')\n")
    assert trainprof("run", "--out", str(plain), "t.py", cwd=tmp_path).returncode == 0
    err = trainprof("trace", str(plain), cwd=tmp_path)
    assert err.returncode == 2 and err.stderr.startswith("error: ")
    assert "no torch.profiler trace" in err.stderr and len(err.stderr.splitlines()) == 1


def test_srun_tasks_record_into_one_folder_and_local_rank_0_prints_the_merge(tmp_path):
    """What `srun --ntasks 2 trainprof run --json train.py` starts: two tasks with
    SLURM's environment (and no RANK), the script taking its rank from SLURM_PROCID."""
    write_script(tmp_path, "train.py", DDP)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
           and not k.startswith("SLURM_")}
    env.update(SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="2",
               SLURM_NTASKS="2", SLURM_NODEID="0", SLURM_STEP_TASKS_PER_NODE="2")
    port = str(_free_port())
    tasks = [subprocess.Popen(
        [sys.executable, "-m", "trainprof", "run", "--json", "train.py", "slurm", port],
        cwd=tmp_path, env={**env, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    (out0, err0), (out1, err1) = (t.communicate(timeout=180) for t in tasks)
    assert [t.returncode for t in tasks] == [0, 0], err0[-2000:] + err1[-2000:]
    assert out1 == "" and "trainprof: rank 1 recorded to" in err1
    doc = json.loads(out0)  # local rank 0: the merged document, the only one
    _check_uneven_ranks(doc)
    (launch,) = (tmp_path / "trainprof-runs").iterdir()
    assert launch.name.endswith("-train-slurm4242.0") and doc["run_dir"] == str(launch)
    assert sorted(p.name for p in (launch / "ranks").iterdir()) == ["0", "1"]


def test_profile_api_under_torchrun_records_each_rank_in_one_launch_folder(tmp_path):
    write_script(tmp_path, "train.py", """
        import torch, torch.distributed as dist, trainprof
        from torch import nn
        from torch.nn.parallel import DistributedDataParallel as DDP
        dist.init_process_group("gloo")
        model = DDP(nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with trainprof.profile(html=False) as prof:
            for step in range(15):
                loss = model(torch.randn(8, 16)).sum()
                opt.zero_grad(); loss.backward(); opt.step()
        dist.destroy_process_group()
    """)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (launch,) = (tmp_path / "trainprof-runs").iterdir()  # one folder for the launch
    assert sorted(p.name for p in (launch / "ranks").iterdir()) == ["0", "1"]
    assert "trainprof: rank 1 recorded to" in proc.stderr
    assert f"all ranks merged: trainprof report {launch}" in proc.stderr
    summary, _ = analyse_folder(launch)
    assert [r["steps"] for r in summary["ranks"]] == [15, 15]


def test_ctrl_c_closes_every_rank_as_interrupted(tmp_path):
    """Ctrl-C reaches the whole process group: the spawned ranks close their records as
    interrupted, and the parent waits for them before it merges (spawn has not joined)."""
    import os
    import signal
    import time

    write_script(tmp_path, "train.py", ENDLESS_SPAWN)
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainprof", "run", "--json", "--out", str(out), "train.py"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(
            (out / "ranks" / k / "steps.bin").exists()
            and (out / "ranks" / k / "steps.bin").stat().st_size > 0 for k in ("0", "1")):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGINT, stderr[-3000:]  # ended by the signal, as python
    doc = json.loads(stdout)
    assert doc["status"] == "interrupted"
    assert [r["status"] for r in doc["ranks"]] == ["interrupted", "interrupted"]
    assert all(r["steps"] > 0 for r in doc["ranks"])


# -- gradient accumulation under DDP without no_sync() (expert-rules.md D4) -------------------

#: Two DDP ranks over gloo, two micro-batches an optimizer step, each all-reduced (the
#: first should be under model.no_sync(): the test below runs that loop).
ACCUMULATE = """
import sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def train(rank, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    torch.set_num_threads(1)
    model = DDP(nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(30):
        for micro in range(2):
            (model(torch.randn(8, 64)).square().mean() / 2).backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(train, args=(int(sys.argv[1]),), nprocs=2)
"""


def test_ddp_accumulation_without_no_sync_is_found_and_no_sync_is_counted(tp):
    port = str(_free_port())
    res = tp(ACCUMULATE, "--json", "--no-html", args=(port,), timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    # the stack timer starts at the first step's end: the set-up's connect() is not
    # interrupted (it failed with EINTR and torch retried 0.7 s later, with a warning)
    assert "Interrupted system call" not in res.stderr
    doc = res.json()
    assert doc["ddp_no_sync_calls"] == 0 and doc["ops"]["backward_per_step"] == 2.0
    (f,) = [f for f in doc["findings"] if f["cause"] == "allreduce_every_micro_step"]
    assert (f["category"], f["severity"], f["estimated_gain"]) == ("distributed", "low", 0.0)
    assert f["evidence"]["world_size"] == 2 and f["evidence"]["gain_unknown"] is True
    assert "model.no_sync()" in f["fix"]["snippet"] and "accum = 2" in f["fix"]["snippet"]


def test_ddps_own_timing_shows_the_all_reduce_the_step_waits_for_and_its_fix(tmp_path):
    """examples/ddp_allreduce.py: 16 MiB of gradients for 4 samples a rank. DDP's reducer
    times its all-reduce on every rank; read from the ranks' records, the part not hidden
    behind the backward pass is a finding, without a profiler; the example's
    ``--accumulate 4`` (no_sync() for 3 micro-batches of 4) is the fix, and proves it."""
    example = Path(__file__).resolve().parent.parent / "examples" / "ddp_allreduce.py"
    res = trainprof("run", "--json", "--no-html", "--out", str(tmp_path / "a"), str(example),
                    "--steps", "110", cwd=tmp_path, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = res.json()
    from trainprof.commands import analyse_folder

    exposed, median = {}, {}
    for label in ("0", "1"):
        rank, _ = analyse_folder(tmp_path / "a" / "ranks" / label)  # each rank on its own
        (m,) = rank["ddp"]
        assert (m["backend"], m["world_size"], m["module"]) == ("gloo", 2, "Sequential")
        assert m["gradient_bytes"] == 4 * 4 * (1024 * 1024 + 1024)
        assert m["samples_from"] == "steady" and 100 in m["iterations"]
        assert 0 <= m["overlap_ms"] <= m["comm_ms"] and m["exposed_ms"] <= m["comm_ms"]
        assert m["comm_ms"] > 1.0  # 16 MiB between two processes
        exposed[label] = m["exposed_ms"] / 1e3
        median[label] = rank["steps"]["median_s"]
    rows = {r["label"]: r for r in doc["ranks"]}
    assert {k: rows[k]["ddp_exposed_comm_s"] for k in rows} == pytest.approx(exposed)
    (f,) = [f for f in doc["findings"] if f["cause"] == "exposed_communication"]
    least = min(exposed, key=exposed.get)
    assert f["evidence"]["rank_waiting_least"] == least
    # that rank's share of its own step (analysis.ddp: of the longer of its median step and
    # the sampled iteration's own span, so never above 1), about exposed / the median step
    assert f["estimated_gain"] == pytest.approx(
        rows[least]["ddp_exposed_share"], rel=1e-3)  # (rounded to 4 digits)
    # (each sampled iteration's exposed time over the longer of the rank's median step and
    # the iteration's span, at most 1.5 medians: a median between 1/1.5 and 1 of the ratio)
    ratio = exposed[least] / median[least]
    assert ratio / 1.5 * 0.95 <= f["estimated_gain"] <= ratio * 1.05
    assert f["severity"] in ("medium", "high") and f["category"] == "distributed"
    assert "model.no_sync()" in f["fix"]["snippet"] and "--knob ddp_" in f["verify"]
    # the HTML report has a section of its own: the main rank's model, every rank's exposed time
    report = trainprof("report", str(tmp_path / "a"), "--html", str(tmp_path / "a.html"),
                       cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    page = (tmp_path / "a.html").read_text()
    section = page[page.index('<section id="ddp">'):]
    section = section[:section.index("</section>")]
    # the column headed by its words, the unit in its values ("exposed 1.2 ms")
    assert "Gradient all-reduce (DDP)" in section and "<th>exposed</th>" in section
    assert ">Sequential<" in section and ">gloo<" in section and "16.0 MiB" in section
    from trainprof.report.terminal import fmt_time

    assert f">{fmt_time(exposed[str(doc['main_rank'])])}<" in section
    ranks = page[page.index('<section id="ranks">'):]
    assert "<th>ddp exposed comm</th>" in ranks[:ranks.index("</section>")]

    # the fix: one all-reduce for 4 micro-batches (104 DDP iterations: 100 is sampled)
    fixed = trainprof("run", "--json", "--no-html", "--out", str(tmp_path / "b"),
                      str(example), "--steps", "26", "--accumulate", "4", cwd=tmp_path,
                      timeout=180)
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    after = fixed.json()
    gain = next((g["estimated_gain"] for g in after["findings"]
                 if g["cause"] == "exposed_communication"), 0.0)
    assert gain < f["estimated_gain"] / 1.5
    # per sample: a step now carries 4 micro-batches
    assert after["steps"]["median_s"] / 4 < doc["steps"]["median_s"] / 1.3


SHORT_DDP = """
import sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP


def train(rank, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    torch.set_num_threads(1)
    m = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 1)))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    for i in range(60):
        loss = m(torch.randn(32, 16)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(train, args=(int(sys.argv[1]),), nprocs=2)
"""


def test_a_short_ddp_run_never_puts_the_all_reduce_above_its_step(tp):
    """60 DDP iterations of a tiny model on two gloo ranks: DDP times iterations 1-10 (read
    once a second: iteration 10 only), the run's slow first steps, iteration 10 inside
    trainprof's op-count window; the steady step is ~1 ms. Set against it, that sample
    read "all-reduce 4.1 ms a step, 0.3 ms under backward, 3.8 ms exposed (397% of step)".
    A share, where one is given, is of a step it fits in; else the summary says why."""
    res = tp(SHORT_DDP, "--json", "--no-html", args=(str(_free_port()),), timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = res.json()
    for label in ("0", "1"):
        rank, _ = analyse_folder(res.run_dir / "ranks" / label)
        (m,) = rank["ddp"]
        assert m["samples"] >= 1 and max(m["iterations"]) <= 10, m
        if m["exposed_share"] is None:
            assert "no share of the step is given" in m["share_withheld"], m
        else:
            assert 0 <= m["exposed_share"] <= 1, m
    for row in doc["ranks"]:
        assert row["ddp_exposed_share"] is None or row["ddp_exposed_share"] <= 1, row
    for f in doc["findings"]:
        if f["cause"] == "exposed_communication":
            assert f["evidence"]["exposed_communication_share"] <= 1, f
    text = trainprof("report", str(res.run_dir), cwd=res.run_dir.parent)
    assert text.returncode == 0, text.stderr
    assert "all-reduce" in text.stdout
    shares = [int(v) for v in re.findall(r"\((\d+)% of step\)", text.stdout)]
    assert all(v <= 100 for v in shares), text.stdout


def test_no_sync_entries_are_counted_and_clear_the_accumulation_finding(tmp_path):
    """The fix's loop, in this process on one gloo rank: each ``model.no_sync()`` entered
    is counted, and the count is what keeps the finding away (the run's summary, as
    two ranks would have it, is diagnosed with the count and with 0)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import trainprof
    from trainprof.commands import analyse
    from trainprof.diagnosis import diagnose
    from trainprof.store import load_run

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with trainprof.profile(tmp_path / "r", report=False):
            model = DDP(nn.Linear(16, 1))
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            for _ in range(12):
                with model.no_sync():
                    (model(torch.randn(4, 16)).square().mean() / 2).backward()
                (model(torch.randn(4, 16)).square().mean() / 2).backward()
                opt.step()
                opt.zero_grad()
    finally:
        dist.destroy_process_group()
    run = load_run(tmp_path / "r")
    doc = analyse(run)
    assert doc["ddp_no_sync_calls"] == 12 and doc["ops"]["backward_per_step"] == 2.0
    assert doc["distributed"]["world_size"] == 1
    two = {**doc, "distributed": {**doc["distributed"], "world_size": 2}}

    def found(summary: dict) -> bool:
        return any(f["rule"] == "distributed.allreduce_every_micro_step"
                   for f in diagnose(summary, run.steps))

    assert not found(two) and found({**two, "ddp_no_sync_calls": 0})


def test_the_whole_data_in_every_rank_needs_ddp_and_torchs_own_sampler():
    from test_diagnosis import loader, make_steps, make_summary

    from trainprof.diagnosis import diagnose

    steps = make_steps(40)
    base = {"forward_roots": ["torch.nn.parallel.distributed.DistributedDataParallel"],
            "distributed": {"rank": 0, "world_size": 4}, "dataloaders": [loader()]}

    def found(**changes) -> list[dict]:
        return [f for f in diagnose(make_summary(steps, **{**base, **changes}), steps)
                if f["rule"] == "distributed.every_rank_reads_all_data"]

    (f,) = found()
    assert f["title"] == ("Each of the 4 ranks iterates all of Images (320 samples): the "
                          "DataLoader has no DistributedSampler, so an epoch is 4 passes over "
                          "the data")
    assert "DistributedSampler(dataset, shuffle=True)" in f["fix"]["snippet"]
    assert "sampler.set_epoch(epoch)" in f["fix"]["snippet"]
    fsdp = "torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel"
    assert found(forward_roots=[fsdp])
    dist_sampler = "torch.utils.data.distributed.DistributedSampler"
    for changes in ({"dataloaders": [loader(sampler=dist_sampler)]},
                    {"dataloaders": [loader(sampler="__main__.ShardSampler")]},
                    {"dataloaders": [loader(dataset="torch.utils.data.dataset.Subset")]},
                    {"dataloaders": [loader(driven_by="lightning")]},
                    {"dataloaders": [loader(iterable_dataset=True)]},
                    {"dataloaders": [loader(batch_sampler="__main__.Buckets")]},
                    {"distributed": {"world_size": 1}},
                    {"forward_roots": ["torch.nn.modules.linear.Linear"]}):
        assert not found(**changes), changes


def _rank(label: str, *first_batches: dict | None) -> tuple[str, dict, dict]:
    loaders = [{"loader_index": i, "first_batch": fb} for i, fb in enumerate(first_batches)]
    return label, {"workers": {"loaders": loaders}}, {}


def test_ranks_with_one_first_batch_load_the_same_data():
    from trainprof.analysis.ranks import same_data

    a, b, c = ({"digest": d, "varies": True} for d in "abc")
    # loader 0: ranks 0 and 2 alike; loader 1: all three alike (the largest group wins)
    ranks = [_rank("0", a, b), _rank("1", c, b), _rank("2", a, b)]
    assert same_data(ranks) == {"loader_index": 1, "identical_ranks": ["0", "1", "2"],
                                "ranks_compared": 3}
    assert same_data([_rank("0", a), _rank("1", c)]) == {
        "loader_index": 0, "identical_ranks": [], "ranks_compared": 2}
    # one constant batch on every rank is no evidence; one rank alone, or none, nothing
    const = {"digest": "k", "varies": False}
    assert same_data([_rank("0", const), _rank("1", const)])["identical_ranks"] == []
    assert same_data([_rank("0", a)]) is None
    assert same_data([_rank("0", None), _rank("1", None)]) is None


def test_the_same_first_batches_on_the_ranks_make_it_high_whatever_the_sampler():
    from test_diagnosis import loader, make_steps, make_summary

    from trainprof.diagnosis import diagnose

    steps = make_steps(40)
    ddp = ["torch.nn.parallel.distributed.DistributedDataParallel"]
    proof = {"loader_index": 0, "identical_ranks": ["0", "1"], "ranks_compared": 2}

    def found(stream: dict, rank_data: dict | None = proof) -> list[dict]:
        summary = make_summary(steps, forward_roots=ddp, dataloaders=[stream],
                               distributed={"rank": 0, "world_size": 2}, rank_data=rank_data)
        return [f for f in diagnose(summary, steps)
                if f["rule"] == "distributed.every_rank_reads_all_data"]

    stream = loader(dataset="__main__.Tokens", len=None, iterable_dataset=True,
                    sampler="torch.utils.data.dataloader._InfiniteConstantSampler")
    (f,) = found(stream)
    assert f["severity"] == "high" and f["evidence"]["identical_first_batch_ranks"] == ["0", "1"]
    assert f["title"] == ("The first batches of Tokens are identical on all 2 ranks: the "
                          "IterableDataset is not split by rank, so every rank trains on the "
                          "same data")
    assert "dist.get_rank() * workers + worker" in f["fix"]["snippet"]
    assert not found(stream, rank_data=None)  # an iterable dataset: no setting shows it
    assert not found(stream, rank_data={**proof, "identical_ranks": []})
    # two ranks of four alike: tensor-parallel peers share their batches by design
    assert not found(stream, rank_data={**proof, "ranks_compared": 4})
    # a sampler of its own, and still the same data on both ranks
    custom = loader(sampler="__main__.ShardSampler")
    (f,) = found(custom)
    assert f["severity"] == "high" and "(no DistributedSampler)" not in f["title"]
    assert not found(custom, rank_data={**proof, "loader_index": 1})  # another loader's
    # torch's own sampler: medium from the settings, high with the proof
    assert found(loader(), rank_data=None)[0]["severity"] == "medium"
    (f,) = found(loader())
    assert f["severity"] == "high" and f["title"].endswith("(no DistributedSampler)")


def test_the_accumulation_rule_needs_ddp_two_ranks_two_backwards_and_no_no_sync():
    from test_diagnosis import make_steps, make_summary

    from trainprof.diagnosis import diagnose

    steps = make_steps(40)
    base = {"forward_roots": ["torch.nn.parallel.distributed.DistributedDataParallel"],
            "ddp_no_sync_calls": 0, "distributed": {"rank": 0, "world_size": 4},
            "ops": {"backward_per_step": 4.0, "loops": []}}

    def found(**changes) -> list[dict]:
        return [f for f in diagnose(make_summary(steps, **{**base, **changes}), steps)
                if f["rule"] == "distributed.allreduce_every_micro_step"]

    (f,) = found()
    assert f["evidence"]["allreduces_not_needed_per_step"] == 3
    assert "by about 75%" in f["verify"]
    for changes in ({"ddp_no_sync_calls": 3}, {"ddp_no_sync_calls": None},
                    {"distributed": {"world_size": 1}}, {"ops": {"backward_per_step": 1.0}},
                    {"forward_roots": ["torch.nn.modules.linear.Linear"]}):
        assert found(**changes) == [], changes
