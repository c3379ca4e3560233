"""Run code around each outermost module call: what the model-level knobs hook into.

A training step calls its model (and often a loss module) from the script; each of those
calls then calls the model's layers. The knobs that change how the model computes
(``autocast``, ``channels_last``, ``float32``) act once per call the script makes: they
wrap ``nn.Module.__call__``, and only a call made while no module call of the same thread
is under way - an outermost one - goes to their hook; the layers' calls go straight
through. Calls made while Dynamo compiles go straight through as well: a compiled model's
graph is traced through its layers, not called from the script.

The cost is a thread-local read for every module call and the hook's own work for the
outermost ones; a knob's two values install the same wrapper, so both arms of a ``trainprof
tune`` comparison pay it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

#: Wrappers whose parameters must stay as they were when the wrapper was built (their
#: gradient buckets or shards are laid out for them): knobs that convert parameters skip them.
DISTRIBUTED_WRAPPERS = frozenset({"DistributedDataParallel", "FullyShardedDataParallel"})

#: ``hook(module, call, args, kwargs)``: runs an outermost call; ``call(*args, **kwargs)``
#: is the module's own ``__call__`` on ``module``.
Hook = Callable[[Any, Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]


def install(hook: Hook) -> Callable[[], None]:
    """Wrap ``nn.Module.__call__`` so that outermost calls go through ``hook``; returns the
    function that undoes it (knobs stack: each undo restores what it found)."""
    from functools import partial

    from torch import nn
    from torch.compiler import is_compiling

    original = nn.Module.__dict__["__call__"]
    local = threading.local()

    def __call__(module: Any, /, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
        if getattr(local, "depth", 0) or is_compiling():
            return original(module, *args, **kwargs)
        local.depth = 1
        try:
            return hook(module, partial(original, module), args, kwargs)
        finally:
            local.depth = 0

    nn.Module.__call__ = __call__  # type: ignore[method-assign]

    def undo() -> None:
        nn.Module.__call__ = original  # type: ignore[method-assign]

    return undo


def install_conversion(record: dict[str, Any], convert_module: Callable[[Any], bool],
                       convert_arg: Callable[[Any], Any]) -> Callable[[], None]:
    """A knob that converts the model once and its arguments at every outermost call.

    ``convert_module(module)`` runs once per outermost module (held weakly) and says whether
    it changed anything; ``convert_arg(arg)`` returns the argument to pass, converted or
    as it was (converted: another object). Distributed wrappers go straight through. The
    knob's ``record`` gets ``modules`` (modules changed), ``calls`` (outermost calls
    converted), ``inputs`` (arguments converted) and ``skipped`` (wrappers by class name).
    """
    import weakref

    seen: weakref.WeakSet[Any] = weakref.WeakSet()
    record.update(modules=0, calls=0, inputs=0, skipped={})
    skipped: dict[str, int] = record["skipped"]

    def convert(arg: Any) -> Any:
        new = convert_arg(arg)
        if new is not arg:
            record["inputs"] += 1
        return new

    def hook(module: Any, call: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        name = type(module).__name__
        if name in DISTRIBUTED_WRAPPERS:
            skipped[name] = skipped.get(name, 0) + 1
            return call(*args, **kwargs)
        if module not in seen:
            seen.add(module)
            record["modules"] += bool(convert_module(module))
        record["calls"] += 1
        return call(*(convert(a) for a in args), **{k: convert(v) for k, v in kwargs.items()})

    return install(hook)
