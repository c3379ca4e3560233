"""An evaluation forward with autograd on, against torch.no_grad() and torch.inference_mode().

The figure the eval-autograd finding quotes (trainprof.diagnosis.eval_autograd): the
time an eval-mode forward saves when autograd does not record its graph. Two models on
the CPU, in one process, in rounds whose arm order is shuffled; each arm's time per
forward is a block's mean, reported as the median per-round ratio to autograd on, with
a 95% bootstrap interval over rounds. Each block keeps its outputs, as an evaluation
that collects predictions does, and frees them after the block.

* ``mlp``: 256-1024-1024-10, a batch of 256;
* ``convnet``: two 3x3 convolutions (3-32-64 channels), BatchNorm, ReLU, pooling and a
  linear head, 32x32 images, a batch of 64.

    python benchmarks/eval_no_grad.py                 # ~1 minute
    python benchmarks/eval_no_grad.py --rounds 40 --threads 2
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import interleaved, ratio_line  # noqa: E402

ARMS = {"autograd on": contextlib.nullcontext, "no_grad": torch.no_grad,
        "inference_mode": torch.inference_mode}


def model_and_batch(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if name == "mlp":
        m: torch.nn.Module = torch.nn.Sequential(
            torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
            torch.nn.ReLU(), torch.nn.Linear(1024, 10))
        return m.eval(), torch.randn(256, 256)
    m = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.BatchNorm2d(64), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10))
    return m.eval(), torch.randn(64, 3, 32, 32)


def block_time(model: torch.nn.Module, x: torch.Tensor, arm: str, calls: int) -> float:
    """Mean seconds per forward over a block, its outputs kept until the block ends."""
    kept = []
    t0 = time.perf_counter()
    with ARMS[arm]():
        for _ in range(calls):
            kept.append(model(x))
    dt = (time.perf_counter() - t0) / calls
    del kept
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=20, help="forwards per block")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), "
          f"{args.rounds} rounds of {args.calls} eval forwards per arm")
    for name in ("mlp", "convnet"):
        model, x = model_and_batch(name)
        for arm in ARMS:
            block_time(model, x, arm, 5)  # warm
        times = interleaved(list(ARMS), args.rounds,
                            lambda arm, m=model, x=x: block_time(m, x, arm, args.calls))
        base = sorted(times["autograd on"])[len(times["autograd on"]) // 2]
        print(f"{name}: autograd on {base * 1e3:.2f} ms per forward")
        for arm in ("no_grad", "inference_mode"):
            print(ratio_line(arm, times, "autograd on", "autograd on"))


if __name__ == "__main__":
    main()
