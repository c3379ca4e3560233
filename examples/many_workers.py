"""CPU training where DataLoader workers and PyTorch's own threads fight over the cores.

A small CNN trains on the CPU with PyTorch's default intra-op thread count (one
thread per usable core), fed by a DataLoader with more worker processes than there
are cores, each doing per-sample augmentation in numpy. The input keeps up, but
every worker that runs takes a core from the model's thread pool, whose threads
then wait for each other at every parallel region.
`trainprof run examples/many_workers.py` reports CPU contention.

The images (random uint8 arrays) are generated in memory: no files.

    python examples/many_workers.py --steps 40
"""

import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--num-workers", type=int, default=4)
parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
parser.add_argument("--augment-rounds", type=int, default=3, help="per-sample CPU work")
args = parser.parse_args()

if args.threads:
    torch.set_num_threads(args.threads)


class AugmentedImages(Dataset):
    """Random 3x72x72 images; random crop to 64x64, flip, brightness jitter, normalise."""

    def __init__(self, n: int = 4096) -> None:
        rng = np.random.default_rng(0)
        self.images = rng.integers(0, 256, (256, 72, 72, 3), dtype=np.uint8)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        rng = np.random.default_rng(i)
        img = self.images[i % len(self.images)].astype(np.float32) / 255
        for _ in range(args.augment_rounds):  # a chain of cheap augmentations, per sample
            y0, x0 = rng.integers(0, 9, 2)
            img = np.pad(img[y0 : y0 + 64, x0 : x0 + 64], ((4, 4), (4, 4), (0, 0)), "reflect")
            if rng.random() < 0.5:
                img = img[:, ::-1]
            noise = rng.normal(0, 0.02, img.shape).astype(np.float32)
            img = np.clip(img * np.float32(rng.uniform(0.8, 1.2)) + noise, 0, 1)
        img = (img[4:68, 4:68] - 0.5) / 0.25
        return torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1))), i % 10


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 32, 3, padding=1)
        self.c2 = nn.Conv2d(32, 64, 3, padding=1)
        self.c3 = nn.Conv2d(64, 64, 3, padding=1)
        self.fc = nn.Linear(64 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        x = F.max_pool2d(F.relu(self.c3(x)), 2)
        return self.fc(x.flatten(1))


if __name__ == "__main__":
    torch.manual_seed(0)
    loader = DataLoader(
        AugmentedImages(),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.num_workers,
        persistent_workers=args.num_workers > 0,
    )
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step = 0
    while step < args.steps:
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step % 20 == 0:
                print(f"step {step}: loss {loss.item():.3f}")
            if step == args.steps:
                break
