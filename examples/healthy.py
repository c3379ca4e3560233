"""A well-tuned, compute-bound training loop: what trainprof should leave alone.

An MLP classifier on a synthetic tabular dataset that fits in memory. Batches are
sliced from tensors that were generated (and shuffled) once, nanoGPT-style, so the
loop never waits for input; the loss is read only at logging steps, there is no
per-step Python object churn, AdamW runs its fused update, PyTorch uses as many
threads as there are usable cores, and on a CPU that computes bfloat16 natively
(AVX-512 BF16 or AMX) the forward runs under bfloat16 autocast. Nearly all time goes
to forward, backward and the optimizer: trainprof should find nothing of consequence
here.

    python examples/healthy.py --steps 60
"""

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--batch-size", type=int, default=256)
parser.add_argument("--width", type=int, default=768)
parser.add_argument("--log-interval", type=int, default=50)
args = parser.parse_args()

n_features, n_classes, n_samples = 128, 10, 16_384

# Usable cores (affinity mask), not the host's: the default can oversubscribe a container.
torch.set_num_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
torch.manual_seed(0)

# The dataset: a Gaussian mixture, one centre per class, generated in memory.
centres = torch.randn(n_classes, n_features) * 2
labels = torch.randint(0, n_classes, (n_samples,))
features = centres[labels] + torch.randn(n_samples, n_features)


def get_batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous slices of a once-shuffled dataset: no per-sample Python work."""
    start = (i * args.batch_size) % (n_samples - args.batch_size)
    return features[start : start + args.batch_size], labels[start : start + args.batch_size]


model = nn.Sequential(
    nn.Linear(n_features, args.width), nn.ReLU(),
    nn.Linear(args.width, args.width), nn.ReLU(),
    nn.Linear(args.width, args.width), nn.ReLU(),
    nn.Linear(args.width, n_classes),
)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


def native_bf16() -> bool:
    """The CPU multiplies bfloat16 natively: twice float32's peak (AVX-512 BF16) or more (AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


bf16 = native_bf16()

for step in range(args.steps):
    x, y = get_batch(step)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if step % args.log_interval == 0:
        print(f"step {step}: loss {loss.item():.4f}")
