"""Statistics of repeated trials: a two-level bootstrap of the ratio of two arms' mean step times.

``trainprof compare`` bootstraps the steps of *one* run per side (moving blocks of steps,
:mod:`trainprof.analysis.compare`), and says so: its interval covers step-to-step noise, not
the run-to-run variation of a machine (a neighbour's burst of load, a different CPU frequency,
where the pages of the dataset happen to be cached). ``trainprof tune`` repeats each arm in
several trials precisely to measure that variation, so its interval must include it. Pooling
the steps of all trials and bootstrapping them as one run would not: with 60 steps a trial,
two trials whose step times differ by 5% still give a pooled interval a fraction of that wide.

The interval here is therefore a **two-level (hierarchical) bootstrap** (Davison & Hinkley,
*Bootstrap Methods and their Application*, 1997, §3.8, hierarchical data): each resample
draws the arm's trials with replacement (level 1: run-to-run variation), then, within each
drawn trial, a moving-block resample of its steady steps (level 2: step-to-step variation,
autocorrelated; blocks of ``ceil(L ** (1/3))`` steps as in ``compare``, Künsch 1989; Hall,
Horowitz & Jing 1995). Each drawn trial contributes the same number ``L`` of steps (the median
steady length of the arm's trials), so a trial is the unit, whatever its warm-up length. The
statistic of a resample is its mean (``stat="median"`` is available; why tune compares means
is in :mod:`trainprof.experiments.tune`); the ratio of an arm to the baseline is
``stat(arm) / stat(baseline)`` over independent resamples of both, and the interval its
2.5% and 97.5% percentiles. With one trial per arm it is ``compare``'s moving-block bootstrap.
Why both levels: resampling the trials alone would leave a handful of distinct resamples with
2-3 trials; resampling at both levels counts the within-trial noise slightly more than once
(Davison & Hinkley), which errs on the cautious side, while drawing among only ``K`` trials
errs the other way (the plug-in between-trial variance is ``(K-1)/K`` of the sample's). More
trials narrow the interval for good reasons.

Resampling is vectorised (one index array per chunk of resamples) and seeded, so the same
trials always give the same interval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from trainprof.analysis.compare import (
    CONFIDENCE,
    MAX_RESAMPLE,
    N_BOOT,
    SEED,
    percentile_ratio_interval,
)


def boot_stats(
    trials: Sequence[np.ndarray],
    rng: np.random.Generator,
    n_boot: int = N_BOOT,
    stat: str = "mean",
) -> np.ndarray:
    """``stat`` (mean or median) of ``n_boot`` two-level bootstrap resamples of ``trials``."""
    reduce = {"mean": np.mean, "median": np.median}[stat]
    trials = [np.asarray(t, dtype=np.float64) for t in trials if len(t)]
    if not trials:
        return np.full(n_boot, math.nan)
    k = len(trials)
    lens = np.array([len(t) for t in trials])
    offsets = np.concatenate([[0], np.cumsum(lens)[:-1]])
    x = np.concatenate(trials)
    per_trial = max(1, min(int(np.median(lens)), MAX_RESAMPLE // k))
    block = max(1, min(math.ceil(per_trial ** (1 / 3)), int(lens.min())))
    n_blocks = math.ceil(per_trial / block)
    steps = np.arange(block)
    out = np.empty(n_boot)
    # chunks of resamples keep the index array to ~16 MB whatever the trial lengths
    chunk = max(1, 2_000_000 // (k * n_blocks * block))
    for lo in range(0, n_boot, chunk):
        hi = min(n_boot, lo + chunk)
        drawn = rng.integers(0, k, size=(hi - lo, k))  # level 1: trials
        span = (lens[drawn] - block + 1)[:, :, None]  # block starts allowed in each trial
        starts = offsets[drawn][:, :, None] + (
            rng.random((hi - lo, k, n_blocks)) * span
        ).astype(np.int64)  # level 2: blocks of steps
        idx = (starts[..., None] + steps).reshape(hi - lo, k, n_blocks * block)[:, :, :per_trial]
        out[lo:hi] = reduce(x[idx.reshape(hi - lo, k * per_trial)], axis=1)
    return out


def ratio_ci(
    baseline: Sequence[np.ndarray],
    arm: Sequence[np.ndarray],
    *,
    n_boot: int = N_BOOT,
    seed: int = SEED,
    confidence: float = CONFIDENCE,
    stat: str = "mean",
) -> tuple[float, float]:
    """Percentile interval of stat(arm) / stat(baseline), each side's trials resampled."""
    rng = np.random.default_rng(seed)
    mb = boot_stats(baseline, rng, n_boot, stat)
    ma = boot_stats(arm, rng, n_boot, stat)
    return percentile_ratio_interval(ma, mb, confidence)
