"""A CIFAR-like image folder, decoded and augmented one sample at a time on the CPU.

One PNG per sample (generated on first use under examples/data/png_folder),
decoded with Pillow, resized, randomly cropped and flipped, colour-jittered and
normalised in float32 numpy, per sample, in DataLoader workers. The model is
small, so the CPU work of the transforms is what the training loop waits for.
`trainprof run examples/png_folder.py` names the cause (CPU transforms, not
slow reads) from the time measured inside the workers.

The finding's fix, in two parts: decoding and resizing give the same result
every epoch, so `--cache DIR` does them once (trainprof.fixes.CachedDataset) and
keeps only the random part per sample; `--uint8` keeps that part in uint8 (crop,
flip) and does the float work (colour jitter, Normalize) once per batch, where
the model runs (trainprof.fixes.DevicePrefetcher).

    python examples/png_folder.py --steps 40        # needs Pillow: pip install pillow
    python examples/png_folder.py --cache examples/data/png_cache --uint8
"""

import argparse
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

try:
    from PIL import Image
except ImportError:  # pragma: no cover - the example says how to fix it
    raise SystemExit("this example needs Pillow: pip install pillow") from None

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--num-workers", type=int, default=1)
parser.add_argument("--size", type=int, default=160, help="training resolution")
parser.add_argument("--data", default=str(Path(__file__).parent / "data" / "png_folder"))
parser.add_argument("--cache", metavar="DIR", help="decode and resize once, into DIR")
parser.add_argument("--uint8", action="store_true",
                    help="augment in uint8 per sample, jitter and normalise per batch")
args = parser.parse_args()

MEAN = np.array([0.49, 0.48, 0.45], dtype=np.float32)
STD = np.array([0.25, 0.24, 0.26], dtype=np.float32)


def make_folder(root: Path, n: int = 1024) -> None:
    """n random 32x32 RGB PNGs in class sub-folders, like CIFAR-10 exported to disk (once)."""
    if (root / "done").exists():
        return
    rng = np.random.default_rng(0)
    for i in range(n):
        folder = root / f"class{i % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    (root / "done").touch()


class PngFolder(Dataset):
    """Decode and resize: the deterministic part, the same every epoch."""

    def __init__(self, root: Path, size: int, transform=None) -> None:
        self.files = sorted(root.glob("class*/*.png"))
        self.size = size
        self.transform = transform

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        path = self.files[i]
        img = Image.open(path).convert("RGB").resize((self.size + 8, self.size + 8), Image.BICUBIC)
        image = np.asarray(img)
        label = int(path.parent.name[len("class"):])
        return (self.transform(image) if self.transform else image), label


def augment(image: np.ndarray) -> torch.Tensor:
    """The random part: crop, flip, brightness/contrast, saturation, then Normalize."""
    size = image.shape[0] - 8
    x = image.astype(np.float32) / 255.0
    top, left = np.random.randint(0, 9, 2)
    x = x[top : top + size, left : left + size]  # random crop
    if np.random.random() < 0.5:
        x = x[:, ::-1]  # horizontal flip
    x = x * np.random.uniform(0.8, 1.2) + np.random.uniform(-0.1, 0.1)  # brightness/contrast
    gray = x.mean(axis=2, keepdims=True)
    x = gray + (x - gray) * np.random.uniform(0.8, 1.2)  # saturation
    x = (np.clip(x, 0.0, 1.0) - MEAN) / STD  # Normalize
    return torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)))


def crop_flip(image: np.ndarray) -> torch.Tensor:
    """The same crop and flip as augment(), kept in uint8 (--uint8)."""
    size = image.shape[0] - 8
    top, left = np.random.randint(0, 9, 2)
    x = image[top : top + size, left : left + size]
    if np.random.random() < 0.5:
        x = x[:, ::-1]
    return torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)))


def color_jitter(x: torch.Tensor) -> torch.Tensor:
    """augment()'s brightness/contrast and saturation for a float batch, factors per sample."""

    def factor(low: float, high: float) -> torch.Tensor:
        return torch.empty(x.shape[0], 1, 1, 1, device=x.device).uniform_(low, high)

    x = x * factor(0.8, 1.2) + factor(-0.1, 0.1)
    gray = x.mean(dim=1, keepdim=True)
    x = gray + (x - gray) * factor(0.8, 1.2)
    return x.clamp_(0.0, 1.0)


def main() -> None:
    torch.manual_seed(0)
    # leave the workers their cores, as a tuned setup does: the transforms are what is left
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) - args.num_workers))
    root = Path(args.data)
    make_folder(root)
    per_sample = crop_flip if args.uint8 else augment
    if args.cache:
        from trainprof.fixes import CachedDataset

        dataset = CachedDataset(PngFolder(root, args.size), args.cache, transform=per_sample,
                                key=f"size={args.size}")
    else:
        dataset = PngFolder(root, args.size, transform=per_sample)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True,
                        num_workers=args.num_workers, drop_last=True)
    batches = loader
    if args.uint8:
        from trainprof.fixes import DevicePrefetcher

        batches = DevicePrefetcher(loader, "cpu", mean=MEAN.tolist(), std=STD.tolist(),
                                   batch_transform=color_jitter)
    model = nn.Sequential(  # small on purpose: pool the input down first
        nn.AvgPool2d(4), nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(8 * 16, 10),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    step = 0
    while step < args.steps:
        for x, y in batches:
            loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step >= args.steps:
                break


if __name__ == "__main__":
    main()
