"""Throughput and the hand-over row with an evaluation loader iterated inside the loop.

One real run, shared by the tests: a training loader of batch 32 (2 workers) for 60
steps, and every 10 steps a pass over an evaluation loader of 2 batches of 100 (1
worker). The step record counts every batch any loader returned, so the evaluation's
200 samples land in every 10th step.
"""

from __future__ import annotations

import pytest
from conftest import trainprof, write_script

from trainprof.analysis.steps import complete_steps
from trainprof.store import load_run

TRAIN_EVAL = """
import torch
from torch.utils.data import DataLoader, TensorDataset

train = DataLoader(TensorDataset(torch.randn(60 * 32, 16), torch.randn(60 * 32, 1)),
                   batch_size=32, num_workers=2, persistent_workers=True)
val = DataLoader(TensorDataset(torch.randn(200, 16), torch.randn(200, 1)),
                 batch_size=100, num_workers=1)
model = torch.nn.Linear(16, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step, (x, y) in enumerate(train, 1):
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step(); opt.zero_grad()
    if step % 10 == 0:
        with torch.no_grad():
            for a, b in val:
                model(a)
"""


@pytest.fixture(scope="module")
def train_eval(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("train_eval")
    write_script(cwd, "train.py", TRAIN_EVAL)
    res = trainprof("run", "--json", "train.py", cwd=cwd)
    assert res.returncode == 0, res.stderr
    return res


def test_samples_per_s_counts_only_the_training_loaders_samples(train_eval):
    summary = train_eval.json()
    run = load_run(train_eval.run_dir)
    steps = summary["steps"]
    assert steps["count"] == 60
    steady = complete_steps(run.steps)[steps["warmup"]:]
    steady_s = float(steady["dur_ns"].sum()) / 1e9
    evals = int((steady["samples"] > 32).sum())
    assert evals >= 3  # evaluation passes inside the steady window
    # every training step brings 32 samples: the rate is 32 a step over the steady time
    assert summary["samples_per_s"] == pytest.approx(32 * len(steady) / steady_s, rel=1e-9)
    assert summary["samples_per_s"] == pytest.approx(32 * summary["steps_per_s"], rel=1e-9)
    # the evaluation's 2 x 100 samples a pass were left out, and said so
    assert summary["samples_other_loaders"] == 200 * evals
    assert int(steady["samples"].sum()) == 32 * len(steady) + 200 * evals


def test_the_terminal_report_says_other_loaders_samples_were_left_out(train_eval):
    res = trainprof("report", str(train_eval.run_dir), cwd=train_eval.run_dir.parent)
    assert res.returncode == 0, res.stderr
    evals = train_eval.json()["samples_other_loaders"] // 200
    row = next(line for line in res.stdout.splitlines() if "samples/s" in line)
    assert f"{200 * evals:,} samples of other loaders left out" in row
    html = train_eval.run_dir.parent / "report.html"
    res = trainprof("report", str(train_eval.run_dir), "--html", str(html),
                    cwd=train_eval.run_dir.parent)
    assert res.returncode == 0, res.stderr
    assert f"{200 * evals:,} samples of other loaders left out" in html.read_text()


def test_the_hand_over_row_is_per_loader(train_eval):
    from trainprof.report.terminal import worker_rows

    summary = train_eval.json()
    handoff = summary["batch_handoff"]
    rows = dict(worker_rows(summary.get("workers"), summary["dataloaders"], handoff))
    # 60 training batches of (x, y) and 6 evaluation passes of 2 batches of (x, y)
    assert rows["Hand-over #0"].startswith("120 tensors (2 a batch)")
    assert rows["Hand-over #1"].startswith("24 tensors (2 a batch)")
    assert "Hand-over" not in rows  # no pooled row beside them
    for index in (0, 1):
        own = next(e for e in handoff["loaders"] if e["loader_index"] == index)
        assert f"training thread {own['training_thread_share'] * 100:.1f}%" in rows[
            f"Hand-over #{index}"]
    # a record made before the capture kept loaders apart: the pooled row, as before
    pooled = dict(worker_rows(summary.get("workers"), summary["dataloaders"],
                              {**handoff, "loaders": []}))
    assert pooled["Hand-over"].startswith("144 tensors")
    assert not any(k.startswith("Hand-over #") for k in pooled)
