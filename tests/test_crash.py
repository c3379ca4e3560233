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


RAISES = """
import torch
from torch import nn

def check(step):
    if step == 80:
        raise RuntimeError("boom: simulated failure at step 80")

model = nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(200):
    loss = model(torch.randn(4, 8)).sum()
    opt.zero_grad(); loss.backward(); opt.step()
    check(step + 1)
"""


def test_an_exception_is_kept_in_the_record_and_named_by_every_report(tmp_path):
    """The traceback on the terminal is gone after the run: the record keeps the exception's
    type, message, the script's frames and the step, and each report says them first."""
    write_script(tmp_path, "train.py", RAISES)
    res = trainprof("run", "--no-html", "train.py", cwd=tmp_path)
    assert res.returncode == 1, res.stderr[-2000:]
    assert "RuntimeError: boom: simulated failure at step 80" in res.stderr  # as python prints

    meta = json.loads((res.run_dir / "run.json").read_text())
    assert meta["status"] == "crashed"
    crash = meta["crash"]
    assert crash["exception"] == "RuntimeError"
    assert crash["message"] == "boom: simulated failure at step 80"
    assert crash["site"]["file"].endswith("/train.py")
    assert (crash["site"]["line"], crash["site"]["function"]) == (7, "check")
    # the user's frames in a traceback's order, none of trainprof's or runpy's
    assert [(f[0].rsplit("/", 1)[-1], f[1], f[2]) for f in crash["frames"]][-2:] == [
        ("train.py", 14, "<module>"), ("train.py", 7, "check")], crash["frames"]
    assert not any("trainprof" in f[0] or "runpy" in f[0] for f in crash["frames"])
    assert crash["step"] == 80  # 80 steps complete: the 81st raised

    doc = trainprof("report", str(res.run_dir), "--json", cwd=tmp_path).json()
    assert doc["crash"]["exception"] == "RuntimeError" and doc["crash"]["step"] == 80
    assert doc["crash"]["message"] == "boom: simulated failure at step 80"

    text = trainprof("report", str(res.run_dir), cwd=tmp_path).stdout
    head = "RuntimeError: boom: simulated failure at step 80 at train.py:7 in check, step 80"
    assert head in text, text
    assert text.index("Crash") < text.index("Steps"), text  # near the top
    assert "train.py:14 in <module>" in text

    html_path = tmp_path / "r.html"
    trainprof("report", str(res.run_dir), "--html", str(html_path), cwd=tmp_path)
    html = html_path.read_text()
    assert f'<p class="headline">The script raised {head}' in html.replace("&lt;", "<").replace(
        "&gt;", ">"), html[:3000]
    # said before anything measured, as a fatal signal's is
    assert html.index('id="tp-crash"') < html.index('class="tiles"')


def test_profile_block_that_raises_keeps_the_exception(tmp_path):
    """The API's block: what it raised is the caller's to print or catch, and is kept in
    the record too."""
    write_script(tmp_path, "t.py", """
        import sys, torch, trainprof

        class DataError(ValueError):
            pass

        w = torch.zeros(2, requires_grad=True)
        opt = torch.optim.SGD([w], lr=0.1)
        try:
            with trainprof.profile(sys.argv[1], report=False):
                for i in range(20):
                    (w * 2).sum().backward(); opt.step(); opt.zero_grad()
                    if i == 11:
                        raise DataError("x" * 5000)
        except DataError:
            print("caught")
    """)
    res = subprocess.run([sys.executable, "t.py", "r"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "caught" in res.stdout, res.stderr[-2000:]
    meta = json.loads((tmp_path / "r" / "run.json").read_text())
    assert meta["status"] == "crashed"
    crash = meta["crash"]
    assert crash["exception"] == "DataError"  # a class of __main__: named as python does
    assert crash["message"].startswith("x" * 2000) and len(crash["message"]) < 2100
    assert crash["message"].endswith("(3,000 more characters)")
    assert (crash["site"]["line"], crash["site"]["function"]) == (14, "<module>")
    assert crash["step"] == 12


def test_keyboard_interrupt_and_exit_are_not_crashes(tmp_path):
    write_script(tmp_path, "t.py", """
        import sys, torch, trainprof
        w = torch.zeros(2, requires_grad=True)
        opt = torch.optim.SGD([w], lr=0.1)
        for out, exc in (("a", KeyboardInterrupt()), ("b", SystemExit(0))):
            try:
                with trainprof.profile(out, report=False):
                    (w * 2).sum().backward(); opt.step(); opt.zero_grad()
                    raise exc
            except BaseException:
                pass
    """)
    res = subprocess.run([sys.executable, "t.py"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    for out, status in (("a", "interrupted"), ("b", "finished")):
        meta = json.loads((tmp_path / out / "run.json").read_text())
        assert meta["status"] == status and "crash" not in meta, meta["status"]


def test_html_measure_it_says_the_trials_stop_before_the_crash():
    """The same caveat as the terminal's verify hint (report/terminal.verify_hint)."""
    from trainprof.report.html import _finding

    finding = {"title": "t", "verify": "trainprof tune --knob float32=false,true t.py"}
    assert ("(its knob on this script, against its estimate; the run crashed after 50 steps: "
            "its trials stop before that)") in _finding(1, finding, "R", 50)
    assert "crashed" not in _finding(1, finding, "R")
