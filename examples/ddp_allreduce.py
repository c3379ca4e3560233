"""Data-parallel training whose steps wait for the gradient all-reduce.

A wide MLP (4 layers of 1024 x 1024: 16 MiB of float32 gradients) trained with
DistributedDataParallel on two ranks (gloo, on the CPU) with a batch of 4 samples per
rank: each step computes little, then all-reduces 16 MiB, and the backward pass cannot
hide it. `trainprof run examples/ddp_allreduce.py` reads DDP's own timing of its
all-reduce on each rank and names the part the step waits for.

``--accumulate K`` is the fix it proposes: K micro-batches per optimizer step, the first
K - 1 under ``model.no_sync()``, so that one all-reduce serves them all (the samples per
optimizer step grow K-fold, as a larger batch would).

    python examples/ddp_allreduce.py --steps 150
    python examples/ddp_allreduce.py --steps 150 --accumulate 4
    torchrun --nproc-per-node 2 examples/ddp_allreduce.py
"""

import argparse
import contextlib
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=150, help="optimizer steps")
parser.add_argument("--batch-size", type=int, default=4, help="per rank and micro-batch")
parser.add_argument("--accumulate", type=int, default=1,
                    help="micro-batches per optimizer step, all but the last under no_sync()")
parser.add_argument("--width", type=int, default=1024)
parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn")


def train(rank: int, world_size: int, args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(1)  # one core per rank
    torch.manual_seed(0)
    width = args.width
    model = DistributedDataParallel(nn.Sequential(
        nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
        nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        for micro in range(args.accumulate):
            x = torch.randn(args.batch_size, width, generator=g)
            last = micro == args.accumulate - 1
            with contextlib.nullcontext() if last else model.no_sync():
                loss = model(x).square().mean() / args.accumulate
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0 and step % 50 == 0:
            print(f"step {step}: loss {loss.item() * args.accumulate:.4f}")
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
