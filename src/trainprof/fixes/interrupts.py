"""Ctrl-C taken between items of threaded work, never inside a lock.

A ``KeyboardInterrupt`` raised while the main thread is inside ``threading``'s lock
code (a ``ThreadPoolExecutor``'s idle semaphore, a future's condition) can leave that
lock held (bpo-29988): the pool's workers then wait on it for ever, and the shutdown
that the interrupt triggers waits for them. ``trainprof pack`` hung so on Ctrl-C, one
time in three here. :func:`deferred_sigint` turns SIGINT into a flag for the duration
and gives a ``check()`` that raises ``KeyboardInterrupt`` where the caller calls it,
between items. Elsewhere than on the main thread, or when the program has its own
SIGINT handler, it changes nothing (``check`` then never raises).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def deferred_sigint() -> Iterator[Callable[[], None]]:
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield lambda: None
        return
    hit: list[int] = []

    def note(signum: int, frame: Any) -> None:
        hit.append(signum)

    def check() -> None:
        if hit:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, note)
    try:
        yield check
    finally:
        signal.signal(signal.SIGINT, previous)
