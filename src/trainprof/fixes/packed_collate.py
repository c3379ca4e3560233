"""A ``collate_fn`` whose batches cross from a DataLoader worker as a few tensors.

Every tensor of a worker's batch reaches the training process on its own: a
shared-memory segment each, and with torch's ``file_descriptor`` sharing strategy a
round trip to the worker each to fetch its descriptor (see
:mod:`trainprof.capture.handoff`, where it was measured at 0.25-0.73 ms per tensor on
this project's 2-core VM). A batch that is a dict of eight fields pays it eight times.

:class:`PackedCollate` wraps a ``collate_fn`` (torch's ``default_collate`` by
default). In a worker, it hands the batch over as one tensor per dtype holding all
its small tensors (at most ``max_tensor_bytes`` each; larger ones cross as they are,
where one receive is small against their copy), plus a description of the batch's
structure. The training process rebuilds the batch as it was - the same dicts,
lists, tuples and named tuples, the same non-tensor values - with each small tensor a
view into its dtype's packed tensor, so the loop needs no change. In the training
process itself (``num_workers=0``) it returns the batch untouched: nothing crosses.

Packing costs the worker one copy of the small tensors; the rebuilding costs the
training process a view per tensor (microseconds). ``benchmarks/packed_collate.py``
measures it against the plain collate, side by side.

The rebuilt tensors share their packed tensor's memory: writing into one in place is
fine, resizing one (``resize_``) is not. Sparse, quantised and non-CPU tensors, and
those that need a gradient, cross as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data import get_worker_info

#: Tensors up to this size (bytes) are packed; larger ones cross on their own.
MAX_TENSOR_BYTES = 1 << 20

# Structure nodes (what crosses instead of the batch itself).
_LEAF, _PACKED, _DICT, _LIST, _TUPLE, _NAMEDTUPLE = range(6)


class PackedCollate:
    """``collate_fn(samples)``, handed over from a worker as one tensor per dtype.

    ``DataLoader(dataset, ..., num_workers=4, collate_fn=PackedCollate())`` or
    ``PackedCollate(my_collate)``. Picklable (``spawn`` workers) when ``collate_fn`` is.
    """

    def __init__(self, collate_fn: Callable[[list[Any]], Any] | None = None, *,
                 max_tensor_bytes: int = MAX_TENSOR_BYTES) -> None:
        if collate_fn is None:
            from torch.utils.data import default_collate

            collate_fn = default_collate
        self.collate_fn = collate_fn
        self.max_tensor_bytes = int(max_tensor_bytes)

    def __call__(self, samples: list[Any]) -> Any:
        batch = self.collate_fn(samples)
        if get_worker_info() is None:  # the training process: nothing crosses
            return batch
        return _PackedBatch(batch, self.max_tensor_bytes)

    def __repr__(self) -> str:
        return f"PackedCollate({getattr(self.collate_fn, '__name__', self.collate_fn)!r})"


def _packable(t: torch.Tensor, max_bytes: int) -> bool:
    return (t.layout == torch.strided and t.device.type == "cpu" and not t.is_quantized
            and not t.requires_grad and type(t) is torch.Tensor
            and t.numel() * t.element_size() <= max_bytes)


class _PackedBatch:
    """A batch that pickles as ``_unpack(packed, spec)``: the receiver gets the batch back."""

    __slots__ = ("batch", "max_bytes")

    def __init__(self, batch: Any, max_bytes: int) -> None:
        self.batch = batch
        self.max_bytes = max_bytes

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        groups: dict[torch.dtype, list[torch.Tensor]] = {}
        sizes: dict[torch.dtype, int] = {}

        def describe(obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):
                if not _packable(obj, self.max_bytes):
                    return (_LEAF, obj)
                dtype = obj.dtype
                offset = sizes.get(dtype, 0)
                groups.setdefault(dtype, []).append(obj)
                sizes[dtype] = offset + obj.numel()
                return (_PACKED, dtype, offset, tuple(obj.shape))
            if isinstance(obj, Mapping):
                return (_DICT, type(obj), [(k, describe(v)) for k, v in obj.items()])
            if isinstance(obj, tuple) and hasattr(obj, "_fields"):
                return (_NAMEDTUPLE, type(obj), [describe(v) for v in obj])
            if type(obj) is tuple:
                return (_TUPLE, None, [describe(v) for v in obj])
            if type(obj) is list:
                return (_LIST, None, [describe(v) for v in obj])
            return (_LEAF, obj)

        spec = describe(self.batch)
        packed = {}
        for dtype, tensors in groups.items():
            # allocated in shared memory: pickling it then moves nothing
            out = torch.empty(sizes[dtype], dtype=dtype).share_memory_()
            torch.cat([t.reshape(-1) for t in tensors], out=out)
            packed[dtype] = out
        return (_unpack, (packed, spec))


def _unpack(packed: dict[torch.dtype, torch.Tensor], spec: Any) -> Any:
    """The batch again, small tensors as views into ``packed`` (runs in the receiver)."""
    kind = spec[0]
    if kind == _PACKED:
        _, dtype, offset, shape = spec
        n = 1
        for d in shape:
            n *= d
        return packed[dtype][offset:offset + n].view(shape)
    if kind == _LEAF:
        return spec[1]
    _, cls, items = spec
    if kind == _DICT:
        values = {k: _unpack(packed, v) for k, v in items}
        try:
            return values if cls is dict else cls(values)
        except Exception:  # a mapping type that cannot be built from a dict
            return values
    values = [_unpack(packed, v) for v in items]
    if kind == _NAMEDTUPLE:
        return cls(*values)
    return tuple(values) if kind == _TUPLE else values
