"""A model that computes in float64: twice the bytes and a fraction of float32's throughput.

float64 rarely reaches a model on purpose. NumPy makes float64 arrays by default,
``torch.from_numpy`` keeps the dtype, and the error that follows ("expected scalar type
Double but found Float", "mat1 and mat2 must have the same dtype") is most easily
silenced with ``model.double()``. Every matrix product and convolution then runs in
float64: a CPU's SIMD units hold half as many float64 lanes as float32 ones (4 against 8
with AVX2, 8 against 16 with AVX-512), so BLAS peaks at half the rate; GPUs other than
the data-centre parts run float64 at 1/32 to 1/64 of their float32 rate, and no GPU runs
it on TF32 or 16-bit tensor cores.

Evidence: the op count's window (:mod:`trainprof.capture.opcount`) counts the matrix
products and convolutions called from Python whose first tensor is float64, and the
FLOPs of all of them from their shapes. The gain bound is the model's share of the step
(forward and backward; on a CUDA run the device's) times, on a CPU, the float64 products'
share of those FLOPs times ``1 - 1/2`` (twice the SIMD lanes) plus the float64
convolutions' share whole (:data:`CPU_SPEEDUP`: oneDNN runs only float32 convolutions, and
the fallback float64 takes grows slower with the size: 2.5x to 9x measured); on a GPU the
whole float64 share, since float32 there can be 2 to 64 times faster, and more on tensor
cores. To that the optimizer's share times half the float64 share is added: its update
reads and writes every parameter, gradient and state tensor, memory-bound, and float32
halves those bytes (without it, the bound was exceeded: "up to 44%" against x0.54
measured). The convolutions' first bound, ``1 - 1/3``, was exceeded too: ``trainprof
verify`` of a two-convolution net said "beyond the bound" (x0.21-x0.24 measured).

``benchmarks/cpu_float64.py`` (this project's 2-core AVX-512 VM, a training step side by
side, 12 shuffled rounds, two runs): float32 against float64, MLPs of 3 Linear layers
x0.83-x0.93 at width 64, x0.61-x0.65 at 256-1024, x0.49 at 2048; two-convolution nets with
a pooling between x0.34-x0.40, without one x0.25 (batch 16) and x0.11 (batch 32).
``trainprof tune --knob float32=false,true`` on an MLP of width 1024 from NumPy data
measured x0.54 (95% CI x0.48-x0.58, 4 trials) against "up to 49%" (see the README).

Not said where float64 is a small part of the FLOPs (a loss or a metric computed in
float64 on purpose), below the low band.
"""

from __future__ import annotations

from trainprof.diagnosis.context import Context, number
from trainprof.diagnosis.device import device_breakdown, used_cuda
from trainprof.diagnosis.finding import Finding, Fix, band
from trainprof.diagnosis.registry import rule

HIGH, MEDIUM, LOW = 0.20, 0.05, 0.02
#: float32's speed over float64's on a CPU: products at twice the SIMD lanes' rate;
#: convolutions without bound (oneDNN runs only float32 ones; float64's fallback measured
#: 2.5x to 9x slower, more the larger the convolution).
CPU_SPEEDUP = {"matmul": 2.0, "conv": float("inf")}


@rule("float64.model_in_float64")
def model_in_float64(ctx: Context) -> Finding | None:
    ops = ctx.summary.get("ops")
    if not isinstance(ops, dict):
        return None
    calls = number(ops.get("float64_matmul_conv_per_step")) or 0.0
    matmul = number(ops.get("float64_matmul_flops_per_step")) or 0.0
    conv = number(ops.get("float64_conv_flops_per_step")) or 0.0
    total = number(ops.get("matmul_conv_flops_per_step")) or 0.0
    if calls <= 0 or matmul + conv <= 0 or total <= 0:
        return None
    share = (matmul + conv) / total
    cuda = used_cuda(ctx)
    shares = device_breakdown(ctx) if cuda else ctx.breakdown
    model = float(number(shares.get("forward")) or 0.0) + float(
        number(shares.get("backward")) or 0.0)
    # the optimizer's update is memory-bound: float32 parameters halve its bytes
    optimizer = float(number(shares.get("optimizer")) or 0.0)  # (with zero_grad: the same)
    if cuda:
        gain = model * share + optimizer * share / 2
    else:
        gain = (model * (matmul / total * (1.0 - 1.0 / CPU_SPEEDUP["matmul"])
                         + conv / total * (1.0 - 1.0 / CPU_SPEEDUP["conv"]))
                + optimizer * share / 2)
    severity = band(gain, HIGH, MEDIUM, LOW)
    if severity is None:
        return None
    where = "GPU" if cuda else "CPU"
    speed = ("float32 runs 2 to 64 times as fast on a GPU, more on TF32 or bfloat16 tensor "
             "cores" if cuda else "a CPU computes float32 matrix products at twice float64's "
             "peak rate (twice the numbers per SIMD instruction), and its float32 "
             "convolutions run in oneDNN, float64 ones in a slower fallback")
    text = (
        f"{calls:.0f} matrix products and convolutions a step run in float64, "
        f"{share * 100:.0f}% of the model's FLOPs, and its forward and backward passes are "
        f"{model * 100:.0f}% of the step; {speed}, and float64 moves twice the bytes. "
        "float64 usually comes from NumPy, whose arrays are float64 by default: "
        "torch.from_numpy keeps the dtype, and model.double() silences the dtype error "
        "that follows. Make the data float32 where it is made and drop .double(), unless "
        "the problem needs float64's precision (compare the loss curves)."
    )
    snippet = "\n".join([
        "x = torch.from_numpy(features.astype(np.float32))  # NumPy's default is float64",
        "model = Net()  # no .double()",
        "# in a Dataset: return torch.as_tensor(sample, dtype=torch.float32)",
    ])
    evidence = {"float64_matmul_conv_per_step": calls, "float64_flop_share": share,
                "model_share": model, "optimizer_share": optimizer, "device": where,
                "step_median_s": ctx.median_step_s}
    return Finding(
        category="compute", cause="float64",
        title=(f"The model computes in float64 on the {where}: float32 could save up to "
               f"{gain * 100:.0f}% of step time"),
        severity=severity, evidence=evidence, estimated_gain=gain,
        fix=Fix(text=text, snippet=snippet),
        verify=(f"trainprof tune --knob float32=false,true {ctx.script}  (a float64 model "
                "and its float64 inputs converted at its calls, the script unchanged)"),
        verify_commands=(f"trainprof tune --knob float32=false,true {ctx.script}",),
    )
