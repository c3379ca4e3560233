"""Forward and backward spent in ops that move memory more than they compute: torch.compile.

Sources: expert-rules.md C7, "unfused pointwise ops → torch.compile, XLA's jit_compile,
fused layers" (the PyTorch tuning guide, TensorFlow's profiler, Hugging Face's
performance docs, Composer). Each pointwise op, reduction, normalization or copy reads its
inputs from memory and writes its output back (on a GPU it is one more kernel launch too);
torch.compile's Inductor fuses chains of them into one kernel that reads and writes once
(Ansel et al. 2024). It does not make matrix products faster.

Evidence: the op count's window times every op (:mod:`trainprof.capture.op_time`); the
summary's ``op_time`` (:func:`trainprof.analysis.ops.summarize_op_time`) gives the model
phases' op time by kind. Fires where the ``fusable`` ops hold at least
:data:`MIN_OF_MODEL` of the model's op time and :data:`MIN_OF_STEP` of the step, the model
is not compiled already, the op count found no Python loop over a tensor's dimension
(whose many small ops are its own finding's: vectorise the loop first), and other
processes did not keep the machine busy while the window ran (``disturbed``: a run on a
shared 2-core machine, with busy loops on the cores in those two steps, put 47% of its
model op time in these ops, against 17-18% quiet).

No gain is claimed (``gain_unknown``, low severity): fusion removes the round trips to
memory between the ops of a chain and their launches, not the chain's own inputs and
outputs, and how long the chains are only compiling shows. The verify line is the
``compile`` knob, which compiles the model's outermost modules with the script unchanged.
On this project's 2-core VM a 4-block MLP of width 16 with LayerNorm and GELU at batch 8192
spends 44% of its model op time (35% of the step) in such ops; ``trainprof verify`` on it
measured the compiled model at ×0.89 (6 trials, 95% CI ×0.86–×0.95; with 3 trials ×0.94,
not significant). At width 32 and batch 4096 they hold 29% and nothing fires. On a CPU,
where these ops are vectorised and cheap beside the products, the gain is modest; on a
GPU each of them is also a kernel launch (unmeasured here).
"""

from __future__ import annotations

from trainprof.diagnosis.context import Context, number
from trainprof.diagnosis.finding import Finding, Fix
from trainprof.diagnosis.registry import rule

#: The least share of the model's op time in fusable ops ...
MIN_OF_MODEL = 0.4
#: ... and of the step.
MIN_OF_STEP = 0.2


@rule("fusion.unfused_ops")
def unfused_ops(ctx: Context) -> Finding | None:
    timed = ctx.summary.get("op_time")
    ops = ctx.summary.get("ops") or {}
    if not isinstance(timed, dict) or ops.get("compiled"):
        return None
    if ops.get("loops"):
        return None  # a Python loop makes the ops small and many: its own finding's fix
    if timed.get("disturbed"):
        return None  # other processes' load slowed the window's ops unevenly
    of_model = number((timed.get("share_of_model") or {}).get("fusable"))
    of_step = number((timed.get("share_of_step") or {}).get("fusable"))
    if of_model is None or of_step is None:
        return None
    if of_model < MIN_OF_MODEL or of_step < MIN_OF_STEP:
        return None
    top = [o for o in timed.get("fusable_ops") or [] if isinstance(o, dict)][:5]
    names = ", ".join(f"{o['op']} {float(o['s_per_step']) * 1e3:.1f} ms" for o in top)
    seconds = timed.get("s_per_step") or {}
    device = "GPU" if ctx.on_cuda else "CPU"
    text = (
        f"Of the {timed['model_s_per_step'] * 1e3:.1f} ms a step that forward and backward "
        f"take, {of_model * 100:.0f}% of the time in torch's ops ({of_step * 100:.0f}% of the "
        f"step) goes to pointwise ops, reductions, normalizations and copies ({names}), and "
        f"{float(seconds.get('product') or 0) * 1e3:.1f} ms to matrix products and "
        "convolutions. Each of those ops reads its inputs from memory and writes its result "
        f"back{', and is one more kernel launch' if ctx.on_cuda else ''}. torch.compile "
        "fuses chains of them into single kernels that read and write once. How much that "
        f"saves on this {device} depends on how long the chains are: the compile knob "
        "measures it with the script unchanged (the compiling steps fall in the warm-up "
        "that tune leaves out)."
    )
    tune = f"trainprof tune --knob compile=false,true {ctx.script}"
    return Finding(
        category="compute", cause="unfused_ops",
        title=(f"Forward and backward spend {of_model * 100:.0f}% of their op time in "
               "pointwise, reduction and normalization ops: torch.compile may fuse them"),
        severity="low",
        evidence={"fusable_share_of_model_ops": of_model, "fusable_share_of_step": of_step,
                  "model_op_s_per_step": timed.get("model_s_per_step"),
                  "top_ops": [o["op"] for o in top], "timed_by": timed.get("timed_by"),
                  "gain_unknown": True},
        estimated_gain=0.0,
        fix=Fix(text=text, snippet="model = torch.compile(model)  # fuses the pointwise ops"),
        verify=f"{tune}  (the model compiled at its first call, the script unchanged)",
        verify_commands=(tune,),
    )
