"""Which DataLoaders are one loader in the record (capture/hooks.py ``LoaderRegistry``).

Loaders iterated together (``zip(dl_a, dl_b, dl_c)``) are one record each, with their own
workers, generations and batches, even with the same settings; a loader made anew each
epoch (the old one gone or done first) stays one logical loader. Real runs of tiny loops.
"""

from __future__ import annotations

import numpy as np
from conftest import trainprof, write_script
from test_diagnosis import MS, loader, make_steps, make_summary

from trainprof.diagnosis.context import Context
from trainprof.diagnosis.registry import diagnose

ZIPPED = """
import torch
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
torch.set_num_threads(2)
# three datasets of the same kind and size, different data: the loaders' settings are equal
sets = [TensorDataset(torch.randn(48, 4) + k) for k in range(3)]
loaders = [DataLoader(s, batch_size=8, shuffle=True, num_workers=2) for s in sets]
w = torch.zeros(4, requires_grad=True)
opt = torch.optim.SGD([w], lr=0.1)
for epoch in range(3):
    for (a,), (b,), (c,) in zip(*loaders):
        ((w * a).sum() + (w * b).sum() + (w * c).sum()).backward()
        opt.step(); opt.zero_grad()
"""


def test_zipped_loaders_with_the_same_settings_are_one_record_each(tmp_path):
    script = write_script(tmp_path, "train.py", ZIPPED)
    res = trainprof("run", "--json", str(script.name), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    doc = res.json()
    loaders = doc["dataloaders"]
    # the truth: 3 loaders of 2 workers, each iterated 3 epochs of 6 batches, all together
    assert [(d["index"], d["num_workers"], d["batches"]) for d in loaders] == [
        (0, 2, 6), (1, 2, 6), (2, 2, 6)]
    assert [d["iterated_with"] for d in loaders] == [[1, 2], [0, 2], [0, 1]]
    workers = {w["loader_index"]: w for w in doc["workers"]["loaders"]}
    assert sorted(workers) == [0, 1, 2]
    for w in workers.values():  # a generation of 2 workers per epoch, per loader
        assert (w["num_workers"], w["generations"], w["processes"]) == (2, 3, 6)
        assert w["batches"] == 18 and w["samples"] == 144
    assert not [f for f in doc["findings"] if f["category"] == "periodic_overhead"]
    # the threads that want a core at once: torch's 2 intra-op threads and all 6 workers
    ctx = Context(doc, None)
    assert ctx.concurrent_workers == 6
    assert [[d["index"] for d in g] for g in ctx.loader_groups] == [[0, 1, 2]]
    # the report shows each loader; compare reads the same run's loaders as unchanged
    report = trainprof("report", str(res.run_dir), cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    for i, others in ((0, "#1, #2"), (1, "#0, #2"), (2, "#0, #1")):
        assert f"DataLoader #{i}" in report.stdout and f"Loading #{i}" in report.stdout
        assert f"iterated together with {others}" in report.stdout
    same = trainprof("compare", str(res.run_dir), str(res.run_dir), "--json", cwd=tmp_path)
    assert same.returncode == 0, same.stderr
    assert "dataloader[2]" not in same.stdout  # nothing changed: no loader rows


def test_a_loader_made_anew_each_epoch_stays_one_loader(tmp_path):
    """Made anew per epoch and left early (a ``break``), in the training process or with
    workers; and loaders alive together but iterated one after another: one each."""
    body = """
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    ds = TensorDataset(torch.randn(64, 4))
    w = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    for nw in (0, 2):
        for epoch in range(3):
            for i, (x,) in enumerate(DataLoader(ds, batch_size=8 + nw, shuffle=True,
                                                num_workers=nw)):
                (w * x).sum().backward(); opt.step(); opt.zero_grad()
                if i == 3:
                    break  # the epoch cut short: its iterator dropped, not done
        kept = [DataLoader(ds, batch_size=5, num_workers=nw) for _ in range(2)]
        for dl in kept:  # both alive, one after the other
            for (x,) in dl:
                (w * x).sum().backward(); opt.step(); opt.zero_grad()
    """
    script = write_script(tmp_path, "train.py", body)
    res = trainprof("run", "--json", str(script.name), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    doc = res.json()
    assert [(d["index"], d["num_workers"], d["batch_size"], d.get("iterated_with"))
            for d in doc["dataloaders"]] == [(0, 0, 8, None), (1, 0, 5, None),
                                             (2, 2, 10, None), (3, 2, 5, None)]
    workers = {w["loader_index"]: w for w in doc["workers"]["loaders"]}
    assert workers[2]["generations"] == 3 and workers[3]["generations"] == 2
    assert workers[1]["batches"] == 2 * 13  # 64 samples in batches of 5, twice


def test_zipped_loaders_of_different_lengths_have_the_shortest_epoch():
    """zip stops at the shortest loader: the epoch start-ups recur at its length, not at the
    length of the loader whose fix is given (the first shuffled one here, 15 batches)."""
    data = np.full(60, 0.2 * MS)
    data[10::10] = 30 * MS  # 320 samples / 32 a batch: the shortest loader's 10 batches
    steps = make_steps(60, data=data)
    loaders = [loader(index=0, len=480, num_workers=2, iterated_with=[1, 2]),
               loader(index=1, len=320, num_workers=2, iterated_with=[0]),  # one way only
               loader(index=2, len=400, num_workers=2, iterated_with=[0])]
    summary = make_summary(steps, dataloaders=loaders,
                           system={"n_samples": 20, "proc_cpu_pct": 90.0,
                                   "workers_cpu_pct": 60.0})
    out = diagnose(summary, steps)
    f = next(f for f in out if f["category"] == "input_pipeline")
    assert f["cause"] == "worker_startup_per_epoch"
    assert f["evidence"]["epoch_spikes"]["period_steps"] == 10
    assert f["evidence"]["epoch_spikes"]["batches_per_epoch"] == 10
    assert f["evidence"]["loaders_iterated_together"] == [0, 1, 2]
    assert f["evidence"]["per_worker_cpu"] == 0.1  # 60% of a core over the 6 workers
    assert "The 3 loaders iterated together (#0, #1, #2) each restart theirs" in f["fix"]["text"]
    assert not [g for g in out if g["category"] == "periodic_overhead"]
    c = next(f for f in out if f["category"] == "cpu_contention")
    assert c["evidence"]["num_workers"] == 6 and c["evidence"]["thread_demand"] == 8
    assert c["cause"] == "workers_oversubscribe_cores"
    # the knob sets every loader's num_workers: its values are each loader's share
    knob = c["verify"].split("--knob num_workers=")[1].split()[0]
    assert max(int(v) for v in knob.split(",")) <= 2, c["verify"]
    assert "for each of the 3 loaders iterated together" in c["fix"]["snippet"]
    # an old record (no iterated_with): each loader alone, the demand its largest
    for d in loaders:
        del d["iterated_with"]
    ctx = Context(summary, steps)
    assert ctx.concurrent_workers == 2 and len(ctx.loader_groups) == 3
