"""A nanoGPT-style loop that makes its batches itself, from a token file on slow storage.

Like nanoGPT's `get_batch`, each step reads random windows of a memory-mapped token
file in the loop, with no DataLoader; here every read also waits for simulated
storage latency. The wait is neither data wait (no DataLoader) nor the model: it is
"other", and trainprof's sampled stacks name the line:

    trainprof run examples/batches_in_loop.py              # finding: host_launch/loop_code
    trainprof run examples/batches_in_loop.py --workers 2  # the fix: batches made in workers
"""

import argparse
import os
import time

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader, IterableDataset

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tokens.bin")
VOCAB, BLOCK, BATCH = 256, 64, 16


def make_tokens(path: str, n: int = 1_000_000) -> None:
    """A token file like nanoGPT's train.bin (uint16), generated once."""
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        rng = np.random.default_rng(0)
        rng.integers(0, VOCAB, size=n, dtype=np.uint16).tofile(path + ".tmp")
        os.replace(path + ".tmp", path)


def get_batch(latency_s: float) -> tuple[torch.Tensor, torch.Tensor]:
    data = np.memmap(DATA, dtype=np.uint16, mode="r")  # nanoGPT re-opens it every batch
    ix = torch.randint(len(data) - BLOCK - 1, (BATCH,))
    time.sleep(latency_s)  # the storage's latency (a network filesystem, a cold disk)
    x = torch.stack([torch.from_numpy(data[i : i + BLOCK].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + BLOCK].astype(np.int64)) for i in ix])
    return x, y


class Batches(IterableDataset):
    """The fix trainprof suggests: the same get_batch, run in DataLoader workers."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s

    def __iter__(self):
        while True:
            yield get_batch(self.latency_s)


class Bigram(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 64)
        self.head = nn.Linear(64, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.emb(idx)))


def train(steps: int, workers: int, latency_s: float) -> None:
    torch.manual_seed(0)
    model = Bigram()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = None
    if workers:
        batches = iter(DataLoader(Batches(latency_s), batch_size=None, num_workers=workers,
                                  persistent_workers=True, prefetch_factor=4))
    for it in range(steps):
        if batches is None:
            x, y = get_batch(latency_s)
        else:
            x, y = next(batches)
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, VOCAB), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if it % 100 == 0:
            print(f"step {it}: loss {loss.item():.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--workers", type=int, default=0,
                        help="make the batches in this many DataLoader workers (0: in the loop)")
    parser.add_argument("--latency-ms", type=float, default=4.0)
    parser.add_argument("--data", default=DATA, help="the token file (made there if missing)")
    args = parser.parse_args()
    DATA = args.data  # get_batch reads it, as nanoGPT's reads its data_dir
    make_tokens(DATA)
    train(args.steps, args.workers, args.latency_ms / 1e3)
