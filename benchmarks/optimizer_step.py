"""optimizer.step() by implementation: for-loop, foreach and fused, side by side.

The figures the optimizer finding and the README quote (trainprof.diagnosis.optimizer):
AdamW on two shapes of model, in one process, in rounds whose arm order is shuffled;
each arm's time per ``step()`` is a block's mean, and each arm is reported as the
median per-round ratio to the for-loop (torch's default on CPU) with a 95% bootstrap
interval over rounds.

* ``many-small``: 24 blocks of Linear(64, 64) + LayerNorm(64): 96 small tensors, where
  the for-loop's per-tensor dispatch dominates;
* ``few-large``: MLP 128-768-768-768-10: 8 tensors, 1.3 M parameters, memory-bound.

    python benchmarks/optimizer_step.py                 # ~1 minute
    python benchmarks/optimizer_step.py --rounds 40 --threads 2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import interleaved, ratio_line  # noqa: E402

ARMS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def model(shape: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if shape == "many-small":
        layers: list[torch.nn.Module] = []
        for _ in range(24):
            layers += [torch.nn.Linear(64, 64), torch.nn.LayerNorm(64)]
        return torch.nn.Sequential(*layers)
    return torch.nn.Sequential(torch.nn.Linear(128, 768), torch.nn.Linear(768, 768),
                               torch.nn.Linear(768, 768), torch.nn.Linear(768, 10))


def block_time(opt: torch.optim.Optimizer, steps: int) -> float:
    """Mean seconds per ``step()`` over a block (the gradients stay as they are)."""
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return (time.perf_counter() - t0) / steps


def measure(shape: str, rounds: int, steps: int) -> dict[str, list[float]]:
    opts = {}
    for arm, kwargs in ARMS.items():
        m = model(shape)
        for p in m.parameters():
            p.grad = torch.randn_like(p)
        opts[arm] = torch.optim.AdamW(m.parameters(), lr=1e-3, **kwargs)
        block_time(opts[arm], 20)  # state built, kernels warm
    return interleaved(list(ARMS), rounds, lambda arm: block_time(opts[arm], steps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=50, help="steps per block")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), AdamW, "
          f"{args.rounds} rounds of {args.steps} steps per arm")
    for shape in ("many-small", "few-large"):
        times = measure(shape, args.rounds, args.steps)
        n = sum(1 for _ in model(shape).parameters())
        base = sorted(times["for-loop"])[len(times["for-loop"]) // 2]
        print(f"{shape} ({n} tensors): for-loop {base * 1e3:.2f} ms per step()")
        for arm in ("foreach", "fused"):
            print(ratio_line(arm, times, "for-loop", "the for-loop"))


if __name__ == "__main__":
    main()
