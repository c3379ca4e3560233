"""The input pipeline's ``shared_memory_handoff`` cause: the loop waits on receiving batches.

Measured, not inferred: :mod:`trainprof.capture.handoff` times every shared-memory
storage the training process rebuilds from a worker's batch. When the training
thread spends at least :data:`~trainprof.diagnosis.input_pipeline.HANDOFF` of the
data wait doing that, the workers' speed is not what the loop waits for, and no
worker count fixes it: the cost is per tensor received.

What removes it, in the order the finding gives:

* ``torch.multiprocessing.set_sharing_strategy("file_system")``: the segment is
  opened by name instead of its descriptor being fetched from the worker over a
  socket (one round trip per tensor, which waits for the worker's GIL). Measured on
  this project's 2-core VM: 0.06-0.12 ms per tensor received against 0.34-0.73 ms
  (medians); ``trainprof tune --knob sharing_strategy=file_descriptor,file_system``
  on 2 workers serving an in-memory dataset gave x0.75 of the step (3 trials each,
  95% CI x0.58-x0.89). torch's documentation warns that ``file_system`` can leave
  shared memory behind when processes die; its ``torch_shm_manager`` removes each
  segment once the processes using it have exited.
* fewer tensors per batch: each one pays the receive (a dict of fields, a list of
  per-sample tensors). :class:`trainprof.fixes.PackedCollate` hands a batch over as
  one tensor per dtype and rebuilds it as it was in the training process (rf-detr,
  pytorch/rf-detr PR 1399, packed 114 objects a batch into 9 by hand: 1.25-1.67x
  loader throughput).

``benchmarks/packed_collate.py`` (2 workers, 8 fields a sample, batches of 16, the
loop only receiving; 8 rounds): PackedCollate x0.64 of the time per batch (95% CI
x0.50-x0.75), file_system x0.63 (x0.46-x0.67), both x0.56; with 100 µs of Python per
sample in the workers, x0.78, x0.65 and x0.64.
"""

from __future__ import annotations

from typing import Any

from trainprof.diagnosis.context import Context
from trainprof.diagnosis.finding import Finding, Fix, band

#: A batch with more tensors than this is worth packing into one per dtype (an (x, y)
#: batch is already one tensor per dtype).
MANY_TENSORS = 3


def handoff_evidence(handoff: dict[str, Any] | None) -> dict[str, Any] | None:
    """The summary's ``batch_handoff`` as a finding's evidence (None: nothing received)."""
    if not handoff:
        return None
    return {k: handoff.get(k) for k in ("loader_index", "strategies", "tensors_per_batch",
                                        "median_ms", "mean_ms", "training_thread_share")}


def handoff_sentence(handoff: dict[str, Any]) -> str:
    """One sentence on what receiving the batches cost the training thread."""
    per_batch = handoff.get("tensors_per_batch")
    tensors = f"{per_batch:.0f} tensors a batch, " if per_batch else ""
    return (
        f"Receiving the workers' batches took the training thread "
        f"{float(handoff.get('training_thread_share') or 0) * 100:.0f}% of step time "
        f"({tensors}{float(handoff.get('mean_ms') or 0):.2f} ms per tensor on average, "
        f"median {float(handoff.get('median_ms') or 0):.2f} ms)."
    )


def shared_memory_handoff_finding(ctx: Context, loader: dict[str, Any] | None,
                                  evidence: dict[str, Any], share: float, pct: str) -> Finding:
    """The finding: what receiving each tensor cost, and the two ways to pay it less."""
    handoff = evidence.get("batch_handoff") or {}
    handoff_share = float(handoff.get("training_thread_share") or 0.0)
    per_batch = handoff.get("tensors_per_batch")
    strategies = handoff.get("strategies") or []
    by_fd = "file_descriptor" in strategies
    many = isinstance(per_batch, int | float) and per_batch > MANY_TENSORS
    # the most it gives: the receiving time itself (the wait may hold more)
    gain = min(share, handoff_share)
    title = (
        f"Training waits for data {pct} of step time, {handoff_share * 100:.0f}% receiving "
        f"the workers' batches: {float(handoff.get('mean_ms') or 0):.2f} ms per tensor"
        + (f", {per_batch:.0f} tensors a batch" if per_batch else "")
    )
    text = (
        f"{handoff_sentence(handoff)} Each tensor of a worker's batch is written to a "
        "shared-memory segment of its own and mapped in the training process when the batch "
        "is unpickled"
    )
    lines: list[str] = []
    if by_fd:
        text += (
            ": with torch's file_descriptor sharing strategy (Linux's default) each segment's "
            "descriptor is fetched from the worker over a socket, a round trip per tensor "
            "that also waits for a thread in the worker to get its GIL (up to 5 ms while "
            "the worker runs Python). The file_system strategy opens each segment by name "
            "instead: set it before any DataLoader starts its workers. torch's documentation "
            "warns that it can leave shared memory behind when processes die; its "
            "torch_shm_manager removes each segment once the processes using it have exited."
        )
        lines += [
            "import torch.multiprocessing",
            "",
            "# first thing in the script, before any DataLoader starts its workers",
            'torch.multiprocessing.set_sharing_strategy("file_system")',
        ]
    else:
        text += ("; the file_system strategy is already in use, so what is left to cut is "
                 "the number of tensors per batch.")
    if many or not by_fd:
        text += (
            " Fewer tensors per batch pay the receive fewer times: "
            "`trainprof.fixes.PackedCollate` hands each batch over as one tensor per dtype "
            "and rebuilds it as it was in the training process (the loop gets the same "
            "batch; benchmarks/packed_collate.py: ×0.64 of the time per batch for 8 "
            "fields a sample)."
        )
        collate = str((loader or {}).get("collate_fn") or "")
        inner = ("" if not collate or collate.endswith("default_collate")
                 else collate.rsplit(".", 1)[-1])
        if lines:
            lines.append("")
        lines += [
            "from trainprof.fixes import PackedCollate",
            "",
            f"loader = DataLoader(..., collate_fn=PackedCollate({inner}))  # one tensor per "
            "dtype crosses",
        ]
    command = (f"trainprof tune --knob sharing_strategy=file_descriptor,file_system "
               f"{ctx.script}" if by_fd else f"trainprof run {ctx.script}")
    verify = (command if by_fd else
              f"after the change, `{command}`: the receiving share (now "
              f"{handoff_share * 100:.0f}% of step time) should fall")
    return Finding(
        category="input_pipeline", cause="shared_memory_handoff", title=title,
        severity=band(gain, 0.20, 0.05) or "low", evidence=evidence, estimated_gain=gain,
        fix=Fix(text=text, snippet="\n".join(lines)), verify=verify,
        verify_commands=(command,),
    )
