"""Shared helpers: write tiny training scripts, run them under `trainprof run` in a subprocess
(forked from the run server, ``run_server.py``, where a fork can stand for a fresh Python)."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
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

# The machine's matmul peak (capture/peak_flops.py) is measured by the first run that needs
# it and cached: in a folder of this test session, not the user's ~/.cache.
os.environ["TRAINPROF_CACHE_DIR"] = tempfile.mkdtemp(prefix="trainprof-test-cache-")
atexit.register(shutil.rmtree, os.environ["TRAINPROF_CACHE_DIR"], True)

# Reports off a terminal are 120 columns wide unless COLUMNS says otherwise
# (report/console.py); the tests read them at that width, whatever the shell exports (a
# GPU machine's had COLUMNS=80, and every wrapped row moved).
for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)


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
    a run is refused). The process is forked from the run server (``run_server.py``: torch
    already imported) unless its environment needs a fresh interpreter.
    """
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    argv = list(args)
    run_dir, n = cwd / "run", 1
    while argv and argv[0] == "run" and "--out" not in argv and run_dir.exists():
        n += 1
        run_dir = cwd / f"run-{n}"
    if argv and argv[0] == "run" and "--out" not in argv:
        argv = ["run", "--out", str(run_dir), *argv[1:]]
    # only commands that run a script import torch: the others start faster afresh
    server = (_run_server(full_env, dynamo=_dynamo_safe(argv, cwd))
              if argv and argv[0] in ("run", "rerun") else None)
    if server is not None:
        code, out, err = server.run(argv, cwd, full_env, timeout)
        return Result(code, out, err, run_dir)
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


#: Variables read as an interpreter or torch starts, or as trainprof is imported (our test
#: switch; ``TRAINPROF_PURE_PYTHON``, which picks the step clock's hot path): a request
#: whose value differs from the server's goes to a fresh interpreter.
_STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "TORCH", "CUDA", "LD_",
                     "TRAINPROF_TEST_FRESH_PYTHON", "TRAINPROF_PURE_PYTHON")
#: Variables torch sets in this (pytest's) process as it goes, and reads only when used, not
#: at import: a run given them needs no fresh interpreter. (Inductor, used in-process by a
#: test, sets its cache folder; every later run would otherwise start afresh.)
_SET_BY_TORCH = frozenset({"TORCHINDUCTOR_CACHE_DIR"})


#: Words that keep a script off the server with Dynamo already imported: it compiles, or it
#: uses ``torch.distributed`` (``run_server.py`` says why). Read loosely: a false match
#: only costs the script its Dynamo import.
_DYNAMO_SENSITIVE = ("compile", "_dynamo", "distributed", "DistributedDataParallel")


def _dynamo_safe(argv: list[str], cwd: Path) -> bool:
    """Whether the script a ``run`` request runs may start with ``torch._dynamo`` imported:
    a ``.py`` file named in ``argv`` whose text has none of ``_DYNAMO_SENSITIVE`` (not a
    module or a rerun: their code is not read here)."""
    if argv[0] != "run" or "-m" in argv:
        return False
    for arg in argv[1:]:
        path = cwd / arg
        if arg.endswith(".py") and path.is_file():
            text = path.read_text(errors="replace")
            return not any(word in text for word in _DYNAMO_SENSITIVE)
    return False


class RunServer:
    """The client end of ``run_server.py``: one request at a time, as ``subprocess.run``."""

    def __init__(self, env: dict[str, str], dynamo: bool = False) -> None:
        self.env = dict(env)
        self.sock, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("run_server.py")), str(theirs.fileno()),
             *(["--dynamo"] if dynamo else [])],
            pass_fds=(theirs.fileno(),), env=self.env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL)
        theirs.close()
        self.replies = self.sock.makefile("rb")

    def serves(self, env: dict[str, str]) -> bool:
        if self.proc.poll() is not None:
            return False
        keys = set(env) | set(self.env)
        return not any(env.get(k) != self.env.get(k) for k in keys - _SET_BY_TORCH
                       if k.startswith(_STARTUP_PREFIXES))

    def run(self, argv: list[str], cwd: Path, env: dict[str, str],
            timeout: float) -> tuple[int, str, str]:
        deadline = time.monotonic() + timeout
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        request = json.dumps({"argv": argv, "cwd": str(cwd), "env": env}).encode()
        try:
            socket.send_fds(self.sock, [request], [out_w, err_w])
        finally:
            os.close(out_w)
            os.close(err_w)
        pid = self._reply()["pid"]
        chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
        open_fds = [out_r, err_r]
        timed_out = False
        # every process that holds the pipes (the run's workers, its sampler) has closed
        # them, as subprocess.run(capture_output=True) waits for
        while open_fds:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                break
            ready, _, _ = select.select(open_fds, [], [], left)
            for fd in ready:
                data = os.read(fd, 1 << 16)
                if data:
                    chunks[fd].append(data)
                else:
                    open_fds.remove(fd)
        for fd in (out_r, err_r):
            os.close(fd)
        status = self._reply()["status"]
        # as text=True reads them: universal newlines
        out, err = (b"".join(chunks[fd]).decode(errors="replace").replace("\r\n", "\n")
                    .replace("\r", "\n") for fd in (out_r, err_r))
        if timed_out:
            # pytest shows a failed test's captured output: what the run printed says where
            print(f"--- trainprof {' '.join(argv)}: timed out after {timeout} s; its stdout:\n"
                  f"{out[-3000:]}\n--- its stderr:\n{err[-5000:]}", file=sys.stderr)
            raise subprocess.TimeoutExpired(["trainprof", *argv], timeout, out, err)
        return status, out, err

    def _reply(self) -> dict:
        line = self.replies.readline()
        if not line:
            raise RuntimeError(f"the run server ended (exit code {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        # the reader made from the socket holds it open too: both, or the server never sees
        # the end and each session's end waited out the 10 s below per server
        self.replies.close()
        self.sock.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


#: The session's run servers, started when first needed: one per Dynamo import (without,
#: with) and set of start-up variables (those ``_STARTUP_PREFIXES`` name, as a request's
#: environment has them).
_SERVERS: dict[tuple[bool, tuple[tuple[str, str], ...]], RunServer] = {}
#: Start-up environments asked for once so far: a fresh interpreter served them. A second
#: request with the same gets a server of its own (the pure-Python clock's tests, say: seven
#: runs, each otherwise paying an interpreter start and torch's import, about 3 s).
_ASKED_ONCE: set[tuple[bool, tuple[tuple[str, str], ...]]] = set()


def _startup(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items()
                        if k.startswith(_STARTUP_PREFIXES) and k not in _SET_BY_TORCH))


def _run_server(env: dict[str, str], dynamo: bool = False) -> RunServer | None:
    """A run server (``dynamo``: with ``torch._dynamo`` imported) that can run a process with
    ``env``, or None: the request goes to a fresh interpreter."""
    if os.environ.get("TRAINPROF_TEST_FRESH_PYTHON", "") not in ("", "0"):
        return None
    base = {**os.environ, "PYTHONUNBUFFERED": "1"}
    key = (dynamo, _startup(env))
    if key[1] != _startup(base):
        if key not in _SERVERS and key not in _ASKED_ONCE:
            _ASKED_ONCE.add(key)
            return None
        base = env
    server = _SERVERS.get(key)
    if server is None or server.proc.poll() is not None:
        server = _SERVERS[key] = RunServer(base, dynamo)
        atexit.register(server.close)
    return server if server.serves(env) else None


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


def as_launch_folder(run_dir: Path, launch: Path, ranks: tuple[str, ...] = ("0", "1")) -> Path:
    """A torchrun-style launch folder (no record of its own, ``ranks/<k>/``) whose ranks are
    copies of ``run_dir``, for what reads every rank of a folder."""
    for k in ranks:
        shutil.copytree(run_dir, launch / "ranks" / k)
    return launch


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
