"""Receiving DataLoader workers' batches: the capture (capture/handoff.py), the
``sharing_strategy`` knob, the finding (diagnosis/handoff.py) and PackedCollate."""

from __future__ import annotations

import collections
import io
import json
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from test_diagnosis import MS, loader, make_steps, make_summary
from torch.utils.data import DataLoader, Dataset, default_collate

from trainprof.capture.knobs import ENV_VAR, Knobs
from trainprof.diagnosis import diagnose
from trainprof.experiments import tune as tune_mod
from trainprof.fixes import PackedCollate
from trainprof.store import load_run

FIELDS = """
import torch
from torch.utils.data import DataLoader, Dataset

class Fields(Dataset):  # a dict of 5 fields a sample: 5 tensors a batch
    def __len__(self):
        return 96
    def __getitem__(self, i):
        return {"x": torch.randn(4), "y": i % 2, "box": torch.rand(4),
                "mask": torch.rand(3) > 0.5, "w": torch.rand(())}

if __name__ == "__main__":
    w = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    loader = DataLoader(Fields(), batch_size=8, num_workers=2, multiprocessing_context=CTX)
    for epoch in range(2):
        for b in loader:
            (w * b["x"]).sum().backward()
            opt.step(); opt.zero_grad()
"""


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_every_tensor_received_from_a_worker_is_counted_and_timed(tp, ctx):
    res = tp(FIELDS.replace("CTX", repr(ctx)), "--json")
    assert res.returncode == 0, res.stderr
    rec = load_run(res.run_dir).meta["batch_handoff"]
    # 2 epochs of 12 batches, 5 tensors each ("y" is collated into a tensor too)
    assert rec["tensors"] == 2 * 12 * 5
    assert rec["strategies"] == ["file_descriptor"]
    assert rec["training_thread"]["tensors"] == rec["tensors"]  # no pin-memory thread
    assert 0 < rec["training_thread"]["total_s"] == rec["total_s"]
    assert sum(c for _, c in rec["hist"]) == rec["tensors"]
    summary = res.json()["batch_handoff"]
    assert summary["tensors_per_batch"] == 5.0
    assert 0 < summary["median_ms"] < 1000 * rec["total_s"]
    assert 0 < summary["training_thread_share"] < 1


def test_the_sharing_strategy_knob_changes_how_batches_come_over(tp):
    res = tp(FIELDS.replace("CTX", "'fork'"), "--json",
             env={ENV_VAR: json.dumps({"sharing_strategy": "file_system"})})
    assert res.returncode == 0, res.stderr
    meta = load_run(res.run_dir).meta
    assert meta["batch_handoff"]["strategies"] == ["file_system"]
    assert meta["batch_handoff"]["tensors"] == 120
    assert meta["knobs"]["process"]["sharing_strategy"] == "file_system"
    assert tune_mod._actual("sharing_strategy", meta) == "file_system"


def test_sharing_strategy_knob_applies_ignores_the_script_and_is_undone():
    import torch.multiprocessing as tmp

    before, setter = tmp.get_sharing_strategy(), tmp.set_sharing_strategy
    knobs = Knobs({"sharing_strategy": "file_system"}).install()
    try:
        assert tmp.get_sharing_strategy() == "file_system"
        tmp.set_sharing_strategy("file_descriptor")  # the script's call: ignored
        assert tmp.get_sharing_strategy() == "file_system"
    finally:
        record = knobs.uninstall()
    assert tmp.set_sharing_strategy is setter and tmp.get_sharing_strategy() == before
    assert record["process"] == {"sharing_strategy": "file_system"}
    assert record["script_calls_ignored"] == [
        "torch.multiprocessing.set_sharing_strategy('file_descriptor')"]
    assert tune_mod._actual("sharing_strategy", {"knobs": record}) == "no worker batch"


# -- the finding ------------------------------------------------------------------


def _handoff_summary(share: float, strategies: list[str], per_batch: float = 8.0,
                     sample_cpu_ms: float = 0.14, busy: float = 0.33):
    """A CPU run waiting for data 60% of the step; its 2 workers' samples cost
    ``sample_cpu_ms`` each; receiving the batches took ``share`` of step time (the
    numbers of a measured run: 8 fields a sample, 0.47 ms per tensor, 42%)."""
    steps = make_steps(60, data=6 * MS, forward=2 * MS, backward=1.5 * MS, optimizer=0.5 * MS)
    summary = make_summary(
        steps, dataloaders=[loader(num_workers=2, persistent_workers=True, batch_size=16)],
        system={"n_samples": 20, "proc_cpu_pct": 123.0, "workers_cpu_pct": 59.0,
                "sys_cpu_pct": 93.0},
    )
    summary["workers"] = {"loaders": [{
        "loader_index": 0, "mode": "workers", "num_workers": 2, "processes": 2,
        "batches": 512, "samples": 8192,
        "sample_blocked_ms": {"median": 0.0, "p90": 0.2, "mean": 0.01},
        "sample_cpu_ms": {"median": sample_cpu_ms, "p90": sample_cpu_ms * 1.1,
                          "mean": sample_cpu_ms},
        "collate_ms": {"median": 2.4, "p90": 5.2, "mean": 2.6},
        "fetch_split": {"blocked": 0.0, "waiting_for_cpu": 0.12, "cpu": 0.5, "collate": 0.38},
        "busy_share_active": {"median": busy, "min": busy, "max": busy},
        "persistent_workers": True, "startup": None, "functions": None,
    }]}
    summary["batch_handoff"] = {
        "strategies": strategies, "tensors": int(512 * per_batch), "total_s": 1.9,
        "mean_ms": 0.47, "median_ms": 0.25, "p90_ms": 1.2, "tensors_per_batch": per_batch,
        "training_thread_s": 1.9, "training_thread_share": share,
    }
    return summary, steps


def _input_finding(summary, steps):
    found = [f for f in diagnose(summary, steps) if f["category"] == "input_pipeline"]
    assert len(found) == 1, found
    return found[0]


def test_a_wait_that_is_mostly_receiving_tensors_is_named_with_both_fixes():
    summary, steps = _handoff_summary(0.42, ["file_descriptor"])
    f = _input_finding(summary, steps)
    assert f["cause"] == "shared_memory_handoff"
    assert f["estimated_gain"] == pytest.approx(0.42)
    assert f["severity"] == "high"
    assert "42% receiving the workers' batches" in f["title"]
    assert "8 tensors a batch" in f["title"]
    snippet = f["fix"]["snippet"]
    assert 'set_sharing_strategy("file_system")' in snippet
    assert "collate_fn=PackedCollate()" in snippet  # 8 tensors a batch: worth packing
    assert f["verify"].startswith(
        "trainprof tune --knob sharing_strategy=file_descriptor,file_system train.py")
    assert f["evidence"]["batch_handoff"]["tensors_per_batch"] == 8.0


def test_receiving_under_half_the_wait_leaves_the_workers_cause():
    summary, steps = _handoff_summary(0.2, ["file_descriptor"])
    assert _input_finding(summary, steps)["cause"] != "shared_memory_handoff"


def test_busy_workers_keep_their_cause_however_slow_the_receive():
    """A worker busy in Python holds its GIL, and the receive waits for it: measured
    at 4.9 ms a tensor behind a 15 ms collate_fn (tests/test_workers.py), whose cause is
    still the collate."""
    summary, steps = _handoff_summary(0.69, ["file_descriptor"], per_batch=2.0, busy=0.9)
    w = summary["workers"]["loaders"][0]
    w["fetch_split"] = {"blocked": 0.0, "waiting_for_cpu": 0.02, "cpu": 0.08, "collate": 0.9}
    w["collate_ms"] = {"median": 15.0, "p90": 16.0, "mean": 15.0}
    assert _input_finding(summary, steps)["cause"] == "collate"


def test_with_file_system_already_the_finding_asks_for_fewer_tensors():
    summary, steps = _handoff_summary(0.42, ["file_system"], per_batch=2.0)
    f = _input_finding(summary, steps)
    assert f["cause"] == "shared_memory_handoff"
    assert "set_sharing_strategy" not in f["fix"]["snippet"]
    assert "PackedCollate()" in f["fix"]["snippet"]
    assert "already in use" in f["fix"]["text"]
    assert f["verify"].startswith("after the change, `trainprof run train.py`")


def test_cheap_samples_from_idle_workers_stay_a_worker_handoff_quoting_the_receive():
    summary, steps = _handoff_summary(0.42, ["file_descriptor"], per_batch=2.0,
                                      sample_cpu_ms=0.003, busy=0.14)
    w = summary["workers"]["loaders"][0]
    w["collate_ms"] = {"median": 0.3, "p90": 0.5, "mean": 0.4}
    w["fetch_split"] = {"blocked": 0.0, "waiting_for_cpu": 0.0, "cpu": 0.3, "collate": 0.7}
    f = _input_finding(summary, steps)
    assert f["cause"] == "worker_handoff"  # num_workers=0 is the better fix there
    assert "Receiving the workers' batches took the training thread 42%" in f["fix"]["text"]


def test_idle_workers_of_loaders_iterated_together_are_counted_together():
    """zip(a, b): both loaders' workers run at once and the wait is on both; the title
    counts them all (2 + 4) and their idleness weighted by each loader's workers, as the
    contention rules count workers (it had said "the 2 DataLoader workers are idle 86%")."""
    summary, steps = _handoff_summary(0.42, ["file_descriptor"], per_batch=2.0,
                                      sample_cpu_ms=0.003, busy=0.14)
    w = summary["workers"]["loaders"][0]
    w["collate_ms"] = {"median": 0.3, "p90": 0.5, "mean": 0.4}
    w["fetch_split"] = {"blocked": 0.0, "waiting_for_cpu": 0.0, "cpu": 0.3, "collate": 0.7}
    summary["dataloaders"][0]["iterated_with"] = [1]
    summary["dataloaders"].append(loader(index=1, num_workers=4, persistent_workers=True,
                                         batch_size=16, sampler="torch.utils.data.sampler."
                                         "SequentialSampler", iterated_with=[0]))
    summary["workers"]["loaders"].append({**w, "loader_index": 1, "num_workers": 4,
                                          "processes": 4,
                                          "busy_share_active": {"median": 0.3, "min": 0.3,
                                                                "max": 0.3}})
    f = _input_finding(summary, steps)
    assert f["cause"] == "worker_handoff"
    busy = (2 * 0.14 + 4 * 0.3) / 6
    assert (f"while the 6 DataLoader workers of the 2 loaders iterated together are idle "
            f"{(1 - busy) * 100:.0f}% of the time") in f["title"]
    assert f"busy only {busy * 100:.0f}%" in f["fix"]["text"]
    assert "num_workers=0 (on each of the 2 loaders)" in f["fix"]["text"]
    assert f["evidence"]["workers_iterated_together"] == 6
    assert f["evidence"]["workers_busy_share_together"] == pytest.approx(busy, abs=1e-4)


# -- PackedCollate ------------------------------------------------------------------

Point = collections.namedtuple("Point", "x y")


class Mixed(Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return {"image": torch.full((3, 4, 4), float(i)), "label": i % 3,
                "mask": torch.arange(5) % (i + 2) == 0, "name": f"s{i}",
                "big": torch.full((300, 300), float(i)),  # 360 kB, over the limit below
                "pt": Point(torch.tensor([i, -i]), 0.5 * i), "pair": [torch.ones(2) * i, i]}


def _same(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_packed_batches_arrive_as_the_collate_made_them(ctx):
    kw = {"batch_size": 8, "num_workers": 2, "multiprocessing_context": ctx}
    plain = list(DataLoader(Mixed(), **kw))
    packed = list(DataLoader(Mixed(), collate_fn=PackedCollate(max_tensor_bytes=1 << 18),
                             **kw))
    assert len(packed) == len(plain) == 5
    for a, b in zip(plain, packed, strict=True):
        _same(a, b)
    # the small tensors share one buffer per dtype; the big one crossed on its own
    b = packed[0]
    floats = {b["image"].untyped_storage().data_ptr(), b["pair"][0].untyped_storage().data_ptr()}
    assert len(floats) == 1
    assert b["big"].untyped_storage().data_ptr() not in floats


def test_packed_collate_pickles_to_few_tensors_and_is_a_no_op_in_process():
    from trainprof.fixes.packed_collate import _PackedBatch

    samples = [Mixed()[i] for i in range(4)]
    batch = default_collate(samples)
    assert PackedCollate()(samples).keys() == batch.keys()  # no worker: the batch itself
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(_PackedBatch(batch, 1 << 18))
    _same(batch, pickle.loads(buf.getvalue()))
    # 8 tensors in the batch: one packed tensor per dtype, and the big one on its own
    packed, spec = _PackedBatch(batch, 1 << 18).__reduce__()[1]
    assert sorted(str(d) for d in packed) == ["torch.bool", "torch.float32",
                                              "torch.float64", "torch.int64"]
    assert spec[2][4][1][0] == 0  # "big": a leaf, not packed
    assert spec[2][4][1][1] is batch["big"]


def test_tensors_a_batch_are_counted_in_a_batch_not_over_the_batches_made():
    """"1.9 a batch" for batches of exactly 2 tensors: 120 tensors received over the 64
    batches the 2 workers made for a 60-step run (4 prefetched, never received)."""
    from trainprof.analysis.handoff import summarize_handoff

    rec = {"strategies": ["file_descriptor"], "tensors": 120, "total_s": 0.1,
           "training_thread": {"tensors": 120, "total_s": 0.1}, "hist": [[230, 120]]}
    workers = {"loaders": [{"loader_index": 0, "mode": "workers", "batches": 64}]}
    two = [{"loader_index": 0, "tensors": [
        {"path": "batch[0]", "dtype": "int64", "shape": [16, 64]},
        {"path": "batch[1]", "dtype": "int64", "shape": [16, 64]}]}]
    summary = summarize_handoff(rec, workers, 1.0, two)
    assert summary["tensors_per_batch"] == 2 and not summary["tensors_per_batch_estimated"]
    # not described (a run recorded before): the estimate, said to be one
    summary = summarize_handoff(rec, workers, 1.0, None)
    assert summary["tensors_per_batch"] == pytest.approx(120 / 64)
    assert summary["tensors_per_batch_estimated"]
    from trainprof.report.terminal import worker_rows

    (row,) = [r for label, r in worker_rows(None, None, summary) if "tensors" in r]
    assert "120 tensors (~1.9 a batch)" in row
    (row,) = [r for label, r in worker_rows(None, None, summarize_handoff(
        rec, workers, 1.0, two)) if "tensors" in r]
    assert "120 tensors (2 a batch)" in row


def test_the_loading_row_says_whose_time_its_shares_are_of():
    """"waiting for a core 46% of the time · busy 0%" read as a contradiction: the first
    is of the workers' loading time, the second of their time since their first batch."""
    from test_workers import entry

    from trainprof.report.terminal import worker_rows

    w = entry(0.1, 0.46, 0.44, 0.5, busy=0.004)
    w["start_method"] = "fork"
    (row,) = [r for label, r in worker_rows({"loaders": [w]}) if label == "Loading #0"]
    assert "waiting for a core 45% of the loading time" in row
    assert ("each worker loading 0% of its time (median; the rest waiting for the loop to "
            "ask for more)") in row


TRAIN_AND_EVAL = """
import torch
from torch.utils.data import DataLoader, Dataset

class Pairs(Dataset):  # (x, y): 2 tensors a batch
    def __init__(self, n):
        self.n = n
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        return torch.randn(4), torch.tensor(float(i % 2))

class Fields(Dataset):  # 5 tensors a batch
    def __len__(self):
        return 32
    def __getitem__(self, i):
        return {"x": torch.randn(4), "y": i % 2, "box": torch.rand(4),
                "mask": torch.rand(3) > 0.5, "w": torch.rand(())}

if __name__ == "__main__":
    w = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    train = DataLoader(Pairs(160), batch_size=8, num_workers=1, persistent_workers=True)
    val = DataLoader(Fields(), batch_size=8, num_workers=1)
    step = 0
    for x, y in train:
        (w * x).sum().backward()
        opt.step(); opt.zero_grad(); step += 1
        if step % 10 == 0:  # an evaluation pass inside the loop: 4 batches
            with torch.no_grad():
                for b in val:
                    (w * b["x"]).sum().item()
"""


def test_an_evaluation_loader_inside_the_loop_has_its_own_handoff(tp):
    """The tensors of each loader's batches are counted against that loader."""
    res = tp(TRAIN_AND_EVAL, "--json")
    assert res.returncode == 0, res.stderr
    rec = load_run(res.run_dir).meta["batch_handoff"]
    by_loader = {e["loader_index"]: e for e in rec["loaders"]}
    assert by_loader[0]["tensors"] == 20 * 2  # 20 training batches of (x, y)
    assert by_loader[1]["tensors"] == 2 * 4 * 5  # 2 passes of 4 batches of 5 tensors
    assert rec["tensors"] == 40 + 40
    assert sum(c for _, c in by_loader[1]["hist"]) == 40
    assert by_loader[1]["training_thread"]["tensors"] == 40
    summary = {e["loader_index"]: e for e in res.json()["batch_handoff"]["loaders"]}
    assert summary[0]["tensors_per_batch"] == 2
    assert summary[1]["tensors_per_batch"] == 5
    assert summary[1]["strategies"] == ["file_descriptor"]


def test_the_finding_quotes_the_training_loaders_handoff_not_the_pooled_one():
    """An evaluation loader's slow receive (9 ms a tensor) pooled with the training
    loader's made 'waits ... receiving the workers' batches' the training loader's cause."""
    summary, steps = _handoff_summary(0.42, ["file_descriptor"], per_batch=2.0)
    pooled = summary["batch_handoff"]
    own = {**pooled, "loader_index": 0, "mean_ms": 0.5, "training_thread_share": 0.07}
    other = {**pooled, "loader_index": 1, "mean_ms": 9.1, "training_thread_share": 0.35}
    pooled["loaders"] = [own, other]
    f = _input_finding(summary, steps)
    assert f["cause"] != "shared_memory_handoff"
    assert f["evidence"]["batch_handoff"]["loader_index"] == 0
    assert f["evidence"]["batch_handoff"]["mean_ms"] == 0.5
    # the same numbers pooled into one loader's: the receive is its cause
    pooled["loaders"] = [{**own, "mean_ms": 2.1, "training_thread_share": 0.42}]
    assert _input_finding(summary, steps)["cause"] == "shared_memory_handoff"
