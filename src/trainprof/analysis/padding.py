"""The padding of each DataLoader's batches, summarised: the share of positions that hold nothing.

From run.json's ``padding`` (:mod:`trainprof.capture.padding`: the first batches of
each loader, read in the training process). Per loader:

* ``pad_share``: padding positions over all positions of the batches read,
  ``1 - real / positions``: what the model computes on for nothing, and what
  batching sequences of similar length (or packing them) can remove at most;
* ``trim_share``: the positions that padding each batch only to its own longest
  sequence removes, ``1 - dynamic / positions``, with ``dynamic`` the sum over
  batches of rows x longest row: what :class:`trainprof.fixes.TrimPadding` (or
  Hugging Face's dynamic padding) removes;
* ``fixed_length``: every batch read had the same padded length (the padding is to a
  fixed length, not to each batch's longest).
"""

from __future__ import annotations

from typing import Any


def summarize_padding(rec: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """``padding`` of the summary: one entry per loader whose batches held sequences."""
    if not rec:
        return None
    out = []
    for ld in rec.get("loaders") or []:
        positions = int(ld.get("positions") or 0)
        if positions <= 0:
            continue
        rows = int(ld.get("rows") or 0)
        real, dynamic = int(ld.get("real") or 0), int(ld.get("dynamic") or 0)
        out.append({
            "loader_index": ld.get("loader_index"),
            "tensor": ld.get("tensor"),
            "side": ld.get("side"),
            "pad_value": ld.get("pad_value"),
            # batches with a padded-sequence tensor, of the batches read
            "batches": int(ld.get("padded_batches") or 0),
            "batches_read": int(ld.get("batches") or 0),
            "length_min": ld.get("length_min"),
            "length_max": ld.get("length_max"),
            "fixed_length": ld.get("length_min") == ld.get("length_max"),
            "pad_share": 1.0 - real / positions,
            "trim_share": 1.0 - dynamic / positions,
            "mean_real": real / rows if rows else None,
            "mean_longest": dynamic / rows if rows else None,
        })
    return out or None


def batch_tensors(rec: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """``batch_tensors`` of the summary: per loader read, its first batch's tensors (where,
    dtype, shape: :func:`trainprof.capture.padding.describe_tensors`), whatever they hold."""
    out = [{"loader_index": ld.get("loader_index"), "tensors": ld["batch_tensors"]}
           for ld in (rec or {}).get("loaders") or []
           if isinstance(ld, dict) and isinstance(ld.get("batch_tensors"), list)]
    return out or None


#: torchvision's datasets hold images (and videos): their module's prefix.
_IMAGE_DATASET_MODULES = ("torchvision.datasets.",)
#: In the workers' sampled functions, files of image decoding and transforms.
_IMAGE_CODE = ("PIL/", "PIL\\", "torchvision/transforms", "torchvision\\transforms",
               "torchvision/io", "cv2")
#: Channel counts of an image tensor (grey, RGB, RGBA).
_CHANNELS = (1, 3, 4)
#: The smallest side of an image (MNIST's is 28; 8 keeps tiny test images).
_MIN_SIDE = 8


def image_tensor(t: dict[str, Any]) -> bool:
    """A described tensor that is a batch of images: uint8 ``N,H,W`` or ``N,C,H,W`` /
    ``N,H,W,C`` (decoded pixels), or a floating ``N,C,H,W`` / ``N,H,W,C`` with 1, 3 or 4
    channels and sides of at least :data:`_MIN_SIDE` (after ``ToTensor``)."""
    shape = [int(n) for n in t.get("shape") or []]
    dtype = str(t.get("dtype") or "")
    if dtype == "uint8" and len(shape) in (3, 4):
        return sorted(shape[1:])[-2] >= _MIN_SIDE  # the shorter side (H, W)
    if dtype.startswith(("float", "bfloat")) and len(shape) == 4:
        return ((shape[1] in _CHANNELS and min(shape[2:]) >= _MIN_SIDE)
                or (shape[3] in _CHANNELS and min(shape[1:3]) >= _MIN_SIDE))
    return False


def holds_images(loader: dict[str, Any] | None, tensors: list[dict[str, Any]] | None,
                 functions: list[str] | None = None) -> bool | None:
    """Whether ``loader``'s samples are images: True when its dataset is torchvision's, its
    workers were sampled in image code (PIL, torchvision's transforms) or its first batch
    holds an image tensor (:func:`image_tensor`); False when that batch was described and
    holds none; None when nothing is known."""
    dataset = str((loader or {}).get("dataset") or "")
    if dataset.startswith(_IMAGE_DATASET_MODULES):
        return True
    if any(code in f for f in functions or [] for code in _IMAGE_CODE):
        return True
    if tensors:
        return any(image_tensor(t) for t in tensors)
    return None
