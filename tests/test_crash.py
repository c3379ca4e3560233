"""A run that dies of a fatal signal: the record names the signal and where it happened.

Real segfaults (``ctypes.string_at(0)``) in real training loops under ``trainprof run``;
faulthandler's dump goes to ``RUN_DIR/faulthandler.log`` (trainprof.capture.fault_log)
and is read back with the record (trainprof.fault_dump, trainprof.analysis.crash).
"""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import trainprof, write_script

SEGFAULT = """
import ctypes, time, torch
from torch import nn

def corrupt():
    ctypes.string_at(0)   # a bad pointer in an extension: SIGSEGV

model = nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
t0 = time.monotonic()
step = 0
while True:
    loss = model(torch.randn(4, 8)).sum()
    opt.zero_grad(); loss.backward(); opt.step()
    step += 1
    time.sleep(0.01)
    if time.monotonic() - t0 > 1.5:   # the steps reach the disk (flushed once a second)
        corrupt()
"""


def test_a_segfault_is_named_with_the_scripts_frames(tmp_path):
    write_script(tmp_path, "train.py", SEGFAULT)
    res = trainprof("run", "train.py", cwd=tmp_path)
    assert res.returncode in (-11, 139), (res.returncode, res.stderr[-2000:])
    # stderr as plain python leaves it: no dump unless the user asked for faulthandler
    assert "Fatal Python error" not in res.stderr
    assert (res.run_dir / "faulthandler.log").stat().st_size > 0

    doc = trainprof("report", str(res.run_dir), "--json", cwd=tmp_path).json()
    assert doc["status"] == "crashed"
    crash = doc["crash"]
    assert crash["signal"] == "SIGSEGV" and crash["message"] == "Segmentation fault"
    # the user's frames, outermost first, no trainprof or runpy frame among them (the
    # tests' run server, which forks the run, is the only one above the script's)
    frames = [(f[0].rsplit("/", 1)[-1], f[1], f[2]) for f in crash["frames"]]
    assert frames[-3:-1] == [("train.py", 18, "<module>"), ("train.py", 6, "corrupt")], frames
    assert frames[-1][2] == "string_at", frames
    assert not any("trainprof" in f[0] or "runpy" in f[0] for f in crash["frames"]), frames
    assert any("died of SIGSEGV" in n for n in doc["notes"]), doc["notes"]
    assert doc["steps"]["count"] >= 20  # what was flushed before is kept

    text = trainprof("report", str(res.run_dir), cwd=tmp_path).stdout
    assert "SIGSEGV (Segmentation fault)" in text
    assert "train.py:6 in corrupt" in text and "train.py:18 in <module>" in text
    # the HTML report opens with it too
    html = trainprof("report", str(res.run_dir), "--html", str(tmp_path / "r.html"),
                     cwd=tmp_path)
    assert html.returncode == 0, html.stderr
    page = (tmp_path / "r.html").read_text()
    assert '<p class="headline">The process died of SIGSEGV (Segmentation fault)' in page
    assert "train.py:6 in corrupt" in page


def test_a_users_faulthandler_keeps_its_stderr_dump(tmp_path):
    """`PYTHONFAULTHANDLER=1` (as `python -X faulthandler`) asked for the dump on stderr:
    the user keeps it; the record says the traceback is not in it."""
    write_script(tmp_path, "train.py", SEGFAULT)
    res = trainprof("run", "train.py", cwd=tmp_path, env={"PYTHONFAULTHANDLER": "1"})
    assert res.returncode in (-11, 139), (res.returncode, res.stderr[-2000:])
    assert "Fatal Python error: Segmentation fault" in res.stderr
    assert 'train.py", line 6 in corrupt' in res.stderr
    assert not (res.run_dir / "faulthandler.log").exists()
    meta = json.loads((res.run_dir / "run.json").read_text())
    assert any("faulthandler was enabled by the user" in m for m in meta["missing"])


def test_profile_hands_faulthandler_back_and_leaves_no_empty_log(tmp_path):
    """In a process that goes on (a notebook), the handler and its file are the record's
    only while it records; a script's own faulthandler.enable() is left as it set it."""
    write_script(tmp_path, "t.py", """
        import faulthandler, sys, torch, trainprof
        w = torch.zeros(2, requires_grad=True)
        opt = torch.optim.SGD([w], lr=0.1)
        with trainprof.profile(sys.argv[1], report=False):
            inside = faulthandler.is_enabled()
            for _ in range(3):
                (w * 2).sum().backward(); opt.step(); opt.zero_grad()
        after = faulthandler.is_enabled()
        with trainprof.profile(sys.argv[2], report=False):
            faulthandler.enable(file=sys.stdout)   # the script's own choice
        print(inside, after, faulthandler.is_enabled())
    """)
    res = subprocess.run([sys.executable, "t.py", "r1", "r2"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split()[-3:] == ["True", "False", "True"], res.stdout
    assert not (tmp_path / "r1" / "faulthandler.log").exists()
    assert (tmp_path / "r1" / "run.json").exists()
