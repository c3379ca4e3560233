"""Environment variables a script sets before its own ``import torch``, honoured as under python.

Under ``python train.py``, ``os.environ["OMP_NUM_THREADS"] = "1"`` at the top of the script,
before ``import torch``, sets torch's intra-op threads: OpenMP reads the variable when torch
loads, and torch's logging reads ``TORCH_LOGS`` then too. Under ``trainprof run`` torch is
loaded before the script's first line (the capture's hooks are torch's), so the assignment
came too late: a script that pinned itself to one thread ran at 2 threads, 4.7 ms a step,
against 1 thread and 8.85 ms under python, and its ``TORCH_LOGS`` printed nothing.

So while the script runs, until it has imported torch itself, an assignment to one of those
variables (``os.environ[...] = ``, ``update``, ``setdefault``) is applied as torch's loading
would have applied it: the thread count through ``torch.set_num_threads`` (the count ATen
takes at start-up: ``OMP_NUM_THREADS``, else ``MKL_NUM_THREADS``), the logging through
torch's own initialisation from the environment. An assignment after the script's own
``import torch`` changes nothing, as under python. Whether the script has imported torch is
seen at its ``import`` statements (``builtins.__import__``, which an import statement calls
even for a module loaded already; a library the script imports that imports torch counts),
watched only until torch's import, so that imports inside the training loop run as they do
under python.

numpy's BLAS reads its thread variables (``OPENBLAS_NUM_THREADS``, ``OMP_NUM_THREADS``...)
when it loads, and trainprof loaded numpy before the script too; nothing re-reads them, so
a run note says that numpy's own matrix products kept their threads (torch's do not use
numpy's BLAS).
"""

from __future__ import annotations

import builtins
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

#: Read by ATen for its intra-op thread count, in this order.
TORCH_THREADS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
#: Read by torch's logging when torch loads.
TORCH_LOGGING = ("TORCH_LOGS", "TORCH_LOGS_OUT", "TORCH_LOGS_FORMAT")
#: Read by numpy's bundled OpenBLAS when numpy loads.
NUMPY_THREADS = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")

_state: dict[str, Any] = {"imported": set(), "notes": []}


def notes() -> list[str]:
    """Run notes: variables the script set before its import of numpy that trainprof could
    not apply."""
    return list(_state["notes"])


def _apply(key: str) -> None:
    imported = _state["imported"]
    torch = sys.modules.get("torch")
    if torch is not None and "torch" not in imported:
        if key in TORCH_THREADS:
            value = os.environ.get("OMP_NUM_THREADS") or os.environ.get("MKL_NUM_THREADS")
            try:
                count = int(str(value).strip())
            except ValueError:
                count = 0
            if count > 0:
                torch.set_num_threads(count)
        elif key in TORCH_LOGGING:
            internal = getattr(getattr(torch, "_logging", None), "_internal", None)
            init = getattr(internal, "_init_logs", None)
            if callable(init):
                init()
    if (key in NUMPY_THREADS and "numpy" in sys.modules and "numpy" not in imported
            and "torch" not in imported):
        note = (f"the script set {key}={os.environ.get(key)} before its import of numpy, which "
                "trainprof had loaded already: numpy's own matrix products kept their threads "
                "(torch's are not numpy's); set it in the shell to apply it")
        if note not in _state["notes"]:
            _state["notes"].append(note)


class _WatchedEnviron(os._Environ):  # type: ignore[name-defined,misc]  # os.environ's class
    """``os.environ`` while the script runs: applies the variables torch reads at load."""

    def __setitem__(self, key: str, value: str) -> None:
        super().__setitem__(key, value)
        if key in TORCH_THREADS or key in TORCH_LOGGING or key in NUMPY_THREADS:
            with suppress(Exception):  # never the script's failure
                _apply(key)


@contextmanager
def honoured() -> Iterator[None]:
    """While the script runs: apply the variables it sets before its own import of torch."""
    environ = os.environ
    original_class = type(environ)
    original_import = builtins.__import__
    imported: set[str] = set()
    _state["imported"] = imported
    _state["notes"] = []

    def watching_import(name: str, globals: Any = None, locals: Any = None,  # noqa: A002
                        fromlist: Any = (), level: int = 0) -> Any:
        top = name.partition(".")[0]
        if level == 0 and top in ("torch", "numpy"):
            imported.add(top)
            if top == "torch" and builtins.__import__ is watching_import:
                # nothing is applied after it: import statements go straight to python's
                builtins.__import__ = original_import
        return original_import(name, globals, locals, fromlist, level)

    swapped = False
    if original_class is os._Environ:  # type: ignore[attr-defined]  # not someone else's
        environ.__class__ = _WatchedEnviron
        swapped = True
    builtins.__import__ = watching_import
    try:
        yield
    finally:
        if builtins.__import__ is watching_import:
            builtins.__import__ = original_import
        if swapped and type(environ) is _WatchedEnviron:
            environ.__class__ = original_class
