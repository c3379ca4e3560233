"""Debugging switches left on (expert rule H10): sampled while training, reported with
their cost, turned off by ``trainprof tune --knob anomaly_detection=false``."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from conftest import trainprof, write_script
from test_diagnosis import make_steps, make_summary

from trainprof.analysis.summary import _debug_modes
from trainprof.capture.debug_modes import DebugModes
from trainprof.capture.knobs import ENV_VAR
from trainprof.diagnosis import diagnose
from trainprof.experiments.tune import _actual

MODEL = """
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[
        torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
        for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    x = torch.randn(64, 64)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
"""


def test_sampling_counts_what_was_on():
    modes = DebugModes()
    assert modes.sample(1) is False  # nothing on
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autograd.detect_anomaly(check_nan=False):
            assert modes.sample(2) is True  # first seen on: worth writing at once
            assert modes.sample(3) is False
    with torch.profiler.profile():
        modes.sample(4)
    assert modes.record() == {"samples": 4, "on": {"anomaly_detection": 2, "profiler": 1},
                              "first_on_step": {"anomaly_detection": 2, "profiler": 4},
                              "anomaly_check_nan": False}


def test_the_summary_gives_shares_and_the_environment_switches():
    meta = {"debug_modes": {"samples": 20, "on": {"anomaly_detection": 5},
                            "first_on_step": {"anomaly_detection": 40}},
            "fingerprint": {"threads": {"env": {"CUDA_LAUNCH_BLOCKING": "1",
                                                "PYTORCH_NO_CUDA_MEMORY_CACHING": "0",
                                                "OMP_NUM_THREADS": "2"}}}}
    out = _debug_modes(meta)
    assert out["share"] == {"anomaly_detection": 0.25}
    assert out["env"] == {"CUDA_LAUNCH_BLOCKING": "1"}  # "0" turns the switch off
    assert _debug_modes({})["share"] == {}


def _findings(modes: dict, cuda: bool = False) -> list[dict]:
    steps = make_steps(80)  # 3 ms forward, 6 ms backward, 1 ms optimizer
    env = {"usable_cores": 2, "torch_num_threads": 2, "cuda": "12.4" if cuda else None,
           "gpu_count": 1 if cuda else 0}
    out = diagnose(make_summary(steps, debug_modes=modes, environment=env), steps)
    return [f for f in out if f["category"] != "measurement_noise"]


def test_rules_weigh_the_share_of_the_run_and_the_phases():
    (f,) = _findings({"samples": 10, "share": {"anomaly_detection": 0.5}})
    assert (f["category"], f["cause"], f["severity"]) == ("host_launch", "anomaly_detection",
                                                          "high")
    assert f["estimated_gain"] == pytest.approx(0.5 * 0.9, rel=0.02)  # forward + backward
    assert "anomaly_detection=script,false" in f["verify"]
    assert _findings({"samples": 10, "share": {"anomaly_detection": 0.05}}) == []
    # one sample of nine (a few steps under detect_anomaly() in a 2-second run): left alone
    assert _findings({"samples": 9, "share": {"anomaly_detection": 1 / 9}}) == []
    (f,) = _findings({"samples": 10, "share": {"profiler": 1.0}})
    assert (f["cause"], f["estimated_gain"]) == ("profiler_left_on", pytest.approx(1.0, 0.01))
    assert "schedule=torch.profiler.schedule(" in f["fix"]["snippet"]
    # the CUDA switches only where CUDA ran
    env = {"samples": 10, "share": {}, "env": {"CUDA_LAUNCH_BLOCKING": "1"}}
    assert _findings(env) == []
    (f,) = _findings(env, cuda=True)
    assert (f["category"], f["cause"]) == ("synchronization", "launch_blocking")
    assert f["verify"].startswith("env -u CUDA_LAUNCH_BLOCKING trainprof run")


def test_anomaly_detection_left_on_is_found_and_the_knob_turns_it_off(tmp_path):
    write_script(tmp_path, "train.py", MODEL + """
    torch.autograd.set_detect_anomaly(True)
    for _ in range(150):
        step()
    """)
    res = trainprof("run", "--json", "--no-html", "train.py", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    doc = res.json()
    top = doc["findings"][0]
    assert (top["category"], top["cause"]) == ("host_launch", "anomaly_detection")
    assert top["evidence"]["anomaly_detection_on_share"] == 1.0
    assert top["evidence"]["samples"] >= 3
    assert top["evidence"]["check_nan"] is True
    slow = doc["steps"]["median_s"]
    # the knob, as trainprof tune passes it: the script's call is ignored and recorded
    res = trainprof("run", "--json", "--no-html", "train.py", cwd=tmp_path,
                    env={ENV_VAR: json.dumps({"anomaly_detection": False})})
    assert res.returncode == 0, res.stderr[-2000:]
    meta = json.loads((res.run_dir / "run.json").read_text())
    assert meta["debug_modes"]["on"] == {} and meta["debug_modes"]["samples"] >= 1
    assert meta["knobs"]["script_calls_ignored"] == ["torch.set_anomaly_enabled(True)"]
    assert _actual("anomaly_detection", meta) == "off"
    assert not [f for f in res.json()["findings"] if f["cause"] == "anomaly_detection"]
    # measured: x0.2 to x0.4 of the step time with it on
    assert res.json()["steps"]["median_s"] < 0.7 * slow


def test_a_few_debugged_steps_and_trainprofs_own_profiler_are_left_alone(tmp_path):
    write_script(tmp_path, "train.py", MODEL + """
    import time, warnings
    warnings.simplefilter("ignore")
    with torch.autograd.detect_anomaly():
        for _ in range(3):
            step()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 1.8:
        step()
    """)
    res = trainprof("run", "--json", "--no-html", "--deep", "train.py", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    meta = json.loads((res.run_dir / "run.json").read_text())
    modes = meta["debug_modes"]
    assert modes["samples"] >= 5
    assert "profiler" not in modes["on"]  # --deep's window is trainprof's, not the script's
    assert modes["on"].get("anomaly_detection", 0) <= 1
    assert not [f for f in res.json()["findings"]
                if f["cause"] in ("anomaly_detection", "profiler_left_on")]


def test_a_profiler_left_recording_is_found(tmp_path):
    write_script(tmp_path, "train.py", MODEL + """
    with torch.profiler.profile():
        for _ in range(200):
            step()
    """)
    res = trainprof("run", "--json", "--no-html", "train.py", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    (f,) = [f for f in res.json()["findings"] if f["cause"] == "profiler_left_on"]
    assert f["severity"] == "high"
    assert f["evidence"]["profiler_on_share"] >= 0.9
