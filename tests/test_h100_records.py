"""Real CUDA records (tests/data/h100/, recorded on an H100) analysed without a GPU.

``tests/test_cuda.py`` runs the CUDA capture where there is a GPU; these check, in every
run of the suite, what trainprof makes of what that capture wrote: device time per phase
from CUDA events, NVML samples, allocator counters, the CUDA trace of a deep window, and
the findings built on them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import trainprof

from trainprof.commands import analyse_folder
from trainprof.diagnosis.trace_rules import diagnose_trace

DATA = Path(__file__).resolve().parent / "data" / "h100"


@pytest.fixture(scope="module")
def synced() -> dict:
    return analyse_folder(DATA / "synced")[0]


@pytest.fixture(scope="module")
def launch_bound() -> dict:
    return analyse_folder(DATA / "launch_bound")[0]


def test_device_time_per_phase_holds_the_known_device_work(synced):
    """forward sleeps N cycles on the device, backward 2N: CUDA events time them so."""
    assert synced["steps"]["count"] == 640
    dev = synced["device"]
    assert dev["steps"] >= 600
    shares = dev["breakdown"]
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-6)
    assert shares["backward"] / shares["forward"] == pytest.approx(2.0, rel=0.2)
    # .item() every step: the host waits for the device, the two step times agree
    assert dev["median_step_s"] == pytest.approx(synced["steps"]["median_s"], rel=0.05)
    assert not [n for n in synced["notes"] if "ran ahead of the GPU" in n]
    assert synced["syncs"]["per_step"] == 1.0
    env = synced["environment"]
    assert (env["gpu"], env["gpu_count"], env["cuda"]) == ("NVIDIA H100 80GB HBM3", 1, "13.0")
    gpu = synced["system"]["gpu"][0]
    assert 30 < gpu["util_pct"] < 90 and gpu["mem_total_bytes"] > 80e9
    mem = synced["cuda_memory"]["devices"][0]
    assert mem["num_alloc_retries"] == 0 and mem["allocated_bytes.all.peak"] > 0


def test_the_deep_windows_cuda_trace_holds_the_sleep_kernels(synced):
    deep = synced["deep"][-1]
    assert deep["cpu_only"] is False and deep["steps"] == ["22", "23", "24"]
    spin = [k for k in deep["kernels"] if "spin_kernel" in k["name"]]
    assert spin[0]["calls"] == 6  # forward's and backward's, 3 steps
    assert spin[0]["max_us"] / spin[0]["min_us"] == pytest.approx(2.0, rel=0.02)
    assert deep["breakdown_us"]["Kernel"] == pytest.approx(spin[0]["total_us"] / 3, rel=0.02)


def test_a_synced_loops_findings_name_the_sync_not_launches(synced):
    """The GPU waits for a host that reads loss.item() and loads its batches: the sync
    finding first; the trace's host-wait is not called launch-bound (its 14 kernels a
    step start 0.58 ms after their launch, queued behind the sleeps) and gives way to
    the run's sync and input findings, which own that idle time."""
    causes = [f["cause"] for f in synced["findings"]]
    assert causes[0] == "host_reads" and "per_sample_overhead" in causes
    assert "launch_bound" not in causes and "host_bound" not in causes
    trace_causes = {f["cause"] for f in diagnose_trace(synced["deep"][-1])}
    assert "host_bound" in trace_causes and "launch_bound" not in trace_causes


def test_a_launch_bound_loops_trace_finding_leads(launch_bound):
    top = launch_bound["findings"][0]
    assert (top["category"], top["cause"]) == ("host_launch", "launch_bound")
    assert top["estimated_gain"] > 0.9
    assert top["evidence"]["kernels_per_step"] == 237
    assert top["evidence"]["kernel_median_us"] < 2
    assert launch_bound["system"]["gpu"][0]["util_pct"] < 10
    opt = launch_bound["optimizers"][0]
    assert (opt["implementation"], opt["devices"]) == ("foreach", ["cuda"])
    # the run's own part of it stays: AdamW's foreach step, fused proposed
    assert "foreach_optimizer" in [f["cause"] for f in launch_bound["findings"]]


def test_report_html_and_perfetto_of_a_cuda_run(tmp_path):
    res = trainprof("report", str(DATA / "synced"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "GPU time     median 4.2 ms/step on the device" in res.stdout
    assert "NVIDIA H100 80GB HBM3" in res.stdout
    html = tmp_path / "r.html"
    res = trainprof("report", str(DATA / "synced"), "--html", str(html), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "NVIDIA H100 80GB HBM3" in html.read_text()
    out = tmp_path / "p.json"
    res = trainprof("export", "--perfetto", str(out), str(DATA / "synced"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    names = {e.get("name") for e in json.loads(out.read_text())["traceEvents"]}
    assert "GPU 0 utilization" in names
    assert any("spin_kernel" in str(n) for n in names)
    assert not (DATA / "synced" / "findings.json").exists()  # reading wrote nothing there


def test_a_pageable_batch_copy_line_is_named_with_pin_memory(monkeypatch):
    """Batches from 2 workers with pin_memory=False, copied by `x.cuda(non_blocking=True)`:
    the copy line's share of the loop's own time is the pageable copy's, fixed by pinning.
    (This record predates the sources kept with the stacks: its lines are read from the
    script beside it, as from the machine the run was on.)"""
    import trainprof.analysis.loop_stacks as loop_stacks

    here = DATA / "pageable"
    real = loop_stacks.source_line
    monkeypatch.setattr(loop_stacks, "source_line",
                        lambda file, line: real(str(here / Path(file).name), line))
    summary = analyse_folder(here)[0]
    found = {f["cause"]: f for f in summary["findings"]}
    f = found["pageable_copy"]
    assert (f["category"], f["rule"]) == ("host_to_device", "host_to_device.pageable_copy")
    assert f["evidence"]["line"].endswith("pageable.py:29")
    assert f["evidence"]["line_share_of_other_samples"] == pytest.approx(0.49, abs=0.01)
    assert "pin_memory=True" in f["fix"]["snippet"] and "num_workers=2" in f["fix"]["snippet"]
    assert f["verify"].startswith("trainprof tune --knob pin_memory=false,true pageable.py")
    # the loop-code finding is left the other line (inside trainprof's own CUDA event)
    lc = found["loop_code"]
    assert lc["evidence"]["line"].endswith("pageable.py:30")
    assert lc["evidence"]["library_call"] == "trainprof.capture.device_timer.DeviceTimer.mark"
    # without a CUDA record the copy line is ordinary loop code
    summary["device"] = None
    summary["cuda_memory"] = None
    from trainprof.diagnosis import diagnose

    causes = [g["cause"] for g in diagnose(summary, analyse_folder(here)[1].steps)]
    assert "pageable_copy" not in causes
