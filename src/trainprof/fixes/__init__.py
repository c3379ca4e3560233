"""Fixes users import: what a finding's snippet tells them to use.

* :class:`PackedDataset`, :func:`pack_folder`, :func:`pack_dataset` — one-file-per-sample
  data (or a dataset's deterministic per-item work: decoding, tokenising) written once
  into a few large files and read back by ``mmap``; ``trainprof pack`` on the command line.
* :class:`CachedDataset` — a dataset's deterministic per-item work (decode, resize) done
  the first time an item is read and kept on disk; random augmentations after it.
* :func:`stage` — a dataset on network storage copied once per node (and version) to
  local disk, the ranks of a node sharing the copy; ``trainprof stage`` on the command line.
* :class:`PackedCollate` — a ``collate_fn`` whose batches cross from a DataLoader worker
  as one tensor per dtype, rebuilt as they were in the training process (each tensor
  of a batch otherwise pays its own hand-over).
* :class:`TrimPadding` — a ``collate_fn`` wrapper that cuts the columns that are padding
  in every row of a batch of token sequences (padded to a fixed length): each batch only
  as long as its longest sequence.
* :class:`LengthGroupedBatchSampler` — batches of sequences of similar length (Hugging
  Face's ``group_by_length``), so that little of each batch is padding.
* :class:`DevicePrefetcher` — batches copied to the device ahead of use (a side stream
  on CUDA), uint8 images turned into floats, augmented and normalised there, batched.

Format and measurements: :mod:`trainprof.fixes.pack_format`. Names are imported on first
use (PEP 562), so ``trainprof pack`` reports bad input before torch is imported.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "CachedDataset": "trainprof.fixes.cached_dataset",
    "DevicePrefetcher": "trainprof.fixes.device_prefetcher",
    "LengthGroupedBatchSampler": "trainprof.fixes.length_grouped",
    "PackError": "trainprof.fixes.pack_format",
    "PackedCollate": "trainprof.fixes.packed_collate",
    "PackedDataset": "trainprof.fixes.packed_dataset",
    "pack_dataset": "trainprof.fixes.pack_writer",
    "pack_folder": "trainprof.fixes.folder",
    "stage": "trainprof.fixes.staging",
    "TrimPadding": "trainprof.fixes.padding",
    "trim_padding": "trainprof.fixes.padding",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'trainprof.fixes' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)


def __dir__() -> list[str]:
    return __all__
