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

**Coverage, measured** (``benchmarks/tune_interval_coverage.py``: 200 simulated sweeps of two
equal arms per case, 40 steps a trial with 5% step noise). With only step noise, the 95%
interval covered the truth in 98-100% of the sweeps (3 and 5 trials, paired or not). When
each trial's speed also varied on its own by 3%: 90% unpaired and 84% paired with 3 trials,
92% and 88% with 5. Few trials are few clusters, and a percentile bootstrap over 3-5 clusters
cannot see how far their spread could be from the truth: the interval is then narrower than
it should be, and the note tune prints when an arm's trials disagree says so. A Student-t
interval over the trials (K - 1 degrees of freedom) would cover 95%, at 2.2 times the width
for 3 trials and 6.5 times for 2, which would leave tune unable to tell most settings apart
at its default of 3 trials; more trials are the remedy that works.

``trainprof tune`` runs its arms in rounds (every arm once per round, back to back), and
when the baseline and an arm each have a usable trial in the same rounds, their interval is
**paired by round** (:func:`ratio_ci`, ``paired=True``): each resample draws the same rounds
for both, so a round that was slower for every arm (the machine drifting, a slower node of a
cluster) cancels in the ratio rather than widening its interval. Measured as above with the
rounds 10% apart: 98% coverage paired at a 7 times narrower width (0.031 against 0.218 with
3 trials), where unpaired the rounds' spread hid any change under ~10%. The price, when the
trials vary on their own instead: a few points less coverage (84% against 90% with 3
trials), as three rounds estimate how alike the arms' trials are only roughly. Rounds that
differ are the common case on a machine that drifts and on a cluster, hence paired.

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
    drawn: np.ndarray | None = None,
) -> np.ndarray:
    """``stat`` (mean or median) of ``n_boot`` two-level bootstrap resamples of ``trials``.

    ``drawn``: the trials each resample draws (``n_boot`` rows of ``len(trials)`` indices),
    to share one draw of rounds between two arms (:func:`ratio_ci`, ``paired``); None draws
    them here. With ``drawn``, every trial must have steps (its index is its round)."""
    reduce = {"mean": np.mean, "median": np.median}[stat]
    if drawn is not None and not all(len(t) for t in trials):
        raise ValueError("paired trials must all have steps")
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
        picked = (rng.integers(0, k, size=(hi - lo, k)) if drawn is None
                  else drawn[lo:hi])  # level 1: trials (rounds)
        span = (lens[picked] - block + 1)[:, :, None]  # block starts allowed in each trial
        starts = offsets[picked][:, :, None] + (
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
    paired: bool = False,
) -> tuple[float, float]:
    """Percentile interval of stat(arm) / stat(baseline), each side's trials resampled.

    ``paired``: ``baseline[i]`` and ``arm[i]`` ran in the same round (a block of ``trainprof
    tune``'s randomised block design: every arm once, back to back, on one machine or one
    node). Each resample then draws the same rounds for both sides, so that what a round did
    to every arm alike (a slower node, the machine drifting between rounds) stays in both
    sides of the ratio and cancels, instead of widening the interval as noise. This is the
    two-level bootstrap with rounds as its clusters (Davison & Hinkley 1997, §3.8): level 2
    (blocks of steps within each trial) stays independent per side. When the trials vary
    independently of their rounds, pairing changes the interval little: the drawn rounds still
    carry each side's trial-to-trial differences (tests/test_tune.py checks the coverage of
    both cases)."""
    rng = np.random.default_rng(seed)
    drawn = None
    if paired:
        if len(baseline) != len(arm):
            raise ValueError(f"paired sides need one trial per round each, got "
                             f"{len(baseline)} and {len(arm)}")
        drawn = rng.integers(0, len(baseline), size=(n_boot, len(baseline)))
    mb = boot_stats(baseline, rng, n_boot, stat, drawn)
    ma = boot_stats(arm, rng, n_boot, stat, drawn)
    return percentile_ratio_interval(ma, mb, confidence)
