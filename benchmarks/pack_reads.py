"""One PNG file per sample vs a pack (``trainprof pack``), read through a DataLoader.

The setting of data-loading.md §2: small PNGs (32x32x3, CIFAR-sized), batch 256,
shuffled (``RandomSampler``), default collate, from a warm page cache unless
``--cold``. Arms, each read as a (3, 32, 32) uint8 tensor plus label:

* ``files``        — ``Image.open(path)`` per sample, as ImageFolder does;
* ``pack``         — ``PackedDataset`` of the PNG bytes (``trainprof pack``), decoded per sample;
* ``pack_decoded`` — ``PackedDataset`` of the decoded arrays (``trainprof pack --decode``).

Each arm runs with ``num_workers`` 0 and 2, in rounds of a shuffled order, in one
process; the report gives the median samples/s of each and its ratio to ``files``
with the same workers. ``--cold`` drops the page cache before every epoch (root only).

    python benchmarks/pack_reads.py                 # ~1 minute
    python benchmarks/pack_reads.py --samples 50000 --rounds 5 --cold
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from trainprof.fixes import PackedDataset, pack_folder


def make_pngs(root: Path, n: int) -> None:
    rng = np.random.default_rng(0)
    for i in range(n):
        folder = root / f"class{i % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(folder / f"{i}.png")


def to_tensor(image: object) -> torch.Tensor:
    return torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1)


class PngFiles(Dataset):
    """ImageFolder's reads, without torchvision: one file opened and decoded per sample."""

    def __init__(self, root: Path) -> None:
        classes = sorted(d.name for d in root.iterdir() if d.is_dir())
        self.samples = [(f, c) for c, name in enumerate(classes)
                        for f in sorted((root / name).iterdir())]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[i]
        with Image.open(path) as img:
            return to_tensor(img.convert("RGB")), label


def epoch_rate(dataset: Dataset, workers: int, cold: bool) -> float:
    if cold:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    loader = DataLoader(dataset, batch_size=256, shuffle=True, num_workers=workers,
                        generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    n = sum(len(y) for _, y in loader)
    return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="drop the page cache per epoch")
    args = parser.parse_args()
    if args.cold:
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        except OSError as exc:
            raise SystemExit(f"--cold needs root (dropping the page cache): {exc}") from None
    tmp = Path(tempfile.mkdtemp(prefix="trainprof-pack-bench-"))
    t0 = time.perf_counter()
    make_pngs(tmp / "png", args.samples)
    print(f"{args.samples:,} PNGs written in {time.perf_counter() - t0:.1f} s", flush=True)
    for out, decode in ((tmp / "pack", False), (tmp / "pack_decoded", True)):
        manifest = pack_folder(tmp / "png", out, decode=decode)
        size = sum(p.stat().st_size for p in out.iterdir())
        print(f"{out.name}: {manifest['write_s']:.2f} s to write, {size / 1e6:.1f} MB", flush=True)
    arms = {
        "files": PngFiles(tmp / "png"),
        "pack": PackedDataset(tmp / "pack", transform=to_tensor),
        "pack_decoded": PackedDataset(tmp / "pack_decoded",
                                      transform=lambda a: torch.from_numpy(a).permute(2, 0, 1)),
    }
    rates: dict[tuple[str, int], list[float]] = {(a, w): [] for a in arms for w in (0, 2)}
    rng = random.Random(0)
    for r in range(args.rounds):
        order = list(rates)
        rng.shuffle(order)
        for arm, workers in order:
            rates[(arm, workers)].append(epoch_rate(arms[arm], workers, args.cold))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    cache = "cold" if args.cold else "warm"
    print(f"\nsamples/s, median of {args.rounds} epochs of {args.samples:,} ({cache} page cache)")
    print(f"{'arm':<14}{'workers':>8}{'samples/s':>12}{'vs files':>10}")
    for workers in (0, 2):
        base = statistics.median(rates[("files", workers)])
        for arm in arms:
            rate = statistics.median(rates[(arm, workers)])
            print(f"{arm:<14}{workers:>8}{rate:>12,.0f}{rate / base:>9.2f}×")


if __name__ == "__main__":
    main()
