"""A short fingerprint of a batch's content, to tell whether two workers loaded the same data.

An ``IterableDataset`` is iterated whole by every DataLoader worker: unless its
``__iter__`` splits the stream by ``torch.utils.data.get_worker_info()``, each of N
workers yields every sample, and an epoch trains on each sample N times (the PyTorch
documentation of ``IterableDataset`` warns of exactly this). Nothing in the loader's
settings shows it; the data does. Each worker fingerprints its first two batches
(:mod:`trainprof.capture.fetch_timing`); workers of one generation whose first batches
are identical, while each one's second batch differs from its first (the data is not
one constant sample), are reading the same stream.

Ranks are compared the same way (:mod:`trainprof.analysis.ranks`): ranks of a
data-parallel model whose first batches are identical train on the same data, as when
the DataLoader has no ``DistributedSampler`` and every rank shuffles with the same seed,
or an ``IterableDataset`` is not split by rank.

The fingerprint hashes the batch's structure (container types, keys, shapes, dtypes) and
up to :data:`MAX_BYTES` of each tensor's or array's data, at most :data:`MAX_LEAVES`
leaves: one BLAKE2b pass, done twice per worker, never per step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

#: Data bytes hashed per tensor / array (the start of its storage, in memory order).
MAX_BYTES = 1 << 16
#: Leaves (tensors, arrays, scalars, strings) hashed per batch.
MAX_LEAVES = 64
_MAX_DEPTH = 8


def batch_digest(batch: Any) -> str | None:
    """Hex digest of ``batch``'s content, or None when it cannot be read (never raises)."""
    h = hashlib.blake2b(digest_size=12)
    budget = [MAX_LEAVES]
    try:
        _feed(h, batch, budget, 0)
    except Exception:  # noqa: BLE001 - a fingerprint must never break the user's loader
        return None
    return h.hexdigest()


def _feed(h: Any, obj: Any, budget: list[int], depth: int) -> None:
    if budget[0] <= 0 or depth > _MAX_DEPTH:
        return
    if isinstance(obj, Mapping):
        h.update(b"{")
        for key, value in obj.items():
            h.update(repr(key).encode())
            _feed(h, value, budget, depth + 1)
        h.update(b"}")
        return
    if isinstance(obj, list | tuple):
        h.update(b"(%d" % len(obj))
        for item in obj:
            _feed(h, item, budget, depth + 1)
            if budget[0] <= 0:
                break
        h.update(b")")
        return
    budget[0] -= 1
    if isinstance(obj, str | bytes | int | float | bool | complex) or obj is None:
        h.update(type(obj).__name__.encode() + b":" + repr(obj).encode())
        return
    data = _array_bytes(obj)
    if data is not None:
        h.update(data)
        return
    h.update(type(obj).__qualname__.encode())  # something else: its type only


def _array_bytes(obj: Any) -> bytes | None:
    """Shape, dtype and the first :data:`MAX_BYTES` of a tensor's or array's data."""
    torch = _torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        t = obj.detach()
        head = f"T{tuple(t.shape)}{t.dtype}".encode()
        if t.device.type != "cpu" or t.is_sparse or t.numel() == 0:
            return head  # (a worker's batch is on the CPU; anything else: its shape)
        flat = t.reshape(-1)
        n = max(1, MAX_BYTES // max(1, t.element_size()))
        part = flat[:n].contiguous()
        return head + part.view(torch.uint8).numpy().tobytes()
    np = _numpy()
    if np is not None and isinstance(obj, np.ndarray):
        flat = obj.reshape(-1)
        n = max(1, MAX_BYTES // max(1, obj.itemsize))
        return f"A{obj.shape}{obj.dtype}".encode() + np.ascontiguousarray(flat[:n]).tobytes()
    return None


def _torch() -> Any:
    import sys

    return sys.modules.get("torch")  # a batch holds tensors only where torch is loaded


def _numpy() -> Any:
    import sys

    return sys.modules.get("numpy")
