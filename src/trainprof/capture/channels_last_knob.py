"""The ``channels_last`` knob: the model's convolutions run in NHWC (or NCHW), whatever the
script does.

A 4-D tensor's memory format is its layout: NCHW (``torch.contiguous_format``, PyTorch's
default) or NHWC (``torch.channels_last``). Convolutions prefer NHWC: on a CPU, oneDNN
reorders NCHW tensors into a blocked layout and back around each convolution, and on a
GPU cuDNN's tensor-core kernels transpose them ("Accelerating PyTorch Vision Models with
Channels Last on CPU", PyTorch blog; the memory-format tutorial). The format carries
through the network from the input and the weights, so the fix is two lines: the model
converted once, each batch converted as it arrives.

How: ``nn.Module.__call__`` is wrapped. An outermost module call (no module call of the
same thread under way) converts the module once - ``module.to(memory_format=...)``, which
changes the 4-D parameters and buffers in place (the optimizer keeps the same
``Parameter`` objects) - and converts each 4-D tensor among its positional and keyword
arguments. ``true`` converts to ``torch.channels_last``; ``false`` to NCHW, so a script
that chose channels_last itself can be measured without it. Both values install the same
wrapper: its Python (a thread-local read and a scan of the arguments, about a microsecond
for each outermost call) is paid by both arms of ``--knob channels_last=false,true``.

Not converted: modules wrapped in DistributedDataParallel or FSDP (their gradient buckets
are laid out for the parameters as they were built; counted in ``skipped``), and calls made
while Dynamo compiles.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

#: Wrappers whose parameters must keep the layout they were built with.
_WRAPPERS = ("DistributedDataParallel", "FullyShardedDataParallel")


def install(value: bool, record: dict[str, Any]) -> Callable[[], None]:
    """Wrap ``nn.Module.__call__``; returns the function that undoes it.

    ``record`` (the knob's entry in run.json) gets ``value``, ``modules`` (the outermost
    modules converted), ``calls`` (outermost module calls made under the knob),
    ``inputs`` (4-D arguments converted) and ``skipped`` (distributed wrappers left alone,
    by class name).
    """
    import torch
    from torch import nn
    from torch.compiler import is_compiling

    original = nn.Module.__dict__["__call__"]
    fmt = torch.channels_last if value else torch.contiguous_format
    local = threading.local()
    converted: weakref.WeakSet[Any] = weakref.WeakSet()
    record.update(value=value, modules=0, calls=0, inputs=0, skipped={})
    skipped: dict[str, int] = record["skipped"]
    tensor = torch.Tensor

    def convert(arg: Any) -> Any:
        if isinstance(arg, tensor) and arg.dim() == 4 and not arg.is_contiguous(
                memory_format=fmt):
            record["inputs"] += 1
            return arg.contiguous(memory_format=fmt)
        return arg

    def __call__(module: Any, /, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
        if getattr(local, "depth", 0) or is_compiling():
            return original(module, *args, **kwargs)
        local.depth = 1
        try:
            name = type(module).__name__
            if name in _WRAPPERS:
                skipped[name] = skipped.get(name, 0) + 1
                return original(module, *args, **kwargs)
            if module not in converted:
                converted.add(module)
                module.to(memory_format=fmt)
                record["modules"] += 1
            record["calls"] += 1
            args = tuple(convert(a) for a in args)
            kwargs = {k: convert(v) for k, v in kwargs.items()}
            return original(module, *args, **kwargs)
        finally:
            local.depth = 0

    nn.Module.__call__ = __call__  # type: ignore[method-assign]

    def undo() -> None:
        nn.Module.__call__ = original  # type: ignore[method-assign]

    return undo
