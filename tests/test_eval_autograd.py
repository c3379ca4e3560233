"""Evaluation with autograd on (expert-rules.md M4): capture, finding and the tune knob."""

from __future__ import annotations

import json

import pytest
from conftest import trainprof, write_script
from test_diagnosis import make_steps, make_summary

from trainprof.capture.knobs import ENV_VAR
from trainprof.diagnosis import diagnose
from trainprof.diagnosis.eval_autograd import MOST_SAVED
from trainprof.experiments.tune import _actual

#: A conv net trained 30 steps; at steps 1, 11 and 21 an evaluation: 8 calls in eval mode
#: with autograd on (outputs kept, as an evaluation that collects predictions keeps them),
#: one under torch.no_grad() and one that fails. Step 1 falls in the hooks' discovery
#: steps (the Python model-call wrapper), 11 and 21 after (the C fast path's).
SCRIPT = """
import sys
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(
    nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
    nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
val = torch.randn(64, 3, 32, 32)
with_graph = 0
for step in range(30):
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 10 == 1:
        model.eval()
        preds = [model(val) for _ in range(8)]
        with_graph += sum(p.requires_grad for p in preds)
        with torch.no_grad():
            model(val)
        try:
            model(torch.randn(2, 5))  # a call that fails: autograd must be back on after it
        except RuntimeError:
            pass
        model.train()
print("eval outputs with a graph:", with_graph, file=sys.stderr)
print("autograd on at the end:", torch.is_grad_enabled(), file=sys.stderr)
"""


def test_an_evaluation_with_autograd_on_is_found_and_the_knob_turns_it_off(tmp_path):
    write_script(tmp_path, "train.py", SCRIPT)
    res = trainprof("run", "--json", "--no-html", "train.py", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "eval outputs with a graph: 24" in res.stderr
    doc = res.json()
    rec = doc["eval_autograd"]
    # every eval-mode call counted, by both wrappers; the training calls are not
    # (the failing calls are not counted: they did not run)
    assert (rec["grad_calls"], rec["nograd_calls"], rec["no_grad_knob"]) == (24, 3, False)
    assert rec["grad_s"] > 0 and rec["nograd_s"] > 0
    found = [f for f in doc["findings"] if f["cause"] == "eval_autograd"]
    assert found, doc["findings"]
    f = found[0]
    assert f["category"] == "memory" and f["evidence"]["eval_calls_with_autograd"] == 24
    share = f["evidence"]["eval_share_of_step_time"]
    assert 0.05 < share < 1
    assert f["estimated_gain"] == pytest.approx(share * MOST_SAVED, abs=1e-3)
    assert "torch.no_grad()" in f["fix"]["snippet"]
    # the trials as long as this run (30 steps: 60 at least), to hold its evaluations
    assert f["verify"].startswith(
        "trainprof tune --knob eval_no_grad=false,true --steps 60 train.py")
    # the knob, as trainprof tune passes it: the same calls run with autograd off
    res = trainprof("run", "--json", "--no-html", "train.py", cwd=tmp_path,
                    env={ENV_VAR: json.dumps({"eval_no_grad": True})})
    assert res.returncode == 0, res.stderr[-2000:]
    assert "eval outputs with a graph: 0" in res.stderr
    assert "autograd on at the end: True" in res.stderr
    meta = json.loads((res.run_dir / "run.json").read_text())
    assert meta["knobs"]["process"]["eval_no_grad"] is True
    assert meta["eval_autograd"]["no_grad_knob"] is True
    assert meta["eval_autograd"]["grad_calls"] == 24  # what the script asked for
    assert _actual("eval_no_grad", meta) == "autograd off in 24 eval calls"
    # trainprof compare names what changed between the two runs
    cmp = trainprof("compare", "--json", str(tmp_path / "run"), str(res.run_dir), cwd=tmp_path)
    assert cmp.returncode == 0, cmp.stderr
    diff = {d["key"]: d for d in cmp.json()["environment_diff"]}
    assert (diff["eval_mode.autograd"]["a"], diff["eval_mode.autograd"]["b"]) == ("on", "off")


def _eval(calls: int, seconds: float, off: int = 0) -> dict:
    return {"grad_calls": calls, "grad_s": seconds, "nograd_calls": off, "nograd_s": 0.0,
            "no_grad_knob": False}


def test_the_gain_is_the_eval_share_times_the_most_measured_saving():
    steps = make_steps(100)  # 10 ms steps: 1 s
    found = diagnose(make_summary(steps, eval_autograd=_eval(200, 0.5, off=3)), steps)
    f = next(f for f in found if f["cause"] == "eval_autograd")
    assert f["evidence"]["eval_share_of_step_time"] == pytest.approx(0.5, rel=0.03)
    assert f["estimated_gain"] == pytest.approx(0.5 * MOST_SAVED, rel=0.03)
    assert f["severity"] == "high" and "3 other eval-mode calls" in f["fix"]["text"]
    # a little evaluation: still a finding, a low one (graphs recorded for nothing)
    found = diagnose(make_summary(steps, eval_autograd=_eval(50, 0.01)), steps)
    assert next(f for f in found if f["cause"] == "eval_autograd")["severity"] == "low"
    # one eval-mode call (a shape check) or none: nothing
    for rec in (_eval(1, 0.01), None, {"grad_calls": 0, "nograd_calls": 5}):
        assert not [f for f in diagnose(make_summary(steps, eval_autograd=rec), steps)
                    if f["cause"] == "eval_autograd"]
