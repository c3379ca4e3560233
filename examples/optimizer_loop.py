"""A deep, narrow residual MLP trained with AdamW as torch builds it by default.

Many small parameter tensors (16 residual blocks of a LayerNorm and two Linear
layers: 100 tensors with the input and output layers) and a modest batch make each
step's forward and backward cheap, while AdamW's default implementation on CPU
updates the parameters one tensor at a time, a dozen small ops for each. trainprof
should find the optimizer step taking a large share of the step and propose
``fused=True``; ``--fused`` applies that fix.

    python examples/optimizer_loop.py --steps 300
    python examples/optimizer_loop.py --steps 300 --fused
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--width", type=int, default=64)
parser.add_argument("--blocks", type=int, default=16)
parser.add_argument("--fused", action="store_true", help="AdamW(fused=True): the fix")
parser.add_argument("--log-interval", type=int, default=100)
args = parser.parse_args()

torch.manual_seed(0)
n_features, n_classes, n_samples = 32, 10, 8192

# The dataset: a Gaussian mixture, one centre per class, generated in memory.
centres = torch.randn(n_classes, n_features) * 2
labels = torch.randint(0, n_classes, (n_samples,))
features = centres[labels] + torch.randn(n_samples, n_features)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


model = nn.Sequential(
    nn.Linear(n_features, args.width),
    *[Block(args.width) for _ in range(args.blocks)],
    nn.Linear(args.width, n_classes),
)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True if args.fused else None)

for step in range(args.steps):
    start = (step * args.batch_size) % (n_samples - args.batch_size)
    x, y = features[start : start + args.batch_size], labels[start : start + args.batch_size]
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if step % args.log_interval == 0:
        print(f"step {step}: loss {loss.item():.4f}")
