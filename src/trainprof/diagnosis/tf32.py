"""float32 matrix products on an Ampere-or-newer GPU with TF32 off.

Source (expert-rules.md): C3 — "FP32 GEMM without TF32 on sm_80+ →
``allow_tf32`` / ``set_float32_matmul_precision("high")``" (TorchTidy, the PyTorch
tuning guide, Hugging Face); no peer publishes a threshold. torch runs float32 matmuls
in full precision by default since 1.12 (``torch.get_float32_matmul_precision()`` is
"highest"); convolutions may use TF32 unless ``torch.backends.cudnn.allow_tf32`` is
off. A ``--deep`` trace tells it from the kernels (the tensor-core finding,
:mod:`trainprof.diagnosis.trace_rules`); without one, the op count's window
(:mod:`trainprof.capture.opcount`) sees the matrix products a model calls from
Python, whether their input is float32 on CUDA outside autocast, and the switches as
the script left them; the fingerprint gives the GPU's compute capability (TF32 from
8.0 on).

Gain, an upper estimate: the device's forward + backward share, times the part of the
window's matrix products and convolutions that would run in TF32 (calls, not time:
backward's products are not seen, and forward's stand in for them), times
``1 - 1/3``: Hugging Face's performance guide and transformers#14450 quote "~3x" for
training in TF32 over float32 on an A100 (NVIDIA's peak figures differ by 8x: an
upper bound the whole step never reaches). Not measured here (no GPU in this project's
CI): the ``verify`` line's knob measures it. Bands: ≥ 15% high, ≥ 5% medium, else low.
"""

from __future__ import annotations

from typing import Any

from trainprof.diagnosis.context import Context, number
from trainprof.diagnosis.device import device_breakdown, used_cuda
from trainprof.diagnosis.finding import Finding, Fix, band
from trainprof.diagnosis.registry import rule

HIGH, MEDIUM = 0.15, 0.05
#: training speed-up from TF32 over float32 that the gain assumes (module docstring)
TF32_SPEEDUP = 3.0
#: the first compute capability with TF32 tensor cores (Ampere)
TF32_CAPABILITY = 8.0


def _capability(value: Any) -> float | None:
    try:
        major, _, minor = str(value).partition(".")
        return int(major) + int(minor or 0) / 10
    except ValueError:
        return None


@rule("tf32.fp32_matmuls")
def fp32_matmuls_without_tf32(ctx: Context) -> Finding | None:
    ops = ctx.summary.get("ops")
    if not isinstance(ops, dict) or not used_cuda(ctx):
        return None
    cap = _capability(ctx.environment.get("gpu_capability"))
    if cap is None or cap < TF32_CAPABILITY:
        return None
    full_matmul = ops.get("float32_matmul_precision") == "highest"
    conv_off = ops.get("cudnn_allow_tf32") is False
    matmuls = (number(ops.get("cuda_fp32_matmul_per_step")) or 0.0) if full_matmul else 0.0
    convs = (number(ops.get("cuda_fp32_conv2d_per_step")) or 0.0) if conv_off else 0.0
    if matmuls + convs <= 0 or "compute" in ctx.deep_categories:
        return None  # nothing TF32 would run, or the trace's tensor-core finding says it
    heavy = sum(number(ops.get(k)) or 0.0 for k in ("matmul_per_step", "conv2d_per_step"))
    part = min(1.0, (matmuls + convs) / heavy) if heavy > 0 else 1.0
    bd = device_breakdown(ctx)
    src = bd or ctx.breakdown
    compute = float(number(src.get("forward")) or 0.0) + float(number(src.get("backward")) or 0.0)
    gain = compute * part * (1 - 1 / TF32_SPEEDUP)
    evidence: dict[str, Any] = {
        "fp32_matmuls_per_step": matmuls,
        "fp32_conv2d_without_tf32_per_step": convs,
        "matmul_and_conv2d_per_step": heavy,
        "float32_matmul_precision": ops.get("float32_matmul_precision"),
        "cudnn_allow_tf32": ops.get("cudnn_allow_tf32"),
        "gpu": ctx.environment.get("gpu"),
        "gpu_capability": ctx.environment.get("gpu_capability"),
        "forward_backward_share": round(compute, 4),
        "assumed_speedup": TF32_SPEEDUP,
    }
    what = " and ".join(
        w for w, n in ((f"{matmuls:.0f} float32 matrix products", matmuls),
                       (f"{convs:.0f} float32 convolutions", convs)) if n)
    title = (f"{what} per step run without TF32 on a GPU with TF32 tensor cores "
             f"({ctx.environment.get('gpu') or 'compute capability ' + str(cap)})")
    text = (
        "This GPU (compute capability 8.0 or newer) runs float32 matrix products on its "
        "TF32 tensor cores when allowed: inputs rounded to a 10-bit mantissa, float32 "
        "range and accumulation, which most training converges with as in float32. torch "
        "does not allow it for matmuls by default"
        + (", and this script turned it off for convolutions" if convs else "")
        + ". Allow it once at start-up; for more, train in bfloat16 with torch.autocast."
    )
    snippet = ('torch.set_float32_matmul_precision("high")  # TF32 for float32 matmuls\n'
               "torch.backends.cudnn.allow_tf32 = True        # and convolutions")
    tune = f"trainprof tune --knob tf32=false,true {ctx.script}"
    autocast = f"trainprof tune --knob autocast=off,bf16 {ctx.script}"
    verify = (f"{tune}  (the forward and backward device time should fall); bfloat16 "
              f"autocast, measured the same way: {autocast}")
    return Finding(category="compute", cause="fp32_without_tf32", title=title,
                   severity=band(gain, HIGH, MEDIUM) or "low", evidence=evidence,
                   estimated_gain=round(gain, 4), fix=Fix(text=text, snippet=snippet),
                   verify=verify, verify_commands=(tune, autocast))
