"""Shared helpers: write tiny training scripts, run them under `trainprof run` in a subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

# A shell starts a background job (`pytest ... &`) with SIGINT ignored, and every
# process it starts inherits that: the tests' Ctrl-C would then reach runs that ignore
# it (as `python train.py &` would), train on and time out. A handler here is reset to
# the default in each child at exec, so the runs get Python's KeyboardInterrupt again.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path

    def json(self) -> dict:
        return json.loads(self.stdout)


def write_script(directory: Path, name: str, body: str) -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(body))
    return path


def trainprof(*args: str, cwd: Path, timeout: float = 120, env: dict | None = None) -> Result:
    """Run `python -m trainprof ARGS` in cwd; the run folder is cwd/run unless --out is given.

    A second run in the same folder goes to cwd/run-2, and so on (a folder that holds
    a run is refused).
    """
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    argv = list(args)
    run_dir, n = cwd / "run", 1
    while argv and argv[0] == "run" and "--out" not in argv and run_dir.exists():
        n += 1
        run_dir = cwd / f"run-{n}"
    if argv and argv[0] == "run" and "--out" not in argv:
        argv = ["run", "--out", str(run_dir), *argv[1:]]
    proc = subprocess.run(
        [sys.executable, "-m", "trainprof", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        stdin=subprocess.DEVNULL,
    )
    return Result(proc.returncode, proc.stdout, proc.stderr, run_dir)


@pytest.fixture
def tp(tmp_path: Path):
    """`tp(script_body, *trainprof_run_options, args=[...])` -> Result, in a fresh folder."""

    def run(body: str, *options: str, args: tuple[str, ...] = (), name: str = "train.py",
            timeout: float = 120, env: dict | None = None) -> Result:
        script = write_script(tmp_path, name, body)
        return trainprof("run", *options, str(script.name), *args, cwd=tmp_path,
                         timeout=timeout, env=env)

    return run


def burn_cpu(seconds: float) -> tuple[float, float]:
    """Busy-loop in the calling thread; return the perf_counter window it covered."""
    t0 = time.perf_counter()
    x = 0
    while time.perf_counter() - t0 < seconds:
        x += 1
    return t0, time.perf_counter()


def sampler_children(pid: int) -> list:
    """The system sampler processes among ``pid``'s children (psutil.Process objects).

    A child that is a zombie (left by an earlier test) has no command line: skipped.
    """
    import psutil

    found = []
    for p in psutil.Process(pid).children():
        try:
            cmdline = " ".join(p.cmdline())
        except psutil.Error:  # ZombieProcess, NoSuchProcess
            continue
        if "trainprof.capture.sampler_process" in cmdline:
            found.append(p)
    return found


# --------------------------------------------------------------------------- a run to export

EXPORT_SCRIPT = """
    import time
    import torch
    import trainprof
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    class Data(Dataset):
        def __len__(self):
            return 4096
        def __getitem__(self, i):
            time.sleep(0.0005)
            return torch.randn(32), i % 4

    torch.manual_seed(0)
    loader = DataLoader(Data(), batch_size=8, num_workers=1, persistent_workers=True)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with trainprof.profile() as prof:
        for step, (x, y) in enumerate(loader):
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(0.004)
            if step % 10 == 9:
                with prof.region("eval"):
                    time.sleep(0.01)
            if step == 39:
                break
"""


@pytest.fixture(scope="session")
def export_run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run with everything the exports carry (steps and phases, a named region, a
    DataLoader worker, system samples, a deep window), shared by the export tests: read
    only."""
    root = tmp_path_factory.mktemp("export")
    write_script(root, "train.py", EXPORT_SCRIPT)
    out = root / "run"
    res = trainprof("run", "--out", str(out), "--sample-interval", "0.05",
                    "--deep", "skip_first=8,warmup=1,active=3", "train.py", cwd=root)
    assert res.returncode == 0, res.stderr
    assert list((out / "deep").glob("*.pt.trace.json.gz")), "no deep-window trace written"
    return out
