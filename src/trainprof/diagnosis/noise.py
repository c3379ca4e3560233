"""Measurement noise: how far the step times of this run can be trusted.

Not a bottleneck (its estimated gain is 0, so it ranks last), but it qualifies every
other finding and every before/after comparison. Sources (expert-rules.md): N1 —
TF step statistics (mean, sigma, min, max) and profiling a steady window, not the
warm-up; N4 — Composer's robust statistics: median/MAD pruning with a minimum of 10
samples. Hence:

* ``too_few_steps``: fewer than 10 steady-state steps (N4's minimum).
* ``unstable_step_time`` / ``external_load``: the robust coefficient of variation
  (1.4826 x MAD / median, so a periodic evaluation does not count as noise: the
  periodic rule reports that) >= 10% low, >= 25% medium. When other processes keep
  the machine's cores busy (system CPU in cores minus this run's process and
  workers >= 0.5 core), the cause is ``external_load``. Where an iteration of the loop is
  k steps (a GAN's discriminator stepped k times a generator step:
  :mod:`trainprof.analysis.iterations`), the steps alternate by design and the CV is over
  iterations, sums of k consecutive steps.

* ``rare_long_steps``: a few outlier steps, at no period, that pull the mean step 1.5x
  above the median (the robust CV leaves them out, the throughput does not).

* ``warmup_under_load``: a long warm-up (at least 5 steps and a fifth of the run,
  whose median step is 1.5x the steady one or more) during which other processes kept
  at least half a core more busy than in the steady steps. Warm-up is told from the
  step times alone (:func:`trainprof.analysis.steps.detect_warmup`), so a burst of
  outside load at the start reads as warm-up and the steady figures come from the
  quieter rest: an explorer's run under a burst had its throughput overstated 2x. Not
  where the warm-up compiled (torch.compile's worker processes count as outside load).

The evidence includes the *resolution* of the run: ``2.8 x CV / sqrt(n)``, the
smallest relative difference between the mean step times of two such runs that a
comparison can tell from noise at about 95% (two-sample normal approximation).
Severity never exceeds medium: noise makes conclusions uncertain, it does not slow
training.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from trainprof.analysis.system import OUTSIDE_LOAD_CORES
from trainprof.diagnosis.context import Context, robust_scale
from trainprof.diagnosis.finding import Finding, Fix
from trainprof.diagnosis.registry import rule

MIN_STEADY = 10
#: Runs of at most this many steps have no steady state at all (the first step is in them).
FIRST_STEPS_ONLY = 2
CV_LOW, CV_MEDIUM = 0.10, 0.25
EXTERNAL_CORES = OUTSIDE_LOAD_CORES


def _seconds(value: Any) -> str:
    if not isinstance(value, int | float):
        return "unknown"
    return f"{value:.2f} s" if value >= 1 else f"{value * 1e3:.3g} ms"


def _where_the_time_went(ctx: Context) -> str | None:
    """The line of the script most of a run's samples were on, when it has no steady state
    (the stacks' ``first_steps``: :mod:`trainprof.analysis.loop_stacks`)."""
    first = (ctx.summary.get("loop_stacks") or {}).get("first_steps") or {}
    rows = first.get("lines") or []
    if first.get("steady_state") or not rows or rows[0].get("file") is None:
        return None
    top = rows[0]
    where = f"{os.path.basename(top['file'])}:{top['line']}"
    if top.get("source"):
        where += f" `{top['source']}`"
    if top.get("function") and top["function"] != "<module>":
        where += f" (in {top['function']})"
    return f"{top['share'] * 100:.0f}% of {first.get('samples')} samples on {where}"


@rule("noise.step_time_stability")
def step_time_stability(ctx: Context) -> Finding | None:
    info = ctx.step_info
    count = int(info.get("count") or 0)
    steady = int(info.get("steady_count") or 0)
    if count == 0:
        return None  # no steps: nothing was measured, so nothing to qualify
    run = f"trainprof run {ctx.script}"
    verify_more = (
        f"re-run `{run}` for more steps on an otherwise idle machine; "
        "`trainprof tune` repeats trials and reports confidence intervals"
    )
    if steady < MIN_STEADY:
        evidence: dict[str, Any] = {"steps": count, "warmup_steps": info.get("warmup"),
                                    "steady_steps": steady, "minimum": MIN_STEADY}
        few = count <= FIRST_STEPS_ONLY
        if few:
            # a run of one or two steps has no steady state: its step is the first, and a
            # first step carries every one-time cost; say so, with the time it took
            evidence["step_time_s"] = info.get("median_s")
            what = "1 step" if count == 1 else f"{count} steps"
            title = (f"{what} in all: no steady state, so the step time "
                     f"({_seconds(info.get('median_s'))}) includes one-time start-up costs")
            went = _where_the_time_went(ctx)
            if went is not None:
                evidence["time_went_to"] = went
        else:
            title = (f"Only {steady} steady-state step{'' if steady == 1 else 's'}: "
                     "too few to judge step time")
        return Finding(
            category="measurement_noise",
            cause="too_few_steps",
            title=title,
            severity="medium",
            evidence=evidence,
            estimated_gain=0.0,
            fix=Fix(
                text=(
                    ("A first step pays for lazy initialisation, the allocator's growth, "
                     "compilation and the DataLoader's start: its time and its breakdown "
                     "are not the loop's. " if few else "")
                    + (f"Its stack samples say where its time went: {went}. "
                       if few and went is not None else "")
                    + f"Run at least {MIN_STEADY} steps after warm-up (more for noisy steps) "
                    "before trusting shares, percentiles or a before/after comparison."
                ),
                snippet=(
                    f"trainprof run {ctx.script}  # with the script set to run at least "
                    f"{MIN_STEADY + int(info.get('warmup') or 0) + 10} steps"
                ),
            ),
            verify=verify_more,
            verify_commands=(run,),
        )
    if not ctx.has_steps():
        return None
    dur = ctx.durations
    per = info.get("per_iteration")
    grouped = isinstance(per, int) and per >= 2 and len(dur) >= MIN_STEADY * per
    if grouped:
        # an iteration of k steps of two kinds (a GAN's discriminator alone, then with the
        # generator): the loop's structure, not noise; iterations are what vary or not
        dur = dur[: len(dur) // per * per].reshape(-1, per).sum(axis=1)
    med, sigma = robust_scale(dur)
    if med <= 0:
        return None
    cv = sigma / med
    if cv < CV_LOW:
        return None
    severity = "medium" if cv >= CV_MEDIUM else "low"
    n = len(dur)
    kept = (np.delete(dur, ctx.step_spikes) if not grouped and len(ctx.step_spikes) < n
            else dur)
    evidence: dict[str, Any] = {
        "robust_cv": cv,
        "cv_without_outliers": float(kept.std() / kept.mean()) if kept.mean() > 0 else None,
        "steady_steps": n,
        "step_median_s": med,
        "resolution": 2.8 * cv / math.sqrt(n),
        "outlier_steps": len(ctx.step_spikes),
    }
    if grouped:
        evidence["steps_per_iteration"] = per
    ext = ctx.external_cores
    if ext is not None:
        evidence["external_load_cores"] = ext
    if ctx.system.get("ctx_switches_ps") is not None:
        evidence["ctx_switches_ps"] = ctx.system["ctx_switches_ps"]
    if ext is not None and ext >= EXTERNAL_CORES:
        cause = "external_load"
        text = (
            f"Other processes kept ~{ext:.1f} of the {ctx.cores} usable cores busy during the "
            f"run, and step times vary by {cv * 100:.0f}% (robust CV). Differences smaller than "
            f"~{evidence['resolution'] * 100:.0f}% between two such runs are noise: measure on "
            "an idle machine, or on cores nobody else uses (taskset, a dedicated node)."
        )
        snippet = "ps -eo pid,pcpu,etime,args --sort=-pcpu | head  # who else uses the CPU"
    else:
        cause = "unstable_step_time"
        text = (
            f"Step times vary by {cv * 100:.0f}% (robust CV) from step to step: differences "
            f"smaller than ~{evidence['resolution'] * 100:.0f}% between two such runs are "
            "noise. Run more steps; variable batch shapes, frequent host reads and a busy "
            "machine are the usual sources."
        )
        snippet = (
            f"trainprof run {ctx.script}  # with the script set to run "
            f"~{max(4 * n, 200)} steps"
        )
    return Finding(
        category="measurement_noise",
        cause=cause,
        title=(f"Iteration times ({per} steps each) vary by {cv * 100:.0f}% (robust CV over "
               f"{n} iterations)" if grouped else
               f"Step times vary by {cv * 100:.0f}% (robust CV over {n} steady steps)"),
        severity=severity,
        evidence=evidence,
        estimated_gain=0.0,
        fix=Fix(text=text, snippet=snippet),
        verify=verify_more,
        verify_commands=(run,),
    )


#: The mean step this much above the median makes the throughput (the mean's) and the
#: step-time percentiles (the median's) disagree: the steps that do it are named.
MEAN_OVER_MEDIAN = 1.5


@rule("noise.long_steps")
def long_steps(ctx: Context) -> Finding | None:
    """A few long steps that no other rule explains, where they pull the mean step 1.5x
    above the median: two 2 s steps among 27 ms ones made 10.4 steps/s of a 27.4 ms median,
    and the robust CV (median/MAD) left them out by design, so nothing said so. Only the
    stray outliers count: those that recur at a period, an epoch's first steps and full
    collections are other rules' findings."""
    if not ctx.has_steps():
        return None
    dur = ctx.durations
    med, sigma = robust_scale(dur)
    mean = float(dur.mean())
    if med <= 0 or mean < MEAN_OVER_MEDIAN * med:
        return None
    stray = ctx.spike_groups.get("stray")  # not a period's, an epoch's, GC's or the input's
    spikes = stray.indices if stray is not None else np.zeros(0, dtype=np.int64)
    above = float(np.clip(dur - med, 0, None).sum())
    if len(spikes) == 0 or float((dur[spikes] - med).sum()) < 0.5 * above:
        return None
    longest = spikes[np.argsort(dur[spikes])[::-1]][:5]
    at = ctx.step_numbers(np.sort(longest))
    took = ", ".join(_ms(float(d)) for d in dur[np.sort(longest)])
    k = len(spikes)
    more = f" (the {len(longest)} longest)" if k > len(longest) else ""
    evidence: dict[str, Any] = {
        "step_mean_s": mean, "step_median_s": med, "robust_cv": sigma / med,
        "long_steps": k, "at_steps": at, "long_steps_s": [float(d) for d in dur[np.sort(longest)]],
        "long_steps_time_share": float(dur[spikes].sum() / dur.sum()),
    }
    ext = ctx.external_cores
    load = ""
    if ext is not None:
        evidence["external_load_cores"] = ext
        if ext >= EXTERNAL_CORES:
            load = (f" Other processes kept ~{ext:.1f} of the {ctx.cores} usable cores busy: "
                    "a stall of the machine is likely.")
    return _noise(
        "rare_long_steps",
        title=(f"{k} long step{'s' if k != 1 else ''} make the mean step {_ms(mean)} against a "
               f"median of {_ms(med)}"),
        severity="low",
        evidence=evidence,
        fix=Fix(
            text=(
                f"Steps {', '.join(map(str, at))}{more} took {took}, {dur[longest[0]] / med:.0f}x "
                f"the median step, and recur at no period. The throughput is the mean's, the "
                f"step-time percentiles the median's: they disagree by {mean / med:.1f}x, and "
                f"these steps are {evidence['long_steps_time_share'] * 100:.0f}% of the steady "
                "time. If they are part of training (a one-off evaluation or checkpoint, a "
                "first batch), the throughput is right; if not, re-run and see whether they "
                f"come back.{load}"
            ),
            snippet=f"trainprof run {ctx.script}  # again: do steps {at[0]}... stay slow?",
        ),
        verify=(f"re-run `trainprof run {ctx.script}` on an otherwise idle machine and "
                "`trainprof compare` the two runs: their median steps should agree"),
        verify_commands=(f"trainprof run {ctx.script}",),
    )


#: A warm-up this long (steps, and share of the run's steps) is worth a look at the load.
LONG_WARMUP_STEPS, LONG_WARMUP_SHARE = 5, 0.2
#: ... and this much slower than the steady steps (median over median).
SLOW_WARMUP = 1.5


@rule("noise.warmup_under_load")
def warmup_under_load(ctx: Context) -> Finding | None:
    info = ctx.step_info
    warm, count = int(info.get("warmup") or 0), int(info.get("count") or 0)
    if warm < LONG_WARMUP_STEPS or count <= 0 or warm < LONG_WARMUP_SHARE * count:
        return None
    during = ctx.system.get("outside_cores_warmup")
    after = ctx.external_cores or 0.0
    if not isinstance(during, int | float) or during < EXTERNAL_CORES or (
            during - after < EXTERNAL_CORES):
        return None
    w_med, s_med = info.get("warmup_median_s"), info.get("median_s")
    if not (w_med and s_med) or w_med < SLOW_WARMUP * s_med:
        return None
    compiles = ctx.summary.get("compiles") or {}
    if set(compiles.get("steps") or []) - set(compiles.get("steps_after_warmup") or []):
        return None  # compiling in the warm-up: its worker processes look like outside load
    cores = ctx.cores
    of_cores = f" of the {cores} usable cores" if cores else ""
    return _noise(
        "warmup_under_load",
        title=(f"The first {warm} steps ({warm / count:.0%} of the run), counted as warm-up, "
               f"ran while other processes kept ~{during:.1f} cores busy"),
        severity="low",
        evidence={"warmup_steps": warm, "steps": count, "warmup_median_s": w_med,
                  "step_median_s": s_med, "outside_cores_warmup": during,
                  "outside_cores_steady": after},
        fix=Fix(
            text=(
                f"Warm-up is where step times settle, told from the step times alone. These "
                f"{warm} steps took {_ms(w_med)} (median) against {_ms(s_med)} after them, "
                f"while other processes kept ~{during:.1f}{of_cores} busy, and ~{after:.1f} "
                "after: part of this warm-up was the load, not the script warming up. The "
                "steady-state figures (step time, throughput, shares) come from the quieter "
                f"rest of the run; on a machine loaded throughout, steps run nearer "
                f"{_ms(w_med)}. Measure on an idle machine, or on cores nobody else uses."
            ),
            snippet="ps -eo pid,pcpu,etime,args --sort=-pcpu | head  # who else uses the CPU",
        ),
        verify=(f"re-run `trainprof run {ctx.script}` on an otherwise idle machine: the "
                "warm-up should be a few steps"),
        verify_commands=(f"trainprof run {ctx.script}",),
    )


def _noise(cause: str, **parts: Any) -> Finding:
    """A measurement-noise finding: it qualifies the numbers, so it claims no gain."""
    return Finding(category="measurement_noise", cause=cause, estimated_gain=0.0, **parts)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"
