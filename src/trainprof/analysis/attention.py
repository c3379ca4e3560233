"""Attention computed op by op, its share of the step, and what the fused kernel saves.

Inputs: the op count's window (``ops.json``'s ``eager_attention``,
:mod:`trainprof.capture.eager_attention`): each attention shape found (score matrices a
softmax ran on), the time and FLOPs of the ops on its scores a step; and the record's
``attention_fix_measured``: ``F.scaled_dot_product_attention`` and the plain ops timed
forward and backward at each shape on the run's machine at the end of the run.

The ops' time is the window's scaled to the steady steps (:func:`model_scale`: forward and
backward's steady seconds, the device's where CUDA events timed the ops, over the model's
op seconds in the window's two steps), so an op
descheduled once there does not count its wait, and the Python between the ops is shared
out in proportion. The saving of a shape is its ops' time a step times one less the ratio
of the fused kernel's time to the plain ops' time, both timed in turns at that shape on the
run's machine: the fix measured on the hardware and shape that ran (what TorchTidy does for
its suggestions, expert-rules.md N7), not a model of it. The ratio is taken from a controlled
pair rather than set against the window's two steps, which a busy moment can stretch; the
script's own attention may do more than the plain ops (a mask, dropout: the fused kernel
saves those too), so the saving is, if anything, understated. (On this project's 2-core VM
the whole step lost a little more than the estimate: the score matrices' memory slows the
other ops too.) Where no measurement was made (a
run stopped early, a CPU rank of a launch), the bound is the ops' time less the time their
FLOPs take at the measured matmul peak (:mod:`trainprof.capture.peak_flops`): a fused
kernel still computes them.
"""

from __future__ import annotations

from typing import Any

_KEY = ("batch", "query_len", "key_len", "head_dim", "dtype", "device")


def summarize_attention(ops: dict[str, Any] | None, measured: list[dict[str, Any]] | None,
                        step_s: float | None, peaks: dict[str, Any] | None,
                        scale: float = 1.0) -> dict[str, Any] | None:
    """The summary's ``attention`` section, or None when the window found no eager
    attention (or the run has no steady step time).

    ``scale`` turns the window's op seconds into steady ones: forward and backward's time
    in the steady steps over the model's op time in the window's two steps (an op
    descheduled once there would otherwise count its wait; :func:`model_scale`)."""
    found = (ops or {}).get("eager_attention")
    if not isinstance(found, list) or not found or not step_s or step_s <= 0:
        return None
    fixes = {tuple(m.get(k) for k in _KEY): m for m in measured or [] if isinstance(m, dict)}
    peaks = peaks if isinstance(peaks, dict) else {}
    shapes = []
    for shape in found:
        if not isinstance(shape, dict):
            continue
        eager = float(shape.get("s_per_step") or 0.0) * scale
        entry = {**shape, "window_s_per_step": shape.get("s_per_step"), "s_per_step": eager,
                 "share": eager / step_s, "fused_s_per_step": None,
                 "saving_s_per_step": None, "bound_s_per_step": None}
        fix = fixes.get(tuple(shape.get(k) for k in _KEY))
        if fix is not None and isinstance(fix.get("ratio"), int | float):
            fused = eager * float(fix["ratio"])
            entry.update(fused_s_per_step=fused, saving_s_per_step=eager - fused,
                         fused_ratio=float(fix["ratio"]))
        elif fix is not None and fix.get("error"):
            entry["fix_error"] = fix["error"]
        peak = peaks.get(f"{shape.get('device')} {shape.get('dtype')}")
        rate = peak.get("flops_per_s") if isinstance(peak, dict) else None
        if isinstance(rate, int | float) and rate > 0:
            entry["bound_s_per_step"] = max(
                0.0, eager - float(shape.get("flops_per_step") or 0.0) / float(rate))
        shapes.append(entry)
    if not shapes:
        return None
    eager = sum(s["s_per_step"] for s in shapes)
    measured_all = all(s["saving_s_per_step"] is not None for s in shapes)
    saving = sum(s["saving_s_per_step"] for s in shapes) if measured_all else None
    bound = (sum(s["bound_s_per_step"] for s in shapes)
             if all(s["bound_s_per_step"] is not None for s in shapes) else None)
    return {
        "shapes": shapes,
        "s_per_step": eager,
        "share": eager / step_s,
        # the fused kernel's saving as measured at every shape (None: not measured)
        "saving_s_per_step": saving,
        "saving_share": None if saving is None else saving / step_s,
        # where not measured: the ops' time beyond their FLOPs' time at the peak
        "bound_share": None if bound is None else bound / step_s,
        "step_s": step_s,
        "scale": scale,
    }


def model_scale(op_time: dict[str, Any] | None) -> float:
    """What :func:`trainprof.analysis.ops.summarize_op_time` multiplied the window's op
    seconds by (forward and backward's steady seconds over the window's, the device's where
    CUDA events timed the ops; at most 1); 1 without a timed window."""
    scale = (op_time or {}).get("scale")
    return float(scale) if isinstance(scale, int | float) and scale > 0 else 1.0
