"""Activation checkpointing: timed in real runs, diagnosed, and turned off by a knob."""

from __future__ import annotations

import json

import pytest
from test_diagnosis import MS, make_steps, make_summary

from trainprof.capture.knobs import ENV_VAR, Knobs
from trainprof.diagnosis import diagnose
from trainprof.experiments import tune as tune_mod
from trainprof.store import load_run

CHECKPOINTED = """
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

torch.manual_seed(0)
blocks = nn.ModuleList(
    nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 64)) for _ in range(4))
head = nn.Linear(64, 1)
opt = torch.optim.SGD([*blocks.parameters(), *head.parameters()], lr=0.01)


def nested(x):  # a checkpoint inside a checkpointed region: one region, not two
    return checkpoint(blocks[1], x, use_reentrant=False)


for step in range(20):
    x = torch.randn(32, 64)
    h = checkpoint(blocks[0], x, use_reentrant=False)
    h = checkpoint(nested, h, use_reentrant=True)  # backward runs nested() again
    # 3 segments of 3 layers: the first two checkpointed, the last run as it is
    h = checkpoint_sequential(blocks[2], 3, h, use_reentrant=False)
    h = checkpoint(blocks[3], h, use_reentrant=False)
    loss = head(h).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print("LOSS", f"{loss.item():.10f}", flush=True)
"""


def _loss(res) -> str:
    return next(line for line in (res.stdout + res.stderr).splitlines()
                if line.startswith("LOSS"))


def test_each_checkpointed_region_is_counted_once_and_its_first_pass_timed(tp):
    res = tp(CHECKPOINTED, "--json")
    assert res.returncode == 0, res.stderr
    rec = load_run(res.run_dir).meta["activation_checkpointing"]
    # 5 outermost regions a step, 2 of them checkpoint_sequential's (through checkpoint());
    # the nested one and the reentrant recomputation, run in backward, are not counted
    assert rec["calls"] == 5 * 20
    assert rec["use_reentrant"] == {"false": 4 * 20, "true": 20}
    assert (rec["first_step"], rec["last_step"]) == (0, 19)
    # the op count's window (steps 8-9, and the step after it) ran under a dispatch mode:
    # its 3 x 5 calls are counted, their time kept apart as the steps' is
    assert rec["profiled_calls"] == 15 and rec["profiled_s"] > 0
    doc = res.json()
    ckpt = doc["activation_checkpointing"]
    assert ckpt["calls_per_step"] == 5.0
    # every block runs inside a region, and checkpoint()'s own work (its hooks and
    # contexts, much of it for blocks this small) is timed with them
    assert 0.05 < ckpt["share"] < 0.9
    assert ckpt["total_s"] == pytest.approx(rec["total_s"])
    (f,) = [f for f in doc["findings"] if f["cause"] == "activation_checkpointing"]
    assert f["category"] == "compute"
    assert f["estimated_gain"] == pytest.approx(ckpt["share"], abs=1e-4)
    assert f["evidence"]["calls_per_step"] == 5
    assert "--knob activation_checkpointing=true,false" in f["verify"]


FIRST_CALL_SLOW = """
import time
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

lin = nn.Linear(16, 16)
opt = torch.optim.SGD(lin.parameters(), lr=0.01)


def region(x):
    if step == 0:
        time.sleep(0.3)  # set-up on a first call, before any module runs (checkpoint's
    return lin(x)        # own first call imports torch._dynamo: 0.9 s on this VM)


for step in range(12):
    loss = checkpoint(region, torch.randn(8, 16), use_reentrant=False).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_a_region_that_begins_the_run_begins_its_first_step(tp):
    # CI once read a share of 1.05: a first call's time that fell before step 0 began
    res = tp(FIRST_CALL_SLOW, "--json")
    assert res.returncode == 0, res.stderr
    run = load_run(res.run_dir)
    assert run.steps["dur_ns"][0] >= 0.3e9  # step 0 holds the region's first call
    rec = run.meta["activation_checkpointing"]
    assert rec["calls"] == 12 and rec["profiled_calls"] == 3
    share = res.json()["activation_checkpointing"]["share"]
    assert 0.3 < share <= 1.0


def test_the_knob_runs_the_regions_directly_with_the_same_results(tp):
    plain = tp(CHECKPOINTED)
    assert plain.returncode == 0, plain.stderr
    off = tp(CHECKPOINTED, env={ENV_VAR: json.dumps({"activation_checkpointing": False})})
    assert off.returncode == 0, off.stderr
    assert _loss(off) == _loss(plain)  # the same arithmetic, activations kept instead
    meta = load_run(off.run_dir).meta
    # the nested call too: the knob sees every call
    assert meta["knobs"]["process"]["activation_checkpointing"] == {"value": False,
                                                                   "calls": 6 * 20}
    assert tune_mod._actual("activation_checkpointing", meta) == "false (120 calls run directly)"
    assert tune_mod._actual("activation_checkpointing", load_run(plain.run_dir).meta) == (
        "true (100 calls)")


def test_the_knob_is_undone():
    import torch
    import torch.utils.checkpoint as checkpoint_module

    original = checkpoint_module.checkpoint
    knobs = Knobs({"activation_checkpointing": False}).install()
    try:
        layer = torch.nn.Linear(4, 4)
        out = checkpoint_module.checkpoint(layer, torch.ones(1, 4), use_reentrant=False,
                                           preserve_rng_state=False)
        assert torch.equal(out, layer(torch.ones(1, 4)))
    finally:
        record = knobs.uninstall()
    assert checkpoint_module.checkpoint is original
    assert record["process"]["activation_checkpointing"] == {"value": False, "calls": 1}


def _summary(share: float, rss_peak: float, memory_total: float = 32 * 2**30,
             cuda: list | None = None):
    steps = make_steps(60, forward=3 * MS, backward=6 * MS, optimizer=1 * MS)
    summary = make_summary(steps)
    summary["activation_checkpointing"] = {
        "calls": 240, "calls_per_step": 4.0, "total_s": 0.1, "share": share,
        "use_reentrant": {"false": 240}}
    summary["system"]["rss_peak_bytes"] = rss_peak
    summary["environment"]["memory_total_bytes"] = memory_total
    summary["cuda_memory"] = {"devices": cuda} if cuda else None
    return summary, steps


def _findings(summary, steps):
    return [f for f in diagnose(summary, steps) if f["cause"] == "activation_checkpointing"]


def test_free_memory_gives_the_bands_and_crowded_memory_a_low_hint():
    (f,) = _findings(*_summary(0.25, rss_peak=2 * 2**30))
    assert f["severity"] == "high" and "likely to fit" in f["fix"]["text"]
    assert f["evidence"]["memory_used_share"] == pytest.approx(2 / 32)
    (f,) = _findings(*_summary(0.25, rss_peak=20 * 2**30))
    assert f["severity"] == "low" and "may not fit" in f["fix"]["text"]
    assert not _findings(*_summary(0.015, rss_peak=2 * 2**30))  # under 2%: nothing


def test_on_cuda_the_fullest_gpu_is_what_decides():
    gpus = [{"index": 0, "total_bytes": 80 * 2**30, "reserved_bytes.all.peak": 10 * 2**30},
            {"index": 1, "total_bytes": 80 * 2**30, "reserved_bytes.all.peak": 60 * 2**30}]
    (f,) = _findings(*_summary(0.25, rss_peak=2 * 2**30, cuda=gpus))
    assert f["severity"] == "low"
    assert f["evidence"]["memory_used_share"] == pytest.approx(0.75)
    assert "GPU 1's allocator reserved at most 60.0 GiB of its 80.0 GiB (75%)" in f["fix"]["text"]
