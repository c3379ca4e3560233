"""Periodic overhead: work that runs every N steps (evaluation, checkpointing, logging).

Sources (expert-rules.md): H6 — TensorFlow's *per-step host extras* (callbacks,
metrics or logging between steps: run them every N steps); N3 — Lightning measures
throughput excluding validation time. No peer publishes a threshold for it; we use
the same bands as the other shares (>= 20% high, >= 5% medium) and report >= 2% as
low, because a periodic cost is the easiest to remove (change one interval).

How it is found: steady-state steps whose duration is an outlier (median + max(5
robust sigma, 50% of the median)) and recur at a fixed period (see
:func:`trainprof.diagnosis.context.fit_period`). Outliers at the epoch length that
are mostly data wait belong to the input pipeline (worker start-up), outliers that
are mostly GC to the GC rule: this rule reports only what is left. The cost is the
*excess* of those steps over a median step (what removing the work would save), as a
share of total steady time. Where an iteration of the loop is k steps of different
kinds (a GAN's critic stepped k times a generator step), a step is judged against steps
of its own kind (:attr:`Context.step_kinds`): the generator's step, long every k steps
by design, is the algorithm, not periodic work. The excess is split by phase, which tells evaluation
(forward + data) from checkpointing or logging (time outside the training phases).
"""

from __future__ import annotations

import math
import shlex
from typing import Any

import numpy as np

from trainprof.analysis.steps import PHASE_COLUMNS
from trainprof.diagnosis.context import Context
from trainprof.diagnosis.finding import Finding, Fix, band
from trainprof.diagnosis.registry import rule

HIGH, MEDIUM, LOW = 0.20, 0.05, 0.02
#: The overhead share a suggested interval aims at.
TARGET_SHARE = 0.02


def fmt_s(seconds: float) -> str:
    """Seconds as the reports write them (:func:`trainprof.report.terminal.fmt_time`: s,
    ms or µs): a 2 ms log every 5 steps printed as "0.00 s" said nothing. Diagnosis does
    not import the report, hence this copy."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} µs"


def suggest_interval(period: int, excess_per_occurrence_s: float, step_s: float) -> int:
    """Smallest interval, a multiple of the current one, at which the work costs <= 2%.

    With work of ``E`` seconds every ``M`` steps of ``s`` seconds the overhead share is
    ``E / (E + M s)``; solving for ``<= TARGET_SHARE`` gives ``M >= E (1 - t) / (t s)``.
    """
    if step_s <= 0:
        return period * 10
    need = excess_per_occurrence_s * (1 - TARGET_SHARE) / (TARGET_SHARE * step_s)
    return max(period * 2, period * math.ceil(need / period))


#: Words in an option's name that say it sets how often something runs.
_INTERVAL_WORDS = ("interval", "every", "freq", "period", "_iters", "_steps")
#: ... and words that say it sets something else (a run's length, a schedule's warm-up).
_NOT_INTERVAL = ("max", "warmup", "total", "num_")


def _sets_interval(option: str) -> bool:
    name = option.lower()
    return (name.startswith("-") and any(w in name for w in _INTERVAL_WORDS)
            and not any(w in name for w in _NOT_INTERVAL))


def with_interval(command: str, period: int, interval: int) -> str:
    """``command`` (the script and its arguments) with the option that set the period to
    ``period`` set to ``interval`` instead: ``--eval_interval=10`` or ``--eval-every 10``
    becomes ``--eval_interval=200``, so the verify line is the command to run. Unchanged
    when no single option with such a name has that value."""
    words = shlex.split(command)
    found = []
    for i, word in enumerate(words):
        name, eq, value = word.partition("=")
        if eq and value == str(period) and _sets_interval(name):
            found.append((i, f"{name}={interval}"))
        elif not eq and i and word == str(period) and _sets_interval(words[i - 1]):
            found.append((i, str(interval)))
    if len(found) != 1:
        return command
    i, replacement = found[0]
    return shlex.join([*words[:i], replacement, *words[i + 1:]])


#: Words in a region's name that say what it is (an evaluation, a checkpoint or a log).
_EVAL_WORDS = ("eval", "val", "test", "metric", "score", "bench", "infer", "predict", "sample")
_SAVE_WORDS = ("save", "ckpt", "checkpoint", "log", "dump", "write", "export", "upload")


def _named_region(ctx: Context, indices: np.ndarray, total_excess_s: float,
                  regions: dict[str, Any]) -> str | None:
    """The named region the spikes are, when regions of their count hold most of their
    excess: the script said what that work is (``prof.region("eval")``), which the phases
    cannot (inside a region an evaluation's forward passes are region time, in "other",
    where a checkpoint's time is too)."""
    if not regions or total_excess_s <= 0:
        return None
    col = ctx.seconds("region_ns")
    excess = float(np.clip(col[indices] - float(np.median(col)), 0, None).sum())
    if excess < 0.5 * total_excess_s:
        return None
    return max(regions, key=lambda name: float(regions[name].get("total_s") or 0.0))


def _region_kind(name: str) -> str:
    """``evaluation``, ``checkpoint_or_logging`` or ``periodic_work``, by the region's name."""
    lower = name.lower()
    if any(w in lower for w in _SAVE_WORDS):
        return "checkpoint_or_logging"
    if any(w in lower for w in _EVAL_WORDS):
        return "evaluation"
    return "periodic_work"


#: An evaluation on a fixed subset of batches, with autograd off (the fixes' snippets).
_EVAL_LOOP = (
    "    model.eval()\n"
    "    with torch.inference_mode():\n"
    "        for i, (x, y) in enumerate(val_loader):\n"
    "            if i == EVAL_BATCHES:\n"
    "                break\n"
    "            ...\n"
    "    model.train()"
)


def _region_fix(name: str, cause: str, period: int, interval: int, per_occ: float,
                share: float) -> tuple[str, str]:
    """The fix for a periodic named region that is an evaluation, or of unknown kind."""
    cost = f"runs every {period} steps and costs {share * 100:.0f}% of the run"
    if cause == "evaluation":
        text = (
            f"The region '{name}' {cost}; it is an evaluation (by its name). Evaluate less "
            f"often (every {interval} steps keeps it near 2%), on a fixed subset of batches, "
            "under torch.no_grad() or torch.inference_mode() with the model in eval mode, or "
            "in the background: a separate process that evaluates the checkpoints training "
            "saves."
        )
        body = _EVAL_LOOP
        head = ("EVAL_BATCHES = 20  # a fixed subset is enough to track progress\n", "EVAL")
    else:
        text = (
            f"The region '{name}' {cost}. Run it less often (every {interval} steps keeps it "
            "near 2%), on less data, or off the training thread (a background thread or "
            "process) if training need not wait for it."
        )
        body = "    ..."
        head = ("", "REGION")
    snippet = (
        f"{head[1]}_INTERVAL = {interval}  # was {period}: {fmt_s(per_occ)} each, "
        f"{share * 100:.0f}% of the run\n"
        f"{head[0]}\n"
        f"if step % {head[1]}_INTERVAL == 0:\n"
        f"    with prof.region({name!r}):\n"
        + "\n".join("    " + line for line in body.splitlines())
    )
    return text, snippet


#: Total variation distance between the spikes' excess split over the phases and the step's
#: own split below which the spikes are the step's own work, slower: no added work.
SAME_SPLIT = 0.2


def _typical_split(ctx: Context, spikes: np.ndarray) -> dict[str, float]:
    """Each phase's median seconds over the steady steps other than ``spikes``: the split of
    a typical step (the run's breakdown carries the spikes, and where they are most of the
    time it is their split)."""
    base = np.setdiff1d(np.arange(len(ctx.durations)), spikes)
    if len(base) == 0:
        return {}
    return {phase: float(np.median(ctx.phase_seconds(phase)[base]))
            for phase in PHASE_COLUMNS}


def _same_work_slower(excess: dict[str, float], breakdown: dict[str, float]) -> bool:
    """Is the excess of the spike steps split over the phases as the step itself is? Then
    nothing was added to those steps: the same forward, backward and optimizer ran slower
    (another process's work at its own period, a frequency drop), which no interval
    changes. An evaluation adds forward time, a checkpoint time outside the phases: each
    moves the split. examples/healthy.py on a machine another process kept busy read
    "[medium] Every 4 steps, periodic work adds 3.2 ms: 14%", with "checkpointing, logging"
    for a fix, from spikes whose excess went 25% forward, 61% backward, 10% optimizer, like
    its steps."""
    keys = set(excess) | {k for k, v in breakdown.items() if isinstance(v, int | float)}
    total = sum(float(v) for v in breakdown.values() if isinstance(v, int | float))
    if total <= 0:
        return False
    distance = 0.5 * sum(abs(float(excess.get(k, 0.0))
                             - float(breakdown.get(k) or 0.0) / total) for k in keys)
    return distance < SAME_SPLIT


@rule("periodic.every_n_steps")
def every_n_steps(ctx: Context) -> Finding | None:
    group = ctx.periodic
    if group is None or group.fit is None or ctx.total_s <= 0:
        return None
    share = group.total_excess_s / ctx.total_s
    severity = band(share, HIGH, MEDIUM, LOW)
    if severity is None:
        return None
    n = len(group.indices)
    period = group.fit.period
    per_occ = group.total_excess_s / n
    step_s = ctx.typical_step_s  # a GAN's k steps of two kinds: their mean, not the median
    phases = {k: v / group.total_excess_s for k, v in group.excess_s.items() if v > 0}
    if _same_work_slower(phases, _typical_split(ctx, group.indices)):
        return None
    eval_like = phases.get("forward", 0) + phases.get("data_wait", 0)
    host_like = phases.get("other", 0)
    if eval_like >= 0.5 and eval_like >= host_like:
        cause, what = "evaluation", "evaluation"
    elif host_like >= 0.5:
        cause, what = "checkpoint_or_logging", "checkpointing or logging"
    else:
        cause, what = "periodic_work", "periodic work"
    spike_time = float(ctx.durations[group.indices].sum())
    regions = {
        name: r for name, r in (ctx.summary.get("regions") or {}).items()
        if isinstance(r, dict) and r.get("count") and abs(int(r["count"]) - n) <= max(1, n // 5)
    }
    evidence = {
        "period_steps": period,
        "occurrences": n,
        "at_steps": ctx.step_numbers(group.indices)[:10],
        "step_median_s": step_s,
        "spike_median_s": float(sorted(ctx.durations[group.indices])[n // 2]),
        "excess_per_occurrence_s": per_occ,
        "excess_share": share,
        "spike_steps_time_share": spike_time / ctx.total_s,
        "excess_by_phase": phases,
        "coverage": group.fit.coverage,
    }
    if regions:
        evidence["matching_regions"] = regions
    region = _named_region(ctx, group.indices, group.total_excess_s, regions)
    if region is not None:
        evidence["region"] = region
        cause, what = _region_kind(region), f"the region '{region}'"
    k = ctx.per_iteration if ctx.step_kinds is not None else None
    if k is not None:
        evidence["steps_per_iteration"] = k
    interval = suggest_interval(period, per_occ, step_s)
    steps_equiv = per_occ / step_s if step_s > 0 else float("nan")
    title = (
        f"Every {period} steps"
        + (f" ({period / k:g} iterations of {k} steps)" if k is not None else "")
        + f", {what} adds {fmt_s(per_occ)} (~{steps_equiv:.0f} steps' worth): "
        f"{share * 100:.0f}% of training time"
    )
    if region is not None and cause != "checkpoint_or_logging":
        text, snippet = _region_fix(region, cause, period, interval, per_occ, share)
    elif cause == "evaluation":
        text = (
            f"A step every {period} steps also runs the model forward on other data (evaluation): "
            f"it costs {share * 100:.0f}% of the run. Evaluate less often (every {interval} "
            "steps keeps it near 2%), on a fixed subset of batches, under "
            "torch.inference_mode(), with a larger eval batch size."
        )
        snippet = (
            f"EVAL_INTERVAL = {interval}  # was {period}: {fmt_s(per_occ)} each, "
            f"{share * 100:.0f}% of the run\n"
            "EVAL_BATCHES = 20  # a fixed subset is enough to track progress\n\n"
            "if step % EVAL_INTERVAL == 0:\n" + _EVAL_LOOP
        )
    elif cause == "periodic_work":
        top = sorted(phases.items(), key=lambda kv: -kv[1])[:2]
        where = " and ".join(f"{name.replace('_', ' ')} ({v * 100:.0f}%)" for name, v in top)
        text = (
            f"Every {period} steps a step takes {fmt_s(per_occ)} longer, mostly in {where}: "
            f"{share * 100:.0f}% of the run. Something the script does only in those steps "
            "runs there (an operation inside the model or the optimizer on a schedule: an EMA "
            "of the weights, a clipping or logging of gradient norms, a larger batch): find "
            f"it and run it less often (every {interval} steps keeps it near 2%)."
        )
        snippet = (f"INTERVAL = {interval}  # was {period}: {fmt_s(per_occ)} each, "
                   f"{share * 100:.0f}% of the run\n"
                   "if step % INTERVAL == 0:\n"
                   "    ...  # the work that runs every few steps")
    else:
        where = f"The region '{region}' (a checkpoint or a log, by its name)" \
            if region is not None else "Work outside the training phases"
        text = (
            f"{where} runs every {period} steps and costs "
            f"{share * 100:.0f}% of the run (checkpointing, logging, metrics, file I/O). "
            f"Do it less often (every {interval} steps keeps it near 2%); save checkpoints "
            "from a background thread after copying the state to CPU, or with "
            "torch.distributed.checkpoint.async_save."
        )
        snippet = (
            f"SAVE_INTERVAL = {interval}  # was {period}: {fmt_s(per_occ)} each, "
            f"{share * 100:.0f}% of the run\n"
            "saver = None  # (before the loop)\n\n"
            "def to_cpu(obj):  # a copy that training cannot change while it is written\n"
            "    if torch.is_tensor(obj):\n"
            "        return obj.detach().to(\"cpu\", copy=True)\n"
            "    if isinstance(obj, dict):\n"
            "        return {k: to_cpu(v) for k, v in obj.items()}\n"
            "    if isinstance(obj, (list, tuple)):\n"
            "        return type(obj)(to_cpu(v) for v in obj)\n"
            "    return obj\n\n"
            "if step % SAVE_INTERVAL == 0:\n"
            "    state = to_cpu({\"model\": model.state_dict(), "
            "\"optimizer\": optimizer.state_dict(), \"step\": step})\n"
            "    if saver is not None:\n"
            "        saver.join()  # one write at a time\n"
            "    saver = threading.Thread(target=torch.save, args=(state, path))\n"
            "    saver.start()"
        )
    command = with_interval(ctx.script, period, interval)
    run = f"trainprof run {command}"
    verify = (
        (f"re-run with the interval raised to {interval} (`{run}`)"
         if command != ctx.script else
         f"re-run with the interval raised to {interval} in the script: `{run}`")
        + " and `trainprof compare` the two runs: the mean step should fall towards the "
        f"{'typical step' if k is not None else 'median'} ({step_s * 1e3:.1f} ms), "
        f"and the run's time by up to {share * 100:.0f}%"
    )
    return Finding(
        category="periodic_overhead",
        cause=cause,
        title=title,
        severity=severity,
        evidence=evidence,
        estimated_gain=share,
        fix=Fix(text=text, snippet=snippet),
        verify=verify,
        verify_commands=(run,),
    )
