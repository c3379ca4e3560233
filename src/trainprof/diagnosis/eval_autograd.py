"""Evaluation with autograd on: eval-mode model calls that record graphs nobody uses.

Source (expert-rules.md): M4 — "Autograd during evaluation → torch.no_grad()" (the
PyTorch performance tuning guide); no peer publishes a threshold. The capture counts
the model calls made in eval mode (``module.training`` False) with autograd on and off,
and their time (:mod:`trainprof.capture.eval_autograd`).

Gain, an upper bound: the time of those calls, as a share of the steps' time, times
the most an eval forward was measured to save with autograd off:
``benchmarks/eval_no_grad.py`` (CPU, one thread, outputs kept as an evaluation that
collects predictions keeps them; 2026-11-26) gave ×0.96 for an MLP (4% saved; 95% CI
×0.92-×0.99) and ×0.64 for a small conv net with BatchNorm (36%, ×0.61-×0.69: the
activations kept for backward are large there), so :data:`MOST_SAVED` = 0.36. Eval
calls are timed inside the steps they fall in (an evaluation every N steps, between
optimizer steps); one after the last step adds time
the steps do not hold, and its share is overstated. Bands: ≥ 15% high, ≥ 5% medium;
below, ``low``: any evaluation with autograd on records graphs for nothing, and on a GPU
it keeps activations alive as long as the outputs are (the memory an evaluation that
collects outputs runs out of).
"""

from __future__ import annotations

from typing import Any

from trainprof.diagnosis.context import Context
from trainprof.diagnosis.finding import Finding, Fix, band
from trainprof.diagnosis.registry import rule

HIGH, MEDIUM = 0.15, 0.05
#: the most of an eval forward's time autograd was measured to cost (module docstring)
MOST_SAVED = 0.36
#: fewer eval-mode calls with autograd on than this are a check, not an evaluation
MIN_CALLS = 2
#: the longest trial the verify line proposes
TUNE_STEPS_MAX = 2000


@rule("eval_autograd.eval_without_no_grad")
def eval_without_no_grad(ctx: Context) -> Finding | None:
    rec: dict[str, Any] = ctx.summary.get("eval_autograd") or {}
    calls = int(rec.get("grad_calls") or 0)
    if calls < MIN_CALLS:
        return None
    eval_s = float(rec.get("grad_s") or 0.0)
    steps_s = float(ctx.steps["dur_ns"].sum()) / 1e9 if ctx.has_steps() else 0.0
    share = min(1.0, eval_s / max(steps_s, eval_s)) if eval_s > 0 else 0.0
    gain = share * MOST_SAVED
    severity = band(gain, HIGH, MEDIUM) or "low"
    off = int(rec.get("nograd_calls") or 0)
    evidence: dict[str, Any] = {
        "eval_calls_with_autograd": calls,
        "eval_s_with_autograd": round(eval_s, 6),
        "eval_share_of_step_time": round(share, 4),
        "eval_calls_without_autograd": off,
        "most_saved_fraction": MOST_SAVED,
    }
    if rec.get("no_grad_knob"):
        evidence["run_with_knob"] = "eval_no_grad"  # the calls ran with autograd off here
    on_gpu = ctx.on_cuda
    title = (f"{calls:,} model calls in eval mode ran with autograd on "
             f"({share * 100:.1f}% of step time): they record graphs no backward uses")
    text = (
        "The model was called in eval mode (model.eval()) with autograd on: every such "
        "forward records its autograd graph and keeps the activations that backward would "
        "need, for a backward that never comes"
        + (", holding GPU memory as long as the outputs live (an evaluation that collects "
           "them can run out of it)" if on_gpu else "")
        + ". Run evaluation under torch.no_grad(), or torch.inference_mode(), which also "
        "skips the version counters; model.eval() alone only changes dropout and "
        "BatchNorm. On the CPU this saved 4% (an MLP) to 36% (a conv net) of an eval "
        "forward (benchmarks/eval_no_grad.py)."
        + (f" {off:,} other eval-mode calls already ran without autograd." if off else "")
    )
    snippet = (
        "model.eval()\n"
        "with torch.no_grad():  # or torch.inference_mode()\n"
        "    for x, y in val_loader:\n"
        "        ...  # the evaluation, unchanged\n"
        "model.train()"
    )
    # evaluations come every N steps: a trial must be long enough to hold several (tune's
    # default of 60 steps may hold none); this run's length, within 60..TUNE_STEPS_MAX
    steps = int(ctx.step_info.get("count") or 0)
    trial = min(max(60, steps), TUNE_STEPS_MAX)
    tune = f"trainprof tune --knob eval_no_grad=false,true --steps {trial} {ctx.script}"
    verify = (f"{tune}  (runs those calls with autograd off: the steps that evaluate should "
              "shorten; each trial must hold several evaluations)")
    return Finding(category="memory", cause="eval_autograd", title=title, severity=severity,
                   evidence=evidence, estimated_gain=round(gain, 4),
                   fix=Fix(text=text, snippet=snippet), verify=verify, verify_commands=(tune,))
