"""Warnings raised in the op count's window, shown where Python shows them without trainprof.

Why: in its window (:mod:`trainprof.capture.opcount`) trainprof pushes a
``TorchFunctionMode`` and a ``TorchDispatchMode`` (:mod:`trainprof.capture.flop_count`;
alone when the model is ``torch.compile``-d), and torch calls then run inside their Python
frames. Python places a warning by walking the stack: ``warnings.warn(msg, stacklevel=k)``
names the k-th frame up, a C++ ``TORCH_WARN`` the innermost Python frame when the C++ call
returns. With a mode's frames on the stack both can land on trainprof's line instead of the
script's: ``F.softmax(x)``'s implicit-dim warning (``stacklevel=3``) and the C++ warning of
``torch.mul(..., out=)`` were placed at ``opcount.py: return func(*args, ...)``, and a
``stacklevel`` in an op's Python kernel counts the dispatch mode's frames. Not only the
place is wrong: Python's once-per-location memory (the ``__warningregistry__`` of the
module it names) and a filter's ``module=`` go by that place, so a warning the script had
already shown was printed again in the window, at trainprof's line, and the script's
``filterwarnings("error", module="__main__")`` let it pass.

How: the modes' call path is left as it is (no cost per op). While a window is open a
filter goes first in ``warnings.filters`` whose message pattern is an object of ours: the C
warnings code calls its ``match`` with each warning the filters see, on the stack it was
raised on. When a mode's frame is on that stack it matches, as ``always`` (which writes no
registry), and the warning reaches ``warnings._showwarnmsg``, replaced for the window, with
the file and line Python chose. That frame is found on the stack, and the frame Python
would have chosen without the modes is the one as many frames up once the modes' frames
are taken out: each mode's frame; the torch frames that called it
(``handle_torch_function``, the ``torch._disable_dynamo`` wrappers of
``__torch_dispatch__``); the function mode's second frame of the call it makes again
(``F.softmax`` runs twice: to reach the mode, and from it); the ``OpOverload.__call__``
the dispatch mode runs the op through. The warning is issued again there by
``warnings.warn_explicit``, with that frame's module name and ``__warningregistry__`` and
the script's filters as they are: printed once per location as without trainprof, ignored
where the script ignores it, and raised where a filter says ``error`` - from inside the
original ``warnings.warn`` (or C++ call), as the same ``Warning`` subclass. The filter list
is changed in place without ``warnings._filters_mutated()``, which would clear every
module's once-per-location memory (warnings already shown would show again).

Cost: nothing per op; a warning raised in the window through a mode's frame costs a stack
walk and a second ``warn_explicit`` (about 9 us more, measured, for one the filters ignore;
one already shown at its place is stopped by its registry before the filters, as before).

Filters the script adds in the window (``filterwarnings``, ``catch_warnings``) would go
before ours and see the place Python chose: ``warnings._filters_mutated``, which each of
them calls, is wrapped for the window to put ours back in front.

Left as Python leaves them: warnings whose stack holds no mode frame (the script's own,
other threads'). When the line Python chose is on the stack twice (a torch wrapper's line
such as ``torch._disable_dynamo``'s, which every disabled function shares; a recursion) the
innermost is taken, the smaller stacklevel: a ``stacklevel`` that lands on the dispatch
mode's own wrapper frames can be placed one such frame off, still inside torch.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import threading
import warnings
from types import CodeType, FrameType
from typing import Any

#: code of a mode's hook -> True for a TorchFunctionMode's (which calls the function again)
_MODE_CODES: dict[CodeType, bool] = {}
#: how many windows are open (the op count's and the FLOP count's modes open one each)
_open = 0
#: ``warnings._showwarnmsg`` and ``warnings._filters_mutated`` as they were when the last
#: window opened
_saved_show: Any = None
_saved_mutated: Any = None
_local = threading.local()


#: files of torch's frames that call a mode's hook (``handle_torch_function``; the
#: ``torch._disable_dynamo`` wrappers a TorchDispatchMode's ``__torch_dispatch__`` gets)
_CALLERS: frozenset[str] = frozenset()
#: ``OpOverload.__call__``: what the dispatch mode calls to run the op
_OP_CALL: CodeType | None = None


def watch(hook: Any, function_mode: bool) -> None:
    """Count frames of ``hook`` (a mode's ``__torch_function__`` or ``__torch_dispatch__``,
    wrapped or not) as the window's, to be left out when placing a warning."""
    global _CALLERS, _OP_CALL
    if not _CALLERS:
        import torch._ops
        import torch.overrides

        # torch's folder as its frames name it (co_filename)
        root = os.path.dirname(torch.overrides.handle_torch_function.__code__.co_filename)
        _CALLERS = frozenset(os.path.join(root, *p.split("/")) for p in (
            "overrides.py", "_compile.py", "_dynamo/eval_frame.py"))
        _OP_CALL = torch._ops.OpOverload.__call__.__code__
    _MODE_CODES[inspect.unwrap(hook).__code__] = function_mode


#: The warnings module's hooks this relies on (CPython's, 3.11-3.13); without them the
#: warnings are left where Python places them.
_SUPPORTED = hasattr(warnings, "_showwarnmsg") and hasattr(warnings, "_filters_mutated")


def open_window() -> None:
    """Start placing the warnings raised through the modes' frames (see the module's docs)."""
    global _open, _saved_show, _saved_mutated
    if not _SUPPORTED:
        return
    _open += 1
    if _open > 1:
        return
    # (still ours when a hook set over it in a window gave it back after: the one ours
    # replaced is saved)
    if warnings._showwarnmsg is not _show:  # type: ignore[attr-defined]
        _saved_show = warnings._showwarnmsg  # type: ignore[attr-defined]
    if warnings._filters_mutated is not _mutated:  # type: ignore[attr-defined]
        _saved_mutated = warnings._filters_mutated  # type: ignore[attr-defined]
    _first()  # no _filters_mutated(): see the module's docs
    warnings._showwarnmsg = _show  # type: ignore[attr-defined]
    warnings._filters_mutated = _mutated  # type: ignore[attr-defined]
    _keep_dynamo_out()


def _first() -> None:
    """Our filter first in ``warnings.filters`` (the list in use now)."""
    filters = warnings.filters
    if filters and filters[0] is _FILTER:
        return
    with contextlib.suppress(ValueError):  # one left in a list swapped out and back
        filters.remove(_FILTER)
    filters.insert(0, _FILTER)


def _mutated() -> None:
    """``warnings._filters_mutated`` in the window, which ``filterwarnings``,
    ``simplefilter``, ``resetwarnings`` and ``catch_warnings`` call once they have changed
    the filters: a filter the script adds in the window goes first, and ours goes back in
    front of it (ours applies the script's to the place Python would name; behind it, the
    script's would see trainprof's place: ``catch_warnings(record=True)`` with
    ``simplefilter("always")`` around a call recorded ``opcount.py``)."""
    _saved_mutated()
    if _open:
        _first()


def _keep_dynamo_out() -> None:
    """Dynamo compiles the Python frames a compiled function's eager code calls, and this
    module's are called from C by a warning raised there: they are skipped (``sys._getframe``
    would break its graph, a break that would be trainprof's, not the script's)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    skip = getattr(eval_frame, "skip_code", None)
    if skip is None:  # Dynamo not imported: nothing compiled
        return
    for code in (_ThroughModes.match.__code__, _show.__code__, _place.__code__,
                 _without_modes.__code__, _mutated.__code__, _first.__code__):
        with contextlib.suppress(Exception):
            skip(code)


def close_window() -> None:
    """Stop, once every window that opened has closed: the filter and the show hook go."""
    global _open
    if not _SUPPORTED or _open == 0:
        return
    _open -= 1
    if _open:
        return
    with contextlib.suppress(ValueError):
        warnings.filters.remove(_FILTER)
    if warnings._showwarnmsg is _show:  # type: ignore[attr-defined]
        warnings._showwarnmsg = _saved_show  # type: ignore[attr-defined]
    if warnings._filters_mutated is _mutated:  # type: ignore[attr-defined]
        warnings._filters_mutated = _saved_mutated  # type: ignore[attr-defined]


class _ThroughModes:
    """The message pattern of trainprof's filter: it matches a warning raised while a mode's
    frame is on the calling thread's stack (and only while a window is open: the filter can
    outlive it in a list the script swapped out)."""

    pattern = "<raised through trainprof's window modes>"

    def match(self, text: Any) -> bool:
        hit = False
        if _open and not getattr(_local, "reissuing", False):
            f: FrameType | None = sys._getframe(1)  # where the warning was raised
            while f is not None:
                if f.f_code in _MODE_CODES:
                    hit = True
                    break
                f = f.f_back
        _local.pending = hit  # for _show, next: the warning it shows is this one
        return hit

    def __repr__(self) -> str:
        return self.pattern


_FILTER = ("always", _ThroughModes(), Warning, None, 0)


def _show(msg: Any) -> None:
    """``warnings._showwarnmsg`` in the window: a warning our filter matched is issued again
    where Python would have placed it without the modes; any other is shown as it was."""
    show = _saved_show if _saved_show is not None else warnings._showwarnmsg_impl  # type: ignore[attr-defined]
    if not getattr(_local, "pending", False):
        return show(msg)
    _local.pending = False
    try:
        place = _place(sys._getframe(1), msg.filename, msg.lineno)
    except Exception:  # noqa: BLE001 - never the script's failure: shown as Python placed it
        place = None
    if place is None:
        return show(msg)
    filename, lineno, module, registry = place
    _local.reissuing = True
    try:
        # may raise: the script's filter says "error" - from the original warn call
        warnings.warn_explicit(msg.message, msg.category, filename, lineno, module, registry,
                               None, msg.source)
    finally:
        _local.reissuing = False
    return None


def _place(frame: FrameType | None, filename: str,
           lineno: int) -> tuple[str, int, str, dict[Any, Any]] | None:
    """(filename, lineno, module, registry) where Python would have placed a warning that
    it placed at ``filename:lineno`` from ``frame`` up, had the modes' frames not been on
    the stack; None when that place is not on the stack."""
    frames: list[FrameType] = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    # the same line can be on the stack twice (see the module's docs): the innermost
    at = next((i for i, f in enumerate(frames)
               if f.f_lineno == lineno and f.f_code.co_filename == filename), None)
    if at is None:
        return None
    kept = _without_modes(frames)
    if at >= len(kept):  # beyond the stack: Python names the sys module
        globals_, filename, lineno = sys.__dict__, "sys", 1
    else:
        target = kept[at]
        globals_, filename, lineno = target.f_globals, target.f_code.co_filename, target.f_lineno
    registry = globals_.get("__warningregistry__")
    if not isinstance(registry, dict):
        registry = globals_["__warningregistry__"] = {}
    module = globals_.get("__name__")
    return filename, lineno, module if isinstance(module, str) else "<string>", registry


def _without_modes(frames: list[FrameType]) -> list[FrameType]:
    """The stack (innermost first) as it would be without the modes: each mode's frame goes,
    with torch's frames that called it; under a TorchFunctionMode, the outer frame of the
    call it makes again (``F.softmax`` runs twice: once to reach the mode, once from it);
    under a TorchDispatchMode, the ``OpOverload.__call__`` it runs the op through."""
    drop = [False] * len(frames)
    for i, f in enumerate(frames):
        function_mode = _MODE_CODES.get(f.f_code)
        if function_mode is None:
            continue
        drop[i] = True
        if not function_mode and i and frames[i - 1].f_code is _OP_CALL:
            drop[i - 1] = True
        j = i + 1
        via_python = False
        while j < len(frames) and frames[j].f_code.co_filename in _CALLERS:
            via_python = True
            drop[j] = True
            j += 1
        if function_mode:
            # the frame the mode called (the first one below it still kept), met again above
            child = next((frames[k].f_code for k in range(i - 1, -1, -1) if not drop[k]), None)
            if child is not None:
                for k in range(j, min(j + (3 if via_python else 1), len(frames))):
                    if frames[k].f_code is child:
                        for m in range(j, k + 1):
                            drop[m] = True
                        break
    return [f for f, d in zip(frames, drop, strict=True) if not d]
