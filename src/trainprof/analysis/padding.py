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
            "batches": int(ld.get("padded_batches") or 0),
            "length_min": ld.get("length_min"),
            "length_max": ld.get("length_max"),
            "fixed_length": ld.get("length_min") == ld.get("length_max"),
            "pad_share": 1.0 - real / positions,
            "trim_share": 1.0 - dynamic / positions,
            "mean_real": real / rows if rows else None,
            "mean_longest": dynamic / rows if rows else None,
        })
    return out or None
