"""Writing a pack (see :mod:`trainprof.fixes.pack_format`) row by row, crash-safely.

Everything is written into a hidden ``.NAME.partial-PID`` folder beside the target and
renamed into place only when the manifest is there, so an interrupted pack never
leaves a folder that looks finished, and an existing pack is replaced only by a
complete one. The source is only read.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainprof.fixes.pack_format import FORMAT, MANIFEST, VERSION, PackError, shard_name

#: Shards of ~256 MB-1 GB (data-loading.md §4): large enough that opening them costs
#: nothing per sample, small enough to copy, stage or re-write one at a time.
DEFAULT_SHARD_BYTES = 512 * 2**20


@dataclass
class FieldSpec:
    """One field of every row: a blob with a codec, or an array (fixed or ragged shape)."""

    name: str
    kind: str  # "blob" | "array" (ragged is decided when the pack is closed)
    codec: str = "raw"  # blob fields
    py: str = "numpy"  # array fields: what a row comes back as
    dtype: str | None = None


def infer_fields(sample: Any) -> tuple[str, list[FieldSpec]]:
    """The row layout of a dataset item: its structure and one field per value."""
    if isinstance(sample, dict):
        for key in sample:
            if not isinstance(key, str):
                raise PackError(f"dict samples need str keys to be packed, got {key!r}")
        return "dict", [_infer_value(k, v) for k, v in sample.items()]
    if isinstance(sample, tuple | list):
        return "tuple", [_infer_value(str(i), v) for i, v in enumerate(sample)]
    return "single", [_infer_value("value", sample)]


def _infer_value(name: str, value: Any) -> FieldSpec:
    if isinstance(value, bytes | bytearray | memoryview):
        return FieldSpec(name, "blob", codec="raw")
    if isinstance(value, str):
        return FieldSpec(name, "blob", codec="utf8")
    if isinstance(value, bool | np.bool_) and not isinstance(value, np.ndarray):
        return FieldSpec(name, "array", py="bool" if isinstance(value, bool) else "numpy",
                         dtype="|b1")
    if isinstance(value, int):
        return FieldSpec(name, "array", py="int", dtype="<i8")
    if isinstance(value, float):
        return FieldSpec(name, "array", py="float", dtype="<f8")
    if isinstance(value, np.ndarray | np.generic) and value.dtype.kind in "biufc":
        return FieldSpec(name, "array", py="numpy", dtype=np.asarray(value).dtype.str)
    torch = _torch_if_loaded()
    if torch is not None and isinstance(value, torch.Tensor):
        try:
            dtype = value.detach().cpu().numpy().dtype.str
        except TypeError:  # bfloat16 and friends have no numpy dtype: keep them whole
            return FieldSpec(name, "blob", codec="pickle")
        return FieldSpec(name, "array", py="tensor", dtype=dtype)
    if type(value).__module__.startswith("PIL."):
        return FieldSpec(name, "blob", codec="image")
    return FieldSpec(name, "blob", codec="pickle")


def _torch_if_loaded() -> Any:
    import sys

    return sys.modules.get("torch")


def check_target(out: Path, overwrite: bool) -> None:
    """Refuse to write over anything but an earlier pack (and that only with ``overwrite``)."""
    if out.exists() and not out.is_dir():
        raise PackError(f"{out} is a file: give a folder for the pack")
    if out.exists() and any(out.iterdir()):
        if not (out / MANIFEST).exists():
            raise PackError(f"{out} exists and is not a pack: will not replace it")
        if not overwrite:
            raise PackError(f"{out} already exists (replace it with --force)")


class PackWriter:
    """Append rows to a new pack; :meth:`close` makes it appear at ``out``.

    ``fields`` fixes the layout (``pack_folder`` knows it); without it the first row
    decides (:func:`infer_fields`). Use as a context manager: an exception removes the
    partial folder and leaves ``out`` as it was.
    """

    def __init__(self, out: Path | str, *, fields: list[FieldSpec] | None = None,
                 structure: str = "tuple", shard_bytes: int = DEFAULT_SHARD_BYTES,
                 overwrite: bool = False, default_fields: list[str] | None = None,
                 extra: dict[str, Any] | None = None) -> None:
        self.out = Path(out)
        check_target(self.out, overwrite)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.out.parent / f".{self.out.name}.partial-{os.getpid()}"
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir()
        self.shard_bytes = int(shard_bytes)
        self.structure = structure
        self.fields = fields
        self.default_fields = default_fields
        self.extra = dict(extra or {})
        self.count = 0
        self.started = time.perf_counter()
        self._shards: list[dict[str, Any]] = []
        self._blob_file: io.BufferedWriter | None = None
        self._offsets: list[int] = []
        self._shard_rows = 0
        self._arrays: dict[str, _ArrayColumn] = {}
        if fields is not None:
            self._setup(fields)

    # -- rows ---------------------------------------------------------------------------
    def add(self, sample: Any) -> None:
        """Append one row: a tuple/list, a dict or a single value, as the first row was."""
        if self.fields is None:
            self.structure, fields = infer_fields(sample)
            self._setup(fields)
        values = self._values(sample)
        if self._blob_file is None or (self._offsets[-1] >= self.shard_bytes and self._shard_rows):
            self._next_shard()
        assert self._blob_file is not None
        for field, value in zip(self.fields or [], values, strict=True):
            if field.kind == "blob":
                data = _encode(field, value, self.count)
                self._blob_file.write(data)
                self._offsets.append(self._offsets[-1] + len(data))
            else:
                self._arrays[field.name].add(value, self.count)
        self._shard_rows += 1
        self.count += 1

    def _values(self, sample: Any) -> list[Any]:
        names = [f.name for f in self.fields or []]
        if self.structure == "dict":
            if not isinstance(sample, dict) or list(sample) != names:
                raise PackError(
                    f"row {self.count}: expected a dict with keys {names}, got "
                    f"{list(sample) if isinstance(sample, dict) else type(sample).__name__}"
                )
            return list(sample.values())
        if self.structure == "tuple":
            if not isinstance(sample, tuple | list) or len(sample) != len(names):
                raise PackError(f"row {self.count}: expected a tuple of {len(names)} values")
            return list(sample)
        return [sample]

    def _setup(self, fields: list[FieldSpec]) -> None:
        seen = set()
        for f in fields:
            if f.name in seen:
                raise PackError(f"two fields named {f.name!r}")
            seen.add(f.name)
        self.fields = fields
        for f in fields:
            if f.kind == "array":
                self._arrays[f.name] = _ArrayColumn(self.tmp, f)

    def _next_shard(self) -> None:
        self._finish_shard()
        name = shard_name(len(self._shards))
        self._blob_file = open(self.tmp / f"{name}.bin", "wb")  # noqa: SIM115 (closed in _finish)
        self._offsets = [0]
        self._shard_rows = 0
        self._shards.append({"data": f"{name}.bin", "offsets": f"{name}.idx.npy",
                             "count": 0, "bytes": 0})

    def _finish_shard(self) -> None:
        if self._blob_file is None:
            return
        self._blob_file.close()
        self._blob_file = None
        shard = self._shards[-1]
        shard["count"] = self._shard_rows
        shard["bytes"] = self._offsets[-1]
        np.save(self.tmp / shard["offsets"], np.asarray(self._offsets, dtype=np.int64))

    # -- finishing ----------------------------------------------------------------------
    def close(self) -> dict[str, Any]:
        """Write the manifest and move the pack into place; returns the manifest."""
        if self.fields is None:
            raise PackError("nothing to pack: the source has no samples")
        self._finish_shard()
        fields_out = []
        for f in self.fields:
            if f.kind == "blob":
                fields_out.append({"name": f.name, "kind": "blob", "codec": f.codec})
            else:
                fields_out.append(self._arrays[f.name].finish(self.count))
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "count": self.count,
            "sample": self.structure,
            "fields": fields_out,
            "default_fields": self.default_fields or [f.name for f in self.fields],
            "shards": self._shards,
            "write_s": round(time.perf_counter() - self.started, 3),
            **self.extra,
        }
        (self.tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if self.out.exists() and not any(self.out.iterdir()):
            self.out.rmdir()
        if self.out.exists():
            old = self.out.parent / f".{self.out.name}.old-{os.getpid()}"
            self.out.rename(old)
            self.tmp.rename(self.out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            self.tmp.rename(self.out)
        return manifest

    def abort(self) -> None:
        """Drop the partial folder (after an error or Ctrl-C); ``out`` is untouched."""
        if self._blob_file is not None:
            self._blob_file.close()
            self._blob_file = None
        for column in self._arrays.values():
            column.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> PackWriter:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is not None:
            self.abort()


class _ArrayColumn:
    """An array field: raw row bytes appended to a temporary file, shapes kept.

    At the end, one shape for all rows makes a ``.npy`` column (the header is written
    then the rows copied after it); varying shapes make a ``ragged`` field.
    """

    def __init__(self, folder: Path, spec: FieldSpec) -> None:
        self.folder = folder
        self.spec = spec
        self.raw_path = folder / f"{spec.name}.raw"
        self.file: io.BufferedWriter | None = open(self.raw_path, "wb")  # noqa: SIM115
        self.dtype = np.dtype(spec.dtype) if spec.dtype else None
        self.shapes: list[tuple[int, ...]] = []

    def add(self, value: Any, row: int) -> None:
        if self.spec.py == "tensor":
            value = value.detach().cpu().numpy()
        array = np.asarray(value)  # not ascontiguousarray: it makes 0-d arrays 1-d
        if self.dtype is None:
            self.dtype = array.dtype
        if array.dtype != self.dtype:
            if self.spec.py in ("int", "float", "bool") and np.can_cast(array.dtype, self.dtype):
                array = array.astype(self.dtype)
            else:
                raise PackError(
                    f"row {row}, field {self.spec.name!r}: dtype {array.dtype} differs from "
                    f"the first row's {self.dtype}"
                )
        assert self.file is not None
        self.file.write(array.tobytes())
        self.shapes.append(array.shape)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def finish(self, count: int) -> dict[str, Any]:
        self.close()
        name = self.spec.name
        assert self.dtype is not None
        base = {"name": name, "dtype": self.dtype.str, "py": self.spec.py}
        if len(set(self.shapes)) <= 1:
            shape = self.shapes[0] if self.shapes else ()
            column = self.folder / f"{name}.npy"
            header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
                      "shape": (count, *shape)}
            with open(column, "wb") as out, open(self.raw_path, "rb") as raw:
                np.lib.format.write_array_header_2_0(out, header)
                shutil.copyfileobj(raw, out, 16 * 2**20)
            self.raw_path.unlink()
            return {**base, "kind": "array", "file": column.name, "shape": list(shape)}
        ndims = {len(s) for s in self.shapes}
        if len(ndims) != 1:
            raise PackError(f"field {name!r}: rows have different numbers of dimensions")
        sizes = np.array([int(np.prod(s)) for s in self.shapes], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        np.save(self.folder / f"{name}.idx.npy", offsets * self.dtype.itemsize)
        np.save(self.folder / f"{name}.shape.npy", np.asarray(self.shapes, dtype=np.int64))
        self.raw_path.rename(self.folder / f"{name}.bin")
        return {**base, "kind": "ragged", "file": f"{name}.bin", "ndim": ndims.pop()}


def _encode(field: FieldSpec, value: Any, row: int) -> bytes:
    codec = field.codec
    try:
        if codec == "raw" or (codec in ("image", "npy") and isinstance(value, bytes | bytearray)):
            return bytes(value)
        if codec == "utf8":
            return value.encode("utf-8")
        if codec == "image":  # a PIL image from a dataset: stored losslessly
            buffer = io.BytesIO()
            value.save(buffer, format="PNG")
            return buffer.getvalue()
        if codec == "npy":
            buffer = io.BytesIO()
            np.save(buffer, np.asarray(value), allow_pickle=False)
            return buffer.getvalue()
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except (AttributeError, TypeError, ValueError, pickle.PicklingError) as exc:
        raise PackError(f"row {row}, field {field.name!r}: cannot store it as {codec}: "
                        f"{exc}") from None


def pack_dataset(dataset: Any, out: Path | str, *, shard_bytes: int = DEFAULT_SHARD_BYTES,
                 overwrite: bool = False,
                 progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Pack every item of a map-style dataset (``len`` and ``[i]``), in index order, or of
    a finite stream (an ``IterableDataset``: no ``len``), in the order one pass of its
    ``__iter__`` yields them in this process (no DataLoader worker: the whole stream).

    For the work a dataset does per item that gives the same result every epoch
    (reading, decoding, tokenising): do it once here, then train from
    ``PackedDataset(out)``, which returns the same items. Random augmentations belong
    after, in the ``transform`` of the packed dataset. A stream's progress has no total
    (``progress`` gets -1 for it).
    """
    source = {"source": {"kind": "dataset", "class": type(dataset).__qualname__}}
    try:
        total = len(dataset)
    except TypeError:
        stream = _is_iterable_dataset(dataset) or (
            hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__"))
        if not stream:
            raise PackError("pack_dataset needs a map-style dataset (len() and [i]) or an "
                            "IterableDataset") from None
        return write_rows(iter(dataset), out, total=-1, shard_bytes=shard_bytes,
                          overwrite=overwrite, progress=progress, extra=source)
    return write_rows((dataset[i] for i in range(total)), out, total=total,
                      shard_bytes=shard_bytes, overwrite=overwrite, progress=progress,
                      extra=source)


def _is_iterable_dataset(dataset: Any) -> bool:
    torch = _torch_if_loaded()
    return torch is not None and isinstance(dataset, torch.utils.data.IterableDataset)


def write_rows(rows: Iterable[Any], out: Path | str, *, total: int,
               fields: list[FieldSpec] | None = None, structure: str = "tuple",
               default_fields: list[str] | None = None,
               shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False,
               progress: Callable[[int, int], None] | None = None,
               extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``rows`` as a pack at ``out``; on any error or Ctrl-C nothing is left behind."""
    writer = PackWriter(out, fields=fields, structure=structure, shard_bytes=shard_bytes,
                        overwrite=overwrite, default_fields=default_fields, extra=extra)
    with writer:
        for row in rows:
            writer.add(row)
            if progress is not None and (writer.count % 256 == 0 or writer.count == total):
                progress(writer.count, total)
        return writer.close()
