"""The test run server stands for a fresh ``python -m trainprof``: its own process, the
request's folder, environment and output, the exit code, the timeout of subprocess.run."""

from __future__ import annotations

import json
import os
import subprocess
import time

import psutil
import pytest
from conftest import trainprof, write_script

SCRIPT = """
    import os, sys
    print("argv", sys.argv)
    print("cwd", os.getcwd())
    print("parent", os.getppid())
    print("x", os.environ.get("X"))
    print("to stderr", file=sys.stderr)
    sys.exit(int(os.environ.get("CODE", "0")))
"""


def _value(res, key: str) -> str:
    return next(line for line in res.stdout.splitlines() if line.startswith(key + " "))[
        len(key) + 1:]


def test_a_forked_run_is_the_command_in_its_folder_with_its_environment(tmp_path):
    write_script(tmp_path, "train.py", SCRIPT)
    res = trainprof("run", "--no-html", "train.py", "--lr", "0.1", cwd=tmp_path,
                    env={"X": "forked", "CODE": "3"})
    assert res.returncode == 3, res.stderr
    assert _value(res, "argv") == "['train.py', '--lr', '0.1']"
    assert _value(res, "cwd") == str(tmp_path) and _value(res, "x") == "forked"
    # forked from the server with Dynamo imported (no Dynamo-sensitive word), not by pytest
    assert _server_args(int(_value(res, "parent"))) == ["--dynamo"]
    assert "to stderr" in res.stderr
    meta = json.loads((res.run_dir / "run.json").read_text())
    assert meta["status"] == "finished" and meta["exit_code"] == 3


def _server_args(pid: int) -> list[str] | None:
    """The arguments after the socket of the run server ``pid`` (None: not a run server)."""
    cmdline = psutil.Process(pid).cmdline()
    if len(cmdline) < 3 or not cmdline[1].endswith("run_server.py"):
        return None
    return cmdline[3:]


def test_a_start_up_variable_gets_a_fresh_interpreter_then_a_server_of_its_own(tmp_path):
    """Asked for once, a start-up variable's value gets a fresh interpreter; asked for again,
    a run server started with it, which serves every later request that has it."""
    write_script(tmp_path, "train.py", SCRIPT)
    # a "TORCH" variable counts as a start-up one; torch reads none of this name, and its
    # value is this test's own: no other test's requests share it
    env = {"TORCH_TRAINPROF_TEST_CASE": str(time.monotonic_ns())}
    parents = []
    for _ in range(3):
        res = trainprof("run", "--no-html", "train.py", cwd=tmp_path, env=env)
        assert res.returncode == 0, res.stderr
        parents.append(int(_value(res, "parent")))
    assert parents[0] == os.getpid()
    assert parents[1] == parents[2] != os.getpid()
    assert _server_args(parents[1]) == ["--dynamo"]  # (a run server; the script may have it)
    assert (psutil.Process(parents[1]).environ()["TORCH_TRAINPROF_TEST_CASE"]
            == env["TORCH_TRAINPROF_TEST_CASE"])


def test_a_run_past_its_timeout_is_killed_as_subprocess_run_kills(tmp_path):
    write_script(tmp_path, "train.py", """
        import os, time
        print("pid", os.getpid(), flush=True)
        time.sleep(60)
    """)
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as info:
        trainprof("run", "--no-html", "train.py", cwd=tmp_path, timeout=3)
    assert time.monotonic() - t0 < 20
    pid = int(next(line for line in info.value.output.splitlines()
                   if line.startswith("pid")).split()[1])
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    # the server goes on serving
    write_script(tmp_path, "ok.py", SCRIPT)
    assert trainprof("run", "--no-html", "--out", str(tmp_path / "ok"), "ok.py",
                     cwd=tmp_path).returncode == 0
