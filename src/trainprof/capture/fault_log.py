"""Where a run that dies of a fatal signal was: Python's faulthandler, into the run folder.

Why: a segfault in an extension (a custom CUDA op, a broken wheel, ``ctypes``), an
abort from a C++ ``std::terminate`` or a ``Py_FatalError`` kills the process before
any Python code runs: the record stays ``running`` and was read as "killed?", with
nothing to say what or where. CPython's :mod:`faulthandler` is made for this: its C
handler for SIGSEGV, SIGFPE, SIGABRT, SIGBUS and SIGILL writes every thread's Python
stack to a file descriptor with async-signal-safe writes, then lets the signal kill
the process as it would have. trainprof points it at ``RUN_DIR/faulthandler.log``
(:data:`FAULT_LOG`); :func:`trainprof.fault_dump.read_fault_dump` reads it back when
the record is loaded.

What the user sees stays what plain ``python`` shows:

* By default python does not enable faulthandler (nothing on stderr at a
  segfault but the shell's "Segmentation fault"). trainprof enables it with the log
  as its file, so stderr shows nothing more.
* If the user enabled it already (``python -X faulthandler``, ``PYTHONFAULTHANDLER``,
  or ``faulthandler.enable()`` before a ``profile()`` block), it is theirs and stays as
  it is: faulthandler holds a single file, and moving theirs away from stderr would
  hide the dump they asked for. The record then says so in ``missing``.
* A script that calls ``faulthandler.enable()`` (or ``disable()``) while recording
  takes it over: its call goes through unchanged, and at the end trainprof leaves the
  handler as the script set it.

At the end of a run that did not crash the handler is disabled (unless the script
took it) and an empty log is removed: nothing of this is left in the process
(``profile()`` in a notebook) or in the folder.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import os
from pathlib import Path
from typing import IO, Any

from trainprof.store import FAULT_LOG

#: The FaultLog whose file faulthandler writes to in this process, if any: a forked
#: child (a rank started by fork) inherits its parent's, which is not the user's.
_owner: list[FaultLog] = []
#: faulthandler's own functions, as imported (a forked child inherits the wrappers)
_ENABLE, _DISABLE = faulthandler.enable, faulthandler.disable


class FaultLog:
    """Enables faulthandler into ``run_dir/faulthandler.log`` for the time of a record."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / FAULT_LOG
        self.missing: list[str] = []
        self._file: IO[bytes] | None = None
        self._pid = os.getpid()
        self._taken = False  # the script called faulthandler.enable/disable itself
        self._saved: dict[str, Any] = {}

    def start(self) -> None:
        inherited = bool(_owner) and _owner[0]._pid != os.getpid()
        if faulthandler.is_enabled() and not inherited:
            self.missing.append("fatal-signal tracebacks: faulthandler was enabled by the user "
                                f"(its output goes where they chose, not to {FAULT_LOG})")
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # append: a forked rank's dump must not truncate what is there; unbuffered,
            # faulthandler writes to the descriptor itself
            self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 (held for the run)
            _ENABLE(file=self._file, all_threads=True)
        except (OSError, ValueError, RuntimeError) as exc:
            self.missing.append(f"fatal-signal tracebacks: {exc}")
            self._close_file()
            return
        _owner[:] = [self]
        for name, original in (("enable", _ENABLE), ("disable", _DISABLE)):
            self._saved[name] = getattr(faulthandler, name)
            setattr(faulthandler, name, self._taking_over(original))

    def _taking_over(self, original: Any) -> Any:
        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            self._taken = True
            return original(*args, **kwargs)

        return call

    def stop(self) -> None:
        """Hand faulthandler back; remove the log if nothing was written to it."""
        for name, original in self._saved.items():
            setattr(faulthandler, name, original)
        self._saved = {}
        if self._file is None:
            return
        if _owner and _owner[0] is self:
            _owner.clear()
        if not self._taken:
            _DISABLE()
        self._close_file()
        with contextlib.suppress(OSError):
            if self.path.stat().st_size == 0:
                self.path.unlink()

    def _close_file(self) -> None:
        # faulthandler no longer holds it: disabled above, or set to the script's own file
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
        self._file = None
