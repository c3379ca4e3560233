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
        # counted calls, not timed ones: the measured gain tends to be larger (see above)
        "gain_is_estimate": True,
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
            f"re-run `trainprof run {ctx.script}` after vectorising: the summary's torch calls "
            f"per step (now {ops.get('calls_per_step') or 0:.0f}) should drop by about "
            f"{calls:.0f} and forward+backward time with it; `trainprof compare` the two runs"
        ),
        verify_commands=(f"trainprof run {ctx.script}",),
    )


#: A function of the user's own code taking this share of the profiled wall time (its own
#: time, cProfile's tottime) is worth a finding: bands on share x the step share it runs in.
HOT_HIGH, HOT_MEDIUM, HOT_LOW = 0.30, 0.10, 0.03


@rule("python_loop.hot_python_function")
def hot_python_function(ctx: Context) -> Finding | None:
    """A function of the user's code dominates the step in pure Python (from ``--py``).

    The cProfile window measures own time (tottime) per function; interpreted
    Python in the user's code (a per-sample augmentation, a hand-written metric,
    a Python loop over a batch) is the part that vectorising or moving to
    torch/numpy removes. Gain: its share of the profiled wall time, an upper
    bound on what making it free could save.
    """
    section = ctx.summary.get("python_profile") or {}
    hot = section.get("hottest_user") or {}
    share = float(hot.get("share") or 0.0)
    severity = band(share, HOT_HIGH, HOT_MEDIUM, HOT_LOW)
    if severity is None or not hot.get("function"):
        return None
    where = _where({"file": hot.get("file"), "line": hot.get("line")})
    line = hot.get("hottest_line") or {}
    cprof = section.get("cprofile") or {}
    evidence = {
        "function": hot.get("function"),
        "where": where,
        "own_time_s": hot.get("tottime"),
        "calls": hot.get("ncalls"),
        "share_of_profiled_time": share,
        "steps_profiled": cprof.get("steps_profiled"),
    }
    if line:
        evidence["hottest_line"] = f"{line.get('line')}: {str(line.get('source', '')).strip()}"
        evidence["hottest_line_share_of_function"] = (line.get("percent") or 0) / 100
    text = (
        f"{hot.get('function')} ({where}) spends {share * 100:.0f}% of the profiled time in "
        "its own Python code. Move the work into vectorised torch/numpy operations over the "
        "whole batch or array, cache what does not change between steps, or, for per-sample "
        "work, run it in DataLoader workers."
    )
    if line:
        text += f" Its hottest line is {line.get('line')} ({line.get('percent', 0):.0f}% of it)."
    return Finding(
        category="python_loop",
        cause="hot_python_function",
        title=(
            f"{hot.get('function')} takes {share * 100:.0f}% of the step in pure Python "
            f"({where})"
        ),
        severity=severity,
        evidence=evidence,
        estimated_gain=share,
        fix=Fix(
            text=text,
            snippet=(
                f"# {where}: see the line profile for where the time goes\n"
                f"trainprof run --lines {where.rsplit(':', 1)[0]}:{hot.get('function')} "
                f"{ctx.script}"
            ),
        ),
        verify=(
            f"re-run `trainprof run --py {ctx.script}`: {hot.get('function')}'s share "
            f"(now {share * 100:.0f}%) should drop; `trainprof compare` the step times"
        ),
        verify_commands=(f"trainprof run --py {ctx.script}",),
    )
