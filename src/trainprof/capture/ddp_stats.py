"""DistributedDataParallel's own timing of its steps: how long the gradient all-reduce takes
and how much of it the backward pass hides.

DDP measures this itself, always: its reducer times the forward pass, the backward pass's
compute, and the gradient communication (from the first bucket's all-reduce to the last
one's end) with CPU timers, or CUDA events on a GPU, on iterations 1-10 and every 100th
after that, and ``DistributedDataParallel._get_ddp_logging_data()`` hands out the last
sampled iteration's figures with the model's DDP settings (torch's
``torch/csrc/distributed/c10d/logger.cpp``; the same data DDP logs with
``TORCH_DISTRIBUTED_DEBUG=DETAIL``). Nothing here times anything: trainprof only reads
those figures - from the Recorder's flush thread once a second (the call copies DDP's record
under the reducer's own lock, so it is safe from another thread) - and keeps each sampled
iteration once. DDP models are found by wrapping ``DistributedDataParallel.__init__``
(:mod:`trainprof.capture.hooks`), held by weak reference: a model the script drops is not
kept alive, and its last figures stay in the record. They are read once more as the model
goes (the weak reference's callback: :meth:`DDPStats.add`) and before
``torch.distributed.destroy_process_group`` (wrapped too): the end of a run usually comes
less than a second after the last poll, and the model goes with the function that trained
it, or with PyTorch Lightning's teardown.

What is kept per model (``run.json``'s ``ddp``, a list): its settings (``backend_name``,
``world_size``, ``bucket_cap_bytes``, ``bucket_sizes`` and ``rebuilt_bucket_sizes``,
``find_unused_parameters``, ``unused_parameter_size``, ``gradient_as_bucket_view``,
``static_graph``, ``comm_hook``, ``total_parameter_size_bytes``, ...) and ``samples``:
``[iteration, forward_ns, backward_compute_ns, backward_comm_ns, overlap_ns]`` per sampled
iteration, in DDP's definitions: ``backward_comm`` from the first bucket's all-reduce
launch to the last one's completion, ``overlap`` from that launch to the end of the
backward compute (0 when the communication started after the compute ended). The part of
the communication the step waits for is ``backward_comm - overlap``.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any

#: DDP settings kept from its logging data (those present: some exist only when set).
SETTINGS = (
    "module_name", "backend_name", "world_size", "rank", "bucket_cap_bytes", "bucket_sizes",
    "has_rebuilt_buckets", "rebuilt_bucket_sizes", "find_unused_parameters",
    "unused_parameter_size", "gradient_as_bucket_view", "static_graph", "comm_hook",
    "total_parameter_size_bytes", "num_parameter_tensors", "dtypes", "is_multi_device_module",
    "broadcast_buffers", "has_sync_bn", "join_uneven_inputs",
)
#: One sampled iteration: DDP's field names, in the order of a sample's elements.
SAMPLE_FIELDS = ("iteration", "forward_compute_time", "backward_compute_time",
                 "backward_comm_time", "backward_compute_comm_overlap_time")
#: Samples kept per model (DDP samples every 100th iteration: 100,000 iterations' worth).
MAX_SAMPLES = 1000


class DDPStats:
    """The DDP models of a run and what their reducers measured."""

    def __init__(self) -> None:
        self._models: list[tuple[weakref.ref[Any], dict[str, Any]]] = []
        # Polled by the flush thread and the training thread. Reentrant, and never held
        # across DDP's own calls: a model the script has dropped goes when the poller lets
        # go of it, or in a garbage collection any allocation may start, on whichever thread
        # that is - and its callback (``gone``) takes this lock again. With a plain lock, a
        # run whose model went while the flush thread read it hung at its end (the record
        # never closed; torchrun killed the rank after 30 s).
        self._lock = threading.RLock()

    def add(self, model: Any) -> None:
        """A DistributedDataParallel model was built (called by its wrapped ``__init__``).

        Its last figures are read when it goes, too: the reference's callback holds DDP's
        logger (which holds the reducer) only until then, so nothing outlives the model -
        PyTorch Lightning drops its DDP wrapper at the end of ``fit()``, often less than a
        second after the last poll, without destroying the process group.
        """
        entry: dict[str, Any] = {"settings": {}, "samples": []}
        logger = getattr(model, "logger", None)

        def gone(_ref: Any, logger: Any = logger, entry: dict[str, Any] = entry) -> None:
            if logger is None:
                return
            try:
                data = logger._get_ddp_logging_data()
                figures = {**data.strs_map, **data.ints_map}
            except Exception:  # noqa: BLE001 - a reducer torn down: its last poll stands
                return
            with self._lock:
                self._keep(entry, figures)

        with contextlib.suppress(TypeError):  # not weak-referenceable: not followed
            self._models.append((weakref.ref(model, gone), entry))

    def poll(self) -> bool:
        """Read every live model's latest figures; True when something new was kept.

        DDP is read outside the lock, and the strong reference to each model is let go
        outside it too (see ``__init__``).
        """
        changed = False
        for ref, entry in list(self._models):
            data = self._read(ref)
            if data is not None:
                with self._lock:
                    changed |= self._keep(entry, data)
        return changed

    @staticmethod
    def _read(ref: weakref.ref[Any]) -> dict[str, Any] | None:
        """A live model's logging data (None: gone, torn down, or an older torch)."""
        model = ref()
        if model is None:
            return None
        try:
            data = model._get_ddp_logging_data()
        except Exception:  # noqa: BLE001 - an older torch, or a model torn down
            return None
        return data if isinstance(data, dict) else None

    @staticmethod
    def _keep(entry: dict[str, Any], data: dict[str, Any]) -> bool:
        """Keep a model's settings and its latest sampled iteration; True when new."""
        changed = False
        settings = {k: data[k] for k in SETTINGS if k in data}
        if settings != entry["settings"]:
            entry["settings"] = settings
            changed = True
        sample = [_int(data.get(k)) for k in SAMPLE_FIELDS]
        samples = entry["samples"]
        if (sample[0] > 0 and any(sample[1:])
                and (not samples or samples[-1][0] != sample[0])
                and len(samples) < MAX_SAMPLES):
            samples.append(sample)
            changed = True
        return changed

    def record(self) -> list[dict[str, Any]]:
        """``run.json``'s ``ddp``: one entry per model that reported anything."""
        with self._lock:
            return [{"settings": dict(e["settings"]),
                     "samples": [list(s) for s in e["samples"]]}
                    for _, e in self._models if e["settings"] or e["samples"]]


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 0
