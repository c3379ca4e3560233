"""Knob overrides: change a setting of an unmodified script from outside (``trainprof tune``).

``trainprof tune`` runs the script once per value of a knob, each time under
``trainprof run`` in a child process, and passes the value in the environment
variable :data:`ENV_VAR` (a JSON object ``{"num_workers": 2, ...}``). The
child's :class:`~trainprof.capture.recorder.Recorder` calls
:func:`install_knobs` before the script starts; without the variable it
returns ``None`` at the cost of one dictionary lookup, so a plain
``trainprof run`` is not touched at all.

Two kinds of knobs (:data:`KNOBS`):

* **DataLoader knobs** (``num_workers``, ``persistent_workers``,
  ``pin_memory``, ``prefetch_factor``, ``batch_size``) replace the keyword
  arguments of every ``torch.utils.data.DataLoader`` the script creates
  (subclasses included: they call ``DataLoader.__init__``), whether the script
  passed them by keyword, by position or not at all. torch's own rules are
  kept: ``prefetch_factor`` and ``persistent_workers=True`` need
  ``num_workers > 0``, so with ``num_workers=0`` they are dropped - and a
  script's own ``prefetch_factor``/``persistent_workers`` are reset when the
  knob turns the workers off, since torch would refuse them (``reset``). ``batch_size``
  is not applied to a loader with a ``batch_sampler`` or with automatic
  batching off (``batch_size=None``): there it would mean something else.
  Everything actually passed, dropped and found is recorded per loader.
* **Process knobs**: ``torch_threads`` (``torch.set_num_threads``, set on the
  training thread before the script starts), ``interop_threads``
  (``torch.set_num_interop_threads``), ``gc_threshold`` (CPython's
  generation-0 threshold; 0 turns automatic collection off) and
  ``gc_freeze`` (``gc.collect(); gc.freeze()`` after the first optimizer
  step, when the model, optimizer and dataset exist: the usual advice is to
  freeze "after set-up, before the loop"), ``explicit_gc`` (``false``: the
  script's own ``gc.collect()`` calls do nothing, counted), ``optimizer`` (the implementation every
  torch.optim optimizer runs: for-loop, foreach or fused,
  :mod:`trainprof.capture.optimizer_impl`), ``anomaly_detection`` (autograd's,
  whatever the script asks) and ``synthetic_data`` (every DataLoader repeats its
  first batch, with ``num_workers=0``: the step with input made free,
  :mod:`trainprof.capture.synthetic_data`) and ``eval_no_grad`` (model calls in eval
  mode run with autograd off, :mod:`trainprof.capture.eval_autograd`; applied by the
  Recorder, which holds the clock) and ``cudnn_benchmark``
  (``torch.backends.cudnn.benchmark``, whatever the script sets) and
  ``zero_grad_set_to_none`` (``zero_grad(set_to_none=...)`` of every optimizer and
  module, whatever the script passes) and ``mha_need_weights`` (``need_weights`` of every
  ``nn.MultiheadAttention`` call, whatever the script passes) and ``tf32`` (TF32 for
  float32 matmuls and convolutions, set again after the script's first optimizer step over what its
  set-up chose) and ``ddp_bucket_cap_mb`` / ``ddp_find_unused_parameters`` /
  ``ddp_comm_hook`` (every DistributedDataParallel model's bucket size, its search for
  unused parameters, and a gradient compression hook for its all-reduce - ``fp16``,
  ``bf16`` or ``none`` - whatever the script passes or registers) and
  ``sharing_strategy`` (``torch.multiprocessing``'s: how workers' batches reach the
  training process, :mod:`trainprof.capture.handoff`) and ``trim_padding`` (every
  DataLoader's batches lose the columns that are padding in every row, as
  :class:`trainprof.fixes.TrimPadding` would cut them: :mod:`trainprof.capture.padding`)
  and ``activation_checkpointing`` (``false``: ``torch.utils.checkpoint.checkpoint``
  runs its function directly, activations kept, no recomputation in backward;
  :mod:`trainprof.capture.checkpointing`) and ``autocast`` (``bf16``: the model's
  calls run under ``torch.autocast`` in bfloat16; ``off``: the same wrapper, autocast
  disabled; :mod:`trainprof.capture.autocast_knob`) and ``channels_last`` (the model
  and its 4-D inputs converted to NHWC, or to NCHW with ``false``, at its outermost
  calls; :mod:`trainprof.capture.channels_last_knob`) and ``float32`` (a float64 model and
  its float64 inputs converted to float32 at its outermost calls;
  :mod:`trainprof.capture.float32_knob`) and ``compile`` (the model under
  ``torch.compile``; :mod:`trainprof.capture.compile_knob`).
* **Environment knobs** (:data:`ENV_KNOBS`): ``omp_wait_policy`` sets
  ``OMP_WAIT_POLICY`` in the child's environment (``trainprof tune`` does, when it
  starts the child): OpenMP reads it when torch loads its runtime, before anything in
  the process could change it. The child records the value it found. While a thread knob is
  set, the script's own ``torch.set_num_threads`` / ``set_num_interop_threads`` calls are
  ignored (and recorded): a script that pins its thread count must not silently undo the
  value under test.

The record (``run.json``'s ``knobs``) is what :meth:`Knobs.record` returns:
``requested`` (the overrides), ``dataloaders`` (per DataLoader created: what
was ``set``, what was ``dropped`` and why, what of the script's was ``reset``, the
script's own values), ``process``
(what was set) and ``errors``. ``trainprof tune`` shows it next to each arm,
so a knob that did nothing (no DataLoader, a dropped value) is visible.

This module imports nothing heavy at import time: ``trainprof tune`` uses
:data:`KNOBS` and :func:`parse_value` to check values before any child starts.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from trainprof.capture import autocast_knob, channels_last_knob, compile_knob, float32_knob
from trainprof.capture.explicit_gc import ExplicitCollects
from trainprof.errors import UsageError

#: The environment variable ``trainprof tune`` sets for each child ``trainprof run``.
ENV_VAR = "TRAINPROF_KNOBS"

#: gc.collect as CPython has it (the ``explicit_gc`` knob and the hooks replace the
#: module attribute; the ``gc_freeze`` knob's own collection must still collect)
_REAL_COLLECT = gc.collect

#: A knob value meaning "leave the script's own setting" (``--knob num_workers=script,2``).
SCRIPT_VALUE = "script"

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError("expected true or false")


def _int_at_least(lowest: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise ValueError(f"expected an integer ≥ {lowest}") from None
        if value < lowest:
            raise ValueError(f"expected an integer ≥ {lowest}")
        return value

    return parse


#: ``ddp_comm_hook`` values: DDP's compression hooks (torch.distributed.algorithms.
#: ddp_comm_hooks.default_hooks), or ``none`` for DDP's own all-reduce.
COMM_HOOKS = {"fp16": "fp16_compress_hook", "bf16": "bf16_compress_hook", "none": None}


def _comm_hook(text: str) -> str:
    value = text.strip().lower()
    if value not in COMM_HOOKS:
        raise ValueError(f"expected {', '.join(COMM_HOOKS)}")
    return value


SHARING_STRATEGIES = ("file_descriptor", "file_system")


def _sharing_strategy(text: str) -> str:
    value = text.strip().lower().replace("-", "_")
    if value not in SHARING_STRATEGIES:
        raise ValueError(f"expected {' or '.join(SHARING_STRATEGIES)}")
    return value


def _wait_policy(text: str) -> str:
    value = text.strip().lower()
    if value not in ("active", "passive"):
        raise ValueError("expected active or passive")
    return value


def _implementation(text: str) -> str:
    from trainprof.capture.optimizer_impl import KNOB_VALUES

    value = KNOB_VALUES.get(text.strip().lower())
    if value is None:
        raise ValueError("expected for-loop, foreach or fused")
    return value


@dataclass(frozen=True)
class KnobSpec:
    """One knob: where it acts (``dataloader`` or ``process``) and how its values parse."""

    name: str
    kind: str
    parse: Callable[[str], Any]
    help: str


KNOBS: dict[str, KnobSpec] = {
    spec.name: spec
    for spec in (
        KnobSpec("num_workers", "dataloader", _int_at_least(0),
                 "DataLoader worker processes (0: load in the training process)"),
        KnobSpec("persistent_workers", "dataloader", _bool,
                 "keep DataLoader workers alive across epochs (needs num_workers > 0)"),
        KnobSpec("pin_memory", "dataloader", _bool, "page-locked batches (faster H2D copies)"),
        KnobSpec("prefetch_factor", "dataloader", _int_at_least(1),
                 "batches loaded ahead per worker (needs num_workers > 0)"),
        KnobSpec("batch_size", "dataloader", _int_at_least(1),
                 "samples per batch (tune then compares time per sample)"),
        KnobSpec("torch_threads", "process", _int_at_least(1),
                 "torch.set_num_threads: intra-op threads of the training process"),
        KnobSpec("interop_threads", "process", _int_at_least(1),
                 "torch.set_num_interop_threads"),
        KnobSpec("gc_threshold", "process", _int_at_least(0),
                 "CPython's generation-0 GC threshold (default 700; 0: no automatic GC)"),
        KnobSpec("gc_freeze", "process", _bool,
                 "gc.collect(); gc.freeze() after the first optimizer step"),
        KnobSpec("explicit_gc", "process", _bool,
                 "the script's own gc.collect() calls (false: they do nothing, counted)"),
        KnobSpec("optimizer", "process", _implementation,
                 "the optimizer step's implementation: for-loop, foreach or fused"),
        KnobSpec("anomaly_detection", "process", _bool,
                 "autograd anomaly detection, whatever the script asks"),
        KnobSpec("synthetic_data", "process", _bool,
                 "every DataLoader repeats its first batch, no workers: input made free"),
        KnobSpec("eval_no_grad", "process", _bool,
                 "model calls in eval mode (model.eval()) run with autograd off"),
        KnobSpec("cudnn_benchmark", "process", _bool,
                 "torch.backends.cudnn.benchmark: cuDNN times its algorithms per shape"),
        KnobSpec("zero_grad_set_to_none", "process", _bool,
                 "zero_grad(set_to_none=...) of every optimizer and module"),
        KnobSpec("mha_need_weights", "process", _bool,
                 "nn.MultiheadAttention's need_weights (false: its fused "
                 "scaled_dot_product_attention path, no attention weights returned)"),
        KnobSpec("tf32", "process", _bool,
                 "TF32 tensor cores for float32 matmuls and convolutions (Ampere+ GPUs)"),
        KnobSpec("ddp_bucket_cap_mb", "process", _int_at_least(1),
                 "DistributedDataParallel's bucket_cap_mb (default 25)"),
        KnobSpec("ddp_comm_hook", "process", _comm_hook,
                 "DDP gradient compression for the all-reduce: fp16, bf16 (NCCL) or none"),
        KnobSpec("ddp_find_unused_parameters", "process", _bool,
                 "DistributedDataParallel's find_unused_parameters"),
        KnobSpec("omp_wait_policy", "env", _wait_policy,
                 "OMP_WAIT_POLICY for torch's intra-op threads: active (idle threads spin, "
                 "the default) or passive (they sleep); set before the run starts"),
        KnobSpec("sharing_strategy", "process", _sharing_strategy,
                 "how workers' batches reach the training process: file_descriptor "
                 "(Linux's default) or file_system (torch.multiprocessing)"),
        KnobSpec("trim_padding", "process", _bool,
                 "every batch padded only to its longest sequence (the columns that are "
                 "padding in every row cut, as trainprof.fixes.TrimPadding does)"),
        KnobSpec("autocast", "process", autocast_knob.parse,
                 "the model's calls under torch.autocast: bf16 (mixed precision, no loss "
                 "scaling needed), off (the same wrapper, full precision) or script (the "
                 "script's own autocast, untouched)"),
        KnobSpec("channels_last", "process", _bool,
                 "the model and its 4-D inputs in NHWC memory format at its outermost calls "
                 "(false: NCHW, the same wrapper)"),
        KnobSpec("float32", "process", _bool,
                 "a float64 model and its float64 inputs in float32 at its outermost calls "
                 "(false: the same wrapper, nothing converted)"),
        KnobSpec("compile", "process", compile_knob.parse,
                 "the model under torch.compile: true (default mode), reduce-overhead (CUDA "
                 "graphs), max-autotune, or false (the same wrapper, eager)"),
        KnobSpec("activation_checkpointing", "process", _bool,
                 "torch.utils.checkpoint (false: each checkpointed function runs directly, "
                 "its activations kept: no recomputation in backward, more memory)"),
    )
}

DATALOADER_KNOBS = tuple(n for n, s in KNOBS.items() if s.kind == "dataloader")
#: Knobs that hook the model's outermost calls (trainprof.capture.outermost_calls): each
#: ``install(value, record)`` returns its undo; installed in this order, the last outermost.
MODEL_KNOBS: dict[str, Callable[[Any, dict[str, Any]], Callable[[], None]]] = {
    "autocast": autocast_knob.install,
    "channels_last": channels_last_knob.install,
    "float32": float32_knob.install,
    "compile": compile_knob.install,
}
#: Knobs that are environment variables of the child process (read by a library as it
#: loads, before any knob could act in the process): ``trainprof tune`` sets them.
ENV_KNOBS = {"omp_wait_policy": "OMP_WAIT_POLICY"}


def knob_environment(overrides: dict[str, Any]) -> dict[str, str]:
    """The environment variables the ``env`` knobs among ``overrides`` set."""
    return {var: str(overrides[name]).upper() for name, var in ENV_KNOBS.items()
            if overrides.get(name) is not None}
#: Arguments of every DistributedDataParallel the script builds (:meth:`Knobs._install_ddp`).
DDP_ARGUMENTS = {"ddp_bucket_cap_mb": "bucket_cap_mb",
                 "ddp_find_unused_parameters": "find_unused_parameters"}
DDP_KNOBS = (*DDP_ARGUMENTS, "ddp_comm_hook")


def parse_value(name: str, text: str) -> Any:
    """The value of knob ``name`` written as ``text``; :data:`SCRIPT_VALUE` gives ``None``.

    Raises UsageError (one line) for an unknown knob or a bad value.
    """
    spec = KNOBS.get(name)
    if spec is None:
        raise UsageError(f"unknown knob {name!r} (knobs: {', '.join(KNOBS)})")
    if text.strip().lower() == SCRIPT_VALUE:
        return None
    try:
        return spec.parse(text)
    except ValueError as exc:
        raise UsageError(f"bad value {text!r} for knob {name}: {exc}") from None


def encode(overrides: dict[str, Any]) -> str:
    """The :data:`ENV_VAR` value for ``overrides`` (knobs left at the script's value omitted)."""
    return orjson.dumps({k: v for k, v in overrides.items() if v is not None}).decode()


def decode(text: str) -> dict[str, Any]:
    """Parse and check an :data:`ENV_VAR` value (UsageError when malformed)."""
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise UsageError(f"{ENV_VAR} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{ENV_VAR} must be a JSON object of knob values, got {text!r}")
    out: dict[str, Any] = {}
    for name, value in data.items():
        if value is None:
            continue
        out[name] = parse_value(name, str(value).lower() if isinstance(value, bool) else str(value))
    return out


class Knobs:
    """Applies one set of overrides to this process; :meth:`uninstall` restores everything."""

    def __init__(self, overrides: dict[str, Any]) -> None:
        self.overrides = dict(overrides)
        self.loader_overrides = {
            k: v for k, v in self.overrides.items() if k in DATALOADER_KNOBS
        }
        if self.overrides.get("synthetic_data"):
            # no worker loads anything: the first batch is repeated in the training process
            # (trainprof.capture.synthetic_data); a num_workers asked beside it means nothing
            self.loader_overrides["num_workers"] = 0
        self.dataloaders: list[dict[str, Any]] = []
        self.process: dict[str, Any] = {}
        self.errors: list[str] = []
        #: the script's own thread-count calls ignored while a thread knob is set (a set, ordered)
        self.ignored_calls: dict[str, None] = {}
        self._restore: list[Callable[[], None]] = []
        self.installed = False

    # -- record --------------------------------------------------------------
    def record(self) -> dict[str, Any]:
        """What run.json keeps under ``knobs`` (see the module docstring)."""
        return {
            "requested": dict(self.overrides),
            "dataloaders": list(self.dataloaders),
            "process": dict(self.process),
            "script_calls_ignored": list(self.ignored_calls),
            "errors": list(self.errors),
        }

    # -- install -------------------------------------------------------------
    def install(self) -> Knobs:
        """Apply the overrides; call on the training thread before the script runs."""
        if self.installed:
            return self
        self.installed = True
        if self.loader_overrides:
            self._install_dataloader()
        if "torch_threads" in self.overrides:
            self._install_threads("torch_threads", "set_num_threads", "get_num_threads")
        if "interop_threads" in self.overrides:
            self._install_threads(
                "interop_threads", "set_num_interop_threads", "get_num_interop_threads"
            )
        if "gc_threshold" in self.overrides:
            old = gc.get_threshold()
            value = int(self.overrides["gc_threshold"])
            gc.set_threshold(value, *old[1:])
            self.process["gc_threshold"] = list(gc.get_threshold())
            self._restore.append(lambda: gc.set_threshold(*old))
        if self.overrides.get("gc_freeze"):
            self._install_gc_freeze()
        elif "gc_freeze" in self.overrides:
            self.process["gc_freeze"] = False
        if self.overrides.get("explicit_gc") is False:
            self._install_no_explicit_gc()
        elif "explicit_gc" in self.overrides and self.overrides["explicit_gc"] is not None:
            self.process["explicit_gc"] = {"value": True}
        if self.overrides.get("optimizer"):
            self._install_optimizer(self.overrides["optimizer"])
        if self.overrides.get("synthetic_data"):
            from trainprof.capture import synthetic_data

            entry = self.process["synthetic_data"] = {}
            self._restore.append(synthetic_data.install(entry))
        elif "synthetic_data" in self.overrides:
            self.process["synthetic_data"] = False
        if self.overrides.get("anomaly_detection") is not None:
            self._install_anomaly(bool(self.overrides["anomaly_detection"]))
        if self.overrides.get("cudnn_benchmark") is not None:
            self._install_cudnn_benchmark(bool(self.overrides["cudnn_benchmark"]))
        if self.overrides.get("zero_grad_set_to_none") is not None:
            self._install_zero_grad(bool(self.overrides["zero_grad_set_to_none"]))
        if self.overrides.get("mha_need_weights") is not None:
            self._install_mha_need_weights(bool(self.overrides["mha_need_weights"]))
        if self.overrides.get("tf32") is not None:
            self._install_tf32(bool(self.overrides["tf32"]))
        if any(self.overrides.get(k) is not None for k in DDP_KNOBS):
            self._install_ddp()
        for name, var in ENV_KNOBS.items():
            if self.overrides.get(name) is not None:  # set by tune before the process started
                self.process[name] = os.environ.get(var)
        if self.overrides.get("sharing_strategy"):
            self._install_sharing_strategy(str(self.overrides["sharing_strategy"]))
        for name, install in MODEL_KNOBS.items():  # each records into its own entry
            if self.overrides.get(name) is not None:
                entry = self.process[name] = {}
                self._restore.append(install(self.overrides[name], entry))
        if self.overrides.get("activation_checkpointing") is False:
            self._install_no_checkpointing()
        elif self.overrides.get("activation_checkpointing") is not None:
            self.process["activation_checkpointing"] = {"value": True}
        if self.overrides.get("trim_padding"):
            self._install_trim_padding()
        elif "trim_padding" in self.overrides and self.overrides["trim_padding"] is not None:
            self.process["trim_padding"] = False
        return self

    def uninstall(self) -> dict[str, Any]:
        """Undo every patch (thread counts stay as set); returns :meth:`record`."""
        if self.installed:
            self.installed = False
            for undo in reversed(self._restore):
                with contextlib.suppress(Exception):
                    undo()
            self._restore.clear()
        return self.record()

    def _install_threads(self, knob: str, setter: str, getter: str) -> None:
        import torch

        value = int(self.overrides[knob])
        original = getattr(torch, setter)
        try:
            original(value)
        except RuntimeError as exc:  # interop: only before any inter-op work started
            self.errors.append(f"{knob}={value}: {exc}")
        self.process[knob] = getattr(torch, getter)()
        ignored = self.ignored_calls

        def ignore(n: int, *args: Any, **kwargs: Any) -> None:
            ignored[f"torch.{setter}({n})"] = None

        ignore.__name__ = setter
        ignore.__doc__ = f"trainprof tune: {knob} is fixed at {value}; this call is ignored."
        setattr(torch, setter, ignore)
        self._restore.append(lambda: setattr(torch, setter, original))

    def _install_gc_freeze(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        process = self.process
        process["gc_freeze"] = "pending: no optimizer step yet"
        pending = [True]
        # objects a library froze already (one does at import on Python 3.12): unfreezing
        # at the end would undo its freeze too, so then ours stays (the run is ending)
        frozen_before = gc.get_freeze_count()

        def freeze(optimizer: Any, args: Any, kwargs: Any) -> None:
            # once; the hook stays registered (a no-op) until uninstall: removing it here
            # would change torch's hook dict while torch iterates over it
            if pending[0]:
                pending[0] = False
                _REAL_COLLECT()
                gc.freeze()
                process["gc_freeze"] = {
                    "frozen_objects": gc.get_freeze_count() - frozen_before}

        handle = register_optimizer_step_post_hook(freeze)

        def undo() -> None:
            handle.remove()
            if not frozen_before:
                gc.unfreeze()

        self._restore.append(undo)

    def _install_no_explicit_gc(self) -> None:
        """The script's ``gc.collect()`` calls (the module attribute) do nothing and
        return 0, counted: what the run would cost without them. CPython's automatic
        collections go on as before."""
        entry = self.process["explicit_gc"] = {"value": False, "skipped": 0}

        def collect(generation: int = 2) -> int:
            frame = ExplicitCollects.caller()
            if frame is None or ExplicitCollects.is_own(frame.f_code.co_filename):
                # trainprof's own (the launcher's), or one no script line made
                return _REAL_COLLECT(generation)
            entry["skipped"] += 1
            return 0

        collect.__doc__ = "trainprof tune: explicit_gc=false; this call does nothing."
        original = gc.collect
        gc.collect = collect
        self._restore.append(lambda: setattr(gc, "collect", original))

    def _install_anomaly(self, value: bool) -> None:
        """Autograd anomaly detection fixed at ``value``: ``torch.set_anomaly_enabled``,
        which ``detect_anomaly``, ``set_detect_anomaly`` (and so Lightning's
        ``detect_anomaly=True``) call, keeps the knob's value; the script's calls that
        asked otherwise are recorded as ignored."""
        import torch

        original = torch.set_anomaly_enabled
        before = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
        original(value)
        self.process["anomaly_detection"] = value
        ignored = self.ignored_calls

        def set_anomaly_enabled(mode: bool, check_nan: bool = True) -> None:
            if bool(mode) != value:
                ignored[f"torch.set_anomaly_enabled({bool(mode)})"] = None
            original(value, check_nan)

        set_anomaly_enabled.__doc__ = (
            f"trainprof tune: anomaly detection is fixed at {value}; other values are ignored.")
        torch.set_anomaly_enabled = set_anomaly_enabled

        def undo() -> None:
            torch.set_anomaly_enabled = original
            original(*before)

        self._restore.append(undo)

    def _install_no_checkpointing(self) -> None:
        """``torch.utils.checkpoint.checkpoint`` calls its function directly (the arguments
        that only steer checkpointing dropped): the regions keep their activations and the
        backward pass recomputes nothing. ``checkpoint_sequential`` and partials made of
        ``checkpoint`` after this (Hugging Face's, at ``gradient_checkpointing_enable()``)
        go through it; the record counts the calls."""
        import functools

        import torch.utils.checkpoint as checkpoint_module

        original = checkpoint_module.checkpoint
        entry = self.process["activation_checkpointing"] = {"value": False, "calls": 0}
        steering = ("use_reentrant", "context_fn", "determinism_check", "debug", "early_stop",
                    "preserve_rng_state")

        @functools.wraps(original)
        def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            entry["calls"] += 1
            for name in steering:
                kwargs.pop(name, None)
            return function(*args, **kwargs)

        checkpoint_module.checkpoint = checkpoint  # type: ignore[assignment]
        self._restore.append(lambda: setattr(checkpoint_module, "checkpoint", original))

    def _install_trim_padding(self) -> None:
        """Every batch that leaves a DataLoader iterator is trimmed (``_next_data`` of both
        of torch's iterators, in the training process: what TrimPadding does in the
        collate, minus where it runs). The record counts the batches and the positions
        before and after."""
        from torch.utils.data.dataloader import (
            _MultiProcessingDataLoaderIter,
            _SingleProcessDataLoaderIter,
        )

        from trainprof.fixes.padding import trimmed

        entry = self.process["trim_padding"] = {"batches": 0, "trimmed": 0,
                                                "positions_before": 0, "positions_after": 0}

        def wrap(orig: Callable[[Any], Any]) -> Callable[[Any], Any]:
            def _next_data(it: Any) -> Any:
                batch, found, keep = trimmed(orig(it))
                entry["batches"] += 1
                if found is not None:
                    entry["trimmed"] += keep < found.length
                    entry["positions_before"] += found.positions
                    entry["positions_after"] += found.rows * keep
                return batch

            return _next_data

        for cls in (_SingleProcessDataLoaderIter, _MultiProcessingDataLoaderIter):
            original = cls.__dict__["_next_data"]
            cls._next_data = wrap(original)  # type: ignore[method-assign]
            self._restore.append(lambda cls=cls, original=original: setattr(
                cls, "_next_data", original))

    def _install_sharing_strategy(self, value: str) -> None:
        """``torch.multiprocessing.set_sharing_strategy(value)`` before the script runs;
        the script's own calls that ask otherwise are recorded as ignored. Workers started
        later (every DataLoader's) pickle their batches the way the strategy says."""
        import torch.multiprocessing as tmp

        original = tmp.set_sharing_strategy
        before = tmp.get_sharing_strategy()
        original(value)
        self.process["sharing_strategy"] = tmp.get_sharing_strategy()
        ignored = self.ignored_calls

        def set_sharing_strategy(new_strategy: str) -> None:
            if new_strategy != value:
                ignored[f"torch.multiprocessing.set_sharing_strategy({new_strategy!r})"] = None

        tmp.set_sharing_strategy = set_sharing_strategy

        def undo() -> None:
            tmp.set_sharing_strategy = original
            original(before)

        self._restore.append(undo)

    def _install_cudnn_benchmark(self, value: bool) -> None:
        """``torch.backends.cudnn.benchmark`` fixed at ``value``: the script's assignments
        (``torch.backends.cudnn.benchmark = ...``, Lightning's ``Trainer(benchmark=...)``)
        and ``torch.backends.cudnn.flags(benchmark=...)`` that ask otherwise are recorded
        as ignored. Both go through ``torch._C._set_cudnn_benchmark``: the attribute's
        descriptor holds its own reference to it, so both are replaced."""
        import torch

        original = torch._C._set_cudnn_benchmark
        before = bool(torch._C._get_cudnn_benchmark())
        original(value)
        self.process["cudnn_benchmark"] = value
        ignored = self.ignored_calls

        def set_cudnn_benchmark(mode: bool) -> None:
            if bool(mode) != value:
                ignored[f"torch.backends.cudnn.benchmark = {bool(mode)}"] = None
            original(value)

        prop = type(torch.backends.cudnn).__dict__.get("benchmark")
        torch._C._set_cudnn_benchmark = set_cudnn_benchmark
        if prop is not None and hasattr(prop, "setter"):
            prop.setter = set_cudnn_benchmark

        def undo() -> None:
            torch._C._set_cudnn_benchmark = original
            if prop is not None and hasattr(prop, "setter"):
                prop.setter = original
            original(before)

        self._restore.append(undo)

    def _install_zero_grad(self, value: bool) -> None:
        """``zero_grad`` of every torch.optim optimizer and nn.Module runs with
        ``set_to_none=value``, whatever the script passes (positionally or by keyword);
        the calls are counted and those that asked otherwise recorded as ignored. The
        base classes' methods are replaced: an optimizer that defines its own zero_grad
        and does not call the base one is left as it is."""
        import torch

        calls = self.process["zero_grad_set_to_none"] = {"value": value, "calls": 0}
        ignored = self.ignored_calls
        for cls in (torch.optim.Optimizer, torch.nn.Module):
            original = cls.__dict__["zero_grad"]

            def zero_grad(obj: Any, set_to_none: bool = True, *, _original: Any = original,
                          _name: str = cls.__name__) -> None:
                calls["calls"] += 1
                if bool(set_to_none) != value:
                    ignored[f"{_name}.zero_grad(set_to_none={bool(set_to_none)})"] = None
                _original(obj, set_to_none=value)

            zero_grad.__doc__ = (f"trainprof tune: {cls.__name__}.zero_grad runs with "
                                 f"set_to_none={value}, whatever is asked.")
            cls.zero_grad = zero_grad  # type: ignore[method-assign, assignment]
            self._restore.append(lambda cls=cls, original=original:
                                 setattr(cls, "zero_grad", original))  # noqa: B010

    def _install_mha_need_weights(self, value: bool) -> None:
        """Every ``nn.MultiheadAttention`` call runs with ``need_weights=value``, whatever
        the script passes (by keyword or in its fifth place). With ``False`` torch computes
        the attention with ``scaled_dot_product_attention`` and returns ``None`` for the
        weights: a script that reads them fails in that arm, which tune reports. The calls
        are counted, and those that asked otherwise recorded as ignored
        (diagnosis/attention.py names this knob for nn.MultiheadAttention's attention)."""
        import torch

        cls = torch.nn.MultiheadAttention
        original = cls.__dict__["forward"]
        calls = self.process["mha_need_weights"] = {"value": value, "calls": 0}
        ignored = self.ignored_calls

        def forward(module: Any, *args: Any, **kwargs: Any) -> Any:
            calls["calls"] += 1
            if len(args) > 4:  # query, key, value, key_padding_mask, need_weights, ...
                asked, args = args[4], (*args[:4], value, *args[5:])
            else:
                asked = kwargs.get("need_weights", True)
                kwargs["need_weights"] = value
            if bool(asked) != value:
                ignored[f"MultiheadAttention(need_weights={bool(asked)})"] = None
            return original(module, *args, **kwargs)

        forward.__doc__ = (f"trainprof tune: nn.MultiheadAttention runs with "
                           f"need_weights={value}, whatever is asked.")
        cls.forward = forward  # type: ignore[method-assign]
        self._restore.append(lambda: setattr(cls, "forward", original))  # noqa: B010

    def _install_tf32(self, value: bool) -> None:
        """TF32 for float32 matmuls (cuBLAS) and convolutions (cuDNN) set to ``value``
        before the script starts, and again after its first optimizer step, over what its
        set-up chose: torch has several ways to set them (``allow_tf32``,
        ``set_float32_matmul_precision``, the ``fp32_precision`` attributes), and set-up
        is where scripts use them. What the script had set by then is recorded."""
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook

        from trainprof.capture.opcount import tf32_settings as read

        def apply() -> None:
            torch.backends.cuda.matmul.allow_tf32 = value
            torch.backends.cudnn.allow_tf32 = value

        before = read()
        apply()
        entry = self.process["tf32"] = {"value": value, "script": "pending: no optimizer step"}
        pending = [True]

        def reapply(optimizer: Any, args: Any, kwargs: Any) -> None:
            # once; the hook stays registered (a no-op) until uninstall (see gc_freeze)
            if pending[0]:
                pending[0] = False
                entry["script"] = read()
                apply()

        handle = register_optimizer_step_post_hook(reapply)

        def undo() -> None:
            handle.remove()
            torch.set_float32_matmul_precision(before["float32_matmul_precision"])
            torch.backends.cudnn.allow_tf32 = before["cudnn_allow_tf32"]

        self._restore.append(undo)

    def _install_ddp(self) -> None:
        """``ddp_bucket_cap_mb``, ``ddp_find_unused_parameters`` and ``ddp_comm_hook`` for
        every DistributedDataParallel model.

        The first two replace the constructor's arguments, however the script passed them;
        the hook is registered right after the constructor, and the script's own
        ``register_comm_hook`` calls are then ignored (and recorded): DDP takes one hook, and a
        second would raise. ``none`` ignores the script's hook, for DDP's plain all-reduce.
        """
        import inspect

        from torch.nn.parallel import DistributedDataParallel as DDP

        arguments = {arg: self.overrides[knob] for knob, arg in DDP_ARGUMENTS.items()
                     if self.overrides.get(knob) is not None}
        hook_name = self.overrides.get("ddp_comm_hook")
        entries = self.process.setdefault("ddp", [])
        ignored = self.ignored_calls
        original_init = DDP.__dict__["__init__"]
        original_register = DDP.__dict__["register_comm_hook"]
        signature = inspect.signature(original_init)

        def __init__(model: Any, /, *args: Any, **kwargs: Any) -> None:  # noqa: N807
            entry: dict[str, Any] = {}
            if arguments:
                bound = signature.bind(model, *args, **kwargs)
                for name, value in arguments.items():
                    entry[f"script_{name}"] = bound.arguments.get(name)
                    bound.arguments[name] = value
                    entry[name] = value
                args, kwargs = bound.args[1:], bound.kwargs
            original_init(model, *args, **kwargs)
            if hook_name is not None:
                entry["comm_hook"] = hook_name
                if COMM_HOOKS[hook_name] is not None:
                    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                    try:
                        original_register(model, None,
                                          getattr(default_hooks, COMM_HOOKS[hook_name]))
                    except Exception as exc:  # bf16 without NCCL: the script trains without
                        self.errors.append(f"ddp_comm_hook={hook_name}: {exc}"[:300])
                        entry["comm_hook"] = None
            entries.append(entry)

        def register_comm_hook(model: Any, state: Any, hook: Any) -> None:
            if hook_name is None:
                return original_register(model, state, hook)
            ignored[f"DistributedDataParallel.register_comm_hook("
                    f"{getattr(hook, '__name__', '?')})"] = None
            return None

        __init__.__wrapped__ = original_init  # type: ignore[attr-defined]
        DDP.__init__ = __init__  # type: ignore[method-assign]
        DDP.register_comm_hook = register_comm_hook  # type: ignore[method-assign]

        def undo() -> None:
            DDP.__init__ = original_init  # type: ignore[method-assign]
            DDP.register_comm_hook = original_register  # type: ignore[method-assign]

        self._restore.append(undo)

    def _install_optimizer(self, implementation: str) -> None:
        """Every torch.optim optimizer the script builds runs ``implementation``.

        Set inside the base ``Optimizer.__init__``, once the param groups exist and
        before the subclass's constructor goes on: what it does after ``super().__init__``
        then sees the new flags (Adagrad builds its state there, laid out for fused or
        not), and no step, nor any state, sees the script's choice. Nothing is added to
        the step itself (trainprof.capture.optimizer_impl.set_implementation).
        """
        from torch.optim import Optimizer

        from trainprof.capture.optimizer_impl import set_implementation

        entries = self.process.setdefault("optimizer", [])
        original = Optimizer.__dict__["__init__"]

        def __init__(opt: Any, /, *args: Any, **kwargs: Any) -> None:  # noqa: N807
            original(opt, *args, **kwargs)
            entries.append(set_implementation(opt, implementation))

        __init__.__wrapped__ = original  # type: ignore[attr-defined]
        Optimizer.__init__ = __init__  # type: ignore[method-assign]
        self._restore.append(lambda: setattr(Optimizer, "__init__", original))

    def _install_dataloader(self) -> None:
        from torch.utils.data import DataLoader

        original = DataLoader.__dict__["__init__"]
        signature = inspect.signature(original)
        knobs = self

        def __init__(loader: Any, /, *args: Any, **kwargs: Any) -> None:  # noqa: N807
            try:
                bound = signature.bind(loader, *args, **kwargs)
            except TypeError:
                return original(loader, *args, **kwargs)  # torch raises its own error
            entry = knobs._override(bound.arguments, signature)
            entry["dataset"] = _qualname(bound.arguments.get("dataset"))
            knobs.dataloaders.append(entry)
            original(*bound.args, **bound.kwargs)

        __init__.__wrapped__ = original  # type: ignore[attr-defined]
        DataLoader.__init__ = __init__  # type: ignore[method-assign]
        self._restore.append(lambda: setattr(DataLoader, "__init__", original))

    def _override(self, arguments: dict[str, Any], signature: inspect.Signature) -> dict[str, Any]:
        """Rewrite one DataLoader call's arguments in place; returns what was done."""

        def current(name: str) -> Any:
            if name in arguments:
                return arguments[name]
            param = signature.parameters.get(name)
            return None if param is None else param.default

        script = {name: current(name) for name in DATALOADER_KNOBS}
        want = self.loader_overrides
        workers = want.get("num_workers", script["num_workers"])
        applied: dict[str, Any] = {}
        dropped: dict[str, str] = {}
        kept: dict[str, str] = {}
        batch_sampler = current("batch_sampler")
        for name, value in want.items():
            if name == "batch_size" and batch_sampler is not None:
                if getattr(batch_sampler, "batch_size", None) == value:
                    # a loader rebuilt from one the knob already set, by its batch_sampler
                    # (accelerate does so with the Trainer's): it batches by the value asked
                    kept[name] = "its batch_sampler already batches so"
                else:
                    dropped[name] = "the script passes a batch_sampler"
            elif name == "batch_size" and script["batch_size"] is None:
                dropped[name] = "the script turned automatic batching off (batch_size=None)"
            elif name in ("prefetch_factor", "persistent_workers") and not workers and value:
                dropped[name] = "needs num_workers > 0"
            else:
                arguments[name] = value
                applied[name] = value
        # torch refuses these without workers: when the knob turned the workers off, the
        # script's own values are reset
        reset: dict[str, Any] = {}
        if not workers:
            if current("prefetch_factor") is not None:
                arguments["prefetch_factor"] = reset["prefetch_factor"] = None
            if current("persistent_workers"):
                arguments["persistent_workers"] = reset["persistent_workers"] = False
        entry = {"set": applied, "dropped": dropped, "reset": reset,
                 "script": {k: script[k] for k in (*want, *reset)}}
        if kept:
            entry["kept"] = kept
        return entry


def _qualname(obj: Any) -> str | None:
    if obj is None:
        return None
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def install_knobs() -> Knobs | None:
    """Apply ``trainprof tune``'s overrides from :data:`ENV_VAR`; ``None`` (no cost) without it."""
    text = os.environ.get(ENV_VAR)
    if not text:
        return None
    return Knobs(decode(text)).install()
