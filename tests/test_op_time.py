"""Every op's time in the op count's window, by phase and kind, and the fusion hint."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_compute_efficiency import _counted
from torch import nn

from trainprof.analysis.ops import summarize_op_time
from trainprof.capture.op_time import kind_of


def test_ops_are_timed_by_kind_and_the_fusable_ones_by_name():
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8))
    x = torch.randn(512, 64)
    count = _counted(lambda: model(x).square().mean().backward())
    timed = count.op_clock.per_step(1)
    model_ns = timed["model"]  # no recorder here: every op is the model's
    assert model_ns["product"] > 0 and model_ns["fusable"] > 0 and model_ns["view"] > 0
    assert "other" not in timed and timed["timed_by"] == "clock"
    names = [o["op"] for o in timed["fusable_ops"]]
    assert {"gelu", "gelu_backward", "native_layer_norm", "native_layer_norm_backward"} <= set(
        names)
    assert [o["s_per_step"] for o in timed["fusable_ops"]] == sorted(
        (o["s_per_step"] for o in timed["fusable_ops"]), reverse=True)


def test_the_ops_on_attention_scores_are_attentions_time_not_products():
    q, k, v = (torch.randn(2, 3, 128, 16, requires_grad=True) for _ in range(3))
    count = _counted(lambda: (torch.softmax(q @ k.transpose(-2, -1) / 4, -1) @ v)
                     .sum().backward())
    timed = count.op_clock.per_step(1)
    (shape,) = count.attention.per_step(1)
    # the same clock readings: the attention record's time is the attention kind's
    assert timed["model"]["attention"] == pytest.approx(shape["s_per_step"])
    assert "product" not in timed["model"]  # the only products were the scores'


def test_the_kind_of_an_op():
    import torch.utils.flop_counter as fc

    aten = torch.ops.aten
    registry = fc.flop_registry
    assert kind_of(aten.mm.default, aten.mm, registry) == "product"
    assert kind_of(aten.view.default, aten.view, registry) == "view"
    assert kind_of(aten.detach.default, aten.detach, registry) == "view"
    assert kind_of(aten.empty_strided.default, aten.empty_strided, registry) == "view"
    assert kind_of(aten.add.Tensor, aten.add, registry) == "fusable"
    assert kind_of(aten.native_layer_norm.default, aten.native_layer_norm, registry) == "fusable"


def test_the_summary_gives_each_kind_its_share_of_the_model_and_of_the_step():
    ops = {"op_time_per_step": {"model": {"product": 0.006, "fusable": 0.012, "view": 0.002},
                                "other": {"fusable": 0.004},
                                "fusable_ops": [{"op": "gelu", "s_per_step": 0.005}],
                                "timed_by": "clock"}}
    timed = summarize_op_time(ops, 0.04)
    assert timed["model_s_per_step"] == pytest.approx(0.02)
    assert timed["share_of_model"] == pytest.approx({"product": 0.3, "fusable": 0.6,
                                                     "view": 0.1})
    assert timed["share_of_step"]["fusable"] == pytest.approx(0.3)  # the window's seconds
    # with the steady steps' breakdown: the window's split of forward and backward's share
    timed = summarize_op_time(ops, 0.04, {"forward": 0.2, "backward": 0.3, "other": 0.5})
    assert timed["share_of_step"]["fusable"] == pytest.approx(0.6 * 0.5)
    assert timed["share_of_step"]["product"] == pytest.approx(0.3 * 0.5)
    assert summarize_op_time({}, 0.04) is None and summarize_op_time(ops, None) is None


def _finding(share_of_model: float, share_of_step: float, compiled: bool = False,  # noqa: ANN202
             loops: list | None = None):
    from trainprof.diagnosis.context import Context
    from trainprof.diagnosis.fusion import unfused_ops

    model = 0.02
    timed = {"model_s_per_step": model,
             "s_per_step": {"product": model * (1 - share_of_model),
                            "fusable": model * share_of_model},
             "share_of_model": {"fusable": share_of_model},
             "share_of_step": {"fusable": share_of_step},
             "fusable_ops": [{"op": "gelu", "s_per_step": 0.004}], "timed_by": "clock"}
    summary = {"op_time": timed, "ops": {"compiled": compiled, "loops": loops or []},
               "command": ["py", "t.py"]}
    return unfused_ops(Context(summary, None))


def test_the_fusion_hint_claims_no_gain_and_names_the_compile_knob():
    f = _finding(0.6, 0.3)
    assert (f.category, f.cause, f.severity, f.estimated_gain) == (
        "compute", "unfused_ops", "low", 0.0)
    assert f.evidence["gain_unknown"] and f.evidence["top_ops"] == ["gelu"]
    assert f.verify.startswith("trainprof tune --knob compile=false,true t.py")
    assert "gelu 4.0 ms" in f.fix.text
    assert _finding(0.3, 0.3) is None  # the products hold most of the model's op time
    assert _finding(0.6, 0.1) is None  # the model's ops are a small part of the step
    assert _finding(0.6, 0.3, compiled=True) is None  # compiled already
    assert _finding(0.6, 0.3, loops=[{"line": 3}]) is None  # a Python loop's small ops


MLP = """
import torch
from torch import nn

torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(w), nn.Linear(w, 4 * w), nn.Linear(4 * w, w)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln(x))))


model = nn.Sequential(*[Block(16) for _ in range(4)], nn.LayerNorm(16), nn.Linear(16, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
x, y = torch.randn(8192, 16), torch.randint(0, 10, (8192,))
for _ in range(24):
    opt.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
"""


def test_a_run_times_its_ops_by_phase_and_kind(tp, tmp_path):
    res = tp(MLP, "--json", "--no-html", timeout=240)
    assert res.returncode == 0, res.stderr
    doc = res.json()
    ops = json.loads((res.run_dir / "ops.json").read_text())["op_time_per_step"]
    # the optimizer's per-tensor updates and zero_grad are not the model's
    assert ops["other"]["fusable"] > 0 and "product" not in ops["other"]
    timed = doc["op_time"]
    assert math.isclose(sum(timed["share_of_model"].values()), 1.0)
    assert timed["s_per_step"]["fusable"] > 0 and timed["s_per_step"]["product"] > 0
    names = {o["op"] for o in timed["fusable_ops"]}
    assert {"gelu", "gelu_backward", "native_layer_norm"} <= names
    # the window gives the split, the steady steps forward and backward's share of the step
    model = doc["breakdown"]["forward"] + doc["breakdown"]["backward"]
    assert timed["share_of_step"]["fusable"] == pytest.approx(
        timed["share_of_model"]["fusable"] * model)
    # the summary's row and the HTML report's tile
    from trainprof.commands import analyse_folder, write_html
    from trainprof.report.terminal import op_time_text
    from trainprof.store import load_run

    assert " a step in torch's ops: products " in op_time_text(timed)
    summary, _ = analyse_folder(res.run_dir)
    page = write_html(summary, load_run(res.run_dir), tmp_path / "report.html").read_text()
    assert "model ops fusable" in page and "pointwise/reductions/norms" in page
    found = [f for f in doc["findings"] if f["cause"] == "unfused_ops"]
    shares = timed["share_of_model"]["fusable"], timed["share_of_step"]["fusable"]
    assert bool(found) == (shares[0] >= 0.4 and shares[1] >= 0.2)
