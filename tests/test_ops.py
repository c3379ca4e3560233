"""Torch calls per step by call site, and the python_loop finding they lead to."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import trainprof, write_script

from trainprof.analysis.ops import _match_dim, load_ops

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "python_loop.py"


@pytest.mark.parametrize(
    ("calls", "shape", "expected"),
    [
        (64.0, [8, 64, 96], (1, 64)),  # logits[:, t] over T=64
        (128.0, [8, 64, 96], (1, 64)),  # two slices per iteration
        (96.0, [8, 64, 96], (2, 96)),  # the largest matching size wins
        (48.0, [8, 64], None),  # no dimension fits
        (6.0, [6, 6], None),  # too few trips to be a loop worth a finding
        (64.5, [64], None),  # not a whole count per step
    ],
)
def test_match_dim(calls, shape, expected) -> None:
    assert _match_dim(calls, shape) == expected


def _run_example(tmp_path: Path, *args: str) -> dict:
    script = tmp_path / "python_loop.py"
    shutil.copy(EXAMPLE, script)
    res = trainprof("run", "--json", "python_loop.py", "--steps", "14", *args, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    return res.json()


def test_per_token_loss_loop_is_found_and_named(tmp_path: Path) -> None:
    summary = _run_example(tmp_path)
    ops = summary["ops"]
    assert ops["steps_sampled"] == 2
    loop = ops["loops"][0]
    source = (tmp_path / "python_loop.py").read_text().splitlines()
    assert "F.cross_entropy(logits[:, t], y[:, t])" in source[loop["line"] - 1]
    assert loop["trips_per_step"] == 64 and loop["axis"] == 1
    assert loop["arg_shape"] == [8, 64, 96]
    # per position: two slices, one cross_entropy, one add
    assert loop["line_calls_per_step"] == 4 * 64
    finding = summary["findings"][0]
    assert finding["category"] == "python_loop"
    assert finding["evidence"]["trips_per_step"] == 64
    assert finding["evidence"]["where"].endswith(f"python_loop.py:{loop['line']}")
    assert "cross_entropy(logits.reshape" in finding["fix"]["snippet"]
    assert 0.05 < finding["estimated_gain"] <= 1.0
    # counted calls, not timed ones: an estimate, said as one (its fix measured past it)
    from trainprof.report.impact import impact_text

    assert impact_text(finding).startswith("could save about ")
    assert impact_text(finding).endswith("(an estimate: often more)")
    # the optimizer's own per-parameter loop is not taken for the user's loop
    assert ops["loops"] == [lp for lp in ops["loops"] if lp["source"] != "opt.step()"]
    on_disk = json.loads((tmp_path / "run" / "ops.json").read_text())
    assert on_disk["optimizer_calls_per_step"] > 0


def test_vectorized_loss_has_no_loop(tmp_path: Path) -> None:
    summary = _run_example(tmp_path, "--vectorized")
    assert summary["ops"]["loops"] == []
    assert not [f for f in summary["findings"] if f["category"] == "python_loop"]
    # steps 8 and 9 were sampled, and are left out of the statistics
    assert summary["steps"]["profiled"] == 3  # and step 10, which carries the stop


def test_no_sample_in_a_run_shorter_than_the_window(tmp_path: Path) -> None:
    summary = _run_example(tmp_path, "--steps", "5")
    assert summary["ops"] is None
    assert load_ops(tmp_path / "run") is None


GRAD_ACCUMULATION = r"""
import torch
from torch import nn
from torch.nn import functional as F

class Net(nn.Module):  # nanoGPT's shape: a transformer block, logits reshaped for the loss
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.block = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
        self.head = nn.Linear(16, 64)
    def forward(self, idx, y):
        logits = self.head(self.block(self.emb(idx)))
        return F.cross_entropy(logits.view(-1, 64), y.view(-1))

model = Net()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(14):
    for micro in range(8):  # gradient accumulation: 8 micro-batches of 8 sequences
        idx = torch.randint(0, 64, (8, 8))
        loss = model(idx, idx) / 8
        loss.backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_line_run_once_per_micro_batch_is_not_a_loop(tmp_path: Path) -> None:
    """Gradient accumulation runs the model's lines 8 times a step: a line whose tensor has
    a dimension of 8 (``logits.view``, and the transformer block's internals, which count
    as the line that called the block) is called 8 times a step, but on a new tensor each
    time. That is no loop over the dimension (it was reported as one, at 17% of calls)."""
    write_script(tmp_path, "train.py", GRAD_ACCUMULATION)
    res = trainprof("run", "--json", "train.py", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    summary = res.json()
    ops = summary["ops"]
    assert ops["steps_sampled"] == 2
    view = [s for s in ops["top_sites"] if s["function"] == "Tensor.view"]
    assert view and view[0]["calls_per_step"] == 16 and view[0]["arg_shape"][0] == 8
    assert view[0]["calls_per_arg_tensor"] == 1  # a new logits (and y) per micro-batch
    assert ops["loops"] == []
    assert not [f for f in summary["findings"] if f["category"] == "python_loop"]
