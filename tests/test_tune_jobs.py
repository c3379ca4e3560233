"""`trainprof tune --slurm`: a sweep's rounds as submitit jobs (experiments/jobs.py).

CI has no SLURM; submitit's local executor (``--slurm cluster=local``) runs the same jobs
as processes of this machine, through the same submission, pickling, result and cancel
paths. What these tests hold: each round is one job whose trials ran in it, one after
another on one host; the sweep is analysed as a local one; a stopped sweep stops its job's
trial cleanly and leaves nothing running; bad parameters are one-line errors.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import trainprof, write_script

from trainprof.cli import _split_run_args
from trainprof.errors import UsageError
from trainprof.experiments.jobs import make_runner, parse_params
from trainprof.report.tune_terminal import render_tune

pytest.importorskip("submitit")

LOOP = """
    import torch
    from torch import nn

    model = nn.Linear(64, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(10**6):
        loss = model(torch.randn(32, 64)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
"""


def test_each_round_is_one_job_and_the_sweep_is_analysed_as_a_local_one(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_script(tmp_path, "train.py", LOOP)
    out = tmp_path / "sweep"
    res = trainprof("tune", "--slurm", "cluster=local,timeout_min=10", "--knob",
                    "gc_threshold=700,0", "--trials", "2", "--steps", "20", "--json",
                    "--out", str(out), "train.py", cwd=tmp_path, timeout=240)
    assert res.returncode == 0, res.stderr
    doc = res.json()
    assert doc["status"] == "finished" and doc["trials_done"] == doc["trials_planned"] == 4
    executor = doc["executor"]
    assert executor["parameters"] == {"cluster": "local", "timeout_min": 10}
    jobs = {j["round"]: j["job_id"] for j in executor["jobs"]}
    assert sorted(jobs) == [1, 2] and len(set(jobs.values())) == 2
    trials = [t for arm in doc["arms"] for t in arm["trials"]]
    assert all(t["usable"] and t["steady_steps"] > 0 for t in trials)
    # a round's trials ran in its job, on this host
    assert {(t["trial"], t["job_id"]) for t in trials} == set(jobs.items())
    assert {t["host"] for t in trials} == {socket.gethostname()}
    for t in trials:
        assert json.loads((Path(t["run_dir"]) / "run.json").read_text())["status"] == "finished"
    base, other = doc["arms"]
    assert base["baseline"] and other["ratio"] > 0 and len(other["ci"]) == 2
    assert other["actual"] == {"gc_threshold": "0"}  # the knob reached the trial in the job
    # submitit's own files: each job's pickled call and its logs
    assert {p.name for p in (out / "submitit").glob("*_submitted.pkl")} == {
        f"{j}_submitted.pkl" for j in jobs.values()}
    assert "[round 2/2] job" in res.stderr and "on " + socket.gethostname() in res.stderr
    # the terminal report says where the rounds ran
    render_tune(json.loads((out / "tune.json").read_text()))
    shown = capsys.readouterr().out
    assert "Rounds as jobs (local, submitit; one round's arms on one node): " in shown
    assert all(j in shown for j in jobs.values())


def test_a_stopped_sweep_stops_its_jobs_trial_cleanly_and_leaves_nothing_running(
        tmp_path: Path) -> None:
    write_script(tmp_path, "train.py", LOOP)
    out = tmp_path / "sweep"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainprof", "tune", "--slurm", "cluster=local", "--knob",
         "gc_threshold=700,0", "--trials", "2", "--steps", "100000", "--json",
         "--out", str(out), "train.py"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 90
        running = []
        while not running and time.monotonic() < deadline:
            running = [p for p in out.glob("*/steps.bin") if p.stat().st_size > 0]
            time.sleep(0.1)
        assert running, "no trial started training"
        tree = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)  # what a scheduler sends; Ctrl-C does the same
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert "stopped; cancelled 1 job not done" in stderr
    doc = json.loads(stdout)
    assert doc["status"] == "interrupted" and doc["trials_done"] == 0
    # the trial in flight closed its record as interrupted, and is left out
    record = json.loads((running[0].parent / "run.json").read_text())
    assert record["status"] == "interrupted"
    trials = {Path(t["run_dir"]).name: t for a in doc["arms"] for t in a["trials"]}
    assert trials[running[0].parent.name]["status"] == "interrupted"
    assert not any(t["usable"] for t in trials.values())
    # the job's controller, its function's process and the trial's `trainprof run`: all gone
    assert len(tree) >= 3
    gone, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive, [p.cmdline() for p in alive]


def test_parameters_are_typed_and_bad_ones_are_one_line_errors(tmp_path: Path) -> None:
    assert parse_params("slurm_partition=gpu, gpus_per_node=1,mem_gb=7.5,exclusive=true,") == {
        "slurm_partition": "gpu", "gpus_per_node": 1, "mem_gb": 7.5, "exclusive": True}
    assert parse_params("") == {}
    for bad, message in (("partition", "KEY=VALUE pairs"), ("cluster=kube", "use one of")):
        with pytest.raises(UsageError, match=message):
            parse_params(bad)
    with pytest.raises(UsageError, match="--slurm: .*nosuch"):
        make_runner(tmp_path / "a", {"cluster": "local", "nosuch": 1}, "x")
    if shutil.which("sbatch") is None:
        with pytest.raises(UsageError, match="no `sbatch` here"):
            make_runner(tmp_path / "b", {}, "x")
    # `--slurm` takes a value only when it reads as one
    assert _split_run_args(["--slurm", "train.py", "--lr", "1"]) == (
        ["--slurm=", "train.py"], ["--lr", "1"])
    assert _split_run_args(["--slurm", "cluster=local", "train.py"]) == (
        ["--slurm", "cluster=local", "train.py"], [])
    write_script(tmp_path, "train.py", LOOP)
    res = trainprof("tune", "--slurm", "cluster=local,nosuch=1", "--knob", "gc_threshold=700,0",
                    "--out", str(tmp_path / "sweep"), "train.py", cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.startswith("error: --slurm: ") and len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "sweep").exists()  # nothing ran: no folder left
