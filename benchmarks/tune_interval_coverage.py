"""How often ``trainprof tune``'s 95% interval covers the true ratio, unpaired and paired by round.

The figures :mod:`trainprof.experiments.stats` and the README quote. Simulated sweeps of two
arms with the same true speed (ratio 1), ``--steps`` steps a trial with 5% step noise, in
``--trials`` rounds, under three kinds of variation:

* ``steps``: step noise only;
* ``trials``: each trial's speed also varies on its own (``--trial-sd``, 3%);
* ``rounds``: each round's speed varies for both arms alike (``--round-sd``, 10%: the machine
  drifting between rounds, or a slower node of a cluster running a round).

For each, the share of sweeps whose interval contains 1, and the mean interval width, with
the interval unpaired (trials resampled per arm) and paired by round (the same rounds drawn
for both arms). The simulation is that of ``tests/test_tune.py`` (``_rounds``), there with
fewer sweeps.

    python benchmarks/tune_interval_coverage.py              # ~1 minute
    python benchmarks/tune_interval_coverage.py --trials 5 --sweeps 400
"""

from __future__ import annotations

import argparse

import numpy as np

from trainprof.experiments.stats import ratio_ci


def sweep(rng: np.random.Generator, k: int, steps: int, round_sd: float,
          trial_sd: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Two equal arms' trials in ``k`` rounds (steps of 10 ms, 5% step noise)."""
    shared = 1 + rng.normal(0, round_sd, k)
    return tuple(  # type: ignore[return-value]
        [rng.normal(10 * shared[r] * (1 + rng.normal(0, trial_sd)), 0.5, steps)
         for r in range(k)] for _ in range(2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=3, help="rounds (trials per arm)")
    ap.add_argument("--steps", type=int, default=40, help="steady steps per trial")
    ap.add_argument("--sweeps", type=int, default=200, help="simulated sweeps per case")
    ap.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples")
    ap.add_argument("--trial-sd", type=float, default=0.03)
    ap.add_argument("--round-sd", type=float, default=0.10)
    args = ap.parse_args()
    cases = {"steps": (0.0, 0.0), "trials": (0.0, args.trial_sd),
             "rounds": (args.round_sd, 0.0)}
    print(f"{args.sweeps} sweeps per case, {args.trials} trials per arm, {args.steps} steps a "
          f"trial, {args.resamples} resamples; true ratio 1")
    print(f"{'variation':<10} {'covered unpaired':>17} {'covered paired':>15} "
          f"{'width unpaired':>15} {'width paired':>13}")
    for name, (round_sd, trial_sd) in cases.items():
        rng = np.random.default_rng(1)
        hits = {False: 0, True: 0}
        width = {False: 0.0, True: 0.0}
        for i in range(args.sweeps):
            base, arm = sweep(rng, args.trials, args.steps, round_sd, trial_sd)
            for paired in (False, True):
                lo, hi = ratio_ci(base, arm, n_boot=args.resamples, seed=i, paired=paired)
                hits[paired] += lo <= 1.0 <= hi
                width[paired] += hi - lo
        n = args.sweeps
        print(f"{name:<10} {hits[False] / n:>17.0%} {hits[True] / n:>15.0%} "
              f"{width[False] / n:>15.3f} {width[True] / n:>13.3f}")


if __name__ == "__main__":
    main()
