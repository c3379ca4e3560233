"""Counters of single processes, read from Linux's ``/proc`` with one ``pread`` each.

The system sampler (:mod:`trainprof.capture.sampler`) reads these every tick for the
training process and each DataLoader worker: CPU time, RSS and context switches.
Each ``/proc`` file is opened once and re-read with a single ``pread`` (with the C
extension, without releasing the GIL); why that matters - GIL hand-offs between the
sampler thread and a Python-bound training thread - is in that module's docstring.
psutil is the portable fallback where ``/proc`` is not Linux's.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import psutil

try:  # Not available on Windows.
    import resource
except ImportError:  # pragma: no cover - platform dependent
    resource = None  # type: ignore[assignment]

# The procfs fast path needs Linux's /proc and CLOCK_BOOTTIME (the clock of stat's starttime).
PROCFS = (
    sys.platform.startswith("linux")
    and os.path.exists("/proc/self/stat")
    and hasattr(time, "CLOCK_BOOTTIME")
)
_CLK_TCK = os.sysconf("SC_CLK_TCK") if PROCFS else 100
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if PROCFS else 4096


def round1(x: float) -> float:
    """Round to 0.1: keeps lines short (per-core lists on 128-core hosts) at no loss of meaning."""
    return round(x, 1)


def pct(part: float, whole: float) -> float:
    """``part / whole`` in percent, clamped to [0, 100] (counters are read non-atomically)."""
    if whole <= 0:
        return 0.0
    return round1(min(max(part / whole * 100.0, 0.0), 100.0))


class Rate:
    """Per-second rate of a cumulative counter, with its own timestamps.

    Each source keeps the time at which *it* was read, not the tick start: under GIL contention a
    tick can take milliseconds of wall time, and one shared timestamp would skew the windows of
    the counters read last.
    """

    def __init__(self, clamp_negative: bool = False) -> None:
        self._last: tuple[float, float] | None = None
        self._clamp_negative = clamp_negative

    def update(self, value: float, t: float) -> float | None:
        """Record ``value`` read at ``t``; return the rate since the previous reading, if any.

        A counter going backwards is a reset or wrap, so that window is skipped (None) rather than
        reported wrong, unless ``clamp_negative``: for a difference of two counters read a few
        microseconds apart (process minus sampler thread), a tiny negative is jitter and means 0.
        """
        last, self._last = self._last, (value, t)
        if last is None:
            return None
        dv, dt = value - last[0], t - last[1]
        if dt <= 0:
            return None
        if dv < 0:
            if not self._clamp_negative:
                return None
            dv = 0.0
        return dv / dt



# -- Linux /proc access ----------------------------------------------------------------------------


def _held_pread() -> Callable[[int, int, int], bytes]:
    """``os.pread``, or the C extension's copy that keeps the GIL (see the module docstring)."""
    if os.environ.get("TRAINPROF_PURE_PYTHON", "") not in ("", "0"):
        return os.pread
    try:
        from trainprof.capture._fastclock import pread_held
    except ImportError:  # built without a C compiler (or an older build)
        return os.pread
    return pread_held  # type: ignore[no-any-return]


_pread = _held_pread()


class ProcFile:
    """A ``/proc`` file kept open and re-read with one ``pread`` per read.

    ``/proc`` regenerates the content on every read from offset 0, so the open/fstat/read/close
    dance (each a GIL release) is unnecessary.
    """

    def __init__(self, path: str, initial_size: int = 4096) -> None:
        self._fd = os.open(path, os.O_RDONLY)
        self._size = initial_size

    def read(self, enough: bytes | None = None) -> bytes:
        """Return the content; stop growing the buffer once it contains ``enough`` (if given)."""
        while True:
            data = _pread(self._fd, self._size, 0)
            if len(data) < self._size or (enough is not None and enough in data):
                return data
            self._size *= 2

    def close(self) -> None:
        """Close the descriptor (idempotent)."""
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1


class Gone(Exception):
    """The process exited (or became a zombie, or is not ours to read)."""


class _Probe(Protocol):
    def read(self) -> tuple[float, int, float]:
        """Return (cumulative CPU seconds, RSS bytes, age in seconds); raise Gone if exited."""
        ...

    def close(self) -> None: ...


class _ProcfsProbe:
    """CPU, RSS and age of one pid from a kept-open ``/proc/<pid>/stat``.

    One ``pread`` per tick, and the open descriptor pins the process identity: once it exits, reads
    fail with ESRCH even if the pid number is reused, so we never report a stranger's counters.
    """

    def __init__(self, pid: int) -> None:
        try:
            self._file = ProcFile(f"/proc/{pid}/stat", initial_size=1024)
        except OSError as exc:
            raise Gone(pid) from exc

    def read(self) -> tuple[float, int, float]:
        """Return (cumulative CPU seconds, RSS bytes, age in seconds)."""
        try:
            data = self._file.read()
        except OSError as exc:
            raise Gone() from exc
        # The command name may contain spaces and parentheses: split after the *last* ')'.
        fields = data.rpartition(b")")[2].split()
        if fields[0] in (b"Z", b"X"):  # exited, not yet reaped
            raise Gone()
        cpu_s = (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime + stime (fields 14, 15)
        rss = int(fields[21]) * _PAGE_SIZE  # field 24, in pages
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / _CLK_TCK  # field 22
        return cpu_s, rss, age

    def close(self) -> None:
        """Release the descriptor."""
        self._file.close()


class _PsutilProbe:
    """Portable fallback for :class:`_ProcfsProbe`."""

    def __init__(self, pid: int) -> None:
        try:
            self._proc = psutil.Process(pid)
        except psutil.Error as exc:
            raise Gone(pid) from exc

    def read(self) -> tuple[float, int, float]:
        """Return (cumulative CPU seconds, RSS bytes, age in seconds)."""
        try:
            with self._proc.oneshot():
                times = self._proc.cpu_times()
                rss = self._proc.memory_info().rss
            age = time.time() - self._proc.create_time()
        except psutil.Error as exc:  # NoSuchProcess (incl. ZombieProcess), AccessDenied
            raise Gone() from exc
        return times.user + times.system, rss, age

    def close(self) -> None:
        """Nothing to release."""


def _new_probe(pid: int) -> _Probe:
    return _ProcfsProbe(pid) if PROCFS else _PsutilProbe(pid)


# -- per-process CPU -------------------------------------------------------------------------------


@dataclass
class _Tracked:
    probe: _Probe
    cpu_s: float
    t: float
    rollup: ProcFile | None = None  # /proc/<pid>/smaps_rollup, opened at the first read
    rollup_failed: bool = False
    rollup_read: bool = False


#: smaps_rollup fields kept (proc(5)): pages only this process maps and has written
#: (copied on write, or allocated), and written pages still shared with another process
_ROLLUP_FIELDS = {b"Private_Dirty": 0, b"Shared_Dirty": 1}


def _parse_rollup(data: bytes) -> tuple[int, int]:
    """(Private_Dirty, Shared_Dirty) in bytes from an smaps_rollup text."""
    out = [0, 0]
    for line in data.splitlines():
        key, _, rest = line.partition(b":")
        index = _ROLLUP_FIELDS.get(key)
        if index is not None:
            out[index] = int(rest.split()[0]) * 1024  # kB
    return out[0], out[1]


class ProcTable:
    """CPU % and RSS of a changing set of pids, with one cached probe per pid.

    Without ``persistent_workers`` the DataLoader replaces all its workers every epoch, so the
    table drops (and closes) probes of pids that exited or are no longer requested and creates
    probes only for new pids.
    """

    def __init__(self, min_window_s: float) -> None:
        self._min_window_s = min_window_s
        self._tracked: dict[int, _Tracked] = {}

    def sample(self, pids: Iterable[int]) -> tuple[dict[int, float], int]:
        """Return ({pid: cpu %}, summed RSS bytes) for the live pids among ``pids``."""
        wanted = set(pids)
        for pid in [p for p in self._tracked if p not in wanted]:
            self._drop(pid)
        pcts: dict[int, float] = {}
        rss_total = 0
        for pid in wanted:
            got = self._sample_one(pid)
            if got is not None:
                pcts[pid], rss = got
                rss_total += rss
        return pcts, rss_total

    def dirty_unread(self) -> bool:
        """A pid is tracked whose dirty memory was never read (a worker just started:
        its first reading is the baseline its later copies are measured from)."""
        return any(not t.rollup_read and not t.rollup_failed for t in self._tracked.values())

    def dirty_memory(self) -> dict[int, tuple[int, int]]:
        """{pid: (Private_Dirty, Shared_Dirty) bytes} of the pids sampled last.

        From ``/proc/<pid>/smaps_rollup`` (Linux 4.14+; kept open, one ``pread`` each):
        a DataLoader worker's private dirty memory grows, and its shared dirty memory
        shrinks, as it copies pages it shares with the training process on first write —
        Python objects of the dataset whose reference counts a read touches
        (copy-on-read). The kernel walks the worker's page tables for it, so this is
        read about once a second, not every tick.
        """
        out: dict[int, tuple[int, int]] = {}
        for pid, tracked in self._tracked.items():
            if tracked.rollup_failed:
                continue
            try:
                if tracked.rollup is None:
                    tracked.rollup = ProcFile(f"/proc/{pid}/smaps_rollup", initial_size=2048)
                out[pid] = _parse_rollup(tracked.rollup.read())
                tracked.rollup_read = True
            except (OSError, ValueError, IndexError):
                tracked.rollup_failed = True  # no procfs, an old kernel, or it exited
        return out

    def close(self) -> None:
        """Release every probe."""
        for pid in list(self._tracked):
            self._drop(pid)

    def _drop(self, pid: int) -> None:
        tracked = self._tracked.pop(pid, None)
        if tracked is not None:
            tracked.probe.close()
            if tracked.rollup is not None:
                tracked.rollup.close()

    def _sample_one(self, pid: int) -> tuple[float, int] | None:
        tracked = self._tracked.get(pid)
        if tracked is not None:
            try:
                cpu_s, rss, _ = tracked.probe.read()
            except Gone:  # exited; the pid number may already belong to a new process
                self._drop(pid)
                tracked = None
            else:
                now = time.perf_counter()
                dt = now - tracked.t
                pct = (cpu_s - tracked.cpu_s) / dt * 100.0 if dt > 0 else 0.0
                tracked.cpu_s, tracked.t = cpu_s, now
                return max(pct, 0.0), rss
        try:
            probe = _new_probe(pid)
            cpu_s, rss, age = probe.read()
        except Gone:
            return None
        self._tracked[pid] = _Tracked(probe, cpu_s, time.perf_counter())
        return self._first_sight_pct(cpu_s, age), rss

    def _first_sight_pct(self, cpu_s: float, age_s: float) -> float:
        """CPU % of a process first seen now: its CPU since creation over its age.

        Workers start between ticks and burn real CPU at startup (imports, unpickling the
        dataset); reporting 0 for their first tick would hide that.  The age is floored at one
        interval because start times have clock-tick (10 ms) resolution: a 5 ms old process would
        otherwise show absurd percentages.
        """
        return cpu_s / max(age_s, self._min_window_s) * 100.0


class MainProcess:
    """CPU %, RSS and context-switch rate of the training process.

    For our own process CPU and switches come from ``getrusage``: microsecond resolution
    (``/proc/<pid>/stat`` counts 10 ms clock ticks, i.e. 5 % quantisation at 5 Hz), no GIL release,
    and, unlike psutil's ``num_ctx_switches()`` on Linux, which reads ``/proc/<pid>/status`` and so
    counts the *main thread only*, it covers every thread.  The sampler thread's own CPU and
    switches are subtracted so the numbers describe training, not the profiler; the sampler's cost
    is reported separately as ``SystemSampler.self_cpu_s``.  Another process (how ``trainprof
    run`` samples: :mod:`trainprof.capture.sampler_process`) is read from ``/proc``: CPU in clock
    ticks, and the switches of its main thread, which is the training thread of most scripts.
    """

    def __init__(self, pid: int, note: Callable[[str, str], None]) -> None:
        self.pid = pid
        self._proc = psutil.Process(pid)  # validates the pid; used for ctx switches of others
        self._probe = _new_probe(pid)
        self._note = note
        self._own = pid == os.getpid() and resource is not None
        self._cpu = Rate(clamp_negative=self._own)
        self._ctx = Rate(clamp_negative=self._own)
        # anonymous resident memory (heap, tensors): what a leak grows; RSS also counts the
        # file pages of a memory-mapped dataset, which grow over a first epoch and stop
        self._statm: ProcFile | None = None
        with contextlib.suppress(OSError):
            self._statm = ProcFile(f"/proc/{pid}/statm", initial_size=256)

    def sample(self, rec: dict[str, Any], in_sampler_thread: bool) -> None:
        """Fill the main-process fields.

        ``in_sampler_thread`` is False only for the baseline taken by ``start()`` in the caller's
        thread, before the sampler thread (whose usage is then 0) exists.
        """
        cpu_s, rss, _ = self._probe.read()
        now = time.perf_counter()
        if self._own:
            # Thread usage first, process usage right after: neither call releases the GIL, so
            # the two readings are microseconds apart and the difference is training's share.
            own_cpu_s, own_ctx = _thread_usage() if in_sampler_thread else (0.0, 0)
            ru = resource.getrusage(resource.RUSAGE_SELF)
            cpu_s = ru.ru_utime + ru.ru_stime - own_cpu_s
            ctx = ru.ru_nvcsw + ru.ru_nivcsw - own_ctx
        else:
            # another process (the sampler's own process, see sampler_process): on Linux
            # /proc/<pid>/status counts the main thread's switches, the training thread's
            switches = self._proc.num_ctx_switches()
            ctx = switches.voluntary + switches.involuntary
        cpu_rate = self._cpu.update(cpu_s, now)
        ctx_rate = self._ctx.update(float(ctx), now)
        rec["proc_cpu_pct"] = None if cpu_rate is None else round1(cpu_rate * 100.0)
        rec["rss_bytes"] = rss
        rec["rss_anon_bytes"] = self._anon_rss()
        rec["ctx_switches_ps"] = None if ctx_rate is None else round1(ctx_rate)

    def _anon_rss(self) -> int | None:
        """``resident - shared`` of /proc/<pid>/statm (proc(5): shared is RssFile +
        RssShmem), in bytes; None where there is no procfs."""
        if self._statm is None:
            return None
        try:
            fields = self._statm.read().split()
            return (int(fields[1]) - int(fields[2])) * _PAGE_SIZE
        except (OSError, IndexError, ValueError):
            return None

    def close(self) -> None:
        """Release the probe."""
        self._probe.close()
        if self._statm is not None:
            self._statm.close()


def _thread_usage() -> tuple[float, int]:
    """CPU seconds and context switches of the *calling* thread (switches 0 where unsupported)."""
    cpu = time.thread_time()
    if resource is not None and hasattr(resource, "RUSAGE_THREAD"):
        ru = resource.getrusage(resource.RUSAGE_THREAD)
        return cpu, ru.ru_nvcsw + ru.ru_nivcsw
    return cpu, 0
