"""The Recorder: everything that is always on during a profiled run, started and stopped together.

It owns the step clock, the auto-instrumentation, the system sampler (a child
process: :mod:`trainprof.capture.sampler_process`) and the Run writer. A
daemon thread drains finished steps to disk once a second, so the training
thread never writes files.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import weakref
from array import array
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from trainprof import __version__
from trainprof.capture import eval_autograd, fetch_timing, import_time_env
from trainprof.capture.clock import StepClock
from trainprof.capture.debug_modes import DebugModes
from trainprof.capture.device_timer import DeviceTimer
from trainprof.capture.eager_attention import measure_sdpa
from trainprof.capture.fault_log import FaultLog
from trainprof.capture.fingerprint import collect_fingerprint, launch_environment
from trainprof.capture.hooks import Instrumentation, LoaderRegistry
from trainprof.capture.knobs import install_knobs
from trainprof.capture.loop_stacks import LoopStackSampler
from trainprof.capture.opcount import OpCountTool, compiled_frames
from trainprof.capture.optimizer_impl import class_name, describe_optimizer
from trainprof.capture.optimizer_time import OptimizerTimes
from trainprof.capture.peak_flops import peaks
from trainprof.capture.ranks import MAX_RECORDED, RANKS_DIR, ChildRuns, launcher_rank
from trainprof.capture.sampler_process import SamplerProcess
from trainprof.capture.window import WindowRunner
from trainprof.capture.worker import MAIN_REARM_HZ, WORKERS_DIR, WorkerCapture
from trainprof.schema import FLAG_PROFILED, RECORD_WIDTH, REGION, STEP_FIELDS
from trainprof.store import SAMPLES_JSONL, STACKS_JSONL, RunWriter

#: optimizers described in run.json's ``optimizers`` at most (see _on_new_optimizer)
MAX_OPTIMIZERS = 16

#: ``torch.cuda.memory_stats`` keys recorded in run.json's ``cuda_memory`` (see ``stop``).
#: Longest time finished steps wait in memory before they are written (what kill -9 can lose).
DRAIN_INTERVAL_S = 1.0

CUDA_MEMORY_KEYS = ("num_alloc_retries", "num_ooms", "allocated_bytes.all.peak",
                    "reserved_bytes.all.peak", "num_device_alloc", "num_device_free")

#: The recorder running in this process, if any (one at a time: the patches are global).
_active: Recorder | None = None

#: Held by the flush thread while it works, and by any fork of this process (taken in
#: ``os.register_at_fork``'s ``before``): a process forked while the flush thread is in
#: the middle of an ``import`` (of psutil, say, collecting the fingerprint) inherits that
#: module's import lock held by a thread that does not exist in the child, and hangs at
#: its own ``import psutil`` (a recorded helper did, at the end of its run: 1 run in 5 on
#: Python 3.12). Reentrant: the flush thread may itself start processes.
_FORK_GUARD = threading.RLock()


def _before_fork() -> None:
    _FORK_GUARD.acquire()


def _after_fork_in_parent() -> None:
    _FORK_GUARD.release()


def _after_fork_in_child() -> None:
    global _FORK_GUARD
    _FORK_GUARD = threading.RLock()  # the child's threads are gone: a fresh, free lock


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)


def active_recorder() -> Recorder | None:
    return _active


def forget_inherited_recorder() -> bool:
    """In a forked child: the parent's recorder (a copy) is not ours. True if there was one.

    Its instrumentation was undone at fork; ``trainprof tune``'s overrides (knobs) stay
    in place, as they were in the parent.
    """
    global _active
    if _active is not None and _active.pid != os.getpid():
        _active = None
        return True
    return False


_DUR, _OTHER = STEP_FIELDS.index("dur_ns"), STEP_FIELDS.index("other_ns")


def _other_share(records: bytes) -> float | None:
    """Share of "other" in a batch of native step records (None when there are none)."""
    if not records:
        return None
    values = memoryview(records).cast("q")
    dur = sum(values[_DUR::RECORD_WIDTH])
    return sum(values[_OTHER::RECORD_WIDTH]) / dur if dur > 0 else None


def _wall_time_at(perf_ns: int) -> float:
    """``time.time()`` at the ``perf_counter_ns()`` instant ``perf_ns``.

    The step clock's origin is read when the clock is made, a moment before the run's
    metadata; reading the wall clock then would shift every wall-clock alignment (Kineto
    traces, other ranks) by that moment.
    """
    return time.time() - (time.perf_counter_ns() - perf_ns) / 1e9


class Recorder:
    """Always-on capture of one training run into one Run folder."""

    def __init__(
        self,
        run_dir: Path,
        *,
        name: str,
        command: list[str],
        script: str | None = None,
        max_steps: int | None = None,
        sample_interval_s: float = 0.2,
        auto: bool = True,
        fingerprint: bool = True,
        windows: list[WindowRunner] | None = None,
        knobs: bool = True,
        sampler_at_first_step: bool = False,
    ) -> None:
        self.run_dir = run_dir = Path(os.path.abspath(run_dir))  # the script may chdir
        self._knobs_enabled = knobs  # off in a forked child: the parent's are in place
        # a process the script started (capture.ranks) samples the system only once it
        # trains: a helper process that never steps costs no sampler process
        self._sampler_pending = sampler_at_first_step
        self._started_by_script = sampler_at_first_step  # a process the script started
        self.clock = StepClock(max_steps=max_steps)
        self._max_steps = max_steps
        #: heavy tools over bounded windows of steps (--deep, --py, --lines)
        self.windows = list(windows or [])
        #: sample the Python stacks of DataLoader workers too (set by --py)
        self.worker_sampling = False
        self._script = script
        self._command = command
        self._fingerprinted = not fingerprint  # off: benchmarks of the per-step cost
        self.writer = RunWriter(
            run_dir,
            {
                "name": name,
                "command": command,
                "script": script,
                "trainprof_version": __version__,
                "clock_origin_s": self.clock.origin_ns / 1e9,
                "wall_origin_s": _wall_time_at(self.clock.origin_ns),
                "max_steps": max_steps,
                "sample_interval_s": sample_interval_s,
                "fingerprint": None,
                # the setting the command started in, before the script could change it
                # (a Hydra chdir, os.environ edits): trainprof verify's trials run in it
                "launch": {"cwd": os.getcwd(), "env": launch_environment()},
                "dataloaders": [],
                "missing": [],
            },
        )
        self.loaders = LoaderRegistry(self._on_new_loader)
        self._optimizers: list[dict[str, Any]] = []
        self._optimizer_refs: list[weakref.ref[Any]] = []  # one per entry of _optimizers
        self._optimizer_spent: list[list[int]] = []  # one per entry: [ns, steps] of step()
        self._optimizer_times = OptimizerTimes(lambda: self.clock.owner)
        self._optimizers_more = 0  # optimizers beyond MAX_OPTIMIZERS, counted only
        # eval-mode model calls as last written (capture/eval_autograd.py)
        self._eval_autograd: dict[str, Any] | None = None
        # debugging switches left on (anomaly detection, the profiler), 5 times a second
        self.debug_modes = DebugModes()
        self._debug_step = 0
        self.clock.on_new_optimizer = self._on_new_optimizer
        for runner in self.windows:  # the op count marks the tables an optimizer steps
            for tool in runner.tools:
                if isinstance(tool, OpCountTool):
                    tool.optimizers = self._live_optimizers
        # per-sample timings inside DataLoader workers; stacks too when worker_sampling is set
        self.worker_capture = WorkerCapture(
            run_dir / WORKERS_DIR, sampling=lambda: self.worker_sampling
        )
        # num_workers=0 batches loaded under a heavy tool are left untimed (fetch_timing)
        fetch_timing.MAIN_CLOCK[0] = self.clock
        self.instrumentation = (
            Instrumentation(self.clock, self.loaders, self.worker_capture) if auto else None
        )
        # processes the script starts that may train: a run folder each, under ranks/
        self.child_runs = ChildRuns(run_dir, name=name, command=command,
                                    sample_interval_s=sample_interval_s, max_steps=max_steps)
        if self.instrumentation is not None:
            self.instrumentation.child_runs = self.child_runs
        self.pid = os.getpid()
        self._distributed_seen = False
        self.sampler = SamplerProcess(run_dir / SAMPLES_JSONL, interval_s=sample_interval_s,
                                      pid=os.getpid())
        self.loaders.on_workers = self.sampler.set_worker_pids
        # where the training thread is, 4 to 20 times a second: what "other" is made of
        self.loop_stacks = LoopStackSampler(self.clock, run_dir / STACKS_JSONL)
        # the Python stacks of a death by a fatal signal (segfault, abort), into the folder
        self.fault_log = FaultLog(run_dir)
        self._flusher: threading.Thread | None = None
        self._flusher_stop = threading.Event()
        self._started = False
        self._stopped = False
        self._last_drain = 0.0

    # -- lifecycle -----------------------------------------------------------
    def start(self) -> Recorder:
        global _active
        if _active is not None:
            raise RuntimeError("a trainprof recorder is already running in this process")
        # trainprof tune's overrides (TRAINPROF_KNOBS), before the script runs; None otherwise
        self.knobs = install_knobs() if self._knobs_enabled else None
        eval_autograd.apply_knob(self.clock, self.knobs)
        if self.knobs is not None:
            self.writer.update_meta(knobs=self.knobs.record())
        _active = self
        self.fault_log.start()
        if self.fault_log.missing:  # now: a crash is when it matters, and nothing else is written
            self.writer.update_meta(missing=[*self.writer.meta["missing"],
                                             *self.fault_log.missing])
        if self.instrumentation is not None:
            self.instrumentation.install()
        for runner in self.windows:
            self.clock.add_window(runner)
        self.loop_stacks.start()
        if not self._sampler_pending:
            self._start_sampler()
        self._flusher = threading.Thread(target=self._flush_loop, name="trainprof-flush",
                                         daemon=True)
        self._flusher.start()
        self._started = True
        return self

    def _start_sampler(self) -> None:
        try:
            self.sampler.start()
        except Exception as exc:  # training goes on without system samples
            self.writer.meta["missing"].append(f"system sampler: {exc}")

    def _flush_loop(self) -> None:
        """Five times a second, re-arm the timing of ``num_workers=0`` loading; once a
        second, finished steps, stack samples and loading timings to disk, CUDA detection.

        Each wake-up takes the GIL from the training thread for a few microseconds.
        """
        while not self._flusher_stop.wait(1.0 / MAIN_REARM_HZ):
            try:
                with _FORK_GUARD:  # no fork while this thread may hold an import lock
                    if self._sampler_pending and self.clock.n_steps > 0:
                        self._sampler_pending = False
                        self._start_sampler()
                    self.worker_capture.rearm()
                    self._sample_debug_modes()
                    self.flush()
            except Exception as exc:  # the next second, or stop(), tries again
                note = f"recorder: flush failed ({type(exc).__name__}: {exc})"
                if note not in self.writer.meta["missing"]:
                    self.writer.meta["missing"].append(note)

    def stop(self, status: str, exit_code: int | None,
             crash: dict[str, Any] | None = None) -> Path:
        """Close the record. Safe to call once; later calls return the folder.

        ``crash``: the exception a crashed script raised (capture.launcher's
        ``describe_exception``), kept as ``crash`` in ``run.json`` with the step it was in
        (the steps complete before it, None before the first step): the traceback printed
        on the terminal is gone once the run is over."""
        if self._stopped:
            return self.run_dir
        self._stopped = True
        global _active
        if _active is self:
            _active = None
        n_done = self.clock.n_steps
        if crash is not None:
            self.writer.meta["crash"] = {**crash,
                                         "step": n_done if self.clock.started else None}
        self.loop_stacks.stop()
        self.clock.finish()
        for runner in self.windows:
            runner.finish(n_done)  # tools write their results (traces, profiles) here
        if self.instrumentation is not None:
            self.instrumentation.uninstall()
        self._optimizer_times.close()
        if fetch_timing.MAIN_CLOCK[0] is self.clock:
            fetch_timing.MAIN_CLOCK[0] = None
        self.loaders.shutdown_workers()
        self.loaders.note_threads(self.clock.owner)
        self._kill_leftover_workers()
        self._flusher_stop.set()
        if self._flusher is not None:
            self._flusher.join(5.0)
        with contextlib.suppress(Exception):
            self.sampler.stop()
        self.flush()
        self.loop_stacks.close()
        self.fault_log.stop()
        missing = list(dict.fromkeys(self.writer.meta["missing"] + list(self.sampler.missing)
                                     + self.worker_capture.missing + self.loop_stacks.missing
                                     + self.fault_log.missing))
        self.writer.meta["training_thread"] = self._training_thread_settings()
        self.writer.meta["debug_modes"] = self.debug_modes.record()
        cuda_memory = self._cuda_memory()  # once, at the end; None unless CUDA was used
        peak = self._peak_flops(status)  # the workers gone, the knobs' threads still set
        if peak:
            self.writer.meta["peak_flops"] = peak
        attention_fix = self._attention_fix_measured(status)
        if attention_fix:
            self.writer.meta["attention_fix_measured"] = attention_fix
        if cuda_memory is not None:
            self.writer.meta["cuda_memory"] = cuda_memory
        if getattr(self, "knobs", None) is not None:
            self.writer.meta["knobs"] = self.knobs.uninstall()
        if self.child_runs.own_label is not None:
            # the script ran itself again as further ranks: this record is a rank's too
            self.writer.meta["rank_label"] = self.child_runs.own_label
        self.writer.close(
            status,
            exit_code,
            steps_recorded=self.clock.n_steps,
            step_delimiter=self.clock.mode,
            dataloaders=self.loaders.configs,
            missing=missing,
            notes=self._notes(),
            # the module classes whose top-level calls were timed as forward
            forward_roots=self.instrumentation.forward_roots if self.instrumentation else [],
            # frames torch.compile compiled in this process (a compiled model or function)
            compiled_frames=compiled_frames(),
            # DDP's no_sync() contexts entered (None: not instrumented)
            ddp_no_sync_calls=(self.instrumentation.ddp_no_sync_calls
                               if self.instrumentation else None),
            windows=[
                {
                    "tools": [t.name for t in runner.tools],
                    "schedule": asdict(runner.schedule),
                    "recorded": [list(w) for w in runner.windows],
                }
                for runner in self.windows
            ],
        )
        return self.run_dir

    def flush(self) -> None:
        """Drain finished steps to disk: at most once a second from the flush thread, and at stop.

        Once a second: each wake-up takes the GIL from the training thread, and a
        ``kill -9`` may lose up to a second of records anyway (the sampler process
        hands its lines to the OS at the same pace).

        The environment fingerprint is taken here too, once the first step is
        done: by then the script has set ``CUDA_VISIBLE_DEVICES`` and friends,
        which probing CUDA earlier would freeze; and it happens off the
        training thread.
        """
        now = time.perf_counter()
        if not self._stopped and now - self._last_drain < DRAIN_INTERVAL_S:
            return
        self._last_drain = now
        data = self.clock.drain_records()  # whole records, native int64s
        self.loop_stacks.adapt(_other_share(data))
        if data:
            if sys.byteorder == "big":  # the file is little-endian (STEP_DTYPE)
                chunk = array("q", data)
                chunk.byteswap()
                data = chunk.tobytes()
            self.writer.append_step_bytes(data)
        device = self.clock.device
        if device is not None:
            dev_records = device.records
            n = len(dev_records)
            if n:
                self.writer.append_device([dev_records.popleft() for _ in range(n)])
        elif self._cuda_in_use():
            # CUDA came up in the script: time phases on the device from now on
            self.clock.device = DeviceTimer.for_cuda()
        self.worker_capture.flush()  # num_workers=0 loading timed in this process
        self._record_optimizers()
        self._record_eval_autograd()
        self._record_captures()
        self.loop_stacks.flush()
        self._note_distributed()
        self._record_ddp()
        if not self._fingerprinted and (self.clock.n_steps > 0 or self._stopped):
            self._fingerprinted = True
            self.writer.update_meta(fingerprint=collect_fingerprint(self._script, self._command))

    def _record_eval_autograd(self) -> None:
        """Eval-mode model calls (trainprof.capture.eval_autograd), written when they change."""
        rec = eval_autograd.record(self.clock)
        if rec is not None and rec != self._eval_autograd:
            self._eval_autograd = rec
            self.writer.update_meta(eval_autograd=rec)

    def _record_captures(self) -> None:
        """What the hooks count beside the steps, each written to run.json when it changed:
        the workers' batches received (capture/handoff.py), the first batches' padding
        (capture/padding.py), activation checkpointing (capture/checkpointing.py), the
        script's gc.collect() calls (capture/explicit_gc.py) and torch.compile's
        compilations (capture/compile_events.py). Each record is a few small dicts, built
        once a second."""
        inst = self.instrumentation
        if inst is None:
            return
        for key, record in (("batch_handoff", inst.handoff.record),
                            ("padding", inst.padding.record),
                            ("activation_checkpointing", inst.checkpointing.record),
                            ("explicit_gc", inst.explicit_gc.record),
                            ("compiles", lambda: inst.compiles.record(self.clock.origin_ns))):
            rec = record()
            if rec is not None and rec != self.writer.meta.get(key):
                self.writer.update_meta(**{key: rec})

    def _sample_debug_modes(self) -> None:
        """Sample the debugging switches (trainprof.capture.debug_modes) while steps are
        made and none of trainprof's own tools is on; written when one is first seen on."""
        n = self.clock.n_steps
        if n <= self._debug_step or self.clock.extra_flags & FLAG_PROFILED:
            return
        self._debug_step = n
        if self.debug_modes.sample(n):
            self.writer.update_meta(debug_modes=self.debug_modes.record())

    def _on_new_optimizer(self, optimizer: Any) -> None:
        """Describe an optimizer at its first step (class, parameters, the implementation
        its step runs: trainprof.capture.optimizer_impl); written at the next flush.

        At most :data:`MAX_OPTIMIZERS` are described (a script that builds one per epoch,
        or per step, would otherwise grow the record without bound); the rest are counted.
        """
        if len(self._optimizers) >= MAX_OPTIMIZERS:
            self._optimizers_more += 1
            return
        try:
            entry = describe_optimizer(optimizer)
        except Exception as exc:  # an optimizer of an unexpected shape: named, not described
            entry = {"class": class_name(optimizer), "error": f"{type(exc).__name__}: {exc}"}
        entry["id"] = id(optimizer)
        self._optimizers.append(entry)
        # its [ns, steps] (capture/optimizer_time.py), timed once there are two: read at
        # each flush, and after the optimizer is gone (a script may drop it first)
        self._optimizer_spent.append([0, 0])
        if len(self._optimizers) == 2:
            first = self._optimizer_refs[0]() if self._optimizer_refs[0] is not None else None
            if first is not None:
                self._optimizer_times.watch(first, self._optimizer_spent[0])
        if len(self._optimizers) >= 2:
            self._optimizer_times.watch(optimizer, self._optimizer_spent[-1])
        # (the clock described only optimizers it holds a weak reference to)
        # the clock's own reference: the primary one is found by it, alive or not
        self._optimizer_refs.append(self.clock.optimizer_ref(optimizer))

    def _live_optimizers(self) -> list[Any]:
        """The described optimizers still alive (capture/opcount.py compares the tables'
        weights with their parameters)."""
        return [o for o in (r() for r in list(self._optimizer_refs)) if o is not None]

    def _record_optimizers(self) -> None:
        """run.json's ``optimizers``, with the one whose steps delimit steps marked
        ``primary`` (known only after its first steps)."""
        # by the clock's weak reference, not id: an optimizer built per epoch reuses an
        # earlier one's address, and the entries of several dead ones were marked primary by
        # the live one's id; and not by the object, which may be gone by the last look (the
        # script's objects collected before the record closes: a short run's only look)
        primary = self.clock.primary_optimizer_ref()
        if len(self._optimizers) >= 2:
            for entry, spent in zip(list(self._optimizers), list(self._optimizer_spent),
                                    strict=False):
                # its step() calls in the training thread since a second optimizer stepped
                entry["step_s"], entry["steps"] = spent[0] / 1e9, spent[1]
        entries = [{**e, "primary": primary is not None and ref is primary}
                   for e, ref in zip(list(self._optimizers), list(self._optimizer_refs),
                                     strict=False)]
        meta = self.writer.meta
        if (entries != meta.get("optimizers", [])
                or self._optimizers_more != meta.get("optimizers_not_described", 0)):
            self.writer.update_meta(optimizers=entries,
                                    optimizers_not_described=self._optimizers_more)

    def _record_ddp(self) -> None:
        """DDP's own timing of its all-reduce (trainprof.capture.ddp_stats), read once a
        second from the models the script built; written when it changes."""
        if self.instrumentation is None:
            return
        stats = self.instrumentation.ddp_stats
        stats.poll()
        record = stats.record()  # (the training thread may have polled too: compare records)
        if record != self.writer.meta.get("ddp", []):
            self.writer.update_meta(ddp=record)

    def _note_distributed(self) -> None:
        """This process's torch.distributed rank, once its process group is up.

        Looked at from the flush thread (once a second) and at the end: a script may
        destroy its process group before it returns.
        """
        if self._distributed_seen:
            return
        dist = sys.modules.get("torch.distributed")
        try:
            if dist is None or not dist.is_available() or not dist.is_initialized():
                return
            info = {"rank": dist.get_rank(), "world_size": dist.get_world_size(),
                    "backend": str(dist.get_backend())}
        except Exception:  # noqa: BLE001 - a group torn down meanwhile: try again later
            return
        self._distributed_seen = True
        self.writer.update_meta(distributed=info)

    def _notes(self) -> list[str]:
        """What a reader of the summary should know about how the run was measured."""
        notes = import_time_env.notes()  # variables set too late for numpy (as run)
        past = self.clock.n_steps - self.clock.auto_prefix - (self._max_steps or 0)
        if self._max_steps is not None and past > 1:
            # StopTraining is raised once (cleanup may step again): a script that catches
            # every exception (`except:`, `except BaseException:`) goes on training
            notes.append(f"the script trained {past} steps past --max-steps "
                         f"{self._max_steps}: it caught trainprof's stop (a bare `except:` or "
                         "`except BaseException:` around the step)")
        for runner in self.windows:
            names = [t.name for t in runner.tools]
            if "torch_profiler" in names and not runner.windows:
                # (cProfile and line_profiler say so in their own notes)
                sched = runner.schedule
                _, active, _ = sched.phase_starts(0)
                notes.append(
                    f"torch.profiler recorded nothing: the run ended after "
                    f"{self.clock.n_steps} steps, before the --deep window (steps {active}-"
                    f"{active + sched.active - 1}); lower it, e.g. --deep skip_first="
                    f"{max(0, min(sched.skip_first, self.clock.n_steps - sched.warmup - 2))}")
        if self.clock.adopted_thread is not None:
            notes.append(f"steps measured in thread {self.clock.adopted_thread!r}, where the "
                         "first optimizer step ran (not the thread that started trainprof); "
                         "that first step, which moved the measurement there, is not counted "
                         "(the script's loop ran one step more than the Steps line says)")
        inst = self.instrumentation
        started = [] if inst is None else [name for _, name in inst.started_processes]
        recorded = self.child_runs.recorded
        if recorded:
            labels = ", ".join(label for label, _ in recorded[:8])
            labels += ", ..." if len(recorded) > 8 else ""
            notes.append(f"the script started {len(recorded)} process"
                         f"{'es' if len(recorded) > 1 else ''} that may train: each is "
                         f"recorded in {RANKS_DIR}/<k>/ of this run (k = {labels})")
        recorded_names = [name for _, name in recorded]
        others = list(started)
        for name in recorded_names:
            if name in others:
                others.remove(name)
        if others:
            names = sorted(set(others))
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            notes.append(f"{len(others)} other process{'es' if len(others) > 1 else ''} "
                         f"({shown}) not measured: pool and manager helpers, Process subclasses "
                         f"with a run() of their own, or beyond the first {MAX_RECORDED}")
        recorded_reruns = self.child_runs.reruns
        if recorded_reruns:
            n = len(recorded_reruns)
            ranks = [r for _, r in recorded_reruns if r is not None]
            which = f" (LOCAL_RANK {', '.join(ranks)})" if ranks else ""
            labels = ", ".join(label for label, _ in recorded_reruns)
            notes.append(
                f"the script ran itself again in {n} process{'es' if n > 1 else ''}{which}, "
                "as PyTorch Lightning's DDP launcher does: each recorded in "
                f"{RANKS_DIR}/<k>/ of this run (k = {labels}); this process is rank "
                f"{self.child_runs.own_label}, the figures above are its own")
        reruns = [] if inst is None else inst.script_reruns
        if reruns:
            ranks = [r for r in reruns if r is not None]
            which = f" (LOCAL_RANK {', '.join(ranks)})" if ranks else ""
            n = len(reruns)
            notes.append(
                f"the script ran itself again in {n} process{'es' if n > 1 else ''}{which}, "
                "as PyTorch Lightning's DDP launcher does: not recorded, this record is one "
                "process's. To record every rank, launch it with torchrun, which Lightning "
                f"uses as it is: torchrun --nproc_per_node {n + 1} -m trainprof run "
                f"{self._script_cmd()}")
        return notes

    def _script_cmd(self) -> str:
        """The script (or ``-m module``) and its arguments, for a command to copy."""
        import shlex

        cmd = [str(a) for a in (self._command or [])[1:]]
        return shlex.join(cmd) if cmd else "SCRIPT ..."

    @staticmethod
    def _training_thread_settings() -> dict[str, int]:
        """torch's thread counts as the training thread sees them.

        With OpenMP the intra-op count is per thread, so the fingerprint
        (taken on the flush thread) can disagree with what the script set
        via ``torch.set_num_threads``; this is read on the training thread.
        """
        import torch

        return {
            "torch_num_threads": torch.get_num_threads(),
            "torch_num_interop_threads": torch.get_num_interop_threads(),
        }

    def _peak_flops(self, status: str) -> dict[str, Any] | None:
        """The matrix-multiply peak of each kind of compute the op count's window saw
        (capture/peak_flops.py): from the cache, or measured now at the end of a finished
        run (a run stopped by Ctrl-C or a crash is not kept waiting); a CPU's only in a run
        of one process (ranks of a launch would measure each other's load), a GPU's in each
        rank (its own device)."""
        kinds: dict[str, float] = {}
        for runner in self.windows:
            for tool in runner.tools:
                if isinstance(tool, OpCountTool) and tool.steps:
                    kinds = tool.flop_count.per_step(tool.steps)
        total = sum(kinds.values())
        wanted = [k for k, v in kinds.items() if total > 0 and v >= 0.01 * total
                  and k.split()[0] in ("cpu", "cuda")]
        torch = sys.modules.get("torch")
        if not wanted or torch is None:
            return None
        try:
            return peaks(torch, wanted, may_measure=self._may_measure(status))
        except Exception as exc:  # noqa: BLE001 - a peak is extra: the record comes first
            return {"error": {"error": f"{type(exc).__name__}: {exc}"}}

    def _may_measure(self, status: str) -> set[str]:
        """The devices a measurement at the end of the run may time: none after Ctrl-C or
        a crash (its user is not kept waiting); the CPU only in a run of one process (ranks
        of a launch would measure each other's load); a GPU in each rank (its own device)."""
        if status != "finished":
            return set()
        one_process = (launcher_rank() is None and self.child_runs.own_label is None
                       and not self._started_by_script and not self._distributed_seen)
        return {"cpu", "cuda"} if one_process else {"cuda"}

    def _attention_fix_measured(self, status: str) -> list[dict[str, Any]] | None:
        """Eager attention found in the op count's window (capture/eager_attention.py): its
        fix, ``F.scaled_dot_product_attention``, timed forward and backward at each of the
        (at most three) costliest shapes, where :meth:`_may_measure` allows."""
        shapes: list[dict[str, Any]] = []
        for runner in self.windows:
            for tool in runner.tools:
                if isinstance(tool, OpCountTool) and tool.steps and tool.flop_count.attention:
                    shapes = tool.flop_count.attention.per_step(tool.steps)[:3]
        devices = self._may_measure(status)
        torch = sys.modules.get("torch")
        out = []
        for shape in shapes:
            if shape["device"] not in devices or torch is None:
                continue
            entry = {k: shape[k] for k in ("batch", "query_len", "key_len", "head_dim",
                                           "dtype", "device")}
            try:
                entry.update(measure_sdpa(torch, shape))
            except Exception as exc:  # noqa: BLE001 - a measurement is extra
                entry["error"] = f"{type(exc).__name__}: {exc}"
            out.append(entry)
        return out or None

    @staticmethod
    def _cuda_in_use() -> bool:
        """True once the script initialised CUDA.

        Only ``is_initialized`` (a flag) is read: ``is_available`` would touch
        the driver, and doing that before the script sets
        ``CUDA_VISIBLE_DEVICES`` would change what the script sees.
        """
        import torch

        return bool(torch.cuda.is_initialized())

    @staticmethod
    def _cuda_memory() -> dict[str, Any] | None:
        """The CUDA caching allocator's counters per device used, for diagnosis/device.py.

        Read once when the run stops, and only if the script initialised CUDA (never
        initialise it here). ``torch.cuda.memory_stats`` reads host-side counters: no sync.
        """
        try:
            import torch

            if not torch.cuda.is_initialized():
                return None
            devices = []
            for i in range(torch.cuda.device_count()):
                stats = torch.cuda.memory_stats(i)
                if stats.get("allocation.all.allocated"):  # devices this run allocated on
                    total = torch.cuda.get_device_properties(i).total_memory
                    devices.append({"index": i, "total_bytes": total,
                                    **{k: stats.get(k) for k in CUDA_MEMORY_KEYS}})
            return {"devices": devices} if devices else None
        except Exception:  # a report without these counters, never a failed stop
            return None

    def _on_new_loader(self, index: int, config: dict[str, Any]) -> None:
        self.writer.event("dataloader", **config)

    def _kill_leftover_workers(self) -> None:
        """No DataLoader worker may outlive the run, however the script ended."""
        import psutil

        deadline = time.monotonic() + 2.0
        for pid in self.loaders.all_worker_pids:
            try:
                proc = psutil.Process(pid)
                if proc.ppid() != os.getpid():
                    continue
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except psutil.TimeoutExpired:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            except (psutil.Error, OSError):
                continue

    # -- API used by trainprof.profile ---------------------------------------
    def step(self) -> None:
        self.clock.manual_step()

    @contextlib.contextmanager
    def region(self, name: str) -> Iterator[None]:
        """Time a named stretch (evaluation, checkpointing) apart from the step phases.

        The name is kept on one line (its whitespace runs made one space: a name with a
        newline split the summary's table) and never empty (``region("")`` printed a bare
        row and "the region ''")."""
        name = " ".join(str(name).split()) or "(unnamed region)"
        clock = self.clock
        t0 = time.perf_counter_ns()
        step = clock.n_steps
        prev = clock.enter(REGION)
        try:
            yield
        finally:
            clock.exit(prev)
            self.writer.event(
                "region",
                name=name,
                step=step,
                t_start_ns=t0 - clock.origin_ns,
                dur_ns=time.perf_counter_ns() - t0,
            )
