"""The ``autocast`` knob: the model's calls run under ``torch.autocast``, whatever the script does.

Mixed precision runs a model's matrix products and convolutions in 16 bits and keeps
float32 where precision matters (torch's autocast op lists: reductions, losses,
softmax). ``bf16`` has float32's exponent range, so training needs no loss scaling
(PyTorch's AMP documentation; ``fp16`` would need a ``GradScaler`` around the backward
and the optimizer step, which no knob can add to a script safely, so it is not
offered). Hardware decides the gain: tensor cores on a GPU (Ampere or newer for bf16),
AVX-512 BF16 or AMX on a CPU (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``).

How: an outermost module call (no module call of the same thread under way;
:mod:`trainprof.capture.outermost_calls`) enters ``torch.autocast(device_type,
dtype=torch.bfloat16)`` for the device of the module's first parameter (the CPU for a
module without one), so the model's forward and the loss modules called beside it run as
under ``with torch.autocast(...)``; the backward runs each op in the dtype its forward
chose, as autocast's own documentation asks. A loss computed by a function outside any
module (``F.cross_entropy(model(x), y)``) sees bfloat16 outputs. The parameters,
gradients and optimizer stay float32.

``off`` installs the same wrapper with autocast disabled: the Python it adds to every
module call (a thread-local read, about a microsecond for the outermost call) is paid
by both arms, so ``--knob autocast=off,bf16`` compares the precision alone.

``script`` (:data:`trainprof.capture.knobs.SCRIPT_VALUE`, read before :func:`parse`)
installs nothing: the script's own autocast, float16 included, runs as written. It is
the baseline for a script that already uses autocast: ``--knob autocast=script,off``
measures turning the script's own precision off, where a ``bf16`` baseline would measure
from a precision the script never had (a float16 CPU script: 29% saved from bf16, ~77%
from its own float16). ``off`` also disables the script's own autocast around the
model's calls: ``torch.autocast(..., enabled=False)`` inside an enabled region turns it
off there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainprof.capture import outermost_calls

#: Values of the knob: autocast disabled (same wrapper), bfloat16.
VALUES = ("off", "bf16")
#: Device types torch.autocast accepts.
_AUTOCAST_DEVICES = frozenset({"cpu", "cuda", "xpu", "mps", "hpu"})


def parse(text: str) -> str:
    value = text.strip().lower().replace("bfloat16", "bf16")
    if value not in VALUES:
        raise ValueError(f"expected {' or '.join(VALUES)}")
    return value


def install(value: str, record: dict[str, Any]) -> Callable[[], None]:
    """Hook the model's outermost calls (:mod:`trainprof.capture.outermost_calls`); returns
    the function that undoes it.

    ``record`` (the knob's entry in run.json) gets ``value``, ``calls`` (outermost module
    calls made under the knob) and ``device_types`` (their count per device type).
    """
    import torch

    enabled = value == "bf16"
    record.update(value=value, calls=0, device_types={})
    devices: dict[str, int] = record["device_types"]

    def hook(module: Any, call: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        param = next(module.parameters(), None)
        device = param.device.type if param is not None else "cpu"
        try:
            if device not in _AUTOCAST_DEVICES:
                return call(*args, **kwargs)
            with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=enabled):
                return call(*args, **kwargs)
        finally:
            record["calls"] += 1
            devices[device] = devices.get(device, 0) + 1

    return outermost_calls.install(hook)
