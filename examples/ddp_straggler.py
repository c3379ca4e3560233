"""Data-parallel training on two ranks, one of which reads its data from slow storage.

A small MLP trained with DistributedDataParallel (gloo, on the CPU), each rank on its
own shard of the data (DistributedSampler). Rank 1's samples come from storage with
``--slow-ms`` of latency per read, rank 0's from a local copy: in synchronous
training rank 0 then waits for rank 1 at every gradient all-reduce, so both step at
rank 1's pace while rank 0's own breakdown shows only a long backward.
`trainprof run examples/ddp_straggler.py` records each rank and names rank 1;
``--slow-ms 0`` is the fix (every rank reads from local storage).

Starts its ranks itself (torch.multiprocessing.spawn), or runs as one rank of a
launcher:

    python examples/ddp_straggler.py --steps 40
    torchrun --nproc-per-node 2 examples/ddp_straggler.py --steps 40
"""

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--batch-size", type=int, default=16, help="per rank")
parser.add_argument("--slow-ms", type=float, default=1.0,
                    help="storage latency per sample on rank 1 (0: local on every rank)")
parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn")


class Samples(Dataset):
    """Feature vectors and labels; each read costs ``latency_s`` (the storage's round trip)."""

    def __init__(self, n: int, latency_s: float):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 64, generator=g)
        self.y = (self.x[:, :8].sum(1) > 0).long()
        self.latency_s = latency_s

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.latency_s:
            time.sleep(self.latency_s)
        return self.x[i], self.y[i]


def train(rank: int, world_size: int, args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(1)  # one core per rank
    torch.manual_seed(0)
    slow = args.slow_ms / 1000 if rank == 1 else 0.0
    data = Samples(args.steps * args.batch_size * world_size, slow)
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                      nn.Linear(256, 2)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step, (x, y) in enumerate(loader):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step}: loss {loss.item():.3f}")
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    args = parser.parse_args()
    if "RANK" in os.environ:  # started by torchrun: this process is one rank
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        mp.spawn(train, args=(args.world_size, args), nprocs=args.world_size)
