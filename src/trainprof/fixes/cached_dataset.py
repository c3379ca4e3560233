"""``CachedDataset``: a dataset's deterministic per-item work done once, then read from disk.

For the ``cpu_transforms`` finding: when decoding and resizing (the same result every
epoch) is what the DataLoader workers spend their CPU on, compute it once. The first
time an item is asked for it is computed by the wrapped dataset and written; every
later read (the next epoch, the next run) is a row of a ``.npy`` column. Random
augmentations stay per sample, in ``transform``.

Storage follows data-loading.md §4's disk-cache recommendation for fixed-shape
outputs: one ``np.lib.format.open_memmap`` column per field plus a ``filled`` flag per
item (483k reads/s, 2 µs a read, in its measurements; diskcache 9.5 µs, sqlite 6.8 µs,
one file per item 51 µs). The columns are sparse files until filled. DataLoader workers
fill disjoint rows of the same shared mappings, so any number of processes (workers,
ranks) can fill one cache at once; a row is written before its flag, so a process
killed in between leaves the item to be computed again, never half of it.

A cache belongs to one dataset: its class (name and source code), its length, the
layout of its items and the ``key`` you give (bump it when the work changes in a way
the class's source does not show, e.g. a size argument). A cache made by another is
rebuilt, with a warning. Items must keep one layout: the same fields, each of one
shape and dtype (numbers, arrays, tensors, PIL images); for items whose shapes vary
use :func:`trainprof.fixes.pack_dataset`.
"""

from __future__ import annotations

import fcntl
import hashlib
import inspect
import json
import os
import shutil
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trainprof.fixes.pack_format import PackError
from trainprof.fixes.pack_writer import infer_fields
from trainprof.fixes.sample_layout import apply_transforms

FORMAT, VERSION = "trainprof-cache", 1
MANIFEST = "cache.json"

try:
    from torch.utils.data import Dataset as _Base
except ImportError:  # pragma: no cover - trainprof depends on torch
    _Base = object  # type: ignore[assignment,misc]


class CachedDataset(_Base):  # type: ignore[misc,valid-type]
    """``dataset`` (map-style) with each item computed once and kept at ``path``.

    ``transform``/``target_transform`` run on every read, after the cache (for tuples
    the first and second elements, as torchvision's ``ImageFolder``; otherwise the
    whole item). ``key``: a string that names the work, part of the cache's identity.
    """

    def __init__(self, dataset: Any, path: Path | str,
                 transform: Callable[[Any], Any] | None = None,
                 target_transform: Callable[[Any], Any] | None = None, *,
                 key: str = "") -> None:
        self.dataset = dataset
        self.path = Path(path)
        self.transform = transform
        self.target_transform = target_transform
        try:
            count = len(dataset)
        except TypeError:
            raise PackError("CachedDataset needs a map-style dataset (len() and [i])") from None
        if count == 0:
            raise PackError("CachedDataset: the dataset is empty")
        first = dataset[0]
        structure, specs = infer_fields(first)
        fields = []
        for spec, value in zip(specs, _values(structure, first), strict=True):
            array = _to_array(value)
            if array is None or (spec.kind != "array" and spec.codec != "image"):
                raise PackError(
                    f"CachedDataset keeps numbers, arrays, tensors and PIL images; field "
                    f"{spec.name!r} is a {type(value).__name__} (pack_dataset keeps anything)"
                )
            py = "pil" if spec.codec == "image" else spec.py
            fields.append({"name": spec.name, "py": py, "dtype": array.dtype.str,
                           "shape": list(array.shape),
                           **({"mode": value.mode} if py == "pil" else {})})
        self.manifest = {
            "format": FORMAT, "version": VERSION, "count": count, "sample": structure,
            "fields": fields, "identity": _identity(dataset, key, count),
        }
        self._create_or_check()
        self._pid: int | None = None
        self._columns: dict[str, np.ndarray] = {}
        self._filled: np.ndarray | None = None

    # -- the Dataset protocol -------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.manifest["count"])

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """Cached items read as a batch (sorted reads); the others computed and stored."""
        n = len(self)
        idx = [int(i) + n if int(i) < 0 else int(i) for i in indices]
        for given, i in zip(indices, idx, strict=True):
            if not 0 <= i < n:
                raise IndexError(f"index {given} is out of range for a dataset of {n} items")
        self._open()
        assert self._filled is not None
        rows: list[list[Any] | None] = [None] * len(idx)
        cached = [k for k, i in enumerate(idx) if self._filled[i]]
        if cached:
            where = np.asarray([idx[k] for k in cached], dtype=np.int64)
            order = np.argsort(where, kind="stable")
            inverse = np.empty_like(order)
            inverse[order] = np.arange(order.size)
            columns = [np.asarray(self._columns[f["name"]][where[order]])[inverse]
                       for f in self.manifest["fields"]]
            for j, k in enumerate(cached):
                rows[k] = [col[j] for col in columns]
        for k, i in enumerate(idx):
            if rows[k] is None:
                rows[k] = self._compute(i)
        return [self._sample(row) for row in rows if row is not None]

    @property
    def cached_fraction(self) -> float:
        """Share of the items already on disk (1.0: every read is a cache read)."""
        self._open()
        assert self._filled is not None
        return float(np.count_nonzero(self._filled)) / len(self)

    def __repr__(self) -> str:
        return (f"CachedDataset({type(self.dataset).__name__}, {str(self.path)!r}, "
                f"{len(self)} items)")

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_pid=None, _columns={}, _filled=None)
        return state

    # -- the cache ------------------------------------------------------------------------
    def _refuse_other_files(self) -> None:
        """A folder that holds files but no cache's manifest is not the cache's to fill."""
        if (self.path.is_dir() and not (self.path / MANIFEST).exists()
                and any(p.name != ".lock" for p in self.path.iterdir())):
            raise PackError(f"{self.path} holds other files: give an empty or new folder "
                            "for the cache")

    def _create_or_check(self) -> None:
        self._refuse_other_files()  # before the lock file: a refused folder is left as it was
        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.path / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # ranks and workers may start together
            manifest_path = self.path / MANIFEST
            if manifest_path.exists():
                try:
                    existing = json.loads(manifest_path.read_text())
                except ValueError:
                    existing = None
                if existing == self.manifest:
                    return
                warnings.warn(
                    f"trainprof: the cache at {self.path} was made for another dataset or "
                    f"work ({_difference(existing, self.manifest)}): rebuilding it",
                    stacklevel=3,
                )
                for entry in self.path.iterdir():
                    if entry.name != ".lock":
                        entry.unlink() if entry.is_file() else shutil.rmtree(entry)
            else:
                self._refuse_other_files()  # (again under the lock: another rank's)
            need = len(self) * sum(
                np.dtype(f["dtype"]).itemsize * int(np.prod(f["shape"], dtype=np.int64))
                for f in self.manifest["fields"]
            )
            free = shutil.disk_usage(self.path).free
            if need > free:
                raise PackError(f"the cache needs {need / 1e9:.1f} GB and {self.path} has "
                                f"{free / 1e9:.1f} GB free")
            for f in self.manifest["fields"]:
                np.lib.format.open_memmap(self.path / f"{f['name']}.npy", mode="w+",
                                          dtype=np.dtype(f["dtype"]),
                                          shape=(len(self), *f["shape"])).flush()
            np.lib.format.open_memmap(self.path / "filled.npy", mode="w+", dtype=np.uint8,
                                      shape=(len(self),)).flush()
            tmp = manifest_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.manifest, indent=1))
            tmp.rename(manifest_path)  # written last: the columns exist when it does

    def _open(self) -> None:
        if self._pid == os.getpid():
            return
        self._columns = {f["name"]: np.load(self.path / f"{f['name']}.npy", mmap_mode="r+")
                         for f in self.manifest["fields"]}
        self._filled = np.load(self.path / "filled.npy", mmap_mode="r+")
        self._pid = os.getpid()

    def _compute(self, i: int) -> list[Any]:
        item = self.dataset[i]
        values = _values(self.manifest["sample"], item, len(self.manifest["fields"]))
        arrays = []
        for f, value in zip(self.manifest["fields"], values, strict=True):
            array = _to_array(value)
            if (array is None or list(array.shape) != f["shape"]
                    or array.dtype.str != f["dtype"]):
                got = ("a " + type(value).__name__ if array is None
                       else f"{array.dtype} {tuple(array.shape)}")
                raise PackError(
                    f"item {i}, field {f['name']!r}: {got}, where item 0 had "
                    f"{np.dtype(f['dtype'])} {tuple(f['shape'])}; CachedDataset needs one "
                    "shape per field (resize deterministically first, or use pack_dataset)"
                )
            arrays.append(array)
        assert self._filled is not None
        for f, array in zip(self.manifest["fields"], arrays, strict=True):
            self._columns[f["name"]][i] = array
        self._filled[i] = 1  # after the row: a kill in between leaves it to be computed again
        return arrays

    def _sample(self, row: list[Any]) -> Any:
        values = [_from_array(f, value) for f, value in zip(self.manifest["fields"], row,
                                                            strict=True)]
        names = [f["name"] for f in self.manifest["fields"]]
        return apply_transforms(self.manifest["sample"], names, values, self.transform,
                                self.target_transform)


def _values(structure: str, item: Any, expected: int | None = None) -> list[Any]:
    if structure == "dict":
        if not isinstance(item, dict):
            raise PackError(f"expected a dict item, got {type(item).__name__}")
        return list(item.values())
    if structure == "tuple":
        if not isinstance(item, tuple | list) or (expected is not None
                                                  and len(item) != expected):
            raise PackError(f"expected a tuple of {expected} values, got {item!r:.80}")
        return list(item)
    return [item]


def _to_array(value: Any) -> np.ndarray | None:
    if type(value).__module__.startswith("PIL."):
        return np.asarray(value)
    if hasattr(value, "detach") and hasattr(value, "numpy"):
        try:
            return value.detach().cpu().numpy()
        except TypeError:
            return None
    if isinstance(value, bool | int | float | np.ndarray | np.generic):
        array = np.asarray(value)
        return array if array.dtype.kind in "biufc" else None
    return None


def _from_array(field: dict[str, Any], value: Any) -> Any:
    py = field["py"]
    if py in ("int", "float", "bool"):
        return value.item()
    if py == "tensor":
        import torch

        return torch.from_numpy(np.array(value))
    if py == "pil":
        from PIL import Image

        return Image.fromarray(np.asarray(value), mode=field.get("mode"))
    return np.array(value)


def _identity(dataset: Any, key: str, count: int) -> dict[str, Any]:
    cls = type(dataset)
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):  # defined in a REPL, or a C type
        source = ""
    return {"class": f"{cls.__module__}.{cls.__qualname__}", "len": count, "key": key,
            "source_sha256": hashlib.sha256(source.encode()).hexdigest()[:16]}


def _difference(old: Any, new: dict[str, Any]) -> str:
    if not isinstance(old, dict):
        return "unreadable manifest"
    for name in ("identity", "fields", "sample", "count", "version"):
        if old.get(name) != new.get(name):
            if name == "identity":
                keys = [k for k in new["identity"] if old.get(name, {}).get(k) != new[name][k]]
                return "differs in " + ", ".join(keys)
            return f"differs in {name}"
    return "differs"
