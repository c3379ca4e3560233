"""Training processes of one run, one record each: ``RUN_DIR/ranks/<k>/``.

Data-parallel training runs one training process per device, a *rank*. They are
started either by the script itself (``torch.multiprocessing.spawn``, a
``multiprocessing.Process`` per rank) or by a launcher that runs the whole command
once per rank (``torchrun``, ``python -m torch.distributed.run``). Either way each
rank gets a complete run folder of its own under ``ranks/`` of the run - the same
record as any run (steps and phases, system samples of that process and its
DataLoader workers), so one rank reads like any run
(``trainprof report RUN_DIR/ranks/1``) - and ``trainprof report RUN_DIR`` merges
them (:mod:`trainprof.analysis.ranks`): DESIGN.md's "one record per rank, merged".

Processes the script starts
---------------------------
The instrumentation sees every ``multiprocessing`` process start
(:mod:`trainprof.capture.hooks`). For one that may train, :class:`ChildRuns`
swaps the process's target for a :class:`RecordedTarget` before it starts: a
plain, picklable object (``spawn`` pickles the process; a ``fork`` child gets it
as it is) that, in the child, starts a :class:`~trainprof.capture.recorder.Recorder`
on ``RUN_DIR/ranks/<k>``, calls the real target and closes the record however it
ends. For ``torch.multiprocessing.spawn`` the function given to ``spawn`` is
wrapped, not torch's ``_wrap`` around it, so that its exception is seen (``_wrap``
turns it into ``sys.exit(1)``) and ``k`` is spawn's process index: the rank, in
the usual ``spawn(train, nprocs=world_size)``. Other processes get the next free
number in start order. Never recorded: DataLoader workers (measured by
:mod:`trainprof.capture.worker`), ``multiprocessing`` pool and manager processes
and ``concurrent.futures`` process-pool workers (helpers, not training), and a
``Process`` subclass that overrides ``run()`` instead of passing a target (its
``run`` cannot be swapped without pickling the process into itself), nor any beyond
the first :data:`MAX_RECORDED` - those are named in the run's notes.

A script that runs itself again
-------------------------------
PyTorch Lightning's DDP launcher trains in the process the user started, as rank 0,
and starts ranks 1.. as ``[python, script, *argv]`` (or ``[python, -m, module,
*argv]``) subprocesses with ``LOCAL_RANK`` set. The instrumentation sees every
``subprocess.Popen``; for one that runs this same script with this Python,
:meth:`ChildRuns.rerun` gives the command that runs it under ``trainprof run`` into
``ranks/<LOCAL_RANK>`` of this run (same script, arguments, environment and working
directory; this run's options). That process prints one line; this one records its
own label (``rank_label``, its ``LOCAL_RANK``), and its record, rank 0, leads the
merged view (:func:`trainprof.analysis.ranks.merge_ranks`).

A launcher's ranks
------------------
Under ``torchrun`` every rank runs ``trainprof run`` with ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` set (the torch.distributed
environment-variable contract). Each records into ``<out>/ranks/<RANK>``, where
``<out>`` is ``--out`` (the same for every rank) or a default folder named after
the launcher process's start time, which all ranks of one launch on one host share
(on several hosts, each host's agent starts at its own time: name a shared folder
with ``--out`` to merge them all). Local rank 0 waits for its host's ranks to close
their records and prints the merged summary; the others print one line.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from trainprof.store import RANKS_DIR, RUN_JSON, safe_name

#: Processes recorded per run at most: a node runs one rank per device; a script that
#: starts hundreds of processes is not starting ranks, and a folder each would bury them.
MAX_RECORDED = 64

#: (module, qualified name) of process targets that are helpers, never training.
_HELPER_TARGETS = frozenset({
    ("multiprocessing.pool", "worker"),
    ("multiprocessing.managers", "BaseManager._run_server"),
    ("concurrent.futures.process", "_process_worker"),
    ("torch.utils.data._utils.worker", "_worker_loop"),
})


def _qualified(target: Any) -> tuple[str, str]:
    func = getattr(target, "__func__", target)  # a bound (class) method: its function
    return (str(getattr(func, "__module__", "")), str(getattr(func, "__qualname__", "")))


def is_helper_target(target: Any) -> bool:
    """True for the targets of pool, manager and DataLoader worker processes."""
    return _qualified(target) in _HELPER_TARGETS


def _is_spawn_wrap(target: Any) -> bool:
    return _qualified(target) == ("torch.multiprocessing.spawn", "_wrap")


@dataclass
class ChildSpec:
    """What a recorded child needs to know to record itself (picklable)."""

    run_dir: str
    name: str
    command: list[str]
    label: str
    sample_interval_s: float
    max_steps: int | None
    #: the heavy tools' specs of ``trainprof run`` (--deep, --py, --lines): each rank runs them
    tools: dict[str, str | None] = field(default_factory=dict)


class RecordedTarget(functools.partial):  # type: ignore[type-arg]
    """A process target that records the process while the real target runs.

    ``RecordedTarget(run_recorded, target, spec)``: a ``functools.partial``, so that calling
    it runs no Python frame of its own and a crash's traceback, as multiprocessing or spawn
    print it, shows the user's frames only (:func:`run_recorded` strips its own). Picklable
    when the target is (``spawn`` pickles it by reference, as it would have the target).
    """

    @property
    def target(self) -> Callable[..., Any]:
        return self.args[0]  # type: ignore[no-any-return]

    @property
    def spec(self) -> ChildSpec:
        return self.args[1]  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return f"<trainprof recorded {self.target!r} -> {self.spec.run_dir}>"


def run_recorded(target: Callable[..., Any], spec: ChildSpec, /, *args: Any, **kwargs: Any) -> Any:
    """In the child: record this process into ``spec.run_dir`` while ``target`` runs.

    The record's status follows the launcher's table (:mod:`trainprof.capture.launcher`):
    returned or ``sys.exit(n)`` - finished; raised - crashed (exit 1); Ctrl-C or SIGTERM -
    interrupted (after SIGTERM the process ends with ``os._exit(143)`` once its record is
    closed, as the signal would have ended it). The exception itself goes on as it would
    have, so ``spawn`` and ``multiprocessing`` report it in the parent as usual.
    ``--max-steps`` ends the target as if it had returned (every rank stops after the same
    number of steps, so none is left waiting in a collective).
    """
    from trainprof.capture import recorder as recorder_module
    from trainprof.capture.clock import StopTraining, Terminated
    from trainprof.capture.launcher import (
        describe_exception,
        exit_code_of,
        sigterm_as_exception,
        strip_own_frames,
    )
    from trainprof.capture.tools import build_windows

    # A forked child holds a copy of the parent's recorder; its patches were
    # already undone at fork (hooks._uninstall_in_child). This process records anew.
    forked = recorder_module.forget_inherited_recorder()
    try:
        run_dir = Path(spec.run_dir)
        rec = recorder_module.Recorder(
            run_dir,
            name=spec.name,
            command=spec.command,
            max_steps=spec.max_steps,
            sample_interval_s=spec.sample_interval_s,
            knobs=not forked,
            sampler_at_first_step=True,  # a helper that never trains: no sampler process
            windows=build_windows(run_dir, **spec.tools),
        )
        rec.worker_sampling = spec.tools.get("py") is not None
        rec.writer.update_meta(rank_label=spec.label, parent_pid=os.getppid())
        rec.start()
    except Exception as exc:  # noqa: BLE001 - the process must run, recorded or not
        print(f"trainprof: process {spec.label} not recorded: {exc}", file=sys.stderr, flush=True)
        return target(*args, **kwargs)
    status, code = "finished", 0
    crash = None
    try:
        with sigterm_as_exception():
            return target(*args, **kwargs)
    except StopTraining as exc:
        print(f"trainprof: stopped process {spec.label}: {exc}", file=sys.stderr, flush=True)
        return None
    except SystemExit as exc:
        code = exit_code_of(exc.code)[0]
        raise
    except KeyboardInterrupt:
        status, code = "interrupted", 130
        raise
    except Terminated:
        status, code = "interrupted", 143
        raise
    except BaseException as exc:
        status, code = "crashed", 1
        # the traceback multiprocessing (or spawn) prints: the user's frames, not ours
        strip_own_frames(exc)
        crash = describe_exception(exc)  # kept in the rank's record: what it raised, where
        raise
    finally:
        rec.stop(status, code, crash)
        if status == "interrupted" and code == 143:  # SIGTERM: end as it ends a python
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


class ChildRuns:
    """The parent's side: decides which started processes are recorded, and where.

    Called by the instrumentation for every ``multiprocessing`` process the script
    starts, before it starts (see the module docstring).
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        name: str,
        command: list[str],
        sample_interval_s: float,
        max_steps: int | None,
    ) -> None:
        self.root = run_dir / RANKS_DIR
        self._base = ChildSpec("", name, list(command), "", sample_interval_s, max_steps)
        #: ``trainprof run``'s heavy tools (deep, py, lines specs), run in every rank too
        self.tools: dict[str, str | None] = {}
        self._taken: set[str] = set()
        self._lock = threading.Lock()
        #: (label, process name) of the processes recorded, in start order
        self.recorded: list[tuple[str, str]] = []
        #: (label, LOCAL_RANK or None) of the script's runs of itself that are recorded
        self.reruns: list[tuple[str, str | None]] = []
        #: this process's label among those runs, once the script ran itself again
        self.own_label: str | None = None
        #: (label, the training script) of the ranks a launcher run under trainprof started
        #: (torchrun, ``accelerate launch``: see :meth:`launched_rank`)
        self.launched: list[tuple[str, str]] = []
        #: the recorded processes (``multiprocessing.Process``), to pass SIGTERM on to
        self._processes: list[weakref.ref[Any]] = []

    def _claim(self, wanted: str | None) -> str:
        with self._lock:
            label = wanted
            if label is None or label in self._taken or (self.root / label).exists():
                n = 0
                while str(n) in self._taken or (self.root / str(n)).exists():
                    n += 1
                label = str(n)
            self._taken.add(label)
            return label

    def _spec(self, label: str) -> ChildSpec:
        return replace(self._base, run_dir=str(self.root / label),
                       name=f"{self._base.name}-rank{label}", label=label, tools=dict(self.tools))

    def prepare(self, process: Any) -> None:
        """Swap ``process``'s target for a recorded one, unless it is a helper."""
        target = getattr(process, "_target", None)
        name = str(getattr(process, "name", "?"))
        if target is None:  # nothing to swap: a subclass with a run() of its own
            return
        if is_helper_target(target) or isinstance(target, RecordedTarget):
            return
        if len(self.recorded) >= MAX_RECORDED:
            return
        args = tuple(getattr(process, "_args", ()))
        if _is_spawn_wrap(target) and len(args) >= 2 and isinstance(args[1], int):
            label = self._claim(str(args[1]))
            process._args = (RecordedTarget(run_recorded, args[0], self._spec(label)), *args[1:])
        else:
            label = self._claim(None)
            process._target = RecordedTarget(run_recorded, target, self._spec(label))
        self.recorded.append((label, name))
        with contextlib.suppress(TypeError):
            self._processes.append(weakref.ref(process))

    def terminate_recorded(self) -> int:
        """Send SIGTERM to the recorded processes still running (``mp.spawn``'s ranks), so
        that they close their records as interrupted now rather than train on while this
        process, terminated, waits for them; returns how many were sent it."""
        sent = 0
        for ref in self._processes:
            process = ref()
            try:
                if process is not None and process.is_alive():
                    process.terminate()
                    sent += 1
            except (AssertionError, OSError, ValueError):  # not ours to poll, or gone
                continue
        return sent

    def rerun(self, args: Sequence[Any], local_rank: str | None) -> list[str] | None:
        """The command that records a process running this same script again, or None.

        ``args``: the ``[python, script, *argv]`` (or ``[python, -m, module, *argv]``) the
        script is starting - PyTorch Lightning's DDP launcher starts ranks 1.. so, with
        ``LOCAL_RANK`` set in their environment, and trains as rank 0 itself. The command
        is ``trainprof run`` of the same script and arguments into ``ranks/<LOCAL_RANK>``
        of this run, with this run's options; the process sees the same ``sys.argv``,
        environment and working directory. This process becomes the rank named by its own
        ``LOCAL_RANK`` (Lightning sets 0): its record is that rank's (see
        :func:`trainprof.analysis.ranks.merge_ranks`).
        """
        if len(self.recorded) + len(self.reruns) + len(self.launched) >= MAX_RECORDED:
            return None
        if self.own_label is None:
            self.own_label = self._claim(os.environ.get("LOCAL_RANK", "0"))
        label = self._claim(local_rank)
        spec = self._spec(label)
        command = self._trainprof_run(spec.run_dir, spec.name)
        command += [os.fsdecode(a) for a in args[1:]]  # the script (or -m module) and argv
        self.reruns.append((label, local_rank))
        return command

    def _trainprof_run(self, out: str | Path, name: str) -> list[str]:
        """``trainprof run`` of a further rank of this run, with this run's options; the
        script and its arguments follow."""
        base = self._base
        command = [sys.executable, "-m", "trainprof", "run", f"--rank-of={self.root.parent}",
                   f"--out={out}", f"--name={name}", f"--sample-interval={base.sample_interval_s}"]
        if base.max_steps is not None:
            command.append(f"--max-steps={base.max_steps}")
        return command + [f"--{tool}={value}" for tool, value in self.tools.items()
                          if value is not None]


    def launched_rank(self, args: Sequence[Any], env: Mapping[str, str]) -> list[str] | None:
        """The command that records a rank this process launches as torchrun does, or None.

        ``trainprof run -m torch.distributed.run --nproc-per-node 2 train.py`` (or
        ``trainprof run $(which torchrun) ...``, ``trainprof run -m accelerate.commands.launch
        ...``): the launcher runs in this process, and its elastic agent starts each rank as
        ``[python, -u, train.py, *argv]`` (``-m module`` for a module) with ``RANK`` and
        ``TORCHELASTIC_RUN_ID`` in its environment. The command is ``trainprof run`` of that
        script and its arguments, with this run's options, into this run's folder: as any
        rank of a launch, it records into ``ranks/<RANK>/`` (:func:`launcher_rank`) and prints
        a line; this process, which trains nothing, prints the ranks merged. Python's own
        options before the script are dropped but ``-u``, passed on as ``PYTHONUNBUFFERED``
        by the caller. None: not a Python rank of a launch, or too many recorded already.
        """
        if "TORCHELASTIC_RUN_ID" not in env or "RANK" not in env:
            return None
        if "RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
            # this process is a rank itself (its children inherit the launch's environment:
            # trainprof's own sampler process among them), not the launcher
            return None
        if len(self.recorded) + len(self.reruns) + len(self.launched) >= MAX_RECORDED:
            return None
        rest = [os.fsdecode(a) for a in args[1:]]
        while rest and rest[0].startswith("-") and rest[0] != "-m":
            rest.pop(0)  # -u (the caller keeps it as PYTHONUNBUFFERED), -X..., -W...
        if not rest or (rest[0] == "-m" and len(rest) < 2):
            return None
        with self._lock:
            self.launched.append((str(env["RANK"]), rest[1] if rest[0] == "-m" else rest[0]))
        # into this run's folder: as a rank of a launch it records into ranks/<RANK>/
        return self._trainprof_run(self.root.parent, self._base.name) + rest


# -- a launcher's ranks (torchrun, srun) -------------------------------------------


@dataclass(frozen=True)
class LauncherRank:
    """This process's place in a launch: by torchrun (the torch.distributed env contract)
    or by SLURM's ``srun`` (a task of a job step)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: str = "torchrun"
    #: When the launch started (Unix time) as every host sees it, where the launcher says
    #: so (SLURM_JOB_START_TIME); else each host uses its launcher process's start.
    started: float | None = None
    #: The launcher's name for the launch, where it has one: ``slurm<job>.<step>``.
    launch_id: str | None = None


def launcher_rank(environ: Mapping[str, str] | None = None) -> LauncherRank | None:
    """The rank this process was launched as, or None outside a multi-process launch.

    ``RANK`` and ``WORLD_SIZE`` are what torchrun (and SLURM wrappers following the
    same contract) set for every process; a world of one is an ordinary run. Without
    them, a task that ``srun`` started is rank ``SLURM_PROCID`` of
    ``SLURM_STEP_NUM_TASKS`` (srun's output environment; ``SLURM_LOCALID`` is its rank on
    the node). Those two are what tell a task of a job step from the batch script of an
    ``sbatch`` job, which has ``SLURM_PROCID=0`` and ``SLURM_NTASKS`` of the allocation
    but is one process: a script run there directly is an ordinary run.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env:
        return _torchrun_rank(env)
    if "SLURM_STEP_NUM_TASKS" in env:
        return _srun_rank(env)
    return None


def _rank_in_world(env: Mapping[str, str], rank_var: str, world_var: str) -> tuple[int, int]:
    """(rank, world size) from two variables; ValueError unless a rank of a world of 2+."""
    rank, world = int(env.get(rank_var, "")), int(env.get(world_var, ""))
    if world < 2 or not 0 <= rank < world:
        raise ValueError(f"{rank_var}={rank} of {world_var}={world}: not a rank of a launch")
    return rank, world


def _torchrun_rank(env: Mapping[str, str]) -> LauncherRank | None:
    try:
        rank, world = _rank_in_world(env, "RANK", "WORLD_SIZE")
    except ValueError:
        return None
    try:
        local = int(env.get("LOCAL_RANK", rank))
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    except ValueError:
        local, local_world = rank, world
    return LauncherRank(rank, world, local, local_world)


def _srun_rank(env: Mapping[str, str]) -> LauncherRank | None:
    try:
        rank, world = _rank_in_world(env, "SLURM_PROCID", "SLURM_STEP_NUM_TASKS")
    except ValueError:
        return None
    try:
        local = int(env.get("SLURM_LOCALID", rank))
    except ValueError:
        local = rank
    local_world = slurm_tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE", ""),
                                      env.get("SLURM_NODEID", "0")) or world
    try:
        started: float | None = float(env["SLURM_JOB_START_TIME"])
    except (KeyError, ValueError):
        started = None
    job, step = env.get("SLURM_JOB_ID", ""), env.get("SLURM_STEP_ID", "")
    launch_id = f"slurm{job}.{step}" if job and step else None
    return LauncherRank(rank, world, local, local_world, launcher="slurm", started=started,
                        launch_id=launch_id)


def slurm_tasks_on_node(tasks_per_node: str, node_id: str) -> int | None:
    """Tasks of this job step on node ``node_id``, from SLURM's compressed per-node list.

    ``SLURM_STEP_TASKS_PER_NODE`` reads like ``2(x3),1``: two tasks on each of the first
    three nodes of the step, one on the fourth (the node index is ``SLURM_NODEID``).
    None when either is missing or malformed.
    """
    counts: list[int] = []
    try:
        for part in tasks_per_node.split(","):
            n, _, times = part.strip().partition("(x")
            counts += [int(n)] * (int(times.rstrip(")")) if times else 1)
        return counts[int(node_id)]
    except (ValueError, IndexError):
        return None


def _launcher_started(launch: LauncherRank | None = None) -> datetime:
    """When the launch started: the same for all its ranks.

    The launcher's own record of it where there is one (SLURM's job start, the same on
    every node); else the start of this process's parent - torchrun's agent, or srun's
    ``slurmstepd`` - the same for every rank of this host.
    """
    if launch is not None and launch.started is not None:
        return datetime.fromtimestamp(launch.started)
    try:
        import psutil

        return datetime.fromtimestamp(psutil.Process(os.getppid()).create_time())
    except Exception:  # noqa: BLE001 - no parent to ask: this process's own start
        return datetime.now()


def default_launch_dir(
    name: str, rank: int, root: Path | None = None, launch: LauncherRank | None = None
) -> Path:
    """``./trainprof-runs/<launch start>-<name>/``: one folder for all ranks of a launch.

    Named after when the launch started (:func:`_launcher_started`), so that every rank
    picks the same folder without talking to the others; a folder where this rank's
    record already exists belongs to an earlier launch (a restart, a requeued job), and
    the next free suffix is taken (the same one for every rank of this launch). A job
    step of SLURM adds its ``-slurm<job>.<step>``: the job's start is the same for all
    its steps, and steps of one script may run side by side (a sweep of ``srun &``).
    """
    root = root if root is not None else Path.cwd() / "trainprof-runs"
    stem = f"{_launcher_started(launch).strftime('%Y%m%d-%H%M%S')}-{safe_name(name)}"
    if launch is not None and launch.launch_id:
        stem += f"-{safe_name(launch.launch_id)}"
    path, n = root / stem, 1
    while (path / RANKS_DIR / str(rank) / RUN_JSON).exists():
        n += 1
        path = root / f"{stem}-{n}"
    return path


def wait_for_ranks(
    base: Path, expected: int, timeout_s: float = 60.0, start_grace_s: float = 10.0
) -> list[str]:
    """Wait until ``expected`` ranks have records under ``base/ranks`` and none is open.

    Called by a launch's local rank 0 before it prints the merged summary: the ranks of
    a synchronous job end within moments of each other, but each closes its own record.
    Returns the labels still open (or missing) when ``timeout_s`` ran out: the summary
    then says so, and ``trainprof report`` merges them later. Ranks with no record at
    all are waited for only ``start_grace_s`` once every record there is closed: ranks
    of one launch start together, so one that has not begun by the time this rank has
    finished never will (it failed before trainprof started, or the environment only
    looked like a launch: a shell inside an ``srun`` step inherits its task count).
    """
    import time

    from trainprof.store import record_is_open

    start = time.monotonic()
    told = False
    while True:
        root = base / RANKS_DIR
        labels = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
        still_open = [label for label in labels if record_is_open(root / label)]
        if len(labels) >= expected and not still_open:
            return []
        waited = time.monotonic() - start
        if waited >= timeout_s or (not still_open and waited >= start_grace_s):
            if len(labels) < expected:
                still_open.append(f"{expected - len(labels)} not started")
            return still_open
        if not told and waited >= 1.0:
            print(f"trainprof: waiting for the other ranks to close their records "
                  f"({len(labels) - len(still_open)} of {expected} done)", file=sys.stderr,
                  flush=True)
            told = True
        time.sleep(0.2)
