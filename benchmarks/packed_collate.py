"""Receiving workers' batches: torch's sharing strategies, and PackedCollate, side by side.

The figures the ``shared_memory_handoff`` finding and ``trainprof.fixes.PackedCollate``
quote. A DataLoader with 2 workers serves batches of 16 samples, each sample a dict of
8 fields (an image, a label, a box, an area, a mask, a depth map, an id, a weight: 8
tensors a batch); the loop only takes the batches, so the time per batch is what the
hand-over lets through. Four arms, in rounds whose order is shuffled: torch's
``default_collate`` or :class:`~trainprof.fixes.PackedCollate` (3 tensors a batch: one
per dtype), under the ``file_descriptor`` (Linux's default) or the ``file_system``
sharing strategy. Each block starts fresh workers (the strategy is read when they
start), skips their first batches and times the rest; reported as the median per-round
ratio to the default (plain collate, file_descriptor), with a 95% bootstrap interval
over rounds.

``--python-us N`` makes each sample cost N µs of pure Python in the worker (a dataset
that builds its samples in Python holds the worker's GIL, which the file_descriptor
strategy's round trip waits for).

    python benchmarks/packed_collate.py                  # ~1 minute
    python benchmarks/packed_collate.py --python-us 100 --rounds 10
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import interleaved, ratio_line  # noqa: E402

from trainprof.fixes import PackedCollate  # noqa: E402

ARMS = ["plain, file_descriptor", "packed, file_descriptor", "plain, file_system",
        "packed, file_system"]


class Fields(Dataset):
    """Detection-style samples: a dict of 8 fields, optionally after some Python work."""

    def __init__(self, python_us: float) -> None:
        self.python_s = python_us / 1e6

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int) -> dict[str, object]:
        if self.python_s:
            t = time.perf_counter()
            while time.perf_counter() - t < self.python_s:
                pass
        return {"image": torch.randn(3, 16, 16), "label": i % 5, "box": torch.rand(4),
                "area": torch.rand(()), "mask": torch.rand(16, 16) > 0.5,
                "depth": torch.rand(16, 16), "id": i, "weight": torch.rand(())}


def block_time(arm: str, dataset: Fields, batches: int, skip: int) -> float:
    """Seconds per batch the loop receives, fresh workers under the arm's strategy."""
    collate, strategy = arm.split(", ")
    torch.multiprocessing.set_sharing_strategy(strategy)
    loader = DataLoader(dataset, batch_size=16, num_workers=2,
                        collate_fn=PackedCollate() if collate == "packed" else None)
    it = iter(loader)
    for _ in range(skip):
        next(it)
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    dt = (time.perf_counter() - t0) / batches
    del it
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--batches", type=int, default=200, help="timed batches per block")
    ap.add_argument("--python-us", type=float, default=0.0,
                    help="µs of pure Python per sample in the workers")
    args = ap.parse_args()
    dataset = Fields(args.python_us)
    times = interleaved(ARMS, args.rounds,
                        lambda arm: block_time(arm, dataset, args.batches, skip=10))
    base = ARMS[0]
    print(f"2 workers, batches of 16 samples × 8 fields, {args.python_us:g} µs of Python "
          f"per sample; {args.rounds} rounds of {args.batches} batches per arm")
    for arm in ARMS:
        med = sorted(times[arm])[len(times[arm]) // 2]
        print(f"  {arm:<24} {med * 1e3:.3f} ms per batch (median block)")
    for arm in ARMS[1:]:
        print(ratio_line(arm, times, base, "the time per batch of " + base))


if __name__ == "__main__":
    main()
