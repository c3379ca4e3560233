"""A training step with ``zero_grad(set_to_none=False)`` against the default ``True``.

The figure the zero-grad finding quotes (trainprof.diagnosis.zero_grad): what a step
saves when ``zero_grad`` drops the gradients instead of writing zeros into them
(expert-rules.md H8, the PyTorch tuning guide). Writing zeros is a pass over every
gradient; with the gradients dropped, backward writes each one fresh instead of adding
into zeros, and ``zero_grad`` only unsets attributes. Two models on the CPU, in one
process, in rounds whose arm order is shuffled; each arm's time per step is a block's
mean, reported as the median per-round ratio to ``set_to_none=False``, with a 95%
bootstrap interval over rounds. Each arm also reports ``zero_grad``'s own share of its
step: the phase the finding reads, which the fix cannot save more than.

* ``mlp``: 1024-2048-2048-10 (6.3 M parameters, 25 MB of gradients), a batch of 32:
  gradients large against the step's compute;
* ``small``: 128-256-256-10, a batch of 64 (the overhead benchmark's loop).

    python benchmarks/zero_grad.py                 # ~1 minute
    python benchmarks/zero_grad.py --rounds 40 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import interleaved, ratio_line  # noqa: E402

ARMS = {"set_to_none=False": False, "set_to_none=True": True}


def model_and_batch(name: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    d_in, hidden, batch = (1024, 2048, 32) if name == "mlp" else (128, 256, 64)
    m = torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.ReLU(),
                            torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                            torch.nn.Linear(hidden, 10))
    return m, torch.randn(batch, d_in), torch.randint(0, 10, (batch,))


def block(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
          y: torch.Tensor, set_to_none: bool, steps: int, zero_s: list[float]) -> float:
    """Mean seconds per step over a block; the time in zero_grad appended to ``zero_s``."""
    zero = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        z0 = time.perf_counter()
        opt.zero_grad(set_to_none=set_to_none)
        zero += time.perf_counter() - z0
        loss.backward()
        opt.step()
    dt = time.perf_counter() - t0
    zero_s.append(zero / dt)
    return dt / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=20, help="steps per block")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), "
          f"{args.rounds} rounds of {args.steps} steps per arm")
    for name in ("mlp", "small"):
        model, x, y = model_and_batch(name)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        shares: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for flag in ARMS.values():
            block(model, opt, x, y, flag, 5, [])  # warm
        times = interleaved(list(ARMS), args.rounds,
                            lambda arm, m=model, o=opt, x=x, y=y, sh=shares:
                            block(m, o, x, y, ARMS[arm], args.steps, sh[arm]))
        base = statistics.median(times["set_to_none=False"])
        print(f"{name}: set_to_none=False {base * 1e3:.2f} ms per step, zero_grad "
              f"{statistics.median(shares['set_to_none=False']) * 100:.1f}% of it; "
              f"set_to_none=True: zero_grad "
              f"{statistics.median(shares['set_to_none=True']) * 100:.2f}%")
        print(ratio_line("set_to_none=True", times, "set_to_none=False", "set_to_none=False"))


if __name__ == "__main__":
    main()
