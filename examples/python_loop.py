"""A tiny GPT-style language model whose loss is computed one position at a time.

The per-token loop in `train()` is the classic Python loop in a loss: T small
cross_entropy calls (and their gradients) instead of one. trainprof finds it:

    trainprof run examples/python_loop.py              # finding: python_loop at the loss line
    trainprof run examples/python_loop.py --vectorized # one call; the finding is gone
"""

import argparse

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, dim: int, block: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(block, dim)
        layer = nn.TransformerEncoderLayer(dim, nhead=2, dim_feedforward=2 * dim, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, num_layers=1)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        return self.head(self.blocks(x, mask=mask, is_causal=True))


def train(steps: int, vectorized: bool, batch: int = 8, block: int = 64, vocab: int = 96) -> None:
    torch.manual_seed(0)
    text = torch.randint(0, vocab, (20_000,))
    model = TinyGPT(vocab, 32, block)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for _ in range(steps):
        ix = torch.randint(len(text) - block - 1, (batch,))
        x = torch.stack([text[i : i + block] for i in ix])
        y = torch.stack([text[i + 1 : i + block + 1] for i in ix])
        logits = model(x)
        if vectorized:
            loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
        else:
            loss = 0.0
            for t in range(block):  # one position at a time: the slow way
                loss = loss + F.cross_entropy(logits[:, t], y[:, t])
            loss = loss / block
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--vectorized", action="store_true", help="one cross_entropy call")
    args = parser.parse_args()
    train(args.steps, args.vectorized)
