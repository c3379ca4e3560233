"""Worker-side capture: what DataLoader workers spend their time on (always on, nearly free).

The training process sees the input pipeline only from outside: how long each step
waits for its batch. Why it waits is decided inside the workers, so trainprof measures
there, in every DataLoader worker process (``fork``, ``spawn`` and ``forkserver``
alike) and, for ``num_workers=0``, in the training process itself. What is timed per
sample and per batch, and what it costs, is :mod:`trainprof.capture.fetch_timing`;
this module gets it into the workers, samples their stacks on request, and writes
the results.

How it gets into the worker
---------------------------
The worker runs ``torch.utils.data._utils.worker._worker_loop``, which calls the
DataLoader's ``worker_init_fn`` and *then* creates the fetcher
(``_MapDatasetFetcher`` / ``_IterableDatasetFetcher``) that calls the dataset and
``collate_fn``. The training process swaps, for the time it takes to create the
iterator, the loader's ``worker_init_fn`` for a :class:`WorkerInit`: a plain,
picklable object (so ``spawn`` and ``forkserver`` work; a ``fork`` child gets it as
it is) that carries the run folder, the loader's index and generation, and the
user's own ``worker_init_fn``, which it calls unchanged. In the worker it replaces
the fetchers' ``fetch`` with a timed copy of torch 2.13's (same calls in the same
order, same exceptions), then calls the user's function.

Results
-------
``RUN_DIR/workers/<pid>.json``: one file per process, rewritten atomically (a
temporary file, then ``os.replace``) by a daemon thread at most once a second and
at the worker's exit (``multiprocessing.util.Finalize``: a worker ends through
multiprocessing's ``_exit_function``, not ``atexit``), so a worker that is killed
loses at most its last second. Counters are sums; distributions are log-linear
histograms (16 bins per power of two: at most 3% from the bin's centre), which add
up exactly across workers. A worker's stream also holds its private and shared dirty
memory just after its first batch (``dirty_after_first_batch``): the end of its
start-up, from which trainprof.analysis.memory_growth counts what it keeps.
The format is read by :mod:`trainprof.analysis.workers`.

Stack sampling (``trainprof run --py``): a thread in each worker reads the worker's
main-thread stack (``sys._current_frames``) 100 times a second while it is inside
``fetch``, and counts each function (file, first line, qualified name) as *self*
(the innermost frame) and *total* (anywhere on the stack below ``fetch``), written
to ``RUN_DIR/workers/<pid>.stacks.json`` the same way. An in-process sampler works
wherever the worker runs (no ptrace permission, no py-spy install needed); like
every in-process sampler it sees a thread only between bytecodes, so time inside one
long C call is attributed to the Python function that made it, which is what a
per-function profile wants anyway.

An in-process sampler also needs the GIL to read a stack, and that biases it: a
thread waiting for the GIL gets it at once when the holder releases it (a ``sleep``,
a read) but only after the switch interval (``sys.getswitchinterval()``, 5 ms) when
the holder is busy in Python, so ticks landing in the last 5 ms of a CPU-bound stretch
were counted against whatever released the GIL next. With 8 ms of transform and 1 ms
of read per sample, the read took half the samples instead of a ninth. Sampled workers
therefore run with a switch interval of :data:`SAMPLING_SWITCH_INTERVAL_S` (0.1 ms):
the sampler is the only thread asking for the GIL, once per tick, so this costs one
forced switch per tick and bounds the bias to ~1% of the sampling period.

Nothing here may break the user's workers: errors in the capture switch it off for
that process; exceptions from the user's dataset, ``collate_fn`` or
``worker_init_fn`` pass through unchanged.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from trainprof.capture.fetch_timing import (
    FIRST_BATCH_NS,
    ArmedFetcher,
    Stream,
    make_iterable_fetch,
    make_map_fetch,
    set_worker_stream,
)
from trainprof.capture.parent_death import die_with_parent, forking_thread_outlives_workers

_perf = time.perf_counter_ns

#: Bumped when the file layout changes (read by trainprof.analysis.workers).
FORMAT = 1
#: Sub-folder of the run folder.
WORKERS_DIR = "workers"
#: How often a process rewrites its file, at most.
WRITE_INTERVAL_S = 1.0
#: Stack samples per second per worker when sampling is on.
SAMPLE_HZ = 100.0
#: GIL switch interval in sampled workers (see the module docstring: sampling bias).
SAMPLING_SWITCH_INTERVAL_S = 1e-4
#: Functions kept per stacks file (by self, then total samples).
MAX_FUNCTIONS = 300
#: ... and in the training process (num_workers=0) about this many a second (rearm()).
MAIN_REARM_HZ = 5.0
#: How often a worker's writer thread looks for its first batch until it has read its
#: memory after it (``dirty_after_first_batch``, _WorkerRuntime.take_baseline)
BASELINE_POLL_S = 0.02


def _own_dirty_memory() -> tuple[int, int] | None:
    """(Private_Dirty, Shared_Dirty) in bytes of this process, from
    ``/proc/self/smaps_rollup`` (the fields trainprof.capture.proc_stats reads for the
    sampler; parsed here so that a worker does not import psutil); None where unreadable."""
    try:
        with open("/proc/self/smaps_rollup", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    out = {}
    for line in data.splitlines():
        key, _, rest = line.partition(b":")
        if key in (b"Private_Dirty", b"Shared_Dirty"):
            out[key] = int(rest.split()[0]) * 1024  # kB
    if len(out) != 2:
        return None
    return out[b"Private_Dirty"], out[b"Shared_Dirty"]


def _write_atomic(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(orjson.dumps(doc))
    os.replace(tmp, path)


# -- in the worker ------------------------------------------------------------------------


class StackSampler:
    """Counts, per function, how often the loading thread is in it (self) or under it (total).

    Only while the thread is inside ``fetch``; the walk up the stack stops at the
    timed ``fetch`` frame, so the torch worker loop above it is not counted.
    """

    def __init__(self, ident: int, stream: Stream, stop_codes: set[Any]) -> None:
        self.ident = ident
        self.stream = stream
        self.stop_codes = stop_codes
        self.ticks = 0
        self.in_fetch = 0
        self.codes: dict[int, Any] = {}
        self.self_n: dict[int, int] = {}
        self.total_n: dict[int, int] = {}

    def sample(self) -> None:
        self.ticks += 1
        if not self.stream.in_fetch:
            return
        frame = sys._current_frames().get(self.ident)
        if frame is None:
            return
        self.in_fetch += 1
        stop, codes, self_n, total_n = self.stop_codes, self.codes, self.self_n, self.total_n
        seen: set[int] = set()
        leaf = True
        while frame is not None:
            code = frame.f_code
            if code in stop:
                break
            key = id(code)
            if key not in codes:
                codes[key] = code
            if leaf:
                self_n[key] = self_n.get(key, 0) + 1
                leaf = False
            if key not in seen:
                seen.add(key)
                total_n[key] = total_n.get(key, 0) + 1
            frame = frame.f_back

    def snapshot(self, interval_s: float) -> dict[str, Any]:
        total = dict(self.total_n)
        self_n = dict(self.self_n)
        keys = sorted(total, key=lambda k: (-self_n.get(k, 0), -total[k]))[:MAX_FUNCTIONS]
        functions = []
        for k in keys:
            code = self.codes[k]
            name = getattr(code, "co_qualname", code.co_name)
            functions.append([code.co_filename, code.co_firstlineno, name,
                              self_n.get(k, 0), total[k]])
        return {"format": FORMAT, "pid": os.getpid(), "interval_s": interval_s,
                "ticks": self.ticks, "ticks_in_fetch": self.in_fetch, "functions": functions}


class _WorkerRuntime:
    """The capture inside one worker process: its stream, file, writer and sampler thread."""

    def __init__(self, out_dir: Path, stream: Stream, sampling: bool, hz: float) -> None:
        self.out_dir = out_dir
        self.path = out_dir / f"{os.getpid()}.json"
        self.stream = stream
        self.sampler: StackSampler | None = None
        self.interval_s = 1.0 / hz
        if sampling:
            stop = {f.__code__ for f in (make_map_fetch(_noop), make_iterable_fetch(_noop))}
            self.sampler = StackSampler(threading.get_ident(), stream, stop)
            stream.time_every = 1  # the sampler counts only ticks inside a timed fetch
            # the worker's own interpreter: nothing of the user's main process changes
            sys.setswitchinterval(min(sys.getswitchinterval(), SAMPLING_SWITCH_INTERVAL_S))
        self._stop = threading.Event()
        self._written = -1
        self._lock = threading.Lock()
        self.baseline_pending = True

    def start(self) -> None:
        from multiprocessing import util

        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.write(final=False)
        # DataLoader workers end through multiprocessing's _exit_function (then os._exit
        # for fork), which runs these finalizers; atexit would not run.
        util.Finalize(None, self.close, exitpriority=100)
        threading.Thread(target=self._run, name="trainprof-worker", daemon=True).start()

    def _run(self) -> None:
        try:
            wait = self._stop.wait
            sampler = self.sampler
            step = self.interval_s if sampler is not None else WRITE_INTERVAL_S
            next_write = _perf() + int(WRITE_INTERVAL_S * 1e9)
            while not wait(min(step, BASELINE_POLL_S) if self.baseline_pending else step):
                if self.baseline_pending and self.stream.acc[FIRST_BATCH_NS]:
                    self.take_baseline()
                if sampler is not None:
                    sampler.sample()
                if _perf() >= next_write:
                    next_write = _perf() + int(WRITE_INTERVAL_S * 1e9)
                    self.write(final=False)
        except Exception:
            self.stream.off = True

    def take_baseline(self) -> None:
        """Record the worker's dirty memory just after its first batch
        (``dirty_after_first_batch``: ``[private, shared, perf_counter_ns]``).

        Why: memory a worker writes after that is what its dataset keeps as it runs (a
        cache), the figure trainprof.analysis.memory_growth reports per worker. What it
        held before is start-up: under ``spawn`` and ``forkserver`` a fresh interpreter
        imports torch and unpickles the dataset (measured: 17 MB at the sampler's first
        sight of a worker, 150 MB after its first batch, for a dataset holding nothing),
        which the sampler's once-a-second readings cannot tell from growth. Read here, in
        the writer thread (polled every :data:`BASELINE_POLL_S` until the first batch),
        not on the loading thread: the read walks the worker's mappings (about 1-4 ms with
        torch imported), and the worker keeps loading meanwhile. Once per worker.
        """
        self.baseline_pending = False
        dirty = _own_dirty_memory()
        if dirty is not None:
            self.stream.info["dirty_after_first_batch"] = [dirty[0], dirty[1], _perf()]
            self.stream.version += 1

    def write(self, final: bool) -> None:
        with self._lock:
            st = self.stream
            if st.version == self._written and not final:
                return
            self._written = st.version
            doc = {"format": FORMAT, "pid": os.getpid(), "role": "worker",
                   "updated_ns": _perf(), "ended": final, "streams": [st.snapshot()]}
            _write_atomic(self.path, doc)
            if self.sampler is not None:
                _write_atomic(self.out_dir / f"{os.getpid()}.stacks.json",
                              self.sampler.snapshot(self.interval_s))

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(Exception):
            self.write(final=True)


def _noop(*args: Any) -> None:
    return None


def samples_yielded(it: Any, batches: int) -> int | None:
    """The samples in the first ``batches`` batches a single-process iterator yielded, where
    its sampler tells them exactly: one a batch without automatic batching; torch's own
    ``BatchSampler`` gives ``batch_size`` a batch, the last one of an epoch what is left of
    ``len(sampler)`` (none left out unless ``drop_last``). None otherwise (a custom batch
    sampler, a sampler without a length): the count is then scaled from the timed batches.
    """
    from torch.utils.data import BatchSampler

    try:
        if not it._auto_collation:
            return batches
        sampler = it._index_sampler
        if type(sampler) is not BatchSampler:
            return None
        full = batches * int(sampler.batch_size)
        return full if sampler.drop_last else min(full, len(sampler.sampler))
    except (AttributeError, TypeError, ValueError):
        return None


class WorkerInit:
    """The ``worker_init_fn`` a DataLoader's workers get while trainprof records.

    Picklable (plain attributes), so it travels to ``spawn``/``forkserver`` workers
    with the rest of the worker's arguments. Starts the capture in the worker, then
    calls the user's ``worker_init_fn`` (timed: its time is part of the start-up).
    """

    def __init__(self, user_fn: Callable[[int], Any] | None, out_dir: str, loader_index: int,
                 generation: int, num_workers: int, persistent: bool, start_method: str | None,
                 sampling: bool, requested_ns: int, parent_pid: int | None = None) -> None:
        self.user_fn = user_fn
        self.out_dir = out_dir
        self.loader_index = loader_index
        self.generation = generation
        self.num_workers = num_workers
        self.persistent = persistent
        self.start_method = start_method
        self.sampling = sampling
        self.requested_ns = requested_ns
        #: the pid the worker's parent must have; None: no parent-death signal (see
        #: trainprof.capture.parent_death; 0: the forkserver, read in the worker)
        self.parent_pid = parent_pid

    def __call__(self, worker_id: int) -> None:
        started = _perf()
        stream = None
        if self.parent_pid is not None:
            with contextlib.suppress(Exception):
                die_with_parent(self.parent_pid or os.getppid())
        try:
            stream = self._start(worker_id, started)
        except Exception:
            stream = None  # no capture in this worker; the user's worker runs as ever
        if self.user_fn is None:
            return
        try:
            self.user_fn(worker_id)
        finally:
            if stream is not None:
                stream.info["init_ns"] = _perf() - started

    def _start(self, worker_id: int, started: int) -> Stream:
        from torch.utils.data._utils import fetch as torch_fetch

        stream = Stream({
            "loader_index": self.loader_index, "generation": self.generation,
            "worker_id": worker_id, "num_workers": self.num_workers,
            "persistent_workers": self.persistent, "start_method": self.start_method,
            "requested_ns": self.requested_ns, "started_ns": started, "init_ns": 0,
        })
        stream.bind_thread()
        # the file first: if it cannot be written, nothing is patched
        _WorkerRuntime(Path(self.out_dir), stream, self.sampling, SAMPLE_HZ).start()
        for cls, make in ((torch_fetch._MapDatasetFetcher, make_map_fetch),
                          (torch_fetch._IterableDatasetFetcher, make_iterable_fetch)):
            current = cls.__dict__["fetch"]
            # a forked worker inherits the class as the parent had it at fork; the
            # training process's patch is undone at fork, but never wrap twice
            orig = getattr(current, "__wrapped__", current)
            cls.fetch = make(orig)
        set_worker_stream(stream)
        return stream


# -- in the training process ----------------------------------------------------------------


class WorkerCapture:
    """The training process's side: gives workers a :class:`WorkerInit`; times ``num_workers=0``.

    ``sampling`` is read each time a DataLoader starts workers (a callable, so the
    Recorder's ``worker_sampling`` flag can be set after construction).
    """

    def __init__(self, out_dir: Path, sampling: Callable[[], bool] | bool = False) -> None:
        self.out_dir = out_dir
        self._sampling = sampling
        self._generations: dict[int, int] = {}
        self._main: dict[int, Stream] = {}
        self._iters: dict[int, list[Any]] = {}  # live single-process iterators per loader
        self._folded: dict[int, int] = {}  # batches of the iterators let go
        #: ... and their samples, where each iterator's are known (None: not all are)
        self._folded_samples: dict[int, int | None] = {}
        self._timed: dict[type, Callable[[Any, Any], Any]] = {}
        self._written: dict[int, int] = {}
        self._last_write = 0
        self._pid = os.getpid()  # a forked child must never write this process's file
        self.missing: list[str] = []

    @property
    def sampling(self) -> bool:
        s = self._sampling
        return bool(s() if callable(s) else s)

    def install(self, patch: Callable[[Any, str, Callable[[Any], Any]], None],
                index_of: Callable[[Any], int]) -> None:
        """Patch iterator creation and the fetchers (through ``patch``: undone at uninstall).

        ``index_of(loader)`` gives the loader's index in the run's DataLoader list.
        """
        from torch.utils.data import DataLoader
        from torch.utils.data._utils import fetch as torch_fetch

        capture = self

        def make_get_iterator(orig: Callable[[Any], Any]) -> Callable[[Any], Any]:
            def _get_iterator(loader: Any) -> Any:
                try:
                    index = index_of(loader)
                    workers = int(loader.num_workers)
                except Exception:
                    return orig(loader)
                if workers == 0:
                    it = orig(loader)
                    capture._tag_single_process(it, index)
                    return it
                init = capture._worker_init(loader, index)
                if init is None:
                    return orig(loader)
                saved = loader.worker_init_fn
                try:
                    loader.worker_init_fn = init
                except Exception:
                    return orig(loader)
                try:
                    return orig(loader)
                finally:
                    loader.worker_init_fn = saved

            return _get_iterator

        patch(DataLoader, "_get_iterator", make_get_iterator)
        # num_workers=0: set on fetcher instances while armed (see the module docstring)
        self._timed = {
            torch_fetch._MapDatasetFetcher: make_map_fetch(torch_fetch._MapDatasetFetcher.fetch),
            torch_fetch._IterableDatasetFetcher: make_iterable_fetch(
                torch_fetch._IterableDatasetFetcher.fetch),
        }

    def _worker_init(self, loader: Any, index: int) -> WorkerInit | None:
        try:
            import torch.multiprocessing as tmp

            self.out_dir.mkdir(parents=True, exist_ok=True)
            gen = self._generations.get(index, 0) + 1
            self._generations[index] = gen
            ctx = loader.multiprocessing_context
            method = ctx.get_start_method() if ctx is not None else tmp.get_start_method()
            if method == "forkserver":
                parent: int | None = 0  # the server, single-threaded: its pid read there
            else:  # the workers' parent is this thread (see capture.parent_death)
                parent = os.getpid() if forking_thread_outlives_workers() else None
            return WorkerInit(
                loader.worker_init_fn, str(self.out_dir), index, gen, int(loader.num_workers),
                bool(loader.persistent_workers), method, self.sampling, _perf(), parent,
            )
        except Exception as exc:
            self._note(f"worker capture: {type(exc).__name__}: {exc}")
            return None

    def _tag_single_process(self, it: Any, index: int) -> None:
        try:
            fetcher = it._dataset_fetcher
            if type(fetcher) not in self._timed:
                return  # a fetcher of a torch version we do not know: loading untimed
            st = self._main.get(index)
            if st is None:
                st = Stream({"loader_index": index, "generation": 1, "worker_id": None,
                             "num_workers": 0, "persistent_workers": False,
                             "start_method": None, "requested_ns": None,
                             "started_ns": _perf(), "init_ns": 0})
                # not bind_thread(): no schedstat reads on the training thread (see above)
                st.time_every = 1
                st.rearm = True
                self._main[index] = st
            # held until only we hold it: its batch count is then final (see rearm)
            self._iters.setdefault(index, []).append(it)
            self._arm(it, st)  # the first batch
        except Exception as exc:
            self._note(f"worker capture (num_workers=0): {type(exc).__name__}: {exc}")

    def _arm(self, it: Any, st: Stream) -> None:
        fetcher = it._dataset_fetcher
        if type(fetcher) is not ArmedFetcher and not st.off:
            it._dataset_fetcher = ArmedFetcher(fetcher, it, st, self._timed[type(fetcher)])

    def rearm(self) -> None:
        """Time the next batch of every live single-process iterator; count their batches.

        Called by the Recorder's flush thread :data:`MAIN_REARM_HZ` times a second. An
        iterator that only this list still references can yield no more batches: its
        count is final, so it is folded into the stream's total and let go. (The
        references are the list's, the loop variable's and ``getrefcount``'s own;
        ``LoaderRegistry`` holds iterators weakly, and an ArmedFetcher too.)
        """
        for index, its in list(self._iters.items()):
            st = self._main[index]
            live = 0
            live_samples: int | None = 0
            keep = []
            for it in its:
                n = int(getattr(it, "_num_yielded", 0))
                samples = samples_yielded(it, n)
                if sys.getrefcount(it) <= 3:  # abandoned by the script
                    self._folded[index] = self._folded.get(index, 0) + n
                    folded = self._folded_samples.get(index, 0)
                    self._folded_samples[index] = (None if folded is None or samples is None
                                                   else folded + samples)
                    continue
                live += n
                live_samples = (None if live_samples is None or samples is None
                                else live_samples + samples)
                keep.append(it)
                self._arm(it, st)
            its[:] = keep
            yielded = self._folded.get(index, 0) + live
            folded = self._folded_samples.get(index, 0)
            total = None if folded is None or live_samples is None else folded + live_samples
            if yielded != st.yielded or total != st.yielded_samples:
                st.yielded = yielded
                st.yielded_samples = total
                st.version += 1

    def holds(self, it: Any) -> int:
        """How many strong references this capture holds to the iterator ``it`` (0 or 1):
        the LoaderRegistry discounts them when it asks whether the script still holds it."""
        for its in list(self._iters.values()):
            if any(x is it for x in list(its)):
                return 1
        return 0

    def _disarm_all(self) -> None:
        """At the end: every iterator's own fetcher back; counts final."""
        self.rearm()
        for its in self._iters.values():
            for it in its:
                fetcher = getattr(it, "_dataset_fetcher", None)
                if type(fetcher) is ArmedFetcher:
                    fetcher.disarm()

    def _note(self, msg: str) -> None:
        if msg not in self.missing:
            self.missing.append(msg)

    def flush(self, final: bool = False) -> None:
        """Rewrite the training process's file if a ``num_workers=0`` loader fetched since.

        At most once a second (the Recorder calls this every sampler tick), except
        ``final``, at the end of the run.
        """
        if os.getpid() != self._pid:
            return
        streams = dict(self._main)
        if not streams or all(self._written.get(i) == s.version for i, s in streams.items()):
            return
        now = _perf()
        if not final and now - self._last_write < WRITE_INTERVAL_S * 1e9:
            return
        self._last_write = now
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            doc = {"format": FORMAT, "pid": os.getpid(), "role": "main", "updated_ns": now,
                   "ended": final, "streams": [s.snapshot() for s in streams.values()]}
            _write_atomic(self.out_dir / f"{os.getpid()}.json", doc)
            self._written = {i: s.version for i, s in streams.items()}
        except Exception as exc:
            self._note(f"worker capture: cannot write: {exc}")

    def close(self) -> None:
        """The last write of the training process's file (the patches are being removed)."""
        if os.getpid() == self._pid:
            with contextlib.suppress(Exception):
                self._disarm_all()
        self.flush(final=True)
