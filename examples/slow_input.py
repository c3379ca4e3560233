"""A small image classifier whose input pipeline is the bottleneck.

Each sample is one .npy file on disk (class sub-folders, like ImageFolder), read
as if from remote storage (1.5 ms of latency per file opened, --latency-ms), then
normalised in Python, one sample at a time, in the training process
(num_workers=0). The model itself is cheap. This is what
`trainprof run examples/slow_input.py` is meant to catch.

    python examples/slow_input.py --steps 60
    python examples/slow_input.py --num-workers 4          # the first fix
    trainprof pack examples/data/slow_input examples/data/slow_input.pack
    python examples/slow_input.py --packed examples/data/slow_input.pack   # the reads removed

A pack holds the samples in one large file, opened once per process: the
simulated per-file latency is gone with the per-file opens.
"""

import argparse
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--num-workers", type=int, default=0)
parser.add_argument("--latency-ms", type=float, default=1.5, help="simulated storage latency")
parser.add_argument("--data", default=str(Path(__file__).parent / "data" / "slow_input"))
parser.add_argument("--packed", metavar="PACK", help="read the samples from this pack")
args = parser.parse_args()


def make_dataset(root: Path, n: int = 2048) -> None:
    """Write n random 3x32x32 uint8 images, one file each, in 10 class folders (only once)."""
    if (root / "done").exists():
        return
    rng = np.random.default_rng(0)
    for i in range(n):
        folder = root / f"class{i % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        np.save(folder / f"{i}.npy", rng.integers(0, 256, (3, 32, 32), dtype=np.uint8))
    (root / "done").touch()


def normalise(image: np.ndarray) -> torch.Tensor:
    image = torch.from_numpy(image).float() / 255
    return (image - 0.5) / 0.25  # per-sample normalisation on the CPU


class RemoteImages(Dataset):
    def __init__(self, root: Path, latency_s: float):
        self.files = sorted(root.glob("class*/*.npy"))
        self.latency_s = latency_s

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        time.sleep(self.latency_s)  # the round trip to remote storage
        path = self.files[i]
        return normalise(np.load(path)), int(path.parent.name[len("class"):])


root = Path(args.data)
make_dataset(root)
torch.manual_seed(0)
if args.packed:
    from trainprof.fixes import PackedDataset

    dataset = PackedDataset(args.packed, transform=normalise)
else:
    dataset = RemoteImages(root, args.latency_ms / 1000)
loader = DataLoader(
    dataset,
    batch_size=args.batch_size,
    shuffle=True,
    num_workers=args.num_workers,
)
model = nn.Sequential(
    nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(4),
    nn.Flatten(), nn.Linear(16 * 8 * 8, 10),
)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
loss_fn = nn.CrossEntropyLoss()

step = 0
while step < args.steps:
    for x, y in loader:
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step % 20 == 0:
            print(f"step {step}: loss {loss.item():.3f}")
        if step == args.steps:
            break
