"""The CUDA-run rules (diagnosis/device.py) on hand-made CUDA summaries, firing and not; the
allocator counters and the conv2d count they read; and a real CPU run that gets none of them.

No GPU here: the CUDA capture path (Recorder._cuda_memory) runs against a faked torch.cuda,
and the op sample's conv2d count runs on CPU tensors (the count does not depend on the device).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import trainprof, write_script
from test_diagnosis import MS, loader, make_steps, make_summary

from trainprof.capture.knobs import ENV_VAR
from trainprof.capture.opcount import OpCountTool
from trainprof.capture.recorder import Recorder
from trainprof.diagnosis import diagnose
from trainprof.diagnosis.context import Context
from trainprof.diagnosis.device import CHANNELS_LAST_SPEEDUP
from trainprof.diagnosis.tf32 import TF32_SPEEDUP
from trainprof.experiments.tune import _actual
from trainprof.report.impact import GAIN_UNKNOWN, impact_text

GIB = 1024**3
DP_ROOT = "torch.nn.parallel.data_parallel.DataParallel"


def gpu(index: int = 0, util: float = 70.0, used_gib: float = 30.0, total_gib: float = 80.0):
    return {"index": index, "util_pct": util, "mem_used_bytes": used_gib * GIB,
            "mem_total_bytes": total_gib * GIB, "power_w": 300.0, "temp_c": 60}


def cuda_summary(steps, *, gap: float = 0.02, gpus: list[dict] | None = None,
                 dev_step_s: float = 0.012, optimizer: float = 0.08, **parts: Any):
    """A CUDA run: device shares (forward/backward split 1:2 of what gap and optimizer leave)."""
    rest = 1 - gap - optimizer
    device = {"steps": len(steps), "median_step_s": dev_step_s,
              "breakdown": {"forward": rest / 3, "backward": 2 * rest / 3,
                            "optimizer": optimizer, "gap": gap}}
    base: dict[str, Any] = {
        "run_dir": "runs/a",
        "device": device,
        "environment": {"usable_cores": 8, "torch_num_threads": 8, "cuda": "12.4",
                        "gpu": "NVIDIA H100 80GB HBM3", "gpu_count": len(gpus or [gpu()])},
        "system": {"n_samples": 20, "proc_cpu_pct": 100.0, "workers_cpu_pct": 0.0,
                   "sys_cpu_pct": 20.0, "gpu": gpus if gpus is not None else [gpu()]},
    }
    base.update(parts)
    return make_summary(steps, **base)


def device_findings(summary, steps) -> list[dict[str, Any]]:
    return [f for f in diagnose(summary, steps) if f["rule"].startswith("device.")]


def one(findings: list[dict[str, Any]], rule: str) -> dict[str, Any]:
    hits = [f for f in findings if f["rule"] == rule]
    assert len(hits) == 1, findings
    return hits[0]


# -- nothing on CPU runs ------------------------------------------------------------------------


def test_cpu_runs_get_no_device_finding():
    """Every symptom a device rule looks for, on runs that never used CUDA."""
    steps = make_steps(60, other=4 * MS)
    symptoms = {
        "dataloaders": [loader(pin_memory=False)],
        "forward_roots": [DP_ROOT],
        "ops": {"conv2d_per_step": 20.0, "conv2d_channels_last_per_step": 0.0},
    }
    cpu = make_summary(steps, **symptoms)
    assert device_findings(cpu, steps) == []
    # a CPU-only script on a GPU machine: NVML samples a full GPU it never touched
    gpu_box = make_summary(
        steps, **symptoms,
        environment={"usable_cores": 8, "torch_num_threads": 8, "cuda": "12.4",
                     "gpu": "NVIDIA H100", "gpu_count": 2},
        system={"n_samples": 20, "proc_cpu_pct": 100.0,
                "gpu": [gpu(0, 95.0, 79.0), gpu(1, 90.0, 78.0)]},
    )
    assert Context(gpu_box, steps).on_cuda  # the broad test says CUDA ...
    assert device_findings(gpu_box, steps) == []  # ... but no device records: nothing fires


# -- 1, 2. the device gap: pageable batches, host-bound ---------------------------------------


def test_pageable_batches_own_the_idle_gap():
    steps = make_steps(60, other=3 * MS)
    summary = cuda_summary(steps, gap=0.25, dataloaders=[loader(num_workers=4)])
    found = device_findings(summary, steps)
    f = one(found, "device.pageable_batches")
    assert (f["category"], f["cause"], f["severity"]) == ("host_to_device", "pageable_batches",
                                                          "high")
    assert f["estimated_gain"] == 0.25  # nothing else owns the gap; the GPU ran kernels 70%
    assert f["evidence"]["device_gap_share"] == 0.25
    assert f["evidence"]["host_other_share"] == pytest.approx(3 / 13, rel=0.02)
    snippet = f["fix"]["snippet"]
    assert "pin_memory=True," in snippet and "num_workers=4,  # unchanged" in snippet
    assert "x = x.to(device, non_blocking=True)" in snippet and "Images(...)" in snippet
    assert f["verify"].startswith("trainprof tune --knob pin_memory=false,true train.py")
    # one bottleneck, one finding: the host-bound rule yields the same gap
    assert [g["category"] for g in found] == ["host_to_device"]


def test_pinned_batches_leave_the_gap_to_host_launch():
    steps = make_steps(60, other=3 * MS)
    summary = cuda_summary(steps, gap=0.25, dataloaders=[loader(pin_memory=True)])
    found = device_findings(summary, steps)
    f = one(found, "device.idle_between_phases")
    assert (f["category"], f["cause"], f["severity"]) == ("host_launch",
                                                          "device_idle_between_phases", "high")
    assert f["estimated_gain"] == 0.25
    assert 'torch.compile(model, mode="reduce-overhead")' in f["fix"]["snippet"]
    assert "batch_size=64)  # was 32" in f["fix"]["snippet"]
    assert f["verify"].startswith("trainprof tune --knob batch_size=32,64,128 train.py")
    assert "trainprof compare runs/a NEW_RUN" in f["verify"]
    assert [g["category"] for g in found] == ["host_launch"]
    # no DataLoader at all (batches made on the GPU): the gap is still the host's
    f = one(device_findings(cuda_summary(steps, gap=0.25), steps), "device.idle_between_phases")
    assert "batch_size" not in f["fix"]["snippet"] and f["verify"].startswith("`trainprof run")


def test_the_gap_is_shared_out_and_capped_by_gpu_utilisation():
    # 0.5 ms data wait on a 14 ms step (3.6%, below the input band); 5% blocked in syncs
    steps = make_steps(60, jitter=0.0, data=0.5 * MS, other=3.5 * MS)
    summary = cuda_summary(steps, gap=0.30, dataloaders=[loader(pin_memory=True)])
    summary["syncs"] = {"per_step": 1.0, "share": 0.05, "host_reads_per_step": 1.0}
    f = one(device_findings(summary, steps), "device.idle_between_phases")
    data = 0.5 / 14
    assert f["evidence"]["gap_owned_by_data_wait"] == pytest.approx(data, rel=1e-3)
    assert f["evidence"]["gap_owned_by_syncs"] == 0.05
    assert f["estimated_gain"] == pytest.approx(0.30 - data - 0.05, abs=1e-4)
    # the GPU ran kernels 90% of the time: at most 10% of the step was idle
    summary["system"]["gpu"] = [gpu(util=90.0)]
    f = one(device_findings(summary, steps), "device.idle_between_phases")
    assert (f["estimated_gain"], f["severity"]) == (pytest.approx(0.10), "medium")
    assert f["evidence"]["gpu_util"] == 0.9
    # 97%: the "gap" is device work between phases (a functional loss), not idle time
    summary["system"]["gpu"] = [gpu(util=97.0)]
    assert device_findings(summary, steps) == []


def test_checkpointing_every_n_steps_is_periodic_not_host_launch():
    other = [1 * MS] * 80
    for i in range(5, 80, 10):
        other[i] = 41 * MS  # a 40 ms checkpoint every 10 steps, outside the phases
    steps = make_steps(80, other=other)
    summary = cuda_summary(steps, gap=0.40, dataloaders=[loader(pin_memory=True)])
    ctx = Context(summary, steps)
    periodic = ctx.periodic.excess_s["other"] / ctx.total_s  # the gap's part of its excess
    assert periodic == pytest.approx(8 * 40 / (80 * 11 + 8 * 40), rel=1e-3)
    f = one(device_findings(summary, steps), "device.idle_between_phases")
    assert f["evidence"]["gap_owned_by_periodic"] == pytest.approx(periodic, rel=1e-3)
    assert f["estimated_gain"] == pytest.approx(0.40 - periodic, abs=1e-4)
    assert diagnose(summary, steps)[0]["category"] == "periodic_overhead"


def test_input_bound_cuda_run_the_gap_rules_yield_to_input_pipeline():
    steps = make_steps(60, data=5 * MS)  # 33% data wait
    summary = cuda_summary(steps, gap=0.40, dataloaders=[loader(num_workers=2)])
    out = diagnose(summary, steps)
    assert out[0]["category"] == "input_pipeline"
    assert "pin_memory=True" in out[0]["fix"]["snippet"]  # the input finding carries the pin
    assert not [f for f in out if f["category"] in ("host_to_device", "host_launch")], out
    summary["dataloaders"] = [loader(num_workers=2, pin_memory=True)]
    assert not [f for f in diagnose(summary, steps)
                if f["category"] in ("host_to_device", "host_launch")]


def test_small_gaps_and_deep_windows_stay_silent():
    steps = make_steps(60)
    quiet = cuda_summary(steps, gap=0.04, dataloaders=[loader(pin_memory=True)])
    assert device_findings(quiet, steps) == []
    f = one(device_findings(cuda_summary(steps, gap=0.03, dataloaders=[loader()]), steps),
            "device.pageable_batches")
    assert f["severity"] == "low"  # pinning is a one-knob check: low band at 2%
    # the deep window's trace measured launches and copies: its findings stand, not ours
    deep = [{"source": "deep/w0.pt.trace.json.gz",
             "findings": [{"category": "host_launch"}, {"category": "host_to_device"}]}]
    for pin in (False, True):
        summary = cuda_summary(steps, gap=0.30, dataloaders=[loader(pin_memory=pin)], deep=deep)
        assert device_findings(summary, steps) == []


# -- 3, 4. memory ----------------------------------------------------------------------------


def counters(retries: int = 0, ooms: int = 0, reserved_gib: float = 40.0) -> dict[str, Any]:
    return {"devices": [{"index": 0, "total_bytes": 80 * GIB, "num_alloc_retries": retries,
                         "num_ooms": ooms, "allocated_bytes.all.peak": 30 * GIB,
                         "reserved_bytes.all.peak": reserved_gib * GIB}]}


@pytest.mark.parametrize(("used_gib", "severity"), [(70.0, None), (73.0, "low"), (77.0, "medium")])
def test_memory_near_capacity_bands(used_gib, severity):
    steps = make_steps(60)
    summary = cuda_summary(steps, gpus=[gpu(used_gib=used_gib)], cuda_memory=counters(),
                           dataloaders=[loader(pin_memory=True)])
    found = [f for f in device_findings(summary, steps) if f["cause"] == "near_capacity"]
    assert [f["severity"] for f in found] == ([severity] if severity else [])
    if found:
        f = found[0]
        assert f["estimated_gain"] == 0.0  # a risk, not a measured slowdown
        assert f["evidence"]["memory_peak_share"] == pytest.approx(used_gib / 80, rel=1e-3)
        assert f["evidence"]["memory_source"] == "nvml"
        assert "expandable_segments:True" in f["fix"]["snippet"]
        assert "batch_size=16)  # was 32" in f["fix"]["snippet"]  # half, with accumulation
        assert f["verify"].startswith("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                                      "trainprof run train.py")


def test_torch_reserved_peak_counts_without_nvml():
    steps = make_steps(60)
    summary = cuda_summary(steps, gpus=[], cuda_memory=counters(reserved_gib=76.0))
    f = one(device_findings(summary, steps), "device.memory_near_capacity")
    assert f["evidence"]["memory_source"] == "torch"
    assert f["evidence"]["memory_peak_share"] == 0.95 and f["severity"] == "medium"
    # NVML sees a second GPU, full with another job, that the run never allocated on
    summary = cuda_summary(steps, gpus=[gpu(0, used_gib=20.0), gpu(1, used_gib=79.0)],
                           cuda_memory=counters(reserved_gib=18.0))
    found = [g for g in device_findings(summary, steps) if g["category"] == "memory"]
    assert [g["cause"] for g in found] == ["underused"]  # not near capacity: 18 of 80 GiB
    assert found[0]["evidence"]["memory_source"] == "torch"
    assert found[0]["evidence"]["memory_peak_share"] == 0.225


def test_allocator_retries_own_the_memory_symptom():
    fwd = [3 * MS] * 60
    for i in (17, 33, 46):  # three irregular stalls of 20 ms: where the retries landed
        fwd[i] = 23 * MS
    steps = make_steps(60, forward=fwd)
    summary = cuda_summary(steps, gpus=[gpu(used_gib=77.0)], cuda_memory=counters(retries=3),
                           dataloaders=[loader(pin_memory=True)])
    found = device_findings(summary, steps)
    f = one(found, "device.allocator_retries")
    assert (f["category"], f["cause"], f["severity"]) == ("memory", "allocator_retries",
                                                          "medium")  # 3 in 60 steps
    assert f["evidence"]["alloc_retries"] == 3 and f["evidence"]["retries_per_step"] == 0.05
    assert f["evidence"]["memory_peak_share"] == pytest.approx(77 / 80, rel=1e-3)
    assert f["evidence"]["cuda0.reserved_peak_gib"] == 40.0
    assert f["evidence"]["cuda0.allocated_peak_gib"] == 30.0
    # the bound: the three stalls' excess over a ~10 ms step; no quiet retries left over
    total = float(steps["dur_ns"][summary["steps"]["warmup"]:].sum()) / 1e9
    assert f["estimated_gain"] == pytest.approx(3 * 20 * MS / total, rel=0.05)
    assert not [g for g in found if g["cause"] == "near_capacity"]  # one memory finding
    assert "num_alloc_retries" in f["verify"]
    # retries in half the steps: high, and the quiet ones are bounded by the threshold
    summary["cuda_memory"] = counters(retries=30, ooms=1)
    f = one(device_findings(summary, steps), "device.allocator_retries")
    assert f["severity"] == "high" and f["evidence"]["ooms"] == 1
    ctx = Context(summary, steps)
    med = ctx.median_step_s
    # 27 quiet retries x (0.5 x median: larger than 5 sigma of a 2% jitter) + the 3 stalls
    assert f["estimated_gain"] == pytest.approx((3 * 20 * MS + 27 * 0.5 * med) / total, rel=0.05)
    summary["cuda_memory"] = counters(retries=0)
    assert not [g for g in device_findings(summary, steps) if g["cause"] == "allocator_retries"]


def test_memory_underused_is_a_low_hint_on_short_gpu_bound_steps():
    steps = make_steps(60)
    summary = cuda_summary(steps, gap=0.04, optimizer=0.10, gpus=[gpu(used_gib=16.0)],
                           dataloaders=[loader(pin_memory=True)])
    f = one(device_findings(summary, steps), "device.memory_underused")
    assert (f["category"], f["cause"], f["severity"]) == ("memory", "underused", "low")
    assert f["estimated_gain"] == 0.05  # half the optimizer's device share
    assert f["verify"] == "trainprof tune --knob batch_size=32,64,128 train.py: time per " \
                          "sample should fall"  # 20% of memory: 4x still leaves headroom
    assert "batch_size=128)  # was 32" in f["fix"]["snippet"] and "lr" in f["fix"]["snippet"]
    summary["system"]["gpu"] = [gpu(used_gib=22.0)]  # 27.5%: only 2x
    f = one(device_findings(summary, steps), "device.memory_underused")
    assert "--knob batch_size=32,64 " in f["verify"]
    for change in ({"gpus": [gpu(used_gib=30.0)]},  # 37%: not under-used
                   {"gap": 0.06},  # the GPU idles (host_launch fires): not GPU-bound
                   {"dev_step_s": 0.3}):  # a long step already fills the GPU
        kw = {"gap": 0.04, "optimizer": 0.10, "gpus": [gpu(used_gib=16.0)], **change}
        s = cuda_summary(steps, dataloaders=[loader(pin_memory=True)], **kw)
        assert not [g for g in device_findings(s, steps) if g["cause"] == "underused"], change


# -- 5. DataParallel --------------------------------------------------------------------------


def test_data_parallel_on_two_gpus():
    steps = make_steps(60)
    roots = [DP_ROOT, "torch.nn.modules.loss.CrossEntropyLoss"]
    summary = cuda_summary(steps, gpus=[gpu(0, 60.0), gpu(1, 40.0)], forward_roots=roots,
                           dataloaders=[loader(pin_memory=True)])
    f = one(device_findings(summary, steps), "device.data_parallel")
    assert (f["category"], f["cause"], f["severity"]) == ("distributed", "data_parallel", "high")
    assert f["verify"].endswith("(per-rank samples/s x 2) with this run's: "
                                "`trainprof compare runs/a RANK0_RUN`")  # no sample count
    assert f["estimated_gain"] == 0.5  # the GPUs were idle half the time on average
    assert f["evidence"]["gpu_util"] == [0.6, 0.4] and f["evidence"]["gpus_in_use"] == 2
    snippet = f["fix"]["snippet"]
    assert "torchrun --nproc_per_node=2 train.py" in snippet
    assert "DDP(model.to(rank), device_ids=[rank])" in snippet
    assert "batch_size=16, sampler=sampler" in snippet  # the global 32 over 2 processes
    # one GPU: DataParallel calls the module directly; DDP is already right
    for gpus, r in (([gpu(0, 60.0)], roots),
                    ([gpu(0, 60.0), gpu(1, 40.0)],
                     ["torch.nn.parallel.distributed.DistributedDataParallel"])):
        s = cuda_summary(steps, gpus=gpus, forward_roots=r, dataloaders=[loader(pin_memory=True)])
        assert not [g for g in device_findings(s, steps) if g["category"] == "distributed"]
    # GPU 0 idles between phases: the same one-process bottleneck, one finding
    summary = cuda_summary(steps, gap=0.25, gpus=[gpu(0, 60.0), gpu(1, 40.0)],
                           forward_roots=roots, dataloaders=[loader(pin_memory=True)],
                           samples_per_s=2400.0)
    found = device_findings(summary, steps)
    assert [g["cause"] for g in found] == ["data_parallel"]
    assert found[0]["evidence"]["device_gap_share"] == 0.25
    assert "with this run's (2400.0 samples/s)" in found[0]["verify"]


# -- 6. channels_last -------------------------------------------------------------------------


def test_channels_last_hint_for_nchw_convolutions():
    steps = make_steps(60)
    ops = {"conv2d_per_step": 20.0, "conv2d_channels_last_per_step": 0.0}
    summary = cuda_summary(steps, ops=ops, dataloaders=[loader(pin_memory=True)])
    f = one(device_findings(summary, steps), "device.channels_last")
    assert (f["category"], f["cause"], f["severity"]) == ("compute", "channels_last", "low")
    dev = summary["device"]["breakdown"]
    assert f["estimated_gain"] == pytest.approx(
        (dev["forward"] + dev["backward"]) * (1 - 1 / CHANNELS_LAST_SPEEDUP), abs=1e-4)
    assert "memory_format=torch.channels_last" in f["fix"]["snippet"]
    summary["ops"] = {"conv2d_per_step": 20.0, "conv2d_channels_last_per_step": 20.0}
    assert device_findings(summary, steps) == []
    summary["ops"] = ops
    summary["deep"] = [{"source": "w", "findings": [{"category": "compute"}]}]
    assert device_findings(summary, steps) == []  # tensor cores unused says it, and more


def test_cudnn_autotuner_off_under_convolutions_is_a_low_hint_the_knob_measures():
    steps = make_steps(60)
    ops = {"conv2d_per_step": 20.0, "conv2d_channels_last_per_step": 20.0}

    def summary(**env: Any) -> dict[str, Any]:
        s = cuda_summary(steps, ops=ops, dataloaders=[loader(pin_memory=True)])
        s["environment"].update(env)
        return s

    f = one(device_findings(summary(cudnn_benchmark=False), steps), "device.cudnn_benchmark")
    assert (f["category"], f["cause"], f["severity"]) == ("compute", "cudnn_benchmark_off",
                                                          "low")
    assert f["estimated_gain"] == 0 and f["evidence"]["gain_unknown"] is True
    assert impact_text(f) == GAIN_UNKNOWN  # not "no speed-up"
    assert f["verify"].startswith("trainprof tune --knob cudnn_benchmark=false,true train.py")
    # on already, deterministic asked for, not recorded (an older run), or no convolution
    for env in ({"cudnn_benchmark": True}, {"cudnn_benchmark": False,
                                            "cudnn_deterministic": True}, {}):
        assert device_findings(summary(**env), steps) == []
    s = summary(cudnn_benchmark=False)
    s["ops"] = {"conv2d_per_step": 0.0}
    assert device_findings(s, steps) == []


def test_the_cudnn_benchmark_and_tf32_knobs_hold_against_the_script(tmp_path):
    """The knobs as trainprof tune passes them: the script's own cudnn.benchmark is
    ignored and recorded, and the fingerprint (after the first step) sees the knob's
    value; its TF32 switches, set in its set-up, are set over after its first step."""
    write_script(tmp_path, "train.py", """
        import torch
        torch.backends.cudnn.benchmark = False  # the script's own choices
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(5):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        with torch.backends.cudnn.flags(enabled=True, benchmark=False):
            assert torch.backends.cudnn.benchmark is True
        print("tf32:", torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    """)
    res = trainprof("run", "--json", "--no-html", "train.py", cwd=tmp_path,
                    env={ENV_VAR: json.dumps({"cudnn_benchmark": True, "tf32": True})})
    assert res.returncode == 0, res.stderr[-2000:]
    meta = json.loads((res.run_dir / "run.json").read_text())
    assert meta["knobs"]["process"]["cudnn_benchmark"] is True
    assert meta["knobs"]["script_calls_ignored"] == ["torch.backends.cudnn.benchmark = False"]
    assert meta["fingerprint"]["torch"]["cudnn_benchmark"] is True
    assert _actual("cudnn_benchmark", meta) == "true"
    assert res.json()["environment"]["cudnn_benchmark"] is True
    assert "tf32: high True" in res.stderr  # (--json: the script prints to stderr)
    assert meta["knobs"]["process"]["tf32"] == {"value": True, "script": {
        "float32_matmul_precision": "highest", "cudnn_allow_tf32": False}}
    assert _actual("tf32", meta) == "true (script: matmul highest, cuDNN fp32)"


# -- TF32 (diagnosis/tf32.py) -------------------------------------------------------------------


def test_fp32_matmuls_on_an_ampere_gpu_without_tf32_are_found():
    steps = make_steps(60)
    ops = {"matmul_per_step": 12.0, "cuda_fp32_matmul_per_step": 12.0, "conv2d_per_step": 0.0,
           "cuda_fp32_conv2d_per_step": 0.0, "float32_matmul_precision": "highest",
           "cudnn_allow_tf32": True}

    def tf32(capability: str | None = "9.0", **changes: Any) -> list[dict[str, Any]]:
        s = cuda_summary(steps, ops={**ops, **changes}, dataloaders=[loader(pin_memory=True)])
        s["environment"]["gpu_capability"] = capability
        return [f for f in diagnose(s, steps) if f["rule"] == "tf32.fp32_matmuls"]

    (f,) = tf32()
    assert (f["category"], f["cause"], f["severity"]) == ("compute", "fp32_without_tf32", "high")
    # the device's forward + backward (0.9 of its step) x all products x (1 - 1/3)
    assert f["estimated_gain"] == pytest.approx(0.9 * (1 - 1 / TF32_SPEEDUP), abs=1e-3)
    assert 'set_float32_matmul_precision("high")' in f["fix"]["snippet"]
    assert f["verify"].startswith("trainprof tune --knob tf32=false,true train.py")
    assert "12 float32 matrix products" in f["title"]
    # half of the heavy calls are convolutions cuDNN already runs in TF32: half the claim
    (f,) = tf32(conv2d_per_step=12.0, cuda_fp32_conv2d_per_step=12.0)
    assert f["estimated_gain"] == pytest.approx(0.45 * (1 - 1 / TF32_SPEEDUP), abs=1e-3)
    # ... unless the script turned TF32 off for them too
    (f,) = tf32(conv2d_per_step=12.0, cuda_fp32_conv2d_per_step=12.0, cudnn_allow_tf32=False)
    assert f["evidence"]["fp32_conv2d_without_tf32_per_step"] == 12.0
    assert "turned it off for convolutions" in f["fix"]["text"]
    # no TF32 cores (Volta), TF32 allowed, autocast (no float32 products), or not recorded
    for case in ({"capability": "7.0"}, {"capability": None},
                 {"float32_matmul_precision": "high"}, {"cuda_fp32_matmul_per_step": 0.0},
                 {"float32_matmul_precision": None}):
        assert tf32(**case) == [], case
    # a --deep window's tensor-core finding says it from the kernels
    s = cuda_summary(steps, ops=ops, deep=[{"findings": [{"category": "compute"}]}])
    s["environment"]["gpu_capability"] = "8.0"
    assert not [f for f in diagnose(s, steps) if f["rule"] == "tf32.fp32_matmuls"]


# -- what the rules read: allocator counters, conv2d count ------------------------------------


def test_cuda_memory_capture_reads_only_devices_used(monkeypatch):
    cuda = torch.cuda
    stats = {0: {"allocation.all.allocated": 120, "num_alloc_retries": 2, "num_ooms": 0,
                 "allocated_bytes.all.peak": 5 * GIB, "reserved_bytes.all.peak": 6 * GIB,
                 "num_device_alloc": 9, "num_device_free": 3},
             1: {}}
    monkeypatch.setattr(cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(cuda, "memory_stats", lambda i: pytest.fail("CUDA read uninitialised"))
    assert Recorder._cuda_memory() is None  # never touches CUDA the script did not start
    monkeypatch.setattr(cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: 2)
    monkeypatch.setattr(cuda, "memory_stats", lambda i: stats[i])
    monkeypatch.setattr(cuda, "get_device_properties",
                        lambda i: SimpleNamespace(total_memory=80 * GIB))
    assert Recorder._cuda_memory() == {"devices": [{
        "index": 0, "total_bytes": 80 * GIB, "num_alloc_retries": 2, "num_ooms": 0,
        "allocated_bytes.all.peak": 5 * GIB, "reserved_bytes.all.peak": 6 * GIB,
        "num_device_alloc": 9, "num_device_free": 3}]}

    def broken(i: int) -> dict:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(cuda, "memory_stats", broken)
    assert Recorder._cuda_memory() is None  # a stop that cannot read them still closes the run


def test_op_sample_counts_conv2d_and_channels_last(tmp_path: Path):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 8, 1), torch.nn.Flatten(),
                                torch.nn.LazyLinear(2))
    x = torch.randn(4, 3, 8, 8)
    model(x)  # materialise the lazy layer outside the window
    counts = []
    for fmt in (torch.contiguous_format, torch.channels_last):
        tool = OpCountTool(tmp_path)
        m = model.to(memory_format=fmt)
        tool.start(0)
        for _ in range(2):
            m(x.to(memory_format=fmt))
        tool.stop(2)
        tool.close()
        doc = json.loads((tmp_path / "ops.json").read_text())
        counts.append((doc["conv2d_per_step"], doc["conv2d_channels_last_per_step"]))
    assert counts == [(2.0, 0.0), (2.0, 2.0)]
    # the matrix products (the linear head), none of them float32 on CUDA; the TF32 switches
    assert (doc["matmul_per_step"], doc["cuda_fp32_matmul_per_step"]) == (1.0, 0.0)
    assert doc["float32_matmul_precision"] == "highest" and doc["cudnn_allow_tf32"] is True


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: what the op count reads of a CUDA input."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def test_op_sample_counts_float32_products_on_cuda(tmp_path: Path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    tool = OpCountTool(tmp_path)
    tool.start(0)
    for dtype in (torch.float32, torch.float64):  # one step each: only float32 counts
        x = torch.randn(4, 8, dtype=dtype).as_subclass(_OnCuda)
        model.to(dtype)(x)
        x @ x.T
    tool.stop(2)
    tool.close()
    doc = json.loads((tmp_path / "ops.json").read_text())
    assert (doc["matmul_per_step"], doc["cuda_fp32_matmul_per_step"]) == (3.0, 1.5)


# -- a real CPU run ---------------------------------------------------------------------------

CPU_SCRIPT = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
data = TensorDataset(torch.randn(256, 3, 16, 16), torch.randint(0, 4, (256,)))
loader = DataLoader(data, batch_size=16, shuffle=True, pin_memory=False)
model = nn.DataParallel(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3),
                                      nn.Flatten(), nn.Linear(8 * 12 * 12, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loss_fn = nn.CrossEntropyLoss()
for x, y in loader:
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()
"""


def test_real_cpu_run_has_no_device_finding_and_no_cuda_memory(tmp_path: Path):
    write_script(tmp_path, "train.py", CPU_SCRIPT)
    # GPUs hidden: on a GPU machine DataParallel would move the model to one
    res = trainprof("run", "--json", "train.py", cwd=tmp_path, env={"CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 0, res.stderr[-3000:]
    doc = res.json()
    assert doc["steps"]["count"] == 16
    assert doc["device"] is None and doc["cuda_memory"] is None
    assert "cuda_memory" not in json.loads((res.run_dir / "run.json").read_text())
    # every symptom the device rules look for was recorded ...
    assert DP_ROOT in doc["forward_roots"]
    assert doc["ops"]["conv2d_per_step"] == 2.0
    assert doc["ops"]["conv2d_channels_last_per_step"] == 0.0
    assert doc["dataloaders"][0]["pin_memory"] is False
    # ... and none fires on a CPU run
    assert not [f for f in doc["findings"] if f["rule"].startswith("device.")], doc["findings"]


def test_a_trainer_built_loader_gets_training_arguments_in_the_memory_fix():
    """Hugging Face's Trainer builds the loader (batch_size None, its batch_sampler's 32):
    the fix halves per_device_train_batch_size and accumulates in TrainingArguments."""
    steps = make_steps(60)
    trainer_loader = loader(pin_memory=True, batch_size=None, batch_sampler_batch_size=32,
                            driven_by="transformers.Trainer")
    summary = cuda_summary(steps, gpus=[gpu(used_gib=77.0)], cuda_memory=counters(),
                           dataloaders=[trainer_loader])
    f = next(f for f in device_findings(summary, steps) if f["cause"] == "near_capacity")
    snippet = f["fix"]["snippet"]
    assert "per_device_train_batch_size=16,  # was 32" in snippet
    assert "gradient_accumulation_steps=2," in snippet
    assert "DataLoader(" not in snippet and "opt.step()" not in snippet
