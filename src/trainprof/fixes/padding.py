"""A ``collate_fn`` that pads each batch only as far as its longest sequence.

A dataset that pads every sample to one fixed length (a tokenizer called with
``padding="max_length"``) makes every batch as long as the longest possible
sequence: the model computes on the padding of its shortest batches as on real
tokens (:mod:`trainprof.capture.padding` measures how much). Padding each batch to
its own longest sequence ("dynamic padding", Hugging Face's
``DataCollatorWithPadding`` or ``tokenizer(..., padding="longest")``) removes the
columns that are padding in every row; sequences that are batched by similar length
(``group_by_length``) leave even fewer.

:class:`TrimPadding` does the first without touching the dataset: it wraps a
``collate_fn`` (``default_collate`` by default), finds the batch's padded tensor the
way the probe does (:func:`trainprof.capture.padding.find_padding`, or the
``pad_value`` and ``side`` given) and cuts the columns that are padding in every
row from every tensor of the batch that has its shape: ``(rows, length)`` (ids,
attention mask, labels, token types) and ``(rows, length, length)`` (a 2-D attention
mask). The real tokens, their order and their positions (right padding) are
unchanged; with left padding the rows' real tokens move left by the columns cut,
which models that derive positions from the attention mask (Hugging Face's decoders)
do not notice.

A model that needs one fixed length (a learned position table sized to it and
indexed by ``arange(length)`` is fine; a ``view(batch, 512, ...)`` is not) fails on
the shorter batches: measure first, ``trainprof tune --knob trim_padding=false,true``
applies the same cut to every batch of a run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from trainprof.capture.padding import Padding, candidates, find_padding, measure


def trim_padding(batch: Any, *, pad_value: int | None = None, side: str | None = None,
                 min_length: int = 1, multiple_of: int = 1) -> Any:
    """``batch`` with the columns that are padding in every row cut from its sequence tensors.

    The padded tensor and its padding are found by :func:`find_padding` unless
    ``pad_value`` (and ``side``: ``"right"``, the default, or ``"left"``) are given, in
    which case the first 2-D integer or boolean tensor is the one read. At least
    ``min_length`` columns are kept, and a multiple of ``multiple_of`` (up to the padded
    length): few distinct lengths for ``torch.compile`` or CUDA graphs, which compile
    again for each new one, and lengths that suit tensor cores (8 for 16-bit math, as
    Hugging Face's ``pad_to_multiple_of`` advises). A batch with nothing to cut is
    returned as it is.
    """
    return trimmed(batch, pad_value=pad_value, side=side, min_length=min_length,
                   multiple_of=multiple_of)[0]


def trimmed(batch: Any, *, pad_value: int | None = None, side: str | None = None,
            min_length: int = 1, multiple_of: int = 1) -> tuple[Any, Padding | None, int]:
    """:func:`trim_padding`, with the padding found (None: none) and the columns kept."""
    if multiple_of < 1:
        raise ValueError(f"multiple_of must be at least 1, not {multiple_of}")
    found = find_padding(batch) if pad_value is None else _given(batch, pad_value, side)
    if found is None:
        return batch, None, 0
    keep = max(found.longest, min(min_length, found.length))
    keep = min(found.length, -(-keep // multiple_of) * multiple_of)
    if keep >= found.length:
        return batch, found, found.length
    return _cut(batch, found.rows, found.length, keep, found.side == "left"), found, keep


def _given(batch: Any, pad_value: int, side: str | None) -> Padding | None:
    """The batch's padding with its value and side given: its first candidate tensor's."""
    if side not in (None, "right", "left"):
        raise ValueError(f"side must be 'right' or 'left', not {side!r}")
    for path, x in candidates(batch):
        return measure(x, path, pad_value, side or "right", interior_max=None)
    return None


def _cut(obj: Any, rows: int, length: int, keep: int, left: bool) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        cut = slice(length - keep, None) if left else slice(0, keep)
        if obj.dim() == 2 and tuple(obj.shape) == (rows, length):
            return obj[:, cut]
        if obj.dim() == 3 and tuple(obj.shape) == (rows, length, length):
            return obj[:, cut, cut]
        return obj
    if isinstance(obj, Mapping):
        items = {k: _cut(v, rows, length, keep, left) for k, v in obj.items()}
        try:
            return type(obj)(items)  # a dict subclass, Hugging Face's BatchEncoding
        except Exception:
            return items
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(_cut(v, rows, length, keep, left) for v in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(_cut(v, rows, length, keep, left) for v in obj)
    return obj


class TrimPadding:
    """``collate_fn(samples)``, with the columns that are padding in every row cut.

    ``DataLoader(dataset, ..., collate_fn=TrimPadding())``, or
    ``TrimPadding(my_collate, pad_value=tokenizer.pad_token_id, multiple_of=8)``
    (see :func:`trim_padding` for the arguments). Picklable (workers
    started by ``spawn``) when ``collate_fn`` is.
    """

    def __init__(self, collate_fn: Callable[[list[Any]], Any] | None = None, *,
                 pad_value: int | None = None, side: str | None = None,
                 min_length: int = 1, multiple_of: int = 1) -> None:
        if collate_fn is None:
            from torch.utils.data import default_collate

            collate_fn = default_collate
        if side not in (None, "right", "left"):
            raise ValueError(f"side must be 'right' or 'left', not {side!r}")
        if multiple_of < 1:
            raise ValueError(f"multiple_of must be at least 1, not {multiple_of}")
        self.collate_fn = collate_fn
        self.multiple_of = multiple_of
        self.pad_value = pad_value
        self.side = side
        self.min_length = min_length

    def __call__(self, samples: list[Any]) -> Any:
        return trim_padding(self.collate_fn(samples), pad_value=self.pad_value,
                            side=self.side, min_length=self.min_length,
                            multiple_of=self.multiple_of)

    def __repr__(self) -> str:
        return f"TrimPadding({getattr(self.collate_fn, '__name__', self.collate_fn)!r})"
