"""``trainprof trace``: the analyzer against published numbers, formats seen in the field,
malformed inputs, and its speed and memory goals.

The reference traces are read in place from ``../shared/traces`` (the TensorBoard plugin's
ResNet-50 samples with the plugin's own numbers, HTA's test traces, TraceLens's H100
traces); those tests are skipped where that folder is missing. Everything else runs on
small traces generated here.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from trainprof.analysis.trace import analyse_trace
from trainprof.analysis.trace import intervals as iv
from trainprof.analysis.trace.gpu_metrics import uses_tensor_cores
from trainprof.diagnosis.trace_rules import diagnose_trace
from trainprof.errors import UsageError
from trainprof.report.trace_terminal import render_trace

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
# the two traces with published values are also vendored (tests/data/tb-resnet50/README.md)
TB = TRACES / "tb-resnet50"
if not TB.is_dir():
    TB = Path(__file__).resolve().parent / "data" / "tb-resnet50"
MORE = TRACES / "more"
needs_traces = pytest.mark.skipif(not TB.is_dir(), reason="shared/traces not available")
#: the other field traces are not vendored: those tests run where ../shared/traces exists
needs_more = pytest.mark.skipif(not MORE.is_dir(), reason="shared/traces/more not available")

CATEGORIES = ("Kernel", "Memcpy", "Memset", "Communication", "Runtime", "DataLoader", "CpuOp",
              "Other", "Total")


@pytest.fixture(scope="module")
def tb_results() -> dict[str, dict]:
    if not TB.is_dir():
        pytest.skip("shared/traces not available")
    return {name: analyse_trace(TB / name)
            for name in ("nw0-steps5-10.pt.trace.json.gz", "nw4-steps5-10.pt.trace.json.gz")}


# --- the published numbers -------------------------------------------------------------

@needs_traces
@pytest.mark.parametrize("name", ["nw0-steps5-10.pt.trace.json.gz",
                                  "nw4-steps5-10.pt.trace.json.gz"])
def test_breakdown_matches_tensorboard_plugin(tb_results, name):
    expected = json.loads((TB / "expected-tb-plugin.json").read_text())[name]
    doc = tb_results[name]
    assert doc["steps"] == expected["steps"]
    for cat, want in expected["avg_step_breakdown_us"].items():
        got = doc["breakdown_us"][cat]
        # the plugin rounds the average to whole µs: within 0.5% or half a microsecond
        assert abs(got - want) <= max(0.005 * want, 0.5), (cat, got, want)
    assert sum(doc["breakdown_us"][c] for c in CATEGORIES[:-1]) == pytest.approx(
        doc["breakdown_us"]["Total"], rel=1e-9)


@needs_traces
@pytest.mark.parametrize("name", ["nw0-steps5-10.pt.trace.json.gz",
                                  "nw4-steps5-10.pt.trace.json.gz"])
def test_gpu_summary_matches_tensorboard_plugin(tb_results, name):
    expected = json.loads((TB / "expected-tb-plugin.json").read_text())[name]["gpu_summary"]
    g = tb_results[name]["gpu"]["0"]
    assert g["name"] == expected["Name"]
    assert g["compute_capability"] == expected["Compute Capability"]

    def pct(key):
        return float(expected[key].rstrip(" %"))

    # the plugin prints two decimals
    assert round(g["utilization"], 2) == pytest.approx(pct("GPU Utilization"), abs=0.011)
    assert round(g["sm_efficiency"], 2) == pytest.approx(pct("Est. SM Efficiency"), abs=0.011)
    assert round(g["achieved_occupancy"], 2) == pytest.approx(
        pct("Est. Achieved Occupancy"), abs=0.011)
    assert g["tensor_core_pct"] == pct("Kernel Time using Tensor Cores") == 0.0


@needs_traces
def test_recommendations_match_tensorboard_plugin(tb_results):
    """The plugin's two recommendations: DataLoader 33.4% (nw0 only); 68% TC-eligible."""
    nw0 = tb_results["nw0-steps5-10.pt.trace.json.gz"]
    nw4 = tb_results["nw4-steps5-10.pt.trace.json.gz"]
    assert round(nw0["breakdown_pct"]["DataLoader"], 1) == 33.4
    for doc in (nw0, nw4):
        assert round(doc["tc_eligible_kernel_pct"]) == 68
    causes0 = [(f["category"], f["cause"]) for f in nw0["findings"]]
    causes4 = [(f["category"], f["cause"]) for f in nw4["findings"]]
    assert causes0[0] == ("input_pipeline", "too_few_workers")
    assert nw0["findings"][0]["severity"] == "high"
    assert nw0["findings"][0]["estimated_gain"] == pytest.approx(0.334, abs=0.001)
    assert ("compute", "tensor_cores_unused") in causes0
    assert ("compute", "tensor_cores_unused") in causes4
    assert not any(c == "input_pipeline" for c, _ in causes4)  # 0.8% DataLoader with 4 workers
    assert ("host_to_device", "pageable_memory") in causes0  # Pageable -> Device copies


@needs_traces
@pytest.mark.parametrize(("name", "idle", "compute", "non_compute", "span"), [
    ("nw0-steps5-10.pt.trace.json.gz", 39.43, 59.35, 1.22, 830_494),
    ("nw4-steps5-10.pt.trace.json.gz", 24.32, 73.23, 2.45, None),
])
def test_temporal_breakdown_matches_hta(tb_results, name, idle, compute, non_compute, span):
    t = tb_results[name]["temporal"]["0"]
    assert round(t["idle_pct"], 2) == idle
    assert round(t["compute_pct"], 2) == compute
    assert round(t["non_compute_pct"], 2) == non_compute
    assert t["last_step_excluded"]
    if span is not None:
        assert t["span_us"] == span
    ib = t["idle_breakdown"]
    assert ib["host_wait_pct"] + ib["kernel_wait_pct"] + ib["other_pct"] == pytest.approx(100)
    assert ib["host_wait_pct"] > 90  # the GPU waits for the host (data loading, launches)


@needs_traces
@needs_more
def test_gpu_timeline_matches_tracelens():
    """TraceLens's gpu_timeline.csv for the H100 traces: total, idle and busy time agree.

    A cross-check of the device-timeline arithmetic by a third tool (one step each, so HTA
    cuts nothing). The Qwen trace is left out: it has kernels before the step, and TraceLens
    windows its timeline to the GPU's ProfilerStep annotation where HTA does not.
    """
    folder = MORE / "tracelens" / "h100"
    checked = 0
    for csv in sorted(folder.glob("*_perf_report_csvs/gpu_timeline.csv")):
        trace = folder / (csv.parent.name.removesuffix("_perf_report_csvs") + ".json.gz")
        if not trace.exists() or trace.name.startswith("Qwen"):
            continue
        ref = {}
        for line in csv.read_text().splitlines()[1:]:
            key, ms, _ = line.split(",")
            ref[key] = float(ms) * 1000.0
        t = analyse_trace(trace)["temporal"]["0"]
        assert t["span_us"] == pytest.approx(ref["total_time"], abs=0.01)
        assert t["idle_us"] == pytest.approx(ref["idle_time"], abs=0.01)
        assert t["span_us"] - t["idle_us"] == pytest.approx(ref["busy_time"], abs=0.01)
        checked += 1
    assert checked >= 4


@needs_more
def test_gemm_and_attention_flops_and_rates_match_tracelens():
    """TraceLens's GEMM, SDPA_fwd and CONV_fwd tables for the H100 traces: per distinct call (op,
    input shapes) the same count, GFLOPs, mean kernel time and mean TFLOP/s, row for row.

    Analysed once per trace, as `trainprof trace` does; every row TraceLens lists is found.
    """
    import csv

    folder = MORE / "tracelens" / "h100"
    checked = 0
    for trace in sorted(folder.glob("*.json.gz")):
        tables = trace.parent / (trace.name.removesuffix(".json.gz") + "_perf_report_csvs")
        flops = analyse_trace(trace)["flops"]
        assert flops["distinct_calls"] <= 30  # these traces: every distinct call is listed
        ours = {(c["name"], json.dumps(c["input_dims"])): c for c in flops["calls"]}
        for name in ("GEMM.csv", "SDPA_fwd.csv", "CONV_fwd.csv"):
            if not (tables / name).exists():
                continue
            for row in csv.DictReader((tables / name).open()):
                c = ours[(row["name"], json.dumps(json.loads(row["Input Dims_first"])))]
                assert c["calls"] == int(row["name_count"])
                assert c["gflops"] == pytest.approx(float(row["GFLOPS_first"]), rel=1e-9)
                assert c["kernel_us_mean"] == pytest.approx(
                    float(row["Kernel Time (µs)_mean"]), rel=1e-4)
                assert c["tflops_per_s_mean"] == pytest.approx(
                    float(row["TFLOPS/s_mean"]), rel=1e-4)
                checked += 1
        # the totals are the rows' sums; bfloat16 on an H100 against its 989.4 TFLOP/s
        assert flops["gflops"] == pytest.approx(sum(c["gflops_total"] for c in ours.values()))
        bf16 = next(k for k in flops["by_dtype"] if k["dtype"] == "bfloat16")
        assert bf16["datasheet_gpu"] == "H100" and bf16["datasheet_tflops_per_s"] == 989.4
        assert bf16["of_datasheet_peak"] == pytest.approx(bf16["tflops_per_s"] / 989.4)
    assert checked >= 43
    text = io.StringIO()
    render_trace(analyse_trace(folder / "Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz"), file=text)
    out = " ".join(text.getvalue().split())  # the row as one line, however it wrapped
    assert ("FLOPs 5.76 TFLOP in products, attention and convolutions over 11.7 ms of their "
            "kernels: 491 TFLOP/s; bfloat16 at 49.7% of the H100") in out


@needs_more
def test_attention_computed_op_by_op_is_found_in_h100_traces_as_tracelens_times_its_ops():
    """TimeSformer and OWLv2 run Hugging Face's eager attention on an H100 (3137 and 5185
    tokens): the score matrices' products and scaling take the kernel time TraceLens's
    GEMM and BinaryElementwise tables give those rows, the softmax the rest; the models that
    run scaled_dot_product_attention (their SDPA_fwd tables) have none."""
    import csv

    from trainprof.diagnosis.trace_rules import diagnose_trace

    folder = MORE / "tracelens" / "h100"
    expected = {"facebook_timesformer-base-finetuned-k400__1016002": (96, 3137, 12),
                "google_owlv2-large-patch14-ensemble__1016001": (16, 5185, 120)}
    for trace in sorted(folder.glob("*.json.gz")):
        stem = trace.name.removesuffix(".json.gz")
        doc = analyse_trace(trace)
        att = doc["attention"]
        if stem not in expected:
            assert att is None
            assert (folder / f"{stem}_perf_report_csvs" / "SDPA_fwd.csv").exists() or (
                "Falconsai" in stem)
            continue
        batch, tokens, layers = expected[stem]
        (shape,) = att["shapes"]
        assert (shape["batch"], shape["query_len"], shape["key_len"], shape["head_dim"],
                shape["dtype"], shape["softmax_calls"]) == (batch, tokens, tokens, 64,
                                                             "bfloat16", layers)
        # TraceLens's rows for the ops on the scores: the two products, the scaling
        ref: dict[str, float] = {}
        gflops = 0.0
        for table in ("GEMM.csv", "BinaryElementwise.csv"):
            for row in csv.DictReader((folder / f"{stem}_perf_report_csvs" / table).open()):
                dims = json.loads(row["Input Dims_first"])
                if any(isinstance(d, list) and len(d) >= 3 and d[-1] * d[-2] == tokens ** 2
                       or d == [batch, tokens, 64] for d in dims):
                    ref[row["name"]] = (ref.get(row["name"], 0.0)
                                        + float(row["Kernel Time (µs)_sum"]))
                    if table == "GEMM.csv":
                        gflops += float(row["GFLOPS_first"]) * int(row["name_count"])
        by_op = shape["kernel_us_by_op"]
        for name, us in ref.items():
            assert by_op[name] == pytest.approx(us, rel=1e-6)
        assert set(by_op) == {*ref, "aten::_softmax"}
        assert shape["gflops"] == pytest.approx(gflops, rel=1e-9)
        assert att["kernel_us"] == pytest.approx(sum(by_op.values()))
        # the bound: the kernel time beyond the products' FLOPs at the H100's 989.4 TFLOP/s
        assert att["bound_us"] == pytest.approx(att["kernel_us"] - gflops / 989.4 * 1e3)
        (finding,) = [f for f in diagnose_trace(doc) if f["cause"] == "eager_attention"]
        kernel_share = doc["breakdown_us"]["Kernel"] / doc["breakdown_us"]["Total"]
        assert finding["estimated_gain"] == pytest.approx(
            att["bound_us"] / att["total_kernel_us"] * kernel_share, rel=1e-3)
        assert finding["severity"] == "high" and "sdpa" in finding["fix"]["snippet"]


def test_a_cpu_trace_counts_the_flops_torchs_counter_counts(tmp_path):
    """A real torch.profiler trace (record_shapes, CPU only) of a training step: the
    products' and convolutions' FLOPs, forward and backward, are those torch's own
    FlopCounterMode counts for the same step (no bias: TraceLens counts its adds, torch
    does not), timed by the ops' own CPU time."""
    import torch
    from torch import nn
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False), nn.Flatten(),
                          nn.Linear(8 * 4 * 4, 10, bias=False))
    x = torch.randn(4, 3, 8, 8)

    def step() -> None:
        model(x).sum().backward()

    step()
    with FlopCounterMode(display=False) as counter:
        step()
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        step()
    path = tmp_path / "cpu.pt.trace.json"
    prof.export_chrome_trace(str(path))
    flops = analyse_trace(path)["flops"]
    assert flops["time_basis"] == "cpu op" and flops["kernel_us"] > 0
    assert flops["gflops"] * 1e9 == counter.get_total_flops()
    # the first convolution's backward computes no input gradient (output_mask)
    names = sorted(c["name"] for c in flops["calls"])
    assert names.count("aten::convolution_backward") == 2
    text = io.StringIO()
    render_trace(analyse_trace(path), file=text)
    assert "of their CPU time" in text.getvalue()


@needs_traces
def test_flop_ops_whose_shapes_do_not_say_their_flops_are_named(tb_results):
    """ResNet-50 traced before torch 2.x: its convolutions lack their strides, so the FLOPs
    line counted the fc layer alone ("2.36 GFLOP ... 31.8% of the V100's peak") and read as
    the whole model's."""
    from trainprof.report.trace_terminal import flops_line

    flops = tb_results["nw0-steps5-10.pt.trace.json.gz"]["flops"]
    (conv,) = [u for u in flops["uncounted"] if u["name"] == "aten::convolution"]
    assert conv["calls"] == 318 and conv["kernel_us"] > 100_000
    assert "not counted: convolution 318×" in flops_line(flops)


@needs_traces
def test_a_cuda_trace_cut_before_its_device_events_is_still_a_cuda_trace(tmp_path):
    """Cut at 300 kB, a V100 trace had read "CPU only", its FLOP rate over CPU time, beside
    aten::cudnn_convolution in its own operator table."""
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes((TB / "nw0-steps5-10.pt.trace.json.gz").read_bytes()[:300_000])
    doc = analyse_trace(cut)
    assert doc["format"]["truncated"] and doc["format"]["device_type"] == "CUDA"
    assert doc["cpu_only"] is False


@needs_traces
def test_memcpy_counts_are_a_steps_beside_a_steps_time(tb_results):
    """"HtoD: 12×, 1.9 ms per step" set the trace's count beside a time a step."""
    from trainprof.report.trace_terminal import _memcpy_lines

    doc = tb_results["nw0-steps5-10.pt.trace.json.gz"]
    (htod,) = [k for k in doc["memcpy"]["kinds"] if k["kind"] == "HtoD"]
    assert htod["count"] == 12 and htod["count_per_step"] == 2
    assert _memcpy_lines(doc["memcpy"])[0].startswith(
        "HtoD (Pageable → Device): 2× a step (12 in the trace), 1.9 ms per step")


def test_flops_of_a_call_follow_tracelens_definitions():
    from trainprof.analysis.trace.op_flops import call_flops

    assert call_flops("aten::mm", [[8, 4], [4, 2]], None) == 2 * 8 * 2 * 4
    assert call_flops("aten::addmm", [[2], [8, 4], [4, 2], [], []], None) == 2 * 8 * 2 * 4 + 16
    assert call_flops("aten::bmm", [[3, 8, 4], [3, 4, 2]], None) == 3 * 2 * 8 * 2 * 4
    assert call_flops("aten::baddbmm", [[3, 8, 2], [3, 8, 4], [3, 4, 2]], None) == (
        3 * 2 * 8 * 2 * 4 + 3 * 16)
    q = [2, 4, 10, 8]
    fwd = 2.0 * 2 * 4 * 10 * 10 * (8 + 8)
    name = "aten::_scaled_dot_product_flash_attention"
    assert call_flops(name, [q, q, q, [], [], [], []], ["", "", "", "0.0", "False"]) == fwd
    assert call_flops(name, [q, q, q, [], [], [], []], ["", "", "", "0.0", "True"]) == fwd / 2
    # backward: the output's gradient first, then query, key, value: 2.5 times the forward
    assert call_flops(name + "_backward", [q, q, q, q, q, []], None) == fwd * 2.5
    # convolutions: 2 N C_out (output positions) C_in/groups (kernel positions)
    conv = "aten::convolution"
    args = ["", "", "", "[2, 2]", "[1, 1]", "[1, 1]", "False", "[0, 0]", "1"]
    out = ((9 + 2 - 2 - 1) // 2 + 1) ** 2  # 9x9, 3x3 kernel, stride 2, padding 1: 5x5
    assert call_flops(conv, [[4, 8, 9, 9], [16, 8, 3, 3], [16]], args) == 2 * 4 * 16 * out * 8 * 9
    grouped = args[:8] + ["4"]  # 4 groups: each output channel sees 2 input channels
    assert call_flops(conv, [[4, 8, 9, 9], [16, 2, 3, 3], []], grouped) == (
        2 * 4 * 16 * out * 2 * 9)
    # backward from the output's gradient: input and weight gradients, each the forward's
    back = ["", "", "", "[16]", "[2, 2]", "[1, 1]", "[1, 1]", "False", "[0, 0]", "1",
            "[True, True, True]"]
    grad = [[4, 16, 5, 5], [4, 8, 9, 9], [16, 8, 3, 3]]
    fwd_conv = 2 * 4 * 16 * out * 8 * 9
    assert call_flops("aten::convolution_backward", grad, back) == 2 * fwd_conv
    back[-1] = "[False, True, False]"  # the first layer: no input gradient
    assert call_flops("aten::convolution_backward", grad, back) == fwd_conv
    # shapes missing (no record_shapes) or of another rank: nothing counted
    assert call_flops("aten::mm", [], None) is None
    assert call_flops(conv, [[4, 8, 9, 9], [16, 8, 3, 3]], None) is None
    assert call_flops("aten::mm", [[8, 4, 2], [4, 2]], None) is None


# --- every trace of the field analyses ------------------------------------------------

MORE_FILES = sorted(p for p in MORE.rglob("*.json.gz")) if MORE.is_dir() else []


@needs_traces
@pytest.mark.parametrize("path", MORE_FILES, ids=[p.name[:40] for p in MORE_FILES])
def test_every_shared_trace_analyses(path):
    doc = analyse_trace(path)
    json.dumps(doc)  # JSON-serialisable as it is
    bd = doc["breakdown_us"]
    assert bd["Total"] > 0
    assert sum(bd[c] for c in CATEGORIES[:-1]) == pytest.approx(bd["Total"], rel=1e-9)
    assert all(0 <= v <= 100.0001 for v in doc["breakdown_pct"].values())
    assert doc["steps"]
    for g in doc["gpu"].values():
        for key in ("utilization", "sm_efficiency", "achieved_occupancy", "tensor_core_pct"):
            assert g[key] is None or 0 <= g[key] <= 100.0001, (key, g[key])
    for t in doc["temporal"].values():
        total = t["idle_pct"] + t["compute_pct"] + t["non_compute_pct"]
        assert total == pytest.approx(100)
    for f in doc["findings"]:
        assert set(f) >= {"category", "cause", "title", "severity", "evidence",
                          "estimated_gain", "fix", "verify"}
    gains = [f["estimated_gain"] for f in doc["findings"]]
    assert gains == sorted(gains, reverse=True)
    out = io.StringIO()
    render_trace(doc, file=out)
    assert "Step-time breakdown" in out.getvalue()


@needs_traces
@needs_more
def test_format_facts_of_the_field():
    amd = analyse_trace(MORE / "hta" / "mi250_minitoy_train_ROCm6_2_kineto.json.gz")
    assert amd["format"]["device_type"] == "ROCm"
    assert amd["format"]["float_timestamps"]
    assert amd["gpu"]  # AMD kernels are device work too
    assert any(k["tensor_cores"] for k in amd["kernels"])  # Tensile MFMA kernels (_MI16x16x1)
    cpu = analyse_trace(next((MORE / "hta").glob("rank-34*.json.gz")))
    assert cpu["format"]["device_type"] == "CPU only" and cpu["cpu_only"]
    assert cpu["gpu"] == {} and cpu["temporal"] == {}
    assert cpu["rank"] == 34  # from distributedInfo
    ns = analyse_trace(next((MORE / "hta" / "ns_res").glob("*.json.gz")))
    assert ns["format"]["float_timestamps"] and ns["format"]["generation"].startswith("modern")
    control = analyse_trace(MORE / "hta" / "trace_diff_control" / "control.json.gz")
    assert control["breakdown_us"]["DataLoader"] > 0  # user_annotation DataLoader counted
    assert control["breakdown_us"]["Communication"] > 0  # NCCL kernels
    assert control["communication"]["overlap_pct_of_communication"] >= 0


@needs_traces
def test_separate_runs_in_one_folder_are_not_taken_for_ranks(tb_results):
    from trainprof.analysis.trace.analyse import merge_ranks

    # nw0 and nw4: two single-GPU runs of one script, no process group, no collective
    docs = [{k: v for k, v in d.items() if k != "findings"} | {"rank": i}
            for i, d in enumerate(tb_results.values())]
    assert all(d["distributed_info"] is None and d["communication"] is None for d in docs)
    doc = merge_ranks(TB, docs)
    assert doc["rank_spread"]["one_job"] is False
    assert doc["rank_spread"]["spread_pct"] == pytest.approx(20.6, abs=0.1)
    assert "straggler_rank" not in [f["cause"] for f in diagnose_trace(doc)]
    out = io.StringIO()
    render_trace(doc, file=out)
    text = " ".join(out.getvalue().split())
    assert "2 separate traces" in text and "Per trace" in text and "Per rank" not in text
    assert ("2 separate runs, mean step time: nw0-steps5-10.pt.trace.json.gz 177.6 ms · "
            "nw4-steps5-10.pt.trace.json.gz 141.1 ms") in text
    # the same two, said by torch.profiler to be ranks of one job: a straggler
    ranks = [d | {"distributed_info": {"backend": "nccl", "rank": d["rank"], "world_size": 2}}
             for d in docs]
    doc = merge_ranks(TB, ranks)
    assert doc["rank_spread"]["one_job"] is True
    (f,) = [f for f in diagnose_trace(doc) if f["cause"] == "straggler_rank"]
    assert f["title"].startswith("Rank 0 is 21% slower per step than rank 1")


@needs_traces
def test_a_rank_that_holds_the_others_up_is_named_not_their_communication(tb_results):
    """Two gloo ranks, rank 1's dataset slow: "[high] Communication not hidden ... 47%" and
    "[high] Training waits for data 42%" (an average that fits neither rank) counted one
    wait twice. The rank the others wait for has the least Communication; its excess says
    why."""
    import copy

    from trainprof.analysis.trace.analyse import merge_ranks

    base = {k: v for k, v in tb_results["nw0-steps5-10.pt.trace.json.gz"].items()
            if k != "findings"}
    docs = []
    for r in (0, 1):
        d = copy.deepcopy(base) | {"rank": r, "distributed_info": {
            "backend": "gloo", "rank": r, "world_size": 2}}
        docs.append(d)
    extra = 60_000.0  # rank 1 waits 60 ms more for data; rank 0 waits as long for it
    docs[1]["breakdown_us"]["DataLoader"] += extra
    docs[0]["breakdown_us"]["Communication"] += extra
    for d in docs:
        d["breakdown_us"]["Total"] += extra
    doc = merge_ranks(TB, docs)
    found = diagnose_trace(doc)
    (held,) = [f for f in found if f["cause"] == "uneven_input_pipeline"]
    assert held["title"].startswith("Rank 1 holds the others up: its waiting for data takes "
                                    "60.0 ms a step more")
    assert held["estimated_gain"] == pytest.approx(extra / (177_592 + extra), rel=0.01)
    assert "exposed_communication" not in [f["cause"] for f in found]
    # what every rank waits for data is the least-waiting rank's (nw0's own 33%), not
    # the average of both
    (common,) = [f for f in found if f["category"] == "input_pipeline"]
    assert common["estimated_gain"] == pytest.approx(
        59_262 / (177_592 + extra), rel=0.02), common["title"]


@needs_traces
@needs_more
def test_directory_of_ranks_is_merged():
    doc = analyse_trace(MORE / "hta" / "trace_filter_2ranks")
    assert set(doc["ranks"]) == {"0", "1"}
    assert set(doc["temporal"]) == {"0", "1"}
    assert len(doc["gpu"]) == 2
    for c in CATEGORIES:
        mean = np.mean([r["breakdown_us"][c] for r in doc["ranks"].values()])
        assert doc["breakdown_us"][c] == pytest.approx(mean)
    assert doc["rank_spread"]["spread_pct"] >= 0
    assert doc["rank_spread"]["one_job"] is True  # distributedInfo: world size 128
    out = io.StringIO()
    render_trace(doc, file=out)
    assert "Per rank" in out.getvalue()


@needs_traces
def test_a_trace_copied_twice_into_a_folder_is_counted_once(tmp_path):
    """One rank's trace twice in a folder (a copy, or a trace handler's folder that kept a
    cycle twice) had read as "2 ranks", "slowest rank 0, fastest 0"."""
    import shutil

    src = TB / "nw0-steps5-10.pt.trace.json.gz"
    shutil.copy(src, tmp_path / "a.pt.trace.json.gz")
    shutil.copy(src, tmp_path / "b.pt.trace.json.gz")
    doc = analyse_trace(tmp_path)
    assert "ranks" not in doc or len(doc["ranks"]) == 1
    assert any("b.pt.trace.json.gz is a copy of a.pt.trace.json.gz" in w
               for w in doc["warnings"]), doc["warnings"]
    assert doc["breakdown_us"]["Total"] == pytest.approx(177_592, abs=1)


# --- a known-answer trace in every format generation -----------------------------------

def synthetic_trace(modern: bool = True, gpu_annotations: bool = True, n_steps: int = 3,
                    base: float = 1_700_000_000_000.125) -> dict:
    """Steps of 100 µs with known answers (µs from the step start):

    DataLoader [0, 20], aten::mm [20, 60], cudaLaunchKernel [30, 35], its tensor-core
    kernel [40, 90] (0.5 blocks/SM, 50% occupancy), cudaStreamSynchronize [60, 95].
    Priority gives Kernel 50, Runtime 10 ([30,35] and [90,95]), DataLoader 20,
    CPU Exec 15 ([20,30] and [35,40]) and Other 5. String pids, float timestamps with
    nanosecond fractions, and (modern) the GPU copy of each ProfilerStep.
    """
    cat = (dict(op="cpu_op", ann="user_annotation", rt="cuda_runtime", k="kernel") if modern
           else dict(op="Operator", ann="Operator", rt="Runtime", k="Kernel"))
    ev: list[dict] = []
    for k in range(n_steps):
        s = base + 100.0 * k
        ext, corr = 10 + k, 1000 + 2 * k
        host = {"pid": "host", "tid": "main"}
        ev += [
            {"ph": "X", "cat": cat["ann"], "name": f"ProfilerStep#{k}", **host, "ts": s,
             "dur": 100.0, "args": {"External id": 100 + k}},
            {"ph": "X", "cat": cat["ann"], **host, "ts": s, "dur": 20.0,
             "name": "enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__"},
            {"ph": "X", "cat": cat["op"], "name": "aten::mm", **host, "ts": s + 20, "dur": 40.0,
             "args": {"External id": ext}},
            {"ph": "X", "cat": cat["rt"], "name": "cudaLaunchKernel", **host, "ts": s + 30,
             "dur": 5.0, "args": {"External id": ext, "correlation": corr}},
            {"ph": "X", "cat": cat["k"], "pid": 0, "tid": 7 if modern else "stream 7",
             "name": "sm80_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize128x128x16",
             "ts": s + 40, "dur": 50.0,
             "args": {"External id": ext, "correlation": corr, "device": 0, "stream": 7,
                      "blocks per SM": 0.5, "est. achieved occupancy %": 50}},
            {"ph": "X", "cat": cat["rt"], "name": "cudaStreamSynchronize", **host,
             "ts": s + 60, "dur": 35.0, "args": {"correlation": corr + 1}},
            {"ph": "s", "id": corr, "pid": "host", "tid": "main", "ts": s + 30, "cat": "ac2g",
             "name": "ac2g"},
        ]
        if modern and gpu_annotations:
            ev.append({"ph": "X", "cat": "gpu_user_annotation", "name": f"ProfilerStep#{k}",
                       "pid": 0, "tid": 7, "ts": s + 40, "dur": 50.0})
    return {"schemaVersion": 1, "traceEvents": ev, "traceName": "synthetic",
            "deviceProperties": [{"id": 0, "name": "NVIDIA A100-SXM4-80GB", "numSms": 108,
                                  "totalGlobalMem": 85899345920, "computeMajor": 8,
                                  "computeMinor": 0}]}


def _write(path: Path, doc, gz: bool = False, indent: int | None = None) -> Path:
    text = json.dumps(doc, indent=indent)
    if gz:
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


@pytest.mark.parametrize(("modern", "layout", "gz", "indent"), [
    (True, "object", False, None),
    (True, "object", True, 2),
    (False, "object", False, 1),
    (True, "array", False, None),
    (False, "array", True, None),
])
def test_known_answer_in_every_format(tmp_path, modern, layout, gz, indent):
    doc = synthetic_trace(modern=modern)
    content = doc if layout == "object" else doc["traceEvents"]
    path = _write(tmp_path / ("t.json.gz" if gz else "t.json"), content, gz=gz, indent=indent)
    res = analyse_trace(path)
    assert res["steps"] == ["0", "1", "2"]
    want = {"Kernel": 50, "Memcpy": 0, "Memset": 0, "Communication": 0, "Runtime": 10,
            "DataLoader": 20, "CpuOp": 15, "Other": 5, "Total": 100}
    for cat, v in want.items():
        assert res["breakdown_us"][cat] == pytest.approx(v, abs=1e-3), cat
    g = res["gpu"]["0"]
    assert g["utilization"] == pytest.approx(50)  # 150 µs of kernels in 300 µs of steps
    assert g["sm_efficiency"] == pytest.approx(25)  # 0.5 blocks per SM
    assert g["achieved_occupancy"] == pytest.approx(50)
    assert g["tensor_core_pct"] == pytest.approx(100)  # sm80_xmma_gemm
    assert res["launch"]["launch_delay_us"]["median"] == pytest.approx(10)
    assert res["sync"]["share_pct"] == pytest.approx(35)
    assert res["format"]["string_pids"] and res["format"]["float_timestamps"]
    assert res["format"]["layout"] == layout and res["format"]["compressed"] == gz
    t = res["temporal"]["0"]
    if modern:
        # HTA cuts at the latest ProfilerStep start of any non-kernel event, the GPU copy
        # of the last step included: the last kernel's launch (at +30) comes before it (+40).
        assert t["span_us"] == pytest.approx(250) and t["idle_pct"] == pytest.approx(40)
    else:
        assert t["span_us"] == pytest.approx(150)  # last step excluded
        assert t["idle_pct"] == pytest.approx(100 / 3)
    assert t["idle_breakdown"]["host_wait_pct"] == pytest.approx(100)
    causes = {(f["category"], f["cause"]) for f in res["findings"]}
    assert ("input_pipeline", "slow_loading") in causes  # 20% with worker processes
    assert ("synchronization", "explicit_synchronize") in causes


def test_breakdown_in_step_batches_is_the_same(tmp_path, monkeypatch):
    """Large traces are broken down a batch of steps at a time (bounded temporaries)."""
    import trainprof.analysis.trace.tb_breakdown as tb

    path = _write(tmp_path / "t.json", synthetic_trace(n_steps=12))
    whole = analyse_trace(path)["breakdown_per_step_us"]
    monkeypatch.setattr(tb, "BATCH_BOUNDS", 16)
    batched = analyse_trace(path)["breakdown_per_step_us"]
    assert batched == whole and len(whole) == 12


def test_hta_cut_without_gpu_annotations(tmp_path):
    path = _write(tmp_path / "t.json", synthetic_trace(gpu_annotations=False))
    t = analyse_trace(path)["temporal"]["0"]
    assert t["last_step_excluded"] and t["device_events"] == 2
    assert t["span_us"] == pytest.approx(150) and t["compute_pct"] == pytest.approx(200 / 3)


def test_cuda_sync_waits_are_hta_non_compute(tmp_path):
    """Kineto's ``cuda_sync`` events (a stream waiting) are device time for HTA, not compute,
    and stay out of its idle-time breakdown and out of the TensorBoard breakdown."""
    doc = synthetic_trace()
    for e in list(doc["traceEvents"]):
        if e["name"] == "cudaStreamSynchronize":
            doc["traceEvents"].append({
                "ph": "X", "cat": "cuda_sync", "name": "Stream Sync", "pid": 0, "tid": 7,
                "ts": e["ts"] + 30.0, "dur": 4.0,
                "args": {"stream": 7, "device": 0, "correlation": e["args"]["correlation"]}})
    res = analyse_trace(_write(tmp_path / "t.json", doc))
    t = res["temporal"]["0"]
    assert t["non_compute_us"] == pytest.approx(8)  # two waits before the cut (HTA: 6, rounded)
    assert t["idle_us"] == pytest.approx(92) and t["compute_us"] == pytest.approx(150)
    assert t["idle_breakdown"]["host_wait_us"] == pytest.approx(100)
    assert res["breakdown_us"]["Kernel"] == pytest.approx(50, abs=1e-3)


def test_the_profilers_closing_synchronize_is_not_the_users(tmp_path):
    """Kineto synchronizes the device when the profiler stops: a cudaDeviceSynchronize
    starting after the last step's host end waits for that step's queued kernels, inside
    the step as moved onto the device timeline, but it is not the loop's sync."""
    doc = synthetic_trace()
    base, host = 1_700_000_000_000.125, {"pid": "host", "tid": "main"}
    doc["traceEvents"] += [  # step 2 launches a kernel that runs until +500
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", **host,
         "ts": base + 270, "dur": 5.0, "args": {"correlation": 5000}},
        {"ph": "X", "cat": "kernel", "name": "long_kernel", "pid": 0, "tid": 7,
         "ts": base + 290, "dur": 210.0, "args": {"correlation": 5000, "stream": 7}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaDeviceSynchronize", **host,
         "ts": base + 350, "dur": 150.0, "args": {"correlation": 5001}},
    ]
    res = analyse_trace(_write(tmp_path / "t.json", doc))
    assert res["window"]["end_us"] - res["window"]["start_us"] == pytest.approx(500)
    sync = res["sync"]
    assert [c["name"] for c in sync["calls"]] == ["cudaStreamSynchronize"]
    assert sync["per_step_us"] == pytest.approx(35)  # the user's syncs only
    assert sync["profiler_stop"] == {"name": "cudaDeviceSynchronize", "count": 1,
                                     "total_us": pytest.approx(150)}
    assert sum("profiler's own" in n for n in res["notes"]) == 1
    out = io.StringIO()
    render_trace(res, file=out)
    assert "cudaDeviceSynchronize" not in out.getvalue().split("Note")[0]


@needs_more
@pytest.mark.parametrize("path", [
    "hta/ns_res/rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz",
    "hta/negq/rank0.json.gz",
    "tracelens/h100/Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz",
])
def test_no_real_trace_blames_the_user_for_the_profilers_synchronize(path):
    res = analyse_trace(MORE / path)
    stop = res["sync"]["profiler_stop"]
    assert stop["name"] == "cudaDeviceSynchronize" and stop["count"] == 1
    names = [c["name"] for c in res["sync"]["calls"] if c["per_step"]]
    assert "cudaDeviceSynchronize" not in names
    titles = [f["title"] for f in res["findings"] if f["category"] == "synchronization"]
    assert not any("cudaDeviceSynchronize" in t for t in titles)
    if "ns_res" in path or "Qwen" in path:  # their only blocking time was the profiler's
        assert res["sync"]["share_pct"] < 1 and not titles


def _copy_back_trace(dst: str) -> dict:
    """The synthetic trace whose per-step sync is a cudaMemcpyAsync from the device into
    ``dst`` host memory (what ``loss.item()`` makes), its copy at +90 after the kernel."""
    doc = synthetic_trace()
    for e in list(doc["traceEvents"]):
        if e["name"] == "cudaStreamSynchronize":
            e["name"] = "cudaMemcpyAsync"
            doc["traceEvents"].append({
                "ph": "X", "cat": "gpu_memcpy", "name": f"Memcpy DtoH (Device -> {dst})",
                "pid": 0, "tid": 7, "ts": e["ts"] + 30.0, "dur": 4.0,
                "args": {"stream": 7, "device": 0, "bytes": 4,
                         "correlation": e["args"]["correlation"]}})
    return doc


def test_an_async_copy_into_pageable_memory_blocks(tmp_path):
    res = analyse_trace(_write(tmp_path / "t.json", _copy_back_trace("Pageable")))
    (call,) = res["sync"]["calls"]
    assert call["name"] == "cudaMemcpyAsync (DtoH to pageable)" and call["pageable_dtoh"]
    assert call["count"] == 3 and call["per_step"] == pytest.approx(1)
    assert res["sync"]["share_pct"] == pytest.approx(35)
    (f,) = [f for f in res["findings"] if f["category"] == "synchronization"]
    assert f["cause"] == "blocking_memcpy" and "pin_memory=True" in f["fix"]["snippet"]
    assert "pageable" in f["fix"]["text"]
    # into pinned memory the same call is asynchronous: no sync at all
    res = analyse_trace(_write(tmp_path / "p.json", _copy_back_trace("Pinned")))
    assert res["sync"]["calls"] == [] and res["sync"]["share_pct"] == 0
    assert not [f for f in res["findings"] if f["category"] == "synchronization"]


@needs_more
def test_pageable_copies_back_are_the_syncs_of_negq():
    """HTA's negq trace: 30 cudaMemcpyAsync into pageable memory take 758 of the 766 ms
    of cudaMemcpyAsync, each blocking the host about 146 ms."""
    res = analyse_trace(MORE / "hta" / "negq" / "rank0.json.gz")
    top = res["sync"]["calls"][0]
    assert top["name"] == "cudaMemcpyAsync (DtoH to pageable)" and top["count"] == 30
    assert top["total_us"] == pytest.approx(758_000, rel=0.01)
    (f,) = [f for f in res["findings"] if f["category"] == "synchronization"]
    assert f["cause"] == "blocking_memcpy" and "pageable" in f["title"]


def test_no_steps_is_one_window(tmp_path):
    doc = synthetic_trace(n_steps=1)
    doc["traceEvents"] = [e for e in doc["traceEvents"]
                          if not e["name"].startswith("ProfilerStep")]
    res = analyse_trace(_write(tmp_path / "t.json", doc))
    assert res["steps"] == ["0"] and not res["steps_found"]
    assert any("whole trace" in n for n in res["notes"])
    assert res["breakdown_us"]["Total"] == pytest.approx(90)  # CPU span [0, 60] → device end 90
    assert any(f["category"] == "measurement_noise" for f in res["findings"])


def test_tail_steps_without_device_work_are_dropped(tmp_path):
    doc = synthetic_trace(n_steps=4)
    doc["traceEvents"] = [e for e in doc["traceEvents"]
                          if not (e["ts"] >= 1_700_000_000_300 and e["cat"] == "kernel")]
    res = analyse_trace(_write(tmp_path / "t.json", doc))
    assert res["steps"] == ["0", "1", "2"] and res["window"]["removed_tail_steps"] == ["3"]


def test_cpu_only_trace_from_torch_profiler(tmp_path):
    """A real CPU trace from torch.profiler with an input-bound DataLoader."""
    script = tmp_path / "gen.py"
    out = tmp_path / "cpu.pt.trace.json"
    script.write_text(textwrap.dedent(f"""
        import time, torch
        from torch.utils.data import DataLoader, Dataset
        class Slow(Dataset):
            def __len__(self): return 64
            def __getitem__(self, i):
                time.sleep(0.002)
                return torch.randn(16), torch.randint(0, 4, ())
        torch.set_num_threads(1)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.profiler.schedule(wait=1, warmup=1, active=3)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    schedule=sched) as prof:
            for step, (x, y) in enumerate(DataLoader(Slow(), batch_size=4)):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad(); loss.backward(); opt.step()
                prof.step()
                if step == 4:
                    break
        prof.export_chrome_trace({str(out)!r})
    """))
    subprocess.run([sys.executable, str(script)], check=True, capture_output=True, timeout=300)
    res = analyse_trace(out)
    assert res["cpu_only"] and res["gpu"] == {} and res["temporal"] == {}
    assert len(res["steps"]) == 3
    # 4 samples x 2 ms of sleep per batch: the DataLoader dominates the step
    assert res["breakdown_pct"]["DataLoader"] > 50
    assert res["breakdown_us"]["DataLoader"] >= 8000
    assert res["breakdown_us"]["CpuOp"] > 0
    names = [op["name"] for op in res["operators"]]
    assert "aten::addmm" in names or "aten::linear" in names
    top = res["findings"][0]
    assert (top["category"], top["cause"]) == ("input_pipeline", "too_few_workers")
    # a CPU run: no pinned memory for copies to a GPU there is none of, and workers that
    # share the cores with the model are for trainprof tune to prove
    assert "pin_memory" not in top["fix"]["snippet"] and "GPU" not in top["fix"]["text"]
    assert "trainprof tune --knob num_workers=0,2,4" in top["fix"]["text"]
    text = io.StringIO()
    render_trace(res, file=text)
    assert "GPU" not in text.getvalue().split("Top operators")[0].replace("GPU 0", "")


# --- memory (profile_memory=True): per operator and per device -------------------------

def test_memory_of_a_real_cpu_trace(tmp_path):
    """torch.profiler with profile_memory=True: a 16 MB tensor per step, made by
    aten::empty inside a record_function label and freed between ops."""
    script = tmp_path / "gen.py"
    out = tmp_path / "mem.pt.trace.json"
    script.write_text(textwrap.dedent(f"""
        import torch
        torch.set_num_threads(1)
        x = torch.randn(32, 32)
        sched = torch.profiler.schedule(wait=0, warmup=1, active=3, repeat=1)
        with torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                schedule=sched,
                on_trace_ready=lambda p: p.export_chrome_trace({str(out)!r})) as prof:
            for _ in range(4):
                with torch.profiler.record_function("make_big"):
                    big = torch.empty(4_000_000)  # 16,000,000 bytes
                y = (x @ x).relu().sum()
                del big
                prof.step()
    """))
    subprocess.run([sys.executable, str(script)], check=True, capture_output=True, timeout=300)
    res = analyse_trace(out)
    assert len(res["steps"]) == 3
    mem = res["memory"]
    cpu = mem["devices"]["cpu"]
    assert cpu["alloc_bytes_per_step"] >= 16_000_000 and cpu["allocs_per_step"] >= 1
    assert cpu["peak_allocated_bytes"] >= 16_000_000  # the allocator's own total
    assert cpu["freed_bytes"] >= 3 * 16_000_000  # `del big`: frees outside any operator
    assert mem["in_operators"] < mem["events"]
    by_name = {op["name"]: op for op in mem["operators"]}
    empty, label = by_name["aten::empty"], by_name["make_big"]
    assert empty["host_alloc_bytes"] >= 3 * 16_000_000 and empty["host_allocs"] >= 3
    assert empty["device_alloc_bytes"] == 0 and empty["device_allocs"] == 0
    assert label["host_alloc_bytes"] == 0  # the label allocates nothing itself ...
    assert label["host_alloc_total_bytes"] >= 3 * 16_000_000  # ... its aten::empty does
    assert mem["operators"][0]["name"] == "aten::empty"  # the largest allocator first
    row = next(op for op in res["operators"] if op["name"] == "aten::empty")
    assert row["host_alloc_bytes"] == empty["host_alloc_bytes"]
    text = io.StringIO()
    render_trace(res, file=text)
    shown = text.getvalue().split("Top operators by memory")[1]
    assert shown.split("\n")[2].split()[0] == "aten::empty"


def _memory_trace(modern: bool) -> dict:
    """Hand-placed memory records (µs): ProfilerStep#0 [0, 1000) on thread 1 holds `outer`
    [100, 600), which holds aten::empty [150, 200), aten::add [300, 400) and a zero-length
    aten::view at 450; thread 2 runs aten::mul [150, 250)."""
    base = 1_700_000_000_000.0
    op_cat = "cpu_op" if modern else "Operator"
    tid = (lambda t: t) if modern else str  # old traces: string tids on ops, ints on memory

    def op(name, ts, dur, t=1, cat=op_cat):
        return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid(t),
                "ts": base + ts, "dur": dur}

    def rec(ts, nbytes, t=1, device_type=0, total=None):
        e = {"ph": "i", "s": "t", "name": "[memory]", "pid": 7, "tid": t, "ts": base + ts,
             "args": {"Device Type": device_type, "Device Id": -1 if device_type == 0 else 0,
                      "Bytes": nbytes}}
        if modern:
            e["cat"] = "cpu_instant_event"
            e["args"].update({"Total Allocated": total if total is not None else 0,
                              "Total Reserved": 0, "Addr": 123})
        return e

    events = [
        op("ProfilerStep#0", 0, 1000, cat="user_annotation" if modern else op_cat),
        op("outer", 100, 500, cat="user_annotation" if modern else op_cat),
        op("aten::empty", 150, 50), op("aten::add", 300, 100), op("aten::view", 450, 0),
        op("aten::mul", 150, 100, t=2),
        rec(160, 1000),  # aten::empty
        rec(200, 10),  # at aten::empty's end: [start, end) gives it to `outer`
        rec(200, 64, t=2),  # thread 2: aten::mul, not thread 1's aten::empty
        rec(300, 100, device_type=1, total=5000),  # aten::add, on cuda:0
        rec(350, -100, device_type=1, total=4900),  # and freed inside it
        rec(450, 7),  # the zero-length aten::view contains nothing: `outer`
        rec(700, -1000),  # in the step, outside any operator
        rec(2000, 5),  # outside every range
    ]
    return {"traceEvents": events}


@pytest.mark.parametrize("modern", [True, False])
def test_memory_goes_to_the_innermost_operator(tmp_path, modern):
    res = analyse_trace(_write(tmp_path / "t.json", _memory_trace(modern)))
    mem = res["memory"]
    assert mem["events"] == 8 and mem["in_operators"] == 6
    ops = {op["name"]: op for op in res["operators"]}
    assert set(ops) == {"outer", "aten::empty", "aten::add", "aten::view", "aten::mul"}
    want = {  # (host self, host total, host allocs, host net, device self, allocs, net)
        "aten::empty": (1000, 1000, 1, 1000, 0, 0, 0),
        "outer": (17, 1017, 2, 17, 0, 0, 0),
        "aten::add": (0, 0, 0, 0, 100, 1, 0),
        "aten::view": (0, 0, 0, 0, 0, 0, 0),
        "aten::mul": (64, 64, 1, 64, 0, 0, 0),
    }
    for name, w in want.items():
        o = ops[name]
        got = (o["host_alloc_bytes"], o["host_alloc_total_bytes"], o["host_allocs"],
               o["host_net_bytes"], o["device_alloc_bytes"], o["device_allocs"],
               o["device_net_bytes"])
        assert got == w, name
    assert ops["outer"]["device_alloc_total_bytes"] == 100
    assert [o["name"] for o in mem["operators"]] == [
        "aten::add", "aten::empty", "aten::mul", "outer"]  # device bytes first, then host
    cpu, cuda = mem["devices"]["cpu"], mem["devices"]["cuda:0"]
    assert (cpu["allocations"], cpu["alloc_bytes"], cpu["frees"], cpu["freed_bytes"]) == (
        5, 1086, 1, 1000)
    assert cpu["peak_growth_bytes"] == 1081  # 1000 + 10 + 64 + 7 before the free at 700
    assert (cpu["allocs_per_step"], cpu["alloc_bytes_per_step"]) == (4, 1081)  # not t=2000
    assert cpu["in_operators_pct"] == pytest.approx(1081 / 1086 * 100)
    assert (cuda["allocations"], cuda["frees"], cuda["alloc_bytes_per_step"]) == (1, 1, 100)
    assert cuda["peak_allocated_bytes"] == (5000 if modern else None)
    text = io.StringIO()
    render_trace(res, file=text)
    out = text.getvalue()
    assert "Top operators by memory" in out and "cuda:0:" in out


def test_no_memory_events_no_memory_columns(tmp_path):
    res = analyse_trace(_write(tmp_path / "t.json", synthetic_trace()))
    assert res["memory"] is None
    assert not any(k.endswith("_bytes") for op in res["operators"] for k in op)
    text = io.StringIO()
    render_trace(res, file=text)
    assert "by memory" not in text.getvalue() and "Memory" not in text.getvalue()


def test_malformed_memory_records_are_read_or_skipped(tmp_path):
    op = {"ph": "X", "cat": "cpu_op", "name": "aten::empty", "pid": 1, "tid": 1, "ts": 100,
          "dur": 50}

    def rec(**kw):
        return {"ph": "i", "name": "[memory]", "pid": 1, "tid": 1, "ts": 110, **kw}

    events = [
        op,
        rec(args={"Bytes": "64", "Device Type": "0"}),  # numbers as strings: read
        rec(ts="130", args={"Bytes": 8, "Device Type": 1.0, "Device Id": 0}),  # read
        rec(args={"Bytes": None}), rec(), rec(args=[1, 2]),  # no size: skipped
        rec(args={"Bytes": 8, "Device Type": 1e300, "Total Allocated": "x"}),  # skipped
        rec(ts=1e300, args={"Bytes": 1}), rec(args={"Bytes": 2**70}),  # nonsense: skipped
    ]
    res = analyse_trace(_write(tmp_path / "t.json", {"traceEvents": events}))
    mem = res["memory"]
    assert mem["events"] == 2 and set(mem["devices"]) == {"cpu", "cuda:0"}
    assert (res["operators"][0]["host_alloc_bytes"], res["operators"][0]["device_alloc_bytes"]
            ) == (64, 8)


@needs_traces
@needs_more
def test_memory_summary_of_a_modern_cuda_trace():
    """TraceLens's H100 trace (modern records with the allocator's totals) against a
    direct reading of its JSON."""
    path = MORE / "tracelens" / "h100" / "gaunernst_bert-small-uncased__1016001.json.gz"
    raw = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    recs = [e["args"] for e in raw if e.get("name") == "[memory]" and e.get("ph") == "i"]
    cuda = [a for a in recs if a["Device Type"] == 1 and a["Device Id"] == 0]
    assert cuda and len(cuda) < len(recs)
    got = analyse_trace(path)["memory"]
    assert got["events"] == len(recs)
    dev = got["devices"]["cuda:0"]
    assert dev["peak_allocated_bytes"] == max(a["Total Allocated"] for a in cuda)
    assert dev["peak_reserved_bytes"] == max(a["Total Reserved"] for a in cuda)
    assert dev["allocations"] == sum(a["Bytes"] > 0 for a in cuda)
    assert dev["alloc_bytes"] == sum(a["Bytes"] for a in cuda if a["Bytes"] > 0)
    assert dev["frees"] == sum(a["Bytes"] < 0 for a in cuda)
    ops = got["operators"]
    assert ops and ops[0]["device_alloc_bytes"] > 0
    assert sum(o["device_alloc_bytes"] for o in ops) <= dev["alloc_bytes"]


@needs_traces
def test_vectorised_memory_attribution_matches_brute_force():
    """innermost_op against a direct search on the shared trace's 12,838 memory records."""
    from trainprof.analysis.trace.correlate import Links
    from trainprof.analysis.trace.events import load_events
    from trainprof.analysis.trace.operators import innermost_op, op_tree

    ev, _ = load_events(TB / "nw0-steps5-10.pt.trace.json.gz")
    m = ev.memory
    assert m is not None and len(m) == 12838 and set(m.device_type.tolist()) == {0, 1}
    rows = Links(ev).op_rows
    parent, depth = op_tree(ev, rows)
    got = innermost_op(ev, rows, parent, m.thread, m.ts)
    start, end, thread = ev.ts[rows], ev.end[rows], ev.thread[rows]
    rng = np.random.default_rng(0)
    for i in rng.choice(len(m), 400, replace=False).tolist():
        inside = np.flatnonzero((thread == m.thread[i]) & (start <= m.ts[i]) & (m.ts[i] < end))
        if inside.size == 0:
            assert got[i] == -1
            continue
        want = inside[np.argmax(depth[inside])]
        assert got[i] >= 0 and depth[got[i]] == depth[want]
        assert (start[got[i]], end[got[i]]) == (start[want], end[want])
    # allocations happen inside ops; the unattributed records are frees between them
    assert (got[m.nbytes > 0] >= 0).mean() > 0.999 and (got >= 0).mean() > 0.7


# --- malformed input: a one-line error (exit 2) or an analysis of what is there --------

def _cli(path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainprof", "trace", str(path), *extra],
        capture_output=True, text=True, timeout=120,
    )


@pytest.mark.parametrize("args", [("trace", "T", "--json"), ("trace", "T")])
def test_a_reader_that_leaves_ends_the_command_quietly(tmp_path, args):
    """``trainprof trace T --json | head -c 100``: the pipe is closed before trainprof
    writes, so every write (and the last flush) meets it; no traceback, status 141."""
    path = _write(tmp_path / "t.json", synthetic_trace())
    argv = [str(path) if a == "T" else a for a in args]
    proc = subprocess.Popen([sys.executable, "-m", "trainprof", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader leaves before anything is written
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and err == b""


BAD_INPUTS = {
    "empty.json": b"",
    "blank.json": b"  \n\t ",
    "not_json.json": b"hello world",
    "binary.json": bytes(range(256)) * 4,
    "object.json": b'{"a": 1, "b": [1, 2]}',
    "number.json": b"42",
    "events_not_list.json": b'{"traceEvents": {"ph": "X"}}',
    "events_numbers.json": b'{"traceEvents": [1, 2, 3]}',
    "events_empty.json": b'{"traceEvents": []}',
    "no_complete_events.json": b'{"traceEvents": [{"ph": "i", "name": "x", "ts": 1}]}',
    "gzip_of_text.json.gz": gzip.compress(b"this is not json"),
    "bad_gzip.json.gz": b"\x1f\x8b\x08\x00garbage that is not deflate",
    "header_only_truncated.json": b'{"schemaVersion": 1, "traceEv',
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_malformed_input_is_one_error_line(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(BAD_INPUTS[name])
    for extra in ((), ("--json",)):
        proc = _cli(path, *extra)
        assert proc.returncode == 2, (name, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
        assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.mark.parametrize(("head", "says"), [
    (b"<!DOCTYPE html>\n<html lang=\"en\"><head><title>trainprof \xc2\xb7 train</title>",
     "trainprof's HTML report, not a trace (open it in a browser); trainprof trace reads a "
     "torch.profiler / Kineto trace: Chrome-trace JSON, plain or gzipped, or a folder of them"),
    (b"<html><body>a page</body></html>", "an HTML page, not a trace; trainprof trace reads a "
     "torch.profiler / Kineto trace: Chrome-trace JSON, plain or gzipped, or a folder of them"),
    (b"hello\nworld, some text", "not a JSON trace (it starts with 'hello world, some text')"),
    (bytes(range(256)), "not a JSON trace (binary data)"),
])
def test_what_a_file_that_is_no_json_trace_is_said_to_be(tmp_path, head, says):
    path = tmp_path / "report.html"
    path.write_bytes(head)
    with pytest.raises(UsageError) as err:
        analyse_trace(path)
    assert str(err.value) == f"{path}: {says}"


def test_missing_path_and_empty_directory(tmp_path):
    for path in (tmp_path / "nope.json", tmp_path):
        proc = _cli(path)
        assert proc.returncode == 2 and proc.stderr.startswith("error: ")
        assert len(proc.stderr.strip().splitlines()) == 1


def test_directory_skips_files_that_are_not_traces(tmp_path):
    _write(tmp_path / "rank0.json", synthetic_trace())
    (tmp_path / "notes.json").write_text('{"comment": "not a trace"}')
    (tmp_path / "readme.txt").write_text("ignored: not *.json")
    doc = analyse_trace(tmp_path)
    assert doc["steps"] == ["0", "1", "2"] and doc["rank"] == 0
    assert any(w.startswith("skipped") and "notes.json" in w for w in doc["warnings"])


def test_usage_error_from_the_library(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"traceEvents": 5}')
    with pytest.raises(UsageError, match="not an array"):
        analyse_trace(path)


@pytest.mark.parametrize("gz", [False, True])
def test_truncated_trace_is_analysed_up_to_the_cut(tmp_path, gz):
    text = json.dumps(synthetic_trace(n_steps=6), indent=1).encode()
    cut = text[: int(len(text) * 0.7)]
    path = tmp_path / ("t.json.gz" if gz else "t.json")
    path.write_bytes(gzip.compress(text)[: int(len(gzip.compress(text)) * 0.7)] if gz else cut)
    proc = _cli(path, "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["format"]["truncated"]
    assert any("truncated" in w for w in doc["warnings"])
    assert 1 <= len(doc["steps"]) < 6
    assert doc["breakdown_us"]["Kernel"] == pytest.approx(50, abs=1e-3)


def test_loose_types_are_read_or_skipped(tmp_path):
    """Timestamps as strings, a numeric name, missing durations: read what makes sense."""
    doc = synthetic_trace()
    doc["traceEvents"][0]["ts"] = str(doc["traceEvents"][0]["ts"])
    doc["traceEvents"].append({"ph": "X", "cat": "cpu_op", "name": 7, "pid": 1, "tid": 1,
                               "ts": 1_700_000_000_010.0})
    doc["traceEvents"].append({"ph": "X", "cat": "cpu_op", "name": "no_ts"})
    doc["traceEvents"].append("not an event")
    res = analyse_trace(_write(tmp_path / "t.json", doc))
    assert res["steps"] == ["0", "1", "2"]
    assert res["breakdown_us"]["Kernel"] == pytest.approx(50, abs=1e-3)


def test_cli_json_is_one_document(tmp_path):
    path = _write(tmp_path / "t.json", synthetic_trace())
    proc = _cli(path, "--json")
    assert proc.returncode == 0
    doc = json.loads(proc.stdout)
    assert {"steps", "breakdown_us", "gpu", "temporal", "findings"} <= set(doc)
    assert set(doc["breakdown_us"]) == set(CATEGORIES)
    assert {"utilization", "sm_efficiency", "achieved_occupancy", "tensor_core_pct"} <= set(
        doc["gpu"]["0"])
    assert {"idle_pct", "compute_pct", "non_compute_pct"} <= set(doc["temporal"]["0"])
    proc = _cli(path)
    assert proc.returncode == 0 and "Step-time breakdown" in proc.stdout
    assert max(len(line) for line in proc.stdout.splitlines()) <= 120  # not a tty: 120 wide


# --- the pieces -----------------------------------------------------------------------

def test_interval_helpers_against_brute_force():
    rng = np.random.default_rng(7)
    grid = np.arange(0, 260)

    def rand_set(n):
        s = rng.integers(0, 200, n)
        return s, s + rng.integers(0, 30, n)

    def mask(st, en):
        m = np.zeros(grid.size, bool)
        for x, y in zip(st, en, strict=True):
            m[x:y] = True
        return m

    for _ in range(20):
        a, b = rand_set(15), rand_set(12)
        ua, ub = iv.union(*a), iv.union(*b)
        assert iv.total(*ua) == mask(*a).sum()
        assert iv.total(*iv.intersect(ua, ub)) == (mask(*a) & mask(*b)).sum()
        assert iv.total(*iv.subtract(ua, ub)) == (mask(*a) & ~mask(*b)).sum()
        assert (np.diff(ua[0]) > 0).all() and (ua[0][1:] > ua[1][:-1]).all()  # disjoint
        vals = rng.random(15) * 0.8
        level = np.zeros(grid.size)
        for x, y, v in zip(*a, vals, strict=True):
            level[x:y] += v
        want = np.minimum(level[20:180], 1.0).sum()
        assert iv.weighted_level_time(a[0], a[1], vals, 20, 180) == pytest.approx(want)


@needs_traces
@needs_more
def test_vectorised_op_tree_matches_a_stack_sweep():
    from trainprof.analysis.trace.correlate import Links
    from trainprof.analysis.trace.events import load_events
    from trainprof.analysis.trace.operators import _op_tree_loop, op_tree

    for path in (TB / "nw4-steps5-10.pt.trace.json.gz",
                 MORE / "tracelens" / "h100" / "gaunernst_bert-small-uncased__1016001.json.gz"):
        ev, _ = load_events(path)
        rows = Links(ev).op_rows
        parent, depth = op_tree(ev, rows)
        parent2, depth2 = _op_tree_loop(ev, rows)
        assert (parent == parent2).all() and (depth == depth2).all()
        assert depth.max() >= 3


@pytest.mark.parametrize(("name", "tc"), [
    ("volta_h884gemm_64x128_ldg8_nn", True),  # the plugin's list
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", True),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x6_tn>", True),
    ("void pytorch_flash::flash_fwd_kernel<pytorch_flash::Flash_fwd_kernel_traits<64>>", True),
    ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NTN", True),
    ("Cijk_Alik_Bljk_SB_Bias_AS_SAV_UserArgs_MT64x16x32_MI16x16x1_SN_LDSB0", True),  # AMD MFMA
    ("void cutlass::Kernel2<cutlass_80_simt_sgemm_128x32_8x5_nn_align1>", False),
    ("volta_sgemm_128x64_nn", False),
    ("ampere_sgemm_128x64_nn", False),
    ("void implicit_convolve_sgemm<float, float, 1024, 6, 7, 3, 3, 5, 1, false>", False),
])
def test_tensor_core_kernel_names(name, tc):
    assert uses_tensor_cores(name) is tc


def test_diagnose_trace_tolerates_sparse_documents():
    assert diagnose_trace({}) == [] or all("category" in f for f in diagnose_trace({}))
    doc = {"breakdown_us": {"DataLoader": 50.0, "Total": 100.0}, "steps": ["1", "2", "3"],
           "steps_found": True}
    found = diagnose_trace(doc)
    assert found[0]["category"] == "input_pipeline" and found[0]["severity"] == "high"
    assert found[0]["estimated_gain"] == pytest.approx(0.5)


# --- speed and memory -----------------------------------------------------------------

@needs_traces
def test_speed_of_the_35mb_trace():
    """The goal is 0.25 s (wall, idle machine; see benchmarks/trace_analysis.py); the test
    takes the best CPU time of three runs with a wide margin, for busy CI machines."""
    path = TB / "nw0-steps5-10.pt.trace.json.gz"
    best = min(_cpu_time(lambda: analyse_trace(path)) for _ in range(3))
    assert best < 0.75, best


def _cpu_time(fn) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def _write_large_trace(path: Path, n_steps: int, ops_per_step: int = 400) -> None:
    """A large modern trace written incrementally (each op launches one kernel)."""
    with gzip.open(path, "wt", compresslevel=1) as f:
        f.write('{"schemaVersion": 1, "traceEvents": [\n')
        t, ext = 1_000_000.0, 0
        for k in range(n_steps):
            length = ops_per_step * 30.0 + 100
            rows = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{k}", "pid": 1,
                     "tid": 1, "ts": t, "dur": length}]
            s = t + 50
            for _ in range(ops_per_step):
                ext += 1
                rows += [
                    {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1,
                     "ts": s, "dur": 25.5, "args": {
                         "External id": ext, "Input Dims": [[256, 1024], [256, 1024], []],
                         "Input type": ["float", "float", "Scalar"], "Ev Idx": ext}},
                    {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1,
                     "tid": 1, "ts": s + 5, "dur": 6.25,
                     "args": {"External id": ext, "cbid": 211, "correlation": ext}},
                    {"ph": "X", "cat": "kernel", "pid": 0, "tid": 7, "ts": s + 12, "dur": 14.0,
                     "name": "void at::native::vectorized_elementwise_kernel<4, "
                             "at::native::CUDAFunctor_add<float>>(int, at::native::Array)",
                     "args": {"External id": ext, "device": 0, "stream": 7, "correlation": ext,
                              "registers per thread": 16, "grid": [1024, 1, 1],
                              "block": [128, 1, 1], "blocks per SM": 4.5,
                              "est. achieved occupancy %": 100}},
                ]
                s += 30
            f.write(("" if k == 0 else ",\n") + ",\n".join(json.dumps(r) for r in rows))
            t += length + 10
        f.write('\n], "traceName": "large"}\n')


def test_large_trace_in_bounded_memory(tmp_path):
    """Streaming: peak RSS growth stays under the JSON size (the goal: at most 2x)."""
    path = tmp_path / "large.json.gz"
    _write_large_trace(path, n_steps=90)
    probe = textwrap.dedent(f"""
        import json, resource
        from pathlib import Path
        from trainprof.analysis.trace import analyse_trace
        import trainprof.analysis.trace.analyse, trainprof.diagnosis.trace_rules  # imports first
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        doc = analyse_trace(Path({str(path)!r}))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(json.dumps({{"growth": peak - base, "json": doc["format"]["json_bytes"],
                           "steps": len(doc["steps"]), "kernel": doc["breakdown_us"]["Kernel"]}}))
    """)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["json"] > 25_000_000
    assert got["steps"] == 90
    assert got["kernel"] == pytest.approx(400 * 14.0)
    assert got["growth"] < 1.25 * got["json"], got


def test_no_number_of_the_trace_tables_is_cut_at_80_columns(tb_results, monkeypatch):
    """Off a wide terminal rich shrank every column of a table too wide, numbers too
    (``588…``, ``cal…``); now the operator and kernel names give up the room."""
    import re

    monkeypatch.setenv("COLUMNS", "80")
    out = io.StringIO()
    render_trace(tb_results["nw0-steps5-10.pt.trace.json.gz"], file=out)
    text = out.getvalue()
    # a number, a unit or a column header ending in an ellipsis
    assert not re.findall(r"[\d,.]+…|\b(?:µs|ms|MiB|GiB|calls|self|total)…", text), text
    assert re.search(r"aten::cudnn_convolution\S*\s+318\s+\d+\.\d ms", text)
    assert "    162  80.8 ms  13.7%  498 µs" in text  # the top kernel's row, whole
