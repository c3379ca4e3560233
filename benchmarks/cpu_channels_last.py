"""A convolutional training step on the CPU in channels_last (NHWC) against NCHW.

The bound the CPU channels_last finding uses (``trainprof.diagnosis.channels_last_cpu``):
how much of a conv net's training step NHWC saves on a CPU, and where it loses. Each case
is a small conv net (plain 3x3 convolutions with BatchNorm; depthwise-separable blocks;
a tiny two-convolution net like the examples'), one forward, backward and SGD step per
call; the two arms (the model and its batch in NCHW, or both converted to
``torch.channels_last`` once) run in rounds whose order is shuffled, and NHWC is reported
as the median per-round ratio to NCHW with a 95% bootstrap interval.

    python benchmarks/cpu_channels_last.py                 # ~2 minutes
    python benchmarks/cpu_channels_last.py --rounds 20 --threads 2
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import arm_arguments, compare_arms, training_steps  # noqa: E402


def plain(c: int) -> nn.Module:
    """3x3 convolutions with BatchNorm, a pooling between, as a VGG/ResNet stem."""
    return nn.Sequential(
        nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
        nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * c, 10))


def depthwise(c: int) -> nn.Module:
    """Depthwise-separable blocks (a 3x3 per channel, then a 1x1), as MobileNet's."""
    return nn.Sequential(
        nn.Conv2d(3, c, 3, padding=1), nn.ReLU(),
        nn.Conv2d(c, c, 3, padding=1, groups=c), nn.Conv2d(c, c, 1), nn.BatchNorm2d(c),
        nn.ReLU(), nn.Conv2d(c, c, 3, padding=1, groups=c), nn.Conv2d(c, c, 1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10))


def tiny(c: int) -> nn.Module:
    """Two convolutions, as the small CNNs of ``examples/``."""
    return nn.Sequential(
        nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c, c, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10))


#: (net, channels, image side, batch)
CASES: tuple[tuple[Callable[[int], nn.Module], int, int, int], ...] = (
    (tiny, 8, 32, 32), (tiny, 16, 32, 32), (plain, 4, 32, 32), (plain, 8, 32, 16),
    (plain, 32, 32, 32), (plain, 64, 16, 16), (plain, 128, 8, 32),
    (depthwise, 32, 32, 16), (depthwise, 128, 16, 16))


def arm(make: Callable[[int], nn.Module], c: int, side: int, batch: int,
        nhwc: bool) -> Callable[[int], float]:
    """A model, optimizer and batch in one format; returns ``steps -> seconds per step``."""
    torch.manual_seed(0)
    fmt = torch.channels_last if nhwc else torch.contiguous_format
    model = make(c).to(memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(batch, 3, side, side).contiguous(memory_format=fmt)
    return training_steps(model, opt, x, torch.randint(0, 10, (batch,)))


def main() -> None:
    args = arm_arguments(__doc__)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), oneDNN "
          f"{'on' if torch.backends.mkldnn.is_available() else 'off'}; {args.rounds} rounds of "
          f"{args.steps} steps per arm")
    for make, c, side, batch in CASES:
        # (warm: oneDNN builds its primitives on the first calls)
        compare_arms(f"{make.__name__} C={c} {side}x{side} B={batch}",
                     {"NCHW": arm(make, c, side, batch, False),
                      "NHWC": arm(make, c, side, batch, True)}, args)


if __name__ == "__main__":
    main()
