"""Timing the loading of samples and batches: timed copies of torch's fetchers.

What a loading thread - a DataLoader worker, or the training process itself with
``num_workers=0`` - spends on each batch (see :mod:`trainprof.capture.worker` for how
these fetchers get there):

* per sample, the time in the dataset's ``__getitem__`` (``__getitems__`` for a
  whole batch; ``next()`` of the dataset iterator for an ``IterableDataset``),
  split into **CPU time** (decode, transforms: ``time.thread_time_ns`` of the
  loading thread) and **blocked time** (wall - CPU, ``time.perf_counter_ns``:
  reads, sleeps, the network, and waiting for a core);
* per batch, the time in ``collate_fn``, and, where Linux exposes it
  (``/proc/thread-self/schedstat``, field 2), the time the loading thread was
  runnable but waiting for a core, so that a CPU shortage is not taken for slow reads;
* per worker, batches and samples produced, the busy share (time in ``fetch`` /
  wall time since the worker started) and its start-up (DataLoader asks for
  workers → worker running → first batch ready), per *generation* of workers:
  without ``persistent_workers`` every epoch starts a new one.

In the training process (``num_workers=0``) the fetcher classes stay torch's: an
:class:`ArmedFetcher` takes the place of a single-process iterator's own fetcher
(``_dataset_fetcher``), times one batch and puts the real one back; the
Recorder's flush thread arms it again five times a second
(:meth:`WorkerCapture.rearm`). An untimed batch so runs torch's code and nothing
else - a wrapper that only counted cost about 1 µs a batch in context, 0.1-0.3% of
a 1 ms step - and the batches are counted from the iterators' own
``_num_yielded``. While samples are expensive (see below) the fetcher stays armed
and times every batch, sample by sample, as in a worker.

Cost: per sample, two clock reads (``thread_time_ns`` is a system call: 0.6 µs on
an idle machine here, 1.3 µs under load) and two histogram increments, about 1-2 µs.
That is kept near 1% of the loading time or less by timing samples one by one only while
they take at least :data:`PER_SAMPLE_MIN_NS` (200 µs) on average, less any wait for a
core where it is measured (a worker); cheaper samples
(in-memory tensors) are timed per batch, each getting the batch's mean, and only one
batch in :data:`TIME_EVERY` is timed at all (in the training process: about
:data:`~trainprof.capture.worker.MAIN_REARM_HZ` a second, see above), while an
untimed one only counts its batch and samples. A timed batch costs three
``thread_time_ns``, three ``perf_counter_ns`` and, in a worker, two ``pread`` of the
schedstat file. System calls cost far more inside a training loop than in a tight
loop that measures them (cold caches: a schedstat ``pread`` took 5.8 µs, p90 17 µs, in
the 0.4 ms loop of ``benchmarks/overhead.py --hidden 16`` against 1.4 µs alone), so
timing every batch there cost 30 µs a batch; and the training process does not read
its run-queue wait per batch at all (``runq_measured`` is false for it: its waits for a
core are counted as blocked time).
The sums of a stream (``fetch_ns``, ``get_ns``, ...) then cover its ``timed_batches``,
and the analysis scales them to all ``batches``: a ratio estimate over a systematic
sample, exact for the means of a steady pipeline, and following a change of pace
within eight batches (a fifth of a second in the training process; a batch whose
samples turn expensive switches timing back to every sample, every batch). In the
training process ``samples`` is estimated the same way (batches times the timed
batches' mean size): only the timed batches are seen.

In the training process, batches loaded while a heavy tool is on (``--py``'s cProfile,
``--lines``' line profiler, ``--deep``, the op count: steps flagged ``FLAG_PROFILED``)
are not timed: the tool's cost is in them (``--lines`` over ``__getitem__`` made a
0.33 ms sample 0.74 ms, ``--py`` 0.31 ms 0.50 ms, and the input findings quoted those),
and the step statistics leave those steps out too. The Recorder points
:data:`MAIN_CLOCK` at its step clock; a worker process has its own streams, whose
``rearm`` is false, and never reads it.

The counters of one loading thread (a worker, or the training process) are a
:class:`Stream`; :mod:`trainprof.capture.worker` gets these fetchers into the workers
and writes the streams to the run folder.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from trainprof.capture.batch_digest import batch_digest

#: Histogram bins: exact below 32 ns, then 16 per power of two, up to 2**63 ns.
N_BINS = 960
#: Samples are timed one by one while the previous batch's took at least this long each.
PER_SAMPLE_MIN_NS = 200_000
#: Cheap batches (timed per batch, not per sample) are timed one in this many...
TIME_EVERY = 8

# Counter slots of Stream.acc.
BATCHES, SAMPLES, FETCH_NS, GET_NS, GET_CPU_NS, COLLATE_NS, COLLATE_CPU_NS, RUNQ_NS = range(8)
FIRST_FETCH_NS, FIRST_BATCH_NS, LAST_FETCH_END_NS, SAMPLES_TIMED = range(8, 12)
TIMED_BATCHES = 12
ACC_NAMES = (
    "batches", "samples", "fetch_ns", "get_ns", "get_cpu_ns", "collate_ns", "collate_cpu_ns",
    "runq_ns", "first_fetch_ns", "first_batch_ns", "last_fetch_end_ns", "samples_timed",
    "timed_batches",
)

_perf = time.perf_counter_ns
_tt = time.thread_time_ns

#: The training process's step clock (set by the Recorder; None elsewhere): its
#: ``extra_flags`` are non-zero while a heavy tool is on (see the module docstring).
MAIN_CLOCK: list[Any] = [None]


def _under_tool(st: Stream) -> bool:
    """A training-process batch (``st.rearm``: the caller tests it first, so that a worker's
    batch pays no call) loaded while a heavy tool is on: left untimed."""
    clock = MAIN_CLOCK[0]
    return clock is not None and bool(clock.extra_flags)


def bin_index(v: int) -> int:
    """Histogram bin of a non-negative duration in ns: exact below 32, then 16 per power of 2."""
    k = v.bit_length()
    return v if k <= 5 else ((k - 5) << 4) + (v >> (k - 5))


def sparse_hist(hist: list[int]) -> list[list[int]]:
    """A histogram as its non-empty [bin, count] pairs (what the run folder stores)."""
    return [[i, c] for i, c in enumerate(hist) if c]


class Stream:
    """Counters of one loader in one process: what a worker (or the training process) fetched.

    Updated by the loading thread only; the writer thread reads copies (``list(...)``
    of a list is one C call under the GIL, so each copy is consistent in itself; the
    counters and the histograms of one snapshot may be a batch apart).
    """

    __slots__ = ("acc", "h_blocked", "h_cpu", "h_collate", "info", "in_fetch", "off",
                 "per_sample", "skip", "time_every", "_fd", "_ident", "version", "rearm",
                 "yielded", "yielded_samples", "digesting", "digests")

    def __init__(self, info: dict[str, Any]) -> None:
        self.acc = [0] * len(ACC_NAMES)
        self.h_blocked = [0] * N_BINS
        self.h_cpu = [0] * N_BINS
        self.h_collate = [0] * N_BINS
        self.info = info
        self.in_fetch = False
        self.off = False  # set when the capture itself failed: fetch runs untimed
        self.per_sample = True  # time samples one by one (else per batch; see the docstring)
        self.skip = 0  # untimed batches left before the next timed one (per-batch timing)
        self.time_every = TIME_EVERY  # 1 where stacks are sampled: they are taken in fetch
        self._fd = -1
        self._ident = 0
        self.version = 0  # bumped per batch: the writer skips unchanged streams
        self.rearm = False  # training process: timed by an armed instance (WorkerCapture.rearm)
        self.yielded = 0  # ... and its batches counted from the iterators (set by the writer)
        #: ... and their samples, where the iterators' samplers tell them (None: scaled)
        self.yielded_samples: int | None = None
        # the first two batches are fingerprinted (note_content); a flag, not len(digests):
        # one attribute read per batch on the fetch path
        self.digesting = True
        self.digests: list[str | None] = []

    def bind_thread(self) -> None:
        """Measure run-queue waits of the calling thread (the one that loads)."""
        self._ident = threading.get_ident()
        with contextlib.suppress(OSError):
            self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)

    def runq_ns(self) -> int:
        """Time the bound thread spent runnable, waiting for a core (-1: not measurable)."""
        if self._fd < 0 or threading.get_ident() != self._ident:
            return -1
        try:
            return int(os.pread(self._fd, 128, 0).split()[1])
        except (OSError, ValueError, IndexError):
            return -1

    def counted(self, n: int) -> None:
        """Book one untimed batch of ``n`` samples (its end still bounds the busy window)."""
        acc = self.acc
        acc[BATCHES] += 1
        acc[SAMPLES] += n
        acc[LAST_FETCH_END_NS] = _perf()
        self.version += 1

    def note_content(self, batch: Any) -> None:
        """Fingerprint one of the first two batches this process loaded (batch_digest).

        Workers of one generation with the same first batch read the same stream; ranks
        with the same first batch train on the same data.
        """
        self.digests.append(batch_digest(batch))
        self.digesting = len(self.digests) < 2
        self.version += 1

    def sample(self, wall_ns: int, cpu_ns: int) -> None:
        """Bin one sample timed on its own: its CPU time and the rest of its wall time.

        Only samples of at least :data:`PER_SAMPLE_MIN_NS` on average are timed one by one,
        so this call (0.4 µs here, measured; next to the two clock reads' 1-2 µs) stays
        near 0.2% of what it measures.
        """
        c = max(0, cpu_ns)
        self.h_blocked[bin_index(max(0, wall_ns - c))] += 1
        self.h_cpu[bin_index(c)] += 1

    def batch(self, n: int, t_begin: int, get_ns: int, get_cpu: int, col_ns: int, col_cpu: int,
              t_end: int, q0: int) -> None:
        """Book one timed batch (called once per batch, after the samples were binned)."""
        acc = self.acc
        if acc[TIMED_BATCHES] == 0:
            acc[FIRST_FETCH_NS] = t_begin
            acc[FIRST_BATCH_NS] = t_end
        acc[BATCHES] += 1
        acc[TIMED_BATCHES] += 1
        acc[SAMPLES] += n
        acc[FETCH_NS] += t_end - t_begin
        acc[GET_NS] += get_ns
        acc[GET_CPU_NS] += get_cpu
        acc[COLLATE_NS] += col_ns
        acc[COLLATE_CPU_NS] += max(0, col_cpu)
        acc[LAST_FETCH_END_NS] = t_end
        if self.per_sample:
            acc[SAMPLES_TIMED] += n
        waited = 0
        if q0 >= 0:
            q1 = self.runq_ns()
            if q1 >= q0:
                waited = q1 - q0
                acc[RUNQ_NS] += waited
        # What the samples cost, not how long another process held the core: a cheap
        # batch preempted on a loaded machine must not switch on per-sample clocks.
        self.per_sample = n > 0 and get_ns - waited >= PER_SAMPLE_MIN_NS * n
        self.skip = 0 if self.per_sample else self.time_every - 1
        self.h_collate[bin_index(max(0, col_ns))] += 1
        self.version += 1

    def even(self, n: int, wall: int, cpu: int) -> None:
        """``n`` samples fetched together (``__getitems__``): each gets the batch's mean."""
        if n <= 0:
            return
        cpu = max(0, cpu)
        self.h_cpu[bin_index(cpu // n)] += n
        self.h_blocked[bin_index(max(0, wall - cpu) // n)] += n

    def snapshot(self) -> dict[str, Any]:
        acc = list(self.acc)
        scaled = False
        if self.rearm:  # only the timed batches were seen: batches from the iterators
            batches = max(self.yielded, acc[TIMED_BATCHES])
            timed = acc[TIMED_BATCHES]
            if self.yielded_samples is not None and self.yielded >= timed:
                acc[SAMPLES] = self.yielded_samples  # counted by the samplers: exact
            else:
                acc[SAMPLES] = round(acc[SAMPLES] * batches / timed) if timed else 0
                scaled = timed < batches
            acc[BATCHES] = batches
        return {
            **self.info,
            **dict(zip(ACC_NAMES, acc, strict=True)),
            **({"first_batches": list(self.digests)} if self.digests else {}),
            "runq_measured": self._fd >= 0,
            # samples counted from the timed batches and scaled to all (an estimate)
            "samples_scaled": scaled,
            "capture_off": self.off,
            "hist": {
                "blocked": sparse_hist(list(self.h_blocked)),
                "cpu": sparse_hist(list(self.h_cpu)),
                "collate": sparse_hist(list(self.h_collate)),
            },
        }


#: The stream of this process when it is a DataLoader worker (see set_worker_stream).
_worker_stream: Stream | None = None


def set_worker_stream(stream: Stream) -> None:
    """Make ``stream`` the one the timed fetchers fill in this worker process (WorkerInit)."""
    global _worker_stream
    _worker_stream = stream


def _size(index: Any, data: Any) -> int:
    """Samples in a batch: the number of indices (else of items fetched; else one)."""
    for obj in (index, data):
        try:
            return len(obj)
        except TypeError:
            continue
    return 1


def _stream_of(fetcher: Any) -> Stream | None:
    if type(fetcher) is ArmedFetcher:  # the training process (num_workers=0)
        return fetcher.stream
    return _worker_stream


class ArmedFetcher:
    """A fetcher that times its next batch, in place of an iterator's own (num_workers=0).

    Armed by putting it in the iterator's ``_dataset_fetcher`` (an attribute the
    iterator already has: assigning it keeps the iterator's attribute layout), and
    disarmed by putting the real one back. Nothing is ever set on the real fetcher:
    a new instance attribute would turn its ``__dict__`` into a plain dict, and
    CPython 3.11's specialised ``self.dataset`` reads - once per sample in torch's
    fetch - would fall back to the generic lookup (~250 instructions a sample,
    measured with ``benchmarks/overhead_instructions.py``).

    The timed fetch reads the fetcher's fields through the properties below (and sets
    ``ended``, the iterable fetcher's end of data).
    """

    __slots__ = ("inner", "stream", "_it", "_timed")

    def __init__(self, inner: Any, it: Any, stream: Stream,
                 timed: Callable[[Any, Any], Any]) -> None:
        self.inner = inner
        self.stream = stream
        self._it = None if it is None else weakref.ref(it)  # no cycle: see rearm()
        self._timed = timed

    def fetch(self, possibly_batched_index: Any) -> Any:
        return self._timed(self, possibly_batched_index)

    def disarm(self) -> None:
        """Put the real fetcher back: the next batches run torch's fetch, untouched."""
        it = self._it() if self._it is not None else None
        if it is not None and getattr(it, "_dataset_fetcher", None) is self:
            it._dataset_fetcher = self.inner

    dataset = property(lambda self: self.inner.dataset)
    auto_collation = property(lambda self: self.inner.auto_collation)
    collate_fn = property(lambda self: self.inner.collate_fn)
    drop_last = property(lambda self: self.inner.drop_last)
    dataset_iter = property(lambda self: self.inner.dataset_iter)

    @property
    def ended(self) -> bool:
        return bool(self.inner.ended)

    @ended.setter
    def ended(self, value: bool) -> None:
        self.inner.ended = value


def _record_batch(fetcher: Any, st: Stream, n: int, *times: int) -> None:
    """Count a timed batch into its stream (after the clocks: their reading stays exact),
    then, in the training process, go back to torch's fetch until ``rearm()``."""
    try:
        st.batch(n, *times)
        if st.rearm and not st.per_sample and type(fetcher) is ArmedFetcher:
            fetcher.disarm()  # cheap: torch's fetch until rearm()
    except Exception:  # the capture switches itself off; the batch goes through
        st.off = True


def make_map_fetch(orig: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """A timed ``_MapDatasetFetcher.fetch``: torch 2.13's logic, with clocks between the calls."""
    from torch.utils.data import Subset

    def fetch(self: Any, possibly_batched_index: Any) -> Any:
        st = _stream_of(self)
        if st is None or st.off or (st.rearm and _under_tool(st)):
            return orig(self, possibly_batched_index)
        if st.skip > 0:  # an untimed batch: torch's logic, counted (inline: 0.3 µs, not 1.1)
            st.skip -= 1
            ds = self.dataset
            if self.auto_collation:
                getitems = getattr(ds, "__getitems__", None)
                if getitems:
                    data = getitems(possibly_batched_index)
                else:
                    data = [ds[idx] for idx in possibly_batched_index]
                n = _size(possibly_batched_index, data)
            else:
                data = ds[possibly_batched_index]
                n = 1
            out = self.collate_fn(data)
            st.counted(n)
            if st.digesting:
                st.note_content(out)
            return out
        perf, tt = _perf, _tt
        q0 = st.runq_ns()
        st.in_fetch = True
        try:
            t_begin = t0 = perf()
            c_begin = c0 = tt()
            ds = self.dataset
            if self.auto_collation:
                getitems = getattr(ds, "__getitems__", None)
                inner = None
                if getitems and type(ds) is Subset and not callable(
                    getattr(ds.dataset, "__getitems__", None)
                ):
                    # torch's Subset.__getitems__ is this very loop: time it per sample
                    inner, indices = ds.dataset, ds.indices
                if getitems and inner is None:
                    data = getitems(possibly_batched_index)
                    t0 = perf()
                    c0 = tt()
                    st.even(_size(possibly_batched_index, data), t0 - t_begin, c0 - c_begin)
                    st.per_sample = False  # one call: no per-sample times to take
                elif not st.per_sample:  # cheap samples: one timing for the batch
                    if inner is None:
                        data = [ds[idx] for idx in possibly_batched_index]
                    else:
                        data = [inner[indices[idx]] for idx in possibly_batched_index]
                    t0 = perf()
                    c0 = tt()
                    st.even(len(data), t0 - t_begin, c0 - c_begin)
                else:
                    data = []
                    append = data.append
                    sample = st.sample
                    for idx in possibly_batched_index:
                        append(ds[idx] if inner is None else inner[indices[idx]])
                        t1 = perf()
                        c1 = tt()
                        sample(t1 - t0, c1 - c0)
                        t0 = t1
                        c0 = c1
                n = _size(possibly_batched_index, data)
            else:
                data = ds[possibly_batched_index]
                t0 = perf()
                c0 = tt()
                st.even(1, t0 - t_begin, c0 - c_begin)
                n = 1
            out = self.collate_fn(data)
        finally:
            st.in_fetch = False
        t2 = perf()
        c2 = tt()
        _record_batch(self, st, n, t_begin, t0 - t_begin, c0 - c_begin, t2 - t0, c2 - c0, t2, q0)
        if st.digesting:
            st.note_content(out)
        return out

    fetch.__wrapped__ = orig  # type: ignore[attr-defined]
    return fetch


def make_iterable_fetch(orig: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """A timed ``_IterableDatasetFetcher.fetch`` (torch 2.13's logic): ``next()`` per sample."""

    def fetch(self: Any, possibly_batched_index: Any) -> Any:
        st = _stream_of(self)
        if st is None or st.off or (st.rearm and _under_tool(st)):
            return orig(self, possibly_batched_index)
        if self.ended:
            raise StopIteration
        if st.skip > 0:  # an untimed batch: torch's logic, counted
            st.skip -= 1
            it = self.dataset_iter
            if not self.auto_collation:
                out = self.collate_fn(next(it))
                st.counted(1)
                if st.digesting:
                    st.note_content(out)
                return out
            data = []
            for _ in possibly_batched_index:
                try:
                    data.append(next(it))
                except StopIteration:
                    self.ended = True
                    break
            if len(data) == 0 or (self.drop_last and len(data) < len(possibly_batched_index)):
                raise StopIteration
            out = self.collate_fn(data)
            st.counted(len(data))
            if st.digesting:
                st.note_content(out)
            return out
        perf, tt = _perf, _tt
        q0 = st.runq_ns()
        st.in_fetch = True
        try:
            t_begin = t0 = perf()
            c_begin = c0 = tt()
            it = self.dataset_iter
            if self.auto_collation:
                data = []
                per_sample = st.per_sample
                sample = st.sample
                for _ in possibly_batched_index:
                    try:
                        data.append(next(it))
                    except StopIteration:
                        self.ended = True
                        break
                    if not per_sample:
                        continue
                    t1 = perf()
                    c1 = tt()
                    sample(t1 - t0, c1 - c0)
                    t0 = t1
                    c0 = c1
                if not per_sample:
                    t0 = perf()
                    c0 = tt()
                    st.even(len(data), t0 - t_begin, c0 - c_begin)
                if len(data) == 0 or (
                    self.drop_last and len(data) < len(possibly_batched_index)
                ):
                    raise StopIteration
                n = len(data)
            else:
                data = next(it)
                t0 = perf()
                c0 = tt()
                st.even(1, t0 - t_begin, c0 - c_begin)
                n = 1
            out = self.collate_fn(data)
        finally:
            st.in_fetch = False
        t2 = perf()
        c2 = tt()
        _record_batch(self, st, n, t_begin, t0 - t_begin, c0 - c_begin, t2 - t0, c2 - c0, t2, q0)
        if st.digesting:
            st.note_content(out)
        return out

    fetch.__wrapped__ = orig  # type: ignore[attr-defined]
    return fetch
