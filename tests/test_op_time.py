"""Every op's time in the op count's window, by phase and kind, and the fusion hint."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import trainprof, write_script
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
    # fused attention kernels are in torch's FLOP table, but they are attention, not products
    for op in (aten._scaled_dot_product_flash_attention_for_cpu,
               aten._scaled_dot_product_flash_attention_for_cpu_backward,
               aten._scaled_dot_product_efficient_attention,
               aten._efficient_attention_backward):
        assert kind_of(op.default, op, registry) == "fused_attention", op


def test_fused_attention_is_timed_as_its_own_kind():
    q, k, v = (torch.randn(2, 3, 128, 16, requires_grad=True) for _ in range(3))
    count = _counted(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)
                     .sum().backward())
    model = count.op_clock.per_step(1)["model"]
    assert model["fused_attention"] > 0 and "product" not in model
    assert count.attention.per_step(1) == []  # not attention computed op by op


def test_the_summary_gives_each_kind_its_share_of_the_model_and_of_the_step():
    ops = {"op_time_per_step": {"model": {"product": 0.006, "fusable": 0.012, "view": 0.002},
                                "other": {"fusable": 0.004},
                                "fusable_ops": [{"op": "gelu", "s_per_step": 0.005}],
                                "timed_by": "clock"}}
    timed = summarize_op_time(ops, 0.04)
    assert timed["model_s_per_step"] == timed["window_model_s_per_step"] == pytest.approx(0.02)
    assert timed["share_of_model"] == pytest.approx({"product": 0.3, "fusable": 0.6,
                                                     "view": 0.1})
    assert timed["share_of_step"]["fusable"] == pytest.approx(0.3)  # the window's seconds
    # with the steady steps' breakdown: the window's split of forward and backward's seconds
    # (0.5 of 40 ms: 20 ms), however long the window's own ops took (timing adds to each)
    ops["op_time_per_step"]["model"] = {"product": 0.009, "fusable": 0.018, "view": 0.003}
    ops["op_time_per_step"]["fusable_ops"] = [{"op": "gelu", "s_per_step": 0.0075}]
    timed = summarize_op_time(ops, 0.04, {"forward": 0.2, "backward": 0.3, "other": 0.5})
    assert timed["window_model_s_per_step"] == pytest.approx(0.03)
    assert timed["model_s_per_step"] == pytest.approx(0.02)
    assert timed["s_per_step"] == pytest.approx({"product": 0.006, "fusable": 0.012,
                                                 "view": 0.002})
    assert timed["fusable_ops"] == [{"op": "gelu", "s_per_step": pytest.approx(0.005)}]
    assert timed["share_of_step"]["fusable"] == pytest.approx(0.6 * 0.5)
    assert timed["share_of_step"]["product"] == pytest.approx(0.3 * 0.5)
    assert not timed["disturbed"] and timed["outside_load_cores"] is None
    assert not summarize_op_time(ops, 0.04, None, 0.3)["disturbed"]
    assert summarize_op_time(ops, 0.04, None, 0.5)["disturbed"]
    assert summarize_op_time({}, 0.04) is None and summarize_op_time(ops, None) is None


def test_the_load_other_processes_put_on_the_machine_during_some_steps():
    from trainprof.analysis.system import outside_cores_during

    # 5 Hz samples on 2 cores: our process takes 1 core throughout; from t=10 s another
    # process takes one more
    samples = [{"t": 8 + i * 0.2, "proc_cpu_pct": 100.0, "workers": {},
                "sys_cpu_pct": [100.0, 100.0] if 8 + i * 0.2 > 10.01 else [100.0, 0.0]}
               for i in range(20)]
    assert outside_cores_during(samples, [(8.5, 9.5)], 2) == pytest.approx(0.0)
    assert outside_cores_during(samples, [(10.5, 11.0)], 2) == pytest.approx(1.0)
    # a window shorter than the sampler's period still reads the sample that covers it
    assert outside_cores_during(samples, [(10.41, 10.42)], 2) == pytest.approx(1.0)
    assert outside_cores_during(samples, [(30.0, 31.0)], 2) is None  # no sample then
    assert outside_cores_during(samples, [(10.5, 11.0)], None) is None  # no core count


def _finding(share_of_model: float, share_of_step: float, compiled: bool = False,  # noqa: ANN202
             loops: list | None = None, disturbed: bool = False):
    from trainprof.diagnosis.context import Context
    from trainprof.diagnosis.fusion import unfused_ops

    model = 0.02
    timed = {"model_s_per_step": model,
             "s_per_step": {"product": model * (1 - share_of_model),
                            "fusable": model * share_of_model},
             "share_of_model": {"fusable": share_of_model},
             "share_of_step": {"fusable": share_of_step},
             "fusable_ops": [{"op": "gelu", "s_per_step": 0.004}], "timed_by": "clock",
             "disturbed": disturbed}
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
    assert _finding(0.6, 0.3, disturbed=True) is None  # other processes took the cores


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
    record = json.loads((res.run_dir / "ops.json").read_text())
    ops = record["op_time_per_step"]
    # the window's steps, whose system samples tell the load of other processes then
    assert record["window_steps"] and all(b > a for a, b in record["window_steps"])
    # the optimizer's per-tensor updates and zero_grad are not the model's
    assert ops["other"]["fusable"] > 0 and "product" not in ops["other"]
    timed = doc["op_time"]
    assert math.isclose(sum(timed["share_of_model"].values()), 1.0)
    assert timed["s_per_step"]["fusable"] > 0 and timed["s_per_step"]["product"] > 0
    names = {o["op"] for o in timed["fusable_ops"]}
    assert {"gelu", "gelu_backward", "native_layer_norm"} <= names
    # the window gives the split, the steady steps forward and backward's share of the step:
    # the kinds' shares and the time outside the ops add up to it
    model = doc["breakdown"]["forward"] + doc["breakdown"]["backward"]
    assert sum(timed["share_of_step"].values()) + timed["outside_ops_share_of_step"] == \
        pytest.approx(model)
    assert timed["share_of_step"]["fusable"] == pytest.approx(
        timed["share_of_model"]["fusable"] * (model - timed["outside_ops_share_of_step"]))
    # the summary's row and the HTML report's tile
    from trainprof.commands import analyse_folder, write_html
    from trainprof.report.terminal import op_time_text
    from trainprof.store import load_run

    assert op_time_text(timed).startswith("forward+backward ")
    assert " a step, by kind of op (share of forward+backward): products " in \
        op_time_text(timed)
    # the row's seconds are forward and backward's steady seconds, split as in the window
    assert timed["model_s_per_step"] == pytest.approx(model / doc["steps_per_s"], rel=0.05)
    assert isinstance(timed["outside_load_cores"], float)
    summary, _ = analyse_folder(res.run_dir)
    page = write_html(summary, load_run(res.run_dir), tmp_path / "report.html").read_text()
    assert "fusable ops, share of forward+backward" in page
    assert "pointwise/reductions/norms" in page
    found = [f for f in doc["findings"] if f["cause"] == "unfused_ops"]
    shares = timed["share_of_model"]["fusable"], timed["share_of_step"]["fusable"]
    assert bool(found) == (shares[0] >= 0.4 and shares[1] >= 0.2 and not timed["disturbed"])


def test_the_op_count_window_does_not_import_dynamo_for_a_script_that_never_does(tmp_path):
    """torch's wrapper of a dispatch mode's hook imports torch._dynamo at its first call:
    0.9 s in the window's step of a loop with no torch.optim and no torch.compile (an
    explorer's manual-update loop stalled 921 ms at its step 64)."""
    write_script(tmp_path, "train.py", """
        import sys, time
        import torch
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 1))
        slowest = 0.0
        for i in range(120):
            t0 = time.perf_counter()
            loss = model(torch.randn(16, 32)).square().mean()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.01 * p.grad
                    p.grad = None
            slowest = max(slowest, time.perf_counter() - t0)
        print("dynamo", "torch._dynamo" in sys.modules, "slowest", slowest)
        """)
    res = trainprof("run", "--json", "--no-html", "train.py", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    (line,) = [ln for ln in res.stderr.splitlines() if ln.startswith("dynamo")]
    assert line.split()[1] == "False", line
    doc = res.json()
    assert doc["ops"]["flops_by_kind_per_step"]  # the window counted the products


def test_forward_time_outside_torchs_ops_is_not_spread_over_the_kinds():
    """An explorer's forward slept 4 ms and its backward 6 ms beside 2.4 ms of ops a step:
    the row read "pointwise/reductions/norms 9.9 ms (93%)" for 2.2 ms of pointwise ops (the
    torch.compile hint reads that share). The ops keep their seconds; the rest is said as
    time outside torch's ops."""
    from trainprof.report.terminal import op_time_text

    ops = {"op_time_per_step": {"model": {"fusable": 0.0022, "product": 0.0002},
                                "timed_by": "clock"}}
    step_s = 0.0118
    timed = summarize_op_time(ops, step_s, {"forward": 0.36, "backward": 0.54})
    assert timed["model_s_per_step"] == pytest.approx(0.9 * step_s)
    assert timed["s_per_step"]["fusable"] == pytest.approx(0.0022)
    assert timed["outside_ops_s_per_step"] == pytest.approx(0.9 * step_s - 0.0024)
    assert timed["share_of_step"]["fusable"] == pytest.approx(0.0022 / step_s)
    row = op_time_text(timed)
    assert "pointwise/reductions/norms 2.2 ms (21%)" in row
    assert "outside torch's ops 8.2 ms (77%)" in row


def test_the_model_ops_row_and_tile_divide_by_forward_and_backward_alone():
    """A user's row read "forward+backward 16.0 ms a step, by kind of op: products 6.7 ms
    (58%) · pointwise… 4.9 ms (42%) · views 73 µs (1%) · outside torch's ops 4.3 ms (27% of
    forward+backward)": the kinds' shares were of the ops' 11.6 ms and summed to 128% with
    the last; the HTML tile said "model ops fusable 42%" for 4.9 of 16.0 ms (a DDP run's
    read 48% for 350 µs of 19.4 ms)."""
    from trainprof.report.html import _verdict
    from trainprof.report.terminal import op_time_text

    ops = {"op_time_per_step": {"model": {"product": 0.0067, "fusable": 0.0049,
                                          "view": 0.000073},
                                "timed_by": "clock"}}
    step_s = 0.020
    timed = summarize_op_time(ops, step_s, {"forward": 0.32, "backward": 0.48})
    assert timed["model_s_per_step"] == pytest.approx(0.016)
    of_fb = timed["share_of_forward_backward"]
    assert sum(of_fb.values()) + timed["outside_ops_share_of_forward_backward"] == \
        pytest.approx(1.0)
    assert of_fb["fusable"] == pytest.approx(0.0049 / 0.016)
    # the fusion rule's measure keeps its meaning: of the ops' own time
    assert timed["share_of_model"]["fusable"] == pytest.approx(0.0049 / 0.011673)
    row = op_time_text(timed)
    assert "products 6.7 ms (42%)" in row and "pointwise/reductions/norms 4.9 ms (31%)" in row
    assert "views 73 µs (<1%)" in row and "outside torch's ops 4.3 ms (27%)" in row
    assert "(share of forward+backward)" in row
    page = _verdict({"steps": {"count": 100, "warmup": 5, "steady_count": 95},
                     "op_time": timed})
    assert "fusable ops, share of forward+backward</div><div class=\"v\">31%" in page
    # a DDP run's forward+backward mostly outside the ops: 350 µs of 19.4 ms
    ops["op_time_per_step"]["model"] = {"product": 0.00038, "fusable": 0.00035}
    timed = summarize_op_time(ops, 0.0243, {"forward": 0.4, "backward": 0.4})
    page = _verdict({"steps": {"count": 100, "warmup": 5, "steady_count": 95},
                     "op_time": timed})
    assert "fusable ops, share of forward+backward</div><div class=\"v\">1.8%" in page

