"""Device-side step time on CUDA, from the CUDA-event records (see capture/device_timer.py).

Shares are time-weighted over the steady-state steps, like the host breakdown:
``forward``/``backward``/``optimizer`` are the stream time between each
phase's markers, ``gap`` the rest of the device step (the stream's time outside
training phases: where a GPU starved by data loading sits idle).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def device_statistics(device: np.ndarray, first_steady_step: int) -> dict[str, Any] | None:
    """Summary of device time per step, or None when the run had no CUDA records."""
    if len(device) == 0:
        return None
    steady = device[device["step"] >= first_steady_step]
    if len(steady) == 0:
        steady = device
    total = float(steady["dev_step_ns"].sum())
    if total <= 0:
        return None

    def share(field: str) -> float:
        return float(steady[field].sum()) / total

    return {
        "steps": len(steady),
        "median_step_s": float(np.median(steady["dev_step_ns"])) / 1e9,
        "breakdown": {
            "forward": share("dev_forward_ns"),
            "backward": share("dev_backward_ns"),
            "optimizer": share("dev_optimizer_ns"),
            "gap": share("dev_gap_ns"),
        },
    }


def device_seconds_per_step(device: np.ndarray,
                            first_steady_step: int) -> dict[str, float] | None:
    """The device's mean seconds a steady step (``step_s``) and of forward and backward
    (``model_s``), from the CUDA events at the phase boundaries; None without CUDA records.

    What ops timed by CUDA events are scaled to and shared out of (analysis/ops.py's
    ``summarize_op_time``): the host's forward and backward phases only launch the
    kernels, and a host that runs ahead of the device (a short run, before the launch
    queue fills) times steps shorter than the device's. On an H200, eager attention: the
    host's phases 0.7 ms a step against the device's 3.1 ms, and a host step of 2.0 ms
    against the device's 3.6 ms, which made the kinds' shares of the step sum to 1.6."""
    if len(device) == 0:
        return None
    steady = device[device["step"] >= first_steady_step]
    if len(steady) == 0:
        steady = device
    model = steady["dev_forward_ns"].astype(np.float64) + steady["dev_backward_ns"]
    model_s = float(model.mean()) / 1e9
    step_s = float(steady["dev_step_ns"].astype(np.float64).mean()) / 1e9
    if model_s <= 0 or step_s <= 0:
        return None
    return {"model_s": model_s, "step_s": step_s}
