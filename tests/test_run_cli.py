"""`trainprof run` on real tiny training scripts, in subprocesses, asserting numbers."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from conftest import sampler_children, trainprof, write_script

from trainprof.analysis.system import load_samples
from trainprof.schema import FLAG_PROFILED
from trainprof.store import load_run

SLEEPY = """
import json, sys, time
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

torch.set_num_threads(1)  # tiny ops: no thread pool to wait on when the machine is busy

class Sleepy(Dataset):
    def __len__(self):
        return 10_000
    def __getitem__(self, i):
        time.sleep(0.002)          # 2 ms per sample, like remote storage
        return torch.randn(8), i % 2

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 2)
    def forward(self, x):
        time.sleep(0.004)          # 4 ms of "compute"
        return self.lin(x)

model = Net()
loss_fn = nn.CrossEntropyLoss()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
it = iter(DataLoader(Sleepy(), batch_size=4))
per_step = []
for step in range(40):
    a = time.perf_counter(); x, y = next(it); b = time.perf_counter()
    loss = loss_fn(model(x), y)
    c = time.perf_counter()
    opt.zero_grad(); loss.backward(); opt.step()
    per_step.append((b - a, c - b, time.perf_counter() - a))
print(json.dumps({"truth": per_step}), file=sys.stderr)
"""


def _truth(stderr: str) -> np.ndarray:
    """The script's own per-step timing: (data, forward, step) in seconds."""
    line = [ln for ln in stderr.splitlines() if ln.startswith('{"truth"')][-1]
    return np.array(json.loads(line)["truth"])


def test_data_wait_share_matches_truth(tp):
    res = tp(SLEEPY, "--json")
    assert res.returncode == 0, res.stderr
    doc = res.json()
    assert doc["status"] == "finished" and doc["exit_code"] == 0
    assert doc["steps"]["count"] == 40
    assert doc["steps"]["delimiter"] == "optimizer"
    warm = doc["steps"]["warmup"]
    assert warm <= 3
    truth = _truth(res.stderr)[warm:]
    b = doc["breakdown"]
    assert abs(sum(b.values()) - 1) < 1e-9
    assert set(b) == {"data_wait", "forward", "backward", "optimizer", "gc", "other"}
    # time-weighted share over the same steady steps, within 3 points
    assert abs(b["data_wait"] - truth[:, 0].sum() / truth[:, 2].sum()) < 0.03, (b, truth)
    # per step: the median step's data wait and forward within 0.3 ms of the truth
    steps = load_run(res.run_dir).steps[warm:]
    for field, col in (("data_wait_ns", 0), ("forward_ns", 1), ("dur_ns", 2)):
        ours = np.median(steps[field]) / 1e9
        assert abs(ours - np.median(truth[:, col])) < 3e-4, (field, ours, truth[:, col])
    assert b["data_wait"] > b["forward"] > b["optimizer"]  # 8 ms of sleep vs 4 ms vs ~0
    # 4 samples per step, ~12 ms per step
    assert 0.010 < doc["steps"]["median_s"] < 0.030
    assert abs(doc["samples_per_s"] - 4 / doc["steps"]["mean_s"]) < 1e-6 * doc["samples_per_s"]
    assert doc["dataloaders"][0]["batch_size"] == 4
    assert doc["dataloaders"][0]["num_workers"] == 0
    assert doc["dataloaders"][0]["dataset"].endswith("Sleepy")
    top = doc["findings"][0]  # 2/3 of each step waiting on a num_workers=0 loader
    assert (top["category"], top["cause"], top["severity"]) == (
        "input_pipeline", "too_few_workers", "high")
    assert Path(doc["run_dir"]) == res.run_dir


def test_a_loader_given_a_batch_sampler_is_described_by_it(tp, tmp_path):
    """Hugging Face's Trainer (through accelerate) hands DataLoader a batch_sampler: the
    loader's batch_size is None and its sampler a default SequentialSampler, while the
    batches come from the batch_sampler (16 here) and the shuffling from its sampler."""
    body = """
    import torch
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset
    data = TensorDataset(torch.randn(100, 4))
    loader = DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data), 16, False))
    w = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    for (x,) in loader:
        (w * x).sum().backward(); opt.step(); opt.zero_grad()
    """
    res = tp(body, "--json")
    assert res.returncode == 0, res.stderr
    dl = res.json()["dataloaders"][0]
    assert dl["batch_size"] is None  # the loader's own attribute, as the script set it
    assert dl["batch_sampler_batch_size"] == 16 and dl["batches"] == 7  # 100 = 6 x 16 + 4
    assert dl["batch_sampler_sampler"] == "torch.utils.data.sampler.RandomSampler"
    assert res.json()["samples_per_s"] > 0
    text = trainprof("report", str(res.run_dir), cwd=tmp_path).stdout
    assert "TensorDataset(len=100), batch_size=16 (its batch_sampler BatchSampler)" in text


def test_a_loader_that_a_trainer_iterates_is_marked_as_its(tp):
    """Hugging Face's Trainer builds and iterates its loaders itself: the record says so
    (its fixes then name TrainingArguments). The loop's module is on the stack when the
    loader's first iterator is made; here a stand-in module of that name runs it."""
    body = """
    import types, torch
    from torch.utils.data import DataLoader, TensorDataset
    LOOP = '''
    def train(loader, w, opt):
        for (x,) in loader:
            (w * x).sum().backward(); opt.step(); opt.zero_grad()
    '''
    trainer = types.ModuleType("transformers.trainer")
    exec(LOOP, trainer.__dict__)
    w = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    trainer.train(DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=8), w, opt)
    for (x,) in DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=8):  # the script's
        pass
    """
    res = tp(body, "--json")
    assert res.returncode == 0, res.stderr
    loaders = res.json()["dataloaders"]
    assert loaders[0]["driven_by"] == "transformers.Trainer"
    assert "driven_by" not in loaders[1]


def test_loaders_made_anew_each_epoch_are_one_and_a_new_one_at_a_freed_address_is_new(tp):
    """A loader per epoch with the same settings is one loader; an evaluation loader made
    after the last training one is gone (often at the freed object's address) is another."""
    body = """
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    train, val = TensorDataset(torch.randn(64, 4)), TensorDataset(torch.randn(24, 4))
    w = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    for epoch in range(3):
        for (x,) in DataLoader(train, batch_size=8, shuffle=True):
            (w * x).sum().backward(); opt.step(); opt.zero_grad()
        with torch.no_grad():
            for (x,) in DataLoader(val, batch_size=12):
                (w * x).sum()
    """
    res = tp(body, "--json")
    assert res.returncode == 0, res.stderr
    loaders = res.json()["dataloaders"]
    assert [(d["index"], d["len"], d["batch_size"]) for d in loaders] == [(0, 64, 8),
                                                                         (1, 24, 12)]


def test_a_stale_address_does_not_pass_for_the_loader_that_lived_there():
    import weakref

    from torch.utils.data import DataLoader

    from trainprof.capture.hooks import LoaderRegistry

    registry = LoaderRegistry(lambda index, config: None)
    old = DataLoader(list(range(10)), batch_size=2)
    new = DataLoader(list(range(30)), batch_size=5)
    assert registry.index_of(old) == 0 and registry.index_of(old) == 0
    # as if `new` had been made where `old` was freed: its id maps to another loader
    registry._ids[id(new)] = (weakref.ref(old), 0)
    assert registry.index_of(new) == 1 and registry.index_of(new) == 1
    assert [c["len"] for c in registry.configs] == [10, 30]
    again = DataLoader(list(range(10)), batch_size=2)  # the first one's settings: the same
    assert registry.index_of(again) == 0 and len(registry.configs) == 2


def test_a_module_that_runs_itself_again_is_recorded_as_a_rank(tmp_path):
    """PyTorch Lightning's DDP launcher starts ranks 1.. as `python -m <module> <args>`
    (or `python <script> <args>`) with LOCAL_RANK set. They run under `trainprof run` with
    this run's options, into ranks/<LOCAL_RANK>; other subprocesses (a plain `python -c`)
    are no rerun. (The DDP case, merged: tests/test_ranks.py.)"""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    write_script(pkg, "train.py", """
    import os, subprocess, sys
    import torch
    if "LOCAL_RANK" not in os.environ:
        env = {**os.environ, "LOCAL_RANK": "1"}
        child = subprocess.Popen([sys.executable, "-m", __spec__.name] + sys.argv[1:], env=env)
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    w = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([w], lr=float(sys.argv[2]))
    for _ in range(1000):
        (w * 2).sum().backward(); opt.step(); opt.zero_grad()
    if "LOCAL_RANK" not in os.environ:
        assert child.wait() == 0
    """)
    res = trainprof("run", "--json", "--max-steps", "12", "-m", "pkg.train", "--lr", "0.1",
                    cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    doc = res.json()
    assert [(r["label"], r["steps"]) for r in doc["ranks"]] == [("0", 12), ("1", 12)]
    notes = [n for n in doc["notes"] if "ran itself again" in n]
    assert notes == [
        "the script ran itself again in 1 process (LOCAL_RANK 1), as PyTorch Lightning's DDP "
        "launcher does: each recorded in ranks/<k>/ of this run (k = 1); this process is "
        "rank 0, the figures above are its own"]
    rank1 = json.loads((res.run_dir / "ranks" / "1" / "run.json").read_text())
    assert rank1["command"][1:] == ["-m", "pkg.train", "--lr", "0.1"]
    assert rank1["steps_recorded"] == 12  # --max-steps reached the rank too
    assert sorted(p.name for p in (res.run_dir / "ranks").iterdir()) == ["1"]


#: Five optimizer steps of a one-tensor model (torch imported by the body before it).
FIVE_STEPS = """
w = torch.zeros(3, requires_grad=True)
opt = torch.optim.SGD([w], lr=0.1)
for _ in range(5):
    (w * 2).sum().backward(); opt.step(); opt.zero_grad()
"""


def test_json_stdout_is_only_json_and_script_output_goes_to_stderr(tp):
    body = textwrap.dedent("""
    import os, torch
    print("hello from the script")
    os.system("echo from a child process")
    """) + FIVE_STEPS
    res = tp(body, "--json")
    assert res.returncode == 0, res.stderr
    json.loads(res.stdout)  # nothing else on stdout
    assert "hello from the script" in res.stderr
    assert "from a child process" in res.stderr


def test_json_stdout_stays_one_document_when_the_script_prints_at_exit(tp):
    """atexit handlers, a __del__ at shutdown and a thread still printing all run after the
    script's last line (and after the document): their output goes to stderr too."""
    body = textwrap.dedent("""
    import atexit, threading, time, torch

    class Tidy:
        def __del__(self):
            print("__del__ at shutdown")

    tidy = Tidy()
    atexit.register(lambda: print("atexit handler"))
    threading.Thread(target=lambda: (time.sleep(0.5), print("late thread"))).start()
    """) + FIVE_STEPS
    res = tp(body, "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["steps"]["count"] == 5  # one document, nothing after it
    for line in ("atexit handler", "__del__ at shutdown", "late thread"):
        assert line in res.stderr, line


def test_a_thread_left_training_after_the_script_returns_is_measured(tp):
    """python waits for the threads that are not daemons before it exits, and so does the
    record; an idle thread pool's workers (ended by the interpreter's shutdown hooks) are not
    waited for."""
    body = """
    import threading, time, torch
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(2)  # never shut down: its idle workers must not hang the run
    assert pool.submit(lambda: 1).result() == 1

    def train():
        w = torch.zeros(4, requires_grad=True)
        opt = torch.optim.SGD([w], lr=0.1)
        for _ in range(40):
            (w * torch.randn(4)).sum().backward(); opt.step(); opt.zero_grad()
            time.sleep(0.002)
        print("thread done", flush=True)

    threading.Thread(target=train).start()
    print("script returned", flush=True)
    """
    res = tp(body, "--json", timeout=60)
    assert res.returncode == 0, res.stderr
    # (a thread's first step is its first optimizer step's end: the clock learns then
    # which thread trains)
    assert res.json()["steps"]["count"] == 39
    assert res.stderr.index("script returned") < res.stderr.index("thread done")


def test_a_script_that_stops_at_its_arguments_gets_one_line(tp):
    """``trainprof run train.py --help`` (or a mistyped option): the script's own help or
    usage error, its exit code, and one line from trainprof instead of a summary."""
    body = """
    import argparse, torch
    parser = argparse.ArgumentParser(description="toy trainer")
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()
    model = torch.nn.Linear(4, 1)
    """
    res = tp(body, args=("--help",))
    assert res.returncode == 0 and res.stdout.startswith("usage: train.py [-h] [--lr LR]")
    assert "Steps" not in res.stdout and "nothing to measure" in res.stderr
    res = tp(body, args=("--bogus",))
    assert res.returncode == 2 and res.stdout == ""
    assert "train.py: error: unrecognized arguments: --bogus" in res.stderr
    assert "the script ended (finished, exit 2) before any" in res.stderr


def test_script_sees_its_own_argv_main_and_cwd(tmp_path):
    (tmp_path / "sub").mkdir()
    write_script(tmp_path / "sub", "helper_mod.py", "VALUE = 42\n")
    write_script(
        tmp_path / "sub",
        "train.py",
        """
        import json, os, sys
        import helper_mod   # importable because sys.path[0] is the script's folder
        print(json.dumps({"argv": sys.argv, "name": __name__, "cwd": os.getcwd(),
                          "value": helper_mod.VALUE}))
        """,
    )
    # --json after the script belongs to the script, so this is plain mode: stdout is the script's
    res = trainprof("run", "sub/train.py", "--lr", "0.1", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    seen = json.loads(res.stdout.splitlines()[0])
    assert seen == {"argv": ["sub/train.py", "--lr", "0.1", "--json"], "name": "__main__",
                    "cwd": str(tmp_path), "value": 42}
    # nothing trainprof times ran: one line on stderr, no summary under the script's output
    assert len(res.stdout.splitlines()) == 1 and "Steps" not in res.stdout
    assert "trainprof: nothing to measure: the script ended (finished, exit 0)" in res.stderr
    assert not (tmp_path / "run" / "report.html").exists()
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "finished"
    # trainprof's own --json: the script's stdout moves to stderr
    res = trainprof("run", "--json", "--out", "run2", "sub/train.py", "x", cwd=tmp_path)
    assert json.loads(res.stderr.splitlines()[1])["argv"] == ["sub/train.py", "x"]
    assert res.json()["steps"]["count"] == 0


def test_module_mode(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    write_script(
        pkg,
        "train.py",
        """
        import sys, torch
        print("argv", sys.argv[1:], __name__)
        w = torch.zeros(2, requires_grad=True)
        opt = torch.optim.Adam([w])
        for _ in range(7):
            w.sum().backward(); opt.step()
        """,
    )
    res = trainprof("run", "--json", "-m", "pkg.train", "--epochs", "1", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "argv ['--epochs', '1'] __main__" in res.stderr
    assert res.json()["steps"]["count"] == 7
    # the `trainprof` command (the README's), whose own sys.path[0] is its bin folder,
    # finds the package in the current directory as `python -m` does
    console = Path(sys.executable).with_name("trainprof")
    if not console.exists():
        pytest.skip("no trainprof console script beside this Python")
    proc = subprocess.run([str(console), "run", "--out", "console", "-m", "pkg.train"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "argv [] __main__" in proc.stdout


def test_a_script_that_changes_directory_keeps_its_record_where_out_said(tmp_path):
    """Hydra (older versions, by default) and many scripts os.chdir() into an output
    folder: a relative --out (or profile(out=...)) still means where trainprof started."""
    (tmp_path / "outputs").mkdir()
    write_script(tmp_path, "train.py", """
        import os, torch
        os.chdir("outputs")
        w = torch.zeros(2, requires_grad=True)
        opt = torch.optim.SGD([w], lr=0.1)
        for _ in range(30):
            w.sum().backward(); opt.step()
    """)
    res = trainprof("run", "--json", "--out", "rel", "--deep", "train.py", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    doc = res.json()
    assert doc["run_dir"] == str(tmp_path / "rel") and doc["steps"]["count"] == 30
    assert json.loads((tmp_path / "rel" / "run.json").read_text())["status"] == "finished"
    assert list((tmp_path / "rel" / "deep").glob("*.json*"))  # the window's trace too
    assert not list((tmp_path / "outputs").iterdir())
    write_script(tmp_path, "api.py", """
        import os, torch, trainprof
        w = torch.zeros(2, requires_grad=True)
        opt = torch.optim.SGD([w], lr=0.1)
        with trainprof.profile(out="api-run", html=False):
            os.chdir("outputs")
            for _ in range(12):
                w.sum().backward(); opt.step()
    """)
    proc = subprocess.run([sys.executable, "api.py"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert load_run(tmp_path / "api-run").status == "finished"
    assert not list((tmp_path / "outputs").iterdir())


def test_the_script_starts_with_no_garbage_collection_pending(tp):
    """torch and trainprof were imported before the script: no full collection may be left
    due (it would run in every forked DataLoader worker over the inherited heap)."""
    res = tp("import gc\nprint('gc counts', gc.get_count()[1:])\n")
    assert res.returncode == 0, res.stderr
    assert "gc counts (0, 0)" in res.stdout, res.stdout


def test_a_script_that_does_not_compile_fails_as_python_says(tmp_path):
    """A syntax error is printed exactly as `python x.py` prints it: no trainprof frame,
    no traceback at all (there is no frame of the script yet); exit 1, a crashed record."""
    (tmp_path / "bad.py").write_text("import torch\n\ndef f():\n    return (1,\n")
    python = subprocess.run([sys.executable, "bad.py"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60)
    assert python.returncode == 1 and "SyntaxError" in python.stderr
    res = trainprof("run", "bad.py", cwd=tmp_path)
    assert res.returncode == 1
    assert python.stderr in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert json.loads((res.run_dir / "run.json").read_text())["status"] == "crashed"


def test_crash_keeps_a_crashed_record_and_prints_python_traceback(tp):
    body = """
    import torch
    w = torch.zeros(2, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    def explode():
        raise ValueError("boom at step 5")
    for step in range(10):
        w.sum().backward(); opt.step()
        if step == 4:
            explode()
    """
    res = tp(body)
    assert res.returncode == 1
    tb = res.stderr[res.stderr.index("Traceback"):]
    assert "trainprof" not in tb.split("ValueError")[0]  # only the user's frames
    assert 'File "' in tb and "train.py" in tb and "in explode" in tb
    assert "ValueError: boom at step 5" in tb
    assert "runpy" not in tb and tb.count("ValueError: boom at step 5") == 1
    assert f'File "{res.run_dir.parent / "train.py"}", line 10, in <module>' in tb
    meta = json.loads((res.run_dir / "run.json").read_text())
    assert meta["status"] == "crashed" and meta["exit_code"] == 1
    assert meta["summary"]["steps"]["count"] == 5
    rep = trainprof("report", str(res.run_dir), "--json", cwd=res.run_dir.parent)
    assert rep.returncode == 0 and rep.json()["status"] == "crashed"


WARNS = """
import re, warnings
from warnings import warn  # bound before any patching of the module's attribute
warnings.warn("module level", stacklevel=2)
def deprecated():
    warnings.warn("function level", stacklevel=2)
def helper():
    warn("helper past the script", stacklevel=3)
deprecated()
helper()
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    warnings.warn("recorded", stacklevel=2)
print(f"recorded at {seen[0].filename}:{seen[0].lineno}")
"""


def _warning_locations(stderr: str) -> list[str]:
    """``filename:lineno: Category: message`` of each warning printed, and the recorded one."""
    return re.findall(r"^([^:\n]+:\d+: \w+Warning: .*|recorded at .+)$", stderr, re.MULTILINE)


def test_a_warning_past_the_script_reads_sys_1_as_under_python(tmp_path):
    """Under python the script's module frame is the bottom of the stack: a warning whose
    stacklevel walks past it reads ``sys:1``; under trainprof it had read the launcher's
    ``exec`` line (``.../capture/launcher.py:245``), the CLI's or runpy's."""
    script = write_script(tmp_path, "train.py", WARNS)
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    write_script(pkg, "train.py", WARNS)
    plain = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=60)
    expected = _warning_locations(plain.stderr + plain.stdout)
    assert expected == ["sys:1: UserWarning: module level",
                        f"{script}:9: UserWarning: function level",
                        "sys:1: UserWarning: helper past the script",
                        "recorded at sys:1"]
    res = trainprof("run", "train.py", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert _warning_locations(res.stderr + res.stdout) == expected
    # -m: python runs the module from runpy's frames (`_run_module_as_main`, `_run_code`),
    # trainprof from runpy.run_module's: the same `_run_code` line over the module's frame
    plain = subprocess.run([sys.executable, "-m", "pkg.train"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    expected = _warning_locations(plain.stderr)[:2]
    assert expected == ["<frozen runpy>:88: UserWarning: module level",
                        f"{pkg / 'train.py'}:9: UserWarning: function level"]
    module = trainprof("run", "-m", "pkg.train", cwd=tmp_path)
    assert module.returncode == 0, module.stderr
    assert _warning_locations(module.stderr)[:2] == expected


ATEXIT_SAVE = """
import atexit, os, sys, torch
from pathlib import Path
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x):
        return self.lin(x)

model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
print("CONFIG", (Path(__file__).parent / "config.txt").read_text().strip(), flush=True)
atexit.register(lambda: (torch.save(model, "final.pt"), print("ATEXIT", sys.argv, flush=True)))
"""


def test_the_scripts_globals_and_file_are_pythons(tmp_path):
    """``./train.py``'s ``__file__`` keeps its ``./`` as under python (a Path had dropped
    it), and the script's globals are python's, ``__annotations__`` included."""
    write_script(tmp_path, "g.py", """
        print("GLOBALS", sorted(k for k in globals()))
        print("FILE", __file__)
        """)
    plain = subprocess.run([sys.executable, "./g.py"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=120)
    res = trainprof("run", "--no-html", "./g.py", cwd=tmp_path)
    assert res.returncode == plain.returncode == 0, res.stderr
    ours = [ln for ln in res.stdout.splitlines() if ln.startswith(("GLOBALS", "FILE"))]
    assert ours == plain.stdout.splitlines(), (ours, plain.stdout)
    assert plain.stdout.splitlines()[1].endswith("/./g.py")


def test_the_script_keeps_its_file_path_and_its_main_for_its_atexit_handlers(tmp_path):
    """A symlinked exp1/train.py reads exp1/config.txt, as under python (the link had been
    resolved: the target's config read, outputs written beside it); an atexit handler that
    saves a model of the script's class pickles it by __main__ with the script's argv
    (trainprof had put its own back: a corrupt checkpoint and trainprof's argv)."""
    shared, exp = tmp_path / "shared", tmp_path / "exp1"
    shared.mkdir()
    exp.mkdir()
    (shared / "train.py").write_text(ATEXIT_SAVE)
    (shared / "config.txt").write_text("shared")
    (exp / "config.txt").write_text("exp1")
    (exp / "train.py").symlink_to(shared / "train.py")
    plain = subprocess.run([sys.executable, "train.py", "a"], cwd=exp, capture_output=True,
                           text=True, timeout=120)
    res = trainprof("run", "--no-html", "train.py", "a", cwd=exp)
    assert res.returncode == plain.returncode == 0, res.stderr
    for out in (plain.stdout, res.stdout):
        assert "CONFIG exp1" in out and "ATEXIT ['train.py', 'a']" in out
    assert "Exception ignored" not in res.stderr
    assert torch_load_ok(exp / "final.pt")


def torch_load_ok(path: Path) -> bool:
    """A whole torch.save archive: its pickle written (the failed one stopped before it)."""
    import zipfile

    return zipfile.is_zipfile(path) and any(
        n.endswith("/data.pkl") for n in zipfile.ZipFile(path).namelist())


def test_a_zipapp_runs_as_under_python(tmp_path):
    import zipfile

    with zipfile.ZipFile(tmp_path / "app.pyz", "w") as z:
        z.writestr("__main__.py", "import sys\nprint('ZIPAPP', sys.argv[1:])\n")
    res = trainprof("run", "--no-html", "app.pyz", "x", cwd=tmp_path)
    assert "ZIPAPP ['x']" in res.stdout, res.stderr


def test_a_shell_loop_stops_on_ctrl_c_as_it_does_under_python(tmp_path):
    """`for lr in 1 2 3; do trainprof run train.py; done`: bash starts the next run unless its
    child died of SIGINT; an exit with 130 had let a Ctrl-C'd sweep go on."""
    write_script(tmp_path, "train.py", """
import time, torch
w = torch.zeros(4, requires_grad=True)
opt = torch.optim.SGD([w], lr=0.1)
print("START", flush=True)
for step in range(10**9):
    (w * torch.randn(4)).sum().backward(); opt.step(); opt.zero_grad()
    time.sleep(0.01)
""")
    loop = (f"for lr in 1 2 3; do {sys.executable} -m trainprof run --no-html train.py; "
            "echo NEXT; done")
    proc = subprocess.Popen(["bash", "-c", loop], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = ""
        while "START" not in line:
            line = proc.stdout.readline()
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole process group
        out, err = proc.communicate(timeout=30)
    finally:  # a loop that went on must not outlive the test
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert "NEXT" not in out and out.count("START") == 0, out  # (the first was read above)
    assert proc.returncode != 0


GARBAGE_SETUP = """
import gc, time, torch
gc.set_threshold(10)  # a set-up that makes cyclic garbage: collections back to back
print("READY", flush=True)
t0 = time.monotonic()
while time.monotonic() - t0 < 8:
    for _ in range(1000):
        a = []; a.append(a)
w = torch.zeros(4, requires_grad=True)
opt = torch.optim.SGD([w], lr=0.1)
for step in range(100):
    (w * torch.randn(4)).sum().backward(); opt.step(); opt.zero_grad()
print("TRAINED", flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_garbage_collection_is_not_lost(tmp_path, sig):
    """A signal whose handler ran as trainprof's gc callback began was an exception CPython
    ignores there: Ctrl-C was lost (the script trained on to exit 0), SIGTERM held."""
    proc, run_dir = _start(tmp_path, GARBAGE_SETUP)
    time.sleep(1.0)
    began = time.monotonic()
    proc.send_signal(sig)
    out, err = _finish(proc, timeout=60)
    assert time.monotonic() - began < 4, err  # not the 8 s of set-up
    assert "TRAINED" not in out and "Exception ignored" not in err, err
    assert proc.returncode == -sig, err  # died of the signal, as python


def test_a_script_that_execs_itself_closes_its_record_first(tp):
    """os.execv replaces the process: the record had stayed "running", read as a crash."""
    res = tp("""
    import os, sys, torch
    w = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    for _ in range(12):
        (w * torch.randn(4)).sum().backward(); opt.step(); opt.zero_grad()
    if len(sys.argv) < 2:
        os.execv(sys.executable, [sys.executable, __file__, "again"])
    print("AGAIN", sys.argv[1:], flush=True)
    """, "--no-html")
    assert res.returncode == 0, res.stderr
    assert "AGAIN ['again']" in res.stdout and "Steps        12" in res.stdout
    assert "the script replaced itself with" in res.stderr
    meta = json.loads((res.run_dir / "run.json").read_text())
    assert (meta["status"], meta["exit_code"]) == ("finished", 0)


def test_sys_exit_code_is_passed_through(tp):
    res = tp("import sys\nsys.exit(3)\n")
    assert res.returncode == 3
    assert json.loads((res.run_dir / "run.json").read_text())["exit_code"] == 3
    res = tp("import sys\nsys.exit('bad config')\n")
    assert res.returncode == 1 and "bad config" in res.stderr
    # recorded as the operating system sees the status: 8 bits, True is 1
    for code, status in (("True", 1), ("256", 0), ("-1", 255)):
        res = tp(f"import sys\nsys.exit({code})\n")
        assert res.returncode == status, code
        assert json.loads((res.run_dir / "run.json").read_text())["exit_code"] == status


OS_EXIT = """
import os, sys
import torch
from torch.utils.data import DataLoader, TensorDataset

w = torch.zeros(4, requires_grad=True)
opt = torch.optim.SGD([w], lr=0.1)
# two epochs of two forked workers each: they end through os._exit as well, with
# the training process's os._exit inherited, and must not touch its record
loader = DataLoader(TensorDataset(torch.randn(48, 4)), batch_size=4, num_workers=2)
for epoch in range(2):
    for (x,) in loader:
        (w * x).sum().backward()
        opt.step()
        opt.zero_grad()
try:
    sys.stdout.flush()
    os._exit(int(sys.argv[1]))  # skip a shutdown that hangs (workers, NCCL, ...)
finally:
    print("finally ran")  # it does not: os._exit runs no cleanup, under trainprof neither
"""


@pytest.mark.parametrize("json_out", [False, True])
def test_os_exit_closes_the_record_and_prints_the_summary_first(tp, json_out):
    """``os._exit(n)`` ends the process at once: no ``finally``, no atexit. The record was
    left "running" with no summary printed; now it is closed and summarised first, and
    the process exits with n, running no more of the script than Python would."""
    res = tp(OS_EXIT, *(["--json"] if json_out else []), args=("3",))
    assert res.returncode == 3, res.stderr
    assert "finally ran" not in res.stdout + res.stderr
    assert "the script called os._exit(3)" in res.stderr
    meta = json.loads((res.run_dir / "run.json").read_text())
    assert meta["status"] == "finished" and meta["exit_code"] == 3
    assert meta["summary"]["steps"]["count"] == 24
    if json_out:
        doc = res.json()
        assert doc["exit_code"] == 3 and doc["steps"]["count"] == 24
    else:
        assert "Steps        24 " in res.stdout
        assert (res.run_dir / "report.html").exists()


PREFETCH_THREAD = """
import queue, threading, time
import torch
from torch.utils.data import DataLoader, Dataset

class Slow(Dataset):
    def __len__(self):
        return 4096
    def __getitem__(self, i):
        time.sleep(0.0005)
        return torch.randn(32)

def prefetch(it, q):  # a daemon thread feeding the loop, prefetch_generator's pattern
    for item in it:
        q.put(item)

q = queue.Queue(2)
threading.Thread(target=prefetch, args=(DataLoader(Slow(), batch_size=16), q),
                 daemon=True).start()
w = torch.zeros(32, requires_grad=True)
opt = torch.optim.SGD([w], lr=0.1)
while True:  # stopped by --max-steps; the thread is still loading then
    (w * q.get()).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_daemon_thread_loading_batches_does_not_abort_the_exit(tp):
    """A daemon thread still loading when the script ends spent trainprof's summary (the
    GIL busy for a second) waiting for the GIL inside torch ops; finalization then ended
    it there and the process aborted ("terminate called without an active exception",
    exit 134) in 5 runs of 6. The exit now waits (at most a second) for such threads to
    reach a wait, as a plain script's would be. (Two runs: the abort came in 5 of 6.)"""
    for _ in range(2):
        res = tp(PREFETCH_THREAD, "--max-steps", "40")
        assert res.returncode == 0, res.stderr[-2000:]
        assert "terminate called" not in res.stderr


def test_settling_daemon_threads_waits_for_busy_ones_only():
    import threading
    import time

    from trainprof.capture.launcher import settle_daemon_threads

    stop = threading.Event()
    sleeper = threading.Thread(target=stop.wait, daemon=True)
    sleeper.start()
    t0 = time.monotonic()
    assert settle_daemon_threads(timeout_s=2.0)  # asleep on an event: settled at once
    assert time.monotonic() - t0 < 0.5

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    t0 = time.monotonic()
    assert not settle_daemon_threads(timeout_s=0.3)  # never waits: given up after 0.3 s
    assert 0.25 < time.monotonic() - t0 < 1.5
    stop.set()
    sleeper.join()
    spinner.join()


def test_max_steps_stops_cleanly(tp):
    body = """
    import torch
    w = torch.zeros(2, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    try:
        while True:          # no step limit of its own
            w.sum().backward(); opt.step(); opt.zero_grad()
    finally:
        import gc
        gc.collect()  # teardown after the last step (a worker's shutdown collects too)
        print("cleanup ran")
    """
    res = tp(body, "--max-steps", "25", "--json")
    assert res.returncode == 0, res.stderr
    assert res.json()["steps"]["count"] == 25
    # the teardown after the stop is no step: no partial 26th record for its GC time
    assert json.loads((res.run_dir / "run.json").read_text())["steps_recorded"] == 25
    assert res.json()["status"] == "finished"
    assert "cleanup ran" in res.stderr
    assert not [n for n in res.json()["notes"] if "max-steps" in n]


def test_max_steps_swallowed_by_the_script_is_noted(tp):
    body = """
    import torch
    w = torch.zeros(2, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    for step in range(60):
        try:
            w.sum().backward(); opt.step()
        except:  # noqa: E722 - swallows everything, trainprof's stop too
            pass
    """
    res = tp(body, "--max-steps", "20", "--json")
    assert res.returncode == 0, res.stderr
    doc = res.json()
    assert doc["steps"]["count"] == 60  # it went on: every step is still recorded
    assert [n for n in doc["notes"] if "max-steps" in n] == [
        "the script trained 40 steps past --max-steps 20: it caught trainprof's stop (a bare "
        "`except:` or `except BaseException:` around the step)"]


def test_a_deep_window_the_run_never_reached_is_noted(tp):
    body = """
    import torch
    w = torch.zeros(2, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    for step in range(6):
        w.sum().backward(); opt.step()
    """
    res = tp(body, "--deep", "--json")
    assert res.returncode == 0, res.stderr
    assert [n for n in res.json()["notes"] if "torch.profiler" in n] == [
        "torch.profiler recorded nothing: the run ended after 6 steps, before the --deep "
        "window (steps 12-16); lower it, e.g. --deep skip_first=2"]
    assert not (res.run_dir / "deep").exists()


def test_backward_delimited_steps_without_optimizer(tp):
    body = """
    import torch
    w = torch.randn(16, 16, requires_grad=True)
    for step in range(90):
        loss = (w @ torch.randn(16, 4)).pow(2).mean()
        loss.backward()
        with torch.no_grad():
            w.data.add_(w.grad, alpha=-0.01)   # manual update, no torch.optim
            w.grad = None
    """
    res = tp(body, "--json")
    assert res.returncode == 0, res.stderr
    doc = res.json()
    assert doc["steps"]["delimiter"] == "backward"
    assert doc["steps"]["count"] == 90


@pytest.mark.parametrize("delimiter", ["optimizer", "backward"])
def test_making_a_loaders_iterator_is_data_wait(tp, delimiter):
    """``iter(loader)`` is the pipeline's time: with workers that are not persistent it
    forks them every epoch. Here a batch sampler takes 30 ms to start each epoch; that
    time is the epoch's first step's data wait, not "other"."""
    update = ("opt.step(); opt.zero_grad()" if delimiter == "optimizer" else
              "w.data.add_(w.grad, alpha=-0.1); w.grad = None")
    body = f"""
    import time
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    class SlowStart:
        def __len__(self):
            return 8
        def __iter__(self):  # a plain function: runs inside iter(loader)
            time.sleep(0.03)
            return iter([list(range(i * 4, i * 4 + 4)) for i in range(8)])

    loader = DataLoader(TensorDataset(torch.randn(32, 4)), batch_sampler=SlowStart())
    w = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    for epoch in range(6):
        for (x,) in loader:
            (w * x).sum().backward()
            {update}
    """
    res = tp(body, "--json")
    assert res.returncode == 0, res.stderr
    doc = res.json()
    assert doc["steps"]["delimiter"] == delimiter
    assert doc["steps"]["count"] == 48
    steps = load_run(res.run_dir).steps[:48]  # (a partial 49th closes the record)
    # epochs 2-6 (the first step of the run may be warm-up), less step 8, which opens the
    # op count's window: its "other" holds the tool's start (flagged, left out of stats)
    first_of_epoch = steps[8::8]
    first_of_epoch = first_of_epoch[(first_of_epoch["flags"] & FLAG_PROFILED) == 0]
    assert len(first_of_epoch) >= 4
    assert (first_of_epoch["data_wait_ns"] >= 30e6).all(), first_of_epoch["data_wait_ns"]
    assert (first_of_epoch["other_ns"] < 5e6).all(), first_of_epoch["other_ns"]
    rest = np.delete(steps, np.s_[::8])
    assert np.median(rest["data_wait_ns"]) < 2e6


def test_gradient_accumulation_is_one_step_per_optimizer_step(tp):
    body = """
    import torch
    w = torch.randn(8, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.01)
    for step in range(12):
        for micro in range(4):
            (w * torch.randn(8)).sum().backward()
        opt.step(); opt.zero_grad()
    """
    res = tp(body, "--json")
    assert res.json()["steps"]["count"] == 12
    assert res.json()["steps"]["delimiter"] == "optimizer"


def test_missing_script_and_bad_option_are_one_line_errors(tmp_path):
    res = trainprof("run", "nope.py", cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip().startswith("error:") and len(res.stderr.strip().splitlines()) == 1
    assert "Traceback" not in res.stderr
    res = trainprof("run", "--max-steps", "zero", "x.py", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.startswith("error:")
    res = trainprof("run", "--bogus", "x.py", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.startswith("error:")
    res = trainprof("run", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.startswith("error:")
    res = trainprof("run", "-m", "no_such_module_xyz", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.startswith("error:")
    # a package without __main__: python -m's own words, before any record is made
    (tmp_path / "mypkg").mkdir()
    write_script(tmp_path, "mypkg/__init__.py", "")
    res = trainprof("run", "-m", "mypkg", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr == (
        "error: no module named mypkg.__main__; 'mypkg' is a package and cannot be directly "
        "executed\n")
    assert not res.run_dir.exists()
    # `--` ends trainprof's options: the script is the word after it
    write_script(tmp_path, "args.py", "import sys\nprint(sys.argv)\n")
    res = trainprof("run", "--no-html", "--", "args.py", "--steps", "5", cwd=tmp_path)
    assert res.returncode == 0 and "['args.py', '--steps', '5']" in res.stdout
    res = trainprof("report", "args.py", cwd=tmp_path)  # a file, not a folder
    assert res.returncode == 2 and res.stderr == "error: args.py is a file, not a run folder\n"
    res = trainprof("report", str(tmp_path / "nothing"), cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.startswith("error:")
    (tmp_path / "notarun").mkdir()
    res = trainprof("report", str(tmp_path / "notarun"), cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    # --out naming a folder that holds a run: refused, and the run there is left as it was
    write_script(tmp_path, "ok.py", "print('ran')\n")
    assert trainprof("run", "--out", "done", "ok.py", cwd=tmp_path).returncode == 0
    before = {f.name: f.read_bytes() for f in (tmp_path / "done").iterdir() if f.is_file()}
    res = trainprof("run", "--out", "done", "ok.py", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.startswith("error:") and "already holds" in res.stderr
    assert "ran" not in res.stdout + res.stderr  # refused before the script ran
    after = {f.name: f.read_bytes() for f in (tmp_path / "done").iterdir() if f.is_file()}
    assert after == before


WORKERS_FOREVER = """
import os, sys, time, torch
from torch.utils.data import DataLoader, Dataset

class Slow(Dataset):
    def __len__(self):
        return 1_000_000
    def __getitem__(self, i):
        time.sleep(0.01)
        return torch.randn(4)

def note_pid(worker_id):  # each worker says who it is: the tests check that none survives
    here = os.path.dirname(os.path.abspath(__file__))
    open(os.path.join(here, f"worker-{os.getpid()}.pid"), "w").close()

w = torch.zeros(4, requires_grad=True)
opt = torch.optim.SGD([w], lr=0.1)
loader = DataLoader(Slow(), batch_size=2, num_workers=2, worker_init_fn=note_pid)
for step, x in enumerate(loader):
    (w * x).sum().backward(); opt.step(); opt.zero_grad()
    if step == 3:
        print("READY", flush=True)
    if step == 8 and "crash" in sys.argv:
        raise RuntimeError("crash with workers alive")
"""


def _worker_pids(script_dir: Path) -> set[int]:
    """The pids WORKERS_FOREVER's workers wrote down as they started."""
    return {int(p.stem.removeprefix("worker-")) for p in script_dir.glob("worker-*.pid")}


def _sampled_worker_pids(run_dir: Path) -> set[int]:
    """The worker pids the system sampler recorded."""
    pids = set()
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            pids.update(int(p) for p in json.loads(line).get("workers", {}))
    return pids


def _gone(pids: set[int], within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.1)
    return False


def test_crash_with_workers_leaves_no_worker_alive(tp, tmp_path):
    res = tp(WORKERS_FOREVER, "--sample-interval", "0.05", args=("crash",))
    assert res.returncode == 1, res.stderr
    pids = _worker_pids(tmp_path)
    assert len(pids) == 2
    # the sampler may not yet have a CPU reading of both when the script crashes this early
    assert _sampled_worker_pids(res.run_dir) <= pids
    assert _gone(pids)


def _start(tmp_path: Path, body: str) -> tuple[subprocess.Popen, Path]:
    write_script(tmp_path, "train.py", body)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainprof", "run", "--out", str(run_dir),
         "--sample-interval", "0.05", "train.py"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # faulthandler: a run that hangs is made to print every thread's stack (SIGABRT)
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"},
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if "READY" in line:
            break
    return proc, run_dir


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """``proc.communicate``; a run that does not end in time fails the test with the
    stacks of its threads, and is not left running (a run that ignored a Ctrl-C trained
    on, for ever here, after the test gave up: see conftest.py)."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"the run did not end within {timeout} s; its threads:\n{err[-6000:]}")


def _sampler_pids(pid: int) -> set[int]:
    """The system sampler's process among ``pid``'s children."""
    return {p.pid for p in sampler_children(pid)}


def test_ctrl_c_interrupts_with_summary_and_exit_130(tmp_path):
    proc, run_dir = _start(tmp_path, WORKERS_FOREVER)
    sampler = _sampler_pids(proc.pid)
    assert len(sampler) == 1
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    out, err = _finish(proc, timeout=60)
    # it ends by SIGINT, as python does (a shell's $? is 130; a shell loop stops on it)
    assert proc.returncode == -signal.SIGINT, err
    assert "interrupted" in out and "Step time" in out
    # where Ctrl-C stopped the script, as python prints it: the script's frames only
    tb = err[err.index("Traceback (most recent call last):"):]
    assert "\nKeyboardInterrupt" in tb and 'train.py", line' in tb, err[-2000:]
    assert "trainprof" not in tb.split("KeyboardInterrupt")[0], tb
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["status"] == "interrupted" and meta["exit_code"] == 130
    assert meta["summary"]["steps"]["count"] >= 4
    assert meta["summary"]["system"]["n_samples"] > 0
    pids = _worker_pids(tmp_path)
    assert len(pids) == 2 and _sampled_worker_pids(run_dir) == pids
    assert _gone(pids) and _gone(sampler, within=1)


def test_sigterm_is_an_interruption(tmp_path):
    proc, run_dir = _start(tmp_path, WORKERS_FOREVER)
    proc.send_signal(signal.SIGTERM)
    _finish(proc, timeout=60)
    assert proc.returncode == -signal.SIGTERM  # died of it, as python
    assert json.loads((run_dir / "run.json").read_text())["status"] == "interrupted"


def test_sigterm_leaves_no_worker_alive(tmp_path):
    proc, run_dir = _start(tmp_path, WORKERS_FOREVER)
    sampler = _sampler_pids(proc.pid)
    proc.send_signal(signal.SIGTERM)
    _, err = _finish(proc, timeout=60)
    assert proc.returncode == -signal.SIGTERM, err  # died of it, as python
    pids = _worker_pids(tmp_path)
    assert len(pids) == 2 and _gone(pids) and _gone(sampler, within=1)


SWALLOWS_SIGTERM = """
import time, torch
w = torch.zeros(4, requires_grad=True)
opt = torch.optim.SGD([w], lr=0.1)
t0 = time.monotonic()
for step in range(10**9):
    try:  # a "robust" loop that skips bad batches: a bare except catches everything
        (w * torch.randn(4)).sum().backward(); opt.step(); opt.zero_grad()
        if step == 5:  # (inside the try: the signal comes as the line is read, and is
            print("READY", flush=True)  # raised as print returns)
        time.sleep(0.01)
    except:  # noqa: E722
        print("skipped a bad batch", flush=True)
    if time.monotonic() - t0 > 60:
        break
print("the loop ended by itself")
"""


def test_sigterm_ends_a_script_that_swallows_its_exception(tmp_path):
    """Under python SIGTERM kills the script at once; the exception trainprof raises in its
    place is caught by the script's bare except: the next step ends the run."""
    proc, run_dir = _start(tmp_path, SWALLOWS_SIGTERM)
    began = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = _finish(proc, timeout=60)
    assert proc.returncode == -signal.SIGTERM, err  # died of it, as python
    assert time.monotonic() - began < 15  # not the script's 60 s
    assert out.count("skipped a bad batch") == 1 and "ended by itself" not in out
    assert "the script caught the exception it raised and trained on" in err
    meta = json.loads((run_dir / "run.json").read_text())
    assert (meta["status"], meta["exit_code"]) == ("interrupted", 143)
    assert "Step time" in out  # the summary


SPAWNED_RANKS = """
import sys, time, torch
import torch.multiprocessing as mp


def train(rank):
    torch.set_num_threads(1)
    w = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    t0 = time.monotonic()
    step = 0
    while time.monotonic() - t0 < 60:
        (w * torch.randn(4)).sum().backward(); opt.step(); opt.zero_grad()
        time.sleep(0.01)
        step += 1
        if rank == 0 and step == 20:
            print("READY", flush=True)


if __name__ == "__main__":
    mp.spawn(train, nprocs=2)
"""


def test_sigterm_stops_the_ranks_the_script_spawned(tmp_path):
    """python dies at once; under trainprof the ranks are sent SIGTERM too and close their
    records as interrupted, instead of training their 60 s while the run waits for them."""
    proc, run_dir = _start(tmp_path, SPAWNED_RANKS)
    began = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = _finish(proc, timeout=60)
    assert proc.returncode == -signal.SIGTERM, err  # died of it, as python
    assert time.monotonic() - began < 20
    for rank in ("0", "1"):
        meta = json.loads((run_dir / "ranks" / rank / "run.json").read_text())
        assert (meta["status"], meta["exit_code"]) == ("interrupted", 143), rank


TRAINS_IN_A_THREAD = """
import threading, time, torch


def train():
    w = torch.zeros(4, requires_grad=True)
    opt = torch.optim.Adam([w])
    t0 = time.monotonic()
    step = 0
    while time.monotonic() - t0 < 60:
        (w * torch.randn(32, 4)).sum().backward(); opt.step(); opt.zero_grad()
        time.sleep(0.005)
        step += 1
        if step == 20:
            print("READY", flush=True)


trainer = threading.Thread(target=train)
trainer.start()
trainer.join()
"""


def test_sigterm_ends_a_run_that_trains_in_a_thread(tmp_path):
    """The training thread is not waited for (nor aborted mid-op at finalization: exit 134)."""
    proc, run_dir = _start(tmp_path, TRAINS_IN_A_THREAD)
    began = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = _finish(proc, timeout=60)
    assert proc.returncode == -signal.SIGTERM, err  # died of it, as python
    assert time.monotonic() - began < 15 and "terminate called" not in err
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["status"] == "interrupted" and meta["steps_recorded"] >= 20


def test_kill_9_leaves_a_readable_record(tmp_path):
    proc, run_dir = _start(tmp_path, WORKERS_FOREVER)
    sampler = _sampler_pids(proc.pid)
    time.sleep(1.5)  # > one flush period
    proc.kill()
    proc.communicate(timeout=30)
    pids = _worker_pids(tmp_path)
    assert len(pids) == 2
    res = trainprof("report", str(run_dir), "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    doc = res.json()
    assert doc["status"] == "crashed" and doc["recorded_status"] == "running"
    assert doc["steps"]["count"] >= 4
    # workers notice their parent is gone and exit (DataLoader's watchdog); so does the sampler
    assert _gone(pids, within=15) and _gone(sampler, within=5)


def test_training_goes_on_when_the_sampler_dies_and_the_summary_says_so(tp):
    """The system sampler (a child process) killed mid-run: the script never notices, the
    samples written before stay, and the summary names what went missing."""
    body = """
    import time, psutil, torch
    from torch import nn
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_for(seconds):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            loss = model(torch.randn(8, 4)).sum()
            opt.zero_grad(); loss.backward(); opt.step()
            time.sleep(0.005)

    train_for(2.0)  # > one second of sampling: the sampler has handed samples to the OS
    for child in psutil.Process().children():
        if "trainprof.capture.sampler_process" in " ".join(child.cmdline()):
            child.kill()
    train_for(1.0)
    """
    res = tp(body, "--json")
    assert res.returncode == 0, res.stderr
    doc = res.json()
    assert doc["status"] == "finished" and doc["steps"]["count"] > 100
    assert "system sampler: exited with code -9" in doc["missing"], doc["missing"]
    # the 5 Hz samples of the first two seconds (less the child's start-up, which
    # compiles its modules on a fresh checkout) stay in the record
    assert len(load_samples(res.run_dir / "samples.jsonl")) >= 3


@pytest.mark.parametrize("pure_python", ["0", "1"])
def test_a_script_that_trains_in_a_thread_of_its_own_is_measured_there(tp, pure_python):
    """The main thread starts a trainer thread and waits: the first optimizer step, in
    the trainer, moves the clock there; that step (already partly past) is not counted."""
    body = """
    import threading, time, torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 1)
        def forward(self, x):
            time.sleep(0.002)          # 2 ms of "compute"
            return self.lin(x)

    def train():
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(40):
            loss = model(torch.randn(4, 8)).sum()
            opt.zero_grad(); loss.backward(); opt.step()

    trainer = threading.Thread(target=train, name="trainer")
    trainer.start()
    trainer.join()
    """
    res = tp(body, "--json", env={"TRAINPROF_PURE_PYTHON": pure_python})
    assert res.returncode == 0, res.stderr
    doc = res.json()
    assert doc["steps"]["count"] == 39
    assert doc["breakdown"]["forward"] > 0.5  # the sleep dominates each step
    assert any("'trainer'" in n and "one step more than the Steps line says" in n
               for n in doc["notes"]), doc["notes"]
    # the stack samples' signal reaches the main thread only: the record says why there are none
    assert any(m.startswith("loop stacks: not sampled") for m in doc["missing"]), doc["missing"]
    assert doc["loop_stacks"] is None
    run = load_run(res.run_dir)
    assert (run.steps["forward_ns"] >= 2e6).all()
    assert (run.steps["optimizer_ns"] > 0).all() and (run.steps["backward_ns"] > 0).all()
    if pure_python == "1":
        return  # (the stop below is the launcher's, the same on both paths)
    # --max-steps stops the trainer thread: one line, no traceback, the script goes on
    res = tp(body.rstrip() + "\n    print('main thread done')\n", "--json", "--max-steps", "10",
             "--out", str(res.run_dir.parent / "run2"), env={"TRAINPROF_PURE_PYTHON": pure_python})
    assert res.returncode == 0, res.stderr
    assert res.json()["steps"]["count"] == 10
    assert "trainprof: stopped thread 'trainer': reached --max-steps after 10 steps" in res.stderr
    assert "Traceback" not in res.stderr and "main thread done" in res.stderr


def test_dataloader_workers_are_not_counted_as_other_processes(tp):
    body = """
    import multiprocessing, torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    if __name__ == "__main__":
        loader = DataLoader(TensorDataset(torch.randn(64, 8)), batch_size=8, num_workers=2)
        model = nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for (x,) in loader:
            loss = model(x).sum()
            opt.zero_grad(); loss.backward(); opt.step()
        helper = multiprocessing.Process(target=print, args=("helper",), name="helper")
        helper.start()
        helper.join()
    """
    res = tp(body, "--json")
    assert res.returncode == 0, res.stderr
    doc = res.json()
    # (this run hung now and then - the helper forked while the flush thread imported
    # psutil, see test_a_fork_waits_for_the_flush_thread_to_finish_an_import)
    seen = (doc["steps"], doc["notes"], doc.get("missing"), doc.get("ranks"))
    assert doc["steps"]["count"] == 8, seen  # 64 samples in batches of 8
    # the helper may train: it is recorded as a rank of its own (test_ranks); the workers not
    assert [n for n in doc["notes"] if "process" in n] == [
        "the script started 1 process that may train: each is recorded in ranks/<k>/ of this "
        "run (k = 0)"], seen
    assert [(r["label"], r["steps"]) for r in doc["ranks"]] == [("0", 0)], seen
    # a process that never steps starts no system sampler of its own
    assert not (res.run_dir / "ranks" / "0" / "samples.jsonl").exists()


def test_a_fork_waits_for_the_flush_thread_to_finish_an_import(tmp_path):
    """A process forked while trainprof's flush thread is importing a module (psutil for
    the fingerprint) inherited that module's import lock, held by a thread it does not
    have, and hung at its own import of it (a recorded helper, 1 run in 5 on Python 3.12).
    Forks now wait for the flush thread's work (the guard it holds while working)."""
    (tmp_path / "slowmod.py").write_text("import time\ntime.sleep(1.0)\n")
    write_script(tmp_path, "fork_during_import.py", """
        import multiprocessing as mp, sys, threading, time
        from trainprof.capture import recorder

        def flush_work():  # what the flush thread does: work, under the guard
            with recorder._FORK_GUARD:
                import slowmod  # noqa: F401 - holds slowmod's import lock for 1 s

        def child():
            import slowmod  # noqa: F401 - hangs if its lock was held at fork

        if __name__ == "__main__":
            sys.path.insert(0, ".")
            threading.Thread(target=flush_work).start()
            time.sleep(0.3)  # the import is under way
            p = mp.get_context("fork").Process(target=child)
            p.start()
            p.join(20)
            print("child exit", p.exitcode)
            if p.exitcode is None:
                p.kill()
    """)
    proc = subprocess.run([sys.executable, "fork_during_import.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "child exit 0" in proc.stdout, proc.stdout + proc.stderr


def test_profile_api_inside_trainprof_run_attaches_to_the_run(tp):
    body = """
    import torch, trainprof
    w = torch.zeros(2, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    with trainprof.profile(max_steps=5, out="elsewhere", deep="") as prof:
        for step in range(12):
            for micro in range(3):   # three optimizer steps per "step" the user marks
                w.sum().backward(); opt.step()
            with prof.region("log"):
                pass
            prof.step()
    """
    res = tp(body, "--json")
    assert res.returncode == 0, res.stderr
    doc = res.json()
    assert doc["steps"]["delimiter"] == "manual"
    assert doc["steps"]["count"] == 12
    assert doc["regions"]["log"]["count"] == 12
    assert not (res.run_dir.parent / "trainprof-runs").exists()  # no second run folder
    # the options that shape a record are the CLI's: those given here are named, once
    assert not (res.run_dir.parent / "elsewhere").exists()
    said = [ln for ln in res.stderr.splitlines() if "ignored" in ln]
    assert said == ["trainprof: profile(out='elsewhere', max_steps=5, deep='') ignored: a "
                    "record is open already (trainprof run's, or an outer profile()'s), and "
                    "this one records into it; give them to `trainprof run` (--out, "
                    "--max-steps, --deep) or the outer profile()"], res.stderr


def test_report_reads_a_run_that_is_still_going(tmp_path):
    proc, run_dir = _start(tmp_path, WORKERS_FOREVER)
    try:
        time.sleep(1.5)  # > one flush period
        res = trainprof("report", str(run_dir), "--json", cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        doc = res.json()
        assert doc["status"] == "running"
        assert doc["steps"]["count"] >= 4
        assert doc["dataloaders"][0]["num_workers"] == 2
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)


def test_spawned_workers_can_unpickle_classes_from_the_script(tp):
    body = """
    import torch
    from torch.utils.data import DataLoader, Dataset

    class DS(Dataset):   # pickled as __main__.DS for the spawned workers
        def __len__(self):
            return 64
        def __getitem__(self, i):
            return torch.randn(4)

    def main():
        w = torch.zeros(4, requires_grad=True)
        opt = torch.optim.SGD([w], lr=0.1)
        loader = DataLoader(DS(), batch_size=8, num_workers=2, multiprocessing_context="spawn")
        for x in loader:
            (w * x).sum().backward(); opt.step()

    if __name__ == "__main__":
        main()
    """
    res = tp(body, "--json")
    assert res.returncode == 0, res.stderr
    doc = res.json()
    assert doc["steps"]["count"] == 8
    assert doc["dataloaders"][0]["multiprocessing_context"] == "spawn"


CTRL_C_WHILE_CLOSING = """
import os, signal, time
import torch
from trainprof.capture import recorder as R

_stop = R.Recorder.stop

def stop(self, *args, **kwargs):  # a second Ctrl-C lands while trainprof closes the record
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.2)
    return _stop(self, *args, **kwargs)

R.Recorder.stop = stop
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(12):
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_ctrl_c_while_the_record_closes_waits_for_it(tmp_path):
    write_script(tmp_path, "train.py", CTRL_C_WHILE_CLOSING)
    res = trainprof("run", "--out", str(tmp_path / "run"), "train.py", cwd=tmp_path)
    assert res.returncode == 130, res.stderr
    assert "Traceback" not in res.stderr
    assert res.stderr.rstrip().endswith("trainprof: interrupted")
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    # the script had finished: the record says so, complete, and report reads it
    assert meta["status"] == "finished" and meta["exit_code"] == 0
    assert meta["steps_recorded"] >= 12  # 12 optimizer steps (and the trailing zero_grad's)
    rep = trainprof("report", str(tmp_path / "run"), "--json", cwd=tmp_path)
    assert rep.returncode == 0 and rep.json()["steps"]["count"] >= 12


def test_a_compiled_model_compiles_once_and_no_dynamo_warning(tp):
    """torch.compile: the op count's call counter (a TorchFunctionMode) is left out once
    Dynamo has compiled a frame - pushing it made Dynamo recompile, trace the mode and warn;
    the FLOP count's dispatch mode runs, with no recompile."""
    body = """
    import torch
    import torch._dynamo.utils as dynamo_utils
    from torch import nn

    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    compiled = torch.compile(model, backend="eager")  # Dynamo only: no C++ compiler needed
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(30):
        loss = compiled(torch.randn(16, 32)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
    print("frames", dict(dynamo_utils.counters["frames"]))
    """
    res = tp(body, "--json", timeout=180)
    assert res.returncode == 0, res.stderr
    assert "frames {'total': 1, 'ok': 1}" in res.stderr  # compiled once, as without trainprof
    assert "Dynamo does not know how to trace" not in res.stderr
    doc = res.json()
    assert doc["steps"]["count"] == 30
    assert doc["ops"]["compiled"] is True and doc["ops"]["calls_per_step"] is None
    assert doc["compute"]["flops_per_step"] == 3 * 2 * 16 * (32 * 64 + 64) - 2 * 16 * 32 * 64
    assert doc["breakdown"]["forward"] > 0


def test_a_wrap_up_that_hangs_after_sigterm_is_given_up_with_the_threads_stacks(tmp_path):
    """SIGTERM is held while the record closes, but a close that hangs must not make the
    process unkillable (torchrun would wait 30 s and SIGKILL it): once the give-up time has
    passed, trainprof says so with every thread's stack and exits 143. The steps flushed
    before stay readable. Here the script makes the close hang: it replaces a torch function
    that the recorder calls while closing with one that sends SIGTERM and sleeps."""
    write_script(tmp_path, "train.py", """
        import os, signal, time
        import torch
        from torch import nn

        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(20):
            loss = model(torch.randn(8, 4)).sum()
            opt.zero_grad(); loss.backward(); opt.step()
        time.sleep(1.5)  # the steps reach the disk (flushed once a second)

        def hang():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)

        torch.get_num_threads = hang  # read by trainprof as it closes the record
    """)
    launcher = ("import sys, trainprof.held_signals as h; h.GIVE_UP_AFTER_S = 1.0; "
                "from trainprof.cli import main; sys.exit(main())")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", launcher, "run", "--out", "run", "train.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert took < 30, took
    assert ("trainprof: closing the record did not finish within 1 s of SIGTERM; exiting "
            "without it - where each thread was (a bug: please report it):") in proc.stderr
    assert "in hang" in proc.stderr and "_training_thread_settings" in proc.stderr  # the stack
    report = trainprof("report", "--json", "run", cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    doc = report.json()  # (left "running" by a process that is gone: read as crashed)
    assert doc["status"] == "crashed" and doc["steps"]["count"] == 20


def test_sigterm_after_the_script_still_gets_the_record_closed_and_the_summary(tp):
    """A launcher stops the ranks that are left as soon as one fails (torchrun: SIGTERM 0.1 s
    after it sees a worker exit), which can land after the script ended, while trainprof
    closes the record and writes the summary. Both are finished first, and the exit code
    stays the script's. Here a thread of the script sends the SIGTERM once the record is
    closed, while the summary is being made."""
    body = """
    import json, os, signal, threading, time
    import torch
    from torch import nn

    record = os.path.join(os.getcwd(), "run", "run.json")

    def stop_once_closed():
        while True:
            try:
                with open(record) as f:
                    if json.load(f)["status"] != "running":
                        break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.002)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_once_closed, daemon=True).start()
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(20):
        loss = model(torch.randn(8, 4)).sum()
        opt.zero_grad(); loss.backward(); opt.step()
    """
    res = tp(body, "--json")
    assert res.returncode == 0, res.stderr
    assert ("trainprof: SIGTERM arrived after the script ended: the record and the summary "
            "were finished first") in res.stderr
    doc = res.json()
    assert doc["status"] == "finished" and doc["steps"]["count"] == 20
    meta = json.loads((res.run_dir / "run.json").read_text())
    assert meta["status"] == "finished" and meta["exit_code"] == 0
