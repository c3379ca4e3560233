"""``trainprof pack DIR OUT``: a folder of one-file-per-sample data made into a pack.

The layout is torchvision's ``ImageFolder``'s when the folder has class sub-folders
(``root/<class>/<file>``): classes sorted by name give the labels, files sorted within
a class give the order, so index *i* of the pack is index *i* of
``ImageFolder(root)`` (files found by extension aside: give ``extensions`` for that);
files beside the class folders (a marker, a README) are skipped and counted, as
ImageFolder ignores them; so are the files that are not images in a folder that is
mostly images (a ``notes.txt``), which ImageFolder's extension filter leaves out and which
would otherwise make every row raw bytes. A folder without class sub-folders, or with more files at
its top than in its sub-folders, packs every file under it, sorted by path.

Files are read by a pool of threads (reads release the GIL, and on network storage
many in flight is what hides the latency); rows are written in order.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainprof.fixes.interrupts import deferred_sigint
from trainprof.fixes.pack_format import PackError
from trainprof.fixes.pack_writer import DEFAULT_SHARD_BYTES, FieldSpec, write_rows

#: Extensions Pillow decodes that datasets commonly use (torchvision's IMG_EXTENSIONS).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
#: Rows read ahead by the thread pool.
CHUNK = 256


@dataclass
class FolderListing:
    """What ``pack_folder`` found: the files in pack order and their labels."""

    root: Path
    files: list[Path]
    labels: list[int] | None
    classes: list[str] | None
    skipped: int = 0
    total_bytes: int = 0
    newest_mtime: float = 0.0
    extensions: list[str] = field(default_factory=list)
    #: files that are not images in a folder of images: skipped, as ImageFolder does
    skipped_non_images: int = 0


def list_folder(root: Path | str, extensions: tuple[str, ...] | None = None) -> FolderListing:
    """The files of ``root`` in ImageFolder order (see the module docstring)."""
    root = Path(root)
    if not root.exists():
        raise PackError(f"no such folder: {root}")
    if not root.is_dir():
        raise PackError(f"{root} is a file: give the folder that holds the samples")
    exts = tuple(e.lower() if e.startswith(".") else f".{e.lower()}" for e in extensions or ())

    def wanted(name: str) -> bool:
        return not name.startswith(".") and (not exts or name.lower().endswith(exts))

    def walk(folder: Path) -> list[Path]:
        found = []
        for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            found.extend(Path(dirpath) / f for f in sorted(filenames) if wanted(f))
        return found

    entries = sorted((e for e in os.scandir(root) if not e.name.startswith(".")),
                     key=lambda e: e.name)
    class_dirs = [e for e in entries if e.is_dir()]
    top_files = [e for e in entries if e.is_file()]
    files: list[Path] = []
    labels: list[int] | None = None
    classes: list[str] | None = None
    skipped = 0
    if class_dirs:
        per_class = [(d.name, walk(Path(d.path))) for d in class_dirs]
        per_class = [(name, found) for name, found in per_class if found]
    else:
        per_class = []
    if per_class and len(top_files) >= sum(len(found) for _, found in per_class):
        per_class = []  # mostly files at the top: a flat folder with a few sub-folders
    if per_class:
        classes = [name for name, _ in per_class]
        labels = []
        for label, (_, found) in enumerate(per_class):
            files.extend(found)
            labels.extend([label] * len(found))
        skipped = len(top_files)  # ImageFolder ignores them too (a "done" marker, a README)
    else:
        files = walk(root)
    non_images = 0
    if not exts and files:
        # ImageFolder keeps only images: in a folder of images, a stray file (notes.txt)
        # is skipped and counted, not packed - it would make every row raw bytes
        is_image = [f.suffix.lower() in IMAGE_EXTENSIONS for f in files]
        if any(is_image) and not all(is_image) and 2 * sum(is_image) >= len(files):
            non_images = len(files) - sum(is_image)
            if labels is not None:
                labels = [lab for lab, keep in zip(labels, is_image, strict=True) if keep]
            files = [f for f, keep in zip(files, is_image, strict=True) if keep]
    if not files:
        raise PackError(f"no files to pack under {root}"
                        + (f" with extensions {', '.join(exts)}" if exts else ""))
    total = newest = 0.0
    for f in files:
        st = f.stat()
        total += st.st_size
        newest = max(newest, st.st_mtime)
    return FolderListing(root, files, labels, classes, skipped, int(total), newest,
                         sorted({f.suffix.lower() for f in files}), non_images)


def codec_for(extensions: list[str]) -> str:
    """``image`` when every file is an image, ``npy`` when every file is one, else ``raw``."""
    if extensions and all(e in IMAGE_EXTENSIONS for e in extensions):
        return "image"
    if extensions == [".npy"]:
        return "npy"
    return "raw"


def decode_file(data: bytes, codec: str) -> np.ndarray:
    """The array a sample decodes to: RGB uint8 (H, W, 3) for images, as ImageFolder's loader."""
    if codec == "image":
        image_module = _pil()
        with image_module.open(io.BytesIO(data)) as img:
            return np.asarray(img.convert("RGB"))
    if codec == "npy":
        return np.load(io.BytesIO(data), allow_pickle=False)
    raise PackError("--decode needs image or .npy files")


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise PackError("images need Pillow: pip install pillow") from None
    return Image


def pack_folder(root: Path | str, out: Path | str, *, decode: bool = False,
                extensions: tuple[str, ...] | None = None,
                shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False,
                threads: int | None = None,
                progress: Callable[[int, int], None] | None = None,
                listing: FolderListing | None = None) -> dict[str, Any]:
    """Pack the files under ``root`` into ``out``; returns the manifest.

    Rows are ``(data, label)`` with class sub-folders, else ``data``, plus a ``path``
    field (the file's path under ``root``) that is not returned by default. ``data`` is
    the file's bytes (decoded when read: images with Pillow, ``.npy`` with numpy), or
    with ``decode=True`` the decoded uint8 array stored as is: no decoding when
    training, at the cost of the decoded size on disk (a fixed-shape column when every
    sample has one shape, which is what makes a batch one read).
    """
    listing = listing or list_folder(root, extensions)
    codec = codec_for(listing.extensions)
    if decode and codec == "raw":
        raise PackError(
            f"--decode needs image or .npy files; {listing.root} has "
            f"{', '.join(listing.extensions[:5]) or 'files without extension'}"
        )
    if decode and codec == "image":
        _pil()
    name = "image" if codec == "image" else "data"
    data_field = (FieldSpec(name, "array", py="numpy") if decode
                  else FieldSpec(name, "blob", codec=codec))
    fields = [data_field]
    if listing.labels is not None:
        fields.append(FieldSpec("label", "array", py="int", dtype="<i8"))
    fields.append(FieldSpec("path", "blob", codec="utf8"))
    default = [f.name for f in fields if f.name != "path"]
    workers = threads or min(32, 4 * len(os.sched_getaffinity(0)))

    def load(i: int) -> Any:
        path = listing.files[i]
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise PackError(f"cannot read {path}: {exc.strerror or exc}") from None
        if decode:
            try:
                value = decode_file(data, codec)
            except PackError:
                raise
            except Exception as exc:  # Pillow/numpy raise many kinds for a bad file
                raise PackError(f"cannot decode {path}: {exc}") from None
        else:
            value = data
        rel = str(path.relative_to(listing.root))
        if listing.labels is not None:
            return (value, listing.labels[i], rel)
        return (value, rel)

    def rows() -> Iterator[Any]:
        # Ctrl-C between rows, never inside the pool's locks (trainprof.fixes.interrupts)
        with deferred_sigint() as check, ThreadPoolExecutor(
                max_workers=workers, thread_name_prefix="trainprof-pack") as pool:
            for start in range(0, len(listing.files), CHUNK):
                for row in pool.map(load, range(start, min(start + CHUNK, len(listing.files)))):
                    check()
                    yield row

    source = {
        "kind": "folder",
        "path": str(listing.root.resolve()),
        "files": len(listing.files),
        "bytes": listing.total_bytes,
        "newest_mtime": listing.newest_mtime,
        "skipped_top_level_files": listing.skipped,
        "skipped_non_image_files": listing.skipped_non_images,
    }
    extra: dict[str, Any] = {"source": source, "decoded": decode, "codec": codec}
    if listing.classes is not None:
        extra["classes"] = listing.classes
    else:
        extra["returns"] = "single"  # a flat folder's rows are the data alone
    return write_rows(rows(), out, total=len(listing.files), fields=fields,
                      structure="tuple", default_fields=default, shard_bytes=shard_bytes,
                      overwrite=overwrite, progress=progress, extra=extra)
