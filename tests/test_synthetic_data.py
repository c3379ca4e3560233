"""The ``synthetic_data`` knob: input made free (expert rules I7/N7, confirm by elimination)."""

from __future__ import annotations

import json

import torch
from conftest import trainprof, write_script
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.dataloader import _SingleProcessDataLoaderIter

from trainprof.capture.knobs import ENV_VAR, Knobs
from trainprof.experiments.tune import Arm, _actual, _knob_notes


class Counting(Dataset):
    def __init__(self, n: int) -> None:
        self.n, self.reads = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.reads += 1
        return torch.tensor([i])


def test_loaders_repeat_their_first_batch_for_an_epoch_of_the_usual_length():
    original = _SingleProcessDataLoaderIter.__dict__["_next_data"]
    knobs = Knobs({"synthetic_data": True}).install()
    try:
        ds, other = Counting(22), Counting(9)
        loader = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2,
                            persistent_workers=True)
        second = DataLoader(other, batch_size=3)
        epochs = [[b.clone() for b in loader] for _ in range(2)]
        assert [len(e) for e in epochs] == [6, 6]  # 22 samples, batches of 4: as without
        assert all(torch.equal(b, epochs[0][0]) for e in epochs for b in e)
        assert ds.reads == 4  # one batch read, really, once
        assert [b.tolist() for b in second] == [[[0], [1], [2]]] * 3  # its own first batch
        assert other.reads == 3
    finally:
        record = knobs.uninstall()
    assert _SingleProcessDataLoaderIter.__dict__["_next_data"] is original
    assert record["process"]["synthetic_data"] == {"batches_cached": 2}
    # no worker loads anything: num_workers 0 (and what needs workers reset)
    assert record["dataloaders"][0]["set"] == {"num_workers": 0}
    assert record["dataloaders"][0]["reset"] == {"persistent_workers": False}
    meta = {"knobs": record, "dataloaders": [{"num_workers": 0}]}
    assert _actual("synthetic_data", meta) == "true (2 loaders)"
    arm = Arm(0, {"synthetic_data": "true", "num_workers": "4"},
              {"synthetic_data": True, "num_workers": 4})
    assert any("num_workers is 0 there" in n for n in _knob_notes(arm, meta))
    # after uninstall, loading is real again
    assert [b.tolist() for b in DataLoader(Counting(4), batch_size=2)] == [[[0], [1]], [[2], [3]]]


SCRIPT = """
    import time
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Slow(Dataset):
        def __len__(self):
            return 4096

        def __getitem__(self, i):
            time.sleep(0.0005)  # slow storage
            return torch.randn(32), i % 4

    model = torch.nn.Linear(32, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Slow(), batch_size=16, shuffle=True)
    for step, (x, y) in enumerate(loader):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if step == 60:
            break
"""


def test_a_run_with_synthetic_data_shows_the_step_without_input(tmp_path):
    write_script(tmp_path, "train.py", SCRIPT)
    real = trainprof("run", "--json", "--no-html", "train.py", cwd=tmp_path)
    assert real.returncode == 0, real.stderr[-2000:]
    free = trainprof("run", "--json", "--no-html", "train.py", cwd=tmp_path,
                     env={ENV_VAR: json.dumps({"synthetic_data": True})})
    assert free.returncode == 0, free.stderr[-2000:]
    a, b = real.json(), free.json()
    assert a["breakdown"]["data_wait"] > 0.8  # 16 x 0.5 ms of sleep a batch
    assert b["breakdown"]["data_wait"] < 0.2
    assert b["steps"]["median_s"] < 0.3 * a["steps"]["median_s"]
    assert b["steps"]["count"] == a["steps"]["count"] == 61
    # its finding names the bound it measures
    top = a["findings"][0]
    assert top["category"] == "input_pipeline"
    assert "synthetic_data=false,true train.py" in top["verify"]
    meta = json.loads((free.run_dir / "run.json").read_text())
    assert _actual("synthetic_data", meta) == "true (1 loader)"


def test_an_iterable_dataset_repeats_its_first_batch_past_its_end():
    """Its epoch's end is known only by reading it: with synthetic data it never ends
    (trainprof tune stops each trial after --steps steps)."""
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(torch.arange(6).split(1))

    knobs = Knobs({"synthetic_data": True}).install()
    try:
        it = iter(DataLoader(Stream(), batch_size=2))
        batches = [next(it) for _ in range(10)]  # the stream holds 3 batches
    finally:
        knobs.uninstall()
    assert all(torch.equal(b, batches[0]) for b in batches)
