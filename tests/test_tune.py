"""`trainprof tune`: knobs applied to unmodified scripts, trials, the two-level bootstrap, verdicts.

The end-to-end tests run real child `trainprof run`s of tiny scripts (the machine has 2 busy
cores, so they are few and short); the knob overrides and the statistics are also checked
in-process, on real DataLoaders and on step times with known distributions.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import trainprof, write_script
from torch.utils.data import BatchSampler, DataLoader, Dataset

from trainprof.analysis.compare import bootstrap_ratio_ci
from trainprof.capture.knobs import ENV_VAR, Knobs, decode, encode, install_knobs
from trainprof.errors import UsageError
from trainprof.experiments import tune as tune_mod
from trainprof.experiments.stats import ratio_ci
from trainprof.experiments.tune import (
    Trial,
    analyse_tune,
    build_arms,
    find_baseline,
    parse_knobs,
    schedule,
    tune_command,
)
from trainprof.report.tune_terminal import render_tune

SLEEPY = """
    import time
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    class Sleepy(Dataset):
        def __len__(self):
            return 100_000
        def __getitem__(self, i):
            time.sleep(0.003)  # 24 ms per batch of 8 in the training process
            return torch.randn(16), i % 2

    torch.manual_seed(0)
    # one intra-op thread: on a busy 2-core machine OpenMP's spinning threads make even this
    # tiny backward() take tens of ms, which would drown the loading time under test
    torch.set_num_threads(1)
    loader = DataLoader(Sleepy(), batch_size=8, num_workers=0)
    model = nn.Linear(16, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
"""

THREADS = """
    import time
    import torch
    from torch import nn

    torch.set_num_threads(3)  # the script pins its own count: the knob must win
    model = nn.Linear(32, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1000):
        loss = model(torch.randn(16, 32)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.05)
"""


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def workers_tune(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("tune")
    write_script(root, "train.py", SLEEPY)
    res = trainprof("tune", "--knob", "num_workers=0,2", "--steps", "25", "--trials", "2",
                    "--json", "--out", str(root / "t"), "train.py", cwd=root, timeout=240)
    assert res.returncode == 0, res.stderr
    return {"doc": res.json(), "stderr": res.stderr, "dir": root / "t"}


def test_more_workers_are_proved_faster_and_the_knob_is_recorded(workers_tune: dict) -> None:
    doc = workers_tune["doc"]
    base, two = doc["arms"]
    assert base["name"] == "num_workers=0" and base["baseline"] and base["verdict"] == "baseline"
    assert two["name"] == "num_workers=2"
    # the script's own loading takes 24 ms per step; two workers overlap it with the step
    assert two["verdict"] == "faster"
    assert two["ratio"] < 0.8
    lo, hi = two["ci"]
    assert lo <= two["ratio"] <= hi < 1
    assert two["speedup"] == pytest.approx(1 / two["ratio"])
    assert two["samples_per_s"] > base["samples_per_s"]
    assert doc["best"]["name"] == "num_workers=2"
    assert doc["metric"] == "step_time"
    for arm in (base, two):
        assert arm["trials_usable"] == 2
        # 2 trials of 25 steps, less the sampled (op count) steps and a warm-up of at most half
        assert arm["steady_steps"] >= 22
        assert arm["actual"] == {"num_workers": arm["settings"]["num_workers"]}
    # each child run recorded the override it ran with, and the DataLoader really had it
    for arm in (base, two):
        n = int(arm["settings"]["num_workers"])
        for trial in arm["trials"]:
            meta = json.loads((Path(trial["run_dir"]) / "run.json").read_text())
            assert meta["status"] == "finished"
            assert meta["knobs"]["requested"] == {"num_workers": n}
            (entry,) = meta["knobs"]["dataloaders"]
            assert entry["set"] == {"num_workers": n} and entry["script"] == {"num_workers": 0}
            assert [dl["num_workers"] for dl in meta["dataloaders"]] == [n]
            assert meta["steps_recorded"] == 25


def test_tune_runs_shuffled_rounds_reports_progress_and_keeps_tune_json(workers_tune) -> None:
    doc, stderr = workers_tune["doc"], workers_tune["stderr"]
    rounds = [doc["order"][:2], doc["order"][2:]]
    for r, pairs in enumerate(rounds, 1):
        assert sorted(name for name, _ in pairs) == ["num_workers=0", "num_workers=2"]
        assert {t for _, t in pairs} == {r}
    progress = [ln for ln in stderr.splitlines() if ln.startswith("[")]
    assert [ln.split("]")[0] for ln in progress] == ["[1/4", "[2/4", "[3/4", "[4/4"]
    assert all("ms/step" in ln and "elapsed" in ln for ln in progress)
    saved = json.loads((workers_tune["dir"] / "tune.json").read_text())
    assert saved["status"] == "finished" and saved["arms"] == doc["arms"]
    assert doc["trials_done"] == doc["trials_planned"] == 4


def test_terminal_table_fits_120_columns_and_names_the_best_arm(workers_tune) -> None:
    out = io.StringIO()
    render_tune(workers_tune["doc"], out)
    text = out.getvalue()
    lines = text.splitlines()
    assert lines[0].startswith("Best: num_workers=2 is ")
    assert lines[-1].startswith("Runs and tune.json: ")  # a path: never wrapped
    assert max(len(ln) for ln in lines[:-1]) <= 120
    row = next(ln for ln in lines if ln.lstrip().startswith("num_workers=2"))
    assert "faster" in row and "×0." in row


def test_report_of_a_tune_folder_prints_its_table_again(workers_tune, tmp_path) -> None:
    tune_dir = workers_tune["dir"]
    res = trainprof("report", str(tune_dir), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("Best: num_workers=2 is ")
    assert f"trainprof report {tune_dir}/<trial>" in res.stderr
    res = trainprof("report", str(tune_dir), "--json", cwd=tmp_path)
    assert json.loads(res.stdout)["arms"] == workers_tune["doc"]["arms"]
    res = trainprof("report", str(tune_dir), "--html", cwd=tmp_path)
    assert res.returncode == 2 and "an HTML report is a run's" in res.stderr


def test_a_tune_folder_exports_to_tensorboards_hparams_dashboard(
    workers_tune, tmp_path: Path
) -> None:
    """Each trial a TensorBoard run tagged with its knob setting, the sweep's config above
    them, and the trial's mean step time as the metric HParams compares (read back with
    TensorBoard's own reader and its hparams plugin's parser)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata as hp_meta
    from tensorboard.util import tensor_util

    # the sweep copied from another machine: its trials found beside tune.json
    moved = tmp_path / "moved"
    shutil.copytree(workers_tune["dir"], moved)
    text = (moved / "tune.json").read_text()
    (moved / "tune.json").write_text(text.replace(str(workers_tune["dir"]), "/elsewhere/t"))
    res = trainprof("export", str(moved), "--tensorboard", str(tmp_path / "logs"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    root = tmp_path / "logs" / "moved"

    def read(folder: Path) -> EventAccumulator:
        acc = EventAccumulator(str(folder), size_guidance={"tensors": 0})
        acc.Reload()
        return acc

    config = read(root).PluginTagToContent("hparams")[hp_meta.EXPERIMENT_TAG]
    experiment = hp_meta.parse_experiment_plugin_data(config)
    (info,) = experiment.hparam_infos
    assert info.name == "num_workers"
    assert [v.string_value for v in info.domain_discrete.values] == ["0", "2"]
    assert "tune/mean_step_ms" in {m.name.tag for m in experiment.metric_infos}

    doc = workers_tune["doc"]
    for arm in doc["arms"]:
        for trial in arm["trials"]:
            name = Path(trial["run_dir"]).name
            acc = read(root / name)
            start = hp_meta.parse_session_start_info_plugin_data(
                acc.PluginTagToContent("hparams")[hp_meta.SESSION_START_INFO_TAG])
            assert start.hparams["num_workers"].string_value == arm["settings"]["num_workers"]
            assert start.group_name == name
            (event,) = acc.Tensors("tune/mean_step_ms")
            value = float(tensor_util.make_ndarray(event.tensor_proto))
            assert value == pytest.approx(trial["mean_s"] * 1e3, rel=1e-6)
            assert "step/time_ms" in acc.PluginTagToContent("scalars")
    # a perfetto export of the sweep names what to do instead
    from trainprof.commands import export_command

    with pytest.raises(UsageError, match="tune folder: export one of its trials"):
        export_command(moved, perfetto=tmp_path / "p.json")


def test_a_tune_folder_exports_to_wandb_as_a_group_of_trials(workers_tune, tmp_path: Path) -> None:
    """Each trial a W&B run in the sweep's group, its knob setting at the top of its config
    (what W&B's runs table and parallel coordinates compare) and its mean step time in its
    summary (offline runs read back from W&B's own files)."""
    pytest.importorskip("wandb")
    from test_export_wandb import wandb_env
    from wandb_records import offline_runs

    res = trainprof("export", str(workers_tune["dir"]), "--wandb", "sweeps", cwd=tmp_path,
                    env=wandb_env(tmp_path))
    assert res.returncode == 0, res.stderr
    name = workers_tune["dir"].name
    runs = {r.run.display_name: r for r in offline_runs(tmp_path)}
    trials = {f"{name}/{Path(t['run_dir']).name}": (arm, t)
              for arm in workers_tune["doc"]["arms"] for t in arm["trials"]}
    assert set(runs) == set(trials) and len(runs) == 4
    for label, (arm, trial) in trials.items():
        run = runs[label]
        assert run.run.run_group == name and run.run.job_type == "trial"
        assert run.config["num_workers"] == arm["settings"]["num_workers"]
        assert run.summary["tune/mean_step_ms"] == pytest.approx(trial["mean_s"] * 1e3,
                                                                 rel=1e-12)
        assert run.summary["trainprof/status"] == "finished"
        assert [r["trainprof/step"] for r in run.history if "step/time_ms" in r]
    assert "[4/4] W&B run" in res.stderr


def test_thread_knob_beats_the_script_and_ctrl_c_reports_what_was_done(tmp_path: Path) -> None:
    write_script(tmp_path, "train.py", THREADS)
    out = tmp_path / "t"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainprof", "tune", "--knob", "torch_threads=1,2",
         "--steps", "30", "--trials", "2", "--json", "--out", str(out), "train.py"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        stderr = ""
        while "ms/step" not in stderr:  # the first trial has finished
            line = proc.stderr.readline()
            assert line, stderr
            stderr += line
        # the second trial is training once its record holds steps
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            running = [p for p in out.glob("*/run.json")
                       if json.loads(p.read_text()).get("status") == "running"
                       and (p.parent / "steps.bin").stat().st_size > 0]
            if running:
                break
            time.sleep(0.05)
        assert running
        proc.send_signal(signal.SIGINT)
        stdout, rest = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr + rest
    doc = json.loads(stdout)
    assert doc["status"] == "interrupted"
    assert doc["trials_done"] == 1 and doc["trials_planned"] == 4
    assert "stopped after 1 of 4 trials" in doc["notes"][0]
    # the trial in flight stopped cleanly (the child closed its record) and is left out
    stopped = json.loads(running[0].read_text())
    assert stopped["status"] == "interrupted"
    trials = [t for arm in doc["arms"] for t in arm["trials"]]
    assert sorted(t["usable"] for t in trials) == [False, True]
    done = next(t for t in trials if t["usable"])
    arm = next(a for a in doc["arms"] if done in a["trials"])
    knob = int(arm["settings"]["torch_threads"])
    meta = json.loads((Path(done["run_dir"]) / "run.json").read_text())
    assert meta["training_thread"]["torch_num_threads"] == knob
    assert meta["knobs"]["process"] == {"torch_threads": knob}
    assert meta["knobs"]["script_calls_ignored"] == ["torch.set_num_threads(3)"]
    assert arm["actual"] == {"torch_threads": str(knob)}


def test_bad_knob_is_a_one_line_error(tmp_path: Path) -> None:
    write_script(tmp_path, "train.py", "print('never runs')\n")
    for knob, message in (
        ("workers=0,2", "unknown knob 'workers'"),
        ("num_workers=0,many", "bad value 'many' for knob num_workers"),
        ("num_workers", "--knob expects NAME=V1,V2"),
    ):
        res = trainprof("tune", "--knob", knob, "train.py", cwd=tmp_path, timeout=60)
        assert res.returncode == 2, res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
        assert "Traceback" not in res.stderr and res.stdout == ""
    assert not (tmp_path / "trainprof-runs").exists()


# --------------------------------------------------------------------------- arguments


def test_knob_arguments_are_checked_before_anything_runs(tmp_path: Path) -> None:
    knobs = parse_knobs(["num_workers=0,2", "pin_memory=false,true"])
    arms = build_arms(knobs)
    assert [a.name for a in arms] == [
        "num_workers=0 pin_memory=false", "num_workers=0 pin_memory=true",
        "num_workers=2 pin_memory=false", "num_workers=2 pin_memory=true",
    ]
    assert arms[3].overrides == {"num_workers": 2, "pin_memory": True}
    assert find_baseline(None, knobs, arms) is arms[0]
    assert find_baseline("pin_memory=1", knobs, arms) is arms[1]
    assert find_baseline("num_workers=2,pin_memory=true", knobs, arms) is arms[3]
    script = parse_knobs(["num_workers=script,4"])
    assert [a.overrides for a in build_arms(script)] == [{"num_workers": None},
                                                       {"num_workers": 4}]
    for bad, message in (
        (["num_workers=0,0"], "repeated"),
        (["num_workers=0"], "nothing to compare"),
        (["num_workers=1,2", "num_workers=3,4"], "given twice"),
        (["num_workers=0,,2"], "empty value"),
        (["torch_threads=0,1"], "integer ≥ 1"),
        ([f"num_workers={','.join(map(str, range(5)))}",
          f"torch_threads={','.join(map(str, range(1, 5)))}"], "combinations"),
    ):
        with pytest.raises(UsageError, match=message):
            build_arms(parse_knobs(bad))
    with pytest.raises(UsageError, match="not one of the values"):
        find_baseline("num_workers=4", knobs, arms)
    with pytest.raises(UsageError, match="of a tuned knob"):
        find_baseline("batch_size=4", knobs, arms)
    script_path = write_script(tmp_path, "train.py", "print('never runs')\n")
    with pytest.raises(UsageError, match="no such script"):
        tune_command("missing.py", [], module=False, knobs=["num_workers=0,1"], steps=5,
                     trials=1, json_out=True, out=tmp_path / "t", baseline=None)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(UsageError, match="not an empty folder"):
        tune_command(str(script_path), [], module=False, knobs=["num_workers=0,1"], steps=5,
                     trials=1, json_out=True, out=tmp_path / "full", baseline=None)


def test_schedule_runs_every_arm_once_per_round_in_a_seeded_shuffled_order() -> None:
    order = schedule(4, 3)
    assert order == schedule(4, 3)  # seeded
    rounds = [order[i:i + 4] for i in range(0, 12, 4)]
    for r, pairs in enumerate(rounds):
        assert sorted(a for a, _ in pairs) == [0, 1, 2, 3] and {t for _, t in pairs} == {r}
    assert len({tuple(a for a, _ in pairs) for pairs in rounds}) > 1  # not one fixed order


# --------------------------------------------------------------------------- knobs in-process


class _Data(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.zeros(2)


def test_dataloader_knobs_override_positional_and_keyword_arguments() -> None:
    original_init = DataLoader.__init__
    knobs = Knobs({"num_workers": 2, "prefetch_factor": 3, "pin_memory": True,
                   "batch_size": 16, "persistent_workers": True}).install()
    try:
        loader = DataLoader(_Data(), 4, False)  # batch_size by position
        sampled = DataLoader(_Data(), batch_sampler=[[0, 1], [2, 3]])
    finally:
        record = knobs.uninstall()
    assert DataLoader.__init__ is original_init
    assert (loader.batch_size, loader.num_workers, loader.prefetch_factor) == (16, 2, 3)
    assert loader.pin_memory is True and loader.persistent_workers is True
    assert record["dataloaders"][0]["script"]["batch_size"] == 4
    assert record["dataloaders"][1]["dropped"] == {"batch_size": "the script passes a "
                                                                 "batch_sampler"}
    assert sampled.batch_size is None and sampled.num_workers == 2
    plain = DataLoader(_Data(), batch_size=4)  # after uninstall: untouched
    assert plain.num_workers == 0 and plain.batch_size == 4


def test_a_loader_rebuilt_from_a_knobbed_one_keeps_its_batch_size() -> None:
    """accelerate rebuilds the Trainer's DataLoader from the first one's batch_sampler:
    the knob set the first, and the second batches by the same size (not a drop)."""
    knobs = Knobs({"batch_size": 16}).install()
    try:
        first = DataLoader(_Data(), batch_size=4, shuffle=True)
        rebuilt = DataLoader(_Data(), batch_sampler=first.batch_sampler)
        other = DataLoader(_Data(), batch_sampler=BatchSampler(range(64), 8, False))
    finally:
        record = knobs.uninstall()
    assert first.batch_size == 16 and len(next(iter(rebuilt))) == 16
    assert other.batch_sampler.batch_size == 8
    one, two, three = record["dataloaders"]
    assert one["set"] == {"batch_size": 16}
    assert two["dropped"] == {} and two["kept"] == {
        "batch_size": "its batch_sampler already batches so"}
    assert three["dropped"] == {"batch_size": "the script passes a batch_sampler"}
    # what the arm ran with, read back: the batch_sampler's size where batch_size is None
    meta = {"dataloaders": [{"batch_size": None, "batch_sampler_batch_size": 16}]}
    assert tune_mod._actual("batch_size", meta) == "16"


def test_no_workers_drops_what_torch_would_refuse() -> None:
    knobs = Knobs({"num_workers": 0, "persistent_workers": True}).install()
    try:
        # the script's own prefetch_factor / persistent_workers are invalid without workers
        loader = DataLoader(_Data(), batch_size=4, num_workers=4, prefetch_factor=4,
                            persistent_workers=True)
    finally:
        record = knobs.uninstall()
    assert loader.num_workers == 0 and loader.prefetch_factor is None
    assert loader.persistent_workers is False
    (entry,) = record["dataloaders"]
    assert entry["set"] == {"num_workers": 0}
    assert entry["dropped"] == {"persistent_workers": "needs num_workers > 0"}
    assert entry["reset"] == {"prefetch_factor": None, "persistent_workers": False}
    assert entry["script"] == {"num_workers": 4, "persistent_workers": True,
                               "prefetch_factor": 4}
    assert len(list(loader)) == 16  # torch accepts the loader as rewritten


def test_thread_and_gc_knobs_apply_and_are_undone() -> None:
    import gc

    threads, threshold = torch.get_num_threads(), gc.get_threshold()
    setter = torch.set_num_threads
    knobs = Knobs({"torch_threads": 1, "gc_threshold": 5000}).install()
    try:
        torch.set_num_threads(2)  # the script's call: ignored
        assert torch.get_num_threads() == 1
        assert gc.get_threshold() == (5000, *threshold[1:])
    finally:
        record = knobs.uninstall()
        torch.set_num_threads(threads)
    assert torch.set_num_threads is setter and gc.get_threshold() == threshold
    assert record["process"] == {"torch_threads": 1, "gc_threshold": [5000, *threshold[1:]]}
    assert record["script_calls_ignored"] == ["torch.set_num_threads(2)"]


def test_gc_freeze_freezes_once_after_the_first_optimizer_step() -> None:
    import gc

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = gc.get_freeze_count()  # frozen by a library already (375 on Python 3.12)
    knobs = Knobs({"gc_freeze": True}).install()
    try:
        assert gc.get_freeze_count() == before
        for _ in range(3):
            model(torch.ones(2)).sum().backward()
            opt.step()
        frozen = gc.get_freeze_count() - before
        assert frozen > 1000  # everything alive after set-up: modules, torch, the test run
    finally:
        record = knobs.uninstall()
    # counted at the freeze; frozen objects that died since have left the count
    assert record["process"]["gc_freeze"]["frozen_objects"] >= frozen
    if before == 0:
        assert gc.get_freeze_count() == 0  # undone
    else:  # left frozen rather than undo the library's own freeze
        assert gc.get_freeze_count() >= before


def test_knobs_env_var_round_trip_and_no_cost_without_it(monkeypatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert install_knobs() is None
    text = encode({"num_workers": 2, "pin_memory": True, "prefetch_factor": None})
    assert decode(text) == {"num_workers": 2, "pin_memory": True}
    for bad in ("{", "[1]", '{"num_workers": -1}', '{"threads": 2}'):
        with pytest.raises(UsageError):
            decode(bad)


# --------------------------------------------------------------------------- statistics


def test_two_level_interval_covers_the_truth_and_is_seeded() -> None:
    rng = np.random.default_rng(0)
    base = [rng.normal(10.0, 0.5, 40) for _ in range(3)]
    same = [rng.normal(10.0, 0.5, 40) for _ in range(3)]
    half = [rng.normal(5.0, 0.25, 40) for _ in range(3)]
    lo, hi = ratio_ci(base, same)
    assert lo < 1 < hi
    lo, hi = ratio_ci(base, half)
    assert lo < 0.5 < hi < 0.9
    assert ratio_ci(base, half) == (lo, hi)


def test_two_level_interval_includes_run_to_run_variation() -> None:
    """Trials that disagree (a busy machine) must widen the interval; pooled steps would not."""
    rng = np.random.default_rng(0)
    # three trials per arm whose medians move by up to 7% from one trial to the next
    base = [rng.normal(m, 0.3, 60) for m in (10.0, 10.6, 10.3)]
    arm = [rng.normal(m, 0.3, 60) for m in (9.7, 10.4, 10.0)]
    pooled = bootstrap_ratio_ci(np.concatenate(base), np.concatenate(arm))
    two_level = ratio_ci(base, arm)
    assert pooled[1] < 0.99  # steps alone: "significantly faster"
    assert two_level[0] < 1 < two_level[1]  # with the trials' disagreement: not shown
    assert (two_level[1] - two_level[0]) > 2 * (pooled[1] - pooled[0])


def _rounds(rng: np.random.Generator, shared_sd: float, trial_sd: float, ratio: float,
            k: int = 3, steps: int = 40) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Two arms' trials in ``k`` rounds: a round effect both arms share (the machine drifting
    between rounds, a slower node), an effect of each trial alone, and step noise."""
    shared = 1 + rng.normal(0, shared_sd, k)
    base = [rng.normal(10 * shared[r] * (1 + rng.normal(0, trial_sd)), 0.5, steps)
            for r in range(k)]
    arm = [rng.normal(10 * ratio * shared[r] * (1 + rng.normal(0, trial_sd)), 0.5, steps)
           for r in range(k)]
    return base, arm


def test_pairing_by_round_cancels_what_a_round_did_to_every_arm() -> None:
    """Rounds 15% apart (both arms alike), the arm 4% faster in every round: unpaired, the
    rounds' spread hides it; paired, it is shown, with the truth inside."""
    base, arm = _rounds(np.random.default_rng(5), shared_sd=0.1, trial_sd=0.0, ratio=0.96,
                        k=4)
    lo_u, hi_u = ratio_ci(base, arm)
    lo_p, hi_p = ratio_ci(base, arm, paired=True)
    assert lo_u < 1 < hi_u
    assert lo_p < 0.96 < hi_p < 0.99
    assert (hi_u - lo_u) > 3 * (hi_p - lo_p)
    assert ratio_ci(base, arm, paired=True) == (lo_p, hi_p)  # seeded
    with pytest.raises(ValueError, match="one trial per round"):
        ratio_ci(base, arm[:3], paired=True)


@pytest.mark.parametrize(("shared_sd", "trial_sd"), [(0.0, 0.0), (0.0, 0.03), (0.1, 0.0)])
def test_paired_intervals_cover_the_truth_as_often_as_unpaired_ones(shared_sd, trial_sd) -> None:
    """Coverage of the true ratio (1) over 100 simulated sweeps of 3 rounds, as measured:
    when nothing but the steps varies, 98 of 100 for both; when each trial varies on its own
    by 3%, 79 unpaired and 76 paired (3 trials are few: the percentile bootstrap of so few
    clusters covers less than 95%, paired or not); when the rounds differ by 10%, 98 paired,
    and 100 unpaired with an interval ~7x as wide."""
    rng = np.random.default_rng(11)
    hits = {False: 0, True: 0}
    width = {False: 0.0, True: 0.0}
    for rep in range(100):
        base, arm = _rounds(rng, shared_sd, trial_sd, ratio=1.0)
        for paired in (False, True):
            lo, hi = ratio_ci(base, arm, n_boot=500, seed=rep, paired=paired)
            hits[paired] += lo <= 1.0 <= hi
            width[paired] += hi - lo
    assert hits[True] >= hits[False] - 8
    assert hits[True] >= (88 if trial_sd == 0 else 70)
    if shared_sd:
        assert width[False] > 4 * width[True]


def _trial(arm: int, trial: int, dur: np.ndarray, samples: int, tmp: Path) -> Trial:
    t = Trial(arm, trial, tmp / f"{arm}-{trial}", status="finished", exit_code=0,
              count=len(dur), dur_s=dur, samples=np.full(len(dur), float(samples)))
    return t


def test_batch_size_arms_are_compared_per_sample(tmp_path: Path) -> None:
    knobs = parse_knobs(["batch_size=8,32"])
    arms = build_arms(knobs)
    rng = np.random.default_rng(2)
    trials = []
    for t in range(2):
        # 8 samples in 10 ms vs 32 samples in 20 ms: steps slower, samples 2x faster
        trials.append(_trial(0, t, rng.normal(0.010, 0.0002, 30), 8, tmp_path))
        trials.append(_trial(1, t, rng.normal(0.020, 0.0004, 30), 32, tmp_path))
    doc = analyse_tune(arms, trials, arms[0], steps=30)
    assert doc["metric"] == "time_per_sample"
    big = doc["arms"][1]
    assert big["ratio"] == pytest.approx(0.5, rel=0.03)
    assert big["verdict"] == "faster" and doc["best"]["name"] == "batch_size=32"
    assert big["samples_per_s_ratio"] == pytest.approx(2.0, rel=0.03)
    assert big["mean_s"] == pytest.approx(0.020, rel=0.03)  # the step itself is slower
    # a crashed trial is reported and left out
    trials.append(Trial(1, 2, tmp_path / "1-2", status="crashed", exit_code=1))
    doc = analyse_tune(arms, trials, arms[0], steps=30)
    assert doc["arms"][1]["trials_usable"] == 2 and doc["arms"][1]["trials_run"] == 3
    assert any("crashed, exit code 1" in n for n in doc["notes"])


def test_no_difference_when_the_change_is_within_noise(tmp_path: Path) -> None:
    arms = build_arms(parse_knobs(["pin_memory=false,true"]))
    rng = np.random.default_rng(3)
    trials = [_trial(a, t, rng.normal(0.010, 0.001, 40), 8, tmp_path)
              for t in range(3) for a in range(2)]
    doc = analyse_tune(arms, trials, arms[1], steps=40)  # --baseline pin_memory=true
    assert doc["baseline"] == "pin_memory=true"
    assert doc["arms"][0]["verdict"] == "no_difference" and doc["best"] is None
    out = io.StringIO()
    render_tune(doc, out)
    assert out.getvalue().startswith("No arm is significantly faster than the baseline "
                                     "pin_memory=true")


def test_arms_are_paired_by_round_unless_a_trial_failed(tmp_path: Path) -> None:
    """Three rounds, each 10-25% slower than the last for both arms, the arm 5% faster in each:
    paired, the interval shows it; with the arm's second trial crashed, the interval is the
    unpaired one, the row says so and a note says why."""
    arms = build_arms(parse_knobs(["pin_memory=false,true"]))
    rng = np.random.default_rng(6)
    trials = []
    for t, drift in enumerate((1.0, 1.25, 1.1)):
        trials.append(_trial(0, t, rng.normal(0.010 * drift, 0.0002, 40), 8, tmp_path))
        trials.append(_trial(1, t, rng.normal(0.0095 * drift, 0.0002, 40), 8, tmp_path))
    doc = analyse_tune(arms, trials, arms[0], steps=40)
    row = doc["arms"][1]
    assert row["paired"] is True and row["verdict"] == "faster"
    assert row["ci"][0] < 0.95 < row["ci"][1] < 0.98
    assert "the same rounds" in doc["bootstrap"]["method"]
    trials[3] = Trial(1, 1, tmp_path / "1-1b", status="crashed", exit_code=1)
    doc = analyse_tune(arms, trials, arms[0], steps=40)
    row = doc["arms"][1]
    assert row["paired"] is False and row["trials_usable"] == 2
    assert any("not paired by round" in n for n in doc["notes"])


def test_a_dataloader_knob_in_a_script_without_a_dataloader_gets_no_verdict(tmp_path):
    """prefetch_factor=2,4 on a script that makes no DataLoader: the arms are the same runs,
    and one noisy trial each said "×1.17 as fast"."""
    from trainprof.experiments.verify import judge

    arms = build_arms(parse_knobs(["prefetch_factor=2,4"]))
    rng = np.random.default_rng(9)
    trials = [_trial(0, 0, rng.normal(0.012, 0.0003, 20), 8, tmp_path),
              _trial(1, 0, rng.normal(0.010, 0.0003, 20), 8, tmp_path)]
    for t in trials:
        t.meta = {"knobs": {"requested": {"prefetch_factor": 2 + 2 * t.arm},
                            "dataloaders": []}}
    doc = analyse_tune(arms, trials, arms[0], steps=20)
    assert doc["arms"][1]["verdict"] == "no_effect" and doc["best"] is None
    assert any("the script created no DataLoader" in n for n in doc["notes"])
    assert judge({"estimated_gain": 0.2}, doc)["verdict"] == "not applicable"


def test_trials_that_disagree_are_noted_in_the_users_words(tmp_path: Path) -> None:
    arms = build_arms(parse_knobs(["num_workers=0,2"]))
    rng = np.random.default_rng(5)
    trials = [_trial(a, t, rng.normal(0.010 * (1 + 0.3 * t), 0.0002, 20), 8, tmp_path)
              for a in range(2) for t in range(2)]
    notes = analyse_tune(arms, trials, arms[0], steps=20)["notes"]
    spread = [n for n in notes if "trials' mean step times differ by" in n]
    assert spread and all(n.endswith("the interval allows for it, but with few trials only "
                                      "in part: more --trials make a verdict surer")
                          for n in spread)
    assert not any(".py" in n for n in notes)  # no source file named to the user


def test_alternating_step_times_are_compared_by_their_mean(tmp_path: Path) -> None:
    """Workers deliver batches in turn: 20, 6, 20, 6 ms. The median picks a mode by chance."""
    arms = build_arms(parse_knobs(["num_workers=0,2"]))
    rng = np.random.default_rng(4)
    base = [_trial(0, t, rng.normal(0.028, 0.001, 21), 8, tmp_path) for t in range(2)]
    # one more slow step in trial 1, one more fast step in trial 2: medians 20 ms and 6 ms
    alt = [np.array([0.020, 0.006] * 10 + [0.020]), np.array([0.006, 0.020] * 10 + [0.006])]
    two = [_trial(1, t, x + rng.normal(0, 0.0003, 21), 8, tmp_path) for t, x in enumerate(alt)]
    doc = analyse_tune(arms, base + two, arms[0], steps=21)
    row = doc["arms"][1]
    medians = [float(np.median(t.dur_s)) for t in two]
    assert medians[0] > 0.019 and medians[1] < 0.008
    assert row["mean_s"] == pytest.approx(0.013, rel=0.03)
    assert row["ratio"] == pytest.approx(0.013 / 0.028, rel=0.03)
    lo, hi = row["ci"]
    assert row["verdict"] == "faster" and hi - lo < 0.15
    assert not any("differ by" in n for n in doc["notes"])  # the trials agree


def test_the_help_lists_every_knob_with_its_text_apart(tmp_path):
    """A name longer than the column ran into its text ("activation_checkpointingtorch...")."""
    import re

    from trainprof.capture.knobs import KNOBS

    res = trainprof("tune", "--help", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    for name, spec in KNOBS.items():
        assert re.search(rf"^  {name}  +{re.escape(spec.help[:20])}", res.stdout, re.M), name


def test_an_arm_whose_rounds_disagree_by_far_gets_no_verdict(tmp_path: Path) -> None:
    """A verify of 2 trials a side where a burst of outside load hit the baseline's first
    trial (a few steps of seconds: its mean 1.19 s against a median of 168 ms) said
    "confirmed, ×0.20 (95% CI ×0.10-×0.81), 80% saved"; the steps' medians said ×0.86. Its
    rounds' ratios are ×0.12 and ×0.80: the size of the change is unsettled."""
    from trainprof.experiments.verify import judge
    from trainprof.report.verify_terminal import verdict_line

    arms = build_arms(parse_knobs(["compile=false,true"]))
    rng = np.random.default_rng(8)
    disturbed = rng.normal(0.168, 0.004, 20)
    disturbed[[3, 9, 15]] = (6.2, 6.5, 7.0)
    trials = [_trial(0, 0, disturbed, 8, tmp_path),
              _trial(1, 0, rng.normal(0.144, 0.004, 20), 8, tmp_path),
              _trial(0, 1, rng.normal(0.181, 0.004, 20), 8, tmp_path),
              _trial(1, 1, rng.normal(0.144, 0.004, 20), 8, tmp_path)]
    # the disturbed trial's own record: another process on one of the 2 cores
    trials[0].summary = {"system": {"sys_cpu_pct": 100.0, "proc_cpu_pct": 100.0,
                                    "workers_cpu_pct": 0.0},
                         "environment": {"usable_cores": 2}}
    doc = analyse_tune(arms, trials, arms[0], steps=20)
    assert "compile=false trial 1: other processes kept ~1.0 cores busy while it ran" in (
        doc["notes"])
    row = doc["arms"][1]
    assert row["paired"] and row["ratio"] < 0.25 and row["ci"][1] < 1  # the interval alone
    assert row["round_ratios"] == [pytest.approx(0.144 / disturbed.mean(), rel=0.05),
                                   pytest.approx(0.80, rel=0.05)]
    assert row["verdict"] == "unsettled" and doc["best"] is None
    assert any("the size of the change is unsettled" in n for n in doc["notes"])
    out = io.StringIO()
    render_tune(doc, out)
    # its interval excludes ×1: "no arm is significantly faster" would contradict it
    head = " ".join(out.getvalue().split("\n\n")[0].split())
    assert head.startswith("No arm is settled as faster than the baseline compile=false: "
                           "compile=true ran at ×0.")
    assert "; 1 trial ran while other processes kept up to ~1.0 cores busy" in head, head
    result = judge({"estimated_gain": 0.0, "evidence": {"gain_unknown": True}}, doc)
    assert result["verdict"] == "unsettled"
    line = verdict_line({**result, "metric": "step_time"}).plain
    assert "by round ×0.1" in line and "rerun with more --trials" in line
    assert "far slower than the others: 1 trial ran while other processes kept up to ~1.0 " \
        "cores busy)" in line
    assert "saved" not in line
    # not significant either way, yet the rounds disagree: unsettled too, not "×2.00"
    three = []
    for t, (base, arm) in enumerate(((0.005, 0.0123), (0.0071, 0.0049), (0.0092, 0.0049))):
        three.append(_trial(0, t, rng.normal(base, 0.0001, 30), 8, tmp_path))
        three.append(_trial(1, t, rng.normal(arm, 0.0001, 30), 8, tmp_path))
    row = analyse_tune(arms, three, arms[0], steps=30)["arms"][1]
    assert row["round_ratios"] == [pytest.approx(r, rel=0.05) for r in (2.46, 0.69, 0.53)]
    assert row["verdict"] == "unsettled"
    # five rounds or more: the bootstrap over the rounds judges, whatever one round did
    more = trials + [_trial(a, t, rng.normal(0.181 if a == 0 else 0.144, 0.004, 20), 8,
                            tmp_path) for t in (2, 3, 4) for a in (0, 1)]
    row = analyse_tune(arms, more, arms[0], steps=20)["arms"][1]
    assert row["verdict"] == "faster"


def test_the_headline_and_table_of_an_unsettled_arm_under_load(monkeypatch) -> None:
    """An unsettled arm whose interval excludes ×1 is not "not significantly faster": it is
    not settled; the trials flagged under outside load are counted in the verdict; and an
    arm's settings never break inside one ("autocast=bf1" / "6") at 100 columns."""
    from trainprof.report.tune_terminal import headline

    def arm(name, verdict, ratio, ci, base=False, load=None):
        return {"name": name, "baseline": base,
                "actual": dict(p.split("=") for p in name.split()), "trials_usable": 3,
                "trials_run": 3, "steady_steps": 150, "mean_s": 0.0123, "median_s": 0.012,
                "samples_per_s": 1300.0, "ratio": ratio, "ci": ci, "verdict": verdict,
                "outside_load": load}

    doc = {"baseline": "autocast=false channels_last=true", "best": None, "confidence": 0.95,
           "metric": "step_time", "target": "train.py", "design": "full", "trials_per_arm": 3,
           "steps": 50, "trials_done": 12, "trials_planned": 12, "status": "finished",
           "practical_threshold_pct": 2, "tune_dir": "/tmp/t", "notes": [], "arms": [
               arm("autocast=false channels_last=true", "baseline", 1.0, None, True),
               arm("autocast=bf16 channels_last=true", "unsettled", 0.8, [0.7, 0.9],
                   load={"trials": 2, "max_cores": 1.3}),
               arm("autocast=bf16 channels_last=false", "no_difference", 0.98, [0.93, 1.03])]}
    assert headline(doc).plain == (
        "No arm is settled as faster than the baseline autocast=false channels_last=true: "
        "autocast=bf16 channels_last=true ran at ×0.80 (95% CI ×0.70–×0.90), but its trials "
        "disagree too much to size the change; 2 trials ran while other processes kept up to "
        "~1.3 cores busy")
    doc["arms"][1].update(verdict="no_difference", outside_load=None)
    assert headline(doc).plain == ("No arm is significantly faster than the baseline "
                                   "autocast=false channels_last=true")
    monkeypatch.setenv("COLUMNS", "100")
    out = io.StringIO()
    render_tune(doc, out)
    words = out.getvalue().split()
    for setting in ("autocast=false", "channels_last=true", "autocast=bf16", "channels_last=false"):
        assert setting in words, out.getvalue()


def test_one_trial_a_side_gets_no_verdict(tmp_path: Path) -> None:
    """``verify --trials 1`` said "beyond the bound ... ×0.73 (95% CI ×0.72–×0.74)" where one
    setting's trial means differed by 43-52% between trials, and Ctrl-C after the first
    round said "confirmed": an interval over one trial's steps is blind to the noise
    between trials, so neither side of one trial gets a verdict."""
    from trainprof.experiments.verify import judge
    from trainprof.report.tune_terminal import headline
    from trainprof.report.verify_terminal import verdict_line

    arms = build_arms(parse_knobs(["num_workers=0,4"]))
    rng = np.random.default_rng(11)
    trials = [_trial(0, 0, rng.normal(0.0100, 0.0001, 40), 8, tmp_path),
              _trial(1, 0, rng.normal(0.0073, 0.0001, 40), 8, tmp_path)]
    doc = analyse_tune(arms, trials, arms[0], steps=40)
    row = doc["arms"][1]
    assert row["ci"][1] < 0.75  # the interval alone: within the one trial, tight
    assert row["verdict"] == "unsettled" and row["unsettled_by"] == "one_trial"
    assert doc["best"] is None
    assert ("num_workers=4: num_workers=4 and the baseline num_workers=0 have one usable "
            "trial, so its interval covers the steps within a trial only, not the noise "
            "between trials (trials of one setting can differ by tens of percent): it gets "
            "no verdict; run --trials 2 or more") in doc["notes"]
    assert headline(doc).plain.startswith(
        "No arm is settled as faster than the baseline num_workers=0: num_workers=4 ran at "
        "×0.73 (95% CI within one trial ×0.7")
    assert headline(doc).plain.endswith(
        "but one trial a side cannot tell a change from the noise between trials")
    result = judge({"estimated_gain": 0.2, "verify": "trainprof tune --knob num_workers=0,4 "
                    "t.py"}, doc)
    assert result["verdict"] == "unsettled" and result["unsettled_by"] == "one_trial"
    line = verdict_line({**result, "metric": "step_time"}).plain
    assert line.startswith("Verdict: unsettled - num_workers=4 ran at ×0.73 of the baseline's "
                           "step time (one trial a side: its 95% CI ×0.7")
    assert "is within that trial only)" in line
    assert line.endswith("one trial per arm cannot tell the fix from the noise between trials "
                         "(trials of one setting can differ by tens of percent): rerun with "
                         "--trials 3 or more")
    assert "saved" not in line and "far slower" not in line
    # Ctrl-C in the second round: its trials cut short are left out, one usable trial a side
    trials += [Trial(0, 1, tmp_path / "0-1", status="interrupted", exit_code=130,
                     stopped=True)]
    doc = analyse_tune(arms, trials, arms[0], steps=40)
    assert doc["arms"][1]["verdict"] == "unsettled" and doc["best"] is None
    # two trials of the baseline do not settle an arm of one
    trials[2] = _trial(0, 1, rng.normal(0.0100, 0.0001, 40), 8, tmp_path)
    doc = analyse_tune(arms, trials, arms[0], steps=40)
    assert doc["arms"][1]["unsettled_by"] == "one_trial"
    assert any(n.startswith("num_workers=4: num_workers=4 has one usable trial")
               for n in doc["notes"])
    # a second round settles it
    trials.append(_trial(1, 1, rng.normal(0.0073, 0.0001, 40), 8, tmp_path))
    doc = analyse_tune(arms, trials, arms[0], steps=40)
    assert doc["arms"][1]["verdict"] == "faster" and doc["arms"][1]["unsettled_by"] is None
    assert doc["best"]["name"] == "num_workers=4"


def test_no_arm_is_best_while_an_unsettled_one_ran_faster(tmp_path: Path) -> None:
    """"Best: num_workers=1 is 1.90× as fast" while num_workers=4 ran at ×0.30 (95% CI
    ×0.13–×0.43), unsettled: the best named was not the fastest arm measured."""
    from trainprof.report.tune_terminal import headline

    arms = build_arms(parse_knobs(["num_workers=0,1,4"]))
    rng = np.random.default_rng(12)
    trials = []
    for t, four in enumerate((0.0015, 0.0045, 0.0030)):  # its rounds: ×0.15, ×0.45, ×0.30
        trials.append(_trial(0, t, rng.normal(0.0100, 0.0001, 40), 8, tmp_path))
        trials.append(_trial(1, t, rng.normal(0.0053, 0.0001, 40), 8, tmp_path))
        trials.append(_trial(2, t, rng.normal(four, 0.00003, 40), 8, tmp_path))
    doc = analyse_tune(arms, trials, arms[0], steps=40)
    one, four = doc["arms"][1], doc["arms"][2]
    assert one["verdict"] == "faster" and four["verdict"] == "unsettled"
    assert four["ratio"] < one["ratio"] and doc["best"] is None
    assert four["unsettled_by"] == "spread"
    text = headline(doc).plain
    assert text.startswith("No arm is settled as the fastest: num_workers=4 ran at ×0.30 of "
                           "the baseline num_workers=0 (95% CI ×0.")
    assert ("but its trials disagree too much to size the change; num_workers=1 is settled "
            "as faster: 1.8") in text and "as fast (mean time per step ×0.53, 95% CI ×0.5" in text
    assert "Best" not in text
    # an unsettled arm slower than the best leaves the best the best
    for t in trials:
        if t.arm == 2:
            t.dur_s = t.dur_s * 2.5  # rounds at ×0.38, ×1.13, ×0.75: unsettled, slower
    doc = analyse_tune(arms, trials, arms[0], steps=40)
    assert doc["arms"][2]["verdict"] == "unsettled"
    assert doc["best"]["name"] == "num_workers=1"
    assert headline(doc).plain.startswith("Best: num_workers=1 is 1.8")


def test_the_header_says_steps_are_a_cap_and_where_the_script_ended_trials(tmp_path) -> None:
    """"2 arms × 3 trials of 60 steps" over a script whose own --steps 40 ended each trial
    sooner (16-37 steady steps seen): --steps is a cap, and the trials tell the rest."""
    from trainprof.experiments.tune import _result_text, plan_text

    assert plan_text(2, 3, 60) == ("trainprof tune: 2 arms × 3 trials of up to 60 steps, in "
                                   "shuffled rounds")
    arms = build_arms(parse_knobs(["num_workers=0,2"]))
    rng = np.random.default_rng(13)
    trials = [_trial(a, t, rng.normal(0.010, 0.0002, 37), 8, tmp_path)
              for t in range(2) for a in range(2)]
    for t in trials:
        t.count = 40  # the script's own loop: 40 steps, 3 of them warm-up
    trials[1].count = 38
    assert _result_text(trials[0], 60).endswith("(37 steady steps; the script ended after "
                                                "40 steps)")
    assert _result_text(trials[0], 40) == _result_text(trials[0])  # ran to the cap
    doc = analyse_tune(arms, trials, arms[0], steps=60)
    assert doc["script_ended_after"] == [38, 40]
    doc.update(target="train.py", design="one knob", trials_per_arm=2, steps=60,
               trials_done=4, trials_planned=4, status="finished", tune_dir="T")
    out = io.StringIO()
    render_tune(doc, out)
    assert ("train.py: 2 arms (one knob), 2 trials each of up to 60 steps (the script ended "
            "them after 38–40 steps); 4/4 trials run") in " ".join(out.getvalue().split())
    for t in trials:
        t.count = 60
    assert analyse_tune(arms, trials, arms[0], steps=60)["script_ended_after"] is None


def test_a_long_trial_marks_its_progress_line_while_it_runs(tmp_path, monkeypatch):
    """A trial slowed 80-fold by another process's load ran 84 s with nothing printed after
    its "trial 1/3 …": the line gets the seconds so far every TICK_S."""
    import sys

    from trainprof.experiments import tune
    from trainprof.experiments.tune import Trial, run_trial

    monkeypatch.setattr(tune, "TICK_S", 0.25)
    trial = Trial(0, 0, tmp_path / "t", stopped=True)
    ticks: list[float] = []
    run_trial(trial, [sys.executable, "-c", "import time; time.sleep(0.9)"], {},
              tick=ticks.append)
    assert len(ticks) >= 2 and ticks == sorted(ticks) and ticks[0] >= 0.25
    assert trial.exit_code == 0
