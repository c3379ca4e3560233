"""A training step in float64 against float32 on the CPU, by model size.

The bound the float64 finding uses on a CPU (``trainprof.diagnosis.float64.CPU_SPEEDUP``:
float32 at twice float64's peak rate). Each case is an MLP of three Linear layers (width W,
batch B) or a small conv net, one forward, backward and SGD step per call, with the model
and its batch in float64 (``model.double()``, NumPy's default dtype) or float32; the two
arms run in rounds whose order is shuffled, and float32 is reported as the median per-round
ratio to float64 with a 95% bootstrap interval.

    python benchmarks/cpu_float64.py                 # ~1 minute
    python benchmarks/cpu_float64.py --rounds 20 --threads 2
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import arm_arguments, compare_arms, training_steps  # noqa: E402


def mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width),
                         nn.ReLU(), nn.Linear(width, 10))


def convnet(channels: int, pool: bool = True) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1), nn.ReLU(),
        *([nn.MaxPool2d(2)] if pool else []),
        nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10))


#: (name, model, input shape)
CASES: tuple[tuple[str, Callable[[], nn.Module], tuple[int, ...]], ...] = (
    ("MLP W=64 B=32", lambda: mlp(64), (32, 64)),
    ("MLP W=256 B=64", lambda: mlp(256), (64, 256)),
    ("MLP W=1024 B=64", lambda: mlp(1024), (64, 1024)),
    ("MLP W=2048 B=128", lambda: mlp(2048), (128, 2048)),
    ("conv C=16 32x32 B=32", lambda: convnet(16), (32, 3, 32, 32)),
    ("conv C=64 32x32 B=16", lambda: convnet(64), (16, 3, 32, 32)),
    ("conv C=16 32x32 B=16, no pooling", lambda: convnet(16, pool=False), (16, 3, 32, 32)),
    ("conv C=16 32x32 B=32, no pooling", lambda: convnet(16, pool=False), (32, 3, 32, 32)),
)


def arm(make: Callable[[], nn.Module], shape: tuple[int, ...],
        dtype: torch.dtype) -> Callable[[int], float]:
    """A model, optimizer and batch in ``dtype``; returns ``steps -> seconds per step``."""
    torch.manual_seed(0)
    model = make().to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return training_steps(model, opt, torch.randn(shape, dtype=dtype),
                          torch.randint(0, 10, (shape[0],)))


def main() -> None:
    args = arm_arguments(__doc__)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); {args.rounds} "
          f"rounds of {args.steps} steps per arm")
    for name, make, shape in CASES:
        compare_arms(name, {"float64": arm(make, shape, torch.float64),
                            "float32": arm(make, shape, torch.float32)}, args)


if __name__ == "__main__":
    main()
