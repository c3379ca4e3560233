"""Attention computed op by op: found in the op count's window, timed, its fix measured."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from test_compute_efficiency import _counted
from torch import nn

from trainprof.analysis.attention import summarize_attention
from trainprof.capture.eager_attention import measure_sdpa
from trainprof.diagnosis.attention import MIN_SAVING
from trainprof.store import load_run


def _eager(q, k, v):  # noqa: ANN001, ANN202
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), dim=-1) @ v


def test_attention_written_out_is_found_with_its_calls_ops_and_flops():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 128, 16, requires_grad=True) for _ in range(3))

    def step() -> None:
        _eager(q, k, v).sum().backward()
        _eager(q, k, v).sum().backward()  # two calls a step

    (shape,) = _counted(step).attention.per_step(1)
    assert (shape["batch"], shape["query_len"], shape["key_len"], shape["head_dim"]) == (
        6, 128, 128, 16)
    assert (shape["dtype"], shape["device"]) == ("float32", "cpu")
    assert shape["calls_per_step"] == 2
    # two products forward, four backward, each 2 x 6 x 128 x 128 x 16 FLOPs, per call
    assert shape["flops_per_step"] == 2 * 6 * (2 * 6 * 128 * 128 * 16)
    assert shape["s_per_step"] > 0
    # forward: product, scale, softmax, product (+ views); backward: their gradients
    assert 12 <= shape["ops_per_step"] <= 40
    assert shape["file"] == __file__ and not shape["multihead_attention"]


def test_cross_attention_and_no_grad_are_found_too():
    q = torch.randn(4, 64, 32)
    k, v = torch.randn(4, 200, 32), torch.randn(4, 200, 32)
    with torch.no_grad():
        (shape,) = _counted(lambda: _eager(q, k, v)).attention.per_step(1)
    assert (shape["batch"], shape["query_len"], shape["key_len"]) == (4, 64, 200)
    assert shape["flops_per_step"] == 2 * (2 * 4 * 64 * 200 * 32)


def test_products_without_a_softmax_and_the_fused_kernel_are_not_attention():
    a, b = torch.randn(8, 256, 16), torch.randn(8, 16, 256)
    low_rank = _counted(lambda: torch.bmm(a, b).relu().sum())
    assert low_rank.attention.per_step(1) == []  # scores-like, but no softmax on them
    q, k, v = (torch.randn(2, 3, 128, 16, requires_grad=True) for _ in range(3))
    fused = _counted(lambda: F.scaled_dot_product_attention(q, k, v).sum().backward())
    assert fused.attention.per_step(1) == []
    assert fused.by_kind["cpu float32"] > 0  # its FLOPs are still counted


@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_attention_is_op_by_op_only_when_it_returns_weights(need_weights):
    """nn.MultiheadAttention's default, need_weights=True, computes the weights op by op;
    need_weights=False takes scaled_dot_product_attention (the finding's fix)."""
    mha = nn.MultiheadAttention(32, 4, batch_first=True)
    x = torch.randn(2, 96, 32)
    count = _counted(lambda: mha(x, x, x, need_weights=need_weights)[0].sum().backward())
    found = count.attention.per_step(1)
    if need_weights:
        (shape,) = found
        assert shape["multihead_attention"] and shape["file"] == __file__
        assert (shape["batch"], shape["query_len"], shape["head_dim"]) == (8, 96, 8)
    else:
        assert found == []


def test_the_fused_kernel_is_timed_at_the_found_shape():
    shape = {"batch": 4, "query_len": 128, "key_len": 128, "head_dim": 32,
             "dtype": "float32", "device": "cpu"}
    state = torch.random.get_rng_state()
    # a budget that three pairs fit in on a busy machine too (0.05 s: one pair of 0.18 s
    # under another process's load, on a GPU machine's 12 test processes)
    out = measure_sdpa(torch, shape, budget_s=0.6)
    assert 0 < out["s_per_call"] < 1 and 0 < out["eager_s_per_call"] < 1
    assert out["ratio"] == out["s_per_call"] / out["eager_s_per_call"] and out["repeats"] >= 3
    assert torch.equal(torch.random.get_rng_state(), state)  # the script's stream untouched
    # a shape whose plain ops would not fit in a quarter of the free memory is not timed
    with pytest.raises(MemoryError, match="not timed"):
        measure_sdpa(torch, {**shape, "batch": 10**6, "query_len": 10**4, "key_len": 10**4})


def _found(**over):  # noqa: ANN003, ANN202
    shape = {"batch": 8, "query_len": 512, "key_len": 512, "head_dim": 64, "dtype": "float32",
             "device": "cpu", "calls_per_step": 2.0, "ops_per_step": 30.0, "s_per_step": 0.05,
             "flops_per_step": 3.2e9, "file": "train.py", "line": 9,
             "multihead_attention": False}
    shape.update(over)
    return shape


def test_the_saving_is_the_measured_fix_and_the_bound_its_flops_at_the_peak():
    key = {k: _found()[k] for k in ("batch", "query_len", "key_len", "head_dim", "dtype",
                                    "device")}
    peaks = {"cpu float32": {"flops_per_s": 200e9}}
    att = summarize_attention({"eager_attention": [_found()]},
                              [{**key, "s_per_call": 0.01, "ratio": 0.4}], 0.1, peaks)
    assert att["share"] == pytest.approx(0.5)
    # 50 ms of ops, the fused kernel measured at 0.4 of the plain ops' time: 30 ms saved of
    # a 100 ms step
    assert att["saving_s_per_step"] == pytest.approx(0.03)
    assert att["saving_share"] == pytest.approx(0.3)
    # 3.2 GFLOP at 200 GFLOP/s take 16 ms: at most 34 ms of the 50 could go
    assert att["bound_share"] == pytest.approx(0.34)
    unmeasured = summarize_attention({"eager_attention": [_found()]}, None, 0.1, peaks)
    assert unmeasured["saving_share"] is None and unmeasured["bound_share"] == pytest.approx(0.34)
    assert summarize_attention({"eager_attention": []}, None, 0.1, peaks) is None


def _finding(att):  # noqa: ANN001, ANN202
    from trainprof.diagnosis.attention import eager_attention
    from trainprof.diagnosis.context import Context

    summary = {"attention": att, "command": ["train.py"], "breakdown": {}}
    return eager_attention(Context(summary, None))


def test_the_finding_takes_the_measured_saving_and_names_the_fix_for_the_code():
    key = {k: _found()[k] for k in ("batch", "query_len", "key_len", "head_dim", "dtype",
                                    "device")}
    peaks = {"cpu float32": {"flops_per_s": 200e9}}

    def att(ratio, **over):  # noqa: ANN001, ANN003, ANN202
        return summarize_attention({"eager_attention": [_found(**over)]},
                                   [{**key, "ratio": ratio}], 0.1, peaks)

    f = _finding(att(0.4))
    assert (f.category, f.cause, f.severity) == ("compute", "eager_attention", "high")
    assert f.estimated_gain == pytest.approx(0.3) and f.evidence["fused_measured"]
    assert "scaled_dot_product_attention(" in f.fix.snippet and "train.py:9" in f.fix.text
    assert "trainprof compare" in f.verify
    # the fused kernel measured no faster: nothing to say
    assert _finding(att(0.95)) is None
    mha = _finding(att(0.4, multihead_attention=True))
    assert "need_weights=False" in mha.fix.snippet
    assert mha.verify.startswith("trainprof tune --knob mha_need_weights=true,false train.py")
    hf = _finding(att(0.4, file="/env/site-packages/transformers/models/bert/modeling_bert.py"))
    assert 'attn_implementation="sdpa"' in hf.fix.snippet
    # not measured (a run stopped early): the bound, said to be one
    bound = _finding(summarize_attention({"eager_attention": [_found()]}, None, 0.1, peaks))
    assert bound.estimated_gain == pytest.approx(0.34)
    assert not bound.evidence["fused_measured"] and "could save up to" in bound.title


TRANSFORMER = """
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
fused = sys.argv[1] == "sdpa"
D, H, T, B = 128, 4, 1024, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
        if fused:
            a = F.scaled_dot_product_attention(q, k, v)
        else:
            a = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(D // H), dim=-1) @ v
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.mlp(self.ln2(x))


model = nn.Sequential(Block(), Block(), nn.Linear(D, 64))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(B, T, D), torch.randint(0, 64, (B, T))
for step in range(20):
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_a_transformer_with_attention_written_out_gets_its_fix_measured(tp, tmp_path):
    res = tp(TRANSFORMER, "--json", "--no-html", args=("eager",), timeout=240)
    assert res.returncode == 0, res.stderr
    doc = res.json()
    att = doc["attention"]
    (shape,) = att["shapes"]
    assert (shape["batch"], shape["query_len"], shape["head_dim"]) == (8, 1024, 32)
    assert shape["calls_per_step"] == 2  # two blocks
    assert shape["flops_per_step"] == 2 * 6 * (2 * 8 * 1024 * 1024 * 32)
    assert shape["line"] == 26  # the line with the softmax, in the script
    # the score matrices' ops hold much of this step; the fix was timed at its shape
    assert 0.25 < att["share"] < 1
    (fix,) = load_run(res.run_dir).meta["attention_fix_measured"]
    assert fix["s_per_call"] > 0 and fix["ratio"] > 0 and fix["query_len"] == 1024
    # on the 2-core VM the fused kernel takes 0.3 of the plain ops' time at this shape (the
    # whole step ran x0.40 with it): a large saving, measured
    (found,) = [f for f in doc["findings"] if f["cause"] == "eager_attention"]
    assert found["estimated_gain"] == pytest.approx(att["saving_share"], rel=1e-3)
    assert found["estimated_gain"] > max(0.1, MIN_SAVING)
    assert found["evidence"]["fused_measured"] is True
    ops = json.loads((res.run_dir / "ops.json").read_text())
    assert ops["eager_attention"][0]["calls_per_step"] == 2
    # the summary's row and the HTML report's tile
    from trainprof.commands import analyse_folder, write_html
    from trainprof.report.terminal import attention_text

    assert attention_text(att).startswith("op by op on 8×1024×1024 scores (float32, heads of 32)")
    summary, _ = analyse_folder(res.run_dir)
    page = write_html(summary, load_run(res.run_dir), tmp_path / "report.html").read_text()
    assert "attention op by op" in page and "scaled_dot_product_attention measured here" in page
    fused = tp(TRANSFORMER, "--json", "--no-html", args=("sdpa",), timeout=240)
    assert fused.returncode == 0, fused.stderr
    assert fused.json()["attention"] is None
    assert not any(f["cause"] == "eager_attention" for f in fused.json()["findings"])
    # compare says where the time went
    import io

    from trainprof.analysis.compare import compare_runs
    from trainprof.report.compare_terminal import render_compare

    result = compare_runs(load_run(res.run_dir), load_run(fused.run_dir))
    assert result["a"]["attention_s_per_step"] == pytest.approx(att["s_per_step"])
    assert result["b"]["attention_s_per_step"] == 0.0
    out = io.StringIO()
    render_compare(result, file=out)
    row = next(x for x in out.getvalue().splitlines() if "attention op by op" in x)
    assert row.split()[-2:] == ["none", "—"]


def test_weights_and_biases_gets_the_attention_figures():
    from trainprof.report.wandb_export import run_summary

    att = summarize_attention({"eager_attention": [_found()]},
                              [{**{k: _found()[k] for k in ("batch", "query_len", "key_len",
                                                            "head_dim", "dtype", "device")},
                                "ratio": 0.4}], 0.1, None)
    out = run_summary({"status": "finished", "attention": att})
    assert out["trainprof/attention/share"] == pytest.approx(0.5)
    assert out["trainprof/attention/s_per_step"] == pytest.approx(0.05)
    assert out["trainprof/attention/saving_share"] == pytest.approx(0.3)
    assert not any(k.startswith("trainprof/attention") for k in run_summary({"status": "x"}))


MHA = """
import torch
from torch import nn

torch.manual_seed(0)
attn = nn.MultiheadAttention(32, 4, batch_first=True)
head = nn.Linear(32, 1)
opt = torch.optim.SGD([*attn.parameters(), *head.parameters()], lr=0.01)
x = torch.randn(4, 128, 32)
for step in range(16):
    out, weights = attn(x, x, x)  # need_weights=True, its default: op by op
    loss = head(out).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print("WEIGHTS", None if weights is None else tuple(weights.shape))
"""


@pytest.mark.parametrize("knob", [None, True, False])
def test_the_mha_need_weights_knob_puts_multihead_attention_on_the_fused_path(tp, knob):
    env = {} if knob is None else {"TRAINPROF_KNOBS": json.dumps({"mha_need_weights": knob})}
    res = tp(MHA, "--json", "--no-html", env=env, timeout=240)
    assert res.returncode == 0, res.stderr
    weights = next(x for x in (res.stdout + res.stderr).splitlines() if x.startswith("WEIGHTS"))
    att = res.json()["attention"]
    if knob is False:  # scaled_dot_product_attention: no score matrix, no weights returned
        assert weights == "WEIGHTS None" and att is None
        meta = load_run(res.run_dir).meta
        assert meta["knobs"]["process"]["mha_need_weights"] == {"value": False, "calls": 16}
        assert meta["knobs"]["script_calls_ignored"] == [
            "MultiheadAttention(need_weights=True)"]
        from trainprof.experiments.tune import _actual

        assert _actual("mha_need_weights", meta) == "false (16 calls)"
    else:
        assert weights == "WEIGHTS (4, 128, 128)"
        (shape,) = att["shapes"]
        assert shape["multihead_attention"] and (shape["batch"], shape["query_len"]) == (16, 128)


def test_the_windows_seconds_are_scaled_to_the_steady_steps():
    """Two steps are few: the attention's share is its share of the model's op time in the
    window times forward and backward's steady time."""
    from trainprof.analysis.attention import model_scale
    from trainprof.analysis.ops import summarize_op_time

    # 20 ms of model ops in the window; forward and backward 50% of a 30 ms steady step
    ops = {"op_time_per_step": {"model": {"attention": 0.01, "product": 0.01},
                                "timed_by": "clock"}}
    op_time = summarize_op_time(ops, 0.03, {"forward": 0.2, "backward": 0.3})
    scale = model_scale(op_time)
    assert scale == pytest.approx(0.75)
    att = summarize_attention({"eager_attention": [_found()]}, None, 0.1, None, scale)
    assert att["shapes"][0]["window_s_per_step"] == 0.05
    assert att["s_per_step"] == pytest.approx(0.0375) and att["share"] == pytest.approx(0.375)
    assert model_scale(None) == 1.0
    assert model_scale(summarize_op_time(ops, 0.03)) == 1.0  # no breakdown: the window's


def test_ops_timed_by_cuda_events_scale_to_the_devices_phases_not_the_hosts():
    """On a GPU the host's forward and backward only launch the kernels (an H200 run of
    eager attention: 0.7 ms of host phases against 3.1 ms of device work a step): CUDA
    event times are scaled to the device's forward and backward seconds, or left as the
    window's where the run has no device phase times."""
    from trainprof.analysis.attention import model_scale
    from trainprof.analysis.ops import summarize_op_time

    ops = {"op_time_per_step": {"model": {"attention": 0.003, "product": 0.001},
                                "timed_by": "cuda events"}}
    host = {"forward": 0.1, "backward": 0.1}  # 20% of a 5 ms step: 1 ms on the host
    device = summarize_op_time(ops, 0.005, host, device={"model_s": 0.0036, "step_s": 0.004})
    assert device["model_s_per_step"] == pytest.approx(0.0036)
    assert device["s_per_step"]["attention"] == pytest.approx(0.0027)  # 0.003 x 0.9
    assert model_scale(device) == pytest.approx(0.9)
    assert device["step_s"] == 0.005  # the host's step, the longer
    assert sum(device["share_of_step"].values()) == pytest.approx(0.72)
    # a host that ran ahead of the device (2 ms steps against its 5 ms): shares of the
    # device's step, never more than the whole of it
    ahead = summarize_op_time(ops, 0.002, host, device={"model_s": 0.0036, "step_s": 0.005})
    assert ahead["step_s"] == 0.005
    assert sum(ahead["share_of_step"].values()) == pytest.approx(0.72)
    # device phases longer than the ops (gaps between kernels): the ops keep their seconds,
    # the rest is time outside them
    gaps = summarize_op_time(ops, 0.005, host, device={"model_s": 0.0042, "step_s": 0.005})
    assert gaps["s_per_step"]["attention"] == pytest.approx(0.003)
    assert gaps["outside_ops_s_per_step"] == pytest.approx(0.0002)
    assert model_scale(gaps) == 1.0
    window = summarize_op_time(ops, 0.005, host)
    assert window["s_per_step"]["attention"] == pytest.approx(0.003)
    assert model_scale(window) == 1.0
