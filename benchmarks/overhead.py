"""Overhead of trainprof's always-on capture on a ~1 ms/step CPU training loop.

The same loop runs in one process in rounds of blocks - plain, plain again,
trainprof, in a random order each round - so that drift of the machine (other
load, thermal, allocator state) hits every arm equally. Each
block is timed from the outside with ``perf_counter``; the overhead is the
median over rounds of (block time with capture / block time without). Each
step is timed too, and the same ratio of the blocks' median steps is reported
beside it: the budget (1% of *median* step time) is that figure; the block
time, which also carries what happens once in many steps (the flush thread's
drain, a stack sample, a timed batch), is the stricter one.
torch.profiler (CPU activity, the usual settings) is measured on the same loop
for contrast.

    python benchmarks/overhead.py            # ~4 minutes
    python benchmarks/overhead.py --quick    # a few seconds, a rough figure
    python benchmarks/overhead.py --parts    # also the capture's parts on their own
    python benchmarks/overhead.py --processes 3   # three processes, one after the other
    TRAINPROF_PURE_PYTHON=1 python benchmarks/overhead.py   # the pure-Python hot path

The figure goes into the README. Noise floor: the spread of plain-vs-plain
blocks is printed too; an overhead below it is not measurable on this machine.
Wall-clock figures on a shared machine are noisy; ``--cpu-time`` times blocks
by the training thread's CPU time instead, and
``benchmarks/overhead_instructions.py`` counts instructions (callgrind), which
repeat to a fraction of a percent.

One process's interval covers the noise between its rounds, not what differs
between processes (where the heap and the code land, which cache sets they share)
or between quarters of an hour on a shared host (what the neighbours do to the
shared caches, which sets the price of the capture's cache misses): two runs can
disagree by more than their intervals. ``--processes N`` runs the whole measurement
in N fresh processes, one after the other, and reports each and their median.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainprof.capture import clock as _clock
from trainprof.capture.recorder import Recorder

#: True when the step clock's C fast path is in use (False on versions before it)
FAST = getattr(_clock, "FAST", False)


def make_loop(
    clock: Callable[[], float] = time.perf_counter, hidden: int = 256
) -> tuple[object, object]:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4096, 128), torch.randint(0, 10, (4096,)))
    loader = DataLoader(data, batch_size=64, shuffle=True, drop_last=True)
    model = nn.Sequential(nn.Linear(128, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                          nn.ReLU(), nn.Linear(hidden, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    state = {"it": iter(loader)}

    def run_steps(n: int, step_times: list[float] | None = None) -> float:
        """Mean step time of ``n`` steps; each step's own time appended to ``step_times``
        when given (one more clock read a step, in every arm alike)."""
        t0 = t = clock()
        for _ in range(n):
            try:
                x, y = next(state["it"])
            except StopIteration:
                state["it"] = iter(loader)
                x, y = next(state["it"])
            loss = loss_fn(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step_times is not None:
                now = clock()
                step_times.append(now - t)
                t = now
        return (clock() - t0) / n

    return run_steps, loss_fn


def _ratio_pct(with_: list[float], without: list[float]) -> float:
    """Median of the per-round ratios, as a percentage over 1.

    Pairing blocks of the same round cancels slow drift; the median ignores
    the odd block hit by foreign load.
    """
    return (statistics.median(a / b for a, b in zip(with_, without, strict=True)) - 1) * 100


def _ci_pct(with_: list[float], without: list[float], n: int = 2000) -> tuple[float, float]:
    """95% bootstrap confidence interval of :func:`_ratio_pct` (resampling rounds)."""
    ratios = np.array(with_) / np.array(without)
    rng = np.random.default_rng(0)
    meds = np.median(rng.choice(ratios, size=(n, len(ratios)), replace=True), axis=1)
    lo, hi = np.percentile(meds, [2.5, 97.5])
    return (lo - 1) * 100, (hi - 1) * 100


def interleaved(arms: list[str], rounds: int, block: Callable[[str], float],
                seed: int = 0) -> dict[str, list[float]]:
    """``block(arm)`` for every arm, in ``rounds`` rounds whose arm order is shuffled:
    the side-by-side measurement the benchmarks report as per-round ratios."""
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    rng = random.Random(seed)
    for _ in range(rounds):
        order = list(arms)
        rng.shuffle(order)
        for arm in order:
            times[arm].append(block(arm))
    return times


def ratio_line(arm: str, times: dict[str, list[float]], base: str, label: str) -> str:
    """``  ARM  ×R of LABEL (95% CI ×LO–×HI)``: the median per-round ratio to ``base``."""
    pct = _ratio_pct(times[arm], times[base])
    lo, hi = _ci_pct(times[arm], times[base])
    return (f"  {arm:<15} ×{1 + pct / 100:.2f} of {label} "
            f"(95% CI ×{1 + lo / 100:.2f}–×{1 + hi / 100:.2f})")


def arm_arguments(doc: str, rounds: int = 12, steps: int = 5) -> argparse.Namespace:
    """``--rounds``, ``--steps`` and ``--threads`` of the side-by-side benchmarks (the
    thread count is set here); the description is the docstring's first line."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--steps", type=int, default=steps, help="training steps per block")
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def training_steps(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                   y: torch.Tensor) -> Callable[[int], float]:
    """``steps -> mean seconds per step`` of a cross-entropy training step on one batch."""

    def run(steps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return (time.perf_counter() - t0) / steps

    return run


def compare_arms(title: str, arms: dict[str, Callable[[int], float]], args: argparse.Namespace,
                 warm: int = 2) -> None:
    """Warm each arm, time them side by side in shuffled rounds, and print the first arm's
    median step under ``title``, then every other arm's ratio to it."""
    base = next(iter(arms))
    for run in arms.values():
        run(warm)
    times = interleaved(list(arms), args.rounds, lambda name: arms[name](args.steps))
    median = sorted(times[base])[len(times[base]) // 2]
    print(f"{title}: {base} {median * 1e3:.2f} ms a step")
    for name in list(arms)[1:]:
        print(ratio_line(name, times, base, base))


def start_recorder(run_dir: Path, *, workers: bool = True, sampler: bool = True) -> Recorder:
    """The always-on capture as ``trainprof run`` starts it (less the one-off fingerprint).

    Parts can be left out to tell their shares of the cost apart: ``workers``,
    the DataLoader sample/collate timing of :mod:`trainprof.capture.worker`
    (here in the training process: ``num_workers=0``); ``sampler``, the system
    sampler's ticks (its process still starts, but never samples). The step
    clock, its hooks and the flush thread are always on.
    """
    # the one-off fingerprint (~20 ms per run) is left out: this is the per-step cost
    rec = Recorder(run_dir, name="overhead", command=sys.argv, fingerprint=False,
                   sample_interval_s=0.2 if sampler else 3600.0)
    if not workers and rec.instrumentation is not None:
        rec.instrumentation.workers = None
    return rec.start()


def measure(
    rounds: int, steps: int, cpu_time: bool = False, hidden: int = 256, settle: int = 128,
    parts: bool = False,
) -> dict[str, Any]:
    """Rounds of three arms in random order: plain, plain again, trainprof.

    Every arm first runs ``settle`` steps timed apart, then ``steps`` steps:
    the per-step overhead (the 1% budget) is the ratio of the second blocks.
    The first steps after the capture starts are slower - patching classes
    invalidates CPython's specialised bytecode for them (torch's Python code on
    ``Tensor``, ``Module``...), and a specialised instruction that keeps
    missing goes back to the generic one only after 52 misses: code that runs
    once per step needs ~50 steps to recover, counted from the last patch (the
    forward wrapper moves onto the root module classes after
    ``DISCOVERY_STEPS``) - a one-off cost per run, reported separately as
    ``startup_ms`` over the first ``settle`` steps. "plain again" against
    "plain" is the noise floor. With ``parts``, two more arms (see
    :func:`start_recorder`): ``hooks``, the step clock and its hooks alone, and
    ``nosampler``, everything but the system sampler's ticks.
    torch.profiler is measured afterwards, in its own rounds, each profiled
    block followed by an untimed block: its teardown disturbs the process for
    a while (a plain block right after it runs up to 1.5x slower here), which
    would otherwise spill onto whichever arm comes next.
    """
    run_steps, _ = make_loop(time.thread_time if cpu_time else time.perf_counter, hidden)
    run_steps(320)  # warm up (whole epochs, like every block)
    rng = random.Random(0)
    times: dict[str, list[float]] = {"plain": [], "plain2": [], "trainprof": []}
    if parts:
        times["hooks"] = []
        times["nosampler"] = []
    first: dict[str, list[float]] = {name: [] for name in times}
    # each block's median step: the budget is "1% of median step time"; the
    # block mean above also carries what happens once in many steps (the flush
    # thread's drain, a stack sample, a timed batch), so it is the stricter figure
    medians: dict[str, list[float]] = {name: [] for name in times}
    tmp = Path(tempfile.mkdtemp(prefix="trainprof-overhead-"))

    def arm(name: str, r: int) -> None:
        rec = None
        if name != "plain" and name != "plain2":
            rec = start_recorder(tmp / f"{name}{r}", workers=name != "hooks",
                                 sampler=name == "trainprof")
        try:
            first[name].append(run_steps(settle) * settle)
            step_times: list[float] = []
            times[name].append(run_steps(steps, step_times))
            medians[name].append(statistics.median(step_times))
        finally:
            if rec is not None:
                rec.stop("finished", 0)

    for r in range(rounds):
        order = list(times)
        rng.shuffle(order)
        for name in order:
            arm(name, r)

    plain_t: list[float] = []
    profiled: list[float] = []
    for _ in range(max(4, rounds // 4)):
        plain_t.append(run_steps(steps))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            profiled.append(run_steps(steps))
        run_steps(steps)  # untimed: let the process settle after the profiler
    res: dict[str, Any] = {
        "hot_path": "C" if FAST else "Python",
        "step_ms_plain": statistics.median(times["plain"]) * 1e3,
        "overhead_pct": _ratio_pct(times["trainprof"], times["plain"]),
        "overhead_ci95_pct": _ci_pct(times["trainprof"], times["plain"]),
        "noise_pct": _ratio_pct(times["plain2"], times["plain"]),
        "noise_ci95_pct": _ci_pct(times["plain2"], times["plain"]),
        "step_ms_plain_median": statistics.median(medians["plain"]) * 1e3,
        "median_step_overhead_pct": _ratio_pct(medians["trainprof"], medians["plain"]),
        "median_step_overhead_ci95_pct": _ci_pct(medians["trainprof"], medians["plain"]),
        "median_step_noise_pct": _ratio_pct(medians["plain2"], medians["plain"]),
        "median_step_noise_ci95_pct": _ci_pct(medians["plain2"], medians["plain"]),
        "torch_profiler_overhead_pct": _ratio_pct(profiled, plain_t),
        "startup_ms": statistics.median(
            (a - b) * 1e3 for a, b in zip(first["trainprof"], first["plain"], strict=True)
        ),
        "rounds": rounds,
        "steps_per_block": steps,
        "settle_steps": settle,
    }
    if parts:
        for part in ("hooks", "nosampler"):
            res[f"{part}_overhead_pct"] = _ratio_pct(times[part], times["plain"])
            res[f"{part}_overhead_ci95_pct"] = _ci_pct(times[part], times["plain"])
            res[f"{part}_median_step_overhead_pct"] = _ratio_pct(medians[part],
                                                                 medians["plain"])
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rounds", type=int, default=120,
                        help="rounds of blocks; the confidence interval narrows as 1/sqrt")
    parser.add_argument("--hidden", type=int, default=256,
                        help="MLP width: 256 gives ~1 ms/step here, 1024 ~10 ms/step")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time blocks by the training thread's CPU time (ignores time the "
                        "thread was descheduled: steal, other load) instead of wall time")
    parser.add_argument("--cpu", type=int, default=None,
                        help="pin the benchmark to this core (less noise on a busy machine)")
    parser.add_argument("--settle", type=int, default=128,
                        help="steps after the capture starts that are left out of the ratio "
                        "(their extra time is the one-off start-up cost)")
    parser.add_argument("--parts", action="store_true",
                        help="also measure the step clock and hooks alone, and everything "
                        "but the system sampler")
    parser.add_argument("--processes", type=int, default=1,
                        help="run the measurement in this many fresh processes, one after "
                        "the other, and report each and their median")
    args = parser.parse_args()
    if args.processes > 1:
        _across_processes(args)
        return
    torch.set_num_threads(args.threads)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    # whole epochs of the loader (64 batches), so that every block, settle included,
    # holds the same number of epoch boundaries (a new iterator and permutation each);
    # blocks of ~0.3 s: each spans one flush and one or two samples of the capture
    steps = 64 if args.quick else max(64, 384 * 256 // args.hidden // 64 * 64)
    res = measure(rounds=6 if args.quick else args.rounds, steps=steps, cpu_time=args.cpu_time,
                  hidden=args.hidden, settle=args.settle, parts=args.parts)
    if args.json:
        print(json.dumps(res))
        return
    print(f"plain loop:            {res['step_ms_plain']:.3f} ms/step "
          f"(hot path in {res['hot_path']})")
    lo, hi = res["overhead_ci95_pct"]
    print(f"trainprof always-on:   {res['overhead_pct']:+.2f}% mean step time "
          f"(95% CI {lo:+.2f}% .. {hi:+.2f}%)")
    lo, hi = res["median_step_overhead_ci95_pct"]
    print(f"                       {res['median_step_overhead_pct']:+.2f}% median step time "
          f"(95% CI {lo:+.2f}% .. {hi:+.2f}%; plain median step "
          f"{res['step_ms_plain_median']:.3f} ms)")
    if args.parts:
        for part, label in (("hooks", "clock + hooks alone"), ("nosampler", "all but sampler")):
            lo, hi = res[f"{part}_overhead_ci95_pct"]
            print(f"  {label + ':':20s} {res[f'{part}_overhead_pct']:+.2f}% "
                  f"(95% CI {lo:+.2f}% .. {hi:+.2f}%), median step "
                  f"{res[f'{part}_median_step_overhead_pct']:+.2f}%")
    lo, hi = res["noise_ci95_pct"]
    print(f"plain vs plain (noise): {res['noise_pct']:+.2f}% (95% CI {lo:+.2f}% .. {hi:+.2f}%)"
          f", median step {res['median_step_noise_pct']:+.2f}%")
    print(f"torch.profiler (CPU):  {res['torch_profiler_overhead_pct']:+.1f}% step time")
    print(f"one-off start-up cost: {res['startup_ms']:.1f} ms over the first "
          f"{res['settle_steps']} steps of a run")


def _across_processes(args: argparse.Namespace) -> None:
    """``--processes N``: the same measurement in N fresh processes (see the docstring)."""
    cmd = [sys.executable, __file__, "--json", "--threads", str(args.threads),
           "--rounds", str(args.rounds), "--hidden", str(args.hidden),
           "--settle", str(args.settle)]
    cmd += [flag for flag, on in (("--quick", args.quick), ("--cpu-time", args.cpu_time),
                                  ("--parts", args.parts)) if on]
    if args.cpu is not None:
        cmd += ["--cpu", str(args.cpu)]
    results = []
    for i in range(args.processes):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"error: process {i + 1} failed:\n{proc.stderr[-2000:]}")
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append(res)
        lo, hi = res["overhead_ci95_pct"]
        if not args.json:
            print(f"process {i + 1}: plain {res['step_ms_plain']:.3f} ms/step · trainprof "
                  f"{res['overhead_pct']:+.2f}% (95% CI {lo:+.2f}% .. {hi:+.2f}%), median "
                  f"step {res['median_step_overhead_pct']:+.2f}% · noise "
                  f"{res['noise_pct']:+.2f}%", flush=True)
    per = [r["overhead_pct"] for r in results]
    per_median = [r["median_step_overhead_pct"] for r in results]
    summary = {"processes": results, "overhead_pct_median": statistics.median(per),
               "overhead_pct_range": (min(per), max(per)),
               "median_step_overhead_pct_median": statistics.median(per_median),
               "median_step_overhead_pct_range": (min(per_median), max(per_median))}
    if args.json:
        print(json.dumps(summary))
        return
    print(f"trainprof always-on, {args.processes} processes: median "
          f"{summary['overhead_pct_median']:+.2f}% mean step time (processes {min(per):+.2f}% "
          f".. {max(per):+.2f}%), {summary['median_step_overhead_pct_median']:+.2f}% median "
          f"step time ({min(per_median):+.2f}% .. {max(per_median):+.2f}%)")


if __name__ == "__main__":
    main()
