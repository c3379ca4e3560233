"""Auto-instrumentation: find steps and phases in an unmodified training script.

Everything here patches *class-level* entry points once, before the script
runs, and restores them afterwards:

* optimizer steps: torch's global ``register_optimizer_step_pre_hook`` /
  ``register_optimizer_step_post_hook`` (every ``torch.optim.Optimizer``,
  whenever it was created);
* data wait: ``_BaseDataLoaderIter.__next__``, the one ``__next__`` that both
  the single- and multi-process DataLoader iterators inherit;
* forward: ``nn.Module.__call__``, timed only for the *outermost* call (the
  model, or the loss module) - nested module calls see that a phase is
  already open and go straight through. A patched ``__call__`` is used rather
  than ``register_module_forward_pre_hook`` because global module hooks force
  every module call onto the slow hook path of ``Module._call_impl``;
* backward: ``torch.autograd.backward`` (what ``Tensor.backward`` calls) and
  ``torch.autograd.grad``;
* zero_grad: ``Optimizer.zero_grad`` and ``Module.zero_grad``;
* a closure given to the optimizer step (``opt.step(closure)``: LBFGS, and every
  training step of PyTorch Lightning's automatic optimization): the optimizer
  runs the forward, the backward and whatever else the closure does, inside its
  step. The pre-hook hands the step a timed closure instead (torch lets a
  step pre-hook replace the step's arguments), which runs at the step's top
  level (phase "other"), so its forward and backward are timed as such and only
  the optimizer's own work counts as "optimizer";
* GC: ``gc.callbacks``;
* host reads: ``Tensor.item/.tolist/.numpy/.cpu`` and
  ``torch.cuda.synchronize``. Reads of a tensor that is not on the CPU force
  a host-device synchronization; those are counted and timed as syncs.

Only one thread is measured: the one that started profiling, unless the run's
first optimizer step happens in another thread, which then becomes the measured
one (:meth:`StepClock.adopt_thread`: a script that trains in a thread of its
own). Forked children (DataLoader workers) restore the originals at fork, so
workers run uninstrumented by these hooks; what workers spend their time on is
measured by :mod:`trainprof.capture.worker`, which they get through
``worker_init_fn``.
"""

from __future__ import annotations

import _thread
import contextlib
import functools
import gc
import multiprocessing.process
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from time import perf_counter_ns
from typing import Any

import torch
from torch.compiler import is_compiling
from torch.utils.data import DataLoader
from torch.utils.data import dataloader as _dl
from torch.utils.data._utils.worker import _worker_loop  # a DataLoader worker's target

from trainprof.capture.checkpointing import CheckpointCalls
from trainprof.capture.clock import FAST, StepClock, Terminated
from trainprof.capture.compile_events import CompileEvents
from trainprof.capture.ddp_stats import DDPStats
from trainprof.capture.device_timer import (
    BWD_BEGIN,
    BWD_END,
    FWD_BEGIN,
    FWD_END,
    OPT_BEGIN,
    OPT_END,
)
from trainprof.capture.explicit_gc import ExplicitCollects
from trainprof.capture.handoff import REBUILDERS, HandoffTimer
from trainprof.capture.opcount import compiled_frames
from trainprof.capture.padding import PaddingProbe
from trainprof.capture.ranks import ChildRuns
from trainprof.capture.worker import WorkerCapture
from trainprof.schema import (
    BACKWARD,
    DATA,
    FLAG_PROFILED,
    FLAG_SKIPPED,
    FORWARD,
    GC,
    GC_GEN2_N,
    GC_N,
    HOST_READS,
    OPTIMIZER,
    OTHER,
    SAMPLES,
    SYNC_N,
    SYNC_NS,
    ZERO_GRAD,
)

_INHERITED = object()

if FAST:  # the C wrappers (see trainprof.capture.clock); else the Python closures below
    from trainprof.capture import _fastclock

#: The installed instrumentations, for the one fork hook (see :func:`_uninstall_in_child`).
_INSTALLED: weakref.WeakSet[Instrumentation] = weakref.WeakSet()
_FORK_HOOK = False


def _signal_again(sig: int) -> None:
    """Flag ``sig`` for the main thread a moment from now (see the unraisable hook)."""
    time.sleep(0.001)
    _thread.interrupt_main(sig)


def _uninstall_in_child() -> None:
    """In a forked child (a DataLoader worker): the originals back, for every recording.

    Registered once per process: ``os.register_at_fork`` cannot unregister, so a hook
    per recording would keep every finished recording (its clock, its records) alive
    and run at every later fork of a process that records more than once.
    """
    for inst in list(_INSTALLED):
        inst._after_fork_in_child()


#: Steps during which every module call is watched to find the top-level
#: (root) module classes; afterwards only those are wrapped.
DISCOVERY_STEPS = 3


def batch_size_of(batch: Any) -> int:
    """Leading dimension of the first tensor found in a batch (0 if none).

    Looks at the batch itself, the first element of a list/tuple, or the first
    value of a mapping: the layouts ``default_collate`` produces. Runs once
    per batch, so exact-type checks come first (``isinstance`` against
    ``torch.Tensor`` and ``len(tensor)`` are several times slower).
    """
    for _ in range(3):
        cls = type(batch)
        if cls is list or cls is tuple:
            if not batch:
                return 0
            batch = batch[0]
        elif cls is torch.Tensor or isinstance(batch, torch.Tensor):
            shape = batch.shape
            return shape[0] if shape else 1
        elif isinstance(batch, (list, tuple)) and batch:
            batch = batch[0]
        elif isinstance(batch, Mapping) and batch:
            batch = next(iter(batch.values()))
        else:
            return 0
    return 0


def _is_timed_closure(fn: Any) -> bool:
    """A closure already timed (an optimizer whose step calls another's with it)."""
    if FAST and type(fn) is _fastclock.Timed:
        return True
    return getattr(fn, "trainprof_closure", False) is True


def _runs_python(args: Any) -> bool:
    """A command line (a list) that starts this Python."""
    if isinstance(args, (str, bytes, os.PathLike)) or len(args) < 2:
        return False
    return os.path.realpath(str(args[0])) == os.path.realpath(sys.executable)


#: Subprocess commands kept for the "nothing to measure" message.
MAX_SUBPROCESSES = 8


def _command_words(args: Any) -> list[str]:
    """A Popen command as words (a string command, ``shell=True``'s, is one word)."""
    if isinstance(args, (str, bytes, os.PathLike)):
        return [os.fsdecode(args)]
    return [os.fsdecode(a) if isinstance(a, (bytes, os.PathLike)) else str(a) for a in args]


_TRAINPROF_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _started_by_trainprof(max_depth: int = 12) -> bool:
    """Whether the Popen being made is trainprof's own (its sampler process, git for the
    fingerprint): the first caller outside ``subprocess`` and this module is in trainprof."""
    frame = sys._getframe(2)
    for _ in range(max_depth):
        if frame is None:
            return False
        name = frame.f_code.co_filename
        if name != subprocess.__file__ and name != __file__:
            return name.startswith(_TRAINPROF_DIR + os.sep)
        frame = frame.f_back
    return False


def _runs_this_script(args: Any) -> bool:
    """A command line that runs the script being recorded again, with this Python.

    What PyTorch Lightning's launcher runs: ``[sys.executable, abspath(sys.argv[0]),
    *argv]``, or ``[sys.executable, "-m", __main__.__spec__.name, *argv]``.
    """
    if not _runs_python(args):
        return False
    if str(args[1]) == "-m":
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        return len(args) > 2 and spec is not None and str(args[2]) == spec.name
    return bool(sys.argv and sys.argv[0]) and (
        os.path.realpath(str(args[1])) == os.path.realpath(sys.argv[0]))


def _qualname(obj: Any) -> str | None:
    if obj is None:
        return None
    cls = obj if isinstance(obj, type) else type(obj)
    if callable(obj) and not isinstance(obj, type) and hasattr(obj, "__qualname__"):
        return f"{getattr(obj, '__module__', '?')}.{obj.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def describe_loader(loader: DataLoader) -> dict[str, Any]:
    """The DataLoader settings that decide input-pipeline speed, as plain JSON."""
    dataset = loader.dataset
    try:
        length: int | None = len(dataset)  # type: ignore[arg-type]
    except Exception:
        length = None
    ctx = loader.multiprocessing_context
    iterable = isinstance(dataset, torch.utils.data.IterableDataset)
    config: dict[str, Any] = {
        "dataset": _qualname(dataset),
        "len": length,
        "batch_size": loader.batch_size,
        "num_workers": loader.num_workers,
        "pin_memory": loader.pin_memory,
        "prefetch_factor": loader.prefetch_factor,
        "persistent_workers": loader.persistent_workers,
        "drop_last": loader.drop_last,
        "timeout": loader.timeout,
        "collate_fn": _qualname(loader.collate_fn),
        "sampler": _qualname(loader.sampler),
        "batch_sampler": _qualname(loader.batch_sampler),
        "multiprocessing_context": ctx.get_start_method() if ctx is not None else None,
        "in_order": getattr(loader, "in_order", None),
        "iterable_dataset": iterable,
    }
    if not iterable:
        with contextlib.suppress(Exception):  # batches an epoch, whatever makes them
            config["batches"] = len(loader)
    batch_sampler = loader.batch_sampler
    if loader.batch_size is None and batch_sampler is not None:
        # a batch_sampler passed in (Hugging Face's Trainer, through accelerate, does): the
        # loader's own batch_size and sampler are None and a default SequentialSampler;
        # what batches and shuffles is the batch_sampler and the sampler inside it
        size = getattr(batch_sampler, "batch_size", None)
        if isinstance(size, int) and not isinstance(size, bool):
            config["batch_sampler_batch_size"] = size
        config["batch_sampler_sampler"] = _qualname(getattr(batch_sampler, "sampler", None))
    shuffle = getattr(loader.sampler, "shuffle", None)
    if isinstance(shuffle, bool):  # a DistributedSampler's: whether it shuffles
        config["sampler_shuffle"] = shuffle
    return config


#: Module-name prefixes of the training loops that build or iterate DataLoaders for the
#: user, and the name a fix refers to: Hugging Face's Trainer builds its loaders itself
#: (from TrainingArguments), so a fix names those arguments, not a DataLoader call.
_FRAMEWORKS = (("transformers.trainer", "transformers.Trainer"),
               ("pytorch_lightning.", "lightning"), ("lightning.", "lightning"))


def _training_framework(max_depth: int = 64) -> str | None:
    """The framework whose training loop is iterating a DataLoader now, or None.

    Called once per loader, when its first iterator is created: the loop that asked
    for it is on the stack (``Trainer._inner_training_loop``, Lightning's fit loop).
    """
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        name = frame.f_globals.get("__name__", "")
        if isinstance(name, str):
            for prefix, framework in _FRAMEWORKS:
                if name.startswith(prefix):
                    return framework
        frame = frame.f_back
    return None


def _dead_ref() -> None:
    return None


#: Configuration keys the run adds to a loader's own settings (not settings themselves).
_RUN_KEYS = frozenset({"index", "iterated_in_thread", "iterated_with"})


def _same_settings(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two described loaders have the same settings (a loader made anew)."""
    return ({k: v for k, v in a.items() if k not in _RUN_KEYS}
            == {k: v for k, v in b.items() if k not in _RUN_KEYS})


def _iterator_done(it: Any) -> bool:
    """Whether a DataLoader iterator has yielded its last batch of the epoch (or shut down).

    Read from torch's own iterator state (torch/utils/data/dataloader.py), nothing added
    to the hot path: a map-style iterator has yielded ``len(_index_sampler)`` batches
    (``__len__`` of ``_BaseDataLoaderIter``); a multi-process one without persistent
    workers calls ``_shutdown_workers()`` at its end (``_shutdown``); with persistent
    workers and an iterable dataset every worker is marked ended (``_workers_status``);
    a single-process iterable one's fetcher has ``ended``. A state that tells nothing
    reads as not done.
    """
    if getattr(it, "_shutdown", False) is True:
        return True
    if getattr(it, "_dataset_kind", None) == _dl._DatasetKind.Map:
        try:
            return int(it._num_yielded) >= len(it._index_sampler)
        except Exception:
            return False
    if getattr(getattr(it, "_dataset_fetcher", None), "ended", False) is True:
        return True
    status = getattr(it, "_workers_status", None)
    return isinstance(status, list) and bool(status) and not any(status)


class LoaderRegistry:
    """DataLoaders seen in the run: their settings, live iterators and worker pids.

    ``worker_pids`` is a tuple replaced as a whole, so other threads can read
    it without locking; ``on_workers`` hears of every change.
    """

    def __init__(self, on_new_loader: Callable[[int, dict[str, Any]], None]) -> None:
        self._on_new_loader = on_new_loader
        self._ids: dict[int, tuple[Callable[[], Any], int]] = {}
        self._iterators: weakref.WeakSet[Any] = weakref.WeakSet()
        #: the loader index of each live iterator
        self._iterator_index: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self.configs: list[dict[str, Any]] = []
        self.worker_pids: tuple[int, ...] = ()
        self.all_worker_pids: set[int] = set()
        #: told the worker pids whenever an iterator starts workers (the system sampler)
        self.on_workers: Callable[[tuple[int, ...]], None] | None = None
        #: per loader index, the threads (ident: name) that started iterating it
        self._threads: dict[int, dict[int, str]] = {}
        #: strong references trainprof itself holds to an iterator (WorkerCapture keeps
        #: single-process iterators until their batch count is final); see _in_use
        self.held_refs: Callable[[Any], int] = lambda it: 0
        #: the step clock's step count (Instrumentation sets it): when an iterator was made
        self.step_count: Callable[[], int] = lambda: 0
        #: the step count at which each live iterator was made
        self._iterator_step: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()

    def index_of(self, loader: DataLoader) -> int:
        """The loader's index in the run (registered the first time it is seen).

        Keyed by ``id(loader)`` and checked by a weak reference: a loader freed and a new
        one made at the same address (a loader per epoch, an evaluation loader made after
        the training one is gone) must not pass for the old one. A new loader with the
        settings of an earlier one gets that one's index - one logical loader (the same
        loop building its DataLoader anew each epoch) - unless the earlier one is being
        iterated now (:meth:`_in_use`): loaders with the same settings zipped in one loop
        (``zip(dl_a, dl_b, dl_c)``, a multi-task or labelled/unlabelled loop) each feed
        every step with their own workers, epochs and batches, so each is its own loader.
        """
        key = id(loader)
        known = self._ids.get(key)
        if known is not None and known[0]() is loader:
            return known[1]
        try:
            config = describe_loader(loader)
        except Exception as exc:  # a loader we cannot describe is still timed
            config = {"error": f"{type(exc).__name__}: {exc}"}
        driver = _training_framework()
        if driver is not None:
            config["driven_by"] = driver
        index = None
        busy = self._indices_in_use()
        if "error" not in config:
            index = next((i for i, seen in enumerate(self.configs)
                          if i not in busy and _same_settings(seen, config)), None)
        # loaders whose iterators were made in this same step and are still being iterated:
        # zip(a, b, c) makes them one after another, before its first batch
        now = self.step_count()
        alongside = sorted(i for i, made in busy.items() if made == now and i != index)
        if index is None:
            index = len(self.configs)
            config["index"] = index
            if alongside:
                config["iterated_with"] = alongside
            self.configs.append(config)
            self._on_new_loader(index, config)
        elif alongside:
            own = set(self.configs[index].get("iterated_with") or ())
            self.configs[index]["iterated_with"] = sorted(own | set(alongside))
        for other in alongside:  # both ways: the record at the end says it of each
            if other < len(self.configs):
                seen = set(self.configs[other].get("iterated_with") or ())
                self.configs[other]["iterated_with"] = sorted(seen | {index})
        try:
            ref: Callable[[], Any] = weakref.ref(loader)
        except TypeError:  # a loader class with __slots__: described again each time
            ref = _dead_ref
        self._ids[key] = (ref, index)
        return index

    def _indices_in_use(self) -> dict[int, int]:
        """Indices of the loaders with an iterator the script is iterating now, each with
        the step count at which the latest such iterator was made.

        An iterator is in use while it is alive, not done (:func:`_iterator_done`) and
        held by something besides trainprof (a ``for`` loop, a ``zip``, a variable). One
        the script dropped early (a ``break`` after N steps) is freed at once, except a
        single-process one that WorkerCapture holds until it has counted its batches
        (:attr:`held_refs`): references beyond ours tell the two apart. Called once per
        new loader object (a few times a run), never per batch.
        """
        busy: dict[int, int] = {}
        live = list(self._iterators)
        for it in live:
            index = self.index_of_iterator(it)
            if index is None or _iterator_done(it):
                continue
            # the references here: `live`, `it`, getrefcount's argument, and trainprof's
            with contextlib.suppress(Exception):
                if sys.getrefcount(it) - 3 - int(self.held_refs(it)) > 0:
                    made = self._iterator_step.get(it, -1)
                    busy[index] = max(busy.get(index, -1), made)
        return busy

    def iterator_created(self, loader: DataLoader, it: Any) -> None:
        index = self.index_of(loader)
        threads = self._threads.setdefault(index, {})
        ident = threading.get_ident()
        if ident not in threads:  # once per thread: a name lookup per epoch at most
            threads[ident] = threading.current_thread().name
        self._iterators.add(it)
        with contextlib.suppress(TypeError):
            self._iterator_index[it] = index
            self._iterator_step[it] = self.step_count()
        self._refresh_pids()

    def index_of_iterator(self, it: Any) -> int | None:
        """The index of the loader ``it`` iterates (None: an iterator made unseen)."""
        try:
            return self._iterator_index.get(it)
        except TypeError:
            return None

    def index_of_receiver(self, found: tuple[str, Any]) -> int | None:
        """The loader index of the iterator receiving a batch, from what
        :func:`trainprof.capture.handoff.calling_iterator` found: the iterator itself, or
        (in the pin-memory thread) its ``_worker_result_queue``."""
        kind, obj = found
        if kind == "iterator":
            return self.index_of_iterator(obj)
        for it in list(self._iterators):
            if getattr(it, "_worker_result_queue", None) is obj:
                return self.index_of_iterator(it)
        return None

    def note_threads(self, training_thread: int) -> None:
        """At the end: name, in each loader's configuration, a thread other than the
        training one that iterated it (``iterated_in_thread``).

        A loader iterated in a thread of its own (a prefetching thread feeding a queue,
        like prefetch_generator's BackgroundGenerator) delivers its batches to the
        training thread through something trainprof does not time: the training thread's
        wait for them is not data wait, but "other". The thread that called ``iter()`` is
        the one recorded (a thread that only calls ``next()`` on an iterator made
        elsewhere is not seen).
        """
        for index, threads in self._threads.items():
            others = [name for ident, name in threads.items() if ident != training_thread]
            if others and index < len(self.configs):
                self.configs[index]["iterated_in_thread"] = others[0]

    def _refresh_pids(self) -> None:
        pids = []
        for it in list(self._iterators):
            for w in getattr(it, "_workers", ()) or ():
                if w.pid is not None:
                    pids.append(w.pid)
        self.all_worker_pids.update(pids)
        self.worker_pids = tuple(pids)
        if self.on_workers is not None:
            with contextlib.suppress(Exception):
                self.on_workers(self.worker_pids)

    def shutdown_workers(self) -> None:
        """Stop the workers of every live iterator (the run is over, however it ended)."""
        for it in list(self._iterators):
            shutdown = getattr(it, "_shutdown_workers", None)
            if shutdown is not None:
                with contextlib.suppress(Exception):
                    shutdown()
        self.worker_pids = ()


class Instrumentation:
    """Installs and removes the patches above around one StepClock."""

    def __init__(
        self, clock: StepClock, loaders: LoaderRegistry, workers: WorkerCapture | None = None
    ) -> None:
        self.clock = clock
        self.loaders = loaders
        self.workers = workers  # worker-side capture (trainprof.capture.worker)
        self._restore: list[tuple[Any, str, Any]] = []
        self._handles: list[Any] = []
        self._gc_cb: Callable[[str, dict[str, Any]], None] | None = None
        #: (our sys.unraisablehook, the one it replaced), while installed
        self._unraisable: tuple[Any, Any] | None = None
        self.installed = False
        self.forward_roots: list[str] = []
        self._compiled_at_install = 0
        #: DistributedDataParallel.no_sync() contexts the script entered (gradient
        #: accumulation without an all-reduce per micro-batch; diagnosis/distributed.py)
        self.ddp_no_sync_calls = 0
        #: the DistributedDataParallel models built, and what their reducers measured
        self.ddp_stats = DDPStats()
        #: the workers' batches received through shared memory (capture/handoff.py)
        self.handoff = HandoffTimer(lambda: clock.owner, loaders.index_of_receiver)
        #: the training thread's own gc.collect() calls (capture/explicit_gc.py)
        self.explicit_gc = ExplicitCollects()
        #: torch.compile's compilations, by step (capture/compile_events.py)
        self.compiles = CompileEvents(lambda: clock.n_steps)
        #: the training thread's activation-checkpointing calls (capture/checkpointing.py)
        self.checkpointing = CheckpointCalls()
        #: how much of the first batches is padding (capture/padding.py)
        self.padding = PaddingProbe(loaders.index_of_iterator)
        #: (pid, name) of the processes the script started, DataLoader workers aside
        self.started_processes: list[tuple[int, str]] = []
        #: records the processes that may train, one run folder each (None: none recorded)
        self.child_runs: ChildRuns | None = None
        #: LOCAL_RANK (or None) of each subprocess that runs the script itself again
        #: (PyTorch Lightning's DDP launcher) and could not be recorded (no child_runs,
        #: or beyond their limit): named in the notes
        self.script_reruns: list[str | None] = []
        #: the first commands of the other subprocesses the script started (a wrapper that
        #: trains in a child: "nothing to measure" names it), at most MAX_SUBPROCESSES
        self.subprocesses: list[list[str]] = []

    def _patch(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        # An inherited attribute (Tensor.item lives on TensorBase) is restored
        # by deleting our override, so the class is left exactly as found.
        own = owner.__dict__.get(name, _INHERITED) if isinstance(owner, type) else _INHERITED
        if own is _INHERITED and not isinstance(owner, type):
            own = getattr(owner, name)
        self._restore.append((owner, name, own))
        setattr(owner, name, make(getattr(owner, name)))

    def install(self) -> None:
        clock = self.clock
        self._compiled_at_install = compiled_frames()  # see _narrow_forward
        get_ident = threading.get_ident
        enter, exit_ = clock.enter, clock.exit
        Tensor = torch.Tensor  # noqa: N806 - a local alias for the hot path
        acc = clock.acc  # one list for the whole run (zeroed in place at each step)

        # The wrappers below run several times per step: their cost is the
        # always-on overhead. The phase transition (StepClock.enter/exit) is
        # written out inline in each, which saves two Python calls per wrapped
        # call; a change to one must be made to all (and to _fastclock.c).

        # -- data wait -----------------------------------------------------
        def make_next(orig: Callable[[Any], Any]) -> Callable[[Any], Any]:
            if FAST:
                return _fastclock.Timed(_fastclock.K_NEXT, clock, orig, DATA,
                                        extra=batch_size_of, tensor_type=Tensor)

            def __next__(it: Any) -> Any:  # noqa: N807 - replaces a dunder
                if get_ident() != clock.owner:
                    return orig(it)
                if clock.bwd_pending:
                    clock.top_level_event()
                now = perf_counter_ns()
                if not clock.started:
                    clock.begin(now)
                prev = clock.current
                acc[prev] += now - clock.mark
                clock.current = DATA
                clock.mark = now
                try:
                    batch = orig(it)
                finally:
                    now = perf_counter_ns()
                    acc[clock.current] += now - clock.mark
                    clock.current = prev
                    clock.mark = now
                # fast path for the usual (tensor, ...) batch; else the general walk
                cls = type(batch)
                if (cls is list or cls is tuple) and batch and type(batch[0]) is Tensor:
                    shape = batch[0].shape
                    acc[SAMPLES] += shape[0] if shape else 1
                else:
                    acc[SAMPLES] += batch_size_of(batch)
                return batch

            return __next__

        self._patch(_dl._BaseDataLoaderIter, "__next__", make_next)

        loaders = self.loaders

        def make_iter(orig: Callable[[Any], Any]) -> Callable[[Any], Any]:
            def __iter__(loader: Any) -> Any:  # noqa: N807
                # Making the iterator is data loading: with workers that are not
                # persistent it forks them all, every epoch (15-25 ms for 2 workers
                # on this project's VM), time the loop waits on the pipeline just as
                # on a batch. Counted as "other" it hid most of what
                # persistent_workers=True saves. Once per epoch: plain Python.
                # The reads made here are torch's own (the seed it shares with the
                # workers: an .item() per epoch), not the loop's.
                if get_ident() == clock.owner and not clock.in_read:
                    if clock.bwd_pending:
                        clock.top_level_event()
                    prev = enter(DATA)
                    clock.in_read = True
                    try:
                        it = orig(loader)
                    finally:
                        clock.in_read = False
                        exit_(prev)
                else:
                    it = orig(loader)
                with contextlib.suppress(Exception):
                    loaders.iterator_created(loader, it)
                return it

            return __iter__

        self._patch(DataLoader, "__iter__", make_iter)
        # -- the hand-over of workers' batches (capture/handoff.py) ---------
        import torch.multiprocessing.reductions as reductions

        for name in REBUILDERS:
            if callable(getattr(reductions, name, None)):
                self._patch(reductions, name, self.handoff.wrap)
        # -- how much of the batches is padding (capture/padding.py) --------
        self.padding.install(self._patch)
        if self.workers is not None:
            # what the workers (or, with num_workers=0, this process) spend on each sample
            self.workers.install(self._patch, loaders.index_of)
            loaders.held_refs = self.workers.holds
        loaders.step_count = lambda: clock.n_steps

        # -- forward (outermost module call only) --------------------------
        # For the first DISCOVERY_STEPS steps every module call goes through
        # the wrapper on nn.Module, which notes the classes of top-level
        # calls (the model, the loss). Then the wrapper moves onto those root
        # classes only, so nested module calls (most of them) run unwrapped.
        roots: dict[type, None] = {}
        discovering = [True]

        def make_call(orig: Callable[..., Any]) -> Callable[..., Any]:
            if FAST and not discovering[0]:
                return _fastclock.Timed(_fastclock.K_CALL, clock, orig, FORWARD,
                                        dev_begin=FWD_BEGIN, dev_end=FWD_END)

            def __call__(module: Any, /, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
                if is_compiling():  # Dynamo tracing a module inside a compiled one
                    return orig(module, *args, **kwargs)
                if clock.current != OTHER or get_ident() != clock.owner:
                    return orig(module, *args, **kwargs)
                if discovering[0]:
                    roots[type(module)] = None
                    if clock.n_steps >= DISCOVERY_STEPS:
                        discovering[0] = False
                        self._narrow_forward(list(roots), make_call)
                if clock.bwd_pending:
                    clock.top_level_event()
                # a model called in eval mode, with autograd on or off (eval_autograd.py)
                grad = (clock.grad_enabled() if getattr(module, "training", True) is False
                        and clock.grad_enabled is not None else None)
                now = perf_counter_ns()
                if not clock.started:
                    clock.begin(now)
                acc[OTHER] += now - clock.mark  # the current phase was OTHER (tested above)
                clock.current = FORWARD
                clock.mark = now
                entered = now
                dev = clock.device
                if dev is not None:
                    dev.mark(FWD_BEGIN)
                no_grad = grad is True and clock.eval_no_grad
                done = False  # eval calls are counted when they return, as in the C path
                try:
                    if no_grad:
                        with torch.no_grad():
                            out = orig(module, *args, **kwargs)
                    else:
                        out = orig(module, *args, **kwargs)
                    done = True
                    return out
                finally:
                    if dev is not None:
                        dev.mark(FWD_END)
                    now = perf_counter_ns()
                    acc[clock.current] += now - clock.mark
                    clock.current = OTHER
                    clock.mark = now
                    if done and grad is True:
                        clock.eval_grad_n += 1
                        clock.eval_grad_ns += now - entered
                    elif done and grad is False:
                        clock.eval_nograd_n += 1
                        clock.eval_nograd_ns += now - entered

            return __call__

        clock.grad_enabled = torch.is_grad_enabled
        self._patch(torch.nn.Module, "__call__", make_call)

        # -- backward ------------------------------------------------------
        def make_backward(orig: Callable[..., Any]) -> Callable[..., Any]:
            if FAST:
                return _fastclock.Timed(_fastclock.K_BACKWARD, clock, orig, BACKWARD,
                                        dev_begin=BWD_BEGIN, dev_end=BWD_END)

            def backward(*args: Any, **kwargs: Any) -> Any:
                if get_ident() != clock.owner:
                    return orig(*args, **kwargs)
                if clock.bwd_pending and clock.current == OTHER:
                    # a script with no DataLoader or module calls still gets
                    # backward-delimited steps: the next backward closes one
                    clock.top_level_event()
                now = perf_counter_ns()
                if not clock.started:
                    clock.begin(now)
                prev = clock.current
                acc[prev] += now - clock.mark
                clock.current = BACKWARD
                clock.mark = now
                dev = clock.device if prev == OTHER else None
                if dev is not None:
                    dev.mark(BWD_BEGIN)
                try:
                    return orig(*args, **kwargs)
                finally:
                    if dev is not None:
                        dev.mark(BWD_END)
                    now = perf_counter_ns()
                    acc[clock.current] += now - clock.mark
                    clock.current = prev
                    clock.mark = now
                    if clock.bwd_track:
                        clock.bwd_pending = True

            return backward

        self._patch(torch.autograd, "backward", make_backward)
        self._patch(torch.autograd, "grad", make_backward)

        # -- optimizer step and zero_grad ----------------------------------
        def timed_closure(closure: Callable[..., Any]) -> Callable[..., Any]:
            """The step's closure, run at the step's top level (see the module docstring).

            On CUDA, the optimizer's device span is closed around it (``OPT_END`` ...
            ``OPT_BEGIN``), so that the forward and backward spans inside do not nest
            in the optimizer's: the device timer adds the spans up.
            """
            if FAST:
                return _fastclock.Timed(_fastclock.K_PHASE, clock, closure, OTHER,
                                        dev_begin=OPT_END, dev_end=OPT_BEGIN)

            def run(*args: Any, **kwargs: Any) -> Any:  # once a step: clock methods do
                if get_ident() != clock.owner:
                    return closure(*args, **kwargs)
                prev = enter(OTHER)
                dev = clock.device
                if dev is not None:
                    dev.mark(OPT_END)
                try:
                    return closure(*args, **kwargs)
                finally:
                    if dev is not None:
                        dev.mark(OPT_BEGIN)
                    exit_(prev)

            run.trainprof_closure = True  # type: ignore[attr-defined]
            return run

        def with_timed_closure(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            """The step's ``(args, kwargs)`` with its closure timed, or None: no closure.

            ``args`` starts with the optimizer itself (torch passes the step's own
            arguments); ``closure`` is the one argument of ``Optimizer.step``.
            """
            if len(args) > 1:
                if callable(args[1]) and not _is_timed_closure(args[1]):
                    return (args[0], timed_closure(args[1]), *args[2:]), kwargs
            else:
                closure = kwargs.get("closure")
                if closure is not None and callable(closure) and not _is_timed_closure(closure):
                    return args, {**kwargs, "closure": timed_closure(closure)}
            return None

        def pre_hook(optimizer: Any, args: Any, kwargs: Any) -> Any:
            if get_ident() == clock.owner:
                outermost = True
                if clock.current == OPTIMIZER:
                    # (getrefcount counts its own argument and clock.opt_args)
                    if clock.opt_args is not None and sys.getrefcount(clock.opt_args) > 2:
                        # a step inside the open one (a subclass's step calling
                        # super().step(), both hooked; a wrapper optimizer stepping the
                        # one it wraps): one phase, closed by the outermost post-hook.
                        # The open step still runs: torch's wrapper holds its arguments
                        clock.opt_depth += 1
                        outermost = False
                    else:
                        # only the clock holds them: the open step raised (no post-hook)
                        # and the script caught it; close it
                        clock.opt_depth = 0
                        now = perf_counter_ns()
                        acc[OPTIMIZER] += now - clock.mark
                        clock.current = clock.opt_prev
                        clock.mark = now
                if outermost:
                    now = perf_counter_ns()
                    if not clock.started:
                        clock.begin(now)
                    prev = clock.current
                    acc[prev] += now - clock.mark
                    clock.current = OPTIMIZER
                    clock.mark = now
                    clock.opt_prev = prev
                    clock.opt_args = args
                    if clock.device is not None:
                        clock.device.mark(OPT_BEGIN)
                if len(args) > 1 or kwargs:
                    result = with_timed_closure(args, kwargs)
                    if outermost and result is not None:
                        clock.opt_args = result[0]  # what the step now runs with
                    return result
            return None

        def post_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
            if get_ident() != clock.owner:
                if clock.n_steps == 0:  # the first step: this thread may be the training one
                    clock.adopt_thread(get_ident())
                return
            if clock.opt_depth > 0:  # the end of a nested step (see pre_hook)
                clock.opt_depth -= 1
                return
            clock.opt_args = None
            if clock.device is not None:
                clock.device.mark(OPT_END)
            now = perf_counter_ns()
            acc[clock.current] += now - clock.mark
            clock.current = clock.opt_prev
            clock.mark = now
            if id(optimizer) == clock.fast_opt:  # the primary optimizer, steady state
                clock._close(0, now)
            else:
                clock.optimizer_stepped(optimizer, now)

        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        if FAST:
            pre_hook = _fastclock.Timed(_fastclock.K_OPT_PRE, clock, None, OPTIMIZER,
                                        extra=with_timed_closure,
                                        dev_begin=OPT_BEGIN, dev_end=OPT_END)
            post_hook = _fastclock.Timed(_fastclock.K_OPT_POST, clock, None, OPTIMIZER,
                                         dev_begin=OPT_BEGIN, dev_end=OPT_END)
        self._handles.append(register_optimizer_step_pre_hook(pre_hook))
        self._handles.append(register_optimizer_step_post_hook(post_hook))

        # -- optimizer steps a GradScaler skipped ------------------------------
        # Mixed precision's GradScaler.step skips optimizer.step when the scaled
        # gradients hold inf/NaN (often the first few steps, while the scale settles,
        # and then about once per growth_interval): no optimizer hook fires, so the
        # iteration would join the next one as one step of twice the length. Once a
        # step per iteration, so plain Python: AMP steps are milliseconds long.
        def make_scaler_step(orig: Callable[..., Any]) -> Callable[..., Any]:
            def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
                if get_ident() != clock.owner:
                    return orig(scaler, optimizer, *args, **kwargs)
                n_before, opt_before = clock.n_steps, acc[OPTIMIZER]
                out = orig(scaler, optimizer, *args, **kwargs)
                # an optimizer step either closed a step or (a secondary optimizer)
                # added optimizer time; neither means this one was skipped
                if (clock.n_steps == n_before and acc[OPTIMIZER] == opt_before
                        and clock.current == OTHER and clock.started):
                    now = perf_counter_ns()
                    acc[OTHER] += now - clock.mark
                    clock.mark = now
                    clock.optimizer_stepped(optimizer, now, FLAG_SKIPPED)
                return out

            return step

        scaler_cls = getattr(getattr(torch, "amp", None), "GradScaler", None)
        if isinstance(scaler_cls, type) and callable(getattr(scaler_cls, "step", None)):
            self._patch(scaler_cls, "step", make_scaler_step)

        def make_zero_grad(orig: Callable[..., Any]) -> Callable[..., Any]:
            if FAST:
                return _fastclock.Timed(_fastclock.K_PHASE, clock, orig, ZERO_GRAD)

            def zero_grad(self_: Any, /, *args: Any, **kwargs: Any) -> Any:
                if get_ident() != clock.owner:
                    return orig(self_, *args, **kwargs)
                now = perf_counter_ns()
                if not clock.started:
                    clock.begin(now)
                prev = clock.current
                acc[prev] += now - clock.mark
                clock.current = ZERO_GRAD
                clock.mark = now
                try:
                    return orig(self_, *args, **kwargs)
                finally:
                    now = perf_counter_ns()
                    acc[clock.current] += now - clock.mark
                    clock.current = prev
                    clock.mark = now

            return zero_grad

        self._patch(torch.optim.Optimizer, "zero_grad", make_zero_grad)
        self._patch(torch.nn.Module, "zero_grad", make_zero_grad)

        # -- host reads / syncs --------------------------------------------
        def make_read(orig: Callable[..., Any]) -> Callable[..., Any]:
            if FAST:
                return _fastclock.Timed(_fastclock.K_READ, clock, orig, OPTIMIZER)

            # A read of a CPU tensor inside the optimizer step is torch's own bookkeeping
            # (Adam and AdamW read each parameter's step counter with .item()), not one the
            # script makes: counted, it made every Adam run report as many host reads per
            # step as the model has parameter tensors. So are those inside the
            # DataLoader's next() (its sampler's seed and permutation each epoch, or the
            # dataset's) and iter() (see make_iter), and other threads'.
            # A read inside a read is the same read: a TorchFunctionMode (trainprof's own
            # op count, or the script's) hands Tensor.item back to torch.Tensor.item, this
            # wrapper, from inside the first call; counted there, it was two reads.
            def read(tensor: Any, /, *args: Any, **kwargs: Any) -> Any:
                mine = get_ident() == clock.owner
                if mine:
                    if clock.in_read:
                        return orig(tensor, *args, **kwargs)
                    clock.in_read = True
                t0 = perf_counter_ns()
                try:
                    out = orig(tensor, *args, **kwargs)
                finally:
                    if mine:
                        clock.in_read = False
                if not tensor.is_cpu:
                    acc[HOST_READS] += 1
                    acc[SYNC_N] += 1
                    acc[SYNC_NS] += perf_counter_ns() - t0
                elif mine and clock.current != OPTIMIZER and clock.current != DATA:
                    acc[HOST_READS] += 1
                return out

            return read

        for name in ("item", "tolist", "numpy", "cpu"):
            self._patch(torch.Tensor, name, make_read)

        def make_sync(orig: Callable[..., Any]) -> Callable[..., Any]:
            if FAST:
                return _fastclock.Timed(_fastclock.K_SYNC, clock, orig, OTHER)

            def synchronize(*args: Any, **kwargs: Any) -> Any:
                t0 = perf_counter_ns()
                out = orig(*args, **kwargs)
                acc[SYNC_N] += 1
                acc[SYNC_NS] += perf_counter_ns() - t0
                return out

            return synchronize

        self._patch(torch.cuda, "synchronize", make_sync)

        # -- processes the script starts -----------------------------------
        # Those that may train (torch.multiprocessing.spawn, a Process per rank) are
        # recorded in RUN_DIR/ranks/<k>/ (trainprof.capture.ranks); the others are
        # named in the summary's notes (Recorder._notes).
        started = self.started_processes
        child_runs = self.child_runs

        def make_start(orig: Callable[[Any], None]) -> Callable[[Any], None]:
            def start(process: Any) -> None:
                loader_worker = getattr(process, "_target", None) is _worker_loop
                if child_runs is not None and not loader_worker:
                    child_runs.prepare(process)
                orig(process)  # (which drops process._target)
                if not loader_worker:
                    with contextlib.suppress(Exception):
                        started.append((int(process.pid), str(process.name)))

            return start

        self._patch(multiprocessing.process.BaseProcess, "start", make_start)

        # A subprocess that runs this same script again: PyTorch Lightning's DDP
        # launcher starts ranks 1.. so, `[python, script, *argv]` with LOCAL_RANK set.
        # It runs under `trainprof run` into ranks/<LOCAL_RANK> (ChildRuns.rerun); one
        # that cannot be recorded is noted. And a rank that a launcher running here starts
        # (torchrun's elastic agent: `[python, -u, train.py, *argv]` with RANK and
        # TORCHELASTIC_RUN_ID set) runs under `trainprof run` into ranks/<RANK>
        # (ChildRuns.launched_rank).
        reruns = self.script_reruns
        popen_commands = self.subprocesses  # (`started` is the processes' list, above)

        def make_popen(orig: Callable[..., None]) -> Callable[..., None]:
            def __init__(popen: Any, args: Any, *rest: Any, **kwargs: Any) -> None:  # noqa: N807
                with contextlib.suppress(Exception):
                    env = kwargs.get("env")
                    env = env if isinstance(env, Mapping) else os.environ
                    launched = (child_runs.launched_rank(args, env)
                                if child_runs is not None and _runs_python(args) else None)
                    if launched is not None:
                        # a rank of torchrun (or accelerate launch) this process runs
                        if "-u" in [os.fsdecode(a) for a in args[1:3]]:
                            kwargs["env"] = {**env, "PYTHONUNBUFFERED": "1"}
                        args = launched
                    elif _runs_this_script(args):
                        local = env.get("LOCAL_RANK")
                        command = None if child_runs is None else child_runs.rerun(args, local)
                        if command is None:
                            reruns.append(local)
                        else:
                            args = command
                    elif (len(popen_commands) < MAX_SUBPROCESSES
                          and not _started_by_trainprof()):
                        popen_commands.append(_command_words(args))
                orig(popen, args, *rest, **kwargs)

            return __init__

        self._patch(subprocess.Popen, "__init__", make_popen)

        # -- DDP's no_sync(): gradient accumulation that skips the all-reduce ------
        ddp = getattr(getattr(torch.nn, "parallel", None), "DistributedDataParallel", None)
        if isinstance(ddp, type) and callable(getattr(ddp, "no_sync", None)):

            def make_no_sync(orig: Callable[..., Any]) -> Callable[..., Any]:
                @functools.wraps(orig)
                def no_sync(module: Any) -> Any:
                    self.ddp_no_sync_calls += 1
                    return orig(module)

                return no_sync

            self._patch(ddp, "no_sync", make_no_sync)

            # -- DDP's own timing of its all-reduce (trainprof.capture.ddp_stats) ----
            def make_ddp_init(orig: Callable[..., Any]) -> Callable[..., Any]:
                @functools.wraps(orig)
                def __init__(module: Any, /, *args: Any, **kwargs: Any) -> None:  # noqa: N807
                    orig(module, *args, **kwargs)
                    self.ddp_stats.add(module)

                return __init__

            self._patch(ddp, "__init__", make_ddp_init)

            dist = getattr(torch, "distributed", None)
            if callable(getattr(dist, "destroy_process_group", None)):

                def make_destroy(orig: Callable[..., Any]) -> Callable[..., Any]:
                    @functools.wraps(orig)
                    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
                        with contextlib.suppress(Exception):
                            self.ddp_stats.poll()  # the models' last figures, while alive
                        return orig(*args, **kwargs)

                    return destroy_process_group

                self._patch(dist, "destroy_process_group", make_destroy)

        # -- garbage collection --------------------------------------------
        def on_gc(phase: str, info: dict[str, Any]) -> None:
            # GC before the first step (imports, dataset set-up) must not start the clock.
            if get_ident() != clock.owner or not clock.started:
                return
            if phase == "start":
                clock.gc_prev = enter(GC)
            elif clock.current == GC:
                exit_(clock.gc_prev)
                acc[GC_N] += 1
                if info.get("generation") == 2:
                    acc[GC_GEN2_N] += 1

        self._gc_cb = on_gc
        gc.callbacks.append(on_gc)
        # CPython ignores exceptions raised in gc callbacks, and a signal handler may run
        # anywhere in one (from its first instruction, before any try of its own): a Ctrl-C
        # or SIGTERM raised there reaches the "Exception ignored" report, and is delivered
        # again from it. A script whose set-up made garbage for seconds lost its Ctrl-C (it
        # trained to the end, exit 0) and had its SIGTERM held to the first step.
        previous_hook = sys.unraisablehook

        def unraisable(report: Any) -> None:
            kind = getattr(report, "exc_type", None)
            if (getattr(report, "object", None) is on_gc and isinstance(kind, type)
                    and issubclass(kind, KeyboardInterrupt | Terminated)):
                # flagged from another thread, once this hook has returned: flagged here,
                # the handler would run at this hook's next instruction and be ignored again
                # (_thread's: threading's start() waits for the thread, here, in the hook)
                sig = signal.SIGTERM if issubclass(kind, Terminated) else signal.SIGINT
                _thread.start_new_thread(_signal_again, (sig,))
                return
            previous_hook(report)

        self._unraisable = (unraisable, previous_hook)
        sys.unraisablehook = unraisable

        explicit = self.explicit_gc

        def make_collect(orig: Callable[..., int]) -> Callable[..., int]:
            def collect(*args: Any, **kwargs: Any) -> int:
                # a call of the training thread's, not trainprof's own: timed, by line
                if get_ident() != clock.owner or not clock.started:
                    return orig(*args, **kwargs)
                frame = explicit.caller()
                if frame is None or explicit.is_own(frame.f_code.co_filename) or (
                        explicit.is_compiler(frame.f_code.co_filename)):
                    return orig(*args, **kwargs)
                code = frame.f_code
                lineno = frame.f_lineno
                t0 = perf_counter_ns()
                try:
                    return orig(*args, **kwargs)
                finally:
                    explicit.add(code.co_filename, lineno, perf_counter_ns() - t0,
                                 clock.n_steps)

            collect.__doc__ = orig.__doc__
            return collect

        self._patch(gc, "collect", make_collect)

        # -- torch.compile's compilations (capture/compile_events.py) ---------
        compiles = self.compiles

        def make_compile(orig: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(orig)
            def compile(*args: Any, **kwargs: Any) -> Any:  # noqa: A001 - torch's name
                compiled = orig(*args, **kwargs)  # imports Dynamo
                compiles.register()
                return compiled

            return compile

        self._patch(torch, "compile", make_compile)

        # -- activation checkpointing (capture/checkpointing.py) -------------
        import torch.utils.checkpoint as checkpoint_module

        ckpt = self.checkpointing

        def make_checkpoint(orig: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(orig)
            def checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
                # the outermost call of the training thread: its first pass, timed (a
                # reentrant region's recomputation calls the checkpoints inside it again,
                # in backward: not counted twice)
                if (ckpt.depth or get_ident() != clock.owner or clock.current == BACKWARD
                        or is_compiling()):
                    return orig(function, *args, **kwargs)
                ckpt.depth += 1
                if clock.bwd_pending and clock.current == OTHER:
                    clock.top_level_event()  # a region begins a backward-delimited step
                t0 = perf_counter_ns()
                if not clock.started:
                    # a region that begins the run begins its first step: its first call
                    # (which imports torch._dynamo, 0.9 s) is the step's, not before it
                    clock.begin(t0)
                try:
                    return orig(function, *args, **kwargs)
                finally:
                    ckpt.depth -= 1
                    ckpt.add(perf_counter_ns() - t0, clock.n_steps, kwargs.get("use_reentrant"),
                             bool(clock.extra_flags & FLAG_PROFILED))

            return checkpoint

        if callable(getattr(checkpoint_module, "checkpoint", None)):
            self._patch(checkpoint_module, "checkpoint", make_checkpoint)
        self.installed = True
        global _FORK_HOOK
        _INSTALLED.add(self)
        if not _FORK_HOOK:
            os.register_at_fork(after_in_child=_uninstall_in_child)
            _FORK_HOOK = True

    def _narrow_forward(
        self, root_classes: list[type], make_call: Callable[[Any], Any]
    ) -> None:
        """Move the forward wrapper from nn.Module onto the root classes seen so far.

        Trade-off: a module class first called at top level after discovery
        (say, an EMA copy of another class) is not timed as forward; its time
        shows as "other".

        Not once ``torch.compile`` has compiled a frame while the wrapper was on
        nn.Module (since :meth:`install`): Dynamo inlined the
        wrapper into it (as ``return orig(...)``: the wrapper's first test is
        ``torch.compiler.is_compiling()``) and guards on ``nn.Module.__call__``
        being that function, so taking it off would recompile every compiled
        model once more (a second full compile of a large model). The wrapper
        stays on nn.Module then; inside compiled code it costs nothing, and an
        eager module call pays its two tests (a nested nn.Identity call took 1.2
        µs with the wrapper, 0.82 µs without, on this project's 2-core VM).
        """
        self.forward_roots = [f"{c.__module__}.{c.__qualname__}" for c in root_classes]
        if compiled_frames() > self._compiled_at_install:
            return
        for i, (owner, name, original) in enumerate(self._restore):
            if owner is torch.nn.Module and name == "__call__":
                del self._restore[i]
                setattr(owner, name, original)
                break
        for cls in root_classes:
            if cls is not torch.nn.Module:
                self._patch(cls, "__call__", make_call)

    def _after_fork_in_child(self) -> None:
        """DataLoader workers (forked) run the original, uninstrumented code."""
        if self.installed:
            self.uninstall()

    def uninstall(self) -> None:
        if not self.installed:
            return
        self.installed = False
        _INSTALLED.discard(self)
        if self.workers is not None:
            self.workers.close()  # last write of num_workers=0 timings (no-op in a fork child)
        for owner, name, original in reversed(self._restore):
            if original is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._restore.clear()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._gc_cb is not None and self._gc_cb in gc.callbacks:
            gc.callbacks.remove(self._gc_cb)
        self._gc_cb = None
        if self._unraisable is not None:
            ours, previous = self._unraisable
            if sys.unraisablehook is ours:
                sys.unraisablehook = previous
            self._unraisable = None
        self.compiles.unregister()
