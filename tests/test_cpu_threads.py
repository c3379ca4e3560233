"""Too few intra-op threads on a CPU run (diagnosis/cpu_threads.py)."""

from __future__ import annotations

import os

import pytest
from test_diagnosis import make_steps, make_summary

from trainprof.diagnosis import diagnose


def _finding(threads: int, cores: int = 2, proc: float = 100.0, sys_cpu: float = 50.0,
             workers: float = 0.0, parts: dict | None = None, **env):
    steps = make_steps(60)  # compute-bound: forward, backward, optimizer
    summary = make_summary(steps, system={"n_samples": 20, "proc_cpu_pct": proc,
                                          "workers_cpu_pct": workers, "sys_cpu_pct": sys_cpu},
                           **(parts or {}))
    summary["environment"] = {"usable_cores": cores, "torch_num_threads": threads,
                              "cuda": None, "gpu_count": 0, **env}
    found = [f for f in diagnose(summary, steps) if f["cause"] == "too_few_threads"]
    return found[0] if found else None


def test_one_thread_with_a_core_idle_gets_the_core():
    """Measured: an MLP on 1 of 2 cores ran x0.54 of the step with 2 (trainprof tune)."""
    f = _finding(1)
    assert f is not None and f["category"] == "compute" and f["severity"] == "high"
    assert f["estimated_gain"] == pytest.approx(0.5)  # all compute, 1 thread of 2
    assert "torch.set_num_threads(2)" in f["fix"]["snippet"]
    assert f["verify"] == "trainprof tune --knob torch_threads=1,2 train.py"
    assert "set_num_threads call" in f["fix"]["text"]


def test_the_environment_that_set_the_pool_is_named():
    f = _finding(1, thread_env={"OMP_NUM_THREADS": "1"})
    assert "OMP_NUM_THREADS=1" in f["fix"]["text"]
    assert f["evidence"]["thread_env"] == {"OMP_NUM_THREADS": "1"}


def test_no_finding_without_idle_cores_or_on_cuda_or_at_full_pool():
    assert _finding(2) is None  # every core in the pool
    assert _finding(1, sys_cpu=100.0) is None  # the other core is busy (another process)
    assert _finding(1, workers=90.0) is None  # a worker uses it
    assert _finding(1, cuda="12.4", gpu_count=1) is None


def test_ranks_sharing_the_host_share_its_cores():
    # examples/ddp_straggler.py: 2 ranks of 1 thread each on 2 cores, the straggler
    # idle half its step: rank 0 is not told to take both cores
    ranks = {"ranks": [{"label": str(i), "host": "node1", "steps": 60,
                        "torch_num_threads": 1} for i in range(2)]}
    assert _finding(1, parts=ranks) is None
    assert _finding(1, parts={"distributed": {"rank": 0, "world_size": 2}}) is None
    # 2 ranks of 1 thread on 4 cores, 2 of them idle: 2 threads each
    f = _finding(1, cores=4, sys_cpu=50.0, parts=ranks)
    assert f is not None and "torch.set_num_threads(2)" in f["fix"]["snippet"]
    # ranks on two hosts, one each: the host's cores are the rank's
    apart = {"ranks": [{"label": str(i), "host": f"node{i}", "steps": 60,
                        "torch_num_threads": 1} for i in range(2)]}
    assert _finding(1, parts=apart) is not None


def test_the_pool_stops_at_the_physical_cores():
    # 32 logical cores, 16 physical: torch's default 16 threads is not "too few"
    assert _finding(16, cores=32, proc=1600.0, sys_cpu=50.0, physical_cores=16,
                    logical_cores=32) is None
    f = _finding(8, cores=32, proc=800.0, sys_cpu=25.0, physical_cores=16, logical_cores=32)
    assert f is not None and "torch.set_num_threads(16)" in f["fix"]["snippet"]
    assert f["estimated_gain"] == pytest.approx(0.5)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores")
def test_a_script_that_pins_one_thread_is_told(tp):
    body = """
    import torch
    from torch import nn
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(256, 256), torch.randint(0, 10, (256,))
    for step in range(60):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
    """
    res = tp(body, "--json")
    assert res.returncode == 0, res.stderr
    doc = res.json()
    assert doc["environment"]["torch_num_threads"] == 1
    if doc["system"]["sys_cpu_pct"] > 100 * (1 - 0.75 / doc["environment"]["usable_cores"]):
        pytest.skip("other processes kept the idle core busy: nothing to give the pool")
    f = next(f for f in doc["findings"] if f["cause"] == "too_few_threads")
    assert f["evidence"]["torch_num_threads"] == 1
    assert f["evidence"]["proposed_threads"] >= 2


# -- idle intra-op threads that spin while the loop waits (contention.spinning_threads) --

def _spin_finding(proc: float = 124.0, threads: int = 2, num_workers: int = 1,
                  thread_env: dict | None = None, cuda: str | None = None):
    """Measured: a loop waiting 71% of its step for 1 worker (a dataset building its
    samples in Python), the process at 124% CPU, the worker at 60%; with
    OMP_WAIT_POLICY=PASSIVE the process used 48% and `trainprof tune --knob
    omp_wait_policy=script,passive` measured x0.75 of the step."""
    from test_diagnosis import MS, loader

    steps = make_steps(60, data=7.1 * MS, forward=1.0 * MS, backward=1.0 * MS,
                       optimizer=0.3 * MS, other=0.6 * MS)
    summary = make_summary(
        steps, dataloaders=[loader(num_workers=num_workers, persistent_workers=True)],
        system={"n_samples": 20, "proc_cpu_pct": proc, "workers_cpu_pct": 60.0,
                "sys_cpu_pct": 93.0})
    summary["environment"] = {"usable_cores": 2, "torch_num_threads": threads,
                              "cuda": cuda, "gpu_count": 1 if cuda else 0,
                              "thread_env": thread_env}
    found = [f for f in diagnose(summary, steps) if f["cause"] == "spinning_threads"]
    return (found[0] if found else None), summary


def test_threads_spinning_while_the_loop_waits_for_workers_are_named():
    f, summary = _spin_finding()
    assert f is not None and f["category"] == "cpu_contention"
    b = summary["breakdown"]
    needed = (b["forward"] + b["backward"] + b["optimizer"]) * 2 + b["other"] + b["gc"]
    # (evidence is rounded to 4 significant digits)
    assert f["evidence"]["cores_needed"] == pytest.approx(needed, abs=1e-3)
    spin = 1.24 - needed
    assert f["evidence"]["cores_spun"] == pytest.approx(spin, abs=1e-3)
    assert f["estimated_gain"] == pytest.approx(b["data_wait"] * spin / (spin + 0.6), abs=1e-3)
    assert "OMP_WAIT_POLICY=PASSIVE python train.py" in f["fix"]["snippet"]
    assert f["verify"] == "trainprof tune --knob omp_wait_policy=script,passive train.py"


def test_no_spinning_finding_where_it_cannot_be():
    assert _spin_finding(proc=48.0)[0] is None  # measured with OMP_WAIT_POLICY=PASSIVE
    assert _spin_finding(thread_env={"OMP_WAIT_POLICY": "passive"})[0] is None
    assert _spin_finding(threads=1)[0] is None  # no pool to spin
    assert _spin_finding(num_workers=0)[0] is None  # nothing waits for a worker
    assert _spin_finding(cuda="12.4")[0] is None


def test_the_wait_policy_knob_is_the_childs_environment():
    from trainprof.capture.knobs import knob_environment, parse_value
    from trainprof.errors import UsageError
    from trainprof.experiments import tune as tune_mod

    assert knob_environment({"omp_wait_policy": "passive", "num_workers": 2}) == {
        "OMP_WAIT_POLICY": "PASSIVE"}
    assert knob_environment({"omp_wait_policy": None}) == {}  # "script": the parent's
    with pytest.raises((UsageError, ValueError)):
        parse_value("omp_wait_policy", "sometimes")
    meta = {"fingerprint": {"threads": {"env": {"OMP_WAIT_POLICY": "PASSIVE"}}}}
    assert tune_mod._actual("omp_wait_policy", meta) == "passive"
    assert tune_mod._actual("omp_wait_policy", {"fingerprint": {}}) == "unset (spin, then sleep)"


def test_a_passive_wait_policy_is_recorded_and_read(tp):
    body = """
    import torch
    w = torch.zeros(8, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    for _ in range(20):
        (w * torch.randn(8)).sum().backward(); opt.step(); opt.zero_grad()
    """
    res = tp(body, "--json", env={"OMP_WAIT_POLICY": "PASSIVE"})
    assert res.returncode == 0, res.stderr
    assert res.json()["environment"]["thread_env"] == {"OMP_WAIT_POLICY": "PASSIVE"}
