"""``PackedDataset``: a map-style dataset over a pack, a drop-in for the one it was made from.

Reads are ``mmap`` slices (blob fields) and rows of ``.npy`` columns opened with
``mmap_mode="r"`` (fixed-shape fields): no file is opened per sample, which is what
removes the per-file latency of one-file-per-sample storage (data-loading.md §2: 4.3k
vs 14.5k samples/s from a cold cache, 1 vs 75-100 µs of container overhead a sample).

``__getitems__`` is what the DataLoader calls for a whole batch of indices when a
dataset has it (torch's ``_MapDatasetFetcher``): the indices are sorted before reading,
so a batch of a fixed-shape column is one fancy-index read in file order, then put
back in the sampler's order.

Files are opened lazily, once per process (keyed by ``os.getpid()``): handles opened
before a fork are never shared with DataLoader workers, and pickling the dataset (what
``spawn`` and ``forkserver`` workers receive) carries the path, not the data — pickling
a ``np.memmap`` serialises the whole array (61 MB for a 61 MB map, data-loading.md §3).

Samples come back as the pack's source gave them: ``(image, label)`` for a folder with
class sub-folders (``transform`` applies to the image and ``target_transform`` to the
label, as in torchvision's ``ImageFolder``), the data alone for a flat folder, and the
tuple, dict or value a packed dataset returned (``transform`` then applies to the first
element of a tuple, else to the whole sample).
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trainprof.fixes.pack_format import PackError, read_manifest
from trainprof.fixes.sample_layout import apply_transforms

try:  # a torch Dataset when torch is there (it always is for training), else a plain class
    from torch.utils.data import Dataset as _Base
except ImportError:  # pragma: no cover - trainprof depends on torch
    _Base = object  # type: ignore[assignment,misc]


class PackedDataset(_Base):  # type: ignore[misc,valid-type]
    """A pack written by ``trainprof pack`` or :func:`trainprof.fixes.pack_dataset`.

    ``fields`` picks the fields a sample holds (default: the pack's default fields;
    a folder pack also has ``path``). ``decode=False`` returns blob fields as the bytes
    stored (an image's encoded file) instead of decoding them; ``image_mode`` is the
    mode images are converted to (``"RGB"``, as ``ImageFolder``'s loader; ``None``
    keeps the file's own).
    """

    def __init__(self, path: Path | str, transform: Callable[[Any], Any] | None = None,
                 target_transform: Callable[[Any], Any] | None = None, *,
                 fields: Sequence[str] | None = None, decode: bool = True,
                 image_mode: str | None = "RGB") -> None:
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        self.transform = transform
        self.target_transform = target_transform
        self.decode = decode
        self.image_mode = image_mode
        by_name = {f["name"]: f for f in self.manifest["fields"]}
        names = list(fields) if fields is not None else list(self.manifest["default_fields"])
        for name in names:
            if name not in by_name:
                raise PackError(f"{self.path} has no field {name!r} (fields: "
                                f"{', '.join(by_name)})")
        self.fields = names
        self._blob_names = [f["name"] for f in self.manifest["fields"] if f["kind"] == "blob"]
        if self.manifest["sample"] == "dict":
            self._returns = "dict"
        elif len(names) == 1 and (fields is not None or self.manifest.get("returns") == "single"
                                  or self.manifest["sample"] == "single"):
            self._returns = "single"
        else:
            self._returns = "tuple"
        self._pid: int | None = None
        self._handles: dict[str, Any] = {}

    # -- the Dataset protocol ----------------------------------------------------------
    def __len__(self) -> int:
        return int(self.manifest["count"])

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The samples at ``indices`` (a batch), read in file order, returned in theirs."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(self)
        idx = np.where(idx < 0, idx + n, idx)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            bad = next(int(i) for i in np.asarray(indices).reshape(-1) if not -n <= int(i) < n)
            raise IndexError(f"index {bad} is out of range for a pack of {n} samples")
        self._open()
        order = np.argsort(idx, kind="stable")
        inverse = np.empty_like(order)
        inverse[order] = np.arange(order.size)
        sorted_idx = idx[order]
        columns = [self._read_field(name, sorted_idx, inverse) for name in self.fields]
        return [self._sample([col[k] for col in columns]) for k in range(idx.size)]

    # -- ImageFolder compatibility -----------------------------------------------------
    @property
    def classes(self) -> list[str] | None:
        return self.manifest.get("classes")

    @property
    def class_to_idx(self) -> dict[str, int] | None:
        classes = self.classes
        return None if classes is None else {c: i for i, c in enumerate(classes)}

    @property
    def targets(self) -> list[int]:
        """Every sample's label, as ``ImageFolder.targets`` (samplers that balance classes)."""
        if "label" not in {f["name"] for f in self.manifest["fields"]}:
            raise AttributeError(f"{self.path} has no label field")
        self._open()
        return [int(x) for x in self._handles["label"]]

    def path_of(self, index: int) -> str:
        """The source file of sample ``index`` (folder packs), relative to the packed folder."""
        self._open()
        return self._blob("path", int(index)).decode("utf-8")

    def __repr__(self) -> str:
        return (f"PackedDataset({str(self.path)!r}, {len(self)} samples, "
                f"fields={self.fields})")

    # -- pickling: the path travels, the handles do not ----------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_handles"] = {}
        state["_pid"] = None
        return state

    # -- reading -------------------------------------------------------------------------
    def _open(self) -> None:
        if self._pid == os.getpid():
            return
        handles: dict[str, Any] = {}
        shards = self.manifest["shards"]
        handles["__starts"] = np.cumsum([0] + [int(s["count"]) for s in shards])
        handles["__shards"] = [None] * len(shards)
        for field in self.manifest["fields"]:
            if field["kind"] == "array":
                handles[field["name"]] = np.load(self.path / field["file"], mmap_mode="r")
            elif field["kind"] == "ragged":
                name = field["name"]
                handles[name] = (
                    _map(self.path / field["file"]),
                    np.load(self.path / f"{name}.idx.npy", mmap_mode="r"),
                    np.load(self.path / f"{name}.shape.npy", mmap_mode="r"),
                )
        self._handles = handles
        self._pid = os.getpid()

    def _shard(self, i: int) -> tuple[Any, np.ndarray]:
        shards = self._handles["__shards"]
        if shards[i] is None:
            info = self.manifest["shards"][i]
            shards[i] = (_map(self.path / info["data"]),
                         np.load(self.path / info["offsets"], mmap_mode="r"))
        return shards[i]

    def _blob(self, name: str, row: int) -> bytes:
        starts = self._handles["__starts"]
        shard = int(np.searchsorted(starts, row, side="right")) - 1
        data, offsets = self._shard(shard)
        k = len(self._blob_names)
        at = (row - int(starts[shard])) * k + self._blob_names.index(name)
        begin, end = int(offsets[at]), int(offsets[at + 1])
        return bytes(data[begin:end]) if end > begin else b""

    def _read_field(self, name: str, sorted_idx: np.ndarray, inverse: np.ndarray) -> list[Any]:
        field = next(f for f in self.manifest["fields"] if f["name"] == name)
        kind = field["kind"]
        if kind == "array":
            batch = np.asarray(self._handles[name][sorted_idx])[inverse]
            py = field.get("py", "numpy")
            if py in ("int", "float", "bool"):
                return batch.tolist()
            if py == "tensor":
                import torch

                return list(torch.from_numpy(batch).unbind(0))
            return list(batch)
        if kind == "ragged":
            data, offsets, shapes = self._handles[name]
            dtype = np.dtype(field["dtype"])
            rows = []
            for i in sorted_idx:
                begin, end = int(offsets[i]), int(offsets[i + 1])
                rows.append(np.frombuffer(data[begin:end] if end > begin else b"", dtype=dtype)
                            .reshape(tuple(int(s) for s in shapes[i])).copy())
            ordered = [rows[j] for j in inverse]
            if field.get("py") == "tensor":
                import torch

                return [torch.from_numpy(r) for r in ordered]
            return ordered
        raw = [self._blob(name, int(i)) for i in sorted_idx]
        out = []
        for j in inverse:
            try:
                out.append(self._decode_blob(field["codec"], raw[j]))
            except PackError:
                raise
            except Exception as exc:  # a corrupt sample: name it, as the file would be named
                index = int(sorted_idx[j])
                try:
                    named = type(exc)(f"{exc} (sample {index}{self._source_of(index)} "
                                      f"of {self.path})")
                except Exception:  # noqa: BLE001 - a type that takes other arguments
                    raise exc from None
                raise named from exc
        return out

    def _source_of(self, index: int) -> str:
        """", from FILE" for a folder pack's sample (its source file), else ""."""
        if "path" not in {f["name"] for f in self.manifest["fields"]}:
            return ""
        try:
            return f", from {self.path_of(index)}"
        except Exception:  # noqa: BLE001 - the name is a courtesy
            return ""

    def _decode_blob(self, codec: str, data: bytes) -> Any:
        if not self.decode or codec == "raw":
            return data
        if codec == "utf8":
            return data.decode("utf-8")
        if codec == "npy":
            return np.load(io.BytesIO(data), allow_pickle=False)
        if codec == "pickle":
            return pickle.loads(data)
        try:
            from PIL import Image
        except ImportError:
            raise PackError("this pack holds images: reading them needs Pillow "
                            "(pip install pillow), or PackedDataset(..., decode=False)") from None
        image = Image.open(io.BytesIO(data))
        return image.convert(self.image_mode) if self.image_mode else image

    def _sample(self, values: list[Any]) -> Any:
        return apply_transforms(self._returns, self.fields, values, self.transform,
                                self.target_transform)

def _map(path: Path) -> Any:
    """A read-only map of ``path`` (an empty file maps to empty bytes: mmap refuses it)."""
    if path.stat().st_size == 0:
        return b""
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
