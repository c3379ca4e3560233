"""A tiny character-level GPT, trained nanoGPT-style, that evaluates far too often.

Like nanoGPT's train.py, every ``--eval-interval`` steps it estimates the loss on
``--eval-iters`` batches of *both* splits and saves a checkpoint. With the small
interval used here, evaluation costs a large share of the run:
`trainprof run examples/eval_every.py` reports it as periodic overhead.

The data (a random Markov-chain "text" of 64 symbols) is generated once into
train.bin / val.bin under --data, like nanoGPT's prepare.py.

    python examples/eval_every.py --steps 60
"""

import argparse
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--eval-interval", type=int, default=10)
parser.add_argument("--eval-iters", type=int, default=10)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--block-size", type=int, default=64)
parser.add_argument("--data", default=str(Path(__file__).parent / "data" / "eval_every"))
parser.add_argument("--ckpt-dir", default=None, help="checkpoint folder (default: a temp one)")
args = parser.parse_args()

vocab_size, n_embd, n_head, n_layer = 64, 64, 4, 2


def prepare(root: Path, n_tokens: int = 200_000) -> None:
    """Write train.bin/val.bin (uint16 tokens) from a random sparse Markov chain, once."""
    if (root / "val.bin").exists():
        return
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    nxt = rng.integers(0, vocab_size, (vocab_size, 4))  # each symbol has 4 likely successors
    tokens = np.empty(n_tokens, dtype=np.uint16)
    tokens[0] = 0
    choice = rng.integers(0, 4, n_tokens)
    for i in range(1, n_tokens):
        tokens[i] = nxt[tokens[i - 1], choice[i]]
    split = int(0.9 * n_tokens)
    tokens[:split].tofile(root / "train.bin.tmp")
    tokens[split:].tofile(root / "val.bin.tmp")
    os.replace(root / "train.bin.tmp", root / "train.bin")
    os.replace(root / "val.bin.tmp", root / "val.bin")


def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    data = np.memmap(Path(args.data) / f"{split}.bin", dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - args.block_size - 1, (args.batch_size,))
    x = torch.stack([torch.from_numpy(data[i : i + args.block_size].astype(np.int64)) for i in ix])
    y = torch.stack(
        [torch.from_numpy(data[i + 1 : i + 1 + args.block_size].astype(np.int64)) for i in ix]
    )
    return x, y


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(args.block_size, n_embd)
        layer = nn.TransformerEncoderLayer(
            n_embd, n_head, 4 * n_embd, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(args.block_size)
        )

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        x = self.blocks(x, mask=self.mask[:t, :t], is_causal=True)
        logits = self.head(self.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, vocab_size), targets.view(-1))
        return logits, loss


@torch.no_grad()
def estimate_loss() -> dict[str, float]:
    """nanoGPT's estimate_loss: the mean loss over eval_iters batches of each split."""
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(args.eval_iters)
        for k in range(args.eval_iters):
            x, y = get_batch(split)
            _, loss = model(x, y)
            losses[k] = loss.item()
        out[split] = losses.mean().item()
    model.train()
    return out


prepare(Path(args.data))
torch.manual_seed(1337)
out_dir = Path(args.ckpt_dir) if args.ckpt_dir else Path(tempfile.mkdtemp(prefix="eval_every-"))
model = GPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

for it in range(args.steps):
    if it % args.eval_interval == 0:
        losses = estimate_loss()
        print(f"step {it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if it > 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "iter_num": it}, out_dir / "ckpt.pt")
    x, y = get_batch("train")
    _, loss = model(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
