"""The script's own gc.collect() calls: captured by line (capture/explicit_gc.py), the
``explicit_gc`` knob that skips them, and the finding that names them (diagnosis/gc.py)."""

from __future__ import annotations

import json

import pytest
from test_diagnosis import MS, make_steps, make_summary

from trainprof.capture.knobs import ENV_VAR
from trainprof.diagnosis import diagnose
from trainprof.experiments import tune as tune_mod
from trainprof.store import load_run

COLLECTING = """
import gc
import torch

w = torch.zeros(64, requires_grad=True)
opt = torch.optim.SGD([w], lr=0.1)
for step in range(60):
    (w * torch.randn(64)).sum().backward()
    opt.step(); opt.zero_grad()
    if step % 10 == 9:
        gc.collect()  # every 10 steps, "to keep memory down"
"""


def test_the_scripts_collect_calls_are_timed_by_line_and_named(tp):
    res = tp(COLLECTING, "--json")
    assert res.returncode == 0, res.stderr
    doc = res.json()
    rec = load_run(res.run_dir).meta["explicit_gc"]
    # 6 calls (after steps 10, 20, ..., 60): not the one trainprof makes before the script
    assert rec["calls"] == 6
    assert list(rec["sites"]) == [f"{res.run_dir.parent / 'train.py'}:11"]
    site = rec["sites"][f"{res.run_dir.parent / 'train.py'}:11"]
    assert site["calls"] == 6 and site["code"].startswith("gc.collect()")
    # the step each call's time lands in: the one after the optimizer step that closed
    # step 9 (the last call is in the partial step 60 that closes the record)
    assert (rec["first_step"], rec["last_step"]) == (10, 60)
    explicit = doc["gc"]["explicit"]
    assert explicit["every_steps"] == 10.0
    assert 0 < explicit["share"] < 1
    # each call is a full collection of a heap with torch in it: the GC share is theirs
    f = next(f for f in doc["findings"] if f["category"] == "gc")
    assert f["cause"] == "explicit_collect"
    assert "every 10 steps" in f["title"] and "train.py:11" in f["title"]
    assert f["verify"].startswith("trainprof tune --knob explicit_gc=true,false train.py")


def test_the_explicit_gc_knob_skips_the_scripts_calls_only(tp):
    res = tp(COLLECTING, "--json", env={ENV_VAR: json.dumps({"explicit_gc": False})})
    assert res.returncode == 0, res.stderr
    meta = load_run(res.run_dir).meta
    assert meta["knobs"]["process"]["explicit_gc"] == {"value": False, "skipped": 6}
    assert meta["explicit_gc"]["calls"] == 6
    assert meta["explicit_gc"]["total_s"] < 0.005  # nothing collected
    assert tune_mod._actual("explicit_gc", meta) == "false (6 calls skipped)"
    assert not [f for f in res.json()["findings"] if f["cause"] == "explicit_collect"]


def test_trainprofs_own_collect_is_not_the_scripts(tp):
    body = COLLECTING.replace("gc.collect()  #", "pass  #")
    res = tp(body, "--json", env={ENV_VAR: json.dumps({"gc_freeze": True})})
    assert res.returncode == 0, res.stderr
    meta = load_run(res.run_dir).meta
    assert meta["knobs"]["process"]["gc_freeze"]["frozen_objects"] > 0  # it collected
    assert "explicit_gc" not in meta


def _summary_with_explicit(explicit_s: float):
    """60 steps with 10 ms of GC every 10th (full collections, 1.6% of the time)."""
    gc_s = [10 * MS if i % 10 == 9 else 0.0 for i in range(60)]
    steps = make_steps(60, gc=gc_s)
    steps["gc_n"][9::10] = 1
    steps["gc_gen2_n"][9::10] = 1
    summary = make_summary(steps)
    summary["gc"] = {"collections_per_step": 0.1, "gen2_per_step": 0.1, "explicit": {
        "calls": 6, "total_s": explicit_s, "first_step": 9, "last_step": 59,
        "every_steps": 10.0, "share": None,
        "sites": {"/home/u/train.py:42": {"calls": 6, "total_s": explicit_s,
                                          "code": "gc.collect()"}}}}
    return summary, steps


def test_collections_mostly_made_by_the_script_are_its_calls_not_the_thresholds():
    summary, steps = _summary_with_explicit(0.055)  # 55 of the 60 ms
    f = [g for g in diagnose(summary, steps) if g["category"] == "gc"][0]
    assert f["cause"] == "explicit_collect"
    assert "6 calls, every 10 steps, 9 ms each at train.py:42 (`gc.collect()`)" in f["title"]
    assert "gc.set_threshold" not in f["fix"]["snippet"]
    assert f["evidence"]["explicit_collect"]["sites"] == ["/home/u/train.py:42"]
    # a few calls beside many automatic collections: the thresholds' finding as before
    summary, steps = _summary_with_explicit(0.02)
    f = [g for g in diagnose(summary, steps) if g["category"] == "gc"][0]
    assert f["cause"] == "full_collections"


def test_a_single_call_has_no_pace():
    summary, steps = _summary_with_explicit(0.055)
    summary["gc"]["explicit"].update(calls=1, every_steps=None)
    f = [g for g in diagnose(summary, steps) if g["category"] == "gc"][0]
    assert "(1 call, 55 ms at train.py:42" in f["title"]


@pytest.mark.parametrize("knob", [None, False])
def test_a_collect_no_python_code_called_runs_as_ever(tp, knob):
    """``atexit.register(gc.collect)``: called from C at exit, with no caller frame to
    name (the wrapper once raised "call stack is not deep enough" there)."""
    body = """
    import atexit, gc
    import torch
    atexit.register(gc.collect)
    w = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    for _ in range(10):
        (w * torch.randn(4)).sum().backward(); opt.step(); opt.zero_grad()
    """
    env = {ENV_VAR: json.dumps({"explicit_gc": knob})} if knob is not None else None
    res = tp(body, env=env)
    assert res.returncode == 0, res.stderr
    assert "Exception ignored" not in res.stderr and "Traceback" not in res.stderr, res.stderr
