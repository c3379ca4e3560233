"""A Python with torch already imported that forks a ``python -m trainprof ...`` per request.

Why: every ``trainprof run`` of a test script spends ~1.1 s of its ~3.3 s on ``import
torch`` (``trainprof run`` imports it before the script starts), and with some two hundred
runs in the suite that is minutes. This server pays it once; each request forks it and the
child becomes ``python -m trainprof ARGS`` in the request's folder, environment and
stdout/stderr (pipes the test holds, passed over a socket), so the run is still a separate
process with its own exit code, signals and children, running the real command-line entry
point, from the state a fresh ``trainprof run`` is in when the script starts.

Only what ``trainprof run`` itself imports before the script is imported here, and, in the
second of the two servers the client keeps (``--dynamo``), ``torch._dynamo``: the first
``torch.optim`` optimizer a script makes imports it (~1.0 s), and a child that imported it
also spends ~0.3 s more at exit freeing it, where here it is frozen in the shared heap: ~1.2 s
of a typical ~2.5 s test run. That server runs only scripts that neither compile nor use
``torch.distributed`` (the client reads the script): imported before the script, Dynamo
changes what such a script does. Dynamo once traced into trainprof's ``Module.__call__``
wrapper and recompiled when it was narrowed (fixed since, but compiled runs are tested as a
fresh ``trainprof run`` has them: trainprof installed first). And with
``torch.distributed.tensor`` (which it imports) loaded before a Gloo process group, a
two-rank DDP script deadlocked at exit in 2 of 8 runs (3 of 10 with
``torch.distributed.tensor`` alone; 4 of 8 without trainprof, Dynamo imported first:
``ProcessGroupGloo``'s destructor joins its workers holding the GIL while a worker needs it
to free a finished work): forked runs must not be where such differences come from. For
every other script, Dynamo imported before or during the script is the same module.

What a fork cannot give, the client (``conftest.trainprof``) leaves to a fresh
interpreter: a request whose environment differs from the server's in a variable read at
interpreter or torch start-up (``PYTHON*``, thread-pool and CUDA variables).
``TRAINPROF_TEST_FRESH_PYTHON=1`` sends every run to a fresh interpreter.

Protocol, over the socket given as fd ``argv[1]`` (then ``--dynamo``, optional): the client
sends one JSON request ({argv, cwd, env}) with the write ends of its stdout and stderr pipes
(SCM_RIGHTS); the server answers ``{"pid": N}`` once the child runs and ``{"status": code}``
when it ends (``-signal`` if killed, as ``subprocess`` reports it).
"""

from __future__ import annotations

import gc
import json
import os
import random
import runpy
import socket
import sys

import numpy
import torch

import trainprof.capture.hooks  # noqa: F401 - a run's own imports, once
import trainprof.cli  # noqa: F401
import trainprof.commands  # noqa: F401

del torch


def _become_the_run(request: dict, fds: list[int]) -> None:
    """In the forked child: turn into ``python -m trainprof ARGV`` and run it.

    Never returns: the command's ``SystemExit`` (or exception) goes up through the
    server's frames to the interpreter, which ends the process as it ends any Python
    program (atexit handlers, threads joined, exit code).
    """
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for target, fd in zip((1, 2), fds, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    # what a fresh interpreter would have drawn for itself
    random.seed()
    numpy.random.seed()
    sys.path[0] = os.getcwd()  # `python -m` puts the working directory first
    sys.orig_argv = [sys.executable, "-m", "trainprof", *request["argv"]]
    sys.argv = ["-m", *request["argv"]]
    runpy._run_module_as_main("trainprof", alter_argv=True)  # what `python -m` calls
    sys.exit(0)


def serve(sock: socket.socket) -> None:
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
        except (ConnectionError, OSError):
            return
        if not message:
            return  # the client closed its end: the test session is over
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:
            sock.close()
            _become_the_run(request, fds)
        for fd in fds:
            os.close(fd)
        sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        _, status = os.waitpid(pid, 0)
        sock.sendall(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode() + b"\n")


if __name__ == "__main__":
    server_socket = socket.socket(fileno=int(sys.argv[1]))
    if "--dynamo" in sys.argv[2:]:
        import torch._dynamo  # noqa: F401 - what a script's first optimizer imports
    gc.collect()
    gc.freeze()  # the imported heap stays shared with the children (no copy-on-write by GC)
    serve(server_socket)
