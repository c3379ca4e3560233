"""The time of every aten op in the op count's window, by phase and by kind of op.

Why: "would torch.compile help?" depends on how much of forward and backward goes to ops
that compute little per byte they move — pointwise ops, reductions, normalizations,
copies: each reads its inputs from memory and writes its output back, and on a GPU is one
more kernel launch. torch.compile (Inductor) fuses chains of them into one kernel that
reads and writes once (Ansel et al. 2024, "PyTorch 2"); it cannot make a matrix product
faster. The step clock sees forward and backward whole; the ops' own times tell the two
kinds apart (expert-rules.md C7: unfused pointwise ops → torch.compile, fused layers).

How: the FLOP count's dispatch mode (:mod:`trainprof.capture.flop_count`) times every op
it passes on, only in the op count's two steps: on the CPU by the clock around the op, on
CUDA by a pair of CUDA events around it, resolved when the window's record is written at
the end of the run (never a sync in the loop). Each op's time goes to its phase (the step
clock's: forward and backward make ``model``, the optimizer, zero_grad and the loop's own
code ``other``) and to its kind:

* ``product``: ops with a FLOP formula (matrix products, convolutions);
* ``fused_attention``: the fused attention kernels (``scaled_dot_product_attention``'s
  flash, memory-efficient and cuDNN backends);
* ``attention``: ops on the score matrices of attention computed op by op
  (:mod:`trainprof.capture.eager_attention`);
* ``view``: ops that move no data (views, ``detach``, allocations);
* ``lookup``: embedding lookups and their backward (a gather, and a scatter-add into the
  table's gradient: a large table's dense gradient is written whole), which torch.compile
  does not make cheaper;
* ``fusable``: the rest — pointwise ops, reductions, normalizations, softmax, copies —
  what torch.compile fuses.

On CUDA an op's events measure its kernels when the GPU's queue is full, and its launch as
well when the GPU waits for the host: torch.compile saves launches too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from trainprof.schema import BACKWARD, FORWARD

#: The step clock's phases that are the model's.
_MODEL_PHASES = frozenset({FORWARD, BACKWARD})
#: Ops that move no data besides the views: allocations and autograd's bookkeeping.
_NO_DATA = frozenset({
    "detach", "alias", "lift_fresh", "_unsafe_view", "empty", "empty_like", "empty_strided",
    "new_empty", "new_empty_strided", "set_", "resize_",
})
#: The most op names kept in the ``fusable`` list.
TOP_OPS = 8


class OpClock:
    """Times ops and adds them up by (phase group, kind), and the fusable ops by name."""

    def __init__(self, torch: Any, phase: Callable[[], int | None] | None) -> None:
        self._torch = torch
        self._phase = phase or (lambda: None)
        #: (group, kind) -> ns
        self.ns: dict[tuple[str, str], int] = {}
        #: fusable op name -> ns, in the model's phases
        self.fusable_ns: dict[str, int] = {}
        self._pending: list[tuple[Any, Any, str, str, str, dict[str, Any] | None]] = []
        self.unresolved = 0
        self.cuda = False  # some op was timed by CUDA events

    def start(self, args: tuple[Any, ...]) -> Any:
        """Before the op: a clock reading, or a recorded CUDA event. Never the script's
        failure: where no event can be recorded (a stream being captured into a CUDA graph,
        where recording one is illegal; a CUDA-looking tensor on a torch without CUDA) the
        clock stands in."""
        tensor = self._torch.Tensor
        if any(isinstance(a, tensor) and a.is_cuda for a in args):
            try:
                if not self._torch.cuda.is_current_stream_capturing():
                    event = self._torch.cuda.Event(enable_timing=True)
                    event.record()
                    return event
            except Exception:  # noqa: BLE001, S110 - timed by the clock instead
                pass
        return time.perf_counter_ns()

    def stop(self, began: Any, kind: str, name: str, record: dict[str, Any] | None) -> None:
        """After the op: its time (now, or its end event to resolve at the end) to its
        phase and kind, and to the attention ``record`` it belongs to."""
        phase = self._phase()
        group = "model" if phase is None or phase in _MODEL_PHASES else "other"
        if isinstance(began, int):
            self._add(time.perf_counter_ns() - began, group, kind, name, record)
            return
        try:
            end = self._torch.cuda.Event(enable_timing=True)
            end.record()
        except Exception:  # noqa: BLE001 - the op is left untimed, never the script's failure
            self.unresolved += 1
            return
        self.cuda = True
        self._pending.append((began, end, group, kind, name, record))

    def _add(self, ns: int, group: str, kind: str, name: str,
             record: dict[str, Any] | None) -> None:
        key = (group, kind)
        self.ns[key] = self.ns.get(key, 0) + ns
        if kind == "fusable" and group == "model":
            self.fusable_ns[name] = self.fusable_ns.get(name, 0) + ns
        if record is not None:
            record["ns"] += ns

    def resolve(self, deadline_s: float = 1.0) -> None:
        """Turn the CUDA events into times (at the end of the run): each pair once its end
        has run, waiting at most ``deadline_s`` in all; pairs still pending are counted in
        ``unresolved`` and dropped."""
        until = time.monotonic() + deadline_s
        for start, end, group, kind, name, record in self._pending:
            while not end.query():
                if time.monotonic() > until:
                    break
                time.sleep(0.001)
            else:
                self._add(int(start.elapsed_time(end) * 1e6), group, kind, name, record)
                continue
            self.unresolved += 1
            if record is not None:
                record["unresolved"] = record.get("unresolved", 0) + 1
        self._pending = []

    def per_step(self, steps: int) -> dict[str, Any]:
        """Seconds a step by phase group and kind, and the costliest fusable ops."""
        if not steps:
            return {}
        out: dict[str, Any] = {}
        for (group, kind), ns in sorted(self.ns.items()):
            out.setdefault(group, {})[kind] = ns / 1e9 / steps
        out["fusable_ops"] = [
            {"op": name, "s_per_step": ns / 1e9 / steps}
            for name, ns in sorted(self.fusable_ns.items(), key=lambda kv: -kv[1])[:TOP_OPS]]
        out["timed_by"] = "cuda events" if self.cuda else "clock"
        if self.unresolved:
            out["unresolved"] = self.unresolved
        return out


#: Fused attention kernels (SDPA's backends, forward and backward), by name: torch's FLOP
#: table has them beside the products, but they are attention, and a slow one (the CPU's
#: flash kernel in bfloat16 can take longer than the plain ops) is not a product's time.
_FUSED_ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention",
                    "cudnn_attention")


#: Embedding lookups and their backward passes (aten's names).
_LOOKUPS = frozenset({
    "embedding", "embedding_backward", "embedding_dense_backward", "embedding_sparse_backward",
    "embedding_renorm_", "_embedding_bag", "_embedding_bag_forward_only",
    "_embedding_bag_backward", "_embedding_bag_dense_backward",
    "_embedding_bag_sparse_backward", "_embedding_bag_per_sample_weights_backward",
})


def kind_of(func: Any, packet: Any, registry: dict[Any, Any]) -> str:
    """``fused_attention``, ``product``, ``view``, ``lookup`` or ``fusable`` (see the
    module's docs; ``attention`` is the caller's, from the op's shapes)."""
    if any(part in packet.__name__ for part in _FUSED_ATTENTION):
        return "fused_attention"
    if packet in registry:
        return "product"
    if getattr(func, "is_view", False) or packet.__name__ in _NO_DATA:
        return "view"
    if packet.__name__ in _LOOKUPS:
        return "lookup"
    return "fusable"
