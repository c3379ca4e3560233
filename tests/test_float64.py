"""A model that computes in float64: its products counted with their FLOPs, diagnosed, and
the knob that runs it in float32."""

from __future__ import annotations

import json

import pytest
import torch
from test_diagnosis import MS, make_steps, make_summary
from torch import nn

from trainprof.analysis.compare import compare_runs
from trainprof.capture.knobs import ENV_VAR, Knobs, parse_value
from trainprof.diagnosis import diagnose
from trainprof.diagnosis.float64 import CPU_SPEEDUP
from trainprof.errors import UsageError
from trainprof.experiments import tune as tune_mod
from trainprof.store import load_run

#: NumPy's float64 data, and model.double() to make the dtype error go away.
DOUBLE = """
import numpy as np
import torch
from torch import nn

rng = np.random.default_rng(0)
features = rng.standard_normal((64, 128))            # float64, NumPy's default
targets = rng.standard_normal((64, 1))
x, y = torch.from_numpy(features), torch.from_numpy(targets)
model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 1)).double()
loss_fn = nn.MSELoss()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(30):
    out = model(x)
    loss = loss_fn(out, y)
    opt.zero_grad(); loss.backward(); opt.step()
print("DTYPES", out.dtype, model[0].weight.dtype, flush=True)
"""

FLOPS = 2 * 64 * (128 * 256 + 256 * 1)


def _line(res, tag: str) -> str:
    return next(x for x in (res.stdout + res.stderr).splitlines() if x.startswith(tag))


def test_a_float64_model_is_found_and_the_knob_runs_it_in_float32(tp):
    res = tp(DOUBLE, "--json")
    assert res.returncode == 0, res.stderr
    assert _line(res, "DTYPES") == "DTYPES torch.float64 torch.float64"
    doc = res.json()
    ops = doc["ops"]
    assert ops["float64_matmul_conv_per_step"] == 2
    assert (ops["float64_matmul_flops_per_step"], ops["float64_conv_flops_per_step"]) == (
        FLOPS, 0)
    assert ops["matmul_conv_flops_per_step"] == FLOPS
    (f,) = [f for f in doc["findings"] if f["cause"] == "float64"]
    ev = f["evidence"]
    assert (ev["float64_flop_share"], ev["device"]) == (1.0, "CPU")
    assert f["estimated_gain"] == pytest.approx(
        ev["model_share"] * (1 - 1 / CPU_SPEEDUP["matmul"]) + ev["optimizer_share"] / 2,
        abs=1e-3)
    assert f["category"] == "compute"
    assert "--knob float32=false,true" in f["verify"]

    knobbed = tp(DOUBLE, "--json", env={ENV_VAR: json.dumps({"float32": True})})
    assert knobbed.returncode == 0, knobbed.stderr
    # converted in place: the script's own model and the loss module's target too
    assert _line(knobbed, "DTYPES") == "DTYPES torch.float32 torch.float32"
    ops = knobbed.json()["ops"]
    assert ops["float64_matmul_conv_per_step"] == 0
    assert ops["matmul_conv_flops_per_step"] == FLOPS
    assert not [f for f in knobbed.json()["findings"] if f["cause"] == "float64"]
    meta = load_run(knobbed.run_dir).meta
    # the model (converted once) and the loss module (nothing of its own to convert):
    # 30 calls each, x for the model and the target for the loss
    assert meta["knobs"]["process"]["float32"] == {
        "value": True, "modules": 1, "calls": 60, "inputs": 60, "skipped": {}}
    assert tune_mod._actual("float32", meta) == "true (1 module converted, 60 inputs)"
    # trainprof compare names the change in how the model computed
    diff = compare_runs(load_run(res.run_dir), load_run(knobbed.run_dir))["environment_diff"]
    (fact,) = [d for d in diff if d["key"] == "model.flops_float64"]
    assert (fact["a"], fact["b"], fact["category"]) == ("100%", "0%", "model")
    assert not [d for d in diff if d["key"] == "model.convolutions_nhwc"]  # (none: no conv)


def test_the_knob_leaves_other_dtypes_and_false_converts_nothing():
    model = nn.Sequential(nn.Linear(4, 4).double(), nn.Linear(4, 4).to(torch.bfloat16))
    weight = model[0].weight
    knobs = Knobs({"float32": False}).install()
    try:
        with pytest.raises(RuntimeError):  # the script's own mix, unconverted
            model(torch.ones(2, 4, dtype=torch.float64))
    finally:
        record = knobs.uninstall()
    assert weight.dtype is torch.float64
    assert record["process"]["float32"] == {
        "value": False, "modules": 0, "calls": 1, "inputs": 0, "skipped": {}}
    assert tune_mod._actual("float32", {"knobs": record}) == "false"
    knobs = Knobs({"float32": True}).install()
    try:
        model[0](torch.ones(2, 4, dtype=torch.float64))
    finally:
        record = knobs.uninstall()
    assert model[0].weight is weight and weight.dtype is torch.float32  # in place
    assert model[1].weight.dtype is torch.bfloat16  # not float64: left alone
    assert parse_value("float32", "true") is True
    with pytest.raises(UsageError, match="float32"):
        parse_value("float32", "fp32")


def _summary(f64: float = 3e9, total: float = 4e9, calls: float = 3.0, conv: float = 0.0):
    steps = make_steps(60, data=0.5 * MS, forward=3 * MS, backward=5 * MS, optimizer=1.5 * MS)
    summary = make_summary(steps)
    summary["ops"] = {"float64_matmul_conv_per_step": calls,
                      "float64_matmul_flops_per_step": f64,
                      "float64_conv_flops_per_step": conv,
                      "matmul_conv_flops_per_step": total}
    return summary, steps


def _findings(summary, steps):
    return [f for f in diagnose(summary, steps) if f["cause"] == "float64"]


def test_the_bound_is_the_model_share_times_the_float64_flop_share_halved_on_a_cpu():
    (f,) = _findings(*_summary())
    model, opt = f["evidence"]["model_share"], f["evidence"]["optimizer_share"]
    assert model == pytest.approx(0.8, abs=0.02)  # (3 + 5) of 10 ms
    assert opt == pytest.approx(0.15, abs=0.01)
    # the products at half the time, the optimizer's bytes halved where float64
    assert f["estimated_gain"] == pytest.approx(model * 0.75 * 0.5 + opt * 0.75 / 2, abs=1e-4)
    assert f["severity"] == "high" and "on the CPU" in f["title"]
    # on a GPU the whole share: float32 is 2-64x faster there
    summary, steps = _summary()
    summary["device"] = {"breakdown": {"forward": 0.3, "backward": 0.5, "optimizer": 0.1,
                                       "gap": 0.1}}
    (f,) = _findings(summary, steps)
    assert f["estimated_gain"] == pytest.approx(0.8 * 0.75 + 0.1 * 0.75 / 2, abs=1e-4)
    assert f["evidence"]["device"] == "GPU"
    # float64 convolutions on a CPU: their whole time (oneDNN runs only float32 ones)
    (f,) = _findings(*_summary(f64=1e9, conv=2e9, total=4e9))
    assert f["estimated_gain"] == pytest.approx(
        model * (0.25 / 2 + 0.5) + opt * 0.75 / 2, abs=1e-4)


def test_float64_in_a_small_part_or_nowhere_gets_nothing():
    assert not _findings(*_summary(f64=0.0, calls=0.0))
    assert not _findings(*_summary(f64=1e7, total=4e9, calls=1.0))  # a metric: 0.1%
    summary, steps = _summary()
    summary["ops"] = None
    assert not _findings(summary, steps)
