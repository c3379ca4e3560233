"""Step statistics: warm-up vs steady state, step-time percentiles, the phase breakdown.

Definitions used throughout trainprof:

* **Warm-up** is the prefix of steps before step times settle (worker start,
  lazy initialisation, allocator growth, cuDNN autotuning). It ends at the
  first step ``i`` such that step ``i`` *and* the median of the window that
  starts at ``i`` both lie in the steady band of the second half of the run.
  The band is centred on the reference (the second half's median), at least
  the larger of 10% of it and 3 robust standard deviations (1.4826 x MAD), so
  noisy runs are not called "still warming up"; and it reaches 10% of the
  reference beyond what the second half itself shows - the 5th to 95th
  percentile of its steps, the range of its window medians - so a run whose
  steps alternate between two levels (a log every other step, two loaders)
  is steady from its first settled step, not warm for half its length, which
  a band around one median would make it. Warm-up is capped at half the steps.
* **Step-time percentiles** are over steady-state steps only (numpy's
  default linear interpolation).
* **Breakdown** shares are *time-weighted*: the sum of each phase over steady
  steps divided by the sum of their durations. Because phases are exclusive
  (see :mod:`trainprof.capture.clock`), the shares add up to 1, and an
  evaluation that makes every 100th step slow weighs as much as it costs.
  ``zero_grad`` is reported inside ``optimizer`` (optimizer bookkeeping) and
  named regions inside ``other``; both are also given on their own in
  ``breakdown_detail``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trainprof.schema import FLAG_BACKWARD, FLAG_MANUAL, FLAG_PARTIAL, FLAG_PROFILED, FLAG_SKIPPED

#: A step that took in at least this many times a median step's samples fetched batches
#: besides its training batch(es): another loader's (an evaluation pass iterated inside the
#: loop), not the training loader's. The step record's ``samples`` counts every batch any
#: DataLoader iterator returned in it (capture/hooks.py); an explorer's trainval.py (a
#: 640-sample validation pass every 40 steps of 32): 672 against 32.
EXTRA_BATCHES = 2.0

BREAKDOWN_KEYS = ("data_wait", "forward", "backward", "optimizer", "gc", "other")

#: The step-record columns (ns) each breakdown phase groups: zero_grad inside the
#: optimizer, named regions inside "other" (see the module docstring).
PHASE_COLUMNS: dict[str, tuple[str, ...]] = {
    "data_wait": ("data_wait_ns",),
    "forward": ("forward_ns",),
    "backward": ("backward_ns",),
    "optimizer": ("optimizer_ns", "zero_grad_ns"),
    "gc": ("gc_ns",),
    "other": ("other_ns", "region_ns"),
}


#: A step is an outlier (the diagnosis' spikes, the loop stacks' unusual steps) when it
#: exceeds the median by all of: SPIKE_SIGMAS robust standard deviations (1.4826 x MAD,
#: Composer's median/MAD pruning, expert-rules N4), SPIKE_REL of the median step, and
#: SPIKE_ABS_S. The relative floor keeps ordinary jitter on a shared machine from being
#: called a spike; the absolute floor does the same for microsecond steps.
SPIKE_SIGMAS = 5.0
SPIKE_REL = 0.5
SPIKE_ABS_S = 0.5e-3


def robust_scale(x: np.ndarray) -> tuple[float, float]:
    """(median, 1.4826 x MAD) of ``x``: a standard deviation that outliers cannot inflate."""
    if len(x) == 0:
        return 0.0, 0.0
    med = float(np.median(x))
    return med, 1.4826 * float(np.median(np.abs(x - med)))


def outliers(x: np.ndarray, floor: float) -> np.ndarray:
    """Indices where ``x`` exceeds its median by more than ``max(SPIKE_SIGMAS * sigma, floor)``."""
    if len(x) < 5:
        return np.zeros(0, dtype=np.int64)
    med, sigma = robust_scale(x)
    return np.flatnonzero(x > med + max(SPIKE_SIGMAS * sigma, floor))


def outliers_by_kind(x: np.ndarray, floor: float, kinds: np.ndarray | None) -> np.ndarray:
    """:func:`outliers` judged within each kind of step (``kinds``: a label per step).

    A loop whose iteration is k steps of different kinds (a GAN's critic stepped k times
    a generator step: :mod:`trainprof.analysis.iterations`) has one long step an
    iteration by design; against the median of all steps every one of them is an
    outlier, recurring at period k, and was reported as periodic work. Against the
    median and spread of its own kind only work beyond the step's usual cost stands
    out. ``kinds`` None: :func:`outliers` of all steps.
    """
    if kinds is None:
        return outliers(x, floor)
    found = [np.flatnonzero(kinds == kind)[outliers(x[kinds == kind], floor)]
             for kind in np.unique(kinds)]
    return np.sort(np.concatenate(found)) if found else np.zeros(0, dtype=np.int64)


def complete_steps(steps: np.ndarray) -> np.ndarray:
    """The steps to analyse: complete ones, with a manual run's automatic prefix merged.

    The run's cut-off last step is dropped, and so are steps recorded while a
    heavy tool was on (``--deep``, ``--py``: FLAG_PROFILED), whose times
    include the tool's own cost. When the script marks steps itself
    (``prof.step()``), the clock cannot know that before the first call, so
    the optimizer steps it saw until then are merged into the first manual
    step: together they are the user's first step.
    """
    if len(steps) == 0:
        return steps
    return merge_auto_prefix(steps[(steps["flags"] & (FLAG_PARTIAL | FLAG_PROFILED)) == 0])


def merge_auto_prefix(steps: np.ndarray) -> np.ndarray:
    """``steps`` with a manual run's automatic prefix (the optimizer steps the clock saw
    before the script's first ``prof.step()``) merged into the first manual step: the
    user's first step, as every view shows it (the Perfetto export had drawn it as two, 121
    steps where the summary counted 120)."""
    if len(steps) == 0:
        return steps
    manual = (steps["flags"] & FLAG_MANUAL) != 0
    if not manual.any() or manual[0]:
        return steps
    first = int(np.argmax(manual))
    head = steps[: first + 1]
    merged = head[-1:].copy()
    for name in steps.dtype.names:
        if name not in ("step", "t_start_ns", "flags"):
            merged[name] = head[name].sum()
    merged["t_start_ns"] = head["t_start_ns"][0]
    return np.concatenate([merged, steps[first + 1 :]])


def detect_warmup(durations: np.ndarray) -> int:
    """Number of warm-up steps at the start of ``durations`` (see module docstring)."""
    n = len(durations)
    if n < 3:
        return 0
    tail = durations[n // 2 :]
    ref = float(np.median(tail))
    mad = float(np.median(np.abs(tail - ref)))
    tol = max(0.10 * ref, 3 * 1.4826 * mad)
    margin = 0.10 * ref
    window = max(3, min(20, n // 20))
    limit = n // 2
    p5, p95 = np.percentile(tail, [5, 95])
    step_lo, step_hi = min(ref - tol, p5 - margin), max(ref + tol, p95 + margin)
    if len(tail) >= window:
        windows = np.lib.stride_tricks.sliding_window_view(tail, window)
        # at most ~20,000 of them (a million-step run stays fast and small)
        windows = windows[:: max(1, len(windows) // 20_000)]
        medians = np.median(windows, axis=1)
        win_lo = min(ref - tol, float(medians.min()) - margin)
        win_hi = max(ref + tol, float(medians.max()) + margin)
    else:
        win_lo, win_hi = ref - tol, ref + tol
    for i in range(limit + 1):
        if not step_lo <= durations[i] <= step_hi:
            continue
        if win_lo <= float(np.median(durations[i : i + window])) <= win_hi:
            return i
    return limit


def delimiter_of(steps: np.ndarray) -> str | None:
    """How steps were delimited: ``optimizer``, ``backward`` or ``manual``."""
    if len(steps) == 0:
        return None
    flags = int(steps["flags"][-1])
    if flags & FLAG_MANUAL:
        return "manual"
    if flags & FLAG_BACKWARD:
        return "backward"
    return "optimizer"


def training_samples(samples: np.ndarray, loaders: int) -> tuple[np.ndarray, int]:
    """Each step's samples of the loader that feeds the training steps, and how many
    samples of other loaders were left out.

    The capture counts, per step, every batch any DataLoader iterator returned (one
    counter: telling loaders apart per batch would cost a lookup per batch on the
    always-on path). An evaluation loader iterated inside the loop every N steps so
    adds its whole pass to one step: counted as training samples it inflated
    samples/s (train 32 a step plus 100-sample eval batches every 10 steps read as
    ~1.9x the training rate). With more than one loader in the run, a step holding
    at least :data:`EXTRA_BATCHES` times the median step's samples is counted as the
    median step's samples (what the training loader brings a step); the rest is
    another loader's. With one loader nothing is left out: a script may well fetch
    a varying number of its batches a step.
    """
    out = samples.astype(np.int64)
    if loaders < 2 or len(out) == 0:
        return out, 0
    typical = float(np.median(out))
    if typical <= 0:
        return out, 0
    extra = out >= EXTRA_BATCHES * typical
    if not extra.any():
        return out, 0
    kept = int(round(typical))
    left_out = int((out[extra] - kept).sum())
    out = out.copy()
    out[extra] = kept
    return out, left_out


def step_statistics(steps: np.ndarray, loaders: int = 1) -> dict[str, Any]:
    """The ``steps``, ``breakdown`` and ``samples_per_s`` parts of a run summary.

    ``loaders``: how many DataLoaders the run iterated; with more than one, samples/s
    counts only the training loader's samples (:func:`training_samples`) and
    ``samples_other_loaders`` says how many of the steady steps' samples were left out.
    """
    done = complete_steps(steps)
    n = len(done)
    profiled = 0
    if len(steps):
        flags = steps["flags"]
        profiled = int((((flags & FLAG_PROFILED) != 0) & ((flags & FLAG_PARTIAL) == 0)).sum())
    out: dict[str, Any] = {
        "steps": {
            # every complete step seen; the statistics leave out the profiled ones
            "count": n + profiled,
            "warmup": 0,
            "steady_count": 0,
            "median_s": None,
            "p10_s": None,
            "p90_s": None,
            "mean_s": None,
            "warmup_median_s": None,
            "delimiter": delimiter_of(done),
            # steps left out because a heavy tool (--deep, --py) was on during them
            "profiled": profiled,
            # iterations whose optimizer step a GradScaler skipped (inf/NaN gradients):
            # steps like the others, without the optimizer's work
            "skipped": int(((done["flags"] & FLAG_SKIPPED) != 0).sum()) if n else 0,
        },
        "breakdown": None,
        "breakdown_detail": None,
        "samples_per_s": None,
        # steady steps' samples of loaders other than the training one (an evaluation
        # pass inside the loop), left out of samples_per_s; None when none were
        "samples_other_loaders": None,
        "steps_per_s": None,
        "syncs": None,
        "gc": None,
    }
    if n == 0:
        return out
    dur = done["dur_ns"].astype(np.float64) / 1e9
    warm = detect_warmup(dur)
    steady = done[warm:]
    sd = dur[warm:]
    total_s = float(sd.sum())
    p10, p50, p90 = np.percentile(sd, [10, 50, 90])
    out["steps"].update(
        warmup=warm,
        steady_count=len(steady),
        median_s=float(p50),
        p10_s=float(p10),
        p90_s=float(p90),
        mean_s=float(sd.mean()),
        warmup_median_s=float(np.median(dur[:warm])) if warm else None,
    )
    if total_s <= 0:
        return out

    def share(field: str) -> float:
        return float(steady[field].sum()) / 1e9 / total_s

    detail = {
        "data_wait": share("data_wait_ns"),
        "forward": share("forward_ns"),
        "backward": share("backward_ns"),
        "optimizer_step": share("optimizer_ns"),
        "zero_grad": share("zero_grad_ns"),
        "gc": share("gc_ns"),
        "region": share("region_ns"),
        "other": share("other_ns"),
    }
    out["breakdown_detail"] = detail
    out["breakdown"] = {
        "data_wait": detail["data_wait"],
        "forward": detail["forward"],
        "backward": detail["backward"],
        "optimizer": detail["optimizer_step"] + detail["zero_grad"],
        "gc": detail["gc"],
        "other": detail["other"] + detail["region"],
    }
    kept, left_out = training_samples(steady["samples"], loaders)
    samples = int(kept.sum())
    out["samples_per_s"] = samples / total_s if samples else None
    out["samples_other_loaders"] = left_out or None
    out["steps_per_s"] = len(steady) / total_s
    k = len(steady)
    out["syncs"] = {
        "per_step": float(steady["sync_n"].sum()) / k,
        "share": share("sync_ns"),
        "host_reads_per_step": float(steady["host_reads"].sum()) / k,
    }
    out["gc"] = {
        "collections_per_step": float(steady["gc_n"].sum()) / k,
        "gen2_per_step": float(steady["gc_gen2_n"].sum()) / k,
    }
    return out
