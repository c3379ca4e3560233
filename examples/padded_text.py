"""A small text classifier whose sequences are padded to a fixed length: a `compute` finding.

Each sample is a sentence of 8 to 40 tokens padded to 128 positions, as a tokenizer
called with ``padding="max_length"`` returns it, so most of what the Transformer
encoder computes on is padding:

    trainprof run examples/padded_text.py          # "81% of the token positions ... are padding"
    trainprof run examples/padded_text.py --trim   # each batch cut to its longest sentence
    trainprof run examples/padded_text.py --trim --group  # and similar lengths batched together

The data is generated here (random tokens), so the example needs nothing but torch.
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

MAX_LEN, VOCAB = 128, 1000

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--trim", action="store_true", help="collate_fn=TrimPadding()")
parser.add_argument("--group", action="store_true",
                    help="batch_sampler=LengthGroupedBatchSampler(...)")
args = parser.parse_args()


class Sentences(Dataset):
    """Sentences of 8 to 40 tokens, each padded with 0 to MAX_LEN positions."""

    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.lengths = torch.randint(8, 41, (n,), generator=g)
        self.tokens = torch.randint(1, VOCAB, (n, MAX_LEN), generator=g)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        n = int(self.lengths[i])
        ids = torch.zeros(MAX_LEN, dtype=torch.long)
        ids[:n] = self.tokens[i, :n]
        return {"input_ids": ids, "attention_mask": (ids != 0).long(), "label": n % 2}


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64, padding_idx=0)
        self.pos = nn.Embedding(MAX_LEN, 64)
        layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(64, 2)

    def forward(self, input_ids, attention_mask):
        x = self.embed(input_ids) + self.pos(torch.arange(input_ids.shape[1]))
        x = self.encoder(x, src_key_padding_mask=attention_mask == 0)
        mask = attention_mask.unsqueeze(-1).float()
        return self.head((x * mask).sum(1) / mask.sum(1))  # mean over the real tokens


dataset = Sentences(2048)
options = {}
if args.trim:
    from trainprof.fixes import TrimPadding

    options["collate_fn"] = TrimPadding()
if args.group:
    from trainprof.fixes import LengthGroupedBatchSampler

    options["batch_sampler"] = LengthGroupedBatchSampler(dataset.lengths.tolist(),
                                                         batch_size=args.batch_size, seed=0)
else:
    options.update(batch_size=args.batch_size, shuffle=True)
loader = DataLoader(dataset, **options)

model = Classifier()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for epoch in range(args.epochs):
    for batch in loader:
        logits = model(batch["input_ids"], batch["attention_mask"])
        loss = nn.functional.cross_entropy(logits, batch["label"])
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"epoch {epoch}: loss {loss.item():.3f}")
