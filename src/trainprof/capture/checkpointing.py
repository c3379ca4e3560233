"""Activation checkpointing: how much forward the backward pass runs a second time.

``torch.utils.checkpoint.checkpoint(fn, *args)`` runs ``fn`` without keeping its
activations and runs it again during the backward pass to rebuild them: memory traded
for one more forward pass of every checkpointed region per step (PyTorch's
documentation of ``torch.utils.checkpoint``; Chen et al. 2016, "Training Deep Nets
with Sublinear Memory Cost", about one extra forward). Hugging Face models turn it on
with ``gradient_checkpointing_enable()`` (or the Trainer's ``gradient_checkpointing=
True``), often left on where the memory would hold the activations anyway.

The hooks wrap ``torch.utils.checkpoint.checkpoint`` (the module attribute:
``checkpoint_sequential`` and Hugging Face's ``functools.partial(checkpoint, ...)``,
made when the model is set up, both go through it) and time, on the training thread,
each outermost call: its first pass. The backward pass runs the region again
(through the autograd graph, not through this function), so the first pass's time is
what the recomputation costs, a little less with ``use_reentrant=True``, whose first
pass runs without autograd and whose second with it. Per call: two clock reads and a
few additions, against a region's forward of milliseconds.

Calls made while a heavy tool is on (the op count's window, ``--deep``: steps flagged
``FLAG_PROFILED``) are counted but their time is kept apart (``profiled_s``): the
tool's cost is in it (the op count's dispatch mode: 1.5x a region's time in the tests'
4-block model), and the steps it is compared with leave those steps out too
(``analysis.steps.complete_steps``). A region that comes before any other event of
the run begins the first step, as a forward does: its first call, which imports
``torch._dynamo`` (0.9 s), would otherwise be time of no step.
"""

from __future__ import annotations

from typing import Any


class CheckpointCalls:
    """The training thread's outermost ``checkpoint()`` calls: count and time."""

    def __init__(self) -> None:
        self.calls = 0
        self.ns = 0
        #: time of the calls made while a heavy tool was on (not in ``ns``)
        self.profiled_ns = 0
        self.profiled_calls = 0
        self.first_step: int | None = None
        self.last_step: int | None = None
        #: calls by their use_reentrant argument ("true", "false", "default")
        self.reentrant: dict[str, int] = {}
        self.depth = 0  # a checkpoint() inside a checkpointed region is not counted again

    def add(self, ns: int, step: int, use_reentrant: Any, profiled: bool = False) -> None:
        self.calls += 1
        if profiled:
            self.profiled_calls += 1
            self.profiled_ns += ns
        else:
            self.ns += ns
        if self.first_step is None:
            self.first_step = step
        self.last_step = step
        key = "default" if use_reentrant is None else str(bool(use_reentrant)).lower()
        self.reentrant[key] = self.reentrant.get(key, 0) + 1

    def record(self) -> dict[str, Any] | None:
        """run.json's ``activation_checkpointing``; None while no call was made."""
        if not self.calls:
            return None
        return {"calls": self.calls, "total_s": self.ns / 1e9,
                "profiled_calls": self.profiled_calls, "profiled_s": self.profiled_ns / 1e9,
                "first_step": self.first_step, "last_step": self.last_step,
                "use_reentrant": dict(self.reentrant)}
