"""Memory that keeps growing through the steady state: a leak that ends the run.

Sources (expert-rules.md): M3 — "Leaks. Memory growth ≥ 1% and per-line leak
likelihood ≥ 0.95" (Scalene). trainprof reads the trend of the system samples
(:mod:`trainprof.analysis.memory_growth`: anonymous RSS of the training process, each
GPU's used memory), growth that holds to the end of the run, at least 32 MB and 3%.

The usual causes in a training loop: tensors kept across steps with their autograd
graph (``losses.append(loss)``, ``total_loss += loss``: the graph, and on a step
without backward its activations, stay alive), batches or outputs kept for metrics,
and Python containers that grow per step (a cache with no bound). No speed-up is
claimed (``estimated_gain`` 0): the finding is about the run's end. Severity by the
projected time until the memory is full (an upper bound: other processes use it
too): within an hour high, within a day medium, otherwise low.
"""

from __future__ import annotations

from typing import Any

from trainprof.diagnosis.context import Context
from trainprof.diagnosis.finding import Finding, Fix
from trainprof.diagnosis.registry import rule

HOUR_S, DAY_S = 3600.0, 86400.0
MB = 2**20


def _severity(seconds_to_full: float | None) -> str:
    if seconds_to_full is not None and seconds_to_full < HOUR_S:
        return "high"
    if seconds_to_full is not None and seconds_to_full < DAY_S:
        return "medium"
    return "low"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * HOUR_S:
        return f"{seconds / 60:.0f} minutes"
    return f"{seconds / HOUR_S:.1f} hours"


def _growth_finding(ctx: Context, g: dict[str, Any], where: str, cause: str) -> Finding:
    per_step = g.get("bytes_per_step")
    rate = float(g.get("slope_bytes_per_s") or 0.0)
    full = g.get("seconds_to_full")
    per_step_txt = f"{per_step / 1024:,.0f} KB a step, " if per_step else ""
    title = (f"{where} memory grows {per_step_txt}{rate / MB:,.1f} MB/s to the end of the run"
             + (f": full in about {_duration(float(full))}" if full else ""))
    evidence: dict[str, Any] = {
        "series": g.get("series", "mem_used_bytes"),
        "bytes_per_step": per_step,
        "bytes_per_s": rate,
        "first_quarter_bytes": g.get("first_bytes"),
        "last_bytes": g.get("last_bytes"),
        "quarter_medians_bytes": g.get("quarter_medians_bytes"),
        "window_s": g.get("window_s"),
        "capacity_bytes": g.get("capacity_bytes"),
        "seconds_to_full": full,
    }
    text = (
        f"{where} memory rose through the whole steady state, in each quarter of it more "
        "than in the one before: something is kept from every step. Most often a tensor "
        "kept with its autograd graph (losses.append(loss), total_loss += loss: keep "
        "loss.item() or loss.detach()), batches or model outputs kept for metrics (keep "
        "the numbers, or detach and move them to the CPU), or a cache with no bound. "
        "tracemalloc (host) or torch.cuda.memory._record_memory_history (GPU) names the "
        "allocation that grows."
    )
    snippet = (
        "running_loss += loss.item()  # not `+= loss`: that keeps every step's graph\n"
        "outputs.append(logits.detach().cpu())  # if outputs are needed at all"
    )
    verify = (f"trainprof run {ctx.script} after the change, then trainprof report: this "
              "finding should be gone")
    return Finding(category="memory", cause=cause, title=title, severity=_severity(full),
                   evidence=evidence, estimated_gain=0.0,
                   fix=Fix(text=text, snippet=snippet), verify=verify)


@rule("memory_growth.leak")
def leak(ctx: Context) -> list[Finding]:
    growth = ctx.summary.get("memory_growth")
    if not isinstance(growth, dict):
        return []
    out: list[Finding] = []
    host = growth.get("host")
    if isinstance(host, dict) and host.get("grows"):
        out.append(_growth_finding(ctx, host, "Host", "host_memory_growth"))
    for index, g in sorted((growth.get("gpus") or {}).items()):
        if isinstance(g, dict) and g.get("grows"):
            out.append(_growth_finding(ctx, g, f"GPU {index}", "gpu_memory_growth"))
    return out
