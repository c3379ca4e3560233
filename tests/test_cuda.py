"""`trainprof run` on a real CUDA training loop: device time per phase, syncs, NVML, fingerprint.

CI has no GPU, so these are skipped there; they run wherever ``torch.cuda.is_available()``
(see the README's "Development": on a GPU machine, ``python -m pytest -q tests/test_cuda.py``).
Everything here is also covered on the CPU by fakes (fake events in
test_device_timer, a fake pynvml in test_sampler); these check the real thing: that
CUDA events resolve lazily into device times that add up, that trainprof's hooks never
force a host-device sync of their own, and that NVML and the fingerprint see the GPU.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from conftest import Result, trainprof, write_script

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

#: A GPU-bound loop with known device work: forward sleeps CYCLES on the device and
#: backward twice that (``torch.cuda._sleep`` spins a kernel for that many clock cycles,
#: so the ratio holds whatever the clock), through a pinned-memory DataLoader. With
#: ``sync``, one ``.item()`` a step: the host waits for the device there, so the host
#: and device step times agree. Without, nothing syncs until the end, under torch's
#: sync debug mode: any synchronizing call (trainprof's included) raises. The script is
#: the one the H100 record tests/data/h100/synced/ ran.
DATA = Path(__file__).resolve().parent / "data" / "h100"
SCRIPT = (DATA / "synced" / "synced.py").read_text()

#: 16 steps an epoch; 40 epochs of ~3 ms steps: ~2 s, ten samples of the 5 Hz sampler
EPOCHS = "40"


def _run(tp, *args: str) -> tuple[Result, dict]:
    res = tp(SCRIPT, "--json", args=args, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return res, json.loads(res.stdout)


@pytest.fixture(scope="module")
def synced(tmp_path_factory) -> tuple[Result, dict]:
    """One synced run, shared by the tests that read it."""

    cwd = tmp_path_factory.mktemp("synced")
    write_script(cwd, "train.py", SCRIPT)
    res = trainprof("run", "--json", "train.py", EPOCHS, "sync", cwd=cwd, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return res, json.loads(res.stdout)


def test_device_time_per_phase_matches_the_known_device_work(synced):
    _, doc = synced
    steps = doc["steps"]
    assert steps["count"] == 640
    dev = doc["device"]
    assert dev is not None, doc.get("missing")
    # the timer starts when the flush thread sees CUDA initialised (within a second)
    assert dev["steps"] >= 200
    shares = dev["breakdown"]
    assert all(v >= 0 for v in shares.values())
    assert sum(shares.values()) == pytest.approx(1.0, abs=0.01)
    # backward holds twice forward's device sleep; both dwarf the rest of the step
    assert shares["backward"] / shares["forward"] == pytest.approx(2.0, rel=0.2), shares
    assert shares["forward"] + shares["backward"] > 0.6, shares
    # the host waits for the device at .item() each step: the step times agree
    assert dev["median_step_s"] == pytest.approx(steps["median_s"], rel=0.2), (dev, steps)


def test_item_on_a_cuda_tensor_is_a_timed_sync(synced):
    _, doc = synced
    assert doc["syncs"]["per_step"] == pytest.approx(1.0, abs=0.02)
    # the host spends most of a GPU-bound step waiting there
    assert 0.3 < doc["syncs"]["share"] < 1, doc["syncs"]


def test_hooks_never_sync_the_device(tp):
    """The unsynced loop runs under torch's sync debug mode "error": a sync would crash it."""
    _, doc = _run(tp, EPOCHS, "nosync")
    assert doc["status"] == "finished"
    assert doc["steps"]["count"] == 640
    assert doc["syncs"]["per_step"] == 0
    assert doc["device"] is not None and doc["device"]["steps"] >= 200


def test_fingerprint_memory_counters_and_nvml_see_the_gpu(synced):
    res, doc = synced
    env = doc["environment"]
    assert env["gpu"] == torch.cuda.get_device_name(0)
    assert env["gpu_count"] == torch.cuda.device_count()
    assert env["cuda"] == torch.version.cuda
    meta = json.loads((res.run_dir / "run.json").read_text())
    assert meta["fingerprint"]["driver_version"]
    mem = doc["cuda_memory"]["devices"][0]
    assert mem["allocated_bytes.all.peak"] > 0 and mem["num_ooms"] == 0
    if importlib.util.find_spec("pynvml") is None:
        assert any("nvidia-ml-py" in m for m in doc["missing"])
        return
    gpus = doc["system"]["gpu"]
    assert gpus and gpus[0]["mem_total_bytes"] > 0 and gpus[0]["mem_used_bytes"] > 0
    # the device is busy most of each step (the sleeps): NVML sees it
    assert gpus[0]["util_pct"] is not None and gpus[0]["util_pct"] > 30, gpus


#: Mixed precision with a GradScaler and AdamW on the device; the gradients overflow at
#: two known iterations (GradScaler then skips the optimizer step), and an explicit
#: torch.cuda.synchronize() each step, as timing code leaves them.
AMP = """
import torch
from torch import nn

model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # 4 parameter tensors
scaler = torch.amp.GradScaler("cuda")
x = torch.randn(64, 256, device="cuda")
y = torch.randint(0, 10, (64,), device="cuda")
for i in range(60):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(x), y)
    if i in (20, 41):
        loss = loss * float("inf")
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    torch.cuda.synchronize()
"""


def test_grad_scaler_skips_and_syncs_on_cuda(tp):
    """A skipped step is a step of its own; GradScaler's one read of ``found_inf`` a step
    is a device sync (a host read the script's library makes), AdamW's reads of its CPU
    step counters are not host reads, and the explicit synchronize() makes the sync
    finding name explicit calls, not reads."""
    res = tp(AMP, "--json", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads(res.stdout)
    assert doc["steps"]["count"] == 60 and doc["steps"]["skipped"] == 2
    syncs = doc["syncs"]
    assert syncs["host_reads_per_step"] == pytest.approx(1.0, abs=0.05), syncs
    assert syncs["per_step"] == pytest.approx(2.0, abs=0.05), syncs
    causes = {f["rule"]: f.get("cause") for f in doc["findings"]}
    if "sync.device_syncs" in causes:
        assert causes["sync.device_syncs"] == "explicit_synchronize", doc["findings"]


def test_device_prefetcher_on_a_side_stream_gives_the_cpu_paths_batches():
    """trainprof.fixes.DevicePrefetcher on CUDA: copies on a side stream, pinned memory."""
    from torch.utils.data import DataLoader

    from trainprof.fixes import DevicePrefetcher

    images = torch.randint(0, 256, (64, 3, 8, 8), dtype=torch.uint8)
    labels = torch.arange(64)
    loader = DataLoader(list(zip(images, labels, strict=True)), batch_size=16, pin_memory=True)
    mean, std = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]
    on_cpu = list(DevicePrefetcher(loader, "cpu", mean=mean, std=std))
    on_gpu = []
    for x, y in DevicePrefetcher(loader, "cuda", mean=mean, std=std):
        assert x.is_cuda and y.is_cuda and x.dtype == torch.float32
        on_gpu.append((x * 2).cpu())  # work on the compute stream, after the wait
    assert len(on_gpu) == 4
    for (x_cpu, _), x_gpu in zip(on_cpu, on_gpu, strict=True):
        torch.testing.assert_close(x_gpu, x_cpu * 2)


def test_optimizer_implementations_on_cuda():
    """torch's CUDA default is foreach; the knob's fused runs and updates as foreach does."""
    from trainprof.capture.optimizer_impl import (
        FOREACH,
        FUSED,
        describe_optimizer,
        set_implementation,
    )

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2)).cuda()

    a, b = model(), model()
    ref = torch.optim.AdamW(a.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(b.parameters(), lr=1e-2)
    assert describe_optimizer(ref)["implementation"] == FOREACH
    assert describe_optimizer(ref)["devices"] == ["cuda"]
    assert set_implementation(opt, FUSED)["set"] == FUSED
    x = torch.randn(4, 8, device="cuda")
    for m, o in ((a, ref), (b, opt)):
        for _ in range(3):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(importlib.util.find_spec("pynvml") is None, reason="nvidia-ml-py missing")
def test_gpu_memory_that_keeps_growing_is_found(tmp_path):
    """Tensors kept on the GPU every step: NVML's used memory grows to the end."""
    write_script(tmp_path, "train.py", """
        import time
        import torch
        model = torch.nn.Linear(1024, 1024).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        kept = []
        for step in range(1000):  # > 10 s: growth is judged on 8 s or more of steady steps
            x = torch.randn(1024, 1024, device="cuda")  # 4 MB
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            kept.append(x)
            torch.cuda.synchronize()
            time.sleep(0.01)
    """)
    res = trainprof("run", "--json", "--no-html", "train.py", cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    found = [f for f in res.json()["findings"] if f["cause"] == "gpu_memory_growth"]
    assert found, res.json()["memory_growth"]
    # judged on the memory NVML lists for the run's own process, not the whole device's
    # (which counts every process on a shared GPU)
    assert found[0]["evidence"]["series"] == "proc_mem_used_bytes", found[0]["evidence"]
    assert 2 * 2**20 < found[0]["evidence"]["bytes_per_step"] < 8 * 2**20


def test_a_cpu_only_script_on_a_gpu_machine_never_initialises_cuda(tmp_path):
    """trainprof must not bring CUDA up for a script that never does: the fingerprint
    names the GPUs through NVML, and no device timing starts (a CUDA context and CUDA
    events on a GPU the script never uses; seen on an H100 machine, 2026-11-26)."""
    write_script(tmp_path, "train.py", """
        import sys, time
        import torch
        model = torch.nn.Linear(64, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(32, 64)
        end = time.monotonic() + 3.0  # several flushes after the first step's fingerprint
        while time.monotonic() < end:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.002)
        print("cuda initialised:", torch.cuda.is_initialized(), file=sys.stderr)
    """)
    res = trainprof("run", "--json", "--no-html", "train.py", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "cuda initialised: False" in res.stderr
    doc = res.json()
    assert doc["device"] is None and doc["cuda_memory"] is None
    assert not [f for f in doc["findings"] if f["rule"].startswith("device.")]
    gpus = json.loads((res.run_dir / "run.json").read_text())["fingerprint"]["gpus"]
    if importlib.util.find_spec("pynvml") is not None:
        assert gpus and gpus[0]["source"] == "nvml"
        assert gpus[0]["name"] == torch.cuda.get_device_name(0)


#: Many tiny layers and a small batch on the GPU: the host launches kernels (some
#: 240 a step of ~2 µs each) slower than the GPU runs them. The script of the H100
#: record tests/data/h100/launch_bound/, run as it was there.
LAUNCH_BOUND = (DATA / "launch_bound" / "launch_bound.py").read_text()


def test_a_launch_bound_loop_is_found_in_its_deep_window(tp):
    """The trace's launch-bound finding reaches the run's findings, though the run's own
    rules found a part of it (AdamW's launches, same category): on an H100, 2026-11-26,
    the GPU idled 94% of the window, and the finding was dropped for the part."""
    res = tp(LAUNCH_BOUND, "--json", "--no-html", "--deep", "skip=50,warmup=2,active=5",
             timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = res.json()
    deep = doc["deep"][-1]
    assert deep["cpu_only"] is False
    assert deep["breakdown_us"]["Kernel"] < 0.3 * deep["breakdown_us"]["Total"], deep[
        "breakdown_us"]
    found = [f for f in doc["findings"] if f["cause"] == "launch_bound"]
    assert found, [(f["rule"], f["cause"], f["estimated_gain"]) for f in doc["findings"]]
    assert found[0]["category"] == "host_launch" and found[0]["estimated_gain"] > 0.5
    assert found[0]["evidence"]["kernels_per_step"] > 100
    assert doc["findings"][0]["cause"] == "launch_bound"  # the largest gain ranks first


def test_deep_window_on_cuda_times_the_known_kernels(tp):
    """The deep window's trace holds the forward's and backward's sleep kernels, two a
    step, the backward's twice as long (CYCLES cycles vs 2 * CYCLES)."""
    res = tp(SCRIPT, "--json", "--no-html", "--deep", "skip=20,warmup=2,active=3",
             args=("10", "sync"), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    deep = res.json()["deep"][-1]
    assert deep["cpu_only"] is False and deep["steps"] == ["22", "23", "24"]
    spin = [k for k in deep["kernels"] if "spin_kernel" in k["name"]]
    assert spin and spin[0]["calls"] == 6, deep["kernels"][:3]
    assert spin[0]["max_us"] / spin[0]["min_us"] == pytest.approx(2.0, rel=0.1)
    bd = deep["breakdown_us"]
    assert bd["Kernel"] >= 0.99 * spin[0]["total_us"] / 3  # per step


#: float32 matmuls on the GPU, one step in two under autocast (bf16): the op count's
#: window (steps 8 and 9) sees one of each. TF32 as torch leaves it (matmuls "highest").
FP32_MATMULS = """
import torch
from torch import nn

model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(512, 1024, device="cuda")
for step in range(60):
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=step % 2 == 1):
        loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print("tf32:", torch.get_float32_matmul_precision())
"""


def test_float32_matmuls_without_tf32_are_counted_and_found_on_ampere(tp):
    """The op count tells float32 products on CUDA from autocast's; on compute capability
    8.0 or newer the TF32 finding names them, and the knob sets TF32 on."""
    res = tp(FP32_MATMULS, "--json", "--no-html", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = res.json()
    ops = doc["ops"]
    # two Linear layers a step; the autocast step's are bf16
    assert (ops["matmul_per_step"], ops["cuda_fp32_matmul_per_step"]) == (2.0, 1.0), ops
    assert ops["float32_matmul_precision"] == "highest"
    major = torch.cuda.get_device_capability()[0]
    assert doc["environment"]["gpu_capability"].startswith(str(major))
    found = [f for f in doc["findings"] if f["cause"] == "fp32_without_tf32"]
    assert bool(found) == (major >= 8), doc["findings"]
    res = tp(FP32_MATMULS, "--json", "--no-html", timeout=300,
             env={"TRAINPROF_KNOBS": json.dumps({"tf32": True})})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "tf32: high" in res.stderr
    assert res.json()["ops"]["float32_matmul_precision"] == "high"


def test_the_autocast_knob_runs_a_cuda_models_calls_in_bfloat16(tp):
    """``--knob autocast=bf16`` enters autocast for the model's device at its outermost
    call, inside the script's own (which turns it off every other step here): no float32
    product is left."""
    from trainprof.store import load_run

    res = tp(FP32_MATMULS, "--json", "--no-html", timeout=300,
             env={"TRAINPROF_KNOBS": json.dumps({"autocast": "bf16"})})
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.json()["ops"]["cuda_fp32_matmul_per_step"] == 0.0
    rec = load_run(res.run_dir).meta["knobs"]["process"]["autocast"]
    assert rec == {"value": "bf16", "calls": 60, "device_types": {"cuda": 60}}


def test_flops_utilization_on_cuda_counts_bfloat16_and_measures_its_peak(tp):
    """Under the autocast knob every product runs in bfloat16: the FLOPs are counted as
    "cuda bfloat16" (forward, weight and input gradients but the first layer's input), the
    peak is measured with CUDA's bfloat16 torch.mm, and a listed GPU gets its datasheet MFU."""
    res = tp(FP32_MATMULS, "--json", "--no-html", timeout=300,
             env={"TRAINPROF_KNOBS": json.dumps({"autocast": "bf16"})})
    assert res.returncode == 0, res.stderr[-3000:]
    compute = res.json()["compute"]
    pairs = 1024 * 4096 + 4096 * 1024
    assert compute["flops_per_step"] == 2.0 * 512 * (2 * pairs + 4096 * 1024)
    (kind,) = compute["kinds"]
    assert kind["kind"] == "cuda bfloat16"
    assert kind["peak_flops_per_s"] > 10e12  # any tensor-core GPU with bfloat16
    assert 0 < compute["utilization"] < 1.2
    name = torch.cuda.get_device_name(0)
    if "H100" in name or "A100" in name or "H200" in name:
        assert 0 < compute["datasheet_utilization"] <= compute["utilization"]


COMPILED_MLP = """
# a compiled model, trained in float32
import sys
import torch
from torch import nn

model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
fast = torch.compile(model, mode=None if sys.argv[1] == "default" else sys.argv[1])
x = torch.randn(512, 1024, device="cuda")
for step in range(40):
    loss = fast(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_a_compiled_cuda_model_is_counted_at_the_products_its_code_calls(tp, mode):
    """Inductor's code calls cuBLAS for the products: the op count's FLOP mode counts them
    as eager would. Replayed as CUDA graphs they call no op: either all are counted (the
    mode kept the graphs from being replayed) or none, and the summary says why."""
    res = tp(COMPILED_MLP, "--json", "--no-html", args=(mode,), timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = res.json()
    assert doc["ops"]["compiled"] is True
    expected = 2.0 * 512 * (2 * (1024 * 4096 + 4096 * 1024) + 4096 * 1024)
    compute = doc["compute"]
    if mode == "default" or compute is not None:
        assert compute["flops_per_step"] == expected
        assert [k["kind"] for k in compute["kinds"]] == ["cuda float32"]
        assert 0 < compute["utilization"] < 1.2
    else:
        assert any(n.startswith("no FLOPs counted") for n in doc["notes"])


EAGER_ATTENTION_CUDA = """
import math
import torch
from torch import nn

torch.manual_seed(0)
B, H, T, d = 8, 12, 1024, 64


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(H * d, 3 * H * d)

    def forward(self, x):
        q, k, v = self.proj(x).view(B, T, 3, H, d).permute(2, 0, 3, 1, 4)
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d), dim=-1) @ v


model = SelfAttention().cuda()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(B, T, H * d, device="cuda")
for step in range(30):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x).float().square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_eager_attention_on_cuda_is_timed_by_events_and_its_fix_measured(tp):
    """On a GPU the ops on the score matrices are timed by CUDA events (resolved at the end),
    and the fused kernel (FlashAttention in bfloat16) against the plain ops at that shape:
    far faster, so the finding fires with a measured saving."""
    res = tp(EAGER_ATTENTION_CUDA, "--json", "--no-html", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = res.json()
    (shape,) = doc["attention"]["shapes"]
    assert (shape["batch"], shape["query_len"], shape["head_dim"], shape["device"],
            shape["dtype"]) == (96, 1024, 64, "cuda", "bfloat16")
    assert shape["s_per_step"] > 0 and "unresolved" not in shape
    assert shape["fused_ratio"] < 0.7
    (found,) = [f for f in doc["findings"] if f["cause"] == "eager_attention"]
    assert found["evidence"]["fused_measured"] is True and found["estimated_gain"] > 0.1
    # every op of the window timed by CUDA events: the attention's time is its kind's (the
    # attention inside the model's forward: ops between modules are "other" work, not the
    # model's), both scaled to the device's forward and backward seconds a step, not the
    # host's, which only launch the kernels
    timed = doc["op_time"]
    assert timed["timed_by"] == "cuda events" and timed["unresolved"] is None
    assert timed["s_per_step"]["attention"] == pytest.approx(shape["s_per_step"])
    # (an H200: the host's phases 0.7 ms a step, the device's 3.1 ms; device steps of 2.7 ms
    # by the median, 3.6 ms by the mean, the host's 2.0 ms: it ran ahead in 30 steps)
    dev = doc["device"]
    model_share = dev["breakdown"]["forward"] + dev["breakdown"]["backward"]
    assert timed["model_s_per_step"] > 0.85 * model_share * dev["median_step_s"], (timed, dev)
    # shares of the device's step, the longer: they add up to forward and backward's share
    # of it (they had summed to 1.6 of the host's)
    assert sum(timed["share_of_step"].values()) + timed["outside_ops_share_of_step"] == \
        pytest.approx(model_share, abs=0.02)
    assert timed["s_per_step"]["product"] > 0  # the projection


def test_ddp_timing_on_cuda_comes_from_its_cuda_timer(tmp_path):
    """DDP's reducer times a CUDA model with CUDA events (its CudaTimer): one NCCL rank
    in this process (a HashStore), 130 iterations, so that iteration 100 is sampled."""
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import trainprof
    from trainprof.commands import analyse
    from trainprof.store import load_run

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with trainprof.profile(tmp_path / "r", report=False):
            model = DDP(nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)]).cuda(),
                        device_ids=[0])
            opt = torch.optim.SGD(model.parameters(), lr=0.001)
            x = torch.randn(64, 1024, device="cuda")
            for _ in range(130):
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
            torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()
    doc = analyse(load_run(tmp_path / "r"))
    (m,) = doc["ddp"]
    assert (m["backend"], m["world_size"]) == ("nccl", 1)
    assert m["samples_from"] == "steady" and m["iterations"] == [100]
    assert m["backward_compute_ms"] > 0 and m["comm_ms"] > 0
    assert 0 <= m["overlap_ms"] <= m["comm_ms"]


#: A float64 model on the GPU (NumPy data, model.double()): GPUs other than the data-centre
#: parts run float64 at 1/32-1/64 of float32's rate. "compile" keeps it off the test server
#: with Dynamo imported (the compile knob runs it too).
FLOAT64_CUDA = """
# run plain, and under the float32, channels_last and compile knobs
import numpy as np
import torch
from torch import nn

rng = np.random.default_rng(0)
x = torch.from_numpy(rng.standard_normal((256, 3, 32, 32))).cuda()
y = torch.from_numpy(rng.integers(0, 10, 256)).cuda()
model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                      nn.Flatten(), nn.Linear(32, 10)).double().cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loss_fn = nn.CrossEntropyLoss()
for step in range(40):
    loss = loss_fn(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
print("LOSS", f"{loss.item():.3f}", next(model.parameters()).dtype, flush=True)
"""


def test_a_float64_model_on_the_gpu_is_found_and_the_model_knobs_run_on_cuda(tp):
    """The float64 finding on a CUDA run claims the device's whole float64 share; the
    float32, channels_last and compile knobs convert and compile a CUDA model."""
    from trainprof.store import load_run

    res = tp(FLOAT64_CUDA, "--json", "--no-html", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = res.json()
    (f,) = [f for f in doc["findings"] if f["cause"] == "float64"]
    assert f["evidence"]["device"] == "GPU" and f["evidence"]["float64_flop_share"] == 1.0
    knobs = {"float32": True, "channels_last": True, "compile": "true"}
    res = tp(FLOAT64_CUDA, "--json", "--no-html", timeout=300,
             env={"TRAINPROF_KNOBS": json.dumps(knobs)})
    assert res.returncode == 0, res.stderr[-3000:]
    # under --json the script's stdout goes to stderr
    assert "torch.float32" in next(x for x in res.stderr.splitlines() if x.startswith("LOSS"))
    process = load_run(res.run_dir).meta["knobs"]["process"]
    assert process["float32"]["modules"] == 1 and process["float32"]["inputs"] == 40
    assert process["channels_last"]["modules"] >= 1
    assert process["compile"]["errors"] == {} and process["compile"]["modules"] == 1
    assert not [f for f in res.json()["findings"] if f["cause"] == "float64"]


#: A GPU-bound loop whose host only launches (a few kernels a step, 1 ms of device sleep)
#: and reads the loss every 10 steps: there it waits for the steps the device ran meanwhile.
LOSS_EVERY_10 = """
import torch
from torch import nn

model = nn.Linear(256, 256).cuda()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(64, 256, device="cuda")
for step in range(400):
    torch.cuda._sleep(2_000_000)  # ~1 ms on the device
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 10 == 0:
        print(f"step {step} loss {loss.item():.4f}")
torch.cuda.synchronize()
"""


def test_a_loss_read_every_10_steps_is_the_host_catching_up_not_periodic_work(tp):
    """The host runs ahead of the device and waits at each `loss.item()` for the steps the
    device ran at its usual pace: no periodic finding (logging less often would save
    nothing), and the summary says the host ran ahead, with the device's median step.
    (Written after the 2026-11-28 H200 lease; first run on the next GPU lease.)"""
    res = tp(LOSS_EVERY_10, "--json", "--no-html", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = res.json()
    assert doc["device"]["median_step_s"] > 1.5 * doc["steps"]["median_s"], (
        doc["device"], doc["steps"])
    assert any("ran ahead of the GPU" in n for n in doc["notes"]), doc["notes"]
    assert not [f for f in doc["findings"] if f["category"] == "periodic_overhead"], [
        (f["cause"], f["title"]) for f in doc["findings"]]
