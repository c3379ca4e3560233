"""What one stack sample costs the training thread (trainprof.capture.loop_stacks).

The always-on capture samples the training thread's stack 4 or 20 times a second. One
sample is far too cheap to see at that rate against the noise of a shared machine, so
this runs the benchmark loop of ``overhead.py`` under trainprof at a high rate (200 a
second by default) and without stack samples, in rounds of blocks in a random order
in one process, and divides the per-round ratio by the rate: the cost of one sample.
A third arm runs the loop with a Python handler that does nothing, signalled as often
by ``setitimer``: what the signal's delivery costs by itself. The cost at the real
rates follows (cost per sample x samples a second).

    python benchmarks/stack_sampling.py            # ~2 minutes
    python benchmarks/stack_sampling.py --rate 500 --rounds 40
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import _ci_pct, _ratio_pct, make_loop, start_recorder  # noqa: E402

from trainprof.capture.loop_stacks import HZ, SPARSE_HZ  # noqa: E402


def measure(rounds: int, steps: int, rate: float) -> dict[str, float]:
    run_steps, _ = make_loop()
    run_steps(320)
    tmp = Path(tempfile.mkdtemp(prefix="trainprof-stacks-"))
    times: dict[str, list[float]] = {"off": [], "sampled": [], "noop_signal": []}
    rng = random.Random(0)
    ticks = [0]

    def noop(signum: int, frame: object) -> None:
        ticks[0] += 1

    for r in range(rounds):
        order = list(times)
        rng.shuffle(order)
        for name in order:
            os.environ["TRAINPROF_STACK_HZ"] = str(rate) if name == "sampled" else "0"
            rec = start_recorder(tmp / f"{name}{r}")
            if name == "noop_signal":
                previous = signal.signal(signal.SIGALRM, noop)
                signal.setitimer(signal.ITIMER_REAL, 1 / rate, 1 / rate)
            try:
                run_steps(64)  # settle after the start
                times[name].append(run_steps(steps))
            finally:
                if name == "noop_signal":
                    signal.setitimer(signal.ITIMER_REAL, 0)
                    signal.signal(signal.SIGALRM, previous)
                rec.stop("finished", 0)
    os.environ.pop("TRAINPROF_STACK_HZ", None)
    out = {"rate": rate, "rounds": rounds, "step_ms": statistics.median(times["off"]) * 1e3}
    for name in ("sampled", "noop_signal"):
        pct = _ratio_pct(times[name], times["off"])
        lo, hi = _ci_pct(times[name], times["off"])
        out[f"{name}_pct"] = pct
        out[f"{name}_us_per_sample"] = pct / 100 / rate * 1e6
        out[f"{name}_us_per_sample_ci"] = (lo / 100 / rate * 1e6, hi / 100 / rate * 1e6)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=200.0, help="samples a second")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=1000, help="steps per block")
    args = parser.parse_args()
    torch.set_num_threads(1)
    res = measure(args.rounds, args.steps, args.rate)
    us, (lo, hi) = res["sampled_us_per_sample"], res["sampled_us_per_sample_ci"]
    print(f"loop: {res['step_ms']:.3f} ms/step; {res['rounds']} rounds at {args.rate:g} samples/s")
    print(f"stack samples:        +{res['sampled_pct']:.2f}% -> {us:.0f} us per sample "
          f"(95% CI {lo:.0f} .. {hi:.0f})")
    print(f"no-op signal handler: +{res['noop_signal_pct']:.2f}% -> "
          f"{res['noop_signal_us_per_sample']:.0f} us per signal")
    for hz in (SPARSE_HZ, HZ):
        print(f"at {hz:g} samples/s: {us * hz / 1e4:.3f}% of the training thread's time")


if __name__ == "__main__":
    main()
