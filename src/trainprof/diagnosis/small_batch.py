"""A step far from the machine's peak, spent on small operations: a larger batch.

Sources (expert-rules.md): C9, "GPU under-filled → increase batch size (powers of 2 /
multiples of 8)" (the TensorBoard plugin, TensorFlow's profiler, Hugging Face's
performance docs; the plugin warns that it may affect convergence); H2, "tiny kernels":
an op whose work is small costs mostly its fixed price (Python, dispatch, on a GPU a
kernel launch), and so does each per-step cost (the optimizer's per-tensor update,
zero_grad, the loop's own code). A larger batch does more work for the same prices.

Evidence: the FLOPs utilization (:mod:`trainprof.analysis.compute_efficiency`) of the
whole step below :data:`MAX_UTILIZATION`, its model phases' below
:data:`MAX_MODEL_UTILIZATION`, the DataLoader's batch size. Left alone where the input
pipeline holds the step (:data:`INPUT_HOLDS`: a larger batch would wait longer for its
samples), where forward and backward hold less than :data:`MIN_MODEL_SHARE` of the step
(its time is elsewhere: the loop's code, which its own finding names), where the op count
found a Python loop over a dimension (its own finding: the loop is what makes the ops
small), and with no DataLoader batch size to sweep.

No bound is claimed (``gain_unknown``): the saving depends on how much of the step is fixed
cost, which only a sweep shows. On this VM a 3-layer MLP of width 128 at batch 16 (4.3%
of the peak) ran ×0.65 per sample at batch 32 and ×0.41 at 64 (``trainprof tune --knob
batch_size=16,32,64``, 2 trials of 150 steps). The fix is named with its caveat: a larger
batch changes the optimisation (scale the learning rate: Goyal et al. 2017's linear
scaling rule, with warm-up) and needs memory.
"""

from __future__ import annotations

from trainprof.diagnosis.context import Context, number
from trainprof.diagnosis.device import input_share
from trainprof.diagnosis.finding import Finding, Fix
from trainprof.diagnosis.registry import rule

#: The whole step's FLOPs utilization below which the step is far from the peak ...
MAX_UTILIZATION = 0.15
#: ... and its forward and backward's: the model itself computes in small pieces.
MAX_MODEL_UTILIZATION = 0.25
#: The data wait share from which the input pipeline holds the step: a larger batch would
#: only wait longer for its samples (below it both findings stand, the input's first).
INPUT_HOLDS = 0.5
#: The least share of the step forward and backward must hold: below it the step's time is
#: elsewhere (the loop's own code, a sleep, logging), which other findings name.
MIN_MODEL_SHARE = 0.3


def _batch_size(ctx: Context) -> int | None:
    """The first DataLoader's batch size (a plain BatchSampler's, where one was passed)."""
    for loader in ctx.summary.get("dataloaders") or []:
        if not isinstance(loader, dict):
            continue
        size = loader.get("batch_size")
        if size is None:
            size = loader.get("batch_sampler_batch_size")
        if isinstance(size, int) and size > 0:
            return size
    return None


@rule("small_batch.far_from_peak")
def far_from_peak(ctx: Context) -> Finding | None:
    compute = ctx.summary.get("compute")
    if not isinstance(compute, dict):
        return None
    whole = number(compute.get("utilization"))
    model = number(compute.get("model_utilization"))
    if whole is None or model is None:
        return None
    if whole >= MAX_UTILIZATION or model >= MAX_MODEL_UTILIZATION:
        return None
    if input_share(ctx) >= INPUT_HOLDS:
        return None
    ops = ctx.summary.get("ops") or {}
    if ops.get("loops"):
        return None
    batch = _batch_size(ctx)
    if batch is None:
        return None
    shares = ctx.breakdown
    model_share = float(shares.get("forward") or 0.0) + float(shares.get("backward") or 0.0)
    if model_share < MIN_MODEL_SHARE:
        return None
    device = "GPU" if ctx.on_cuda else "CPU"
    per_op = ("a kernel launch and a dispatch" if ctx.on_cuda
              else "a dispatch and waking the thread pool")
    sweep = f"{batch},{batch * 2},{batch * 4}"
    text = (
        f"The step's FLOPs ({compute['flops_per_step'] / 1e6:,.1f} MFLOP) would take "
        f"{whole * 100:.1f}% of the step at the peak torch.mm reaches on this {device}; "
        f"forward and backward, {model_share * 100:.0f}% of the step, run at "
        f"{model * 100:.1f}% of it. At batch_size={batch} each operation is small: its fixed "
        f"price ({per_op}, the Python that calls it) outweighs its arithmetic, and so do the "
        "step's own fixed costs (the optimizer's update of every parameter tensor, "
        "zero_grad, the loop's code). A larger batch does more work for the same prices: "
        "time per sample falls until the operations fill the hardware. It changes the "
        "optimisation: scale the learning rate with it (the linear scaling rule, with a "
        "warm-up: Goyal et al. 2017) and check the memory. Gradient accumulation does not "
        "help here: it repeats the same small operations."
    )
    snippet = "\n".join([
        f"loader = DataLoader(dataset, batch_size={batch * 2}, ...)  # was {batch}",
        *_optimizer_lines(ctx, batch),
    ])
    return Finding(
        category="compute", cause="small_batch",
        title=(f"The step runs at {whole * 100:.1f}% of this {device}'s matmul peak in small "
               f"operations (batch_size={batch}): a larger batch may cost less per sample"),
        severity="low",
        evidence={"utilization": whole, "model_utilization": model,
                  "flops_per_step": compute.get("flops_per_step"), "batch_size": batch,
                  "model_share": model_share, "gain_unknown": True},
        estimated_gain=0.0,
        fix=Fix(text=text, snippet=snippet),
        verify=(f"trainprof tune --knob batch_size={sweep} {ctx.script}  (compared per "
                "sample; the learning rate stays the script's)"),
        verify_commands=(f"trainprof tune --knob batch_size={sweep} {ctx.script}",),
    )


def _optimizer_lines(ctx: Context, batch: int) -> list[str]:
    """Each optimizer the script steps, its learning rate scaled (the linear scaling rule).

    One optimizer: over ``model.parameters()``, as most scripts build it. Several (sparse
    embeddings under ``SparseAdam``, the rest under ``Adam``): each keeps the parameters
    it has now; ``SparseAdam(model.parameters())`` fails on the dense gradients."""
    names = []
    for o in ctx.summary.get("optimizers") or []:
        if isinstance(o, dict):
            name = str(o.get("class") or "")
            names.append(f"torch.optim.{name.rsplit('.', 1)[-1]}"
                         if name.startswith("torch.optim.") else name or "torch.optim.SGD")
    scaled = f"{batch * 2} / {batch}"
    if len(names) <= 1:
        optimizer = names[0] if names else "torch.optim.SGD"
        return [f"opt = {optimizer}(model.parameters(), lr=lr * {scaled})  "
                "# the linear scaling rule"]
    lines = ["# the linear scaling rule, for each optimizer, over the parameters it has now"]
    lines += [f"opt{i} = {name}(params{i}, lr=lr{i} * {scaled})"
              for i, name in enumerate(dict.fromkeys(names), start=1)]
    return lines
