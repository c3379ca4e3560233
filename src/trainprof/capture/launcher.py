"""Run an unmodified script or module as ``python SCRIPT`` / ``python -m MODULE`` would.

Same ``sys.argv``, ``__main__``, ``sys.path[0]`` and working directory, in
this process (like cProfile and pyinstrument), so the instrumentation sees
every step. The outcome maps onto the run status:

=============================  ===========  =========
how the script ended           status       exit code
=============================  ===========  =========
returned                       finished     0
``sys.exit(n)``                finished     n
``os._exit(n)``                finished     n
``--max-steps`` reached        finished     0
raised                         crashed      1
Ctrl-C                         interrupted  130 (ends by SIGINT, as python)
SIGTERM                        interrupted  143 (ends by SIGTERM, as python)
=============================  ===========  =========

SIGTERM kills a plain ``python`` at once. Here it is raised in the script as
:class:`~trainprof.capture.clock.Terminated` (a ``BaseException``, so the record is closed
as the script unwinds: its ``finally`` blocks run), raised again at each later step should
the script swallow it; processes the script started and trainprof records (``mp.spawn``'s
ranks) are sent SIGTERM in turn; and once the record and the summary are written the process
dies of SIGTERM (:func:`trainprof.held_signals.die_of`): like ``python``, it waits for no
thread and runs no ``atexit`` handler, and its parent sees a death by the signal.

``os._exit(n)`` ends the process at once, without ``finally`` blocks or
``atexit`` (scripts call it to skip a hanging shutdown: worker processes, NCCL):
:func:`finish_before_os_exit` closes the record and prints the summary first,
then exits as asked (coverage.py's ``patch = _exit`` does the same for its data).

A crash's traceback is printed as Python prints it: frames of trainprof and
``runpy`` are removed, so the user sees only their code and the libraries
it called. The terminal's traceback is gone once the run is over, so the same
exception is also kept in the record (:func:`describe_exception`, ``run.json``'s
``crash``): a crashed run read later says what it raised and where. A warning
attributed beneath the script (a module-level ``warnings.warn(msg, stacklevel=2)``)
reads ``sys:1``, as under python (:mod:`trainprof.capture.warning_location`).
"""

from __future__ import annotations

import builtins
import importlib.machinery
import importlib.util
import io
import os
import runpy
import signal
import sys
import threading
import time
import traceback
import types
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from trainprof.capture import import_time_env
from trainprof.capture.clock import StopTraining, Terminated
from trainprof.capture.warning_location import is_launch_code, warnings_located_as_under_python
from trainprof.errors import UsageError


@dataclass
class Outcome:
    """How the script ended; ``message`` is a line for stderr, if any; ``terminated``: by
    SIGTERM (the process ends with ``os._exit`` once the record is written)."""

    status: str
    exit_code: int
    message: str | None = None
    terminated: bool = False
    #: the exception a crashed script raised, for the record (:func:`describe_exception`)
    crash: dict[str, Any] | None = None


#: Launchers' console scripts, and the module each one runs (for ``trainprof run -m``).
LAUNCHER_MODULES = {"torchrun": "torch.distributed.run",
                    "accelerate": "accelerate.commands.accelerate_cli"}


def check_target(target: str, module: bool) -> str:
    """Fail early, with a one-line error, when the script or module does not exist."""
    if module:
        # looked up where `python -m` looks: the current directory first (the console
        # script's own sys.path[0] is its bin directory)
        saved = sys.path[:]
        sys.path[0:1] = [os.getcwd()]
        try:
            spec = importlib.util.find_spec(target)
            # a package runs its __main__, as `python -m` does
            main = (importlib.util.find_spec(f"{target}.__main__")
                    if spec is not None and spec.submodule_search_locations is not None
                    else spec)
        except (ImportError, ValueError) as exc:
            raise UsageError(f"cannot find module {target!r}: {exc}") from exc
        finally:
            sys.path[:] = saved
        if spec is None:
            raise UsageError(f"no module named {target!r}")
        if main is None:
            raise UsageError(f"no module named {target}.__main__; {target!r} is a package "
                             "and cannot be directly executed")
        return target
    path = Path(target)
    if not path.exists():
        launcher = LAUNCHER_MODULES.get(path.name)
        if launcher is not None:  # `trainprof run torchrun ...`: a command, not a script
            raise UsageError(f"no such script: {target} (to record the ranks {path.name} "
                             f"starts: trainprof run -m {launcher} ARGS...)")
        raise UsageError(f"no such script: {target}")
    if path.is_dir() and not (path / "__main__.py").exists():
        raise UsageError(f"{target} is a directory with no __main__.py")
    if path.is_file() and not zipfile.is_zipfile(target):
        from trainprof.capture.targets import refuse_non_python

        refuse_non_python(target)  # a shell script or a program: what to run instead
    return target


def strip_own_frames(exc: BaseException | None, seen: set[int] | None = None) -> None:
    """Remove trainprof and runpy frames from a traceback (and its causes), in place."""
    seen = seen if seen is not None else set()
    if exc is None or id(exc) in seen:
        return
    seen.add(id(exc))
    frames: list[TracebackType] = []
    tb = exc.__traceback__
    while tb is not None:
        if not is_launch_code(tb.tb_frame.f_code.co_filename):
            frames.append(tb)
        tb = tb.tb_next
    for a, b in zip(frames, frames[1:], strict=False):
        a.tb_next = b
    if frames:
        frames[-1].tb_next = None
        exc.__traceback__ = frames[0]
    elif isinstance(exc, SyntaxError):
        # the script did not compile: Python prints the error alone, with no traceback
        # (our frames would be all there is; any other error with none of the script's
        # frames is trainprof's own, and keeps them)
        exc.__traceback__ = None
    strip_own_frames(exc.__cause__, seen)
    strip_own_frames(exc.__context__, seen)


#: The longest exception message kept in the record: a message can hold a whole tensor
#: or a config dump, and the record is read back at every report.
MAX_MESSAGE = 2000
#: The innermost frames of a traceback kept in the record; ``more`` counts the rest.
MAX_FRAMES = 50


def exception_name(exc_type: type[BaseException]) -> str:
    """The exception's type as Python's traceback names it: ``RuntimeError``, but
    ``torch.OutOfMemoryError`` (the module is left out for builtins and ``__main__``)."""
    module = getattr(exc_type, "__module__", None)
    name = getattr(exc_type, "__qualname__", None) or exc_type.__name__
    return name if module in (None, "builtins", "__main__") else f"{module}.{name}"


def describe_exception(exc: BaseException) -> dict[str, Any]:
    """What a script died of, for the record: ``{"exception", "message", "site": {"file",
    "line", "function"}, "frames": [[file, line, function], ...], "more": n}``.

    Why: the traceback goes to the terminal and is gone afterwards; a crashed run read
    later (``trainprof report``, the HTML, the exports) must say what it raised and where.
    ``frames`` are the traceback's, most recent call last (as Python prints it), without
    trainprof's or runpy's (a wrapper of trainprof's a module call went through is not
    where the script failed); at most :data:`MAX_FRAMES`, the innermost. ``site`` is the
    innermost of them, the line Python's traceback ends on. The message is cut at
    :data:`MAX_MESSAGE` characters. Never raises: a ``__str__`` that fails is named so.
    """
    try:
        message = str(exc)
    except Exception as err:  # a broken __str__: Python prints "<exception str() failed>"
        message = f"<exception str() failed: {type(err).__name__}>"
    if len(message) > MAX_MESSAGE:
        message = (message[:MAX_MESSAGE]
                   + f"... ({len(message) - MAX_MESSAGE:,} more characters)")
    frames = [[f.filename, f.lineno, f.name]
              for f in traceback.extract_tb(exc.__traceback__)
              if not is_launch_code(f.filename)]
    shown = frames[-MAX_FRAMES:]
    record: dict[str, Any] = {"exception": exception_name(type(exc)), "message": message,
                              "site": None, "frames": shown, "more": len(frames) - len(shown)}
    if shown:
        file, line, function = shown[-1]
        record["site"] = {"file": file, "line": line, "function": function}
    elif isinstance(exc, SyntaxError) and exc.filename:  # the script did not compile
        record["site"] = {"file": exc.filename, "line": exc.lineno, "function": "<module>"}
    return record


def print_exception(exc: BaseException) -> None:
    """Print a script's uncaught exception exactly as the interpreter would."""
    strip_own_frames(exc)
    sys.stdout.flush()
    sys.excepthook(type(exc), exc, exc.__traceback__)
    sys.stderr.flush()


@contextmanager
def sigterm_as_exception() -> Iterator[None]:
    """Turn SIGTERM into an exception so the record is closed as ``interrupted``.

    Only when the script would otherwise die silently (default handler) and we
    are in the main thread; a script that installs its own handler keeps it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        from trainprof.capture.recorder import active_recorder

        recorder = active_recorder()
        if recorder is not None:  # raised again at the next step, should the script go on
            recorder.clock.terminated = True
            recorder.clock.next_watch = recorder.clock.n_steps
        raise Terminated()

    previous = signal.getsignal(signal.SIGTERM)
    if previous is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is handler:
            signal.signal(signal.SIGTERM, previous)


@contextmanager
def _stop_threads_quietly() -> Iterator[None]:
    """``--max-steps`` reached in a thread of the script's own: one line, no traceback.

    The clock follows a script that trains in a thread (StepClock.adopt_thread), so
    StopTraining is raised there; the thread ends as if its loop had, and the rest
    of the script goes on. Any other exception in a thread goes to the hook that
    was there before (Python's prints it as usual).
    """
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is not None and issubclass(args.exc_type, StopTraining):
            name = args.thread.name if args.thread is not None else "?"
            print(f"trainprof: stopped thread {name!r}: {args.exc_value}", file=sys.stderr)
            return
        previous(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        if threading.excepthook is hook:
            threading.excepthook = previous


def _run_file_as_main(path: str) -> None:
    """Execute a script file as ``python path`` does.

    Not ``runpy.run_path``: that sets ``sys.argv[0]`` to the path it is
    given, while python keeps the path as typed in ``argv[0]`` and uses the
    absolute path for ``__file__`` and in tracebacks: the path joined to the
    working directory, symlinks and ``..`` kept (a symlinked ``exp1/train.py``
    reads ``exp1/config.json`` beside it, not its target's). Like runpy, the
    script gets a fresh ``__main__`` module in ``sys.modules`` (so its classes
    pickle as ``__main__.X`` for spawned DataLoader workers), and it stays there
    when the script ends, as under python: the script's ``atexit`` handlers run
    after trainprof's summary, and one that saves a model of a class of the
    script pickles it by ``__main__`` (a put-back ``__main__`` had left a
    corrupt checkpoint). ``path`` is a string: a ``Path`` drops the ``./`` of
    ``./train.py``, which python's ``__file__`` keeps. The module's globals are
    python's, ``__annotations__`` (an empty dict) included.
    """
    filename = path
    with io.open_code(filename) as f:
        source = f.read()
    code = compile(source, filename, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=filename,
        __cached__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", filename),
        __spec__=None,
        __package__=None,
        __builtins__=builtins,
        __annotations__={},
    )
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def exit_code_of(code: object) -> tuple[int, str | None]:
    """The process's exit status for ``sys.exit(code)``, as the operating system will see it
    (``True`` is 1; statuses are 8 bits: 256 is 0, -1 is 255), and the message it prints."""
    if code is None:
        return 0, None
    if isinstance(code, int):
        return int(code) & 0xFF, None
    return 1, str(code)  # sys.exit("message") prints the message, exits 1


def _start_gc_afresh() -> None:
    """Collect once before the script runs, so that it starts with no collection pending.

    Under ``python train.py`` the script's own ``import torch`` drives the garbage
    collector's counters; under trainprof, torch and trainprof were imported (and the
    recorder set up) before the script, which can leave a full collection due. Then the
    first collection in each DataLoader worker forked from this process escalates to a
    full one over the whole inherited heap, copy-on-write faults included: 0.3-0.5 s
    before each worker's first batch (seen on Python 3.12: the workers' first collate
    took 400 ms under trainprof, 1 ms without it), which trainprof would then report as
    the workers' start-up. A collection now costs ~0.1 s once, before the first step.
    """
    import gc

    if gc.isenabled():
        gc.collect()


@contextmanager
def finish_before_os_exit(finish: Callable[[int], None],
                          finish_exec: Callable[[str], None] | None = None) -> Iterator[None]:
    """While the script runs, ``os._exit(n)`` in this process runs ``finish(n)`` first, and
    ``os.execv``/``os.execve`` (every ``os.exec*`` goes through them) ``finish_exec(path)``.

    ``finish`` closes the record and prints the summary; then the process exits
    exactly as the script asked. Only once, and only in this process: a forked
    child (a DataLoader worker, a forked ``Process``) ends through ``os._exit`` too,
    and must not touch its parent's record. Whatever ``finish`` raises is dropped:
    nothing keeps the script from exiting. An exec replaces the process: its record
    had stayed "running" for ever, read as a crash. It is closed before an exec of a file
    that can run (``execvp`` tries each folder of ``PATH`` through ``execv``: the ones
    that hold no such program are let fail as they would).
    """
    real_exit, real_execv, real_execve = os._exit, os.execv, os.execve
    pid = os.getpid()
    done = False

    def _exit(code: int) -> None:  # os._exit's signature: one int, no keywords
        nonlocal done
        if os.getpid() == pid and not done and isinstance(code, int):
            done = True
            with suppress(BaseException):  # exit as asked, whatever happened
                finish(code)
        real_exit(code)

    def _before_exec(path: Any) -> None:
        nonlocal done
        if (finish_exec is not None and os.getpid() == pid and not done
                and isinstance(path, str | bytes | os.PathLike)
                and os.access(path, os.X_OK) and not os.path.isdir(path)):
            done = True
            with suppress(BaseException):
                finish_exec(os.fsdecode(path))

    def execv(path: Any, argv: Any) -> None:
        _before_exec(path)
        real_execv(path, argv)

    def execve(path: Any, argv: Any, env: Any) -> None:
        _before_exec(path)
        real_execve(path, argv, env)

    os._exit, os.execv, os.execve = _exit, execv, execve
    try:
        yield
    finally:
        if os._exit is _exit:
            os._exit = real_exit
        if os.execv is execv:
            os.execv = real_execv
        if os.execve is execve:
            os.execve = real_execve


def _thread_state(native_id: int) -> str | None:
    """The kernel's scheduling state of a thread of this process (``R``, ``S``, ...)."""
    try:
        with open(f"/proc/self/task/{native_id}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # "tid (comm) S ...": comm may hold spaces or parentheses; the state follows the last ")"
    return stat[stat.rfind(b")") + 2:][:1].decode() or None


def settle_daemon_threads(timeout_s: float = 1.0, poll_s: float = 0.01) -> bool:
    """Before the interpreter finalizes: let the script's daemon threads reach a wait.

    At finalization CPython (before 3.14) ends a daemon thread that asks for the GIL
    with ``pthread_exit``; if it asks from inside a C++ call (a torch op's
    ``gil_scoped_release`` ending), the forced unwind meets a ``noexcept`` frame and the
    process aborts ("terminate called without an active exception", exit 134). A
    prefetching thread (a DataLoader iterated in a thread feeding a queue) is usually
    blocked on its full queue when a plain script ends; after the script, trainprof's
    summary holds the GIL for about a second, and such a thread spends it waiting for the
    GIL mid-op: the abort came in 5 runs of 6. So here, with the GIL released, wait until
    every live daemon thread has been asleep (``S``/``D``, not waiting for the GIL: that
    is free meanwhile) at two polls in a row, at most ``timeout_s``. Returns whether they
    settled (also when there are none). Linux only (``/proc``); elsewhere a no-op.
    """
    me = threading.current_thread()
    deadline = time.monotonic() + timeout_s
    asleep_before: set[int] = set()
    while True:
        asleep: set[int] = set()
        busy = False
        for t in threading.enumerate():
            if t is me or not t.daemon or not t.is_alive() or t.native_id is None:
                continue
            state = _thread_state(t.native_id)
            if state is None and not os.path.isdir("/proc/self/task"):
                return True  # no /proc: nothing to go by
            if state in ("S", "D"):
                asleep.add(t.native_id)
            elif state is not None:
                busy = True
        if not busy and asleep <= asleep_before:
            return True
        if time.monotonic() >= deadline:
            return False
        asleep_before = asleep
        time.sleep(poll_s)


#: Modules whose threads are ended by the interpreter's own shutdown hooks
#: (``threading._register_atexit``: an idle ``ThreadPoolExecutor`` worker waits for them),
#: or by their pool's: not waited for after the script.
_SHUTDOWN_ENDS = ("concurrent.futures", "multiprocessing")


def join_script_threads(poll_s: float = 0.1) -> None:
    """Wait, as Python's shutdown does (``threading._shutdown``), for the threads the script
    left running that are not daemons, before the record is closed: a script that starts
    its training in a thread and returns (no ``join``) trains on under ``python`` until
    the thread ends, and so it is measured. trainprof's own threads are daemons; a
    thread pool's idle workers are ended by the interpreter's shutdown hooks, not here
    (:data:`_SHUTDOWN_ENDS`). Joined in short waits so that Ctrl-C and SIGTERM interrupt."""
    me = threading.current_thread()
    while True:
        pending = [t for t in threading.enumerate()
                   if t is not me and not t.daemon and t.is_alive()
                   and not str(getattr(getattr(t, "_target", None), "__module__", "")
                               ).startswith(_SHUTDOWN_ENDS)]
        if not pending:
            return
        pending[0].join(poll_s)


def run_target(target: str, args: list[str], module: bool) -> Outcome:
    """Execute the script/module in this process and report how it ended."""
    # sys.argv, sys.path[0] and __main__ stay the script's when it ends, as under python:
    # its atexit handlers run after trainprof's summary (see _run_file_as_main)
    if module:
        sys.argv = [target, *args]  # runpy replaces argv[0] with the module's file
        sys.path[0:1] = [os.getcwd()]
    else:
        sys.argv = [target, *args]
        resolved = Path(target).resolve()  # python puts the script's folder (or the zip/dir) first
        sys.path[0:1] = [str(resolved if not resolved.is_file() else resolved.parent)]
    _start_gc_afresh()
    try:
        # a warning walked past the script's own frames reads sys:1 (see warning_location)
        with (sigterm_as_exception(), _stop_threads_quietly(),
              warnings_located_as_under_python(sys._getframe()), import_time_env.honoured()):
            try:
                if module:
                    runpy.run_module(target, run_name="__main__", alter_sys=True)
                elif Path(target).is_file() and not zipfile.is_zipfile(target):
                    _run_file_as_main(os.path.join(os.getcwd(), target))
                else:  # a directory or a zip (app.pyz) with __main__.py: absolute, as
                    # python puts it first on sys.path (runpy inserts the path it is given)
                    runpy.run_path(os.path.join(os.getcwd(), target), run_name="__main__")
            except SystemExit:
                join_script_threads()
                raise
            join_script_threads()
    except SystemExit as exc:
        code, message = exit_code_of(exc.code)
        return Outcome("finished", code, message)
    except StopTraining as exc:
        return Outcome("finished", 0, f"trainprof: stopped the script: {exc}")
    except KeyboardInterrupt as exc:
        # python prints where Ctrl-C stopped the script, then ends by SIGINT: so here
        print_exception(exc)
        return Outcome("interrupted", 130, "trainprof: interrupted by Ctrl-C")
    except Terminated:
        return Outcome("interrupted", 128 + signal.SIGTERM, "trainprof: terminated by SIGTERM",
                       terminated=True)
    except BaseException as exc:
        print_exception(exc)  # the traceback says it all; no extra line
        return Outcome("crashed", 1, crash=describe_exception(exc))
    return Outcome("finished", 0)
