"""Convolutions in NCHW on a CPU: oneDNN reorders every one of them.

PyTorch runs CPU convolutions with oneDNN. An NCHW (``torch.contiguous_format``) tensor
is reordered into oneDNN's blocked layout before each convolution and back after it,
forward and backward; an NHWC (``torch.channels_last``) one is used as it is, and the
layout carries through the network ("Accelerating PyTorch Vision Models with Channels
Last on CPU", PyTorch blog, 2022: channels_last is the format oneDNN is optimised for).
The fix is two lines: the model converted once, each batch as it arrives.

Evidence: the op count's window (:mod:`trainprof.capture.opcount`) counts the ``conv2d``
and ``conv_transpose2d`` calls (a decoder's or a GAN generator's upsampling: a generator of
two 4x4 transposed convolutions, 64 channels on 16x16 images, ran a training step x0.74-x0.79
in channels_last here, 3 rounds side by side after a warm-up one; a quick check, not yet a
case of benchmarks/cpu_channels_last.py), those with an NHWC input or weight, and their
forward FLOPs from the shapes, beside the float32 matrix products'; the fingerprint says
oneDNN is on. The gain bound is the model's share of the step (forward and backward) x
:data:`SAVING` x the NCHW convolutions' share of the model's FLOPs (convolutions and matrix
products): a model whose convolutions are a stem before a Transformer gains little.

:data:`SAVING` is the largest saving ``benchmarks/cpu_channels_last.py`` measured on a
whole training step (this project's 2-core AVX-512 VM, torch 2.13, 12 shuffled rounds, two
runs on 2026-11-27): x0.65 and x0.79 for a two-convolution net of 8 channels, x0.72-x0.77
for one of 16, x0.79-x0.83 for plain 3x3 nets of 32 channels, x0.77-x1.00 for
depthwise-separable blocks. It also saw no gain, or a loss, for few channels or small
images: 4 channels x0.96-x1.01 (x1.17 in a first exploration), 128 channels on 8x8 images
x0.94-x0.95. So the finding is never more than medium, and the verify line measures it
with the ``channels_last`` knob: ``trainprof tune --knob channels_last=false,true`` on a
plain 3x3 net of 32 channels measured x0.75 (95% CI x0.68-x0.85, 6 trials), on
``examples/many_workers.py`` x0.76.

Not on CUDA runs (:func:`trainprof.diagnosis.device.channels_last` speaks for GPUs), nor
where the input pipeline holds the step (its finding comes first), nor without oneDNN.
"""

from __future__ import annotations

from trainprof.diagnosis.context import Context, number
from trainprof.diagnosis.device import input_share, used_cuda
from trainprof.diagnosis.finding import Finding, Fix, band
from trainprof.diagnosis.input_pipeline import MEDIUM as INPUT_MEDIUM
from trainprof.diagnosis.registry import rule

#: Severity bands of the gain; never high (above).
MEDIUM, LOW = 0.05, 0.02
#: The largest share of a training step NHWC saved in benchmarks/cpu_channels_last.py.
SAVING = 0.35


@rule("channels_last_cpu.nchw_convolutions")
def nchw_convolutions(ctx: Context) -> Finding | None:
    ops = ctx.summary.get("ops")
    env = ctx.environment
    if not isinstance(ops, dict) or used_cuda(ctx):
        return None
    if env.get("cpu_onednn") is not True:
        return None
    conv = number(ops.get("conv2d_per_step")) or 0.0
    nhwc = number(ops.get("conv2d_channels_last_per_step")) or 0.0
    conv_flops = number(ops.get("cpu_conv2d_flops_per_step")) or 0.0
    nchw_flops = number(ops.get("cpu_nchw_conv2d_flops_per_step")) or 0.0
    if conv <= 0 or nhwc >= 0.5 * conv or nchw_flops <= 0:
        return None
    if input_share(ctx) >= INPUT_MEDIUM:
        return None
    matmul_flops = number(ops.get("cpu_fp32_matmul_flops_per_step")) or 0.0
    conv_share = nchw_flops / (conv_flops + matmul_flops)
    shares = ctx.breakdown
    model = float(shares.get("forward") or 0.0) + float(shares.get("backward") or 0.0)
    gain = model * SAVING * conv_share
    severity = band(gain, float("inf"), MEDIUM, LOW)
    if severity is None:
        return None
    per_conv = nchw_flops / max(conv - nhwc, 1.0) / 1e6
    text = (
        f"The model's {conv - nhwc:.0f} convolutions a step (of {conv:.0f}) run on NCHW "
        f"tensors, {per_conv:.1f} MFLOP each on average and {conv_share * 100:.0f}% of the "
        f"model's FLOPs (convolutions and matrix products); its forward and backward passes "
        f"are {model * 100:.0f}% of the step. oneDNN, which runs convolutions on the CPU, "
        "reorders NCHW tensors into its own layout before each convolution and back after it; "
        "NHWC (channels_last) ones it uses as they are, and the layout carries through the "
        "network. Convert the model once and each batch as it arrives. On this project's "
        f"benchmark NHWC saved up to {SAVING * 100:.0f}% of a conv net's training step, but "
        "nothing, or a little more time, with 4 channels or 8x8 images: measure it."
    )
    snippet = "\n".join([
        "model = model.to(memory_format=torch.channels_last)  # once, before the optimizer",
        "for x, y in loader:",
        "    x = x.contiguous(memory_format=torch.channels_last)",
        "    loss = loss_fn(model(x), y)",
    ])
    evidence = {"conv2d_per_step": conv, "conv2d_channels_last_per_step": nhwc,
                "mflop_per_nchw_conv": per_conv, "nchw_conv_flop_share": conv_share,
                "model_share": model, "step_median_s": ctx.median_step_s}
    tune = f"trainprof tune --knob channels_last=false,true {ctx.script}"
    return Finding(
        category="compute", cause="channels_last",
        title=(f"{conv - nhwc:.0f} convolutions a step run in NCHW on the CPU: channels_last "
               f"could save up to {gain * 100:.0f}% of step time"),
        severity=severity, evidence=evidence, estimated_gain=gain,
        fix=Fix(text=text, snippet=snippet),
        verify=f"{tune}  (the model and its 4-D inputs converted at its calls, the script "
               "unchanged)",
        verify_commands=(tune,),
    )
