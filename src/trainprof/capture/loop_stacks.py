"""Where the training thread is, a few times a second: what the loop's "other" time is made of.

The step clock measures exactly how much of each step is *not* spent in the
DataLoader, the model, backward, zero_grad, the optimizer or GC ("other"), but
not *where* in the script that time goes: a script that makes its batches itself
(nanoGPT's ``get_batch``), logs, computes metrics or writes files every step
shows a large "other" share and nothing to act on. A careful engineer would look
at the stacks; so does this, always on: :data:`HZ` times a second while "other" is
5% of the step or more, :data:`SPARSE_HZ` times otherwise.

How: a POSIX timer of the C fast path (``_fastclock.start_stack_timer``) sends a
signal to the training thread itself at the interval; its C handler notes the
clock's step and phase at that instant, and this module's handler, which the
interpreter runs in that thread at its next bytecode boundary, reads the frame it
is given (see the C file for the details). Why not a Python thread reading
``sys._current_frames()``: it needs the GIL, so it sees the training thread only
where that lets the GIL go - with a loop of 2 ms of pure-Python work and a 2 ms
``sleep``, the sleeping line took 65 of 66 samples. A native timer *thread* did
better (65% / 35%) but woke late while torch's threads kept both cores busy, which
moved ticks out of the model's phases. A signal is handled at the next bytecode
boundary: at once in pure-Python code, by interrupting a ``sleep`` (which Python then
resumes, PEP 475), and after a C call returns, on the line that made it - a function
call's (``torch.mm(a, b)``): an operator's (``a @ b``) is noted at the next call or loop
jump, where the interpreter next looks at its signals, maybe on a later line; ticks that
arrive during one C call are counted, and the sample carries their number as its
weight.

The signal is ``SIGURG``: its default action is to ignore it, so a script that resets
every handler cannot be killed by a late tick, and Python programs do not use it
(out-of-band socket data; the Go runtime borrows it for the same reason). It is used
only while nothing else handles it, installed with ``SA_RESTART`` so that interrupted
system calls resume, and only when the training thread is the main thread (where
Python runs signal handlers). Otherwise, and without the C fast path, nothing is
sampled and the record says so. Ticks start when the first step ends, or
:data:`LONG_STEP_S` into it should it last longer (a run of one long step), never in
the script's set-up: a signal interrupts a blocking call with a timeout whatever
``SA_RESTART`` says (torch.distributed's TCPStore ``connect()`` failed with EINTR).

What is kept per sample: the step number, the phase (:mod:`trainprof.schema`), the
weight, whether the thread was inside a timed device sync (a CUDA tensor's ``.item()``,
``torch.cuda.synchronize``: a fifth element ``1``, absent otherwise), and the stack
reduced to the *user's* frames (not the stdlib, site-packages, console scripts or
trainprof: :func:`trainprof.capture.pyprof.library_paths`), outermost first, with the
first :data:`CHAIN` library frames each of them calls (a framework's training loop that
the script enters with one call: ``Trainer(...).train()``) and the innermost frame whatever
its file (the library function the user's code was in); nothing above the script's
outermost frame (``runpy``, trainprof's launcher). Reduced stacks are interned: each is
written once, as ``{"stack": id, "frames": [[file, line, function, user], ...], "sources":
[text of each frame's line but an innermost library one, or null, ...]}`` (the sources read
by the flush thread, so that a
report read on another machine still quotes the lines), and samples refer
to it, ``{"samples": [[step, phase, stack, weight(, 1)], ...]}``, both appended to
``RUN_DIR/stacks.jsonl`` at the Recorder's once-a-second drain (a crash loses at
most the last second, like the step records): about 16 bytes a sample (measured), so
65 bytes a second sparse and 320 dense, 28 MB a day at most.
``TRAINPROF_STACK_HZ=0`` switches the sampling off.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import orjson

from trainprof.capture.clock import FAST
from trainprof.capture.pyprof import library_paths

if FAST:
    from trainprof.capture import _fastclock

#: Format of the file's lines.
FORMAT = 1
#: Samples a second while "other" is at least :data:`DENSE_OTHER` of the last second's
#: steps (something to attribute), and otherwise. A sample costs the training thread
#: 70-90 us on this project's 2-vCPU VM, most of it the signal's delivery (a handler
#: that does nothing cost 34-59 us; ``benchmarks/stack_sampling.py``): 0.14-0.18% of its
#: time at 20 a second, 0.03-0.04% at 4. The timer starts ticking when the first step ends
#: (or :data:`LONG_STEP_S` into a first step that lasts longer), dense for
#: :data:`DENSE_FIRST_S`, so that the first steps (and a run of a few seconds: 14
#: samples in all had left a 64% "other" unnamed) are sampled enough; then the
#: Recorder's drain calls :meth:`adapt` once a second. Each tick weighs its interval in
#: units of the dense one.
HZ, SPARSE_HZ = 20.0, 4.0
DENSE_OTHER = 0.05
#: Sampled densely for this long from the first step's end, whatever "other" is: the
#: first steps (the drain's first look could otherwise switch to sparse before a tick)
DENSE_FIRST_S = 1.0
#: What a sparse tick weighs: its interval in dense intervals.
SPARSE_WEIGHT = round(HZ / SPARSE_HZ)
#: A first step that lasts this long is sampled from then on, before it ends (see
#: :meth:`LoopStackSampler.arm_long_first_step`).
LONG_STEP_S = 1.0


#: The signal sent to the training thread (see the module docstring).
SIGNAL = getattr(signal, "SIGURG", None)
#: Frames walked per sample, innermost first (a deeper stack keeps its innermost ones).
MAX_DEPTH = 128
#: Distinct reduced stacks interned, and frames in them all (~150 bytes each written, with
#: the line's source: 30 MB at most); samples of further ones are counted, not kept.
MAX_STACKS = 20_000
MAX_FRAMES = 200_000
#: Library frames kept below each user frame (the rest of a chain, but its innermost frame,
#: is left out): enough for a framework's own training loop under the script's one call
#: into it - ``trainer.fit(model)`` to Lightning's batch loop is ~15 frames, Hugging Face's
#: ``Trainer.train()`` to ``_run_epoch`` 3.
CHAIN = 24

#: The sampler whose handler is installed in this process, for the fork hook below.
_ACTIVE: LoopStackSampler | None = None


def _fixed_rate() -> float | None:
    """The rate ``TRAINPROF_STACK_HZ`` sets (no adapting to "other"), or None."""
    try:
        hz = float(os.environ["TRAINPROF_STACK_HZ"])
    except (KeyError, ValueError):
        return None
    return min(max(hz, 0.1), 1000.0)


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker, a forked rank) gets the default SIGURG back.

    The timer is not inherited, and the child may record a run of its own: the parent's
    handler and ``signal.signal`` wrapper must not make it look taken.
    """
    sampler = _ACTIVE
    if sampler is not None:
        with contextlib.suppress(Exception):
            sampler._running = False
            sampler._restore()
            sampler._unwrap()


os.register_at_fork(after_in_child=_after_fork_in_child)


class LoopStackSampler:
    """Samples the training thread's stack on a native timer; writes them to the run folder.

    :meth:`start` and :meth:`stop` run in the training thread, :meth:`flush` in the
    Recorder's flush thread, the handler in the training thread when signalled.
    """

    def __init__(self, clock: Any, path: Path) -> None:
        self.clock = clock
        self.path = path
        self.missing: list[str] = []
        # by id(): hashing a code object hashes its constants and names again every time
        # (~1-3 us for torch's larger functions, 30 frames a sample); the code objects are
        # kept here, so their ids are not reused while the run lasts
        self._user: dict[int, tuple[CodeType, bool]] = {}
        self._prefixes: tuple[str, ...] = ()
        self._stacks: dict[tuple[int, ...], int] = {}
        self._new_stacks: list[dict[str, Any]] = []
        self._samples: list[list[int]] = []
        self._dropped = 0
        self._frames = 0  # in the stacks interned
        self._seq = 0
        self._file: Any = None
        self._previous: Any = None
        self._running = False
        self._orig_signal: Any = None
        self._wrapper: Any = None
        self._fixed = False
        self._dense = False
        self._armed = False  # ticking (from the first step's end: see arm)
        self._early = False  # set to tick LONG_STEP_S into the first step (see
        # arm_long_first_step)
        self._armed_at = 0.0
        self._interval = 0.0

    # -- the timer --------------------------------------------------------------------------
    def start(self) -> None:
        """Install the handler and start the timer, if this thread can be sampled."""
        why = self._unavailable()
        if why is not None:
            self.missing.append(f"loop stacks: not sampled ({why})")
            return
        self._prefixes = tuple(p.rstrip(os.sep) + os.sep for p in library_paths())
        try:
            self._previous = signal.signal(SIGNAL, self._on_signal)
            self._seq = _fastclock.stack_stash()[0]
            fixed = _fixed_rate()
            self._fixed = fixed is not None
            # made now, armed when the first step ends (the clock calls arm): a tick in
            # the script's set-up can make a blocking call with a timeout fail with EINTR
            # (torch.distributed's TCPStore connect() did, and retried 0.7 s later)
            _fastclock.start_stack_timer(self.clock, 0.0, SIGNAL, 1)
            self._interval = 1.0 / (fixed or HZ)
            self.clock.at_first_step(self.arm)
            self.clock.at_begin(self.arm_long_first_step)
            self._dense = not self._fixed
        except Exception as exc:
            self._restore()
            self.missing.append(f"loop stacks: not sampled ({type(exc).__name__}: {exc})")
            return
        self._running = True
        global _ACTIVE
        _ACTIVE = self
        # a script that installs its own SIGURG handler later gets the signal to itself:
        # sampling stops first, so that no tick of ours reaches that handler. Ours set
        # again is not the script's (PyTorch Lightning's Trainer saves every handler
        # with getsignal() and sets them all again when fit() ends): it is left in place,
        # as setting it would put Python's action back over the timer's C tick, which
        # sampling needs (no sample after that, and no note of why).
        self._orig_signal = orig = signal.signal

        def _signal(signalnum: Any, handler: Any) -> Any:
            if (signalnum == SIGNAL and self._running and handler == self._on_signal
                    and threading.current_thread() is threading.main_thread()):
                return self._on_signal  # the handler it replaces: the same one
            if signalnum == SIGNAL and self._running:
                self.stop()
                self.missing.append("loop stacks: sampling stopped early (the script "
                                    "installed its own SIGURG handler)")
            return orig(signalnum, handler)

        _signal.__doc__, _signal.__wrapped__ = orig.__doc__, orig  # type: ignore[attr-defined]
        self._wrapper = _signal
        signal.signal = _signal

    def arm(self) -> None:
        """Start ticking (the first step has ended; the clock calls this once)."""
        if self._running and not self._armed:
            self._armed = True
            self._armed_at = time.monotonic()
            try:
                _fastclock.set_stack_interval(self._interval, 1)
            except Exception as exc:
                self.missing.append(f"loop stacks: not sampled ({type(exc).__name__}: {exc})")

    def arm_long_first_step(self) -> None:
        """Tick from :data:`LONG_STEP_S` into the first step on, should it last that long
        (the clock calls this when the first step begins).

        Ticking starts at the first step's *end* (:meth:`arm`), so that the script's
        set-up never sees a signal; but then a run of one long step - a big batch on
        the CPU, a first step that compiles for minutes, one that hangs in a collective -
        had no sample at all, and its time nowhere but in "other" or "forward" (an
        explorer's 170 s single-step run). Once steps have begun, the set-up is over: a
        step's ticks are what every later step gets anyway. The delay keeps a run's
        usual first step (well under a second) as untouched as before, and lazy work
        that starts with it (DataLoader workers, a CUDA context) out of the ticks' way
        unless it is what makes the step long. Under a launcher (``WORLD_SIZE`` above
        1) whose process group is not made yet, the script's set-up goes on inside this
        step (a dummy forward before ``init_process_group``): the store's ``connect()``
        is what a tick broke, so nothing is armed early.
        """
        if not self._running or self._armed or self._early or _group_pending():
            return
        try:
            _fastclock.set_stack_interval(self._interval, 1, LONG_STEP_S)
        except TypeError:  # a build of _fastclock.c before first_s: sampled from the end
            return
        except Exception as exc:
            self.missing.append(f"loop stacks: not sampled ({type(exc).__name__}: {exc})")
            return
        self._early = True

    def adapt(self, other_share: float | None) -> None:
        """Dense sampling while the last second's steps spent :data:`DENSE_OTHER` or more
        in "other", sparse otherwise (called by the Recorder's drain, once a second)."""
        if not self._running or not self._armed or self._fixed or other_share is None:
            return
        if time.monotonic() - self._armed_at < DENSE_FIRST_S:
            return  # the first second of steps is sampled densely, whatever "other" is
        dense = other_share >= DENSE_OTHER
        if dense != self._dense:
            self._dense = dense
            try:
                if dense:
                    _fastclock.set_stack_interval(1.0 / HZ, 1)
                else:
                    _fastclock.set_stack_interval(1.0 / SPARSE_HZ, SPARSE_WEIGHT)
            except Exception as exc:
                self.missing.append(f"loop stacks: cannot change the rate ({exc})")

    @staticmethod
    def _unavailable() -> str | None:
        if os.environ.get("TRAINPROF_STACK_HZ", "").strip() in ("0", "0.0", "off"):
            return "TRAINPROF_STACK_HZ=0"
        if not FAST or not hasattr(_fastclock, "start_stack_timer") or SIGNAL is None:
            return "needs the C fast path on Linux"
        if threading.current_thread() is not threading.main_thread():
            return "the recording did not start in the main thread"
        current = signal.getsignal(SIGNAL)
        if current not in (signal.SIG_DFL, None):
            return "the script handles SIGURG itself"
        return None

    def stop(self) -> None:
        """Stop the timer and put the signal's previous handler back (the run is ending)."""
        if not self._running:
            return
        self._running = False
        try:
            _fastclock.stop_stack_timer()
        finally:
            self._restore()
            self._unwrap()
            global _ACTIVE
            if _ACTIVE is self:
                _ACTIVE = None

    def _unwrap(self) -> None:
        if self._wrapper is not None and signal.signal is self._wrapper:
            signal.signal = self._orig_signal
        self._wrapper = None

    def _restore(self) -> None:
        if self._previous is None:
            return
        install = self._orig_signal or signal.signal
        try:
            if signal.getsignal(SIGNAL) == self._on_signal:
                install(SIGNAL, self._previous)
        except (ValueError, OSError):  # not the main thread now: the handler stays, unused
            pass
        self._previous = None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """One sample (run by the interpreter in the training thread; must never raise)."""
        try:
            seq, step, phase, *rest = _fastclock.stack_stash()  # an older build: 3 items
            in_sync = rest[0] if rest else 0
            weight, self._seq = seq - self._seq, seq
            if weight <= 0 or frame is None or threading.get_ident() != self.clock.owner:
                return
            key = self._reduce(frame)
            sid = self._stacks.get(key)
            if sid is None:
                if (len(self._stacks) >= MAX_STACKS
                        or self._frames + len(key) // 2 > MAX_FRAMES):
                    self._dropped += weight
                    return
                self._frames += len(key) // 2
                sid = self._stacks[key] = len(self._stacks)
                frames = []
                for i in range(0, len(key), 2):
                    code, mine = self._user[key[i]]
                    frames.append([code.co_filename, key[i + 1], _name(code), mine])
                self._new_stacks.append({"stack": sid, "frames": frames})
            self._samples.append([step, phase, sid, weight, 1] if in_sync
                                 else [step, phase, sid, weight])
        except Exception:  # the script must not see the profiler's failure
            self._dropped += 1

    def _reduce(self, frame: FrameType | None) -> tuple[int, ...]:
        """The user's frames, the first :data:`CHAIN` library frames below each of them and
        the innermost frame, outermost first, flat as ``(id(code), line, ...)``."""
        user = self._user
        walked: list[tuple[int, int, bool]] = []
        depth = 0
        while frame is not None and depth < MAX_DEPTH:
            code = frame.f_code
            key = id(code)
            known = user.get(key)
            if known is None:
                known = user[key] = (code, self._is_user(code.co_filename))
            walked.append((key, frame.f_lineno or code.co_firstlineno, known[1]))
            depth += 1
            frame = frame.f_back
        kept: list[int] = []
        below = -1  # library frames since the last user frame; -1: none seen yet
        last = len(walked) - 1
        for i in range(last, -1, -1):  # outermost first
            key, line, mine = walked[i]
            if mine:
                below = 0
            elif below >= 0:
                below += 1
            if mine or 0 < below <= CHAIN or i == 0:
                kept.append(key)
                kept.append(line)
        return tuple(kept)

    def _is_user(self, filename: str) -> bool:
        if not filename or filename.startswith("<"):
            return False
        if filename.startswith(self._prefixes):
            return False
        real = os.path.realpath(filename)
        return not real.startswith(self._prefixes)

    # -- writing ----------------------------------------------------------------------------
    def flush(self) -> None:
        """Append the stacks and samples taken since the last flush (the Recorder's drain)."""
        if not self._samples and not self._new_stacks:
            return
        stacks, samples = self._new_stacks, self._samples
        self._new_stacks, self._samples = [], []
        for stack in stacks:
            # the source of the user's lines, read here (the flush thread) while the
            # script is on this disk: a report read elsewhere, or after the script
            # changed, still quotes the line that ran
            last = len(stack["frames"]) - 1
            stack["sources"] = [
                (linecache.getline(file, line).strip() or None) if mine or i < last else None
                for i, (file, line, _func, mine) in enumerate(stack["frames"])
            ]
        try:
            if self._file is None:
                self._file = open(self.path, "ab")  # noqa: SIM115 - open for the whole run
                self._file.write(orjson.dumps({
                    "format": FORMAT, "pid": os.getpid(),
                    "library_paths": sorted(p.rstrip(os.sep) for p in self._prefixes or ()),
                    # what a weight of 1 is, in seconds: the dense interval (or the one
                    # TRAINPROF_STACK_HZ sets), so that ticks read as time
                    "tick_s": self._interval,
                }) + b"\n")
            lines = [orjson.dumps(s) for s in stacks]
            if samples:
                lines.append(orjson.dumps({"samples": samples}))
            self._file.write(b"\n".join(lines) + b"\n")
            self._file.flush()
        except Exception as exc:
            self.stop()
            self.missing.append(f"loop stacks: cannot write {self.path.name}: {exc}")

    def close(self) -> None:
        """The last samples, then the file is closed (after :meth:`stop`)."""
        if self._file is None and not self._samples:  # nothing was ever sampled
            adopted = getattr(self.clock, "adopted_thread", None)
            if adopted and not any(m.startswith("loop stacks:") for m in self.missing):
                self.missing.append(f"loop stacks: not sampled (the loop trained in thread "
                                    f"{adopted!r}; the signal reaches the main thread only)")
            elif (self._armed or self._early) and not any(
                    m.startswith("loop stacks:") for m in self.missing):
                # started, but no tick landed in a step: every step was over before one
                n = int(getattr(self.clock, "n_steps", 0))
                when = (f"a first step is sampled from {LONG_STEP_S:g} s into it on, the "
                        "later ones from their start" if self._early else
                        # a process group still to be made, or a build of _fastclock.c
                        # without the delay: from the first step's end only
                        "sampling started when the first step ended")
                self.missing.append(
                    f"loop stacks: none taken (this run had {n} step{'' if n == 1 else 's'}, "
                    f"over before a tick: {when}, since a tick during the script's set-up "
                    "can break its blocking calls; run more steps to see where a step's "
                    "time goes)")
        self.flush()
        if self._file is None:
            return
        with contextlib.suppress(Exception):  # the samples already written stay readable
            if self._dropped:
                self._file.write(orjson.dumps({"dropped": self._dropped}) + b"\n")
            self._file.close()
        self._file = None


def _group_pending() -> bool:
    """A launcher started this process as one of several ranks, and its process group is
    not made yet (see :meth:`LoopStackSampler.arm_long_first_step`)."""
    try:
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return False
    except ValueError:
        return False
    dist = sys.modules.get("torch.distributed")
    try:
        return dist is None or not (dist.is_available() and dist.is_initialized())
    except Exception:
        return True


def _name(code: CodeType) -> str:
    return getattr(code, "co_qualname", code.co_name)
