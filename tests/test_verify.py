"""``trainprof verify``: a finding's knob measured on the run's own command, and the verdict
set against the finding's estimate."""

from __future__ import annotations

import json

import pytest
from conftest import trainprof, write_script

from trainprof.errors import UsageError
from trainprof.experiments.verify import (
    current_first,
    judge,
    knob_specs,
    original_command,
    pick_finding,
)
from trainprof.report.verify_terminal import after_line, verdict_line

#: A conv net in float64 (NumPy's default): the float64 finding comes first, and float32
#: runs its convolutions about three times as fast (oneDNN has no float64 ones): an effect
#: that stays clear of the noise even on a loaded machine.
DOUBLE = """
import numpy as np
import torch
from torch import nn

x = torch.from_numpy(np.random.default_rng(0).standard_normal((16, 3, 32, 32)))
y = torch.from_numpy(np.random.default_rng(1).integers(0, 10, 16))
model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
                      nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)).double()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loss_fn = nn.CrossEntropyLoss()
for step in range(60):
    loss = loss_fn(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
"""


def test_an_aside_knob_is_not_judged_against_the_findings_estimate():
    from trainprof.experiments.verify import judge
    from trainprof.report.verify_terminal import verdict_line

    finding = {"estimated_gain": 0.66, "verify": "`trainprof run t.py` after the change; a "
               "worker for a thread: trainprof tune --knob num_workers=0,1 t.py"}
    doc = {"metric": "step_time", "arms": [
        {"name": "num_workers=1", "baseline": True, "ratio": 1.0},
        {"name": "num_workers=0", "ratio": 0.72, "ci": [0.6, 0.8], "verdict": "faster"}]}
    result = judge(finding, doc)
    assert result["aside"] and result["verdict"] == "confirmed"
    line = verdict_line({**result, "metric": "step_time"}).plain
    assert "the finding's main fix is a code change, not measured here" in line
    assert line.split("\n")[0].endswith("keep that setting") and "66%" not in line


#: DDP's exposed all-reduce where it outlasts the backward, as the rule writes its line: the
#: fix is fewer all-reduces (a code change), 16-bit gradients an aside of it.
DDP_VERIFY = ("`trainprof run ddp.py` after the change (the gradients of several micro-batches "
              "accumulated under model.no_sync(), one all-reduce for them all), then trainprof "
              "compare RUN <the new run>  (DDP's exposed all-reduce, now 9.0 ms a step, 40% of "
              "it, should fall); 16-bit gradients alone: trainprof tune --knob "
              "ddp_comm_hook=script,fp16 ddp.py")


def test_an_aside_that_costs_more_is_the_knobs_verdict_not_the_findings():
    """examples/ddp_allreduce.py: 16-bit gradients between two ranks of one host ran at
    ×1.09 (95% CI ×1.02–×1.17), and verify said "refuted ... keep the current setting" of a
    finding whose fix is gradient accumulation: a user drops a sound diagnosis."""
    finding = {**_finding("exposed_communication", DDP_VERIFY, gain=0.4),
               "category": "distributed"}
    doc = {"metric": "step_time", "arms": [
        {"name": "ddp_comm_hook=script", "baseline": True, "ratio": 1.0},
        {"name": "ddp_comm_hook=fp16", "ratio": 1.09, "ci": [1.02, 1.17], "verdict": "slower"}]}
    result = judge(finding, doc)
    assert result["role"] == "aside" and result["verdict"] == "did not help"
    assert result["main_fix"].startswith("`trainprof run ddp.py` after the change (the "
                                         "gradients of several micro-batches accumulated "
                                         "under model.no_sync()")
    line = verdict_line(result).plain
    assert "refuted" not in line and "up to 40%" not in line
    assert line.startswith("Verdict: did not help - ddp_comm_hook=fp16 ran at ×1.09")
    assert line.split("\n")[0] == ("Verdict: did not help - ddp_comm_hook=fp16 ran at ×1.09 "
                                   "of the baseline's step time (95% CI ×1.02–×1.17): keep "
                                   "the current setting")
    assert ("ddp_comm_hook=fp16 measures only an aside of this finding, and the verdict is "
            "the knob's: the finding's main fix is a code change, not measured here - measure "
            "it as its verify line says: `trainprof run ddp.py` after the change") in line
    assert "then trainprof compare RUN <the new run>" in line
    # no significant difference: the knob may not matter, not "the fix"
    doc["arms"][1].update(ratio=1.01, ci=[0.95, 1.07], verdict="no_difference")
    line = verdict_line(judge(finding, doc)).plain
    assert "the knob does not matter here" in line and "the fix does not" not in line
    # a knob that is the fix itself is still refuted by a slowdown
    fix = _finding("x", "trainprof tune --knob ddp_comm_hook=script,fp16 ddp.py", gain=0.4)
    doc["arms"][1].update(ratio=1.09, ci=[1.02, 1.17], verdict="slower")
    assert judge(fix, doc)["verdict"] == "refuted" and judge(fix, doc)["role"] == "fix"


def test_the_bound_is_a_ceiling_to_measure_the_fix_against_not_a_fix():
    """synthetic_data=true measured for a fix that is a code change said "beyond the bound -
    ... 89% saved; the finding said up to 75%: apply the fix": it is the most any input fix
    can give, and the fix itself is measured as the verify line says."""
    verify = ("after the change, trainprof compare RUN <the new run> (data wait now 75%); "
              "`trainprof tune --knob num_workers=0,2 t.py` shows whether workers help; the "
              "most any input fix can give: trainprof tune --knob synthetic_data=false,true t.py")
    finding = {**_finding("per_sample_overhead", verify, gain=0.75), "category": "input_pipeline"}
    doc = _doc(0.11, (0.10, 0.12), "faster")
    doc["arms"][1]["name"] = "synthetic_data=true"
    result = judge(finding, doc)
    assert result["role"] == "bound" and result["verdict"] == "beyond the bound"
    line = verdict_line(result).plain
    assert "apply the fix" not in line and "saved" not in line
    assert ("89% off with the input made free; the finding said up to 75%: the estimate was "
            "too low (worth reporting)") in line
    assert ("synthetic_data=true makes the input free: this is the most any input fix can "
            "give here, a ceiling, not a fix to apply. Measure the fix itself next, as its "
            "verify line says: after the change, trainprof compare RUN <the new run> (data "
            "wait now 75%)") in line
    assert "confirmed: " not in line
    doc = _doc(0.4, (0.35, 0.45), "faster")
    line = verdict_line(judge(finding, doc)).plain
    assert line.startswith("Verdict: confirmed") and "the estimate holds as the ceiling" in line
    # the step no faster with the input free: the finding is refuted, nothing to measure next
    line = verdict_line(judge(finding, _doc(1.1, (1.05, 1.15), "slower"))).plain
    assert line.startswith("Verdict: refuted") and "no input fix can help here" in line
    assert "Measure the fix itself" not in line


def test_the_summary_names_what_the_knob_verify_measures_is_to_the_finding():
    from trainprof.report.terminal import verify_hint

    summary = {"run_dir": "R", "status": "finished", "steps": {"count": 100}}
    fix = _finding("float64", "trainprof tune --knob float32=false,true t.py")
    aside = _finding("exposed_communication", DDP_VERIFY)
    assert verify_hint(summary, [fix]) == (
        "Measure finding 1's fix (its knob on this script, against its estimate):",
        "trainprof verify R")
    assert verify_hint(summary, [_finding("noise", "trainprof run"), aside]) == (
        "Measure finding 2's knob (an aside: its fix is a code change, measured as its verify "
        "line says):", "trainprof verify R --finding 2")
    bound = _finding("per_sample_overhead", "after the change, trainprof compare; the most any "
                     "input fix can give: trainprof tune --knob synthetic_data=false,true t.py")
    prose, command = verify_hint(summary, [bound])
    assert prose.startswith("Measure the most finding 1's fix can give (the input made free")
    assert command == "trainprof verify R"
    # code python read from stdin: nothing for verify to run again (it said `trainprof run -`)
    assert verify_hint({**summary, "command": ["python", "-"]}, [fix]) is None


def test_code_from_stdin_is_named_as_a_file_to_save_it_in():
    from test_diagnosis import make_steps, make_summary

    from trainprof.diagnosis.context import Context

    steps = make_steps(20)
    assert Context(make_summary(steps, command=["python", "-"]), steps).script == "SCRIPT.py"
    assert Context(make_summary(steps), steps).script == "train.py"


def test_a_trials_own_knobs_are_kept_in_every_arm():
    from trainprof.experiments.verify import trial_knobs

    meta = {"knobs": {"requested": {"num_workers": 4, "pin_memory": True,
                                    "channels_last": True}}}
    # the finding's own knob is measured; the trial's others stay as the trial ran them
    assert trial_knobs(meta, ["channels_last=false,true"]) == ["num_workers=4",
                                                               "pin_memory=true"]
    assert trial_knobs({}, ["channels_last=false,true"]) == []


def test_the_knobs_are_read_from_the_first_tune_command_of_a_verify_line():
    assert knob_specs("trainprof tune --knob channels_last=false,true train.py  (the model "
                      "and its inputs)") == (["channels_last=false,true"], None)
    assert knob_specs("trainprof tune --knob gc_freeze=false,true --knob gc_threshold=700,"
                      "50000 train.py") == (["gc_freeze=false,true",
                                             "gc_threshold=700,50000"], None)
    assert knob_specs("trainprof tune --knob eval_no_grad=false,true --steps 400 t.py") == (
        ["eval_no_grad=false,true"], 400)
    assert knob_specs("trainprof tune --knob batch_size=32,64,128 t.py: time per sample "
                      "should fall") == (["batch_size=32,64,128"], None)
    # a second command after "; " is an aside, not the fix
    assert knob_specs("trainprof tune --knob num_workers=0,4 t.py; the most any input fix "
                      "can give: trainprof tune --knob synthetic_data=false,true t.py") == (
        ["num_workers=0,4"], None)
    assert knob_specs("re-run `trainprof run t.py` and `trainprof compare A B`") == ([], None)
    # a fix that is a code change: verify measures the bound (synthetic_data), not an aside
    line = ("`trainprof run t.py` after the change, then trainprof compare A B; a worker for a "
            "thread: trainprof tune --knob num_workers=0,1 --knob torch_threads=1,2 t.py; the "
            "most any input fix can gain: trainprof tune --knob synthetic_data=false,true t.py")
    assert knob_specs(line) == (["synthetic_data=false,true"], None)
    # the script's own --steps (and a --knob it takes) are its arguments, not tune's
    assert knob_specs("trainprof tune --knob fused=false,true t.py --steps 100000 --knob x=1"
                      ) == (["fused=false,true"], None)


def _finding(cause: str, verify: str, gain: float = 0.3) -> dict:
    return {"category": "compute", "cause": cause, "title": cause, "severity": "medium",
            "estimated_gain": gain, "evidence": {}, "verify": verify}


def test_the_first_finding_with_a_knob_is_picked_unless_one_is_named():
    findings = [_finding("noise", "trainprof tune repeats trials"),
                _finding("float64", "trainprof tune --knob float32=false,true t.py"),
                _finding("optimizer", "trainprof tune --knob optimizer=script,fused t.py")]
    assert pick_finding(findings, None)[:3] == (2, findings[1], ["float32=false,true"])
    assert pick_finding(findings, 3)[2] == ["optimizer=script,fused"]
    with pytest.raises(UsageError, match="finding 1 .* has no knob to measure"):
        pick_finding(findings, 1)
    with pytest.raises(UsageError, match="the run has 3 findings"):
        pick_finding(findings, 4)
    with pytest.raises(UsageError, match="no finding to verify"):
        pick_finding([], None)
    with pytest.raises(UsageError, match="no finding of the run has a knob"):
        pick_finding(findings[:1], None)


def test_the_runs_own_setting_is_the_baseline_where_its_record_tells_it():
    """A sweep written in order (contention: torch_threads=1,2 with num_workers=0,1,2,4)
    starts with values the run did not have: the baseline must be what it had."""
    meta = {"training_thread": {"torch_num_threads": 2}, "dataloaders": [{"num_workers": 4}]}
    assert current_first(["torch_threads=1,2", "num_workers=0,1,2,4"], meta) == [
        "torch_threads=2,1", "num_workers=4,0,1,2"]
    # not recorded (a process knob the run had no record of): as the finding wrote it
    assert current_first(["channels_last=false,true"], meta) == ["channels_last=false,true"]
    # already first, or not among the values: unchanged
    assert current_first(["num_workers=4,8", "torch_threads=1,4"], meta) == [
        "num_workers=4,8", "torch_threads=1,4"]


def test_a_spawned_launchs_settings_are_its_main_ranks(tmp_path):
    """mp.spawn: the launching process kept 2 threads, each rank set 1: the baseline of
    torch_threads=1,2 is the ranks' 1 (it was the launcher's 2, and verify measured
    the finding's own proposal as the baseline)."""
    import numpy as np

    from trainprof.experiments.verify import _main_rank_meta
    from trainprof.schema import STEP_FIELDS
    from trainprof.store import RunWriter

    dtype = np.dtype([(f, np.int64) for f in STEP_FIELDS])

    def record(path, threads: int, steps: int) -> None:
        rec = np.zeros(steps, dtype=dtype)
        rec["step"] = np.arange(steps)
        rec["dur_ns"] = rec["other_ns"] = 10_000_000
        rec["t_start_ns"] = rec["step"] * 10_000_000
        writer = RunWriter(path, {"name": path.name, "clock_origin_s": 0.0,
                                  "training_thread": {"torch_num_threads": threads}})
        writer.append_step_bytes(rec.tobytes())
        writer.close("finished", 0)

    record(tmp_path / "launch", 2, 0)
    for rank in ("0", "1"):
        record(tmp_path / "launch" / "ranks" / rank, 1, 30)
    meta = _main_rank_meta(tmp_path / "launch")
    assert meta["training_thread"]["torch_num_threads"] == 1
    assert current_first(["torch_threads=1,2"], meta) == ["torch_threads=1,2"]


def test_the_command_is_the_runs_own():
    meta = {"command": ["/usr/bin/python3", "train.py", "--lr", "0.1"],
            "fingerprint": {"cwd": "/data/job"}}
    target, args, module, cwd = original_command(meta)
    assert (target, args, module, str(cwd)) == ("train.py", ["--lr", "0.1"], False, "/data/job")
    meta = {"command": ["python", "-m", "pkg.train", "--x"], "fingerprint": {}}
    assert original_command(meta) == ("pkg.train", ["--x"], True, None)
    with pytest.raises(UsageError, match="no command line"):
        original_command({})


def _doc(ratio: float, ci: tuple[float, float], verdict: str) -> dict:
    return {"arms": [{"name": "k=a", "baseline": True, "ratio": None, "verdict": "baseline"},
                     {"name": "k=b", "baseline": False, "ratio": ratio, "ci": list(ci),
                      "verdict": verdict}]}


@pytest.mark.parametrize("ratio,ci,verdict,expected", [
    (0.75, (0.68, 0.85), "faster", "confirmed"),  # 25% saved of "up to 30%"
    (0.55, (0.50, 0.60), "faster", "beyond the bound"),  # at least 40% saved: > 30%
    (0.65, (0.60, 0.72), "faster", "confirmed"),  # 35%, but the interval reaches 28%
    (1.01, (0.84, 1.19), "no_difference", "not confirmed"),
    (1.90, (1.70, 2.10), "slower", "refuted"),
])
def test_the_verdict_sets_the_measured_saving_against_the_bound(ratio, ci, verdict, expected):
    result = judge(_finding("x", "", gain=0.30), _doc(ratio, ci, verdict))
    assert result["verdict"] == expected
    assert result["saving"] == pytest.approx(1 - ratio)
    assert result["saving_ci"] == pytest.approx([1 - ci[1], 1 - ci[0]])
    assert str(verdict_line(result)).startswith(f"Verdict: {expected} - k=b ran at ×{ratio:.2f}")
    # a finding that claims no gain (gain_unknown) is confirmed, never "beyond" a bound
    unknown = {**_finding("x", "", gain=0.0), "evidence": {"gain_unknown": True}}
    if expected == "beyond the bound":
        assert judge(unknown, _doc(ratio, ci, verdict))["verdict"] == "confirmed"
    assert judge(_finding("x", ""), {"arms": []})["verdict"] == "no data"


def test_help_lists_every_verdict_judge_gives(capsys):
    from trainprof.cli import main
    from trainprof.experiments.verify import VERDICTS
    from trainprof.report.verify_terminal import _STYLE

    given = {judge(_finding("x", "", gain=0.30), _doc(0.75, (0.7, 0.8), tune_verdict))["verdict"]
             for tune_verdict in ("faster", "slower", "no_effect", "unsettled", "no_difference")}
    given |= {judge(_finding("x", "", gain=0.10), _doc(0.5, (0.4, 0.6), "faster"))["verdict"],
              judge(_finding("x", ""), {"arms": []})["verdict"],
              judge(_finding("x", DDP_VERIFY), _doc(1.1, (1.05, 1.15), "slower"))["verdict"]}
    assert given == set(VERDICTS) == set(_STYLE)  # and the terminal styles each one
    with pytest.raises(SystemExit):
        main(["verify", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for verdict, meaning in VERDICTS.items():
        assert f"{verdict} ({meaning})" in shown


def test_the_runs_with_the_fix_say_how_near_the_peak_they_ran():
    doc = _doc(0.25, (0.2, 0.3), "faster")
    doc["arms"][0]["flops_utilization"] = 0.004
    doc["arms"][1].update(flops_utilization=0.017, top_finding={"title": "NCHW convolutions"})
    result = judge(_finding("x", "", gain=0.8), doc)
    assert result["flops_utilization"] == [0.004, 0.017]
    assert result["next_finding"] == {"title": "NCHW convolutions"}
    assert after_line(result) == (
        "With k=b the steps' FLOPs ran at 1.7% of this machine's matmul peak (0.4% before)")
    doc["arms"][1]["flops_utilization"] = None
    assert after_line(judge(_finding("x", "", gain=0.8), doc)) is None
    # nothing to say of a fix that was not confirmed
    assert after_line(judge(_finding("x", ""), _doc(1.9, (1.7, 2.1), "slower"))) is None


def test_verify_measures_the_first_findings_knob_from_anywhere(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    write_script(job, "train.py", DOUBLE)
    run = trainprof("run", "--json", "--no-html", "train.py", cwd=job)
    assert run.returncode == 0, run.stderr
    assert run.json()["findings"][0]["cause"] == "float64"
    # the terminal summary and the HTML report name the command
    import io

    from trainprof.commands import analyse_folder, write_html
    from trainprof.report.terminal import render_summary

    summary, record = analyse_folder(run.run_dir)
    text = io.StringIO()
    render_summary(summary, file=text)
    assert ("Measure finding 1's fix (its knob on this script, against its estimate):\n"
            f"   trainprof verify {run.run_dir}\n") in text.getvalue()
    page = write_html(summary, record, tmp_path / "report.html").read_text()
    assert f"trainprof verify {run.run_dir} --finding 1" in page
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    res = trainprof("verify", "--json", "--trials", "2", "--steps", "30", "--out",
                    str(tmp_path / "v"), str(run.run_dir), cwd=elsewhere, timeout=240)
    assert res.returncode == 0, res.stderr
    doc = res.json()  # one document: tune's table went nowhere, its progress to stderr
    assert (doc["finding_number"], doc["knobs"]) == (1, ["float32=false,true"])
    assert doc["cwd"] == str(job) and doc["finding"]["cause"] == "float64"
    assert doc["arm"] == "float32=true" and doc["status"] == "finished"
    # what comes next with the fix: no float64 left (compare: the baseline's first finding)
    assert doc["next_finding"] is None or doc["next_finding"]["cause"] != "float64"
    # float32 convolutions about three times as fast: a large, robust effect - though two
    # trials of 30 short steps on a shared machine can disagree by more than tune's
    # UNSETTLED_SPREAD (one CI run: "unsettled"); the verdicts' own rules are tested apart
    assert doc["verdict"] in ("confirmed", "beyond the bound", "unsettled"), doc
    assert doc["ratio"] < 0.7
    # each arm's steps against the matmul peak of the dtype it computed in
    assert all(isinstance(u, float) and u > 0 for u in doc["flops_utilization"])
    saved = json.loads((tmp_path / "v" / "verify.json").read_text())
    assert saved["verdict"] == doc["verdict"]
    tune = json.loads((tmp_path / "v" / "tune.json").read_text())
    assert tune["target"] == "train.py" and tune["trials_per_arm"] == 2


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    res = trainprof("verify", str(tmp_path / "missing"), cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.startswith("error: ")
    assert res.stderr == f"error: no such run folder: {tmp_path / 'missing'}\n"
    (tmp_path / "launch" / "ranks" / "0").mkdir(parents=True)
    res = trainprof("verify", str(tmp_path / "launch"), cwd=tmp_path)
    assert res.returncode == 2 and "a launch of several ranks" in res.stderr


def test_a_refused_verify_leaves_no_empty_folder(tmp_path):
    write_script(tmp_path, "train.py", DOUBLE)
    run = trainprof("run", "--no-html", "--max-steps", "20", "train.py", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    (tmp_path / "train.py").unlink()  # the script the run ran is gone: nothing to measure
    res = trainprof("verify", str(run.run_dir), cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.endswith("error: no such script: train.py\n")
    assert list((tmp_path / "trainprof-runs").iterdir()) == []


def test_the_verdict_names_the_trials_that_ran_under_outside_load():
    doc = _doc(1.01, (0.84, 1.19), "no_difference")
    doc["arms"][0]["outside_load"] = {"trials": 1, "max_cores": 0.9}
    doc["arms"][1]["outside_load"] = {"trials": 2, "max_cores": 1.4}
    line = str(verdict_line(judge(_finding("x", "", gain=0.30), doc)))
    assert line.startswith("Verdict: not confirmed")
    assert line.endswith("(3 trials ran while other processes kept up to ~1.4 cores busy)")
    doc["arms"][1]["verdict"] = "unsettled"
    line = str(verdict_line(judge(_finding("x", "", gain=0.30), doc)))
    assert "a trial ran far slower than the others: 3 trials ran while other processes kept " \
        "up to ~1.4 cores busy); rerun" in line
    del doc["arms"][0]["outside_load"], doc["arms"][1]["outside_load"]
    assert "outside load?" in str(verdict_line(judge(_finding("x", "", gain=0.30), doc)))


def test_verify_trials_run_in_the_runs_own_setting(tmp_path):
    """A run of ``-m pkg.train`` with a relative PYTHONPATH and OMP_NUM_THREADS=1, verified
    from another folder where OMP_NUM_THREADS=2 and PYTHONPATH lacks the package: its trials
    find the module and train on 1 thread, as the run did (they had run in the caller's
    setting: 2 threads, and the module check failed in verify's own process)."""
    import os

    job = tmp_path / "job"
    (job / "code" / "pkg").mkdir(parents=True)
    (job / "code" / "pkg" / "__init__.py").write_text("")
    write_script(job / "code" / "pkg", "train.py", DOUBLE.replace("range(60)", "range(30)"))
    ours = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    pythonpath = os.pathsep.join(["code", *ours])  # relative: read from the job's folder
    run = trainprof("run", "--json", "--no-html", "-m", "pkg.train", cwd=job,
                    env={"OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath})
    assert run.returncode == 0, run.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    res = trainprof("verify", "--json", "--trials", "1", "--steps", "12", "--out",
                    str(tmp_path / "v"), str(run.run_dir), cwd=elsewhere, timeout=240,
                    env={"OMP_NUM_THREADS": "2"})
    assert res.returncode == 0, res.stderr
    doc = res.json()
    corrected = doc["setting"]["corrected"]
    assert "OMP_NUM_THREADS=1 (here 2)" in corrected
    assert f"PYTHONPATH={pythonpath} (here {os.environ.get('PYTHONPATH', 'unset')})" in corrected
    assert doc["setting"]["not_corrected"] == []
    # one line names them, on stderr with --json
    assert "trials run as the run did: " in res.stderr and "OMP_NUM_THREADS=1 (here 2)" in \
        res.stderr
    trials = [json.loads(p.read_text()) for p in sorted((tmp_path / "v").glob("*/run.json"))]
    assert len(trials) == 2 and all(t["status"] == "finished" for t in trials)
    assert [t["fingerprint"]["threads"]["torch_num_threads"] for t in trials] == [1, 1]
    assert all(t["launch"]["env"]["PYTHONPATH"] == pythonpath for t in trials)
    assert all(t["launch"]["cwd"] == str(job) for t in trials)
    # the run's own record: every variable named, unset ones as null
    meta = json.loads((run.run_dir / "run.json").read_text())
    assert meta["launch"]["env"]["OMP_NUM_THREADS"] == "1"
    assert "MKL_NUM_THREADS" in meta["launch"]["env"]


def _setting_meta(python: str, torch_version: str | None) -> dict:
    return {"command": [python, "train.py"], "launch": {"cwd": "/x", "env": {}},
            "fingerprint": {"torch": {"version": torch_version}}}


def test_a_gone_interpreter_is_named_and_another_torch_refused(tmp_path, monkeypatch):
    import sys
    from importlib import metadata

    from trainprof.experiments.trial_setting import run_setting

    (tmp_path / "train.py").write_text("")
    gone = str(tmp_path / "old-venv" / "bin" / "python")
    here = metadata.version("torch")
    setting = run_setting(_setting_meta(gone, here), "train.py", False, tmp_path)
    assert setting.python == sys.executable
    assert setting.not_corrected == [f"the run's interpreter {gone} is gone: trials use "
                                     f"{sys.executable}"]
    assert setting.line() == "not as the run did: " + setting.not_corrected[0]
    import re

    with pytest.raises(UsageError, match=re.escape(f"this one has torch {here} where the run "
                                                   "had torch 1.13.1: trials here would "
                                                   "measure another torch")):
        run_setting(_setting_meta(gone, "1.13.1"), "train.py", False, tmp_path)
    # the run's own interpreter, torch upgraded since: used, and said
    setting = run_setting(_setting_meta(sys.executable, "1.13.1"), "train.py", False, tmp_path)
    assert setting.python == sys.executable
    assert setting.not_corrected == [f"torch {here} in {sys.executable} (the run had 1.13.1)"]
    # another interpreter that runs trainprof (a wrapper, as a venv's python is to us): used
    other = tmp_path / "other-python"
    other.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    other.chmod(0o755)
    setting = run_setting(_setting_meta(str(other), here), "train.py", False, tmp_path)
    assert setting.python == str(other) and setting.not_corrected == []
    assert setting.corrected == [f"interpreter {other} (here {sys.executable})"]
    # one that cannot import trainprof: this one instead, said
    other.write_text("#!/bin/sh\necho 'ModuleNotFoundError: no trainprof' >&2; exit 1\n")
    setting = run_setting(_setting_meta(str(other), here), "train.py", False, tmp_path)
    assert setting.python == sys.executable
    assert setting.not_corrected == [f"the run's interpreter {other} cannot run trainprof "
                                     "(ModuleNotFoundError: no trainprof): trials use "
                                     f"{sys.executable}"]
    # a variable set here that the run had unset is unset for the trials
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    meta = {**_setting_meta(sys.executable, here),
            "launch": {"env": {"OMP_NUM_THREADS": None, "MKL_NUM_THREADS": "2"}}}
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    setting = run_setting(meta, "train.py", False, tmp_path)
    assert setting.env == {"MKL_NUM_THREADS": "2", "OMP_NUM_THREADS": None}
    assert setting.corrected == ["MKL_NUM_THREADS=2 (here unset)", "OMP_NUM_THREADS unset "
                                                                   "(here 3)"]
    assert "OMP_NUM_THREADS" not in setting.environ()
    with pytest.raises(UsageError, match="no such script: missing.py"):
        run_setting(meta, "missing.py", False, tmp_path)


def test_a_crashed_runs_trials_stop_before_the_crash():
    """A script that raised at its step 50: verify's trials of 60 steps crashed there too,
    and it said "no data", throwing away their 50 steps each."""
    from trainprof.experiments.verify import trial_steps
    from trainprof.report.terminal import verify_hint

    crashed = {"run_dir": "R", "status": "crashed", "steps": {"count": 50}}
    assert trial_steps(crashed, None, None) == (50, "the run crashed after 50 steps: its "
                                                    "trials run 50 steps, to stop before the "
                                                    "crash (--steps to choose)")
    assert trial_steps(crashed, None, 30)[0] == 30  # the verify line's, already short enough
    assert trial_steps(crashed, None, 400)[0] == 50
    # --steps as given (the script may have been fixed), said up front
    assert trial_steps(crashed, 80, None) == (80, "the run crashed after 50 steps: trials of "
                                                  "--steps 80 go past that point and crash "
                                                  "there too unless the script was fixed "
                                                  "since")
    assert trial_steps(crashed, 40, None)[1].endswith("trials of --steps 40 stop before that")
    assert trial_steps({"status": "finished"}, None, None) == (60, None)
    assert trial_steps({"status": "interrupted", "steps": {"count": 5}}, None, 400) == (400,
                                                                                        None)
    too_soon = {"run_dir": "R", "status": "crashed", "steps": {"count": 3}}
    with pytest.raises(UsageError, match=r"^the run crashed after 3 steps, too few for trials "
                       r"that stop before the crash \(at least 10\): fix the crash, run the "
                       r"script again and verify that run$"):
        trial_steps(too_soon, None, None)
    # the summary names verify as it works, and not where it cannot
    fix = _finding("float64", "trainprof tune --knob float32=false,true t.py")
    assert verify_hint(crashed, [fix])[0].endswith(
        "(its knob on this script, against its estimate; the run crashed after 50 steps: its "
        "trials stop before that):")
    assert verify_hint(too_soon, [fix]) is None


def test_verify_of_a_crashed_run_measures_the_steps_before_the_crash(tmp_path):
    crashing = DOUBLE.replace("for step in range(60):\n", "for step in range(100):\n"
                              "    if step == 30:\n        raise RuntimeError('a bad batch')\n")
    write_script(tmp_path, "train.py", crashing)
    run = trainprof("run", "--no-html", "train.py", cwd=tmp_path)
    assert run.returncode != 0 and "a bad batch" in run.stderr
    res = trainprof("verify", "--trials", "1", "--out", str(tmp_path / "v"), str(run.run_dir),
                    cwd=tmp_path, timeout=240)
    assert res.returncode == 0, res.stderr
    assert ("the run crashed after 30 steps: its trials run 30 steps, to stop before the "
            "crash") in res.stdout
    tune = json.loads((tmp_path / "v" / "tune.json").read_text())
    trials = [t for arm in tune["arms"] for t in arm["trials"]]
    assert [(t["status"], t["exit_code"], t["steps"]) for t in trials] == [("finished", 0, 30)] * 2
    assert json.loads((tmp_path / "v" / "verify.json").read_text())["verdict"] != "no data"
