"""A warning attributed below the script reads ``sys:1``, as it does under ``python``.

Under ``python train.py`` the script's module frame is the bottom of the main thread's
stack. A ``warnings.warn(msg, stacklevel=N)`` whose walk up the stack goes past that
bottom is attributed to ``sys:1`` (``setup_context`` in CPython's ``Python/_warnings.c``:
no frame left, so the ``sys`` module's globals, file name ``"sys"``, line 1): a module-level
``warnings.warn(msg, stacklevel=2)``, or a helper's ``stacklevel=3`` called at module level.
Under ``trainprof run`` the script runs in this process, under the frames that launched it
(trainprof's CLI, the launcher, runpy): the same walk lands on one of them, and the user's
log read ``.../trainprof/capture/launcher.py:245: UserWarning: ...`` over a line of
trainprof's code. ``python -m cProfile train.py`` (``cProfile.py:101``), ``runpy.run_path``
(``<frozen runpy>:88``) and coverage.py's ``coverage run`` (an ``exec`` in its
``execfile.py``) do the same.

No shallower stack can give ``sys:1`` in this process: a frame with no caller exists in
the main thread only where the interpreter runs ``__main__`` itself, and beneath the
script there is always at least trainprof's console script (or runpy's frames, under
``python -m trainprof``); the walk skips only importlib's bootstrap frames
(``is_internal_frame``: "importlib" and "_bootstrap" in the file name). So the location
is corrected where the warning is shown: ``warnings._showwarnmsg``, which the
interpreter calls with every warning that passed the filters, whoever issued it
(``warnings.warn``, a ``warn`` bound earlier by ``from warnings import warn``, a C
extension's ``PyErr_WarnEx``), and through which a replaced ``showwarning``
(``logging.captureWarnings``) and ``catch_warnings(record=True)`` receive it. A warning
located at a launching frame, at the very line that frame waits on while the script runs,
is moved to ``sys:1``.

``warnings.warn`` itself is not replaced: torch.compile knows it (Dynamo handles
``_warnings.warn`` itself, and ``reorderable_logging_functions`` names it), and a Python
function in its place would change the graph breaks trainprof measures. Left as it is
(the walk is the interpreter's): the module that filters match such a warning against
(``sys`` under python, the launching frame's module here; no filter of Python's default
set tells the two apart) and the registry ``"default"``/``"once"`` count it in. Other
walks past the script's frame (``inspect.stack()``, ``logging``'s ``stacklevel``) still
see the launching frames.
"""

from __future__ import annotations

import runpy
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

_OWN_DIR = str(Path(__file__).resolve().parents[1])
_RUNPY = runpy.__file__

#: The launcher's frame that runs the script, while it runs (none otherwise).
_floor: list[FrameType] = []


def is_launch_code(filename: str) -> bool:
    """Code of trainprof's or runpy's, which launches the script."""
    return filename.startswith(_OWN_DIR) or filename in (_RUNPY, "<frozen runpy>")


def launching_frames(floor: FrameType, top: FrameType | None) -> list[FrameType]:
    """The frames beneath the script on the stack that ``top`` is the top of, that python
    would not have: ``floor``, the frames under it, and trainprof's frames just over it
    (the launcher's ``exec``). Empty when ``floor`` is not on that stack (another thread's).

    runpy's frames over the floor are not among them: ``python -m pkg.train`` (and
    ``python app.pyz``) run the code from runpy's ``_run_code`` too, and a module-level
    ``stacklevel=2`` reads ``<frozen runpy>:88`` there as here.
    """
    over: list[FrameType] = []
    frame = top
    while frame is not None and frame is not floor:
        if frame.f_code.co_filename.startswith(_OWN_DIR):
            over.append(frame)
        else:  # the script's own frame, or one over it: what came before is not beneath
            over.clear()
        frame = frame.f_back
    if frame is None:
        return []
    under: list[FrameType] = []
    while frame is not None:
        under.append(frame)
        frame = frame.f_back
    return over + under


def _at_launching_frame(filename: str, lineno: int | None) -> bool:
    """Whether a warning shown now is located at a launching frame and at no other frame of
    the stack: runpy's ``_run_code`` line, say, is both over the script (``-m``) and
    beneath it (under ``python -m trainprof``); the frame over it is the one python has."""
    if not _floor:
        return False
    top = sys._getframe(1)
    launching = launching_frames(_floor[0], top)
    if not launching:
        return False
    ids = {id(f) for f in launching}
    at_location = [f for f in _stack(top)
                   if f.f_code.co_filename == filename and f.f_lineno == lineno]
    return bool(at_location) and all(id(f) in ids for f in at_location)


def _stack(top: FrameType | None) -> Iterator[FrameType]:
    while top is not None:
        yield top
        top = top.f_back


def _located_as_under_python(show: Callable[[Any], None]) -> Callable[[Any], None]:
    def _showwarnmsg(msg: Any) -> None:
        try:
            if _at_launching_frame(msg.filename, msg.lineno):
                msg.filename, msg.lineno, msg.line = "sys", 1, None
        except Exception:  # noqa: BLE001 - the warning is shown, located or not
            pass
        show(msg)

    return _showwarnmsg


@contextmanager
def warnings_located_as_under_python(floor: FrameType) -> Iterator[None]:
    """While the script runs from ``floor`` (the launcher's frame that starts it), warnings
    that the interpreter attributes to ``floor`` or a frame beneath the script read
    ``sys:1``."""
    previous = getattr(warnings, "_showwarnmsg", None)
    if previous is None or _floor:  # not this interpreter's warnings module; or nested
        yield
        return
    hook = _located_as_under_python(previous)
    warnings._showwarnmsg = hook  # type: ignore[attr-defined]
    _floor.append(floor)
    try:
        yield
    finally:
        _floor.clear()
        if getattr(warnings, "_showwarnmsg", None) is hook:
            warnings._showwarnmsg = previous  # type: ignore[attr-defined]
