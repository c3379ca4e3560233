"""The ``float32`` knob: a model that computes in float64 runs in float32, the script unchanged.

float64 usually reaches a model by accident: NumPy makes float64 arrays by default,
``torch.from_numpy`` keeps their dtype, and ``model.double()`` is what makes "expected
scalar type Double but found Float" go away. This knob measures what float32 would give.

How: an outermost module call (no module call of the same thread under way;
:mod:`trainprof.capture.outermost_calls`) converts the module's float64 parameters and
buffers to float32 once, in place (``Module._apply``, as ``Module.float()`` does: the
optimizer keeps the same ``Parameter`` objects; other dtypes are left alone), and
converts each float64 tensor among the call's positional and keyword arguments. ``false``
installs the same wrapper and converts nothing, so both arms of ``--knob
float32=false,true`` pay its Python. A loss computed by a function from the model's
output and a float64 target (``F.mse_loss(model(x), y)``) may then fail in its backward
on the mixed dtypes, where a loss module (``nn.MSELoss()``) gets its target converted:
such a trial shows as crashed.

Not converted: modules wrapped in DistributedDataParallel or FSDP (their gradient buckets
are laid out for the parameters as they were built; counted in ``skipped``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainprof.capture import outermost_calls


def install(value: bool, record: dict[str, Any]) -> Callable[[], None]:
    """Hook the model's outermost calls; returns the function that undoes it.

    ``record`` (the knob's entry in run.json) gets ``value`` and what
    :func:`trainprof.capture.outermost_calls.install_conversion` counts: ``modules`` that
    had float64 tensors converted, ``calls``, float64 ``inputs`` converted, distributed
    wrappers ``skipped``.
    """
    import torch

    float64, float32 = torch.float64, torch.float32
    tensor = torch.Tensor
    record["value"] = value

    def to_float32(t: Any) -> Any:
        return t.to(float32) if t.dtype is float64 else t

    def convert_module(module: Any) -> bool:
        if value and any(t.dtype is float64 for t in (*module.parameters(),
                                                      *module.buffers())):
            module._apply(to_float32)
            return True
        return False

    def convert_arg(arg: Any) -> Any:
        if value and isinstance(arg, tensor) and arg.dtype is float64:
            return arg.to(float32)
        return arg

    return outermost_calls.install_conversion(record, convert_module, convert_arg)
