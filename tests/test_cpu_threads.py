"""Too few intra-op threads on a CPU run (diagnosis/cpu_threads.py)."""

from __future__ import annotations

import os

import pytest
from test_diagnosis import make_steps, make_summary

from trainprof.diagnosis import diagnose


def _finding(threads: int, cores: int = 2, proc: float = 100.0, sys_cpu: float = 50.0,
             workers: float = 0.0, **env):
    steps = make_steps(60)  # compute-bound: forward, backward, optimizer
    summary = make_summary(steps, system={"n_samples": 20, "proc_cpu_pct": proc,
                                          "workers_cpu_pct": workers, "sys_cpu_pct": sys_cpu})
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
