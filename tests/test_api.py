"""The Python API, in process: explicit steps, regions, the null object, and patches undone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import trainprof
from trainprof.analysis.steps import complete_steps, step_statistics
from trainprof.analysis.summary import summarize_run
from trainprof.schema import FLAG_MANUAL
from trainprof.store import load_run


def _loop(prof, steps: int, eval_every: int = 0) -> None:
    """A tiny training loop; with ``prof``, steps marked by hand (else by the optimizer)."""
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if prof is None:
            continue
        if eval_every and step % eval_every == eval_every - 1:
            with prof.region("eval"):
                time.sleep(0.02)
        prof.step()


def test_explicit_steps_and_regions(tmp_path):
    originals = (torch.nn.Module.__call__, torch.Tensor.item, torch.autograd.backward)
    with trainprof.profile(tmp_path / "r", report=False) as prof:
        _loop(prof, 30, eval_every=10)
    assert (torch.nn.Module.__call__, torch.Tensor.item, torch.autograd.backward) == originals
    s = prof.summary
    assert s["status"] == "finished"
    assert s["steps"]["count"] == 30
    assert s["steps"]["delimiter"] == "manual"
    assert s["regions"]["eval"]["count"] == 3
    assert s["regions"]["eval"]["total_s"] == pytest.approx(0.06, abs=0.02)
    steps = load_run(tmp_path / "r").steps
    # the eval region is charged to the step it ran in, not to forward
    assert (steps["region_ns"] > 15e6).sum() == 3
    assert (steps["forward_ns"][1:] < 15e6).all()  # the first forward may include lazy init
    # exclusive phases add up to each step's duration exactly
    phases = [f for f in steps.dtype.names if f.endswith("_ns") and f not in
              ("t_start_ns", "dur_ns", "sync_ns")]
    assert (sum(steps[f] for f in phases) == steps["dur_ns"]).all()


def test_region_names_are_kept_on_one_line_and_never_empty(tmp_path):
    """``region("log\nline")`` split the summary's table; ``region("")`` printed a bare row."""
    with trainprof.profile(tmp_path / "r", report=False) as prof:
        for _ in range(3):
            with prof.region("log\nline"):
                pass
            with prof.region(""):
                pass
            prof.step()
    assert set(prof.summary["regions"]) == {"log line", "(unnamed region)"}


def test_crash_inside_profile_is_recorded_and_reraised(tmp_path):
    with pytest.raises(ZeroDivisionError), trainprof.profile(tmp_path / "r", report=False) as prof:
        _loop(prof, 5)
        1 / 0  # noqa: B018
    run = load_run(tmp_path / "r")
    assert run.status == "crashed"
    assert step_statistics(run.steps)["steps"]["count"] == 5


def test_os_exit_inside_profile_closes_the_record_first(tmp_path):
    """``os._exit`` inside the block skips ``__exit__``: the record is closed and the
    summary printed before the process exits with the code asked for."""
    import json
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import os
        import torch
        import trainprof
        w = torch.zeros(3, requires_grad=True)
        opt = torch.optim.SGD([w], lr=0.1)
        with trainprof.profile({str(tmp_path / "r")!r}):
            for _ in range(12):
                (w - 1).pow(2).sum().backward()
                opt.step()
                opt.zero_grad()
            os._exit(4)
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 4, proc.stderr
    assert "Steps        12 " in proc.stderr
    meta = json.loads((tmp_path / "r" / "run.json").read_text())
    assert meta["status"] == "finished" and meta["exit_code"] == 4


def test_max_steps_ends_the_block_quietly(tmp_path):
    with trainprof.profile(tmp_path / "r", max_steps=7, report=False) as prof:
        model = nn.Linear(2, 1)
        opt = torch.optim.Adam(model.parameters())
        while True:
            model(torch.randn(3, 2)).sum().backward()
            opt.step()
    assert prof.summary["steps"]["count"] == 7
    assert prof.summary["status"] == "finished"


def test_disabled_profile_is_a_null_object(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    prof = trainprof.profile(enabled=False)
    assert isinstance(prof, trainprof.NullProfile)
    with prof:
        _loop(prof, 3, eval_every=1)
    assert not (tmp_path / "trainprof-runs").exists()
    # costs nothing measurable: a step() call is a no-op method call
    t0 = time.perf_counter()
    for _ in range(100_000):
        prof.step()
    assert (time.perf_counter() - t0) / 100_000 < 2e-6


def test_sync_and_host_read_counts(tmp_path):
    with trainprof.profile(tmp_path / "r", report=False) as prof:
        w = torch.zeros(3, requires_grad=True)
        opt = torch.optim.SGD([w], lr=0.1)
        for _ in range(10):
            loss = (w - 1).pow(2).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss.item()
            w.detach().tolist()
    s = prof.summary
    assert s["syncs"]["per_step"] == 0  # CPU tensors: reads, but no device sync
    # each iteration's two reads come after its optimizer step: they land in the next step
    # (the summary's mean depends on whether the first step, with none, counts as warm-up),
    # the op-count sample's steps (8 and 9) included: its TorchFunctionMode once made them 4
    steps = load_run(tmp_path / "r").steps
    reads = steps["host_reads"]
    assert reads[0] == 0 and len(reads) >= 10 and set(reads[1:10]) == {2}, steps


def test_gc_time_is_its_own_phase(tmp_path):
    import gc

    with trainprof.profile(tmp_path / "r", report=False) as prof:
        w = torch.zeros(3, requires_grad=True)
        opt = torch.optim.SGD([w], lr=0.1)
        junk = [[i] for i in range(200_000)]
        for _ in range(6):
            (w * 2).sum().backward()
            gc.collect()
            opt.step()
        del junk
    steps = load_run(tmp_path / "r").steps
    assert (steps["gc_n"] >= 1).all()
    assert (steps["gc_gen2_n"] >= 1).all()
    assert (steps["gc_ns"] > 1e6).sum() >= 5  # a full collection of 200k lists takes ms
    assert prof.summary["breakdown"]["gc"] > 0.3


def test_forward_wrapper_moves_onto_root_classes_after_discovery(tmp_path):
    """After a few steps only the top-level module classes stay wrapped; forward is still timed."""
    original_call = torch.nn.Module.__call__

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

        def forward(self, x):
            time.sleep(0.002)
            return self.body(x)

    seen_during_run = []
    with trainprof.profile(tmp_path / "r", report=False):
        model, loss_fn = Net(), nn.MSELoss()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(12):
            loss = loss_fn(model(torch.randn(8, 4)), torch.zeros(8, 1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen_during_run.append(torch.nn.Module.__call__ is original_call)
        assert "__call__" in Net.__dict__ and "__call__" in nn.MSELoss.__dict__
        assert "__call__" not in nn.Linear.__dict__
    assert seen_during_run[0] is False and seen_during_run[-1] is True
    assert "__call__" not in Net.__dict__ and "__call__" not in nn.MSELoss.__dict__
    run = load_run(tmp_path / "r")
    assert (run.steps["forward_ns"] > 2e6).all()  # the 2 ms sleep in forward, every step
    assert run.meta["forward_roots"] == [
        f"{Net.__module__}.{Net.__qualname__}", "torch.nn.modules.loss.MSELoss"]


def test_training_goes_on_when_the_sampler_fails(tmp_path, monkeypatch):
    from trainprof.capture import sampler_process

    def broken_start(self):
        raise OSError("no /proc here")

    monkeypatch.setattr(sampler_process.SamplerProcess, "start", broken_start)
    with trainprof.profile(tmp_path / "r", report=False) as prof:
        _loop(prof, 5)
    assert prof.summary["steps"]["count"] == 5
    assert any("system sampler" in m for m in prof.summary["missing"])
    assert prof.summary["system"]["n_samples"] == 0


def test_recording_again_and_again_keeps_nothing_alive(tmp_path):
    """One fork hook per process, not one per recording: finished recordings are freed."""
    import gc
    import weakref

    from trainprof.capture import hooks

    refs = []
    for i in range(3):
        with trainprof.profile(tmp_path / f"r{i}", report=False) as prof:
            _loop(prof, 3)
            (inst,) = list(hooks._INSTALLED)
            refs.append(weakref.ref(inst))
        assert not list(hooks._INSTALLED)  # uninstalled at the end of the block
        del prof, inst
    gc.collect()
    assert [r() for r in refs] == [None, None, None]
    assert hooks._FORK_HOOK


def test_once_a_step_closed_other_threads_optimizer_steps_do_not_move_the_clock(tmp_path):
    """The clock follows the thread of the run's first optimizer step, and only that one:
    a helper thread stepping its own optimizer later (an EMA, a probe) is not measured."""
    with trainprof.profile(tmp_path / "r", report=False) as prof:
        _loop(None, 6)  # 6 steps
        helper = threading.Thread(target=_loop, args=(None, 10))
        helper.start()
        helper.join()
        _loop(None, 3)  # a new optimizer: its second step makes it the primary
    assert prof.summary["steps"]["count"] == 9  # one per iteration of this thread
    assert prof.summary["notes"] == []


def test_manual_steps_keep_their_thread(tmp_path):
    with trainprof.profile(tmp_path / "r", report=False) as prof:
        prof.step()  # the first call begins the first step: manual from here on
        helper = threading.Thread(target=_loop, args=(None, 5))
        helper.start()  # before any step closed: its optimizer steps would move an auto clock
        helper.join()
        for _ in range(4):
            time.sleep(0.002)
            prof.step()
    assert prof.summary["steps"]["count"] == 4
    assert prof.summary["steps"]["delimiter"] == "manual"
    assert prof.summary["notes"] == []


def test_the_clock_moves_to_another_thread_only_while_nothing_is_measured_yet():
    from trainprof.capture.clock import StepClock
    from trainprof.schema import FORWARD, OTHER

    me, other = threading.get_ident(), threading.get_ident() + 1
    clock = StepClock()
    clock.current = FORWARD  # this thread is inside a timed call: its wrapper closes it
    assert not clock.adopt_thread(other) and clock.owner == me
    clock.current = OTHER
    assert not clock.adopt_thread(me)
    assert clock.adopt_thread(other) and clock.owner == other and not clock.started
    assert clock.adopted_thread == threading.current_thread().name
    moved = StepClock()
    moved._close(0)  # a step closed: the clock stays where it is
    assert not moved.adopt_thread(other) and moved.owner == me


_COMPILED_LOOP = """
import sys
import torch
import torch._dynamo.utils as dynamo_utils
from torch import nn
import trainprof

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))

torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.01)  # imports Dynamo before trainprof patches
how = sys.argv[1]
if how == "model":
    step_loss = torch.compile(model, backend="eager")  # Dynamo only: no C++ compiler needed
elif how == "in_place":
    model.compile(backend="eager")
    step_loss = model
else:  # a compiled function that calls the model
    step_loss = torch.compile(lambda x: model(x), backend="eager")
with trainprof.profile(sys.argv[2], report=False):
    for _ in range(20):
        loss = step_loss(torch.randn(16, 32)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    wrapped = torch.nn.Module.__call__ is not nn.Module.__dict__.get("_wrapped_call_impl")
print("frames", dynamo_utils.counters["frames"]["total"],
      "breaks", sum(dynamo_utils.counters["graph_break"].values()), "wrapped", wrapped)
"""


@pytest.mark.parametrize("how", ["model", "in_place", "function"])
def test_profiling_a_compiled_model_compiles_it_once(tmp_path, how):
    """``trainprof.profile()`` after ``torch.compile`` (Dynamo imported before trainprof
    wraps ``nn.Module.__call__``): Dynamo inlines the wrapper as a plain module call, and
    the wrapper stays on nn.Module after discovery, so the model is compiled once and the
    compiled function is not broken into pieces (before: a second compile at discovery's
    end, and 16 graph breaks in the compiled function)."""
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(_COMPILED_LOOP)
    res = subprocess.run([sys.executable, str(script), how, str(tmp_path / "r")],
                         capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["frames", "1", "breaks", "0", "wrapped", "True"]
    run = load_run(tmp_path / "r")
    assert len(run.steps) >= 19
    assert run.meta["compiled_frames"] == 1
    notes = summarize_run(run)["notes"]
    if how != "function":
        assert (complete_steps(run.steps)["forward_ns"] > 0).all()
        assert run.meta["forward_roots"][0].endswith("OptimizedModule" if how == "model"
                                                     else "Net")
        assert not any("no forward pass was seen" in n for n in notes)
    else:  # a compiled function that calls the model hides its forward: the summary says so
        assert not complete_steps(run.steps)["forward_ns"].any()
        assert any(n.startswith("torch.compile compiled 1 frame and no forward pass was seen")
                   for n in notes)
    # compiled from the first step: the op count's window counts the FLOPs only (no call
    # sites), at the ops the compiled code calls, without a recompile (frames 1 above):
    # forward 2*16*(32*64 + 64*1), backward twice that but fc1's input gradient
    ops = json.loads((tmp_path / "r" / "ops.json").read_text())
    assert ops["compiled"] is True and "sites" not in ops
    assert ops["flops_by_kind_per_step"] == {"cpu float32": 3 * 67584 - 2 * 16 * 32 * 64}
    assert not any(n.startswith("no FLOPs counted") for n in notes)


def _train_step(model, opt) -> None:
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def test_n_iterations_with_prof_step_are_n_steps_and_max_steps_counts_them(tmp_path):
    """The first iteration's optimizer step closes a step before the first prof.step()
    (the clock cannot know yet that the script marks its own): with the sliver up to
    prof.step() it is the user's one first step, for the summary and for max_steps (which
    had stopped a max_steps=15 loop after 14 iterations, "Steps 14")."""
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    done = 0
    with trainprof.profile(tmp_path / "r", max_steps=15, report=False) as prof:
        for _ in range(40):
            _train_step(model, opt)
            done += 1
            prof.step()
    assert done == 15
    assert prof.summary["steps"]["count"] == 15
    assert prof.summary["notes"] == []
    raw = load_run(tmp_path / "r").steps
    # the optimizer step that closed the first record, then the 15 prof.step() calls
    assert raw["flags"][0] & FLAG_MANUAL == 0 and len(raw) == 16


@pytest.mark.parametrize("where", ["first", "twice"])
def test_prof_step_twice_in_a_row_records_no_empty_step(tmp_path, where):
    """prof.step() with no code since the last one (at the top of the loop as well as at
    its end, or twice by mistake) closes no step: 40 iterations are 40 steps, not 80 of
    which 40 last a few microseconds."""
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with trainprof.profile(tmp_path / "r", report=False) as prof:
        if where == "first":
            prof.step()
            prof.step()
        for _ in range(40):
            _train_step(model, opt)
            prof.step()
            if where == "twice":
                prof.step()
    assert prof.summary["steps"]["count"] == 40
    assert prof.summary["steps"]["median_s"] > 20e-6


def test_a_garbage_collection_between_two_calls_makes_no_step():
    """prof.step() at the top of the loop and at its end: a collection set off in between
    (by the op count's window, set up in the call before) had made one empty gap a step
    (101 steps for 100 iterations)."""
    from trainprof.capture.clock import StepClock
    from trainprof.schema import GC, GC_N

    clock = StepClock()
    clock.manual_step()
    clock.acc[GC_N] += 1
    clock.acc[GC] += 5_000
    clock.manual_step()
    assert clock.n_steps == 0


def test_a_step_of_untimed_work_is_still_a_step():
    """Only the gap between two calls is dropped: a longer step with nothing timed in it
    (a sleep, code outside any module) is closed as before."""
    from trainprof.capture.clock import EMPTY_STEP_NS, StepClock

    clock = StepClock()
    clock.manual_step()
    clock.manual_step()  # at once: empty
    assert clock.n_steps == 0
    time.sleep(EMPTY_STEP_NS / 1e9 * 2)
    clock.manual_step()
    assert clock.n_steps == 1


def test_a_profile_records_once_and_report_false_prints_nothing(tmp_path, capsys):
    """A second ``with`` on the same profile wrote its record over the first one's, in the
    same folder: it is refused, and the first record stays whole."""
    from trainprof.errors import UsageError

    prof = trainprof.profile(tmp_path / "r", report=False)
    with prof:
        _loop(prof, 10)
    assert capsys.readouterr().err == ""  # report=False: not even the HTML report's path
    assert (tmp_path / "r" / "report.html").exists()
    with pytest.raises(UsageError, match=r"recorded already .* make a new one"), prof:
        _loop(prof, 10)
    assert load_run(tmp_path / "r").status == "finished"
    assert step_statistics(load_run(tmp_path / "r").steps)["steps"]["count"] == 10


def test_regions_share_is_shown_and_their_wall_time_explained(tmp_path):
    """A region's time in the Region row is its wall time, with its share of the steady
    steps; the breakdown's "other" names the regions' part of it (it held them unsaid).
    A region around training steps runs longer than the breakdown's region time (their
    backward and optimizer count as those phases): a note says so."""
    import io

    from trainprof.report.html import _breakdown_bar
    from trainprof.report.terminal import render_summary

    with trainprof.profile(tmp_path / "r", report=False) as prof:
        _loop(prof, 40, eval_every=10)
    s = prof.summary
    region = s["breakdown_detail"]["region"]
    assert region > 0.2  # 20 ms sleeps against steps well under 1 ms
    assert s["regions"]["eval"]["steady_share"] == pytest.approx(region, rel=0.2)
    assert s["notes"] == []  # a region of its own work: wall time and region time agree
    buf = io.StringIO()
    render_summary(s, file=buf)
    text = " ".join(buf.getvalue().split())
    assert f"(region eval {region * 100:.1f}%)" in text
    assert (f"Region eval 4× · {s['regions']['eval']['total_s'] * 1e3:.1f} ms wall time · "
            f"{s['regions']['eval']['steady_share'] * 100:.1f}% of the steady steps' time") in text
    assert f"other {s['breakdown']['other'] * 100:.1f}% (region eval" in _breakdown_bar(
        s["breakdown"], f"region eval {region * 100:.1f}%")

    class SlowSGD(torch.optim.SGD):
        def step(self, closure=None):
            time.sleep(0.003)  # the optimizer phase, inside the region or not
            return super().step(closure)

    model = nn.Linear(4, 1)
    opt = SlowSGD(model.parameters(), lr=0.1)
    with trainprof.profile(tmp_path / "across", report=False) as prof:
        for it in range(30):
            if it == 10:
                span = prof.region("span")
                span.__enter__()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
            prof.step()
            if it == 20:
                span.__exit__(None, None, None)
    (note,) = prof.summary["notes"]
    assert note.startswith("the named regions ran ") and "(wall time, the Region rows)" in note
    assert "backward passes, optimizer steps" in note


def test_a_profile_under_python_dash_m_records_the_module_command(tmp_path):
    """`python -m mypkg.train` with trainprof.profile(): the record had the module's file as
    a script, and verify's trials crashed on its relative imports."""
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "util.py").write_text("LR = 0.1\n")
    (pkg / "train.py").write_text(
        "import sys, torch, trainprof\n"
        "from .util import LR\n"
        "with trainprof.profile(sys.argv[1], report=False):\n"
        "    w = torch.zeros(4, requires_grad=True)\n"
        "    opt = torch.optim.SGD([w], lr=LR)\n"
        "    for _ in range(3):\n"
        "        (w * torch.randn(4)).sum().backward(); opt.step(); opt.zero_grad()\n")
    res = subprocess.run([sys.executable, "-m", "mypkg.train", str(tmp_path / "r"), "--x"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             [str(Path(trainprof.__file__).parents[1]),
                              os.environ.get("PYTHONPATH", "")])})
    assert res.returncode == 0, res.stderr
    from trainprof.experiments.verify import original_command

    meta = json.loads((tmp_path / "r" / "run.json").read_text())
    assert meta["command"][1:] == ["-m", "mypkg.train", str(tmp_path / "r"), "--x"]
    assert original_command(meta)[:3] == ("mypkg.train", [str(tmp_path / "r"), "--x"], True)

