"""How much of each batch is padding: token positions the model computes on for nothing.

Text batches are rectangles: every sequence of a batch is padded to one length. When
that length is fixed (a tokenizer called with ``padding="max_length"``, a dataset that
pads every sample to 512), a batch of short sequences makes the model compute on
positions that hold nothing: embedding, every projection and MLP, the attention, the
loss and all of their backward passes run on pad tokens that the attention mask then
hides. Hugging Face's documentation of padding says as much ("dynamic padding": pad
to the longest sequence of the batch, `DataCollatorWithPadding`), and its Trainer's
``group_by_length`` batches sequences of similar length together to cut what is left.
Nothing in the loader's settings shows the waste; the batches do.

:func:`find_padding` reads one batch: among its 2-D integer or boolean tensors of at
least :data:`MIN_LENGTH` positions (token ids, attention masks, labels) it takes the
first that is padded the way token batches are, an edge run per row of one value
(``0`` for a mask; for ids, the value most rows end with) on the right or the left,
with that value (almost) absent inside the rows (at most :data:`INTERIOR_MAX` of their
real positions: a multi-hot or categorical table has zeros everywhere and is not
padding). An ``attention_mask`` of a dict batch is read first, then ``input_ids``.
It returns the positions of the batch, the real ones, and the positions that padding
each batch to its own longest sequence would keep.

:class:`PaddingProbe` runs it in the training process on the first
:data:`BATCHES_PER_LOADER` batches of each DataLoader, after the batch is loaded (the
``_next_data`` of both of torch's iterators), and removes itself after
:data:`BATCHES_SEEN` batches: padding is a property of the tokenization, the same all
run long. Measured on this project's VM (median of 5 rounds of 2,000 reads, an idle
process): a dict batch of 32 x 128 (its attention mask read) 50 µs, 32 x 128 token ids
64 µs, 64 x 512 84 µs, an ``(x, y)`` batch of floats and labels (nothing to read) 3 µs;
NumPy reads the tensors' memory in place. Inside a training run the same reads took
about 250 µs each (64 reads, 15-18 ms: the model's intra-op threads, spinning between
ops, hold the cores), so only the first 16 batches of a loader are read: a few
milliseconds once, in the data wait of a run's first steps (most of them warm-up), and
nothing per step after them.

The same reads keep what the input pipeline's fix needs to know of a loader's samples:
:func:`describe_tensors` lists the first batch's tensors (where, dtype, shape; a few
microseconds, no data read), so that a fix for images (uint8 crops, a normalisation per
batch) is given only where the batches hold images.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Any

from trainprof.schema import MAX_DESCRIBED

#: Fewer positions than this per row: not a padded sequence worth reading.
MIN_LENGTH = 16
#: Tensors with more elements are not read (their reading would cost milliseconds).
MAX_ELEMENTS = 1 << 22
#: A padding value found inside the rows' real parts at more than this share of them
#: means the tensor is not padded sequences (a multi-hot or categorical table).
INTERIOR_MAX = 0.05
#: Batches read per DataLoader (16 batches of 8 rows are 128 sequences: enough to tell
#: the padding's share to a few points, and cheap: see the module docstring).
BATCHES_PER_LOADER = 16
#: After this many batches (all loaders) the probe removes itself: the training loader's
#: first batches and an evaluation loader's, when it comes early; a one-off cost (the
#: overhead benchmark's start-up figure), nothing per step after it.
BATCHES_SEEN = 4 * BATCHES_PER_LOADER
#: Dict keys read first, in this order (Hugging Face's names).
PREFERRED_KEYS = ("attention_mask", "input_ids")
_MAX_DEPTH = 4


@dataclass(frozen=True)
class Padding:
    """One batch's padding, as read from one of its tensors."""

    path: str  # where the tensor is: "batch['input_ids']", "batch[0]", "batch"
    side: str  # "right" or "left"
    pad_value: int
    rows: int
    length: int  # positions per row (the padded length)
    real: int  # real positions, all rows
    longest: int  # the longest row's real positions

    @property
    def positions(self) -> int:
        return self.rows * self.length

    @property
    def trimmable(self) -> int:
        """Columns that are padding in every row (what trimming the batch removes)."""
        return self.length - self.longest


def candidates(batch: Any, path: str = "batch", depth: int = 0) -> Iterator[tuple[str, Any]]:
    """2-D tensors of a batch that could be padded sequences, preferred ones first."""
    import torch

    if depth > _MAX_DEPTH:
        return
    if isinstance(batch, torch.Tensor):
        if (batch.dim() == 2 and batch.shape[1] >= MIN_LENGTH and batch.shape[0] >= 1
                and batch.numel() <= MAX_ELEMENTS and batch.layout == torch.strided
                and batch.device.type == "cpu"  # reading a device tensor would sync
                and (batch.dtype == torch.bool or not batch.dtype.is_floating_point)
                and not batch.dtype.is_complex):
            yield path, batch
        return
    if isinstance(batch, Mapping):
        keys = list(batch.keys())
        keys.sort(key=lambda k: PREFERRED_KEYS.index(k) if k in PREFERRED_KEYS
                  else len(PREFERRED_KEYS))
        for k in keys:
            yield from candidates(batch[k], f"{path}[{k!r}]", depth + 1)
    elif isinstance(batch, list | tuple):
        for i, v in enumerate(batch[:16]):
            yield from candidates(v, f"{path}[{i}]", depth + 1)


def measure(x: Any, path: str, pad_value: int, side: str,
            interior_max: float | None = INTERIOR_MAX) -> Padding | None:
    """``x``'s padding by ``pad_value`` on ``side``: per row, the run of it from that edge.

    None when every position is padding, or when the value is found inside the rows'
    real parts at more than ``interior_max`` of them; no padding at all when no row
    has more than one of it at its edge (rows that all end with one end-of-sequence
    token). ``interior_max=None`` (a value the caller knows is padding) checks neither.
    ``x`` is a CPU tensor or a NumPy array (read as an array: NumPy's small-array
    operations cost a fraction of torch's dispatch).
    """
    import numpy as np

    a = _array(x)
    rows, length = int(a.shape[0]), int(a.shape[1])
    real_pos = a if a.dtype == np.bool_ and pad_value == 0 else a != pad_value
    # a row's real length: up to its last real position (right padding), or from its
    # first one (left): the highest weight of a real position, weights counted from the
    # far edge (one multiply and a max per row, no scan)
    weights = (np.arange(1, length + 1, dtype=np.int32) if side == "right"
               else np.arange(length, 0, -1, dtype=np.int32))
    lengths = (real_pos * weights).max(1)
    real = int(lengths.sum())
    if real <= 0:  # nothing but padding: not sequences
        return None
    if interior_max is not None:
        if real - int(real_pos.sum()) > interior_max * real:
            return None
        if length - int(lengths.min()) < 2:
            # no row has more than one of the value at its edge: every row ending with
            # the same token (an end-of-sequence mark) is not padding
            return Padding(path=path, side=side, pad_value=int(pad_value), rows=rows,
                           length=length, real=rows * length, longest=length)
    longest = int(lengths.max())
    return Padding(path=path, side=side, pad_value=int(pad_value), rows=rows, length=length,
                   real=real, longest=longest)


def _array(x: Any) -> Any:
    """A CPU tensor's data as a NumPy array, without a copy."""
    import numpy as np

    return x if isinstance(x, np.ndarray) else x.detach().numpy()


def _read(x: Any, path: str) -> Padding | None:
    """``x``'s padding, or None when it is not padded sequences.

    The side is the edge where the padding value fills more rows: the value ``0`` of a
    mask (boolean, or integers that are all 0 or 1), else the most frequent value of
    each edge column.
    """
    import numpy as np

    a = _array(x)
    mask_like = a.dtype == np.bool_ or (int(a.min()) >= 0 and int(a.max()) <= 1)
    best: tuple[int, int, str] | None = None  # (rows padded at the edge, value, side)
    for side, edge in (("right", a[:, -1]), ("left", a[:, 0])):
        if mask_like:
            pad, count = 0, int((edge == 0).sum())
        else:
            values, counts = np.unique(edge, return_counts=True)
            top = int(counts.argmax())
            pad, count = int(values[top]), int(counts[top])
        if best is None or count > best[0]:
            best = (count, pad, side)
    assert best is not None
    return measure(a, path, best[1], best[2])


def find_padding(batch: Any) -> Padding | None:
    """The padding of ``batch``: read from its first tensor that is padded sequences.

    None when no tensor of the batch looks like token sequences (images, tabular
    features, sequences of another shape). A batch without padding gives a
    :class:`Padding` with ``real == positions``. Never raises.
    """
    try:
        for path, x in candidates(batch):
            found = _read(x, path)
            if found is not None:
                return found
    except Exception:
        return None
    return None




def describe_tensors(batch: Any) -> list[dict[str, Any]]:
    """The first :data:`MAX_DESCRIBED` tensors and arrays of ``batch``: where each is, its
    dtype (torch's name, ``"uint8"``) and shape (NumPy arrays marked ``array``). Never
    raises; reads no data."""
    import numpy as np
    import torch

    out: list[dict[str, Any]] = []

    def walk(x: Any, path: str, depth: int) -> None:
        if len(out) >= MAX_DESCRIBED or depth > _MAX_DEPTH:
            return
        if isinstance(x, torch.Tensor | np.ndarray):
            dtype = str(x.dtype).removeprefix("torch.")
            out.append({"path": path, "dtype": dtype, "shape": [int(n) for n in x.shape]})
            if isinstance(x, np.ndarray):  # pickled whole from a worker, not shared memory
                out[-1]["array"] = True
        elif isinstance(x, Mapping):
            for k in list(x.keys())[:16]:
                walk(x[k], f"{path}[{k!r}]", depth + 1)
        elif isinstance(x, list | tuple):
            for i, v in enumerate(x[:16]):
                walk(v, f"{path}[{i}]", depth + 1)

    try:
        walk(batch, "batch", 0)
    except Exception:
        return out
    return out


class LoaderPadding:
    """The padding read from one DataLoader's batches, summed."""

    def __init__(self) -> None:
        self.batches = 0  # batches read
        self.padded_batches = 0  # of them, batches with a padded-sequence tensor
        self.rows = 0
        self.positions = 0
        self.real = 0
        self.dynamic = 0  # positions left if each batch were padded to its longest row
        self.lengths: set[int] = set()
        self.paths: dict[str, int] = {}
        self.sides: dict[str, int] = {}
        self.pad_values: dict[int, int] = {}
        self.tensors: list[dict[str, Any]] | None = None  # the first batch's (describe_tensors)

    def add(self, p: Padding | None) -> None:
        self.batches += 1
        if p is None:
            return
        self.padded_batches += 1
        self.rows += p.rows
        self.positions += p.positions
        self.real += p.real
        self.dynamic += p.rows * p.longest
        self.lengths.add(p.length)
        self.paths[p.path] = self.paths.get(p.path, 0) + 1
        self.sides[p.side] = self.sides.get(p.side, 0) + 1
        self.pad_values[p.pad_value] = self.pad_values.get(p.pad_value, 0) + 1

    def record(self, index: int) -> dict[str, Any]:
        def most(d: dict[Any, int]) -> Any:
            return max(d, key=lambda k: d[k]) if d else None

        return {
            "loader_index": index, "batches": self.batches,
            "padded_batches": self.padded_batches, "rows": self.rows,
            "positions": self.positions, "real": self.real, "dynamic": self.dynamic,
            "length_min": min(self.lengths) if self.lengths else None,
            "length_max": max(self.lengths) if self.lengths else None,
            "tensor": most(self.paths), "side": most(self.sides),
            "pad_value": most(self.pad_values),
            "batch_tensors": self.tensors,
        }


class PaddingProbe:
    """Reads the padding of the first batches of every DataLoader (see the module doc).

    ``index_of_iterator(it)`` names the loader an iterator belongs to (None: unknown,
    not read). Batches loaded in another thread (a prefetching thread) are read too:
    they are the same batches; a lock keeps the counts whole.
    """

    def __init__(self, index_of_iterator: Callable[[Any], int | None]) -> None:
        self._index_of = index_of_iterator
        self.loaders: dict[int, LoaderPadding] = {}
        self.seen = 0
        self.ns = 0
        self._lock = threading.Lock()
        self._installed: list[tuple[type, Any, Any]] = []  # (class, original, wrapper)

    def install(self, patch: Callable[[Any, str, Callable[[Any], Any]], None]) -> None:
        """Wrap both iterators' ``_next_data`` through ``patch`` (which restores at the end)."""
        from torch.utils.data.dataloader import (
            _MultiProcessingDataLoaderIter,
            _SingleProcessDataLoaderIter,
        )

        for cls in (_SingleProcessDataLoaderIter, _MultiProcessingDataLoaderIter):
            if "_next_data" in cls.__dict__:
                patch(cls, "_next_data", lambda orig, cls=cls: self._wrap(cls, orig))

    def _wrap(self, cls: type, orig: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def _next_data(it: Any) -> Any:
            batch = orig(it)
            self._look(it, batch)
            return batch

        self._installed.append((cls, orig, _next_data))
        return _next_data

    def _look(self, it: Any, batch: Any) -> None:
        t0 = perf_counter_ns()
        with self._lock:
            self.seen += 1
            if self.seen >= BATCHES_SEEN:
                self._remove()
            index = self._index_of(it)
            if index is None:
                return
            entry = self.loaders.get(index)
            if entry is None:
                entry = self.loaders[index] = LoaderPadding()
            if entry.batches >= BATCHES_PER_LOADER:
                return
            if entry.tensors is None:
                entry.tensors = describe_tensors(batch)
            entry.add(find_padding(batch))
            self.ns += perf_counter_ns() - t0

    def _remove(self) -> None:
        """Put the originals back where the wrappers still are (a knob may have wrapped them)."""
        for cls, orig, wrapper in self._installed:
            if cls.__dict__.get("_next_data") is wrapper:
                cls._next_data = orig  # type: ignore[attr-defined]
        self._installed.clear()

    def record(self) -> dict[str, Any] | None:
        """run.json's ``padding``: per loader read, what its batches held; None if none."""
        with self._lock:
            loaders = [e.record(i) for i, e in sorted(self.loaders.items()) if e.batches]
        if not loaders:
            return None
        return {"loaders": loaders, "read_s": self.ns / 1e9,
                "batches_per_loader": BATCHES_PER_LOADER}
