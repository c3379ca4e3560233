"""Debugging switches left on while training, sampled once a second off the training thread.

PyTorch has global switches meant for debugging that slow every step: expert-rules.md
H10, "Debug APIs left on" (the PyTorch performance tuning guide: "Disable debugging
APIs": anomaly detection, the autograd profiler, ``emit_nvtx``, gradcheck). Two of
them are process-wide flags that another thread can read without touching the
training thread:

* **anomaly detection** (``torch.autograd.detect_anomaly`` /
  ``set_detect_anomaly(True)``, Lightning's ``Trainer(detect_anomaly=True)``): every
  autograd node of the forward keeps the Python stack that made it, and backward
  checks each node's output for NaN (with ``check_nan``, a device-to-host read per
  node on CUDA). On a CPU loop of 8 MLP blocks, ``trainprof tune --knob
  anomaly_detection=script,false`` measured ×0.21 of the step time with it off.
  ``torch.is_anomaly_enabled()`` reads one C++ static (``AnomalyMode::_enabled``).
* **the profiler** (``torch.profiler.profile`` / ``torch.autograd.profiler.profile``
  recording): ``torch.autograd.profiler._is_profiler_enabled``, a module global set
  while the profiler records (with a schedule, only in its warm-up and active steps).
  trainprof's own ``--deep`` windows set it too: samples taken while one of its tools
  is on (``FLAG_PROFILED``) are not counted.

The Recorder calls :meth:`DebugModes.sample` at each once-a-second flush in which
steps were made (a script's set-up and teardown do not count), and keeps
:meth:`DebugModes.record` in run.json's ``debug_modes``. Environment switches of the
same kind (``CUDA_LAUNCH_BLOCKING``, ``PYTORCH_NO_CUDA_MEMORY_CACHING``) are in the
fingerprint's environment.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def _anomaly(torch: Any) -> bool:
    return bool(torch.is_anomaly_enabled())


def _profiler(torch: Any) -> bool:
    profiler = sys.modules.get("torch.autograd.profiler")
    return bool(getattr(profiler, "_is_profiler_enabled", False))


#: name -> probe(torch module) -> bool
PROBES: dict[str, Callable[[Any], bool]] = {
    "anomaly_detection": _anomaly,
    "profiler": _profiler,
}


class DebugModes:
    """Counts, over once-a-second samples taken while training runs, how often each
    switch was on; the step at which each was first seen on."""

    def __init__(self) -> None:
        self.samples = 0
        self.on: dict[str, int] = {}
        self.first_on_step: dict[str, int] = {}
        self.check_nan: bool | None = None
        self.errors: dict[str, str] = {}

    def sample(self, step: int) -> bool:
        """One sample; True when a switch is seen on for the first time (worth writing)."""
        torch = sys.modules.get("torch")
        if torch is None:
            return False
        self.samples += 1
        new = False
        for name, probe in PROBES.items():
            try:
                on = probe(torch)
            except Exception as exc:  # a torch without it: recorded once, never fatal
                self.errors.setdefault(name, f"{type(exc).__name__}: {exc}")
                continue
            if on:
                self.on[name] = self.on.get(name, 0) + 1
                if name not in self.first_on_step:
                    self.first_on_step[name] = step
                    new = True
                if name == "anomaly_detection":
                    try:
                        self.check_nan = bool(torch.is_anomaly_check_nan_enabled())
                    except Exception:
                        self.check_nan = None
        return new

    def record(self) -> dict[str, Any]:
        """run.json's ``debug_modes``: ``samples`` taken, per switch the samples it was
        ``on`` and the step it was first seen on."""
        out: dict[str, Any] = {"samples": self.samples, "on": dict(self.on),
                               "first_on_step": dict(self.first_on_step)}
        if self.check_nan is not None:
            out["anomaly_check_nan"] = self.check_nan
        if self.errors:
            out["errors"] = dict(self.errors)
        return out
