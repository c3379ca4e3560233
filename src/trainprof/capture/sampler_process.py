"""The system sampler in a child process, so that sampling never takes the training GIL.

:class:`~trainprof.capture.sampler.SystemSampler` in a thread of the training process
had to take the GIL for every tick: the training thread was asked to drop it, waited
while the tick parsed ``/proc`` (hundreds of microseconds of Python), and took it
back with cold caches. Measured with ``benchmarks/overhead.py --parts`` on a ~1 ms
step, that cost the training loop about 0.8% of its wall time at 5 Hz, most of the
always-on budget (1%). In a process of its own the sampler runs on another core,
or at worst is scheduled beside training like any other process, and shares no lock
with it.

What changes for the samples (``samples.jsonl``, same fields):

* the training process is read from outside: its CPU from ``/proc/<pid>/stat``
  (clock ticks, as ``top`` and psutil read it: 10 ms resolution, so a single
  0.2 s sample is quantised to 5% of a core; means over a run are unaffected) and
  its context switches from ``/proc/<pid>/status``, which counts the main thread's
  (the training thread, unless a script trains in another thread);
* ``t`` is still :func:`time.perf_counter`: ``CLOCK_MONOTONIC`` on Linux, one clock
  for every process of the machine, so samples and steps align as before.

The child is ``python -m trainprof.capture.sampler_process``: it imports neither
torch nor the training script. The training process tells it the DataLoader
worker pids over the child's stdin (a line per change, written without blocking
when iterators start workers), and stops it with ``q`` and EOF; the child then
takes a last sample and prints one JSON line of status (what could not be
sampled, GPUs seen, its own CPU time). It runs in a session of its own, so a
Ctrl-C in the terminal reaches only the training process, which then stops the
sampler in order; and it stops by itself when the training process is gone
(``kill -9``): stdin reaches EOF, or its parent pid changes (forked DataLoader
workers may hold the pipe open).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

import orjson

__all__ = ["SamplerProcess"]

#: How long :meth:`SamplerProcess.stop` waits for the child's last sample and status.
STOP_TIMEOUT_S = 5.0


class SamplerProcess:
    """Runs a :class:`~trainprof.capture.sampler.SystemSampler` in a child process.

    The same interface as the sampler for what the Recorder uses: ``start()``,
    ``stop()``, ``missing`` (complete after ``stop()``), ``gpu_count`` and
    ``self_cpu_s`` (known after ``stop()``), plus :meth:`set_worker_pids`.

    Args:
        out_path: the ``samples.jsonl`` to append to.
        interval_s: tick period of the sampler.
        pid: the process to sample as "the training process" (default: this one).
        gpu: whether the child tries NVML.
    """

    def __init__(self, out_path: Path, interval_s: float = 0.2, pid: int | None = None,
                 gpu: bool = True) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.out_path = Path(out_path)
        self.interval_s = float(interval_s)
        self.pid = os.getpid() if pid is None else pid
        self.gpu = gpu
        self.missing: list[str] = []
        self.gpu_count = 0
        self.ticks = 0
        self.self_cpu_s = 0.0
        self._proc: subprocess.Popen[bytes] | None = None
        self._stdin: IO[bytes] | None = None
        self._sent: tuple[int, ...] = ()
        self._wanted: tuple[int, ...] = ()  # the latest pids, sent again at start()
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the child; returns at once (the child takes its baseline on its own).

        Raises:
            RuntimeError: if called twice.
            OSError: if the child cannot be started.
        """
        if self._proc is not None:
            raise RuntimeError("SamplerProcess.start() called twice")
        self.out_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "trainprof.capture.sampler_process",
               "--pid", str(self.pid), "--out", str(self.out_path),
               "--interval", repr(self.interval_s)]
        if not self.gpu:
            cmd.append("--no-gpu")
        self._proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=_child_env(), start_new_session=True, close_fds=True,
        )
        self._stdin = self._proc.stdin
        assert self._stdin is not None
        # a full pipe (a stuck child) must never block the training thread
        with contextlib.suppress(OSError, AttributeError):  # POSIX pipes: always possible
            os.set_blocking(self._stdin.fileno(), False)
        if self._wanted:  # workers started before the sampler did
            self.set_worker_pids(self._wanted)

    def set_worker_pids(self, pids: Iterable[int]) -> None:
        """Tell the child the current DataLoader worker pids (sent only when they change).

        Called from the training thread when an iterator starts workers: one short
        non-blocking write. A child that is gone or not reading loses the update
        (noted once); training never waits for it.
        """
        new = tuple(sorted({int(p) for p in pids}))
        with self._lock:
            self._wanted = new
            if new == self._sent or self._stdin is None:
                return
            line = ("w " + " ".join(map(str, new)) + "\n").encode()
            try:
                os.write(self._stdin.fileno(), line)
                self._sent = new
            except (BlockingIOError, BrokenPipeError, OSError) as exc:
                self._note(f"system sampler: worker pids not delivered ({type(exc).__name__})")

    def stop(self) -> None:
        """Stop the child (a last sample, then its status); idempotent, bounded in time."""
        proc = self._proc
        with self._lock:
            stdin, self._stdin = self._stdin, None
        if proc is None or stdin is None:
            return
        with contextlib.suppress(OSError):
            # "q", then EOF: a forked child of the script that inherited the pipe may keep
            # it open, so EOF alone might never come
            os.write(stdin.fileno(), b"q\n")
        with contextlib.suppress(OSError):
            stdin.close()
        proc.stdin = None  # communicate() below must not flush it
        try:
            out, err = proc.communicate(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            self._note(f"system sampler: did not stop within {STOP_TIMEOUT_S:.0f} s (killed)")
        status = _last_json_line(out)
        if status is None:
            tail = err.decode(errors="replace").strip().splitlines()[-1:] if err else []
            why = f": {tail[0]}" if tail else ""
            self._note(f"system sampler: exited with code {proc.returncode}{why}")
            return
        self.gpu_count = int(status.get("gpu_count", 0))
        self.ticks = int(status.get("ticks", 0))
        self.self_cpu_s = float(status.get("self_cpu_s", 0.0))
        for message in status.get("missing", []):
            self._note(str(message))
        if self.ticks == 0 and not status.get("missing"):
            # the sampler's start (a Python process, its imports: ~0.1 s, longer on a busy
            # machine) outlasted the training, and a last window under 50 ms has no reading
            self._note("system samples: none, the run ended before the sampler's first one")

    def _note(self, message: str) -> None:
        if message not in self.missing:
            self.missing.append(message)


def _child_env() -> dict[str, str]:
    """This environment, with trainprof importable whatever put it on ``sys.path``."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # the folder holding the package
    paths = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = root + (os.pathsep + paths if paths else "")
    return env


def _last_json_line(data: bytes | None) -> dict[str, Any] | None:
    for line in reversed((data or b"").splitlines()):
        with contextlib.suppress(orjson.JSONDecodeError):
            doc = orjson.loads(line)
            if isinstance(doc, dict):
                return doc
    return None


# -- the child ---------------------------------------------------------------------------------


def _read_commands(box: list[tuple[int, ...]], done: threading.Event) -> None:
    """Worker-pid lines (``w PID ...``) from stdin until ``q`` or EOF (the training
    process stopped the sampler, or died)."""
    try:
        for raw in sys.stdin.buffer:
            parts = raw.split()
            if parts and parts[0] == b"q":
                break
            if parts and parts[0] == b"w":
                with contextlib.suppress(ValueError):
                    box[0] = tuple(int(p) for p in parts[1:])
    except OSError:
        pass
    finally:
        done.set()


def child_main(argv: list[str] | None = None) -> int:
    """Sample ``--pid`` until stdin closes or the parent is gone; print a status line."""
    parser = argparse.ArgumentParser(prog="python -m trainprof.capture.sampler_process")
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--no-gpu", action="store_true")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the training process decides when to stop
    from trainprof.capture.sampler import SystemSampler

    parent = os.getppid()
    box: list[tuple[int, ...]] = [()]
    done = threading.Event()

    def parent_gone() -> None:
        if os.getppid() != parent:  # re-parented: the training process died
            done.set()

    sampler = SystemSampler(args.out, interval_s=args.interval, pid=args.pid,
                            worker_pids=lambda: box[0], on_tick=parent_gone,
                            gpu=not args.no_gpu)
    status: dict[str, Any] = {}
    try:
        sampler.start()
    except Exception as exc:
        status["missing"] = [f"system sampler: {type(exc).__name__}: {exc}"]
    else:
        threading.Thread(target=_read_commands, args=(box, done), daemon=True).start()
        while not done.wait(1.0):
            parent_gone()
        sampler.stop()
        status["missing"] = list(sampler.missing)
    status.update(gpu_count=sampler.gpu_count, ticks=sampler.ticks,
                  self_cpu_s=time.process_time())
    sys.stdout.buffer.write(orjson.dumps(status) + b"\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(child_main())
