"""Background sampler of process, DataLoader-worker, system and GPU counters.

A step timeline tells *that* a step was slow; these samples tell *why*: was the main process
pegged at one core (Python-bound input pipeline), were the DataLoader workers saturated, was the
disk busy, was the GPU idle?  The sampler runs in a daemon thread and appends one JSON object per
tick to a JSON-lines file; ``trainprof run`` runs it in a process of its own
(:mod:`trainprof.capture.sampler_process`), so that it never takes the training process's GIL.

Design constraints, and how they are met:

* **Never crash or slow training.**  Every section of a tick is guarded; a failure degrades that
  field to ``null`` and leaves one human-readable note in :attr:`SystemSampler.missing`.
* **Few GIL hand-offs.**  The sampler is a Python thread, so every syscall that releases the GIL
  lets a Python-bound training thread take it back, and re-acquiring it can then cost the sampler
  up to ``sys.getswitchinterval()`` (5 ms).  psutil opens, stats, reads and closes a file per
  call: ~70 syscalls per tick, which stretched a 50 ms tick to ~180 ms against a busy main thread.
  On Linux we therefore keep ``/proc`` files open and re-read each with a single ``pread``
  (about six syscalls per tick); psutil remains the portable fallback.  Even those hand-offs
  cost the training thread: with the C extension (``_fastclock.pread_held``) the ``/proc``
  reads keep the GIL (the kernel generates these files in microseconds, no disk involved),
  so a tick hands the GIL back and forth only where it writes its records.
* **Crash safety.**  Lines are handed to the OS at least once a second (``flush_interval_s``),
  so a ``kill -9`` loses at most the last second of samples (the loader ignores a truncated
  last line); the file write is one more GIL hand-off, so not one per tick.
* **Memory, and what kind.**  Besides RSS, the training process's anonymous resident memory
  (``rss_anon_bytes``, from ``/proc/<pid>/statm``: a leak grows it, a memory-mapped dataset
  does not) and, about once a second and at a worker's first sight, each DataLoader worker's
  private and shared dirty memory (``workers_dirty_bytes``, from ``smaps_rollup``: pages a
  worker copied from the training process, trainprof.analysis.memory_growth).
* **Same clock as the step timeline.**  ``t`` is :func:`time.perf_counter`, which the step clock of
  the same process also uses, so samples and steps align without conversion.
* **No shared global state.**  CPU percentages come from our own deltas of cumulative counters,
  not ``psutil.cpu_percent()``: ``cpu_percent(interval=x)`` blocks for ``x`` seconds, and
  ``cpu_percent(interval=None)`` keeps its "previous call" state in globals that any other caller
  in the process silently resets, corrupting our windows.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

import orjson
import psutil

from trainprof.capture.nvml import NvmlReader
from trainprof.capture.proc_stats import (
    PROCFS,
    Gone,
    MainProcess,
    ProcFile,
    ProcTable,
    Rate,
    pct,
    round1,
)

__all__ = ["SystemSampler"]

_SECTOR_BYTES = 512  # /proc/diskstats always counts 512-byte sectors, whatever the device

# Discovering descendants means walking /proc (psutil's ``children(recursive=True)`` reads the
# stat file of *every* process on the machine: ~1 ms with 70 processes, tens of ms on a busy node).
# Non-worker children (compile workers, decoders, ...) are long-lived, so one rescan a second is
# plenty; their CPU is still sampled every tick through cached probes.
_CHILD_SCAN_PERIOD_S = 1.0

#: The sampling period unless one is given: resolves per-step behaviour of typical steps while
#: costing < 0.5 % of one core.
DEFAULT_INTERVAL_S = 0.2
#: The shortest period that gives true CPU figures. /proc counts CPU time in clock ticks
#: (1/CLK_TCK: 10 ms), so a tick's percentage moves in steps of 10 ms / period: 20% of a core
#: at 0.05 s, a whole core or more below 0.01 s, where most ticks read 0 and the sampler's own
#: work (subtracted from the process's) is as large as what it measures: at 0.0001 s the
#: training process read 4% of a core where 0.2 s read 55%.
MIN_INTERVAL_S = 0.05

# Upper bound on how long stop() waits for the thread; only reached if a tick hangs (e.g. a wedged
# NVML driver call).  We would rather return and leak a daemon thread than hang the training exit.
_JOIN_TIMEOUT_S = 5.0

_MAIN_KEYS = ("proc_cpu_pct", "rss_bytes", "rss_anon_bytes", "ctx_switches_ps")
_WORKER_KEYS = ("workers", "workers_rss_bytes", "children_cpu_pct")
_SYS_KEYS = ("sys_cpu_pct", "iowait_pct")
_DISK_KEYS = ("disk_read_bps",)


# -- system CPU and disk ---------------------------------------------------------------------------

# Per core: (total, idle, iowait or None); psutil's definition of busy is total - idle - iowait.
_CoreTimes = tuple[float, float, float | None]


def _read_cores_procfs(f: ProcFile) -> list[_CoreTimes]:
    """Per-core times from ``/proc/stat``.

    The file ends with a per-IRQ line that can be tens of kB on big hosts; only the ``cpuN`` lines
    at the top are needed.  ``guest``/``guest_nice`` are already included in ``user``/``nice``, so
    only the first eight columns are summed.
    """
    cores: list[_CoreTimes] = []
    for line in f.read(enough=b"\nintr").split(b"\n"):
        if not line.startswith(b"cpu"):
            if cores:
                break
            continue
        if line[3:4] == b" ":  # the aggregate "cpu " line
            continue
        cols = [int(x) for x in line.split()[1:9]]
        cores.append((float(sum(cols)), float(cols[3]), float(cols[4])))
    return cores


def _read_cores_psutil() -> list[_CoreTimes]:
    cores: list[_CoreTimes] = []
    for t in psutil.cpu_times(percpu=True):
        total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
        cores.append((total, t.idle, getattr(t, "iowait", None)))
    return cores


class _SystemCpu:
    """Per-core busy % and system-wide iowait % from deltas of cumulative per-core times.

    iowait is idle time with I/O outstanding: a hint of storage stalls, not a utilisation.
    """

    def __init__(self) -> None:
        self._file = ProcFile("/proc/stat", initial_size=16384) if PROCFS else None
        self._last: list[_CoreTimes] | None = None

    def sample(self) -> tuple[list[float] | None, float | None]:
        """Return (per-core busy %, iowait % or None where the platform has none)."""
        cur = _read_cores_procfs(self._file) if self._file else _read_cores_psutil()
        last, self._last = self._last, cur
        if last is None or len(last) != len(cur):  # first call, or CPU hotplug
            return None, None
        per_core: list[float] = []
        all_sum = io_sum = 0.0
        for (tot_a, idle_a, io_a), (tot_b, idle_b, io_b) in zip(last, cur, strict=True):
            all_d = tot_b - tot_a
            io_d = (io_b - io_a) if io_a is not None and io_b is not None else 0.0
            per_core.append(pct(all_d - (idle_b - idle_a) - io_d, all_d))
            all_sum += all_d
            io_sum += io_d
        return per_core, (None if cur[0][2] is None else pct(io_sum, all_sum))

    def close(self) -> None:
        """Release the descriptor."""
        if self._file is not None:
            self._file.close()


def _physical_disks() -> set[str]:
    """Block devices not stacked on other block devices.

    Device-mapper (LVM, dm-crypt) and md RAID devices have ``slaves``; a read through them is also
    counted on the disk beneath, so summing both (as psutil does) would double it.
    """
    disks: set[str] = set()
    with contextlib.suppress(OSError):
        for name in os.listdir("/sys/block"):
            try:
                stacked = bool(os.listdir(f"/sys/block/{name}/slaves"))
            except OSError:
                stacked = False
            if not stacked:
                disks.add(name.replace("!", "/"))  # sysfs spells "cciss/c0d0" as "cciss!c0d0"
    return disks


class _Disk:
    """System-wide read throughput of local block devices.

    Network filesystems (NFS, Lustre, FUSE object stores) do not appear here at all; reads served
    from the page cache do not either.  A ``null`` means "unknown", never "no I/O".
    """

    def __init__(self) -> None:
        self._rate = Rate()
        self.available = True
        self._file: ProcFile | None = None
        self._disks: set[str] = set()
        if PROCFS:
            with contextlib.suppress(OSError):
                self._file = ProcFile("/proc/diskstats", initial_size=8192)
                self._disks = _physical_disks()

    def sample(self) -> float | None:
        """Return bytes/s read since the previous call, or None (first call / unavailable)."""
        read_bytes = self._read_procfs() if self._file is not None else self._read_psutil()
        if read_bytes is None:  # no disks visible (some containers)
            self.available = False
            return None
        rate = self._rate.update(float(read_bytes), time.perf_counter())
        return None if rate is None else round(rate)

    def _read_procfs(self) -> int | None:
        assert self._file is not None
        sectors = 0
        seen = False
        for line in self._file.read().split(b"\n"):
            cols = line.split()
            if len(cols) > 5 and cols[2].decode() in self._disks:
                sectors += int(cols[5])
                seen = True
        return sectors * _SECTOR_BYTES if seen else None

    @staticmethod
    def _read_psutil() -> int | None:
        # nowrap=False: psutil's wrap correction keeps a module-global cache; a counter that goes
        # backwards yields null for one tick instead (see Rate).
        counters = psutil.disk_io_counters(nowrap=False)
        return None if counters is None else counters.read_bytes

    def close(self) -> None:
        """Release the descriptor."""
        if self._file is not None:
            self._file.close()


# -- descendants and GPUs --------------------------------------------------------------------------


def _read_once(path: str) -> bytes:
    """Read a small file with three syscalls (``open()`` adds fstat/ioctl/extra reads)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 65536)
    finally:
        os.close(fd)


class _Descendants:
    """Pids of all descendants of ``pid``, rescanned at most once per period.

    On Linux we follow ``/proc/<pid>/task/<tid>/children`` for every thread (a child belongs to
    the thread that forked it), so the cost scales with our own process tree rather than with the
    whole machine; elsewhere, or without CONFIG_PROC_CHILDREN, we fall back to psutil.
    """

    def __init__(self, pid: int, period_s: float) -> None:
        self._pid = pid
        self._period_s = period_s
        self._next_scan = 0.0
        self._pids: set[int] = set()
        self._procfs = PROCFS and os.path.exists(f"/proc/{pid}/task/{pid}/children")

    def pids(self) -> set[int]:
        """Return the (possibly cached) set of descendant pids."""
        now = time.perf_counter()
        if now >= self._next_scan:
            self._pids = self._scan_procfs() if self._procfs else self._scan_psutil()
            self._next_scan = now + self._period_s
        return self._pids

    def _scan_psutil(self) -> set[int]:
        try:
            return {c.pid for c in psutil.Process(self._pid).children(recursive=True)}
        except psutil.Error:
            return set()

    def _scan_procfs(self) -> set[int]:
        found: set[int] = set()
        stack = [self._pid]
        while stack:
            pid = stack.pop()
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:  # process gone
                continue
            for tid in tids:
                try:
                    data = _read_once(f"/proc/{pid}/task/{tid}/children")
                except OSError:  # thread gone
                    continue
                for child in map(int, data.split()):
                    if child not in found:
                        found.add(child)
                        stack.append(child)
        return found


# -- the sampler -----------------------------------------------------------------------------------


class SystemSampler:
    """Sample process/worker/system/GPU counters to a JSON-lines file from a daemon thread.

    Args:
        out_path: JSON-lines file to append to (parents are created).
        interval_s: Tick period (:data:`DEFAULT_INTERVAL_S`; at least :data:`MIN_INTERVAL_S`
            for true CPU figures).
        pid: Process to attribute as "the training process"; defaults to this process.
        worker_pids: Called every tick (from the sampler thread) for the current DataLoader worker
            pids; must be cheap and thread-safe.
        on_tick: Called after each sample is written, e.g. to flush the caller's own buffers.
        gpu: Whether to try NVML.
        flush_interval_s: Longest time a sample waits in the buffer before it reaches the OS
            (what a ``kill -9`` can lose).

    Attributes:
        missing: Human-readable notes on what could not be sampled; one per kind of problem.
        gpu_count: Number of GPUs sampled (0 when NVML is unavailable or ``gpu=False``).
        ticks: Number of samples written.
        self_cpu_s: CPU seconds spent by the sampler thread itself (its overhead on training).
    """

    def __init__(
        self,
        out_path: Path,
        interval_s: float = DEFAULT_INTERVAL_S,
        pid: int | None = None,
        worker_pids: Callable[[], Iterable[int]] | None = None,
        on_tick: Callable[[], None] | None = None,
        gpu: bool = True,
        flush_interval_s: float = 1.0,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.flush_interval_s = float(flush_interval_s)
        self._last_flush = 0.0
        self.out_path = Path(out_path)
        self.interval_s = float(interval_s)
        self.pid = os.getpid() if pid is None else pid
        self.missing: list[str] = []
        self.gpu_count = 0
        self.ticks = 0
        self.self_cpu_s = 0.0
        self._worker_pids = worker_pids
        self._last_worker_set: set[int] = set()
        self._on_tick = on_tick
        self._gpu_enabled = gpu
        self._noted: set[str] = set()
        self._stop_event = threading.Event()
        self._lifecycle = threading.Lock()
        self._thread: threading.Thread | None = None
        self._fh: IO[bytes] | None = None
        self._last_t: float | None = None
        self._main: MainProcess | None = None
        self._workers = ProcTable(self.interval_s)
        #: ticks between two readings of the workers' dirty memory (about one a second)
        self._dirty_every = max(1, round(1.0 / self.interval_s))
        self._children = ProcTable(self.interval_s)
        self._descendants: _Descendants | None = None
        self._sys_cpu: _SystemCpu | None = None
        self._disk: _Disk | None = None
        self._nvml = NvmlReader(self._note)

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Open the output file, take the baseline for every delta, and start the thread.

        The baseline is taken here, synchronously, so that ``missing`` and ``gpu_count`` are
        meaningful as soon as ``start()`` returns and the first tick already has a full window.

        Raises:
            RuntimeError: if called twice.
            OSError: if the output file cannot be opened (a configuration error worth surfacing
                before training starts).
            psutil.NoSuchProcess: if ``pid`` does not exist.
        """
        with self._lifecycle:
            if self._thread is not None:
                raise RuntimeError("SystemSampler.start() called twice")
            self.out_path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.out_path, "ab")  # noqa: SIM115 - closed by the sampler thread
            try:
                self._main = MainProcess(self.pid, self._note)
            except psutil.Error:
                self._close()
                raise
            except Gone as exc:  # exited between the two checks; keep Gone private
                self._close()
                raise psutil.NoSuchProcess(self.pid) from exc
            self._open_sources()
            self._sample(in_sampler_thread=False)
            self._thread = threading.Thread(target=self._run, name="trainprof-sampler", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread, which writes a final sample and closes the file; idempotent.

        Returns within one tick's duration (not one interval): the thread waits on an Event.
        """
        with self._lifecycle:
            thread = self._thread
            if thread is None or self._stop_event.is_set():
                return
            self._stop_event.set()
        thread.join(_JOIN_TIMEOUT_S)
        if thread.is_alive():
            self._note("stop", f"sampler: thread did not stop within {_JOIN_TIMEOUT_S:.0f} s")

    def _open_sources(self) -> None:
        """Create the system-wide sources; one that cannot be opened is noted and left out."""
        self._descendants = _Descendants(self.pid, _CHILD_SCAN_PERIOD_S)
        try:
            self._sys_cpu = _SystemCpu()
        except OSError as exc:
            self._note("system cpu", f"system cpu: unavailable ({exc})")
        self._disk = _Disk()
        if self._gpu_enabled:
            self.gpu_count = self._nvml.open()

    # -- thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        """Tick on a fixed grid; if a tick overruns, skip slots instead of bursting to catch up."""
        try:
            next_due = time.perf_counter() + self.interval_s
            while not self._stop_event.wait(max(0.0, next_due - time.perf_counter())):
                self._tick()
                next_due += self.interval_s
                now = time.perf_counter()
                if next_due <= now:
                    next_due = now + self.interval_s
            # Final partial window, unless it is too short for the counters' resolution.
            if self._last_t is None or time.perf_counter() - self._last_t >= min(
                MIN_INTERVAL_S, self.interval_s / 2
            ):
                self._tick()
        except Exception as exc:  # pragma: no cover - _tick already guards everything
            self._note("thread", f"sampler: thread stopped early ({type(exc).__name__}: {exc})")
        finally:
            self.self_cpu_s = time.thread_time()
            self._close()

    def _tick(self) -> None:
        rec = self._sample(in_sampler_thread=True)
        self._write(rec)
        if self._on_tick is not None:
            try:
                self._on_tick()
            except Exception as exc:
                self._note("on_tick", f"on_tick: raised {type(exc).__name__}: {exc}")
        self.self_cpu_s = time.thread_time()

    def _close(self) -> None:
        """Release every descriptor, NVML and the output file."""
        for source in (self._main, self._sys_cpu, self._disk, self._workers, self._children):
            if source is not None:
                with contextlib.suppress(Exception):
                    source.close()
        self._nvml.close()
        if self._fh is not None:
            try:
                self._fh.close()
            except OSError as exc:
                self._note("write", f"output: close failed ({exc})")
            self._fh = None

    # -- sampling --------------------------------------------------------------------------------

    def _sample(self, in_sampler_thread: bool) -> dict[str, Any]:
        """Build one record; every section is guarded so one failure nulls only its fields."""
        t = time.perf_counter()
        rec: dict[str, Any] = {"t": t}
        self._guard("process", rec, _MAIN_KEYS, lambda: self._sample_main(rec, in_sampler_thread))
        self._guard("workers", rec, _WORKER_KEYS, lambda: self._sample_procs(rec))
        self._guard("system cpu", rec, _SYS_KEYS, lambda: self._sample_sys(rec))
        self._guard("disk io", rec, _DISK_KEYS, lambda: self._sample_disk(rec))
        if self.gpu_count:
            self._guard("gpu", rec, (), lambda: self._sample_gpu(rec))
        self._last_t = t
        return rec

    def _guard(
        self, kind: str, rec: dict[str, Any], keys: tuple[str, ...], fn: Callable[[], None]
    ) -> None:
        try:
            fn()
        except Exception as exc:
            self._note(kind, f"{kind}: sampling failed ({type(exc).__name__}: {exc})")
        for key in keys:
            rec.setdefault(key, None)

    def _sample_main(self, rec: dict[str, Any], in_sampler_thread: bool) -> None:
        assert self._main is not None
        self._main.sample(rec, in_sampler_thread)

    def _sample_procs(self, rec: dict[str, Any]) -> None:
        worker_set = self._current_worker_pids()
        worker_pcts, worker_rss = self._workers.sample(worker_set)
        rec["workers"] = {str(p): round1(v) for p, v in sorted(worker_pcts.items())}
        rec["workers_rss_bytes"] = worker_rss
        if worker_pcts and (self.ticks % self._dirty_every == 0 or self._workers.dirty_unread()):
            # once a second, and at a worker's first sight: [private dirty, shared dirty]
            # bytes per worker (copy-on-read)
            rec["workers_dirty_bytes"] = {
                str(p): list(v) for p, v in sorted(self._workers.dirty_memory().items())}
        assert self._descendants is not None
        others = self._descendants.pids() - worker_set
        child_pcts, _ = self._children.sample(others)
        rec["children_cpu_pct"] = round1(sum(child_pcts.values(), 0.0))

    def _current_worker_pids(self) -> set[int]:
        """Ask the caller for worker pids; if that fails, keep the last answer.

        Falling back to the previous set (rather than to none) keeps the cached probes
        and their CPU baselines, so one bad call does not blank a tick and skew the next.
        """
        if self._worker_pids is None:
            return set()
        try:
            self._last_worker_set = {int(p) for p in self._worker_pids()}
        except Exception as exc:
            self._note("worker_pids", f"workers: worker_pids() raised {type(exc).__name__}: {exc}")
        return self._last_worker_set

    def _sample_sys(self, rec: dict[str, Any]) -> None:
        if self._sys_cpu is None:
            return
        per_core, iowait = self._sys_cpu.sample()
        rec["sys_cpu_pct"] = per_core
        rec["iowait_pct"] = iowait
        if per_core is not None and iowait is None:
            self._note("iowait", "iowait: not reported on this platform")

    def _sample_disk(self, rec: dict[str, Any]) -> None:
        if self._disk is None:
            return
        rec["disk_read_bps"] = self._disk.sample()
        if not self._disk.available:
            self._note("disk io", "disk io: unavailable")

    def _sample_gpu(self, rec: dict[str, Any]) -> None:
        gpus = self._nvml.read(self.pid)
        if gpus is not None:
            rec["gpu"] = gpus

    # -- output / notes --------------------------------------------------------------------------

    def _write(self, rec: dict[str, Any]) -> None:
        """Append one line; hand the buffer to the OS at least every ``flush_interval_s``."""
        if self._fh is None:
            return
        try:
            self._fh.write(orjson.dumps(rec, option=orjson.OPT_APPEND_NEWLINE))
            if rec["t"] - self._last_flush >= self.flush_interval_s:
                self._fh.flush()
                self._last_flush = rec["t"]
            self.ticks += 1
        except (OSError, TypeError) as exc:  # disk full, unserialisable value
            self._note("write", f"output: write failed ({type(exc).__name__}: {exc})")

    def _note(self, kind: str, message: str) -> None:
        """Record ``message`` once per ``kind`` so a persistent failure cannot flood ``missing``."""
        if kind not in self._noted:
            self._noted.add(kind)
            self.missing.append(message)
