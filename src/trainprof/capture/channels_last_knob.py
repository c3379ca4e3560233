"""The ``channels_last`` knob: the model's convolutions run in NHWC (or NCHW), whatever the
script does.

A 4-D tensor's memory format is its layout: NCHW (``torch.contiguous_format``, PyTorch's
default) or NHWC (``torch.channels_last``). Convolutions prefer NHWC: on a CPU, oneDNN
reorders NCHW tensors into a blocked layout and back around each convolution, and on a
GPU cuDNN's tensor-core kernels transpose them ("Accelerating PyTorch Vision Models with
Channels Last on CPU", PyTorch blog; the memory-format tutorial). The format carries
through the network from the input and the weights, so the fix is two lines: the model
converted once, each batch converted as it arrives.

How: an outermost module call (no module call of the same thread under way;
:mod:`trainprof.capture.outermost_calls`) converts the module once -
``module.to(memory_format=...)``, which changes the 4-D parameters and buffers in place
(the optimizer keeps the same ``Parameter`` objects) - and converts each 4-D tensor
among its positional and keyword arguments. ``true`` converts to
``torch.channels_last``; ``false`` to NCHW, so a script that chose channels_last itself
can be measured without it. Both values install the same wrapper: its Python (a
thread-local read and a scan of the arguments, about a microsecond for each outermost
call) is paid by both arms of ``--knob channels_last=false,true``.

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
    :func:`trainprof.capture.outermost_calls.install_conversion` counts: ``modules``
    converted, ``calls``, 4-D ``inputs`` converted, distributed wrappers ``skipped``.
    """
    import torch

    fmt = torch.channels_last if value else torch.contiguous_format
    tensor = torch.Tensor
    record["value"] = value

    def convert_module(module: Any) -> bool:
        module.to(memory_format=fmt)
        return True

    def convert_arg(arg: Any) -> Any:
        if isinstance(arg, tensor) and arg.dim() == 4 and not arg.is_contiguous(
                memory_format=fmt):
            return arg.contiguous(memory_format=fmt)
        return arg

    return outermost_calls.install_conversion(record, convert_module, convert_arg)
