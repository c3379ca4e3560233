"""Timing the hand-over of DataLoader workers' batches in the training process.

A worker's batch reaches the training process as a pickle whose tensors keep their
data in shared memory: the worker's ``collate_fn`` writes each tensor into a
shared-memory segment of its own, and unpickling maps each segment in the training
process (``torch.multiprocessing.reductions``, torch 2.13):

* with the ``file_descriptor`` sharing strategy (Linux's default), each storage is
  rebuilt by ``rebuild_storage_fd``, whose ``DupFd.detach()`` opens a connection to a
  thread in the worker (``multiprocessing.resource_sharer``) and receives the
  segment's file descriptor over it: **one round trip to the worker per tensor**.
  That thread needs the worker's GIL; while the worker's main thread runs Python (a
  dataset that builds its samples in Python) it gets it only at the next switch
  interval (``sys.getswitchinterval()``, 5 ms);
* with ``file_system``, ``rebuild_storage_filename`` opens the segment by name:
  no round trip.

Measured on this project's 2-core VM (``rebuild_storage_fd`` timed in the training
process): 0.42 ms per tensor (median) from 2 workers reading in-memory tensors; 0.73
ms median and 1.9 ms mean from a worker building samples in pure Python, whose
batches' hand-over so took 0.71 s of a 2.1 s run. With ``file_system`` the same
batches took 0.12 and 0.06 ms per tensor (median). Every tensor of a batch pays it:
a batch of a dict of 10 tensors pays it 10 times (rf-detr measured 114 objects a
batch and 1.25-1.67x loader throughput from packing them into 9, pytorch/rf-detr
PR 1399).

So the training process times both functions (a wrapper that keeps their module and
name, which is how a pickle names them: workers started by ``fork`` inherit the
wrapper and pickle it by that name, ``spawn`` workers the original, and both resolve
to the wrapper here). Per tensor: two clock reads and a histogram increment, 0.99 µs
(median of 7 rounds of 200k calls against the bare function, this VM) against
hundreds. Where the unpickling runs (the training thread, or the pin-memory thread with
``pin_memory=True``) is recorded too: only the training
thread's share is time the loop itself spends.

Each storage is also counted against the loader whose batch it came in (``loaders`` in
the record): an evaluation loader iterated inside the training loop (a validation pass
every N steps) has its own workers, dataset and hand-over cost, and pooled with the
training loader's it was misread as the training loader's (2.75 ms a tensor pooled
against 0.57 ms for the training loader alone, in an explorer's script). The loader is
found from the frames calling the rebuild, a few levels up: the iterator's own
``_try_get_data`` (``self``), or the pin-memory thread's ``_pin_memory_loop``
(``in_queue``, the iterator's ``_worker_result_queue``); a few µs a tensor against the
hundreds the receive costs.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any

from trainprof.capture.fetch_timing import N_BINS, bin_index, sparse_hist

#: The rebuild functions timed, by the sharing strategy that uses each.
REBUILDERS = {"rebuild_storage_fd": "file_descriptor",
              "rebuild_storage_filename": "file_system"}

#: How many frames above the rebuild to look for the iterator (rebuild, Queue.get,
#: _try_get_data: 3 in torch 2.13; the pin-memory thread's do_one_step, _pin_memory_loop)
_MAX_DEPTH = 10


def calling_iterator(depth: int = 1) -> tuple[str, Any] | None:
    """What the frames above say of the iterator receiving this batch: ``("iterator", it)``
    from its ``_try_get_data``, ``("queue", q)`` from the pin-memory thread's loop (the
    iterator's ``_worker_result_queue``); None when neither is found."""
    frame = sys._getframe(depth + 1)
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return None
        name = frame.f_code.co_name
        if name == "_try_get_data":
            it = frame.f_locals.get("self")
            return ("iterator", it) if it is not None else None
        if name in ("do_one_step", "_pin_memory_loop"):
            q = frame.f_locals.get("in_queue")
            return ("queue", q) if q is not None else None
        frame = frame.f_back
    return None


class HandoffTimer:
    """Counts and times the shared-memory storages the training process receives."""

    def __init__(self, owner: Callable[[], int | None],
                 loader_of: Callable[[tuple[str, Any]], int | None] | None = None) -> None:
        #: the training thread's ident (the clock's owner), read at each call
        self._owner = owner
        #: the loader index of what :func:`calling_iterator` found (None: unknown)
        self._loader_of = loader_of
        #: per loader index: [tensors, ns, tensors in the training thread, ns there, hist]
        self.by_loader: dict[int, list[Any]] = {}
        self.tensors = 0
        self.ns = 0
        self.tensors_training_thread = 0
        self.ns_training_thread = 0
        self.hist = [0] * N_BINS
        self.strategies: set[str] = set()

    def wrap(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        """``orig`` timed, under its own module and name (see the module docstring)."""
        strategy = REBUILDERS.get(getattr(orig, "__name__", ""), "other")
        get_ident = threading.get_ident
        owner = self._owner
        hist = self.hist

        def rebuild(*args: Any, **kwargs: Any) -> Any:
            t0 = perf_counter_ns()
            try:
                return orig(*args, **kwargs)
            finally:
                dt = perf_counter_ns() - t0
                self.tensors += 1
                self.ns += dt
                hist[bin_index(dt)] += 1
                training = get_ident() == owner()
                if training:
                    self.tensors_training_thread += 1
                    self.ns_training_thread += dt
                self.strategies.add(strategy)
                self._count_for_loader(dt, training)

        for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
            setattr(rebuild, attr, getattr(orig, attr, None))
        rebuild.__wrapped__ = orig  # type: ignore[attr-defined]
        return rebuild

    def _count_for_loader(self, dt: int, training: bool) -> None:
        """Count one storage against the loader whose batch it came in, where found."""
        if self._loader_of is None:
            return
        try:
            found = calling_iterator(2)
            index = self._loader_of(found) if found is not None else None
        except Exception:  # never let the attribution break the receive
            return
        if index is None:
            return
        row = self.by_loader.get(index)
        if row is None:
            row = self.by_loader[index] = [0, 0, 0, 0, [0] * N_BINS]
        row[0] += 1
        row[1] += dt
        if training:
            row[2] += 1
            row[3] += dt
        row[4][bin_index(dt)] += 1

    def record(self) -> dict[str, Any] | None:
        """run.json's ``batch_handoff``; None while no storage was received."""
        if not self.tensors:
            return None
        return {
            "strategies": sorted(self.strategies),
            "tensors": self.tensors,
            "total_s": self.ns / 1e9,
            "training_thread": {"tensors": self.tensors_training_thread,
                                "total_s": self.ns_training_thread / 1e9},
            "hist": sparse_hist(self.hist),
            # the same, per loader whose batches they came in (where found)
            "loaders": [
                {"loader_index": index, "tensors": row[0], "total_s": row[1] / 1e9,
                 "training_thread": {"tensors": row[2], "total_s": row[3] / 1e9},
                 "hist": sparse_hist(row[4])}
                for index, row in sorted(self.by_loader.items())
            ],
        }
