"""A training step under CPU bfloat16 autocast against float32, by the size of its products.

The threshold the CPU bfloat16 finding uses (``trainprof.schema.BIG_MATMUL_FLOPS``):
only matrix products large enough gain from bfloat16 on a CPU; smaller ones lose to the
casts autocast adds around them. Each case is an MLP of three Linear layers (width W,
batch B: a forward product of 2 B W^2 FLOPs), a forward, backward and SGD step per
call; the two arms (autocast off, autocast bf16) run in rounds whose order is shuffled,
and each is reported as the median per-round ratio to float32 with a 95% bootstrap
interval. Run it on a CPU with AVX-512 BF16 or AMX (``grep -o 'avx512_bf16\\|amx_bf16'
/proc/cpuinfo``): elsewhere torch emulates bfloat16 and every case loses.

    python benchmarks/cpu_bf16.py                 # ~2 minutes
    python benchmarks/cpu_bf16.py --rounds 20 --threads 2
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import arm_arguments, compare_arms  # noqa: E402

#: (width, batch): forward products from 0.3 to 1,074 MFLOP
CASES = ((64, 32), (256, 32), (256, 256), (512, 64), (1024, 64), (1024, 256), (2048, 128))


def step_time(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
              bf16: bool, steps: int) -> float:
    """Mean seconds per training step over a block."""
    t0 = time.perf_counter()
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return (time.perf_counter() - t0) / steps


def main() -> None:
    args = arm_arguments(__doc__)
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    native = [f for f in ("amx_bf16", "avx512_bf16") if f in flags]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), native bfloat16: "
          f"{', '.join(native) or 'none'}; {args.rounds} rounds of {args.steps} steps per arm")
    for width, batch in CASES:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width),
                              nn.ReLU(), nn.Linear(width, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(batch, width), torch.randint(0, 10, (batch,))
        compare_arms(
            f"W={width} B={batch}, {2 * batch * width * width / 1e6:.1f} MFLOP a product",
            {"float32": lambda n, m=model, o=opt, x=x, y=y: step_time(m, o, x, y, False, n),
             "bf16": lambda n, m=model, o=opt, x=x, y=y: step_time(m, o, x, y, True, n)},
            args)


if __name__ == "__main__":
    main()
