"""The optimizer step runs its slowest implementation: for-loop (or foreach) where fused exists.

Sources (expert-rules.md): H7 — "single-tensor optimizer": ``_single_tensor_{adam,
adamw,sgd}`` in a trace → ``foreach=True`` or fused optimizers (TorchTidy's pattern
matcher; Hugging Face's ``optim="adamw_torch_fused"``); the PyTorch tuning guide says
the same. No peer publishes a threshold: the bands are TF's host-overhead ones (H5:
≥ 15% high, ≥ 3% moderate) on the optimizer's share of the step, with a low band from
2%.

The capture records, at each optimizer's first step, which implementation its step
runs (:mod:`trainprof.capture.optimizer_impl`: torch's default is the for-loop on
CPU and foreach on CUDA; fused is never the default), whether the class has a fused
or foreach one, and whether its parameters can take fused (floating point, on a
device with fused kernels). The rule proposes the fastest available: fused, else
foreach. ``benchmarks/optimizer_step.py`` (AdamW on CPU, one thread, arms interleaved,
median per-round ratios to the for-loop): over 96 small tensors foreach ×0.60, fused
×0.17; over 8 large tensors (1.3 M parameters) foreach ×0.87, fused ×0.13. The whole
step gains less: ``examples/optimizer_loop.py`` with ``trainprof tune`` gave fused ×0.75
and foreach ×0.98 (not significant), so foreach is proposed only where no fused exists,
and the ``verify`` line measures it.

Gain: an upper bound, the optimizer's share of the step (the update cannot take less
than nothing), robust to a few descheduled steps (:meth:`Context.steady_share`: the update
costs the same every step); ``trainprof tune --knob optimizer=script,fused`` measures the
real one. With several optimizers, the optimizer phase is all of theirs: the share is
the candidates' part of it, by each optimizer's own ``step()`` time (run.json's
``optimizers[].step_s``). A recommender's SparseAdam (no fused one) over 45M embedding
parameters took 11.4 ms a step beside an Adam over a 61k-parameter MLP at 0.36 ms, and
the whole phase, 41% of the step, had been put on the Adam.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from trainprof.diagnosis.context import Context
from trainprof.diagnosis.finding import Finding, Fix, band
from trainprof.diagnosis.registry import rule
from trainprof.schema import IMPL_FOR_LOOP, IMPL_FOREACH, IMPL_FUSED

HIGH, MEDIUM, LOW = 0.15, 0.03, 0.02

# the implementations as run.json records them (trainprof.capture.optimizer_impl)
SINGLE, FOREACH, FUSED = IMPL_FOR_LOOP, IMPL_FOREACH, IMPL_FUSED


def _better(entry: dict[str, Any]) -> str | None:
    """The faster implementation this optimizer could run (None: none, or unknown)."""
    impl = entry.get("implementation")
    supports = entry.get("supports") or []
    if not entry.get("torch_step") or impl == FUSED:
        return None
    if "fused" in supports and not entry.get("fused_unavailable"):
        return FUSED
    if impl == SINGLE and "foreach" in supports:
        return FOREACH
    return None


def _candidates(ctx: Context) -> list[dict[str, Any]]:
    """Optimizers that could run faster, the one delimiting steps first."""
    entries = [e for e in ctx.summary.get("optimizers") or []
               if isinstance(e, dict) and _better(e) is not None]
    return sorted(entries, key=lambda e: not e.get("primary"))


def _short(cls: str) -> str:
    return cls.rsplit(".", 1)[-1]


def _timed(ctx: Context) -> list[dict[str, Any]]:
    """The described optimizers whose step() time was recorded."""
    return [e for e in ctx.summary.get("optimizers") or [] if isinstance(e, dict)
            and isinstance(e.get("step_s"), int | float) and e.get("steps")]


def _candidates_part(ctx: Context, candidates: list[dict[str, Any]]) -> float | None:
    """The candidates' part of every optimizer's step() time; None where it is not known
    for each of them (a record from before the timing, optimizers not described) or one
    optimizer is all there is."""
    every = [e for e in ctx.summary.get("optimizers") or [] if isinstance(e, dict)]
    timed = _timed(ctx)
    if len(every) < 2 or len(timed) != len(every) or ctx.summary.get(
            "optimizers_not_described"):
        return None
    total = sum(float(e["step_s"]) for e in timed)
    mine = sum(float(e["step_s"]) for e in candidates if e in timed)
    return mine / total if total > 0 else None


#: Mean parameters a tensor below which the for-loop's ops are small: 64k float32 are
#: 256 KiB, within a core's L2 cache, so an op's fixed price (dispatch) weighs on it.
SMALL_TENSOR = 1 << 16
#: ... and from which each op of the update is a pass over a large tensor's memory
#: (fused does them all in one pass: ×0.13 over 8 tensors of 1.3 M, module docstring).
LARGE_TENSOR = 1 << 20


def _count(n: float) -> str:
    """12,345 / 1.3M / 44.9M parameters."""
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,.0f}"


def _sizes(n: int, numel: Any) -> str:
    """The for-loop's tensors by their real size: the ops are small ones only where the
    tensors are (a finding said "a few small ops each" for 9 tensors of 44.9 M)."""
    if not isinstance(numel, int | float) or numel <= 0 or n <= 0:
        return f"{n} tensors, several ops of the update each"
    mean = numel / n
    sizes = f"{n} tensors, {_count(numel)} parameters, {_count(mean)} a tensor on average"
    if mean < SMALL_TENSOR:
        return f"{sizes}: a few small ops each"
    if mean >= LARGE_TENSOR:
        return f"{sizes}: each op of the update a pass over a large tensor's memory"
    return f"{sizes}: several ops of the update each"


_SLOW_STEPS = "a few slow steps inflate it"


def _why_the_breakdown_differs(ctx: Context, share: float, page: float,
                               part: float | None) -> str:
    """Why the breakdown's optimizer share ``page`` is more than 1.5x this finding's
    ``share`` (a typical step's: :meth:`Context.steady_share`), or "" where it is not: two
    optimizer shares on one page, 15.7% and 8.5%, read as a mistake unless told apart."""
    if page <= 1.5 * share:
        return ""
    detail = ctx.summary.get("breakdown_detail") or {}
    weighted = float(detail.get("optimizer_step") or 0.0) * (part if part is not None else 1.0)
    reasons = []
    if weighted > 1.2 * share:
        reasons.append(_SLOW_STEPS)
    if float(detail.get("zero_grad") or 0.0) > 0.1 * page:
        reasons.append("it holds zero_grad too")
    if part is not None and part < 0.8:
        reasons.append("it holds the other optimizers' steps too")
    return "; ".join(reasons) or _SLOW_STEPS


@rule("optimizer.implementation")
def optimizer_implementation(ctx: Context) -> Finding | None:
    candidates = _candidates(ctx)
    if not candidates:
        return None
    # optimizer.step() alone: the breakdown's "optimizer" also holds zero_grad
    detail = ctx.summary.get("breakdown_detail") or {}
    share = ctx.steady_share(
        "optimizer_ns", float(detail.get("optimizer_step", ctx.breakdown.get("optimizer")) or 0.0))
    part = _candidates_part(ctx, candidates)
    if part is not None:
        share *= part
    severity = band(share, HIGH, MEDIUM, LOW)
    if severity is None:
        return None
    main = candidates[0]
    impl, target = str(main.get("implementation")), str(_better(main))
    name = _short(str(main.get("class") or "the optimizer"))
    n = int(main.get("param_tensors") or 0)
    evidence: dict[str, Any] = {
        "optimizer_share": share,
        "optimizer": main.get("class"),
        "implementation": impl,
        "faster_implementation": target,
        "param_tensors": n,
        "parameters": main.get("numel"),
        "devices": main.get("devices"),
        "step_median_s": ctx.step_info.get("median_s"),
    }
    if "zero_grad" in detail:
        evidence["zero_grad_share"] = detail["zero_grad"]
    if part is not None:
        # of the optimizer phase, by each optimizer's own step() time
        evidence["share_of_optimizer_phase"] = part
        evidence["step_s_by_optimizer"] = {
            _short(str(e.get("class"))): e["step_s"] / e["steps"] for e in _timed(ctx)}
    if main.get("steps") and isinstance(main.get("step_s"), int | float):
        opt_s = float(main["step_s"]) / int(main["steps"])
    elif ctx.has_steps():
        opt_s = float(np.median(ctx.seconds("optimizer_ns")))
    else:
        opt_s = None
    if opt_s is not None:
        evidence["optimizer_s_per_step"] = opt_s
        if n:
            evidence["optimizer_s_per_tensor"] = opt_s / n
    if len(candidates) > 1:
        # class -> how many (a script may build one per epoch)
        evidence["other_optimizers"] = dict(Counter(_short(str(e.get("class")))
                                                    for e in candidates[1:]))
    how = {SINGLE: f"one parameter tensor at a time ({_sizes(n, main.get('numel'))})",
           FOREACH: f"over lists of tensors ({n} tensors), one op of the update at a time"}
    # the breakdown on the same page says "optimizer X%": where that is well above this
    # share, say which each is, and why they differ
    page = float(ctx.breakdown.get("optimizer") or 0.0)
    why = _why_the_breakdown_differs(ctx, share, page, part)
    typical = _SLOW_STEPS in why
    title = (f"{name}.step() takes {share * 100:.1f}% of "
             f"{'a typical step' if typical else 'step time'} running its {impl} "
             f"implementation; {target} is faster")
    text = (
        f"torch.optim's {name} updates the parameters {how.get(impl, impl)}. "
        + ("Its fused implementation does the whole update of all of them in one kernel "
           "(CUDA and CPU): pass fused=True. "
           if target == FUSED else
           f"{name} has no fused implementation; foreach=True runs each op of the update "
           "over all tensors at once. ")
        + "torch never picks fused by default, and on CPU its default is the for-loop. "
        "The update is the same arithmetic; results can differ in the last bits."
    )
    if why:
        of = ("of a typical step: its median time over the median step's" if typical else
              "of step time: its own step()'s")
        text += (f" ({share * 100:.1f}% {of}; the breakdown's optimizer {page * 100:.1f}% is "
                 f"of the steady time, and {why}.)")
    flag = "fused=True" if target == FUSED else "foreach=True"
    if (ctx.train_loader or {}).get("driven_by") == "transformers.Trainer" and name == "AdamW":
        snippet = ('args = TrainingArguments(..., optim="adamw_torch_fused")'
                   f"  # was the {impl} AdamW")
    else:
        snippet = (f"opt = torch.optim.{name}(model.parameters(), lr=lr, ..., {flag})"
                   f"  # was the {impl} implementation")
    others = evidence.get("other_optimizers")
    if others:
        # a GAN's two, or one built per epoch: the share is every optimizer's step
        listed = ", ".join(f"{cls} ×{k}" for cls, k in others.items())
        text += (f" The script builds more optimizers that could run faster ({listed}): "
                 f"pass {flag} to each; the knob below changes them all.")
        snippet += f"\n# and {flag} for every other optimizer: {listed}"
    tune = f"trainprof tune --knob optimizer=script,{target} {ctx.script}"
    verify = f"{tune}  (the optimizer share, now {share * 100:.1f}%, should fall)"
    return Finding(
        category="host_launch",
        cause=f"{impl.replace('-', '_')}_optimizer",
        title=title,
        severity=severity,
        evidence=evidence,
        estimated_gain=share,
        fix=Fix(text=text, snippet=snippet),
        verify=verify,
        verify_commands=(tune,),
    )
