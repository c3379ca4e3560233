"""The system sampler in its own process: same numbers, no GIL taken, gone with its parent.

Real processes and real CPU burn, as in test_sampler.py; the truth comes from
counters read outside the sampler.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from conftest import burn_cpu, sampler_children

from trainprof.analysis.system import load_samples
from trainprof.capture.sampler_process import SamplerProcess


def _gone(proc: psutil.Process, within: float) -> bool:
    try:
        proc.wait(timeout=within)
    except psutil.TimeoutExpired:
        return False
    except psutil.NoSuchProcess:
        pass
    return True


def test_child_samples_this_process_and_the_workers_it_is_told_of(tmp_path: Path) -> None:
    busy = subprocess.Popen([sys.executable, "-c", "while True:\n    pass\n"])
    try:
        s = SamplerProcess(tmp_path / "s.jsonl", interval_s=0.05, gpu=False)
        s.start()
        assert len(sampler_children(os.getpid())) == 1
        s.set_worker_pids([busy.pid])
        time.sleep(0.5)  # the child's start-up (an interpreter, psutil) and a few ticks
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        t0, t1 = burn_cpu(1.2)
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        started = time.perf_counter()
        s.stop()
        stop_s = time.perf_counter() - started
    finally:
        busy.kill()
        busy.wait(timeout=5)
    assert stop_s < 2.0
    assert s.missing == [] and s.gpu_count == 0 and s.ticks > 0 and s.self_cpu_s > 0
    samples = load_samples(tmp_path / "s.jsonl")
    assert len(samples) == s.ticks
    during = [x for x in samples if t0 <= x["t"] <= t1]
    assert len(during) >= 15  # ~24 ticks at 20 Hz: this process's GIL was never needed
    true_main = (ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime) / (t1 - t0) * 100
    proc_cpu = sum(x["proc_cpu_pct"] for x in during) / len(during)
    assert abs(proc_cpu - true_main) < 12, (proc_cpu, true_main)  # clock ticks: 5% a tick
    seen = [x["workers"].get(str(busy.pid)) for x in during]
    assert all(v is not None for v in seen)
    assert sum(seen) / len(seen) > 40 or psutil.cpu_count() < 2
    assert all(x["ctx_switches_ps"] is not None and x["ctx_switches_ps"] >= 0 for x in during)
    s.stop()  # idempotent
    assert not sampler_children(os.getpid())


def test_worker_pid_updates_never_block_and_stop_is_idempotent(tmp_path: Path) -> None:
    s = SamplerProcess(tmp_path / "s.jsonl", interval_s=10.0, gpu=False)
    s.set_worker_pids([1, 2])  # before start: kept, sent when the child starts
    s.start()
    t0 = time.perf_counter()
    for i in range(2000):  # far more than a pipe holds if the child did not read
        s.set_worker_pids([10_000 + i])
    assert time.perf_counter() - t0 < 1.0
    s.stop()
    s.stop()
    # a pipe that filled up is noted, never waited for (and, stopped before its first
    # 10 s tick, maybe that no sample was taken: see the next test)
    assert all("worker pids not delivered" in m or m == NO_SAMPLE for m in s.missing), s.missing


NO_SAMPLE = "system samples: none, the run ended before the sampler's first one"


def test_a_sampler_stopped_before_its_first_sample_says_so(tmp_path: Path) -> None:
    """A run shorter than the sampler's start (a spawned rank of 0.4 s on a busy machine)
    has no system samples: its record says why, instead of an empty file alone."""
    s = SamplerProcess(tmp_path / "s.jsonl", interval_s=10.0, gpu=False)
    s.start()
    s.stop()  # at once: the child reads the stop right after its baseline
    assert s.ticks == 0 and s.missing == [NO_SAMPLE]
    assert (tmp_path / "s.jsonl").read_text() == ""
    s = SamplerProcess(tmp_path / "t.jsonl", interval_s=0.05, gpu=False)
    s.start()
    time.sleep(0.5)
    s.stop()
    assert s.ticks > 0 and NO_SAMPLE not in s.missing


def test_child_stops_with_its_parent_after_kill_9(tmp_path: Path) -> None:
    out = tmp_path / "s.jsonl"
    code = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from trainprof.capture.sampler_process import SamplerProcess
        SamplerProcess(Path({str(out)!r}), interval_s=0.02, gpu=False).start()
        print("READY", flush=True)
        time.sleep(60)
        """)
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None and "READY" in parent.stdout.readline()
        children = sampler_children(parent.pid)
        assert len(children) == 1
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (
                not out.exists() or out.read_bytes().count(b"\n") < 10):
            time.sleep(0.05)
        time.sleep(0.5)
        killed_at = time.perf_counter()
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=5)
    finally:
        if parent.poll() is None:
            parent.kill()
    # stdin reached EOF: a last sample, then the child exits; none is left sampling
    assert _gone(children[0], within=5)
    samples = load_samples(out)
    assert len(samples) >= 10
    assert samples[-1]["t"] >= killed_at - 1.3


def test_ctrl_c_in_the_terminal_does_not_reach_the_child(tmp_path: Path) -> None:
    """A new session: the terminal's SIGINT goes to training, which then stops the child."""
    s = SamplerProcess(tmp_path / "s.jsonl", interval_s=0.05, gpu=False)
    s.start()
    try:
        (child,) = sampler_children(os.getpid())
        assert os.getsid(child.pid) != os.getsid(0)
        deadline = time.monotonic() + 10  # started: its handlers are set once it samples
        while time.monotonic() < deadline and not (tmp_path / "s.jsonl").exists():
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGINT)  # even sent to it directly, it is ignored
        time.sleep(0.5)
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
    finally:
        s.stop()
    assert s.ticks >= 3 and not s.missing


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_bad_interval_is_refused(tmp_path: Path, bad: float) -> None:
    with pytest.raises(ValueError):
        SamplerProcess(tmp_path / "s.jsonl", interval_s=bad)


def test_stop_is_prompt_while_a_forked_child_holds_the_pipe(tmp_path: Path) -> None:
    """A forked DataLoader worker (or any fork of the script) inherits the pipe: EOF
    alone would wait for it; the explicit ``q`` does not."""
    s = SamplerProcess(tmp_path / "s.jsonl", interval_s=0.05, gpu=False)
    s.start()
    pid = os.fork()
    if pid == 0:  # the fork: holds the pipe's write end, does nothing
        time.sleep(4)
        os._exit(0)
    try:
        time.sleep(0.3)
        started = time.perf_counter()
        s.stop()
        assert time.perf_counter() - started < 2.0
        assert not s.missing and s.ticks >= 1
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_worker_pids_told_before_start_reach_the_child(tmp_path: Path) -> None:
    """A rank's sampler starts at its first step (capture.ranks): its DataLoader workers
    may be running by then."""
    busy = subprocess.Popen([sys.executable, "-c", "while True:\n    pass\n"])
    try:
        s = SamplerProcess(tmp_path / "s.jsonl", interval_s=0.05, gpu=False)
        s.set_worker_pids([busy.pid])
        s.start()
        time.sleep(1.0)
        s.stop()
    finally:
        busy.kill()
        busy.wait(timeout=5)
    samples = load_samples(tmp_path / "s.jsonl")
    assert any(str(busy.pid) in x["workers"] for x in samples), samples[-1]
