"""Python loops in the model or the loss: many small torch calls where one would do.

Peers: TorchTidy flags Python-level loops of small ops, the TensorBoard plugin
warns about many short kernels (expert-rules.md). trainprof names the line and
the dimension: :mod:`trainprof.analysis.ops` finds call sites whose count per
step is a small multiple of a dimension of the tensor they index.

Estimated gain: the loop's share of the step's torch calls times the share
of step time where those calls
and their gradients run. Vectorising leaves one call where there were ``T``,
so nearly all of that time goes. Counting calls, not timing them (the sample
runs without the profiler), this is an estimate rather than a bound: a loop's
small ops usually cost more than their share of calls (each has a backward op
and a fixed overhead), so the measured gain tends to be larger - on
``examples/python_loop.py`` the estimate is ~35% and vectorising saves ~80%.

Bands on that gain: >= 20% high, >= 5% medium, >= 1% low.
"""

from __future__ import annotations

import os

from trainprof.diagnosis.context import Context
from trainprof.diagnosis.finding import Finding, Fix, band
from trainprof.diagnosis.registry import rule

HIGH, MEDIUM, LOW = 0.20, 0.05, 0.01


def _where(loop: dict) -> str:
    path = str(loop.get("file"))
    try:
        rel = os.path.relpath(path)
        path = rel if not rel.startswith("..") else path
    except ValueError:
        pass
    return f"{path}:{loop.get('line')}"


@rule("python_loop.loop_over_dimension")
def loop_over_dimension(ctx: Context) -> Finding | None:
    ops = ctx.summary.get("ops") or {}
    loops = ops.get("loops") or []
    if not loops:
        return None
    loop = loops[0]
    share_calls = float(loop.get("share_of_calls") or 0.0)
    b = ctx.breakdown
    # where torch calls and their gradients run: forward, backward, and the loss or
    # other code outside module calls ("other"); not data wait, optimizer or GC
    compute = 1.0 - sum(float(b.get(k) or 0.0) for k in ("data_wait", "optimizer", "gc"))
    gain = share_calls * max(0.0, compute)
    severity = band(gain, HIGH, MEDIUM, LOW)
    if severity is None:
        return None
    trips = int(loop["trips_per_step"])
    axis = loop.get("axis")
    shape = loop.get("arg_shape")
    where = _where(loop)
    source = loop.get("source") or ""
    calls = float(loop.get("line_calls_per_step") or 0.0)
    evidence = {
        "where": where,
        "source": source,
        "trips_per_step": trips,
        "loop_dimension": axis,
        "tensor_shape": shape,
        "torch_calls_per_step_on_line": calls,
        "torch_calls_per_step": ops.get("calls_per_step"),
        "share_of_torch_calls": share_calls,
        "compute_share": compute,
        "steps_sampled": ops.get("steps_sampled"),
    }
    if len(loops) > 1:
        evidence["other_loops"] = [_where(lp) for lp in loops[1:4]]
    snippet = (
        "# before: one small op per position, a Python call (and kernel launch) each\n"
        f"# {source}\n"
        "# after: one call over the whole dimension, e.g. for a per-token loss\n"
        "loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))"
        if "cross_entropy" in source or "loss" in source
        else "# before\n"
        f"# {source}\n"
        f"# after: index/compute over dimension {axis} at once (slicing with ':' or\n"
        "# torch.gather/index_select, batched ops, or torch.vmap over the loop body)"
    )
    return Finding(
        category="python_loop",
        cause="loop_over_tensor_dimension",
        title=(
            f"A Python loop at {where} runs {trips} times per step over dimension {axis} "
            f"of a {tuple(shape or ())} tensor ({share_calls * 100:.0f}% of torch calls)"
        ),
        severity=severity,
        evidence=evidence,
        estimated_gain=gain,
        fix=Fix(
            text=(
                f"Line {where} issues {calls:.0f} torch calls per step: one per position of a "
                f"dimension of size {trips}. Each call pays Python, dispatch and (on a GPU) a "
                "kernel launch for a tiny amount of work, in forward and again in backward. "
                "Express the loop as one operation over the whole dimension."
            ),
            snippet=snippet,
        ),
        verify=(
            "re-run `trainprof run` after vectorising: the summary's torch calls per step "
            f"(now {ops.get('calls_per_step') or 0:.0f}) should drop by about {calls:.0f} and "
            "forward+backward time with it; `trainprof compare` the two runs"
        ),
    )
