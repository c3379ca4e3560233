"""FLOPs of a step by kind, the machine's measured matmul peak, and the FLOPs utilization."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from trainprof.analysis.compute_efficiency import compute_efficiency
from trainprof.capture import peak_flops
from trainprof.capture.flop_count import FlopCount
from trainprof.report.terminal import compute_text, fmt_flops
from trainprof.store import load_run


def _mlp_flops(batch: int, dims: list[int]) -> float:
    """Forward, weight gradients, and input gradients of every layer but the first (its
    input needs none): 2 x batch x (in x out) each."""
    pairs = [a * b for a, b in zip(dims, dims[1:], strict=False)]
    return 2.0 * batch * (2 * sum(pairs) + sum(pairs[1:]))


def _counted(fn) -> FlopCount:  # noqa: ANN001
    count = FlopCount()
    count.start()
    try:
        fn()
    finally:
        count.stop()
    return count


def test_forward_and_backward_flops_are_counted_by_the_dtype_they_ran_in():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

    def step() -> None:
        nn.functional.cross_entropy(model(x), y).backward()

    count = _counted(step)
    assert count.by_kind == {"cpu float32": _mlp_flops(32, [64, 128, 10])}
    assert count.errors == {}

    def autocast_step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()

    # autocast casts before the product: the same FLOPs, computed in bfloat16
    assert _counted(autocast_step).by_kind == {"cpu bfloat16": _mlp_flops(32, [64, 128, 10])}
    # under no_grad only the forward counts
    with torch.no_grad():
        count = _counted(lambda: model(x))
    assert count.by_kind == {"cpu float32": 2.0 * 32 * (64 * 128 + 128 * 10)}


def test_convolutions_and_the_cpus_attention_kernel_are_counted():
    conv = nn.Conv2d(3, 8, 3, padding=1)
    x = torch.randn(4, 3, 16, 16)
    forward = 2.0 * 4 * 16 * 16 * conv.weight.numel()
    # forward and the weight gradient (the input needs none); the bias's adds are not counted
    assert _counted(lambda: conv(x).sum().backward()).by_kind == {"cpu float32": 2 * forward}
    q = torch.randn(2, 4, 10, 8, requires_grad=True)
    k, v = torch.randn(2, 4, 10, 8), torch.randn(2, 4, 10, 8)
    count = _counted(
        lambda: nn.functional.scaled_dot_product_attention(q, k, v).sum().backward())
    attention = 2 * (2.0 * 2 * 4 * 10 * 10 * 8)  # Q K^T and (softmax) V
    # torch's formula for attention's backward: 2.5 times its forward
    assert count.by_kind == {"cpu float32": attention * 3.5}


def test_fused_recurrent_layers_are_counted_as_products():
    """An nn.LSTM on the CPU runs as mkldnn_rnn_layer, one call per layer and direction:
    its gate products had counted nothing, and its kernels were timed as pointwise ops."""
    torch.manual_seed(0)
    lstm = nn.LSTM(32, 64, num_layers=2, batch_first=True, bidirectional=True)
    x = torch.randn(8, 20, 32)
    count = _counted(lambda: lstm(x)[0].sum().backward())
    rows = 8 * 20
    layer1 = 2.0 * rows * 256 * (32 + 64)  # 4 gates of 64; the input's 32 and the state's 64
    layer2 = 2.0 * rows * 256 * (128 + 64)  # the first layer's two directions in
    forward = 2 * (layer1 + layer2)  # two directions
    assert count.by_kind == {"cpu float32": pytest.approx(3 * forward)}  # + backward, twice
    assert count.errors == {}
    assert not [op for op in count.op_clock.fusable_ns if "rnn" in op]
    assert count.op_clock.ns[("model", "product")] > 0


def test_cudnns_flat_weights_give_each_layers_gate_products():
    from trainprof.capture.flop_count import _rnn_formulas

    formulas = {str(op): f for op, f in _rnn_formulas(torch.ops.aten).items()}
    x = torch.empty(20, 8, 32, device="meta")  # (T, B, in)
    w = [torch.empty(*shape, device="meta") for shape in
         [(256, 32), (256, 64), (256,), (256,),  # layer 1: w_ih, w_hh, b_ih, b_hh
          (256, 64), (256, 64), (256,), (256,)]]  # layer 2
    forward = 2.0 * 160 * 256 * (32 + 64) + 2.0 * 160 * 256 * (64 + 64)
    assert formulas["aten._cudnn_rnn"](x, w, 4) == forward
    assert formulas["aten._cudnn_rnn_backward"](x, w, 4) == 2 * forward
    # a projection (proj_size 16, with biases: 5 tensors a layer): w_hh is 4H x 16
    w = [torch.empty(*shape, device="meta") for shape in
         [(256, 32), (256, 16), (256,), (256,), (16, 64)]]
    assert formulas["aten._cudnn_rnn"](x, w, 5) == (
        2.0 * 160 * 256 * (32 + 16) + 2.0 * 160 * 16 * 64)


def test_utilization_divides_each_kind_by_its_own_peak():
    ops = {"flops_by_kind_per_step": {"cpu bfloat16": 8e9, "cpu float32": 1e9},
           "steps_sampled": 2}
    peaks = {"cpu bfloat16": {"flops_per_s": 800e9, "source": "cache"},
             "cpu float32": {"flops_per_s": 200e9, "source": "measured"}}
    out = compute_efficiency(ops, peaks, 0.05, {"forward": 0.2, "backward": 0.3})
    assert out is not None
    assert out["flops_per_step"] == 9e9 and out["flops_per_s"] == pytest.approx(180e9)
    # 8e9 / 800e9 + 1e9 / 200e9 = 15 ms at peak, in a 50 ms step
    assert out["ideal_step_s"] == pytest.approx(0.015)
    assert out["utilization"] == pytest.approx(0.3)
    assert out["model_utilization"] == pytest.approx(0.6)  # 15 ms of the 25 ms of the model
    assert [k["kind"] for k in out["kinds"]] == ["cpu bfloat16", "cpu float32"]
    text = compute_text(out)
    assert text == ("9 GFLOP a step · 180 GFLOP/s · 30% of the peak torch.mm reaches here "
                    "(cpu bfloat16: 800 GFLOP/s, cpu float32: 200 GFLOP/s) · "
                    "forward+backward at 60%")
    # a kind with most of the FLOPs and no peak: no utilization, and the row says so
    peaks.pop("cpu bfloat16")
    out = compute_efficiency(ops, peaks, 0.05, {"forward": 0.5})
    assert out["utilization"] is None and out["peak_covered_share"] == pytest.approx(1 / 9)
    assert compute_text(out).endswith("no measured peak to compare with")
    assert compute_efficiency({"flops_by_kind_per_step": {}}, peaks, 0.05, None) is None
    assert compute_efficiency(None, peaks, 0.05, None) is None
    assert fmt_flops(1.5e12) == "1.5 TFLOP" and fmt_flops(999.0) == "999 FLOP"


def test_the_peak_is_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(peak_flops.CACHE_ENV, str(tmp_path))
    # a rank of a launch never measures the CPU's
    out = peak_flops.peaks(torch, ["cpu float32"], may_measure={"cuda"})
    assert out["cpu float32"]["error"].startswith("not measured")
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    first = peak_flops.peaks(torch, ["cpu float32"], may_measure={"cpu"})["cpu float32"]
    assert torch.equal(torch.rand(3), expected)  # the process's random stream untouched
    assert first["source"] == "measured" and first["repeats"] >= peak_flops.MIN_REPEATS
    # a 1024-square product in float32 on any CPU that runs torch: well above 1 GFLOP/s
    assert first["flops_per_s"] > 1e9 and first["matrix"] == 1024
    cached = json.loads((tmp_path / peak_flops.CACHE_FILE).read_text())
    assert list(cached) == [first["key"]]
    assert f"{torch.get_num_threads()} threads" in first["key"]

    def no_measuring(*args, **kwargs):  # noqa: ANN002, ANN003
        raise AssertionError("measured again")

    monkeypatch.setattr(peak_flops, "measure", no_measuring)
    again = peak_flops.peaks(torch, ["cpu float32"], may_measure={"cpu"})["cpu float32"]
    assert again["source"] == "cache" and again["flops_per_s"] == first["flops_per_s"]
    # a dtype torch cannot multiply here is an error entry, not a failure
    monkeypatch.undo()
    monkeypatch.setenv(peak_flops.CACHE_ENV, str(tmp_path))
    out = peak_flops.peaks(torch, ["cpu no_such_dtype"], may_measure={"cpu"})
    assert out["cpu no_such_dtype"]["error"].startswith("AttributeError")


TRAIN = """
import sys
import torch
from torch import nn

width = int(sys.argv[1])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                      nn.Linear(width, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
for step in range(40):
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_a_run_reports_its_flops_and_how_near_the_peak_they_ran(tp, tmp_path):
    wide = tp(TRAIN, "--json", "--no-html", args=("1024",))
    assert wide.returncode == 0, wide.stderr
    compute = wide.json()["compute"]
    assert compute["flops_per_step"] == _mlp_flops(16, [32, 1024, 1024, 4])
    (kind,) = compute["kinds"]
    assert kind["kind"] == "cpu float32" and kind["peak_flops_per_s"] > 1e9
    peak = load_run(wide.run_dir).meta["peak_flops"]["cpu float32"]
    assert peak["flops_per_s"] == kind["peak_flops_per_s"]
    assert peak["source"] in ("measured", "cache")  # another test may have measured it
    assert 0 < compute["utilization"] <= compute["model_utilization"] < 1.5
    narrow = tp(TRAIN, "--no-html", args=("8",))
    assert narrow.returncode == 0, narrow.stderr
    assert "\nCompute      " in narrow.stdout + narrow.stderr
    small = load_run(narrow.run_dir)
    from trainprof.commands import analyse_folder, write_html

    summary, _ = analyse_folder(narrow.run_dir)
    assert small.meta["peak_flops"]["cpu float32"]["source"] == "cache"
    # 8-wide layers keep the cores busy with overheads: a fraction of the wide net's rate
    assert summary["compute"]["utilization"] < compute["utilization"] / 3
    page = write_html(summary, small, tmp_path / "report.html").read_text()
    assert "FLOPs utilization" in page and "of the peak torch.mm reaches here" in page
    # compare shows both: the work a step does and how near the peak it ran
    import io

    from trainprof.analysis.compare import compare_runs
    from trainprof.report.compare_terminal import render_compare

    result = compare_runs(load_run(wide.run_dir), small)
    assert result["a"]["compute"]["flops_per_step"] == compute["flops_per_step"]
    assert result["b"]["compute"]["flops_per_step"] == _mlp_flops(16, [32, 8, 8, 4])
    out = io.StringIO()
    render_compare(result, file=out)
    assert "FLOPs utilization" in out.getvalue() and "FLOPs/step" in out.getvalue()


LATE_COMPILE = """
# a model first called compiled at step 8, inside the op count's window
import torch
import torch._dynamo.utils as dynamo_utils
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
compiled = torch.compile(model, backend="eager")
x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
for step in range(20):
    loss = nn.functional.cross_entropy((model if step < 8 else compiled)(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
print("BREAKS", [k.splitlines()[0] + " " + k.splitlines()[1]
                 for k in dynamo_utils.counters["graph_break"]])
"""


def test_a_model_first_compiled_inside_the_window_is_compiled_and_its_flops_counted(tp):
    """Dynamo compiling under the op count's modes: the FLOP mode steps aside while it
    compiles (before, Dynamo skipped the frame for good: the model never compiled), and
    the call counter hands Dynamo the bare call (before, it traced the frame walk and
    broke the graph at every op, warning about sys._getframe)."""
    res = tp(LATE_COMPILE, "--json", "--no-html")
    assert res.returncode == 0, res.stderr
    assert "_getframe" not in res.stdout + res.stderr
    breaks = next(x for x in (res.stdout + res.stderr).splitlines() if x.startswith("BREAKS"))
    assert "_getframe" not in breaks and "startswith" not in breaks
    meta = load_run(res.run_dir).meta
    assert meta["compiled_frames"] >= 1
    ops = json.loads((res.run_dir / "ops.json").read_text())
    assert not ops.get("compiled") and ops["calls_per_step"] > 0  # counted as it opened
    assert ops["flops_by_kind_per_step"] == {"cpu float32": _mlp_flops(16, [32, 64, 4])}
    assert res.json()["compute"]["flops_per_step"] == _mlp_flops(16, [32, 64, 4])


def test_on_a_listed_gpu_the_mfu_is_against_its_datasheet():
    from trainprof.analysis.datasheet_peaks import datasheet_peak

    assert datasheet_peak("NVIDIA H100 80GB HBM3", "cuda bfloat16") == ("H100", 989.4e12)
    assert datasheet_peak("NVIDIA H100 PCIe", "cuda float32 tf32") == ("H100 PCIE", 378e12)
    assert datasheet_peak("NVIDIA A100-SXM4-80GB", "cuda float16") == ("A100", 312e12)
    assert datasheet_peak("NVIDIA L4", "cuda bfloat16") == ("L4", 121e12)
    assert datasheet_peak("NVIDIA L40S", "cuda bfloat16") == ("L40S", 362e12)
    assert datasheet_peak("NVIDIA A10", "cuda float32") == ("A10", 31.2e12)
    # no bfloat16 on a V100; an A10G, an H100 NVL, a CPU: no figure
    assert datasheet_peak("Tesla V100-SXM2-32GB", "cuda bfloat16") is None
    assert datasheet_peak("NVIDIA A10G", "cuda bfloat16") is None
    assert datasheet_peak("NVIDIA H100 NVL", "cuda bfloat16") is None
    assert datasheet_peak(None, "cpu float32") is None
    ops = {"flops_by_kind_per_step": {"cuda bfloat16": 98.94e12, "cuda float32": 1e9}}
    peaks = {"cuda bfloat16": {"flops_per_s": 700e12, "source": "measured"},
             "cuda float32": {"flops_per_s": 50e12, "source": "measured"}}
    out = compute_efficiency(ops, peaks, 0.5, {"forward": 0.3, "backward": 0.6},
                             gpu_name="NVIDIA H100 80GB HBM3")
    # 0.1 s at the datasheet's 989.4 TFLOP/s (and 1 GFLOP at 67) in a 0.5 s step
    assert out["datasheet_utilization"] == pytest.approx((0.1 + 1e9 / 67e12) / 0.5)
    assert out["utilization"] == pytest.approx((98.94e12 / 700e12 + 1e9 / 50e12) / 0.5)
    assert compute_text(out).endswith("· MFU 20% of the H100 datasheet's dense peak")
    # no measured peak (a rank of a launch): the datasheet's MFU still stands
    out = compute_efficiency(ops, {}, 0.5, None, gpu_name="NVIDIA H100 80GB HBM3")
    assert out["utilization"] is None and out["datasheet_utilization"] is not None
    assert "no measured peak" not in compute_text(out)


def test_a_mig_slice_has_no_datasheet_figure():
    from trainprof.analysis.datasheet_peaks import datasheet_peak

    assert datasheet_peak("NVIDIA A100-SXM4-40GB MIG 1g.5gb", "cuda bfloat16") is None
    assert datasheet_peak("NVIDIA H100 80GB HBM3", "cuda bfloat16", 16) is None  # 1g of 7
    assert datasheet_peak("NVIDIA H100 80GB HBM3", "cuda bfloat16", 132) == ("H100", 989.4e12)


SMALL_BATCH = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
data = TensorDataset(torch.randn(4096, 64), torch.randint(0, 10, (4096,)))
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                      nn.Linear(128, 10))
# fused: the for-loop update would hold half the step, leaving forward and backward near the
# rule's 30% (a CI run fell under it)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
for x, y in DataLoader(data, batch_size=16, shuffle=True):
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_a_step_far_from_the_peak_in_small_operations_gets_a_batch_size_sweep(tp):
    res = tp(SMALL_BATCH, "--json", "--no-html")
    assert res.returncode == 0, res.stderr
    doc = res.json()
    (finding,) = [f for f in doc["findings"] if f["cause"] == "small_batch"]
    ev = finding["evidence"]
    assert ev["batch_size"] == 16 and ev["gain_unknown"] is True
    assert ev["utilization"] == pytest.approx(doc["compute"]["utilization"], rel=1e-3)
    assert ev["utilization"] < 0.15 and ev["model_utilization"] < 0.25
    assert finding["severity"] == "low" and finding["estimated_gain"] == 0.0
    assert finding["verify"].startswith("trainprof tune --knob batch_size=16,32,64 train.py")
    assert "torch.optim.AdamW(model.parameters(), lr=lr * 32 / 16)" in finding["fix"]["snippet"]


def _context(utilization: float, model: float, **parts):  # noqa: ANN003, ANN202
    from test_diagnosis import loader, make_steps, make_summary

    from trainprof.diagnosis.context import Context

    steps = make_steps(60, **parts.pop("phases", {}))
    given = {"dataloaders": [loader(batch_size=8)], "ops": {"loops": []},
             "compute": {"utilization": utilization, "model_utilization": model,
                         "flops_per_step": 1e6}}
    summary = make_summary(steps, **{**given, **parts})
    return Context(summary, steps)


def test_the_batch_finding_keeps_out_of_the_way_of_other_causes():
    from trainprof.diagnosis.small_batch import far_from_peak

    MS = 1e-3
    found = far_from_peak(_context(0.05, 0.08))
    assert found is not None and found.evidence["batch_size"] == 8
    assert "batch_size=8,16,32" in found.verify
    # near enough to the peak, in the step or in the model's phases
    assert far_from_peak(_context(0.2, 0.08)) is None
    assert far_from_peak(_context(0.05, 0.3)) is None
    # the input pipeline holds the step: a larger batch would wait longer
    assert far_from_peak(_context(0.05, 0.08, phases={"data": 20 * MS})) is None
    # the step's time is the loop's own (a sleep, logging), not the model's
    assert far_from_peak(_context(0.05, 0.08, phases={"other": 30 * MS})) is None
    # a Python loop makes the small ops: its own finding
    assert far_from_peak(_context(0.05, 0.08, ops={"loops": [{"line": 3}]})) is None
    # no DataLoader batch size to sweep; no FLOPs utilization at all
    assert far_from_peak(_context(0.05, 0.08, dataloaders=[])) is None
    assert far_from_peak(_context(0.05, 0.08, compute=None)) is None


def test_a_dtype_too_slow_to_repeat_is_timed_by_its_warm_up(monkeypatch):
    """A product that alone takes the whole budget (float16 on a CPU without it) is not
    repeated: the measurement stays within about twice the budget."""
    import time as time_mod

    calls = []

    def slow_mm(a, b, out=None):  # noqa: ANN001, ANN202
        calls.append(1)
        time_mod.sleep(0.05)
        return out

    monkeypatch.setattr(torch, "mm", slow_mm)
    t0 = time_mod.perf_counter()
    out = peak_flops.measure(torch, "cpu float32", budget_s=0.05)
    assert time_mod.perf_counter() - t0 < 0.5
    assert out["repeats"] <= 1 and len(calls) <= 2
    # the matrix's size follows the threads (1024 on a few cores)
    assert out["flops_per_s"] == pytest.approx(2.0 * out["matrix"] ** 3 / 0.05, rel=0.5)


def test_the_batch_snippet_keeps_each_optimizers_own_parameters():
    """A recommender's SparseAdam (sparse embeddings) and Adam (the MLP): the snippet said
    ``SparseAdam(model.parameters(), ...)``, which fails on the dense gradients."""
    from trainprof.diagnosis.small_batch import far_from_peak

    sparse = {"class": "torch.optim.sparse_adam.SparseAdam", "param_tensors": 3,
              "numel": 44_800_000}
    dense = {"class": "torch.optim.adam.Adam", "param_tensors": 6, "numel": 61_185}
    found = far_from_peak(_context(0.05, 0.08, optimizers=[sparse, dense]))
    assert found is not None
    snippet = found.fix.snippet
    assert "model.parameters()" not in snippet
    assert "opt1 = torch.optim.SparseAdam(params1, lr=lr1 * 16 / 8)" in snippet
    assert "opt2 = torch.optim.Adam(params2, lr=lr2 * 16 / 8)" in snippet
    assert "over the parameters it has now" in snippet
    # one optimizer: over the model's parameters, as most scripts build it
    found = far_from_peak(_context(0.05, 0.08, optimizers=[dense]))
    assert "opt = torch.optim.Adam(model.parameters(), lr=lr * 16 / 8)" in found.fix.snippet
