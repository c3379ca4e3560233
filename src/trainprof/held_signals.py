"""Ctrl-C and SIGTERM held while trainprof wraps up after the script - but not forever.

Once the script has ended, what is left is trainprof's own work: closing the record, then
waiting for the other ranks' records, merging them and printing the summary. A signal that
arrives then is held and acted on right after (:func:`deferred_sigint`,
:func:`finish_despite_sigterm`), so that the record is never left half written and rank 0
of a failed launch still prints the merged view of the failure it was asked about.

Holding a signal must not make a process impossible to stop. Should the wrap-up itself hang
(a deadlock in trainprof, a filesystem that stops answering), a held Ctrl-C or SIGTERM would
otherwise be swallowed for good: the user presses Ctrl-C and nothing happens, and torchrun
waits its 30 s grace period and SIGKILLs the rank. So a held signal starts a timer
(:data:`GIVE_UP_AFTER_S`); if the wrap-up is still going when it fires, trainprof says so on
stderr - with every thread's stack when the record itself would not close, since that is a
bug to report - and exits with the signal's code. Steps already on disk stay readable
(``trainprof report`` reads a record in any status): the record is flushed once a second
while the script runs.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

#: How long the wrap-up may go on after a held signal; under torchrun's 30 s grace period
#: between its SIGTERM and its SIGKILL.
GIVE_UP_AFTER_S = 20.0
#: os._exit itself (the launcher patches the script's while it runs: finish_before_os_exit)
_OS_EXIT = os._exit


def die_of(signum: int) -> None:
    """End the process by ``signum``, now, as the signal's default action would have.

    A ``python`` that SIGTERM stops dies of the signal: its parent sees it killed
    (``subprocess``'s returncode -15, a shell's ``$?`` 143, SLURM and torchrun "signal 15"),
    not an exit with a code. No thread is waited for and no ``atexit`` handler runs (the
    default action ends every thread at once). Should the signal not end the process (a
    blocked signal), exit with ``128 + signum``.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed stream must not stop the exit
            stream.flush()
    with contextlib.suppress(OSError, ValueError):  # not the main thread: the exit below
        signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
        os.kill(os.getpid(), signum)
    _OS_EXIT(128 + signum)


@contextmanager
def _timers_cancelled_on_exit() -> Iterator[list[threading.Timer]]:
    """Yields a list the handlers add started timers to; all are cancelled on the way out."""
    timers: list[threading.Timer] = []
    try:
        yield timers
    finally:
        for timer in timers:
            timer.cancel()


def _start_give_up(timers: list[threading.Timer], signum: int, what: str, stacks: bool) -> None:
    """A held signal: exit after :data:`GIVE_UP_AFTER_S` unless the wrap-up is done first."""
    if timers:  # a second Ctrl-C: the first one's timer is already running
        return

    def give_up() -> None:
        name = signal.Signals(signum).name
        print(f"trainprof: {what} did not finish within {GIVE_UP_AFTER_S:.0f} s of {name}; "
              "exiting without it" + (" - where each thread was (a bug: please report it):"
                                      if stacks else ""), file=sys.stderr, flush=True)
        if stacks:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        die_of(signum)

    timer = threading.Timer(GIVE_UP_AFTER_S, give_up)
    timer.daemon = True
    timer.start()
    timers.append(timer)


def _holder(pending: list[int], timers: list[threading.Timer], what: str,
            stacks: bool) -> Callable[[int, object], None]:
    """The handler that notes a held signal and starts its give-up timer."""

    def held(signum: int, frame: object) -> None:
        pending.append(signum)
        _start_give_up(timers, signum, what, stacks)

    return held


@contextmanager
def deferred_sigint(what: str = "closing the record", stacks: bool = True) -> Iterator[None]:
    """Hold Ctrl-C while the record is closed, then deliver it.

    A second Ctrl-C (people press it twice) must not leave ``run.json`` half
    written with status ``running``: closing takes well under a second, so the
    interrupt waits for it and is raised right after, where the run's record is
    complete and ``trainprof report`` can read it. A close still going
    :data:`GIVE_UP_AFTER_S` after the Ctrl-C is given up (module docstring).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    with _timers_cancelled_on_exit() as timers:
        previous = signal.signal(signal.SIGINT, _holder(pending, timers, what, stacks))
        try:
            yield
        finally:  # None: a handler not set from Python; the default is what it did
            signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
    if pending:
        raise KeyboardInterrupt


@contextmanager
def finish_despite_sigterm(what: str = "closing the record",
                           stacks: bool = True) -> Iterator[list[int]]:
    """Hold SIGTERM while trainprof wraps up after the script, then exit as planned.

    The script has ended; what is left is trainprof's own wrap-up: closing the record,
    waiting for the other ranks' records, merging them, printing the summary. A launcher
    stops the processes that are left as soon as one rank fails (torchrun's agent sends
    SIGTERM 0.1 s after it sees a worker exit), so without this rank 0 could die half-way
    and print no merged view of the very failure it was asked about. The signal is noted
    (the list yields it) and the process exits with the script's own code right after, well
    within the launcher's grace period (torchrun's: 30 s before SIGKILL); a wrap-up still
    going :data:`GIVE_UP_AFTER_S` after it is given up (module docstring). A handler the
    script installed stays in charge.
    """
    pending: list[int] = []
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield pending
        return
    with _timers_cancelled_on_exit() as timers:
        signal.signal(signal.SIGTERM, _holder(pending, timers, what, stacks))
        try:
            yield pending
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
