"""The step clock: where every nanosecond of a training step went.

The clock keeps one *current phase*. Entering a phase charges
the time since the last transition to the phase that was current, so time is
attributed *exclusively*: GC that runs inside ``forward`` counts as GC, not as
forward, and the phases of a step always add up to the step's wall time
exactly ("other" is the time spent at top level, outside any tracked phase).
This is the same exclusive-time convention as the PyTorch-profiler TensorBoard
plugin's step-time breakdown, applied to host phases.

Step boundaries come from three sources, decided at run time:

* ``optimizer``: the post-hook of the *primary* optimizer (the first one seen
  to step). Other optimizers (a GAN's second one) do not split steps; if the
  primary stops stepping while another one keeps stepping, the other becomes
  primary.
* ``backward``: scripts without a ``torch.optim`` optimizer (manual
  ``param.data.add_`` updates) are delimited by ``backward()`` calls: a step
  closes when data loading or a top-level forward begins after a backward.
  Until the clock has seen an optimizer step it cannot know which kind of
  script it is, so backward-delimited sub-steps are kept as cumulative
  snapshots and merged into one step if an optimizer step arrives (gradient
  accumulation), or emitted as steps once :data:`AUTO_DECIDE_AFTER` of them
  have passed without any optimizer step.
* ``manual``: :meth:`StepClock.step` from the Python API; once used, automatic
  boundaries are off.

The hot path only does integer arithmetic on a flat list; finished steps are
appended to a flat int64 array that a background thread drains to disk (see
:mod:`trainprof.store`).

Two implementations of the hot path, one behaviour
--------------------------------------------------
The phase transitions run several times per step, so their cost is the
always-on overhead (budget: 1% of a ~1 ms step, about 8 µs for everything).
The state they touch (``current``, ``mark``, ``acc``, the step counters) lives
in the base class of :class:`StepClock`: ``ClockCore`` from the C extension
``trainprof.capture._fastclock`` (``src/trainprof/capture/_fastclock.c``)
when it was built, whose ``Timed`` wrappers (installed by
:mod:`trainprof.capture.hooks`) time a call with no Python frame of their own
and close a step without leaving C; otherwise :class:`_PyCore` below, with the
same attributes and methods, and Python closures as the wrappers. Measured
(``benchmarks/overhead_instructions.py``, instructions of the training thread
per step of its loop): the clock and its hooks add about 4-6k with the
extension, 44k without; 54k before the hot path was rewritten (enter/exit
called as methods, ``array.extend`` of a tuple per step, two Python optimizer
hooks), 10k with the extension before its accumulators and step records moved
into its C struct. ``TRAINPROF_PURE_PYTHON=1`` forces the pure-Python path
(``tests/test_fastclock.py`` runs the same loops under both).
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import weakref
from array import array
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any

from trainprof.capture.window import NEVER
from trainprof.schema import (
    DATA,
    FLAG_BACKWARD,
    FLAG_MANUAL,
    FLAG_PARTIAL,
    FLAG_PROFILED,
    GC,
    GC_GEN2_N,
    GC_N,
    HOST_READS,
    N_ACC,
    N_PHASES,
    OTHER,
    RECORD_WIDTH,
    SAMPLES,
    SYNC_N,
    SYNC_NS,
)

#: Backward-delimited sub-steps seen without any optimizer step before the
#: clock decides the script has no optimizer. Large enough for gradient
#: accumulation over 64 micro-batches, small enough to be decided early.
AUTO_DECIDE_AFTER = 64

#: A manual step shorter than this with nothing timed in it is no step (see
#: :meth:`StepClock._empty`): two ``prof.step()`` calls with no code between take a few
#: microseconds; the shortest real steps, tens of them and a timed phase.
EMPTY_STEP_NS = 100_000


#: Accumulators that say nothing of a manual step's work (:meth:`StepClock._empty`).
_NOT_WORK = frozenset({OTHER, GC, GC_N, GC_GEN2_N})

#: One step record as native int64s: ``array.frombytes`` of one packed record
#: costs a tenth of ``array.extend`` of a tuple, which converts item by item.
_RECORD = struct.Struct(f"={RECORD_WIDTH}q")
#: Zeroed accumulators: slice-assignable to the C core's int64 view and to a list.
_ZEROS = array("q", bytes(8 * N_ACC))


class _PyCore:
    """The clock's hot state and phase transitions, in Python (the fallback of ``ClockCore``).

    ``acc`` is one list for the whole run, zeroed in place at each step
    boundary, so that the hooks can hold it directly. ``fast_opt`` is the
    ``id`` of the optimizer whose post-hook closes a step with no further
    checks (0: none; see :meth:`StepClock.optimizer_stepped`); ``bwd_track``
    says whether ``backward()`` calls delimit steps (modes ``auto`` and
    ``backward``).
    """

    current: int
    mark: int
    started: bool
    acc: list[int]
    _records: array[int]
    n_steps: int
    step_start: int
    origin_ns: int
    extra_flags: int
    next_watch: int
    device: Any
    in_read: bool

    def _init_core(self) -> None:
        """The hot state the C core keeps in its own struct: here a list and an array."""
        self.acc = [0] * N_ACC  # the same list all run long: the hooks hold it
        self._records = array("q")
        # the training thread is inside a host read (hooks.make_read counts a read once),
        # or in DataLoader.__iter__ (its reads are torch's own)
        self.in_read = False

    def begin(self, now: int) -> None:
        """Abstract here: StepClock (the subclass) defines it; this base holds the hot path only."""
        raise NotImplementedError

    def _append_record(self, data: bytes) -> None:
        """Append whole records (native int64s): ``array.frombytes``, one C call."""
        self._records.frombytes(data)

    def drain_records(self) -> bytes:
        """The finished step records since the last drain (native int64s).

        Called from the Recorder's thread: the training thread only ever extends the
        end by whole records, so the first ``n`` stay intact between the two calls.
        """
        buf = self._records
        n = len(buf)
        data = buf[:n].tobytes()
        del buf[:n]
        return data

    def peek_records(self) -> bytes:
        """The undrained step records (native int64s), left in place."""
        return self._records.tobytes()

    def enter(self, phase: int) -> int:
        """Make ``phase`` current; returns the phase to give back to :meth:`exit`.

        The caller keeps the previous phase in its own frame (no shared
        stack), so nesting is whatever the call structure is.
        """
        now = perf_counter_ns()
        if not self.started:
            self.begin(now)
        prev = self.current
        self.acc[prev] += now - self.mark
        self.current = phase
        self.mark = now
        return prev

    def exit(self, prev: int) -> int:
        """Leave the current phase for ``prev``; returns the time of the transition."""
        now = perf_counter_ns()
        self.acc[self.current] += now - self.mark
        self.current = prev
        self.mark = now
        return now

    def _close(self, flags: int, now: int | None = None) -> None:
        """End the current step at ``now`` (default: this instant, charging the time since
        the last transition to the current phase)."""
        acc = self.acc
        if now is None:
            now = perf_counter_ns()
            acc[self.current] += now - self.mark
            self.mark = now
        start = self.step_start
        n = self.n_steps
        self._records.frombytes(
            _RECORD.pack(n, start - self.origin_ns, now - start, *acc, flags | self.extra_flags)
        )
        acc[:] = _ZEROS
        self.n_steps = n = n + 1
        self.step_start = now
        if self.device is not None:
            self.device.step_closed(n - 1)
        if n >= self.next_watch:
            self._watch()  # type: ignore[attr-defined]


#: The ``_fastclock.VERSION`` this module is written for (a stale build is not used).
_FAST_VERSION = 7


def _core_class() -> type:
    if os.environ.get("TRAINPROF_PURE_PYTHON", "") not in ("", "0"):
        return _PyCore
    try:
        from trainprof.capture import _fastclock
    except ImportError:  # built without a C compiler: the pure-Python path
        return _PyCore
    if getattr(_fastclock, "VERSION", None) != _FAST_VERSION:
        return _PyCore  # built from an older _fastclock.c: `pip install -e .` rebuilds it
    _fastclock.configure(n_acc=N_ACC, other=OTHER, samples=SAMPLES, host_reads=HOST_READS,
                         sync_n=SYNC_N, sync_ns=SYNC_NS, data=DATA)
    return _fastclock.ClockCore


_Core: type = _core_class()
#: True when the C extension runs the hot path (see the module docstring).
FAST = _Core is not _PyCore


class StopTraining(BaseException):  # noqa: N818 - a control-flow signal, like KeyboardInterrupt
    """Raised from a step boundary when ``--max-steps`` is reached.

    A ``BaseException`` so that the script's ``except Exception`` does not
    swallow it; its ``finally`` blocks and context managers still run.
    """


class Terminated(BaseException):  # noqa: N818 - a signal, like KeyboardInterrupt
    """SIGTERM arrived (a scheduler's preemption, ``kill``): raised where the signal finds
    the script's main thread, and again at each of its later step boundaries should the
    script swallow it (a bare ``except:`` around a step) - under ``python`` the process
    would have died at once, and a record cannot be closed by a process that trains on."""


class StepClock(_Core):  # type: ignore[misc, valid-type]
    """Exclusive per-phase timing of training steps (see the module docstring)."""

    def __init__(self, max_steps: int | None = None) -> None:
        self.origin_ns = perf_counter_ns()
        self.owner = threading.get_ident()
        self.max_steps = max_steps
        #: SIGTERM arrived: the main thread's next step boundary (the script swallowed the
        #: exception) calls ``on_terminated`` (``trainprof run``: close the record, end the
        #: process), else raises Terminated again
        self.terminated = False
        self.on_terminated: Callable[[], None] | None = None
        # The accumulators and the finished steps (flat: RECORD_WIDTH int64 values
        # each), which the Recorder drains once a second: an int64 buffer, not
        # tuples, so nothing per step for the GC to track and a drain is one copy.
        # In the C core's struct, or a list and an array (_PyCore._init_core).
        self._init_core()
        self.mode = "auto"  # auto | optimizer | backward | manual
        #: the steps closed automatically before the first prof.step(), which the analysis
        #: merges into the first manual step: max_steps and the stop's message skip them
        self.auto_prefix = 0
        self._manual_end = 0  # when the last prof.step() that closed a step returned
        self.n_steps = 0
        self.started = False
        self.current = OTHER
        # phases to restore after hook pairs (optimizer pre/post, GC start/stop)
        self.opt_prev = OTHER
        self.opt_depth = 0  # optimizer steps open inside the open one (hooks.pre_hook)
        self.opt_args: Any = None  # the open optimizer step's arguments (hooks.pre_hook)
        self.gc_prev = OTHER
        self.mark = 0
        self.step_start = 0
        self.bwd_pending = False
        self.bwd_track = True
        self.fast_opt = 0
        #: torch.is_grad_enabled once the model-call hook looks at eval-mode calls (set by
        #: the hooks), else None; the counts and ns of model calls in eval mode with
        #: autograd on and off (trainprof.capture.eval_autograd)
        self.grad_enabled: Any = None
        self.eval_grad_n = self.eval_nograd_n = 0
        self.eval_grad_ns = self.eval_nograd_ns = 0
        #: trainprof tune's eval_no_grad knob: those calls run with autograd off, through
        #: set_grad_enabled (torch._C._set_grad_enabled, set with the knob)
        self.eval_no_grad = False
        self.set_grad_enabled: Any = None
        self._subs: list[tuple[int, list[int]]] = []
        self._primary: int | None = None
        self._others_since_primary: dict[int, int] = {}
        #: per other optimizer, where its first step since the primary's ended (time,
        #: accumulators then): a step boundary if it turns out to be the new primary
        self._other_first_end: dict[int, tuple[int, list[int]]] = {}
        #: a weak reference to each optimizer seen stepping, by id (an id may be reused
        #: once an optimizer is freed: the reference tells)
        self._optimizers_seen: dict[int, weakref.ref[Any]] = {}
        #: called with each optimizer at its first step (the Recorder describes it then:
        #: once per optimizer, in a warm-up step; a script may free it before any flush)
        self.on_new_optimizer: Any = None
        #: a DeviceTimer once CUDA is in use (set by the Recorder), else None
        self.device: Any = None
        #: WindowRunners of heavy tools (see trainprof.capture.window), driven at step counts
        self.windows: list[Any] = []
        #: the step count at which _watch runs next (max steps, window transitions)
        self.next_watch = NEVER if max_steps is None else min(max_steps, NEVER)
        self._at_first_step: list[Callable[[], None]] = []  # (see at_first_step)
        self._at_begin: list[Callable[[], None]] = []  # (see at_begin)
        #: flags OR-ed into every step record (FLAG_PROFILED while a tool is on)
        self.extra_flags = 0
        self._cooldown = 0
        #: set when --max-steps stopped the script: what runs after is teardown, not a step
        self.stopped = False
        #: the name of the thread the clock moved to, if it did (adopt_thread)
        self.adopted_thread: str | None = None

    def begin(self, now: int) -> None:
        """Start the first step at the first instrumented event of the run.

        Import time and set-up before the loop are not part of any step.
        """
        self.started = True
        self.mark = now
        self.step_start = now
        if self._at_begin:
            calls, self._at_begin = self._at_begin, []
            for call in calls:
                with contextlib.suppress(Exception):
                    call()

    def adopt_thread(self, ident: int) -> bool:
        """Measure thread ``ident`` from now on: the run's first optimizer step ran there.

        The clock measures one thread: the one that started it (under ``trainprof
        run``, the main thread). A script that trains in a thread of its own (a GUI or
        a server around the loop, a watchdog in the main thread) would show no step at
        all. So while no step has closed, an optimizer step in another thread moves
        the clock there (the global post-hook calls this): what the first thread
        accumulated is dropped, and the next event in the new thread begins the first
        step (the one in progress, already partly past, is not counted). Manual steps
        (``prof.step()``) keep the thread that calls them, and so does a thread that is
        inside a timed phase right now (its wrapper will still close that phase): the
        next optimizer step of the other thread tries again.
        """
        if (self.n_steps or self.mode == "manual" or ident == self.owner
                or self.current != OTHER):
            return False
        # called from the post-hook, in the thread that stepped
        self.adopted_thread = threading.current_thread().name
        self.owner = ident
        self.started = False
        self.current = OTHER
        self.opt_depth = 0
        self.opt_args = None
        self.bwd_pending = False
        self._subs.clear()
        acc = self.acc
        for i in range(len(acc)):
            acc[i] = 0
        return True

    # -- step boundaries ---------------------------------------------------
    def top_level_event(self) -> None:
        """Called when data loading, a top-level forward or a top-level backward begins.

        Closes a backward-delimited step if a backward ran since the last one.
        """
        if self.bwd_pending:
            self.bwd_pending = False
            self._backward_boundary()

    def backward_done(self) -> None:
        if self.bwd_track:
            self.bwd_pending = True

    def _set_mode(self, mode: str) -> None:
        self.mode = mode
        self.bwd_track = mode in ("auto", "backward")
        if mode != "optimizer":
            self.fast_opt = 0

    def optimizer_stepped(self, optimizer: object, now: int, flags: int = 0) -> None:
        """Global optimizer post-hook: close the step if this is the primary optimizer.

        ``now`` is when the optimizer step ended (the hook has already charged
        the time up to it). The common case, one optimizer in steady state, is
        decided by the hook itself: when ``id(optimizer) == fast_opt`` it calls
        :meth:`_close` directly; ``fast_opt`` is set here once the primary
        optimizer is known and no other one stepped since its last step.
        ``flags``: FLAG_SKIPPED when a GradScaler skipped the step (the hooks did not
        fire; see :mod:`trainprof.capture.hooks`).
        """
        key = id(optimizer)
        known = self._optimizers_seen.get(key)
        if known is None or known() is not optimizer:
            self._note_optimizer(key, optimizer)
        if key == self._primary and self.mode == "optimizer" and not self._others_since_primary:
            self.fast_opt = key
            self._close(flags, now)
            return
        if self.mode == "manual" or not self.started:
            return
        if self._primary is None:
            self._primary = key
        elif key != self._primary:
            seen = self._others_since_primary.get(key, 0) + 1
            self._others_since_primary[key] = seen
            self.fast_opt = 0  # the primary's next step must come through here
            if seen < 2:
                # a second optimizer of the same iteration (a GAN's), or the first step of
                # one that replaces the primary (a new phase, an optimizer made anew each
                # epoch): its next step tells; keep this end as the step boundary it may be
                self._other_first_end[key] = (now, list(self.acc))
                return
            self._primary = key  # the old primary stopped stepping
            first = self._other_first_end.get(key)
            if first is not None:
                self._split_at(*first, flags)
        self._others_since_primary.clear()
        self._other_first_end.clear()
        self._set_mode("optimizer")
        self.fast_opt = key
        self.bwd_pending = False
        self._subs.clear()
        self._close(flags, now)

    def _note_optimizer(self, key: int, optimizer: object) -> None:
        try:
            ref = weakref.ref(optimizer)
        except TypeError:  # a class with __slots__ and no __weakref__: not described
            return
        self._optimizers_seen[key] = ref
        if self.on_new_optimizer is not None:
            self.on_new_optimizer(optimizer)

    @property
    def primary_optimizer(self) -> int | None:
        """id() of the optimizer whose steps delimit steps (None: none yet)."""
        return self._primary

    def optimizer_ref(self, optimizer: Any) -> Any:
        """The weak reference this clock holds to ``optimizer`` (made if it holds none)."""
        ref = self._optimizers_seen.get(id(optimizer))
        return ref if ref is not None and ref() is optimizer else weakref.ref(optimizer)

    def primary_optimizer_ref(self) -> Any:
        """The clock's weak reference to the optimizer whose steps delimit steps (None: none
        yet). The reference names it after it died too (a recorder's last look, at the end
        of a run, may come after the script's objects were collected); a later optimizer at
        the same address gets a reference of its own."""
        return self._optimizers_seen.get(self._primary) if self._primary is not None else None

    def primary_optimizer_object(self) -> Any:
        """The optimizer whose steps delimit steps, while it lives (None: none, or gone).

        Its ``id`` alone does not name it: a script that builds an optimizer per epoch
        gets the same addresses back, and an earlier optimizer's id can equal it.
        """
        ref = self._optimizers_seen.get(self._primary) if self._primary is not None else None
        return ref() if ref is not None else None

    def _split_at(self, t: int, snap: list[int], flags: int) -> None:
        """Close the step at an earlier instant ``t`` (accumulators ``snap`` then): the
        open step spans two iterations whose boundary is known only now."""
        if not self.step_start < t <= self.mark:
            return
        self._append(self.step_start, t - self.step_start, snap, flags)
        self.acc[:] = array("q", [a - b for a, b in zip(self.acc, snap, strict=True)])
        self.step_start = t

    def manual_step(self) -> None:
        """Explicit boundary from ``prof.step()``; turns automatic boundaries off.

        Steps closed automatically before the first call are kept as they are;
        the analysis merges them into the first manual step
        (:func:`trainprof.analysis.steps.complete_steps`), and so ``max_steps``
        counts them with it as one (:attr:`auto_prefix`): the user's first
        iteration is one step, not an optimizer step and a sliver up to
        ``prof.step()``. A manual step with nothing in it (see :meth:`_empty`) is
        not closed: its few microseconds stay in the step that goes on.
        """
        if not self.started:
            self.begin(perf_counter_ns())
            self._set_mode("manual")
            return
        if self.mode == "manual":
            if self._empty():
                return
        elif self.n_steps:
            # the first call after automatic steps: they and this one are one step
            self.auto_prefix = self.n_steps
            if self.max_steps is not None:
                self.max_steps += self.auto_prefix
        self._set_mode("manual")
        self.bwd_pending = False
        self._subs.clear()
        self._close(FLAG_MANUAL)
        self._manual_end = perf_counter_ns()

    def _empty(self) -> bool:
        """The open manual step is empty: ``prof.step()`` twice in a row (at the top of the
        loop and again at its end, or twice by mistake). Nothing was timed in it - no
        phase, no region, no counter - and less than :data:`EMPTY_STEP_NS` passed since the
        last call returned: what separates two calls with no code between (from the return:
        the last call may have started a tool's window, whose cost is the new step's). A
        garbage collection in between is no work of a step (the op count's window, set up in
        the last call, once set one off there: 101 steps for 100 iterations). A step of
        untimed work (a sleep, plain tensor code outside any module) lasts longer and is
        kept."""
        since = max(self.step_start, self._manual_end)
        if self.current != OTHER or perf_counter_ns() - since >= EMPTY_STEP_NS:
            return False
        acc = self.acc
        return not any(acc[i] for i in range(N_ACC) if i not in _NOT_WORK)

    def _backward_boundary(self) -> None:
        if self.mode == "backward":
            self._close(FLAG_BACKWARD)
        elif self.mode == "auto":
            now = perf_counter_ns()
            self.acc[self.current] += now - self.mark
            self.mark = now
            self._subs.append((now, list(self.acc)))
            if len(self._subs) >= AUTO_DECIDE_AFTER:
                self._set_mode("backward")
                self._emit_subs()

    def _emit_subs(self) -> None:
        """Turn pending backward-delimited snapshots into steps."""
        prev_t = self.step_start
        prev = [0] * N_ACC
        for t, snap in self._subs:
            diff = [a - b for a, b in zip(snap, prev, strict=True)]
            self._append(prev_t, t - prev_t, diff, FLAG_BACKWARD)
            prev_t, prev = t, snap
        self.acc[:] = array("q", [a - b for a, b in zip(self.acc, prev, strict=True)])
        self.step_start = prev_t
        self._subs.clear()
        self._check_max_steps()

    def _append(self, t_start: int, dur: int, acc: Any, flags: int) -> None:
        self._append_record(
            _RECORD.pack(self.n_steps, t_start - self.origin_ns, dur, *acc,
                         flags | self.extra_flags)
        )
        self.n_steps += 1

    @property
    def records(self) -> array[int]:
        """The undrained step records as a flat int64 array (a copy; for tests and tools)."""
        return array("q", self.peek_records())

    def at_first_step(self, call: Callable[[], None]) -> None:
        """Run ``call`` (in the training thread) once the first step has ended: what only
        concerns the loop, started when the script's set-up is over."""
        self._at_first_step.append(call)
        self.next_watch = min(self.next_watch, max(1, self.n_steps))

    def at_begin(self, call: Callable[[], None]) -> None:
        """Run ``call`` (in the training thread) once, when the first step begins (the run's
        first timed event: a DataLoader batch, a forward, a backward), or at once if it has
        begun."""
        if self.started:
            with contextlib.suppress(Exception):
                call()
            return
        self._at_begin.append(call)

    def add_window(self, runner: Any) -> None:
        """Drive a :class:`~trainprof.capture.window.WindowRunner` from the step boundaries."""
        self.windows.append(runner)
        self.next_watch = min(self.next_watch, max(runner.first_watch(), self.n_steps))

    def _watch(self) -> None:
        """At the step counts asked for: window transitions, then the ``--max-steps`` stop.

        Runs at most a few times per run (or every step inside a window), so
        a run without windows or a step limit pays one comparison per step.
        The step right after a window closes is flagged too: it carries the
        tool's stop and export cost.
        """
        n = self.n_steps
        if self.terminated and threading.current_thread() is threading.main_thread():
            # a step after SIGTERM: the script swallowed its exception and trains on
            if self.on_terminated is not None:
                self.on_terminated()  # closes the record and ends the process
            self.next_watch = n + 1
            raise Terminated()
        if self._at_first_step:
            calls, self._at_first_step = self._at_first_step, []
            for call in calls:
                with contextlib.suppress(Exception):
                    call()
        nxt = NEVER
        profiling = False
        for runner in self.windows:
            nxt = min(nxt, runner.at_boundary(n))
            profiling = profiling or runner.profiling
        if profiling:
            self.extra_flags = FLAG_PROFILED
            self._cooldown = 1
        elif self._cooldown:
            self._cooldown -= 1
            self.extra_flags = FLAG_PROFILED
            nxt = min(nxt, n + 1)
        else:
            self.extra_flags = 0
        if self.max_steps is not None:
            if n >= self.max_steps:
                self.max_steps = None  # raise once; cleanup code may step again
                self.next_watch = nxt
                self.stopped = True
                raise StopTraining(f"reached --max-steps after {n - self.auto_prefix} steps")
            nxt = min(nxt, self.max_steps)
        self.next_watch = nxt

    def _check_max_steps(self) -> None:
        if self.n_steps >= self.next_watch:
            self._watch()

    def finish(self) -> None:
        """End of run: emit undecided sub-steps and the partial last step."""
        if not self.started:
            return
        if self.mode == "auto" and self._subs:
            self._set_mode("backward")
            with contextlib.suppress(StopTraining):
                self._emit_subs()
        if self.mode == "backward" and self.bwd_pending:
            self.bwd_pending = False
            self._append_tail(FLAG_BACKWARD)
            return
        if self.stopped:
            # after the --max-steps stop: the script's teardown (a GC pass while DataLoader
            # workers shut down) is not a partial step of training
            return
        self._append_tail(FLAG_PARTIAL)

    def _append_tail(self, flags: int) -> None:
        now = perf_counter_ns()
        self.acc[self.current] += now - self.mark
        self.mark = now
        dur = now - self.step_start
        if dur > 0 and any(self.acc[:N_PHASES]) and self.acc[OTHER] != dur:
            self._append(self.step_start, dur, self.acc, flags)
        self.acc[:] = _ZEROS
        self.step_start = now
