"""torch.compile's compilations by step, recompilations after the warm-up, and their limit."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_diagnosis import make_steps, make_summary

from trainprof.analysis.compiles import reason_kind, summarize_compiles
from trainprof.capture.explicit_gc import ExplicitCollects
from trainprof.diagnosis import diagnose

# shapes change from step 20 (one more sample each step), and every 10th step evaluates
# the compiled model under no_grad: Dynamo compiles again each time, until its limit
RECOMPILES = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
compiled = torch.compile(model, backend="eager", dynamic=False)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(40):
    batch = 32 if step < 20 else 32 + (step - 19)
    loss = compiled(torch.randn(batch, 16)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    if step % 10 == 9:
        model.eval()
        with torch.no_grad():
            compiled(torch.randn(8, 16))
        model.train()
"""

STEADY = """
import torch
from torch import nn

model = torch.compile(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)),
                      backend="eager")
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(30):
    loss = model(torch.randn(32, 16)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""


def test_recompilations_after_the_warm_up_are_found_with_their_reasons(tp):
    res = tp(RECOMPILES, "--json", "--no-html", timeout=240)
    assert res.returncode == 0, res.stderr
    record = json.loads((res.run_dir / "run.json").read_text())["compiles"]
    dynamo = [e for e in record["events"] if e["trigger"] == "dynamo"]
    # the first compilation, the no_grad one at step 9's evaluation (step counter 10:
    # 10 steps done), then one per new size from step 20 until the limit (8 in all)
    assert [e["compile_id"] for e in dynamo] == [f"0/{i}" for i in range(8)]
    assert [e["step"] for e in dynamo] == [0, 10, 20, 21, 22, 23, 24, 25]
    assert all(e["dur_s"] > 0 for e in dynamo) and record["recompile_limit"] == 8
    info = res.json()["compiles"]
    # (step 10's recompilation, in the op count's cool-down step, is not a steady step: the
    # share is of the steady steps' time, and only their compilations count in it)
    assert info["count"] == 8 and info["after_warmup"] == 6
    assert info["steps_after_warmup"] == [20, 21, 22, 23, 24, 25]
    assert 0 < info["after_warmup_share"] < 1
    assert info["limit_hit"] and info["limit_hit_step"] == 25
    assert set(info["reason_kinds"]) == {"shape", "grad_mode"}
    assert "size mismatch at index 0. expected 32, actual 33" in info["reason_examples"]["shape"]
    (f,) = [f for f in res.json()["findings"] if f["cause"] == "recompilation"]
    assert f["category"] == "host_launch" and f["severity"] in ("medium", "high")
    assert f["estimated_gain"] == pytest.approx(info["after_warmup_share"], abs=1e-4)
    assert "runs eagerly from step 26" in f["title"]
    assert "dynamic=True" in f["fix"]["snippet"] and "drop_last=True" in f["fix"]["snippet"]
    assert "with autograd off" in f["fix"]["text"]
    # Dynamo's own gc.collect() while compiling is neither the script's nor a GC finding
    assert not (res.json()["gc"] or {}).get("explicit")
    assert not [g for g in res.json()["findings"] if g["category"] == "gc"]
    from trainprof.report.terminal import compiles_text

    assert compiles_text(info).startswith("8 compilations (")
    assert " after the warm-up, at steps " in compiles_text(info)
    assert compiles_text(info).endswith("recompile limit (8) hit at step 25: uncompiled since")
    from trainprof.commands import analyse_folder, write_html
    from trainprof.store import load_run

    summary, _ = analyse_folder(res.run_dir)
    page = write_html(summary, load_run(res.run_dir), res.run_dir / "r.html").read_text()
    assert "torch.compile recompilations</div><div class=\"v\">6</div>" in page
    # compare shows them side by side
    from trainprof.analysis.compare import compare_runs
    from trainprof.report.compare_terminal import _recompilations

    side = compare_runs(load_run(res.run_dir), load_run(res.run_dir))["a"]["recompilations"]
    assert side["after_warmup"] == 6 and side["limit_hit"]
    assert _recompilations(side).startswith("6 (") and _recompilations(side).endswith(
        "limit hit")
    assert _recompilations(None) == "—"


def test_a_model_compiled_once_has_no_recompilation(tp):
    res = tp(STEADY, "--json", "--no-html", timeout=240)
    assert res.returncode == 0, res.stderr
    info = res.json()["compiles"]
    assert info["count"] == 1 and info["after_warmup"] == 0 and not info["limit_hit"]
    assert info["steps"] == [0]
    assert not [f for f in res.json()["findings"] if f["cause"] == "recompilation"]


def _record(events: list[tuple[int, str, float]], reasons: list[str],
            limit: int = 8) -> dict:
    return {"events": [{"step": s, "compile_id": c, "dur_s": d, "trigger": "dynamo",
                        "t_start_ns": 0} for s, c, d in events],
            "reasons": [{"function": "forward", "file": "train.py", "line": 3,
                         "count": len(reasons),
                         "reasons": [{"text": r, "count": 1} for r in reasons]}],
            "recompile_limit": limit, "dropped": 0}


def _findings(record: dict, n: int = 200) -> list[dict]:
    steps = make_steps(n)  # 10 ms steps
    summary = make_summary(steps)
    summary["compiles"] = summarize_compiles(record, steps, summary["steps"]["warmup"])
    return [f for f in diagnose(summary, steps) if f["cause"] == "recompilation"]


def test_one_evaluation_recompilation_in_a_long_run_is_below_the_bands():
    # 80 ms once in 2 s of steps: 4%; in a run 10 times as long it is nothing
    record = _record([(0, "0/0", 1.0), (100, "0/1", 0.08)], ["0/0: GLOBAL_STATE changed: "
                                                               "grad_mode "])
    (f,) = _findings(record)
    assert f["severity"] == "medium" and f["evidence"]["at_steps"] == [100]
    assert f["evidence"]["reason_kinds"] == {"grad_mode": 1}
    record["events"][1]["dur_s"] = 0.008
    assert _findings(record) == []


def test_the_recompile_limit_is_at_least_medium_whatever_it_cost():
    events = [(0, "0/0", 0.5)] + [(100 + i, f"0/{i}", 0.0005) for i in range(1, 8)]
    (f,) = _findings(_record(events, ["tensor 'x' size mismatch at index 0. expected 4, "
                                      "actual 5"]))
    assert f["severity"] == "medium" and f["evidence"]["limit_hit"]
    assert f["evidence"]["limit_hit_step"] == 107 and "from step 108" in f["title"]
    # the same 7 recompilations under a higher limit: 0.2% of the steps, nothing
    assert _findings(_record(events, ["size mismatch"], limit=16)) == []


def test_reason_kinds_and_compiler_gc_calls():
    assert reason_kind("tensor 'L['x']' size mismatch at index 0. expected 3, actual 4") == (
        "shape")
    assert reason_kind("GLOBAL_STATE changed: grad_mode ") == "grad_mode"
    assert reason_kind("L['self'].training == True") == "module_mode"
    assert reason_kind("L['lr'] == 0.1") == "other"
    assert ExplicitCollects.is_compiler("/x/site-packages/torch/_dynamo/convert_frame.py")
    assert ExplicitCollects.is_compiler("/x/site-packages/torch/_inductor/compile_fx.py")
    assert not ExplicitCollects.is_compiler("/home/me/train.py")
    assert summarize_compiles(None, np.zeros(0), 0) is None
