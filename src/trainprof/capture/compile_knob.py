"""The ``compile`` knob: the model runs under ``torch.compile``, the script unchanged.

"Would torch.compile make this faster?" depends on the model, the shapes and the hardware,
and costs a compilation first: the way to know is to measure the steps after it. This knob
compiles each module the script calls from its loop, at its first outermost call
(:mod:`trainprof.capture.outermost_calls`), with ``torch.compile(module, mode=...)``, and
sends that call and every later one through the compiled module. ``trainprof tune``'s
warm-up detection leaves the compiling steps out of the comparison (they are the slow first
ones); give it enough ``--steps`` for the steady state.

Values: ``false`` (the same wrapper, nothing compiled), ``true`` (torch.compile's default
mode), ``reduce-overhead`` (CUDA graphs on a GPU: fewer launches, for launch-bound loops)
and ``max-autotune`` (it also times kernel variants: a long compilation). Modules without
parameters (a loss module) are left alone, and so are DistributedDataParallel and FSDP
models (compiling them needs the script's own ordering of wrapping and compiling: counted
in ``skipped``). A module whose compilation fails at its first call runs eagerly from then
on, and the error is recorded (``errors``): the arm then measures eager, which the recorded
column of ``trainprof tune`` shows.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from trainprof.capture import outermost_calls

#: The knob's values: off, then torch.compile's modes ("true" is its default mode).
VALUES = ("false", "true", "reduce-overhead", "max-autotune")
_ALIASES = {"off": "false", "no": "false", "0": "false", "on": "true", "yes": "true",
            "1": "true", "default": "true"}


def parse(text: str) -> str:
    value = text.strip().lower()
    value = _ALIASES.get(value, value)
    if value not in VALUES:
        raise ValueError(f"expected {', '.join(VALUES)}")
    return value


def install(value: str, record: dict[str, Any]) -> Callable[[], None]:
    """Hook the model's outermost calls; returns the function that undoes it.

    ``record`` (the knob's entry in run.json) gets ``value``, ``modules`` (modules compiled),
    ``calls`` (outermost calls that went through a compiled module), ``skipped``
    (distributed wrappers, by class name) and ``errors`` (a failed compilation's message, per
    module class).
    """
    import torch

    record.update(value=value, modules=0, calls=0, skipped={}, errors={})
    skipped: dict[str, int] = record["skipped"]
    errors: dict[str, str] = record["errors"]
    compiled: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
    mode = None if value == "true" else value

    def hook(module: Any, call: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        if value == "false":
            return call(*args, **kwargs)
        name = type(module).__name__
        if name in outermost_calls.DISTRIBUTED_WRAPPERS:
            skipped[name] = skipped.get(name, 0) + 1
            return call(*args, **kwargs)
        fast = compiled.get(module)
        if fast is None:
            if module in compiled or next(module.parameters(), None) is None:
                return call(*args, **kwargs)  # failed before, or nothing of its own
            fast = torch.compile(module, mode=mode)
            try:
                out = fast(*args, **kwargs)  # compiles here
            except Exception as exc:  # noqa: BLE001 - measured eager instead, and said so
                errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                compiled[module] = None
                return call(*args, **kwargs)
            compiled[module] = fast
            record["modules"] += 1
            record["calls"] += 1
            return out
        record["calls"] += 1
        return fast(*args, **kwargs)

    return outermost_calls.install(hook)
