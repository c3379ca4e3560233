"""zero_grad(set_to_none=False) (expert-rules.md H8): the op count, the finding, the knob."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import trainprof, write_script
from test_diagnosis import MS, make_steps, make_summary

from trainprof.capture.knobs import ENV_VAR
from trainprof.diagnosis import diagnose
from trainprof.diagnosis.zero_grad import MOST_SAVED_PER_SHARE
from trainprof.experiments.tune import _actual

#: 60 steps keeping the gradients: through the optimizer on even steps, through the model
#: (positionally) on odd ones; the op count's window (steps 8 and 9) sees one of each.
SCRIPT = """
import sys
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                      nn.Linear(1024, 10))
opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
x, y = torch.randn(16, 512), torch.randint(0, 10, (16,))
for step in range(60):
    loss = nn.functional.cross_entropy(model(x), y)
    if step % 2:
        model.zero_grad(False)
    else:
        opt.zero_grad(set_to_none=False)
    loss.backward()
    opt.step()
print("gradients kept:", model[0].weight.grad is not None, file=sys.stderr)
"""

#: the model's parameters in bytes (float32): what each zero_grad writes
GRAD_BYTES = 4 * (512 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10)


def _steady_steps(run_dir, doc):  # noqa: ANN001, ANN202
    from trainprof.analysis.steps import complete_steps
    from trainprof.store import load_run

    return complete_steps(load_run(run_dir).steps)[doc["steps"]["warmup"]:]


def test_zeros_written_by_zero_grad_are_found_and_the_knob_drops_the_gradients(tmp_path):
    write_script(tmp_path, "train.py", SCRIPT)
    res = trainprof("run", "--json", "--no-html", "train.py", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    doc = res.json()
    ops = json.loads((res.run_dir / "ops.json").read_text())
    # one zero_ per gradient (6 tensors), whichever class zeroed them
    assert ops["zero_grad_zeroing_calls_per_step"] == 6
    assert ops["zero_grad_zeroed_bytes_per_step"] == GRAD_BYTES
    # nn.Module.zero_grad's own calls are torch's loop, not sites of the script's line
    assert {s["function"] for s in ops["sites"]} == {
        "linear", "relu", "cross_entropy", "Tensor.backward"}
    (f,) = [f for f in doc["findings"] if f["cause"] == "zero_grad_writes_zeros"]
    assert f["category"] == "host_launch"
    # the share of a typical step: the breakdown's (time-weighted) or, where a few steps
    # were disturbed, the median zero_grad over the median step, whichever is smaller
    zero_grad = np.array([r["zero_grad_ns"] for r in _steady_steps(res.run_dir, doc)])
    typical = float(np.median(zero_grad)) / 1e9 / doc["steps"]["median_s"]
    share = min(doc["breakdown_detail"]["zero_grad"], typical)
    assert f["evidence"]["zero_grad_share"] == pytest.approx(share, abs=1e-4)
    assert f["estimated_gain"] == pytest.approx(share * MOST_SAVED_PER_SHARE, abs=1e-3)
    assert "6.3 MB" in f["title"] and "set_to_none=True" in f["fix"]["snippet"]
    assert f["verify"].startswith(
        "trainprof tune --knob zero_grad_set_to_none=false,true train.py")
    # the knob, as trainprof tune passes it: every zero_grad drops the gradients
    res = trainprof("run", "--json", "--no-html", "train.py", cwd=tmp_path,
                    env={ENV_VAR: json.dumps({"zero_grad_set_to_none": True})})
    assert res.returncode == 0, res.stderr[-2000:]
    assert "gradients kept: True" in res.stderr  # backward made them anew
    ops = json.loads((res.run_dir / "ops.json").read_text())
    assert ops["zero_grad_zeroing_calls_per_step"] == 0
    assert not [f for f in res.json()["findings"] if f["cause"] == "zero_grad_writes_zeros"]
    meta = json.loads((res.run_dir / "run.json").read_text())
    knobs = meta["knobs"]
    assert knobs["process"]["zero_grad_set_to_none"] == {"value": True, "calls": 60}
    assert sorted(knobs["script_calls_ignored"]) == [
        "Module.zero_grad(set_to_none=False)", "Optimizer.zero_grad(set_to_none=False)"]
    assert _actual("zero_grad_set_to_none", meta) == "true (60 calls)"


def _ops(calls: float, nbytes: float = 1e6) -> dict:
    return {"steps_sampled": 2, "calls_per_step": 50.0, "loops": [],
            "zero_grad_zeroing_calls_per_step": calls,
            "zero_grad_zeroed_bytes_per_step": nbytes}


def test_the_gain_is_zero_grads_share_times_the_most_measured_saving():
    steps = make_steps(100, zero_grad=0.25 * MS)  # 10.25 ms steps, zero_grad 2.4% of them
    found = diagnose(make_summary(steps, ops=_ops(6)), steps)
    f = next(f for f in found if f["cause"] == "zero_grad_writes_zeros")
    share = 0.25 / 10.25
    assert f["evidence"]["zero_grad_share"] == pytest.approx(share, rel=0.03)
    assert f["estimated_gain"] == pytest.approx(share * MOST_SAVED_PER_SHARE, rel=0.03)
    assert f["severity"] == "medium"
    steps = make_steps(100, zero_grad=1 * MS)  # 9% of the step: a gain of over 15%
    found = diagnose(make_summary(steps, ops=_ops(6)), steps)
    assert next(f for f in found if f["cause"] == "zero_grad_writes_zeros")["severity"] == "high"
    # a zero_grad the clock barely sees (a GPU's, which only launches): still named, low
    steps = make_steps(100, zero_grad=0.01 * MS)
    found = diagnose(make_summary(steps, ops=_ops(6)), steps)
    assert next(f for f in found if f["cause"] == "zero_grad_writes_zeros")["severity"] == "low"
    # no zeros written (set_to_none=True), or a record from before the count: nothing
    for ops in (_ops(0), {"steps_sampled": 2, "calls_per_step": 50.0, "loops": []}, None):
        assert not [f for f in diagnose(make_summary(steps, ops=ops), steps)
                    if f["cause"] == "zero_grad_writes_zeros"]
