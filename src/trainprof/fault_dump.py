"""Reading back faulthandler's dump: the fatal signal a run died of, and where.

The dump is CPython's (``Python/faulthandler.c``, ``Python/traceback.c``), written by
trainprof.capture.fault_log into ``RUN_DIR/faulthandler.log``::

    Fatal Python error: Segmentation fault

    Thread 0x00007ff7a9a816c0 (most recent call first):
      File "/usr/lib/python3.11/threading.py", line 982 in run
      ...

    Current thread 0x00007ff7aa5ffb80 (most recent call first):
      File "/usr/lib/python3.11/ctypes/__init__.py", line 519 in string_at
      File "/home/me/train.py", line 6 in crash

The first line names the signal by faulthandler's description of it (its
``faulthandler_handlers`` table); any other text there is a ``Py_FatalError`` message,
after which CPython aborts (SIGABRT). Python 3.12 may print ``Stack (most recent call
first):`` for the current thread and an ``Extension modules:`` line; both are read.
A log can hold several dumps (a forked process that shares the file): the last is the
one that ended the record's process, the only one written after its last step.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

#: faulthandler's description of each fatal signal it handles (faulthandler.c).
SIGNAL_OF_DESCRIPTION = {
    "Segmentation fault": "SIGSEGV",
    "Aborted": "SIGABRT",
    "Bus error": "SIGBUS",
    "Floating point exception": "SIGFPE",
    "Illegal instruction": "SIGILL",
}
#: At most this many bytes are read from the end of the log (a dump is a few KB;
#: 100 frames per thread at most, faulthandler's MAX_FRAME_DEPTH).
MAX_READ = 1 << 20

_FATAL = "Fatal Python error: "
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+|\?\?\?) in (?P<func>.*)$')
_CURRENT = ("Current thread ", "Stack (most recent call first)")


def read_fault_dump(path: Path) -> dict[str, Any] | None:
    """The last dump in a faulthandler log, or None (no file, or no dump in it).

    Returns ``{"signal": "SIGSEGV", "message": "Segmentation fault", "frames":
    [[file, line, function], ...], "threads": n}``: ``frames`` are the crashing thread's,
    innermost first as faulthandler lists them (``line`` 0 where it printed ``???``);
    ``threads`` counts the threads dumped.
    """
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - MAX_READ))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    start = text.rfind(_FATAL)
    if start < 0:
        return None
    lines = text[start:].splitlines()
    message = lines[0][len(_FATAL):].strip()
    frames: list[list[Any]] = []
    threads = 0
    current = False
    for line in lines[1:]:
        if line.startswith(("Thread ", *_CURRENT)):
            threads += 1
            current = line.startswith(_CURRENT)
            continue
        match = _FRAME.match(line)
        if match and current:
            lineno = match["line"]
            frames.append([match["file"], int(lineno) if lineno.isdigit() else 0,
                           match["func"].strip()])
        elif not line.startswith(" "):
            current = False  # a blank line or "Extension modules: ..." ends the block
    return {"signal": SIGNAL_OF_DESCRIPTION.get(message, "SIGABRT"), "message": message,
            "frames": frames, "threads": threads}
