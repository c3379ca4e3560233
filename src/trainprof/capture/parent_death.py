"""A DataLoader worker ends the moment its training process does (Linux).

Why: when the training process dies hard (``kill -9``, a segfault, the OOM killer)
its DataLoader workers are left behind. torch notices only through its own
watchdog (``torch.utils.data._utils.worker.ManagerWatchdog``): between two batches
the worker loop compares ``os.getppid()`` with the pid it started under, and
``index_queue.get`` waits up to ``MP_STATUS_CHECK_INTERVAL`` (5 s) before it looks;
a worker inside a long ``__getitem__`` looks even later. Measured on a run with two
persistent workers killed mid-epoch: they stayed 4.5-5 s, holding their memory (a
copy of the dataset, pinned buffers, open files) while the user restarts the run.

The kernel can do it at once: ``prctl(PR_SET_PDEATHSIG, sig)`` asks it to send
``sig`` to this process when its parent dies. Two details decide whether that is
safe:

* *Which signal.* ``SIGKILL``. On parent death torch's loop just leaves (no result
  can reach anyone any more), so there is no clean-up a catchable signal would let
  run; and a catchable one may be caught: a forked worker inherits the training
  process's handlers, trainprof's own SIGTERM handler (``launcher.sigterm_as_exception``,
  which raises) or a user's checkpoint-on-SIGTERM handler, which would keep the
  worker alive or run the user's code in it. What the worker loses is its last
  once-a-second write of ``workers/<pid>.json`` (``ended`` stays false), the same
  second the dead training process lost.
* *Which parent.* The signal is sent when the *thread* that forked the worker
  exits, not its process (``man 2 prctl``). A DataLoader iterated first from a
  thread of the script starts its workers from that thread; should that thread end
  while the training goes on, the workers would be killed under a live run. So the
  signal is asked for only when the workers were started from the process's main
  thread (its thread-group leader, which lives as long as the process), or by the
  ``forkserver`` (single-threaded: its workers' parent is the server, which exits
  when the training process's end closes its pipe). Otherwise torch's watchdog
  stays the only guard.

The parent may die before the worker gets here: the setting would then watch the
process the worker was re-parented to. So after ``prctl`` the worker checks that its
parent is still the one expected, and ends itself if not (what the signal would
have done).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

#: ``PR_SET_PDEATHSIG`` from ``<linux/prctl.h>``.
PR_SET_PDEATHSIG = 1


def forking_thread_outlives_workers() -> bool:
    """True when the calling thread is its process's main thread (tid == pid).

    Called in the training process where DataLoader workers are started (the
    iterator's creation): the thread that forks them is the calling one.
    """
    return threading.get_native_id() == os.getpid()


def die_with_parent(expected_parent: int) -> bool:
    """Ask the kernel for SIGKILL when this process's parent dies; True if set.

    ``expected_parent``: the pid the parent had when the worker was started. If the
    parent is already another (it died before this call), the process ends here.
    Nothing happens off Linux or where libc cannot be loaded.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        # the interpreter's own symbols, libc's among them (find_library would run ldconfig)
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != expected_parent:
        os.kill(os.getpid(), signal.SIGKILL)
    return True
