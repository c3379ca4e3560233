"""Activation checkpointing: a forward pass run twice, where the memory may hold it once.

Measured: :mod:`trainprof.capture.checkpointing` times the first pass of every region
the training thread checkpoints (``torch.utils.checkpoint.checkpoint``). The backward
pass runs each region again to rebuild its activations: that second pass, about as
long as the first, is the price of the memory saved (PyTorch's ``torch.utils.checkpoint``
documentation; Chen et al. 2016 put it at about one extra forward). Where the memory
would hold the activations, the price buys nothing.

The gain claimed is the first pass's share of the step, an upper bound: seen here, a
4-block residual MLP checkpointed block by block on the CPU (first pass 23% of the
step), ``trainprof tune --knob activation_checkpointing=true,false`` measured x0.87 (3
trials each, 95% CI x0.81-x0.95): backward reading activations kept since the forward
pays memory traffic that the recomputed ones, still in cache, did not.

Memory decides whether the fix applies, and trainprof cannot tell how much more the
kept activations would take. So the finding quotes the run's peak against the
capacity (the CUDA allocator's reserved peak per device; on a CPU run the process's
RSS peak against the machine's memory), and from :data:`CROWDED` of it on it is low,
whatever the time: turning checkpointing off may not fit, and checkpointing fewer
regions is the way to try.
"""

from __future__ import annotations

from typing import Any

from trainprof.diagnosis.context import Context, number
from trainprof.diagnosis.finding import Finding, Fix, band
from trainprof.diagnosis.registry import rule

HIGH, MEDIUM, LOW = 0.20, 0.05, 0.02
#: Memory in use (peak over capacity) from which the fix may not fit.
CROWDED = 0.5


def _memory(ctx: Context) -> tuple[float | None, float | None, str]:
    """(peak bytes, capacity bytes, a sentence naming them) of the memory the activations
    live in: the fullest GPU's allocator peak, or on a CPU run the process's RSS peak."""
    cm = ctx.summary.get("cuda_memory")
    devices = [d for d in (cm or {}).get("devices") or [] if isinstance(d, dict)]
    best: tuple[float | None, float | None, str] = (None, None, "")
    for d in devices:
        peak, total = number(d.get("reserved_bytes.all.peak")), number(d.get("total_bytes"))
        if peak is not None and total and (best[0] is None or best[1] is None
                                           or peak / total > best[0] / best[1]):
            best = (peak, total, f"GPU {d.get('index')}'s allocator reserved at most "
                                 f"{_gib(peak)} of its {_gib(total)} ({peak / total:.0%})")
    if best[0] is not None:
        return best
    peak = number(ctx.system.get("rss_peak_bytes"))
    total = number(ctx.environment.get("memory_total_bytes"))
    if peak is None or not total:
        return peak, total, "The run's memory peak was not measured"
    return peak, total, (f"The training process's memory (RSS) peaked at {_gib(peak)} of the "
                         f"machine's {_gib(total)} ({peak / total:.0%})")


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


@rule("checkpointing.activation_checkpointing")
def activation_checkpointing(ctx: Context) -> Finding | None:
    rec = ctx.summary.get("activation_checkpointing")
    if not isinstance(rec, dict):
        return None
    share = number(rec.get("share"))
    if share is None:
        return None
    severity = band(share, HIGH, MEDIUM, LOW)
    if severity is None:
        return None
    peak, total, memory_text = _memory(ctx)
    used = peak / total if peak is not None and total else None
    crowded = used is None or used >= CROWDED
    if crowded:
        severity = "low"
    per_step = number(rec.get("calls_per_step"))
    if per_step is not None and abs(per_step - round(per_step)) < 0.05:
        per_step = float(round(per_step))
    calls = f"{per_step:.0f} regions a step" if per_step else "its regions"
    title = (f"Activation checkpointing runs the forward of {calls} twice: "
             f"{share * 100:.0f}% of step time recomputed in backward"
             + ("" if used is None else f" (memory {used * 100:.0f}% used)"))
    text = (
        f"torch.utils.checkpoint drops the activations of {calls} and runs them again during "
        f"the backward pass to rebuild them. Their first pass took {share * 100:.1f}% of step "
        "time, and the second costs up to as much. " + memory_text + ". "
        + ("With that much free, turning checkpointing off (the activations kept) is likely to "
           "fit: measure it, and the memory it takes, with the verify line. "
           if not crowded else
           "Turning it off may not fit: checkpoint fewer regions (every other layer) and "
           "measure the step and the memory peak as you go. ")
        + "Checkpointing buys memory, for a larger batch or a longer sequence; where that "
        "memory is not needed, it only costs time."
    )
    snippet = "\n".join([
        "# Hugging Face: leave it off (TrainingArguments(gradient_checkpointing=False))",
        "model.gradient_checkpointing_disable()",
        "",
        "# plain PyTorch: call the region itself where it was checkpointed",
        "x = block(x)  # was: x = checkpoint(block, x, use_reentrant=False)",
    ])
    evidence: dict[str, Any] = {
        "recompute_share": share, "calls_per_step": per_step,
        "use_reentrant": rec.get("use_reentrant"), "memory_peak_bytes": peak,
        "memory_total_bytes": total, "memory_used_share": used,
        "step_median_s": ctx.median_step_s,
    }
    tune = f"trainprof tune --knob activation_checkpointing=true,false {ctx.script}"
    return Finding(
        category="compute", cause="activation_checkpointing", title=title,
        severity=severity, evidence=evidence, estimated_gain=share,
        fix=Fix(text=text, snippet=snippet),
        verify=(f"{tune}  (false runs each checkpointed function directly; each trial's run "
                "folder keeps its memory peak: `trainprof report RUN`)"),
        verify_commands=(tune,),
    )
