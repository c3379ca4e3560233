"""Proof that a pack reads faster than the files it was made from, and holds the same samples.

Run by ``trainprof pack`` right after writing: the same random indices (a training
sampler's access pattern) are read from the source files and from the pack, in
alternating rounds, and the rates compared. The files were just read to pack them,
so both sides read from a warm page cache: the ratio is the per-file overhead
(open, stat, read, close, against a slice of a mapped file) and, with ``decode``, the
decoding saved; cold or remote storage, where every file is a round trip, gains more
(data-loading.md §2: 4.3k vs 14.5k samples/s cold). The same reads check the content:
each sampled pack row must equal its file (bytes, or the decoded array).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainprof.fixes.folder import FolderListing, codec_for, decode_file
from trainprof.fixes.pack_format import PackError, read_manifest
from trainprof.fixes.packed_dataset import PackedDataset

#: Samples read from each side per round, and rounds (alternating files and pack).
SAMPLES, ROUNDS = 2000, 3
#: Batch of indices per ``__getitems__`` call, a typical DataLoader batch.
BATCH = 64


@dataclass
class ReadRates:
    samples: int
    rounds: int
    files_per_s: float
    pack_per_s: float
    identical: bool
    decoded: bool

    @property
    def speedup(self) -> float:
        return self.pack_per_s / self.files_per_s if self.files_per_s > 0 else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "rounds": self.rounds,
                "files_per_s": round(self.files_per_s, 1), "pack_per_s": round(self.pack_per_s, 1),
                "speedup": round(self.speedup, 2), "identical": self.identical,
                "decoded": self.decoded, "page_cache": "warm"}


def compare_reads(listing: FolderListing, pack: Path, *, decode: bool,
                  samples: int = SAMPLES, rounds: int = ROUNDS, seed: int = 0) -> ReadRates:
    """Random reads from ``listing``'s files vs the pack at ``pack``; best round of each."""
    n = len(listing.files)
    rng = np.random.default_rng(seed)
    indices = rng.choice(n, size=min(samples, n), replace=False)
    codec = codec_for(listing.extensions)
    dataset = PackedDataset(pack, fields=[_data_field(pack)], decode=False)

    def from_files() -> list[Any]:
        out = []
        for i in indices:
            data = listing.files[int(i)].read_bytes()
            out.append(decode_file(data, codec) if decode else data)
        return out

    def from_pack() -> list[Any]:
        out: list[Any] = []
        for start in range(0, len(indices), BATCH):
            out.extend(dataset.__getitems__(indices[start:start + BATCH].tolist()))
        return out

    best_files = best_pack = float("inf")
    identical = True
    for _ in range(rounds):
        t0 = time.perf_counter()
        a = from_files()
        t1 = time.perf_counter()
        b = from_pack()
        t2 = time.perf_counter()
        best_files = min(best_files, t1 - t0)
        best_pack = min(best_pack, t2 - t1)
        identical = identical and all(_same(x, y) for x, y in zip(a, b, strict=True))
    count = len(indices)
    return ReadRates(count, rounds, count / best_files, count / best_pack, identical, decode)


def _data_field(pack: Path) -> str:
    """The field the files' content went into: the pack's first default field."""
    fields = read_manifest(pack)["default_fields"]
    if not fields:
        raise PackError(f"{pack} has no data field")
    return fields[0]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    return bytes(a) == bytes(b)
