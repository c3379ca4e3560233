"""Mixed precision on the CPU: the autocast knob, the op count's float32 products, the rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_diagnosis import MS, make_steps, make_summary

from trainprof.capture.fingerprint import _cpu_bf16
from trainprof.capture.knobs import ENV_VAR, Knobs, parse_value
from trainprof.diagnosis import diagnose
from trainprof.errors import UsageError
from trainprof.experiments import tune as tune_mod
from trainprof.store import load_run

MLP = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                      nn.Linear(256, 4))
loss_fn = nn.CrossEntropyLoss()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
dtypes = set()
for step in range(16):
    out = model(torch.randn(32, 64))
    dtypes.add(str(out.dtype))
    loss = loss_fn(out, torch.randint(0, 4, (32,)))
    opt.zero_grad()
    loss.backward()
    opt.step()
print("DTYPES", sorted(dtypes), "PARAMS", model[0].weight.dtype, flush=True)
"""


def _line(res, tag: str) -> str:
    return next(x for x in (res.stdout + res.stderr).splitlines() if x.startswith(tag))


@pytest.mark.parametrize("value", ["off", "bf16"])
def test_the_autocast_knob_runs_the_models_calls_in_bfloat16(tp, value):
    res = tp(MLP, "--json", env={ENV_VAR: json.dumps({"autocast": value})})
    assert res.returncode == 0, res.stderr
    dtype = "torch.bfloat16" if value == "bf16" else "torch.float32"
    # the outputs in the knob's precision, the parameters float32 all along
    assert _line(res, "DTYPES") == f"DTYPES ['{dtype}'] PARAMS torch.float32"
    meta = load_run(res.run_dir).meta
    # the model and the loss module, 16 steps: outermost calls only, none of the layers'
    assert meta["knobs"]["process"]["autocast"] == {
        "value": value, "calls": 32, "device_types": {"cpu": 32}}
    assert tune_mod._actual("autocast", meta) == f"{value} (32 model calls, cpu)"
    # the op count's window (steps 8-9) sees the products in float32 only without it
    ops = res.json()["ops"]
    assert ops["matmul_per_step"] == 3
    assert ops["cpu_fp32_matmul_per_step"] == (3 if value == "off" else 0)
    # 2 x 32 x (64 x 256 + 256 x 256 + 256 x 4) FLOPs, none of them a large product
    assert ops["cpu_fp32_matmul_flops_per_step"] == (
        2 * 32 * (64 * 256 + 256 * 256 + 256 * 4) if value == "off" else 0)
    assert ops["cpu_fp32_big_matmul_flops_per_step"] == 0


def test_the_knob_is_undone_and_parses_its_values():
    from torch import nn

    call = nn.Module.__dict__["__call__"]
    layer = nn.Linear(4, 4)
    knobs = Knobs({"autocast": "bf16"}).install()
    try:
        assert layer(torch.ones(2, 4)).dtype == torch.bfloat16
    finally:
        record = knobs.uninstall()
    assert nn.Module.__dict__["__call__"] is call
    assert layer(torch.ones(2, 4)).dtype == torch.float32
    assert record["process"]["autocast"]["calls"] == 1
    assert parse_value("autocast", "bfloat16") == "bf16"
    with pytest.raises(UsageError, match="autocast"):
        parse_value("autocast", "fp16")


def test_the_cpus_bfloat16_instructions_are_read_from_its_flags(tmp_path: Path):
    info = tmp_path / "cpuinfo"
    info.write_text("model name : X\nflags : fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16\n")
    assert _cpu_bf16(str(info)) == "amx_bf16"
    info.write_text("flags : fpu avx2 avx512f avx512_bf16\n")
    assert _cpu_bf16(str(info)) == "avx512_bf16"
    info.write_text("flags : fpu avx2 avx512f\n")
    assert _cpu_bf16(str(info)) is None
    assert _cpu_bf16(str(tmp_path / "missing")) is None


def _summary(flag: str | None, fp32: float = 3.0, matmuls: float = 3.0,
             flops: float = 4e9, big: float = 3e9):
    steps = make_steps(60, data=0.5 * MS, forward=3 * MS, backward=5 * MS, optimizer=1.5 * MS)
    summary = make_summary(steps)
    summary["environment"]["cpu_bf16"] = flag
    summary["ops"] = {"matmul_per_step": matmuls, "cpu_fp32_matmul_per_step": fp32,
                      "cpu_fp32_matmul_flops_per_step": flops,
                      "cpu_fp32_big_matmul_flops_per_step": big}
    return summary, steps


def _findings(summary, steps):
    return [f for f in diagnose(summary, steps) if f["cause"] == "float32_on_bf16_cpu"]


def test_float32_products_on_a_bf16_cpu_get_autocast_with_the_instructions_bound():
    (f,) = _findings(*_summary("avx512_bf16"))
    model = f["evidence"]["model_share"]
    assert model == pytest.approx(0.8, abs=0.02)  # (3 + 5) of 10 ms
    # the large products hold 3 of the 4 GFLOP a step
    assert f["estimated_gain"] == pytest.approx(model / 2 * 0.75, abs=1e-4)
    assert f["evidence"]["mflop_per_product"] == pytest.approx(4e9 / 3 / 1e6, abs=1)
    assert f["category"] == "compute" and f["severity"] == "high"
    assert 'torch.autocast("cpu", dtype=torch.bfloat16)' in f["fix"]["snippet"]
    assert "--knob autocast=off,bf16" in f["verify"]
    (f,) = _findings(*_summary("amx_bf16"))
    assert f["estimated_gain"] == pytest.approx(model * 15 / 16 * 0.75, abs=1e-4)
    assert "AMX" in f["title"]


def test_no_native_bf16_small_products_mostly_in_autocast_or_cuda_get_nothing():
    assert not _findings(*_summary(None))
    assert not _findings(*_summary("avx512_bf16", big=0.0))  # products too small to gain
    assert not _findings(*_summary("avx512_bf16", fp32=1.0, matmuls=3.0))
    summary, steps = _summary("avx512_bf16")
    summary["ops"] = None  # no op-count window: the products' dtypes unknown
    assert not _findings(summary, steps)
    summary, steps = _summary("avx512_bf16")
    summary["environment"].update(cuda="12.4", gpu="NVIDIA H100", gpu_count=1)
    summary["system"]["gpu"] = [{"index": 0, "util_pct": 90.0}]
    assert not _findings(summary, steps)


AUTOCAST_MLP = MLP.replace(
    "    out = model(torch.randn(32, 64))",
    "    with torch.autocast(\"cpu\", dtype=torch.bfloat16):\n"
    "        out = model(torch.randn(32, 64))")


def test_the_scripts_own_cpu_autocast_is_counted_and_small_products_get_the_converse(tp):
    """A script that runs its model under CPU bfloat16 autocast: the op count sees its 3
    products a step under autocast, with their FLOPs, none large; the rule says autocast
    loses here, and its verify line compares the model's calls with autocast off."""
    res = tp(AUTOCAST_MLP, "--json")
    assert res.returncode == 0, res.stderr
    assert _line(res, "DTYPES") == "DTYPES ['torch.bfloat16'] PARAMS torch.float32"
    doc = res.json()
    ops = doc["ops"]
    assert ops["matmul_per_step"] == 3 and ops["cpu_fp32_matmul_per_step"] == 0
    assert ops["cpu_autocast_matmul_per_step"] == 3
    assert ops["cpu_autocast_matmul_flops_per_step"] == 2 * 32 * (64 * 256 + 256 * 256 + 256 * 4)
    assert ops["cpu_autocast_big_matmul_flops_per_step"] == 0
    assert ops["cpu_autocast_dtype"] == "bfloat16"
    (f,) = [f for f in doc["findings"] if f["cause"] == "autocast_loses_on_cpu"]
    model = f["evidence"]["model_share"]
    assert f["estimated_gain"] == pytest.approx(model * (1 - 1 / 1.81), abs=1e-3)
    assert "--knob autocast=script,off" in f["verify"]
    assert "the script's own bfloat16 autocast" in f["verify"]
    assert "enabled=use_autocast" in f["fix"]["snippet"]


F16_MLP = MLP.replace(
    "    out = model(torch.randn(32, 64))",
    "    with torch.autocast(\"cpu\", dtype=torch.float16):\n"
    "        out = model(torch.randn(32, 64))")


@pytest.mark.parametrize(("value", "dtype"), [("script", "float16"), ("off", "float32")])
def test_the_autocast_knobs_script_value_keeps_the_scripts_own_float16(tp, value, dtype):
    """verify's baseline for a float16 CPU script was the knob's bf16 (29% saved where the
    script's own float16 lost ~77%): ``script`` installs nothing, so the script's own
    float16 autocast runs as written, and ``off`` turns it off around the model's calls."""
    res = tp(F16_MLP, "--json", env={ENV_VAR: json.dumps({"autocast": value})})
    assert res.returncode == 0, res.stderr
    assert _line(res, "DTYPES") == f"DTYPES ['torch.{dtype}'] PARAMS torch.float32"
    meta = load_run(res.run_dir).meta
    process = (meta.get("knobs") or {}).get("process") or {}
    if value == "script":
        assert "autocast" not in process  # no wrapper at all
        assert tune_mod._actual("autocast", meta) == "script's"
    else:
        assert process["autocast"]["calls"] == 32


def test_the_autocast_knob_in_process_script_leaves_float16_and_off_disables_it():
    from torch import nn

    layer = nn.Linear(4, 4)
    for text, dtype in (("script", torch.float16), ("off", torch.float32)):
        knobs = Knobs({"autocast": parse_value("autocast", text)}).install()
        try:
            with torch.autocast("cpu", dtype=torch.float16):
                assert layer(torch.ones(2, 4)).dtype == dtype, text
        finally:
            record = knobs.uninstall()
        assert ("autocast" in record["process"]) == (text == "off")


def test_verify_measures_from_the_scripts_own_autocast():
    """A run that left autocast to the script (``_actual``: "script's") has ``script`` as
    its current value: verify puts it first, as the baseline, however the spec is written."""
    from trainprof.experiments.verify import current_first

    meta = {"knobs": {"process": {}}, "training_thread": {}}
    assert current_first(["autocast=off,script"], meta) == ["autocast=script,off"]
    assert current_first(["autocast=script,off"], meta) == ["autocast=script,off"]
    (f,) = _converse(*_autocast_summary(None, dtype="float16", flops=4e9, big=3e9))
    assert "--knob autocast=script,off" in f["verify"]
    assert "the script's own float16 autocast" in f["verify"]


def _autocast_summary(flag: str | None, dtype: str = "bfloat16", under: float = 3.0,
                      flops: float = 13e6, big: float = 0.0):
    summary, steps = _summary(flag, fp32=0.0)
    summary["ops"].update(cpu_autocast_matmul_per_step=under, cpu_autocast_dtype=dtype,
                          cpu_autocast_matmul_flops_per_step=flops,
                          cpu_autocast_big_matmul_flops_per_step=big)
    return summary, steps


def _converse(summary, steps):
    return [f for f in diagnose(summary, steps) if f["cause"] == "autocast_loses_on_cpu"]


def test_cpu_autocast_loses_on_small_products_or_without_native_bf16_only():
    (small,) = _converse(*_autocast_summary("avx512_bf16"))
    model = small["evidence"]["model_share"]
    assert small["estimated_gain"] == pytest.approx(model * (1 - 1 / 1.81), abs=1e-4)
    assert "small matrix products" in small["title"]
    # large products on a native CPU: autocast is right there (the other rule's case)
    assert not _converse(*_autocast_summary("amx_bf16", flops=4e9, big=3e9))
    # the same large products with no bfloat16 instructions: emulated, all of them lose
    (emulated,) = _converse(*_autocast_summary(None, flops=4e9, big=3e9))
    assert emulated["estimated_gain"] == pytest.approx(model * (1 - 1 / 1.81), abs=1e-4)
    assert "without native bfloat16" in emulated["title"]
    # a few products under autocast, most outside it; sizes unknown; on CUDA: nothing
    assert not _converse(*_autocast_summary("avx512_bf16", under=1.0))
    assert not _converse(*_autocast_summary("avx512_bf16", flops=0.0))
    summary, steps = _autocast_summary("avx512_bf16")
    summary["environment"].update(cuda="12.4", gpu="NVIDIA H100", gpu_count=1)
    summary["system"]["gpu"] = [{"index": 0, "util_pct": 90.0}]
    assert not _converse(summary, steps)
    # records before the field: no dtype, no finding
    summary, steps = _autocast_summary("avx512_bf16")
    del summary["ops"]["cpu_autocast_dtype"]
    assert not _converse(summary, steps)
