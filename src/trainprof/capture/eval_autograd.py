"""Model calls in eval mode with autograd on: an evaluation that records graphs it never uses.

expert-rules.md M4 (PyTorch's tuning guide): evaluation without ``torch.no_grad()``
records the autograd graph of every forward and keeps each output's activations alive
for a backward that never comes: time spent recording, and memory that can run a GPU
out of it when outputs are kept (``preds.append(model(x))``).

How it is seen, always on, at no cost to a training step: the model-call hook (the
root module's ``__call__``, timed as forward by the step clock; the C fast path's
``K_CALL``) reads the module's ``training`` flag, an instance attribute, and only when
it is False (``model.eval()``) asks ``torch.is_grad_enabled()``. The clock counts such
calls and their time, with autograd on and off (the C struct's ``eval_n``/``eval_ns``
or the pure-Python clock's attributes); :func:`record` turns them into run.json's
``eval_autograd``, written by the Recorder's flush when they change.

trainprof tune's knob ``eval_no_grad=true`` (:func:`apply_knob`) makes the same hook
run those calls with autograd off (``torch._C._set_grad_enabled``, restored after the
call), so the fix is measured on the script unchanged. A script that needs gradients of
an eval-mode call (saliency maps, adversarial evaluation) fails under the knob, as it
would under the fix.
"""

from __future__ import annotations

from typing import Any

KNOB = "eval_no_grad"


def apply_knob(clock: Any, knobs: Any) -> None:
    """Set the clock's eval_no_grad switch when trainprof tune asks for it."""
    if knobs is None or KNOB not in knobs.overrides:
        return
    value = bool(knobs.overrides[KNOB])
    if value:
        import torch

        clock.set_grad_enabled = torch._C._set_grad_enabled
        clock.eval_no_grad = True
    knobs.process[KNOB] = value


def record(clock: Any) -> dict[str, Any] | None:
    """run.json's ``eval_autograd``: eval-mode model calls with autograd on and off, or
    None before the first one."""
    on, off = int(clock.eval_grad_n), int(clock.eval_nograd_n)
    if not on and not off:
        return None
    return {
        "grad_calls": on,
        "grad_s": int(clock.eval_grad_ns) / 1e9,
        "nograd_calls": off,
        "nograd_s": int(clock.eval_nograd_ns) / 1e9,
        "no_grad_knob": bool(clock.eval_no_grad),
    }
