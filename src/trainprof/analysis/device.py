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
