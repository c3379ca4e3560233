"""Instructions per training step added by trainprof's always-on capture (callgrind).

Wall-clock overhead figures on a shared 2-core machine move by a percent or two
from run to run (``benchmarks/overhead.py`` prints its noise floor); instruction
counts repeat to a fraction of a percent, so they show a change of a few
hundred instructions per step. This runs the loop of ``benchmarks/overhead.py``
under ``valgrind --tool=callgrind`` and counts the training thread's
instructions in blocks of steps, in rounds of arms:

* ``plain``: no capture;
* ``hooks``: the step clock and its hooks;
* ``capture``: the step clock, its hooks and the DataLoader sample/collate
  timing (:mod:`trainprof.capture.fetch_timing`, in the training process here:
  ``num_workers=0``): everything ``trainprof run`` adds to the training thread
  but the system sampler.

The system sampler (a process of its own) is started but never samples in either
arm, and only the training thread is counted: the sampler and the Recorder's flush
thread run on wall time (5 Hz), and under callgrind's ~50x slowdown they would run
50 times as often per step as they really do; their share is measured by
``benchmarks/overhead.py`` (``--parts``). The stack timer (``TRAINPROF_STACK_HZ``) is
switched off for the same reason: it ticks on wall time, in the training thread, and
``benchmarks/stack_sampling.py`` measures one sample's cost.

Each arm first runs ``--settle`` steps uncounted (the one-off start-up: CPython
re-specialising code on the patched classes), then ``--steps`` counted steps;
both are whole epochs of the loop's DataLoader, so that every counted block
starts at the same point of an epoch.
Only instructions of the training thread are counted: system calls (the
kernel's side of reading clocks and /proc) and other threads are not, so this
complements the wall-clock figure, it does not replace it.

    python benchmarks/overhead_instructions.py                 # ~2 minutes per path
    python benchmarks/overhead_instructions.py --paths c,python
    python benchmarks/overhead_instructions.py --cache-sim     # and L1 cache misses (~3x slower)

How blocks are delimited: each counted block runs inside ``functools.reduce``
(a C function the loop itself does not call), and callgrind collects and dumps
only inside it (``--toggle-collect``, ``--dump-after``); the number of dumps is
checked against the number of blocks.
"""

from __future__ import annotations

import argparse
import functools
import gc
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ARMS = ("plain", "hooks", "capture")


def child(rounds: int, steps: int, settle: int, hidden: int, path: str) -> None:
    """Runs under valgrind: rounds of blocks in a fixed order (counts need no shuffling)."""
    sys.path.insert(0, str(HERE))
    import torch
    from overhead import FAST, make_loop, start_recorder  # type: ignore[import-not-found]

    if (path == "c") != FAST:
        sys.exit(f"error: asked for the {path} hot path, but the C extension is "
                 f"{'in use' if FAST else 'not built (or stale): run `pip install -e .`'}")

    from trainprof.capture import fetch_timing, recorder

    # The flush thread re-arms the timing of num_workers=0 batches five times a second
    # of wall time: 1 batch in ~200 at 1 ms a step, but 1 in ~4 under callgrind's
    # slowdown. Here it never wakes; the timing is re-armed once before each counted
    # block instead: 1 timed batch in `steps` (64), more than the real rate.
    recorder.MAIN_REARM_HZ = 1e-6
    # Samples cheaper than PER_SAMPLE_MIN_NS are timed a batch at a time; the decision
    # reads the wall clock, which valgrind slows 50-150x: without this, this loop's ~2 us
    # samples would look slow enough (with --cache-sim) to be timed one by one
    fetch_timing.PER_SAMPLE_MIN_NS *= 500
    torch.set_num_threads(1)
    # glibc's malloc skips its locks until a process first creates a thread, and never
    # goes back: without this, the first plain block would run the single-threaded
    # allocator and every later block (the capture's flush thread) the locking one,
    # ~10k instructions a step of torch's allocations in this loop, charged to the capture
    threading.Thread(target=lambda: None).start()
    run_steps, _ = make_loop(hidden=hidden)
    run_steps(64)
    tmp = Path(tempfile.mkdtemp(prefix="trainprof-instr-"))
    for r in range(rounds):
        for arm in ARMS:
            rec = None if arm == "plain" else start_recorder(
                tmp / f"{arm}{r}", workers=arm == "capture", sampler=False)
            try:
                run_steps(settle)
                if rec is not None:
                    rec.worker_capture.rearm()
                # the same collector state for every block: a full collection that
                # happened to fall into one block would cost more than the capture
                gc.collect()
                functools.reduce(lambda _a, _b: run_steps(steps), [0, 0])
            finally:
                if rec is not None:
                    rec.stop("finished", 0)


#: glibc's allocator: its cost per call depends on the heap's layout, which the
#: arms before a block leave different (torch's tensors are malloc'ed), so it is
#: also reported apart. The capture itself allocates through Python's obmalloc.
_ALLOC = re.compile(r"^(_int_(malloc|free|memalign|realloc)|malloc|free|realloc|calloc|"
                    r"__libc_\w+|_mid_memalign|posix_memalign|unlink_chunk|"
                    r"malloc_consolidate|sysmalloc|tcache\w*)(\.\w+)*$")


def _block_counts(path: str) -> tuple[int, int] | None:
    """(all instructions, those in glibc's allocator) of one dump; None if not a block."""
    text = Path(path).read_text(errors="replace")
    trigger = re.search(r"^desc: Trigger: (.*)$", text, re.M)
    if not trigger or "functools_reduce" not in trigger.group(1):
        return None
    names: dict[str, str] = {}
    fn = ""
    total = alloc = 0
    after_call = False
    for line in text.splitlines():
        if line.startswith(("fn=", "cfn=")):
            m = re.match(r"c?fn=\((\d+)\)(?: (.*))?", line)
            if m:
                if m.group(2):
                    names[m.group(1)] = m.group(2)
                if line[0] == "f":
                    fn = names.get(m.group(1), "")
        elif line.startswith("calls="):
            after_call = True
        elif line[:1].isdigit() or line[:1] in "+-*":
            if after_call:  # the inclusive cost of a call, counted in the callee
                after_call = False
                continue
            parts = line.split()
            if len(parts) > 1:
                total += int(parts[1])
                if _ALLOC.match(fn):
                    alloc += int(parts[1])
    return total, alloc


def _block_misses(path: str) -> tuple[int, int] | None:
    """(first-level instruction-cache misses, data-cache misses) of one block dump.

    From the dump's ``events:`` and ``summary:`` lines (``--cache-sim=yes``); None if
    the dump is not a block.
    """
    text = Path(path).read_text(errors="replace")
    trigger = re.search(r"^desc: Trigger: (.*)$", text, re.M)
    events = re.search(r"^events: (.*)$", text, re.M)
    summary = re.search(r"^summary: (.*)$", text, re.M)
    if not (trigger and events and summary) or "functools_reduce" not in trigger.group(1):
        return None
    ev = dict(zip(events.group(1).split(), map(int, summary.group(1).split()), strict=False))
    return ev.get("I1mr", 0), ev.get("D1mr", 0) + ev.get("D1mw", 0)


def run_path(path: str, rounds: int, steps: int, settle: int, hidden: int,
             keep: str | None = None, cache_sim: bool = False) -> dict[str, Any]:
    out = Path(keep) / path if keep else Path(tempfile.mkdtemp(prefix="trainprof-callgrind-"))
    out.mkdir(parents=True, exist_ok=True)
    # the stack timer ticks on wall time too (4-20 a second), in the training thread:
    # under callgrind's slowdown it would tick ~50 times as often per step (one sample,
    # ~50k instructions, nearly every step); benchmarks/stack_sampling.py measures it
    env = {**os.environ, "TRAINPROF_PURE_PYTHON": "1" if path == "python" else "0",
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0",
           "TRAINPROF_STACK_HZ": "0"}
    cmd = ["valgrind", "--tool=callgrind", "--separate-threads=yes", "--collect-atstart=no",
           "--toggle-collect=functools_reduce", "--dump-after=functools_reduce",
           *(["--cache-sim=yes"] if cache_sim else []),
           f"--callgrind-out-file={out}/cg.out", sys.executable, __file__, "--child", path,
           "--rounds", str(rounds), "--steps", str(steps), "--settle", str(settle),
           "--hidden", str(hidden)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: callgrind run failed:\n{proc.stderr[-3000:]}")
    # one file per dump and thread: cg.out.<dump>-<thread>; the training thread is 01
    dumps = sorted(glob.glob(f"{out}/cg.out.*-01"),
                   key=lambda p: int(re.search(r"\.(\d+)-01$", p).group(1)))
    counts = [c for c in map(_block_counts, dumps) if c is not None]
    if len(counts) != rounds * len(ARMS):
        sys.exit(f"error: expected {rounds * len(ARMS)} counted blocks, found {len(counts)} "
                 f"(in {out})")
    misses = [m for m in map(_block_misses, dumps) if m is not None] if cache_sim else []
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
    res: dict[str, Any] = {}
    for key, per_block in (("", [c[0] for c in counts]),
                           ("_no_alloc", [c[0] - c[1] for c in counts]),
                           ("_i1_misses", [m[0] for m in misses]),
                           ("_d1_misses", [m[1] for m in misses])):
        if per_block:
            res.update(_added_per_step(per_block, steps, key))
    return res


def _added_per_step(per_block: list[int], steps: int, key: str) -> dict[str, Any]:
    """What each arm adds per step to ``plain``: the median over rounds of the difference.

    ``per_block`` holds one count per block, arms in :data:`ARMS` order round after round.
    """
    per_arm: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for i, count in enumerate(per_block):
        per_arm[ARMS[i % len(ARMS)]].append(count / steps)
    plain = statistics.median(per_arm["plain"])
    res: dict[str, Any] = {f"plain{key}_per_step": plain}
    for arm in ARMS[1:]:
        deltas = [a - b for a, b in zip(per_arm[arm], per_arm["plain"], strict=True)]
        res[f"{arm}{key}_added_per_step"] = statistics.median(deltas)
        res[f"{arm}{key}_added_range"] = (min(deltas), max(deltas))
        res[f"{arm}{key}_added_pct"] = statistics.median(deltas) / plain * 100
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--paths", default="c", help="hot paths to count: c, python or c,python")
    parser.add_argument("--rounds", type=int, default=3)
    # whole epochs (64 batches): every block holds the same epoch boundaries (a new
    # iterator, a permutation of 4096 indices: ~1.8M instructions, more than the capture)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--settle", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=16,
                        help="MLP width (the capture's cost does not depend on it; 16 keeps "
                        "MKL's share, and its run-to-run variation, small)")
    parser.add_argument("--cache-sim", action="store_true",
                        help="also count first-level cache misses (valgrind's cache "
                        "simulation; about three times slower)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--keep", metavar="DIR",
                        help="keep callgrind's files here (callgrind_annotate reads them)")
    args = parser.parse_args()
    if args.child:
        child(args.rounds, args.steps, args.settle, args.hidden, args.child)
        return
    if shutil.which("valgrind") is None:
        sys.exit("error: valgrind is not installed (apt-get install valgrind)")
    results = {}
    for path in args.paths.split(","):
        results[path] = run_path(path, args.rounds, args.steps, args.settle, args.hidden,
                                 args.keep, args.cache_sim)
    if args.json:
        print(json.dumps(results))
        return
    for path, res in results.items():
        print(f"hot path {path}: plain loop {res['plain_per_step'] / 1e6:.2f} M instructions/step")
        for key, label in (("", "all"), ("_no_alloc", "less glibc malloc/free")):
            for arm in ARMS[1:]:
                lo, hi = res[f"{arm}{key}_added_range"]
                print(f"  {arm:10s} {res[f'{arm}{key}_added_per_step']:+9,.0f} instructions/step "
                      f"({res[f'{arm}{key}_added_pct']:+.3f}%; rounds {lo:+,.0f} .. {hi:+,.0f})"
                      f"  [{label}]")
        for key, label in (("_i1_misses", "L1 instruction-cache misses"),
                           ("_d1_misses", "L1 data-cache misses")):
            if f"plain{key}_per_step" not in res:
                continue
            print(f"  {label}: plain loop {res[f'plain{key}_per_step']:,.0f}/step")
            for arm in ARMS[1:]:
                print(f"  {arm:10s} {res[f'{arm}{key}_added_per_step']:+9,.0f} /step "
                      f"({res[f'{arm}{key}_added_pct']:+.2f}%)")


if __name__ == "__main__":
    main()
