"""Convolutions in NCHW on a CPU: counted with their FLOPs, diagnosed, and the knob that
converts the model and its inputs to channels_last (NHWC)."""

from __future__ import annotations

import json

import pytest
import torch
from test_diagnosis import MS, make_steps, make_summary
from torch import nn

from trainprof.analysis.compare import compare_runs
from trainprof.capture import channels_last_knob
from trainprof.capture.knobs import ENV_VAR, Knobs, parse_value
from trainprof.capture.opcount import _conv2d_flops
from trainprof.diagnosis import diagnose
from trainprof.diagnosis.channels_last_cpu import SAVING
from trainprof.errors import UsageError
from trainprof.experiments import tune as tune_mod
from trainprof.store import load_run

CONVNET = """
import torch
from torch import nn

torch.manual_seed(0)
c = 16
model = nn.Sequential(
    nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
    nn.Conv2d(c, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
    nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(),
    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * c, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
for step in range(30):
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
w = model[0].weight
print("FORMAT", w.is_contiguous(memory_format=torch.channels_last), flush=True)
"""

#: Forward FLOPs of CONVNET's three convolutions and its Linear layer, a step.
CONV_FLOPS = 2 * 16 * (32 * 32 * 16 * 3 * 9 + 32 * 32 * 16 * 16 * 9 + 16 * 16 * 32 * 16 * 9)
LINEAR_FLOPS = 2 * 16 * 32 * 10


def _line(res, tag: str) -> str:
    return next(x for x in (res.stdout + res.stderr).splitlines() if x.startswith(tag))


def test_a_cpu_conv_net_in_nchw_gets_channels_last_and_the_knob_clears_it(tp):
    res = tp(CONVNET, "--json")
    assert res.returncode == 0, res.stderr
    assert _line(res, "FORMAT") == "FORMAT False"
    doc = res.json()
    ops = doc["ops"]
    assert (ops["conv2d_per_step"], ops["conv2d_channels_last_per_step"]) == (3, 0)
    assert ops["cpu_conv2d_flops_per_step"] == CONV_FLOPS
    assert ops["cpu_nchw_conv2d_flops_per_step"] == CONV_FLOPS
    assert ops["cpu_fp32_matmul_flops_per_step"] == LINEAR_FLOPS
    assert doc["environment"]["cpu_onednn"] is True
    (f,) = [f for f in doc["findings"] if f["cause"] == "channels_last"]
    ev = f["evidence"]
    assert ev["nchw_conv_flop_share"] == pytest.approx(
        CONV_FLOPS / (CONV_FLOPS + LINEAR_FLOPS), abs=1e-4)  # (evidence: 4 digits)
    assert f["estimated_gain"] == pytest.approx(
        ev["model_share"] * SAVING * ev["nchw_conv_flop_share"], abs=1e-3)
    assert f["category"] == "compute" and f["severity"] in ("medium", "low")
    assert "--knob channels_last=false,true" in f["verify"]

    knobbed = tp(CONVNET, "--json", env={ENV_VAR: json.dumps({"channels_last": True})})
    assert knobbed.returncode == 0, knobbed.stderr
    # converted in place: the script's own reference to the weight sees NHWC
    assert _line(knobbed, "FORMAT") == "FORMAT True"
    ops = knobbed.json()["ops"]
    assert (ops["conv2d_per_step"], ops["conv2d_channels_last_per_step"]) == (3, 3)
    assert ops["cpu_nchw_conv2d_flops_per_step"] == 0
    assert not [f for f in knobbed.json()["findings"] if f["cause"] == "channels_last"]
    meta = load_run(knobbed.run_dir).meta
    # the model and... only the model: the loss is a function, not a module
    assert meta["knobs"]["process"]["channels_last"] == {
        "value": True, "modules": 1, "calls": 30, "inputs": 30, "skipped": {}}
    assert tune_mod._actual("channels_last", meta) == "true (1 module converted, 30 inputs)"
    # trainprof compare names the change in how the model computed
    diff = compare_runs(load_run(res.run_dir), load_run(knobbed.run_dir))["environment_diff"]
    # (which phase it is ranked on follows the phases that changed: timing, not tested here)
    (fact,) = [d for d in diff if d["key"] == "model.convolutions_nhwc"]
    assert (fact["a"], fact["b"], fact["category"]) == ("0%", "100%", "model")


def test_the_knob_converts_in_place_both_ways_and_is_undone():
    call = nn.Module.__dict__["__call__"]
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 1))
    weight = model[0].weight
    knobs = Knobs({"channels_last": True}).install()
    try:
        out = model(torch.randn(2, 3, 8, 8))
        assert model[0].weight is weight  # the optimizer's Parameter, converted in place
        assert weight.is_contiguous(memory_format=torch.channels_last)
        assert out.is_contiguous(memory_format=torch.channels_last)
        nhwc = torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)
        model(nhwc)  # already NHWC: not counted again
    finally:
        record = knobs.uninstall()
    assert nn.Module.__dict__["__call__"] is call
    assert record["process"]["channels_last"] == {
        "value": True, "modules": 1, "calls": 2, "inputs": 1, "skipped": {}}
    # false: NCHW whatever the script chose
    rec: dict = {}
    undo = channels_last_knob.install(False, rec)
    try:
        out = model(nhwc)
    finally:
        undo()
    assert weight.is_contiguous() and out.is_contiguous()
    assert rec["inputs"] == 1 and rec["modules"] == 1
    assert parse_value("channels_last", "yes") is True
    with pytest.raises(UsageError, match="channels_last"):
        parse_value("channels_last", "nhwc")


@pytest.mark.parametrize("conv,side", [
    (nn.Conv2d(3, 8, 3, padding=1), 16),
    (nn.Conv2d(8, 8, 3, stride=2, groups=8), 17),  # depthwise, strided
    (nn.Conv2d(3, 4, 5, padding="same"), 9),
    (nn.Conv2d(3, 4, 3, padding="valid", dilation=2), 12),
    (nn.Conv2d(3, 4, (3, 1), stride=(2, 1), padding=(1, 0)), 10),
])
def test_convolution_flops_follow_the_output_shape(conv, side):
    x = torch.randn(2, conv.in_channels, side, side)
    out = conv(x)
    want = 2 * out.shape[0] * out.shape[2] * out.shape[3] * conv.weight.numel()
    args = (x, conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation, conv.groups)
    assert _conv2d_flops(args, None) == want
    assert _conv2d_flops((x, conv.weight), {"stride": conv.stride, "padding": conv.padding,
                                            "dilation": conv.dilation}) == want
    assert _conv2d_flops((torch.randn(3, 8, 8), conv.weight), None) is None  # no batch


def _summary(nhwc: float = 0.0, conv_flops: float = 3e9, nchw_flops: float = 3e9,
             matmul_flops: float = 1e9, onednn: bool | None = True, data: float = 0.5):
    steps = make_steps(60, data=data * MS, forward=3 * MS, backward=5 * MS,
                       optimizer=1.5 * MS)
    summary = make_summary(steps)
    summary["environment"]["cpu_onednn"] = onednn
    summary["ops"] = {"conv2d_per_step": 4.0, "conv2d_channels_last_per_step": nhwc,
                      "cpu_conv2d_flops_per_step": conv_flops,
                      "cpu_nchw_conv2d_flops_per_step": nchw_flops,
                      "cpu_fp32_matmul_flops_per_step": matmul_flops}
    return summary, steps


def _findings(summary, steps):
    """The CPU rule's findings (the GPU rule has the same cause)."""
    return [f for f in diagnose(summary, steps)
            if f["cause"] == "channels_last" and "on the CPU" in f["title"]]


def test_the_bound_is_the_model_share_times_the_saving_times_the_nchw_flop_share():
    (f,) = _findings(*_summary())
    model = f["evidence"]["model_share"]
    assert model == pytest.approx(0.8, abs=0.02)  # (3 + 5) of 10 ms
    assert f["estimated_gain"] == pytest.approx(model * SAVING * 0.75, abs=1e-4)
    assert f["severity"] == "medium"  # 18%: never high, it can lose
    assert "memory_format=torch.channels_last" in f["fix"]["snippet"]
    # a conv stem before matrix products that hold most of the FLOPs: 0.2%, nothing said
    assert not _findings(*_summary(conv_flops=1e8, nchw_flops=1e8, matmul_flops=9.9e9))
    # a third of the FLOPs: 8%
    (f,) = _findings(*_summary(conv_flops=1e9, nchw_flops=1e9, matmul_flops=2e9))
    assert f["estimated_gain"] == pytest.approx(model * SAVING / 3, abs=1e-4)


def test_nhwc_no_onednn_cuda_or_an_input_bound_loop_get_nothing():
    assert not _findings(*_summary(nhwc=4.0, nchw_flops=0.0))
    assert not _findings(*_summary(onednn=False))
    assert not _findings(*_summary(onednn=None))  # a record from before the field
    assert not _findings(*_summary(data=20.0))  # the input pipeline's finding comes first
    summary, steps = _summary()
    summary["device"] = {"breakdown": {"forward": 0.3, "backward": 0.5, "optimizer": 0.1,
                                       "gap": 0.1}}
    assert not _findings(summary, steps)  # a CUDA run: the device rule speaks
    summary, steps = _summary()
    summary["ops"] = None  # no op-count window
    assert not _findings(summary, steps)


def test_model_knobs_stack_and_come_off_in_order():
    """autocast, channels_last and float32 each wrap the outermost calls: set together, a
    call goes through all three, and uninstalling restores torch's own __call__."""
    call = nn.Module.__dict__["__call__"]
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).double()
    knobs = Knobs({"autocast": "bf16", "channels_last": True, "float32": True}).install()
    try:
        out = model(torch.randn(2, 3, 8, 8, dtype=torch.float64))
    finally:
        record = knobs.uninstall()
    assert nn.Module.__dict__["__call__"] is call
    assert out.dtype is torch.bfloat16 and out.is_contiguous(memory_format=torch.channels_last)
    assert model[0].weight.dtype is torch.float32
    process = record["process"]
    assert process["autocast"]["calls"] == process["channels_last"]["calls"] == 1
    assert process["float32"] == {"value": True, "modules": 1, "calls": 1, "inputs": 1,
                                  "skipped": {}}


@pytest.mark.parametrize("conv", [
    nn.ConvTranspose2d(8, 4, 4, stride=2, padding=1),  # a generator's upsampling
    nn.ConvTranspose2d(8, 8, 3, stride=2, padding=1, output_padding=1, groups=4),
    nn.ConvTranspose2d(3, 5, (3, 1), dilation=2),
])
def test_transposed_convolution_flops_are_torchs_own(conv):
    from torch.utils.flop_counter import FlopCounterMode

    from trainprof.capture.opcount import _conv_transpose2d_flops

    x = torch.randn(2, conv.in_channels, 7, 9)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        conv(x)
    assert _conv_transpose2d_flops((x, conv.weight, conv.bias, conv.stride), None) == (
        counter.get_total_flops())
    assert _conv_transpose2d_flops((torch.randn(8, 7, 9), conv.weight), None) is None


GENERATOR = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(
    nn.ConvTranspose2d(32, 32, 4, 2, 1), nn.ReLU(),
    nn.ConvTranspose2d(32, 16, 4, 2, 1), nn.ReLU(), nn.Conv2d(16, 3, 3, padding=1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
z = torch.randn(8, 32, 8, 8)
for step in range(24):
    loss = model(z).square().mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""


def test_a_generators_transposed_convolutions_count_for_channels_last(tp):
    res = tp(GENERATOR, "--json", "--no-html")
    assert res.returncode == 0, res.stderr
    doc = res.json()
    ops = doc["ops"]
    assert (ops["conv2d_per_step"], ops["conv2d_channels_last_per_step"]) == (3, 0)
    # 2 N H_in W_in x weight, twice, then the 3x3 convolution on 32x32
    flops = 2 * 8 * (8 * 8 * 32 * 32 * 16 + 16 * 16 * 32 * 16 * 16 + 32 * 32 * 16 * 3 * 9)
    assert ops["cpu_conv2d_flops_per_step"] == ops["cpu_nchw_conv2d_flops_per_step"] == flops
    (f,) = [f for f in doc["findings"] if f["cause"] == "channels_last"]
    assert f["evidence"]["nchw_conv_flop_share"] == pytest.approx(1.0)
