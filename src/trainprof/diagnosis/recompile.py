"""torch.compile compiling again while the model trains: recompilations, and their limit.

Sources: expert-rules.md C8 ("recompilation storms: dynamic shapes, changing Python
values") and PyTorch's torch.compile troubleshooting guide ("Recompilation": each guard
failure compiles the frame again; past ``torch._dynamo.config.recompile_limit``, 8 by
default, the frame runs in eager mode; ``dynamic=True`` / ``mark_dynamic`` for sizes that
vary; ``TORCH_LOGS=recompiles`` names each reason).

Evidence: the compilations Dynamo's callbacks timed by step, and its guard-failure reasons
(:mod:`trainprof.capture.compile_events`, :mod:`trainprof.analysis.compiles`). Fires for
compilations after the warm-up that took at least :data:`LOW` of the steady steps' time
(bands: 10% high, 3% medium, 1% low), and whenever a frame hit the recompile limit (at
least medium: the "compiled" model then runs uncompiled for the rest of the run, whatever
the recompilations cost). Gain: the compilations' share of the steady time, the most that
avoiding them saves; a model that fell back to eager mode loses its compiled speed too,
which only a run after the fix shows (no bound is claimed for that).

The fix follows the kinds of reasons: sizes that change (a short last batch, sequences of
varying length) - ``drop_last=True``, padding to a few lengths, or ``dynamic=True``;
autograd switched off or the module put in eval mode for evaluation - a compilation per
mode, once each, cheap in a long run unless the limit is near; other guards - the reason
Dynamo gave, quoted.
"""

from __future__ import annotations

from trainprof.diagnosis.context import Context
from trainprof.diagnosis.finding import Finding, Fix, band
from trainprof.diagnosis.registry import rule

HIGH, MEDIUM, LOW = 0.10, 0.03, 0.01


def _steps_text(steps: list[int], most: int = 8) -> str:
    shown = ", ".join(str(s) for s in steps[:most])
    return shown + (f" and {len(steps) - most} more" if len(steps) > most else "")


@rule("recompile.after_warmup")
def recompilation(ctx: Context) -> Finding | None:
    info = ctx.summary.get("compiles")
    if not isinstance(info, dict):
        return None
    share = float(info.get("after_warmup_share") or 0.0)
    limit_hit = bool(info.get("limit_hit"))
    severity = band(share, HIGH, MEDIUM, LOW)
    if limit_hit and severity in (None, "low"):
        severity = "medium"
    if severity is None or not info.get("after_warmup"):
        return None
    n = int(info["after_warmup"])
    seconds = float(info.get("after_warmup_s") or 0.0)
    steps = [int(s) for s in info.get("steps_after_warmup") or []]
    kinds = info.get("reason_kinds") or {}
    examples = info.get("reason_examples") or {}
    limit = info.get("recompile_limit")
    title = (f"torch.compile compiled again {n} time{'s' if n != 1 else ''} after the "
             f"warm-up ({seconds:.2f} s, {share * 100:.1f}% of the steady steps' time)"
             + (f"; it hit its recompile limit ({limit}) and runs eagerly from step "
                f"{int(info.get('limit_hit_step') or 0) + 1}" if limit_hit else ""))
    parts = [f"Dynamo compiled the model again at steps {_steps_text(steps)}, each a "
             "stalled step, because a guard of the compiled code failed."]
    snippet_lines = []
    if "shape" in kinds:
        parts.append(
            f"The input's sizes change (\"{examples.get('shape')}\"): every new size "
            "compiles again. Keep the sizes few - drop the short last batch "
            "(drop_last=True), pad sequences to a few lengths - or compile for varying "
            "sizes: torch.compile(model, dynamic=True), or mark the varying dimension "
            "with torch._dynamo.mark_dynamic(x, 0).")
        snippet_lines += [
            "loader = DataLoader(dataset, ..., drop_last=True)  # no short last batch",
            "model = torch.compile(model, dynamic=True)  # or: sizes that vary compile once"]
    if "grad_mode" in kinds or "module_mode" in kinds:
        parts.append(
            "Evaluation runs the compiled model "
            + ("with autograd off" if "grad_mode" in kinds else "in eval mode")
            + " - another graph, compiled once per mode: a one-time cost in a long run, "
            "but it counts towards the recompile limit. To keep evaluation out of it, "
            "evaluate with the uncompiled module (torch.compile(model) returns a wrapper; "
            "keep the original) or compile the evaluation separately.")
        snippet_lines += [
            "compiled = torch.compile(model)  # train with compiled(...)",
            "with torch.no_grad():",
            "    model.eval(); val_loss = loss_fn(model(x_val), y_val); model.train()"
            "  # the uncompiled module"]
    if "other" in kinds:
        parts.append(f"Dynamo's reason: \"{examples.get('other')}\". "
                     "TORCH_LOGS=recompiles prints each one as it happens.")
    if limit_hit:
        parts.append(
            f"After {limit} compilations of one frame Dynamo stops compiling it: the "
            "model has run uncompiled since, which also loses what compiling gained. "
            "Remove the cause; raising torch._dynamo.config.recompile_limit only delays "
            "the fall-back.")
    evidence = {
        "compilations": info.get("count"),
        "after_warmup": n,
        "after_warmup_s": seconds,
        "after_warmup_share": share,
        "at_steps": steps[:10],
        "reason_kinds": kinds,
        "recompile_limit": limit,
        "limit_hit": limit_hit,
    }
    if limit_hit:
        evidence["limit_hit_step"] = info.get("limit_hit_step")
    return Finding(
        category="host_launch", cause="recompilation", title=title, severity=severity,
        evidence=evidence, estimated_gain=share,
        fix=Fix(text=" ".join(parts),
                snippet="\n".join(snippet_lines) or "TORCH_LOGS=recompiles python train.py"),
        verify=(f"re-run `trainprof run {ctx.script}` after the change: its Compile row "
                "should show no compilation after the warm-up"),
        verify_commands=(f"trainprof run {ctx.script}",),
    )
