"""A batch sampler that puts sequences of similar length in the same batch.

Padding each batch to its own longest sequence (:class:`trainprof.fixes.TrimPadding`)
still pads every shorter row of the batch up to that length: a batch that holds one
sequence of 40 tokens and 31 of 10 computes on 1,280 positions for 350 real ones.
Grouping sequences of similar length leaves little to pad. Drawn at random, the
batches would be as different as before; sorted whole, the order of the data would be
the same every epoch. The usual middle way, Hugging Face's ``group_by_length``
(``transformers.trainer_pt_utils.get_length_grouped_indices``), is the one used here:
shuffle all indices, cut them into pools of ``pool_batches`` batches, sort each pool
by length (longest first), cut it into batches, and shuffle the order of the batches.
Each epoch draws a new shuffle; every index appears once per epoch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler


class LengthGroupedBatchSampler(Sampler[list[int]]):
    """Batches of indices whose ``lengths`` are close: ``DataLoader(batch_sampler=...)``.

    ``lengths[i]`` is sample ``i``'s number of real tokens (before any padding).
    ``pool_batches`` batches are sorted together: larger pools group lengths more
    tightly and shuffle less. ``seed`` makes the order reproducible (a new one each
    epoch, ``seed + epoch``); without it the order follows torch's global generator.
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, *, pool_batches: int = 50,
                 drop_last: bool = False, seed: int | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size}")
        if pool_batches < 1:
            raise ValueError(f"pool_batches must be at least 1, not {pool_batches}")
        self.lengths = torch.as_tensor(list(lengths), dtype=torch.int64)
        if self.lengths.dim() != 1:
            raise ValueError("lengths must be one number per sample")
        self.batch_size = batch_size
        self.pool_batches = pool_batches
        self.drop_last = drop_last
        self.seed = seed
        self.epoch = 0

    def __len__(self) -> int:
        n = len(self.lengths)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        generator = None
        if self.seed is not None:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
        self.epoch += 1
        order = torch.randperm(len(self.lengths), generator=generator)
        pool = self.pool_batches * self.batch_size
        batches: list[list[int]] = []
        for start in range(0, len(order), pool):
            chunk = order[start:start + pool]
            # stable sort, longest first: ties keep their shuffled order
            by_length = chunk[torch.argsort(self.lengths[chunk], descending=True, stable=True)]
            batches += [by_length[i:i + self.batch_size].tolist()
                        for i in range(0, len(by_length), self.batch_size)]
        if self.drop_last:
            batches = [b for b in batches if len(b) == self.batch_size]
        for i in torch.randperm(len(batches), generator=generator).tolist():
            yield batches[i]
