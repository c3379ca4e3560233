"""Worker-side capture: what DataLoader workers spend their time on, and the causes it names.

Real DataLoader runs under `trainprof run` (fork and spawn workers, num_workers=0), with
datasets whose cost is known: a 5 ms sleep per sample (blocked), ~5 ms of CPU per sample,
a slow collate_fn, workers restarted every epoch. The machine has 2 shared cores, so a
sleep can take longer to wake up from and CPU work can wait for a core: bounds are loose
where the scheduler decides, and tight where trainprof measures (a 5 ms sleep is 5 ms of
blocked time once run-queue waits are set apart).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import trainprof, write_script

from trainprof.analysis.workers import bin_bounds, hist_quantile, summarize_workers
from trainprof.capture import fetch_timing as W

COMMON = """
import os, sys, time, torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

def burn(ms):
    t = time.thread_time()
    while time.thread_time() - t < ms / 1000:
        pass

class Sleepy(Dataset):          # blocked: 5 ms of "remote storage" per sample
    def __len__(self):
        return 96
    def __getitem__(self, i):
        time.sleep(0.005)
        return torch.zeros(8), i % 2

class Burner(Sleepy):           # CPU: ~5 ms of transforms per sample
    def __getitem__(self, i):
        burn(5)
        return torch.zeros(8), i % 2

def train(loader, epochs=1, step_s=0.0):
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(epochs):
        for x, y in loader:
            if step_s:
                time.sleep(step_s)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
"""


def run_script(tmp_path: Path, body: str, *options: str, timeout: float = 180) -> dict[str, Any]:
    write_script(tmp_path, "train.py", COMMON + body)
    res = trainprof("run", "--json", *options, "train.py", cwd=tmp_path, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.json()


def loader_entry(doc: dict[str, Any], index: int = 0) -> dict[str, Any]:
    entries = [e for e in doc["workers"]["loaders"] if e["loader_index"] == index]
    assert len(entries) == 1, doc["workers"]
    return entries[0]


def input_finding(doc: dict[str, Any]) -> dict[str, Any]:
    hits = [f for f in doc["findings"] if f["category"] == "input_pipeline"]
    assert len(hits) == 1, doc["findings"]
    return hits[0]


def reads_ms(w: dict[str, Any]) -> float:
    """Mean blocked ms per sample with run-queue waits set apart (what the diagnosis quotes)."""
    split = w["fetch_split"]
    off_cpu = split["blocked"] + split["waiting_for_cpu"]
    return w["sample_blocked_ms"]["mean"] * split["blocked"] / off_cpu


# -- units: histograms, the timed fetch ---------------------------------------------------------


def test_histogram_bins_hold_their_values_and_merge_into_percentiles():
    for v in [0, 1, 31, 32, 33, 63, 64, 1000, 5_000_000, 5_123_456, 2**40 + 12345, 2**63 - 1]:
        i = W.bin_index(v)
        lo, hi = bin_bounds(i)
        assert lo <= v < hi, (v, i, lo, hi)
        assert i < W.N_BINS
        if v >= 32:
            assert (hi - lo) / lo <= 1 / 16  # 16 bins per power of two
    bins = [W.bin_index(v) for v in range(4096)]
    assert bins == sorted(bins) and set(bins) == set(range(bins[-1] + 1))  # monotone, no gaps
    # 1..1000 µs uniformly: percentiles within the bin width (<= 6%)
    hist: dict[int, int] = {}
    for us in range(1, 1001):
        i = W.bin_index(us * 1000)
        hist[i] = hist.get(i, 0) + 1
    assert hist_quantile(hist, 0.5) == pytest.approx(500_000, rel=0.06)
    assert hist_quantile(hist, 0.9) == pytest.approx(900_000, rel=0.06)
    assert hist_quantile({}, 0.5) is None


def _fetcher(dataset: Any, kind: str = "map", batch: bool = True):
    from torch.utils.data._utils import fetch as F

    if kind == "map":
        f = F._MapDatasetFetcher(dataset, batch, lambda x: x, False)
        timed = W.make_map_fetch(F._MapDatasetFetcher.fetch)
    else:
        f = F._IterableDatasetFetcher(dataset, batch, lambda x: x, False)
        timed = W.make_iterable_fetch(F._IterableDatasetFetcher.fetch)
    st = W.Stream({})
    st.bind_thread()
    return W.ArmedFetcher(f, None, st, timed), timed, st


def test_timed_fetch_is_torchs_fetch_and_times_per_sample_only_when_it_is_cheap_to():
    class Cheap:
        def __getitem__(self, i):
            return i * 2

    class Slow:
        def __getitem__(self, i):
            time.sleep(0.0005)
            return i

    class Broken:
        def __getitem__(self, i):
            raise KeyError(f"no sample {i}")

    f, timed, st = _fetcher(Cheap())
    assert timed(f, [1, 2, 3]) == [2, 4, 6]  # same result as torch's fetch
    for _ in range(20):
        timed(f, list(range(64)))
    acc = dict(zip(W.ACC_NAMES, st.acc, strict=True))
    assert acc["batches"] == 21 and acc["samples"] == 3 + 20 * 64
    # samples far cheaper than 200 µs: after the first batch, timed per batch (no per-sample
    # clock reads), and only one batch in eight (batches 9 and 17): the sums and histograms
    # hold those
    assert acc["samples_timed"] == 3
    assert acc["timed_batches"] == 3
    assert sum(st.h_cpu) == sum(st.h_blocked) == 3 + 2 * 64
    f, timed, st = _fetcher(Slow())
    for _ in range(3):
        timed(f, list(range(4)))
    assert st.acc[W.SAMPLES_TIMED] == 12  # 0.5 ms samples: each timed on its own
    assert hist_quantile(dict(enumerate(st.h_blocked)), 0.5) == pytest.approx(0.5e6, rel=0.5)
    f, timed, st = _fetcher(Broken())
    with pytest.raises(KeyError, match="no sample 3"):
        timed(f, [3])
    assert not st.in_fetch and st.acc[W.BATCHES] == 0 and not st.off
    # an iterable dataset: next() per sample; the end of the data is torch's StopIteration
    f, timed, st = _fetcher(iter(range(10)), kind="iterable")
    assert timed(f, [None] * 4) == [0, 1, 2, 3]
    assert timed(f, [None] * 8) == [4, 5, 6, 7, 8, 9]
    with pytest.raises(StopIteration):
        timed(f, [None] * 4)
    assert st.acc[W.SAMPLES] == 10 and st.acc[W.BATCHES] == 2


# -- the diagnosis on hand-made measurements ----------------------------------------------------


def entry(blocked: float, waiting: float, cpu: float, collate: float, *, busy: float = 0.97,
          samples: int = 640, generations: list[tuple[float, float]] | None = None,
          **kw: Any) -> dict[str, Any]:
    """A workers summary entry whose fetch time splits as given (per sample: 1 ms in all)."""
    per_sample = blocked + waiting + cpu
    entry = {
        "loader_index": 0, "mode": "workers", "num_workers": 2, "samples": samples,
        "batches": samples // 32, "generations": len(generations or [1]),
        "sample_blocked_ms": {"median": blocked + waiting, "p90": 1.2 * (blocked + waiting),
                              "mean": blocked + waiting},
        "sample_cpu_ms": {"median": cpu, "p90": 1.2 * cpu, "mean": cpu},
        "collate_ms": {"median": collate, "p90": collate, "mean": collate},
        "fetch_split": {k: v / (per_sample + collate / 32) for k, v in (
            ("blocked", blocked), ("waiting_for_cpu", waiting), ("cpu", cpu),
            ("collate", collate / 32))},
        "busy_share_active": {"median": busy, "min": busy, "max": busy},
        "persistent_workers": kw.get("persistent", False),
        "startup": None, "functions": None,
    }
    if generations:
        gens = [{"generation": i + 1, "at_s": at, "first_batch_s": s, "median_s": s}
                for i, (at, s) in enumerate(generations)]
        entry["startup"] = {"per_generation": gens, "median_s": gens[0]["first_batch_s"],
                            "avoidable_s": sum(g["first_batch_s"] for g in gens[1:])}
    return entry


def diagnose_with(w: dict[str, Any] | None, *, loader_kw: dict[str, Any] | None = None,
                  system: dict[str, Any] | None = None, data_ms: float = 10.0):
    from test_diagnosis import MS, loader, make_steps, make_summary

    from trainprof.diagnosis import diagnose

    steps = make_steps(60, data=data_ms * MS)  # 10 ms compute + the wait
    summary = make_summary(
        steps, dataloaders=[loader(**{"num_workers": 2, "persistent_workers": True,
                                      **(loader_kw or {})})],
        system=system or {"n_samples": 20, "proc_cpu_pct": 40.0, "workers_cpu_pct": 60.0,
                          "sys_cpu_pct": 50.0},
        workers={"loaders": [w]} if w else None,
    )
    found = [f for f in diagnose(summary, steps) if f["category"] == "input_pipeline"]
    assert len(found) == 1, found
    return found[0], steps, summary


def test_the_slowest_stage_in_the_workers_names_the_cause():
    # reads: 0.8 ms blocked of 1 ms, measured in busy workers
    f, _, _ = diagnose_with(entry(0.8, 0.05, 0.15, 0.5))
    assert f["cause"] == "slow_reads"
    assert "each sample waits 0.80 ms on reads or latency" in f["title"]
    assert f["evidence"]["sample_blocked_ms"]["median"] == pytest.approx(0.85)
    assert f["evidence"]["sample_cpu_ms"]["median"] == pytest.approx(0.15)
    assert f["evidence"]["collate_ms_per_batch"]["mean"] == pytest.approx(0.5)
    assert "num_workers=4,  # was 2" in f["fix"]["snippet"]
    # CPU, a core idle (50% of 2 cores used) and no wait for one: more workers
    f, _, _ = diagnose_with(entry(0.1, 0.0, 0.9, 0.5))
    assert f["cause"] == "too_few_workers" and "0.90 ms of CPU per sample" in f["title"]
    assert "num_workers=3,  # was 2" in f["fix"]["snippet"]
    # the same workers waiting for a core a third of their CPU-bound time: no core is free
    # (whatever the sampler says), so make each sample cheaper
    f, _, _ = diagnose_with(entry(0.1, 0.3, 0.6, 0.5))
    assert f["cause"] == "cpu_transforms" and "num_workers=2,  # unchanged" in f["fix"]["snippet"]
    assert "33% of that time they wait for a core" in f["fix"]["text"]  # 0.3 of 0.9 ms
    # a CPU run: the workers may take more from the model than they give, so verify
    # measures loading in the training process too
    assert "trainprof tune --knob num_workers=0,2 train.py" in f["verify"]
    # CPU-bound workers with 0.7 of a core idle: making samples cheaper stays the fix, and
    # one more worker has room (examples/png_folder.py: 0.9 idle, a second worker ×0.72;
    # the finding had said "no core is free")
    f, _, _ = diagnose_with(entry(0.1, 0.0, 0.9, 0.5), system={
        "n_samples": 20, "proc_cpu_pct": 50.0, "workers_cpu_pct": 80.0, "sys_cpu_pct": 65.0})
    assert f["cause"] == "cpu_transforms" and "no core is free" not in f["title"]
    assert "0.7 of a core is idle" in f["title"] and "one more worker (num_workers=3)" in (
        f["fix"]["text"])
    assert "num_workers=3,  # was 2: 0.7 of a core is idle" in f["fix"]["snippet"]
    assert "trainprof tune --knob num_workers=2,3 train.py" in f["verify"]
    # the whole machine busy (other processes): cpu_transforms too
    f, _, _ = diagnose_with(entry(0.1, 0.0, 0.9, 0.5), system={
        "n_samples": 20, "proc_cpu_pct": 40.0, "workers_cpu_pct": 60.0, "sys_cpu_pct": 100.0})
    assert f["cause"] == "cpu_transforms"
    assert 'CachedDataset(Images(...), "cache/train"' in f["fix"]["snippet"]
    # a dataset cached already is not wrapped in a second cache: its transform is what is left
    f, _, _ = diagnose_with(entry(0.1, 0.3, 0.6, 0.5), loader_kw={
        "dataset": "trainprof.fixes.cached_dataset.CachedDataset"})
    assert f["cause"] == "cpu_transforms" and "CachedDataset(CachedDataset" not in (
        f["fix"]["snippet"])
    assert "# cached already: what each sample still costs is its transform" in (
        f["fix"]["snippet"])
    # collate: 64 ms per 32-sample batch against 1 ms per sample
    f, _, _ = diagnose_with(entry(0.2, 0.0, 0.8, 64.0))
    assert f["cause"] == "collate" and "collate_fn takes 64.0 ms per batch" in f["title"]
    compile(f["fix"]["snippet"], "snippet", "exec")


def test_measurements_that_cannot_decide_leave_it_to_the_sampled_cpu_use():
    sysinfo = {"n_samples": 20, "proc_cpu_pct": 100.0, "workers_cpu_pct": 40.0,
               "sys_cpu_pct": 70.0}
    # workers idle most of the time: their stages are not what the loop waits for, and
    # their low CPU use (20% each) is idleness, not blocked reads
    f, _, _ = diagnose_with(entry(0.1, 0.0, 0.9, 0.5, busy=0.3), system=sysinfo)
    assert f["cause"] == "undetermined"
    assert "busy only 30% of the time" in f["fix"]["text"] and "ms of CPU" not in f["title"]
    assert f["evidence"]["worker_busy_share"] == 0.3
    # too few samples measured
    f, _, _ = diagnose_with(entry(0.1, 0.0, 0.9, 0.5, samples=8), system=sysinfo)
    assert f["cause"] == "slow_reads" and "sample_cpu_ms" not in f["evidence"]
    # nothing measured (an older run): the sampled CPU use decides, as before
    g, _, _ = diagnose_with(None, system=sysinfo)
    assert g["cause"] == "slow_reads" and "fetch_split" not in g["evidence"]


def test_measured_start_ups_after_the_first_are_a_cost_per_epoch():
    # three generations of workers, each 0.3 s to the first batch; no data-wait spikes
    # stand out (the wait is steady), but the two restarts cost 0.6 s of a ~1.2 s window
    w = entry(0.5, 0.0, 0.5, 0.5, generations=[(-1.0, 0.3), (0.2, 0.3), (0.6, 0.3)])
    f, steps, summary = diagnose_with(w, loader_kw={"persistent_workers": False},
                                      data_ms=10.0)
    assert f["cause"] == "worker_startup_per_epoch", f
    steady = steps[summary["steps"]["warmup"]:]
    total = steady["dur_ns"].sum() / 1e9
    assert f["evidence"]["worker_startup_share"] == pytest.approx(0.6 / total, rel=1e-3)
    assert f["evidence"]["worker_startup_s"] == 0.3 and f["evidence"]["worker_generations"] == 3
    assert "0.30 s per epoch start" in f["title"]
    # a restart before the steady window is not counted; with persistent workers none is
    w = entry(0.5, 0.0, 0.5, 0.5, generations=[(-1.0, 0.3), (-0.5, 0.3)])
    f, _, _ = diagnose_with(w, loader_kw={"persistent_workers": False})
    assert f["cause"] != "worker_startup_per_epoch"


# -- real runs ----------------------------------------------------------------------------------


def test_sleeping_samples_in_fork_workers_are_slow_reads(tmp_path):
    doc = run_script(tmp_path, """
if __name__ == "__main__":
    train(DataLoader(Sleepy(), batch_size=8, num_workers=2, persistent_workers=True), epochs=2)
""")
    w = loader_entry(doc)
    assert (w["mode"], w["start_method"], w["num_workers"]) == ("workers", "fork", 2)
    assert w["samples"] == 192 and w["batches"] == 24 and w["processes"] == 2
    assert w["samples_timed"] == 192  # 5 ms samples are timed one by one
    # a 5 ms sleep: 5 ms blocked once the waits for a core are set apart; almost no CPU
    assert 4.9 <= reads_ms(w) <= 6.5, w
    assert 4.9 <= w["sample_blocked_ms"]["median"] <= 15, w
    assert w["sample_cpu_ms"]["median"] < 1.0, w
    assert w["fetch_split"]["blocked"] > 0.5 > w["fetch_split"]["cpu"]
    assert w["busy_share_active"]["median"] > 0.5  # the loop waits on them
    assert len(w["startup"]["per_generation"]) == 1 and w["startup"]["avoidable_s"] == 0
    f = input_finding(doc)
    assert f["cause"] == "slow_reads", f
    assert f["evidence"]["sample_blocked_ms"]["median"] == pytest.approx(
        w["sample_blocked_ms"]["median"], rel=1e-3)
    assert "sample_cpu_ms" in f["evidence"] and "collate_ms_per_batch" in f["evidence"]
    assert "ms on reads or latency" in f["title"]
    assert "num_workers=4,  # was 2: blocked workers can exceed" in f["fix"]["snippet"]
    assert "from trainprof.fixes import PackedDataset" in f["fix"]["snippet"]
    assert "removing it is better: pack the sample files once" in f["fix"]["text"]
    # the files behind it: one per worker, closed at exit
    files = sorted((tmp_path / "run" / "workers").glob("*.json"))
    assert len(files) == 2
    assert all(json.loads(p.read_text())["ended"] for p in files)


def test_cpu_bound_samples_in_spawn_workers_are_cpu_transforms(tmp_path):
    doc = run_script(tmp_path, """
if __name__ == "__main__":
    train(DataLoader(Burner(), batch_size=8, num_workers=2, persistent_workers=True,
                     multiprocessing_context="spawn"))
""")
    w = loader_entry(doc)
    assert (w["start_method"], w["samples"]) == ("spawn", 96)
    assert 4.5 <= w["sample_cpu_ms"]["median"] <= 6.0, w  # thread CPU time: load-independent
    assert reads_ms(w) < 1.0, w  # whatever is off-CPU is a wait for a core, not a read
    assert w["fetch_split"]["cpu"] + w["fetch_split"]["waiting_for_cpu"] > 0.8
    # spawn workers import torch and the script before their first batch
    gen = w["startup"]["per_generation"][0]
    assert gen["launch_s"] > 0.2 and gen["median_s"] > gen["launch_s"]
    f = input_finding(doc)
    assert f["cause"] == "cpu_transforms", f
    assert f["evidence"]["sample_cpu_ms"]["median"] == pytest.approx(
        w["sample_cpu_ms"]["median"], rel=1e-3)
    assert "ms of CPU in the DataLoader workers" in f["title"]
    assert "num_workers=2,  # unchanged" in f["fix"]["snippet"]


def test_cheap_batches_are_timed_one_in_eight_and_scaled_to_all(tmp_path):
    """The split of cheap batches is estimated from the batches that were timed.

    Samples of ~40 µs: CPU-bound in the first half of the run, asleep in the second
    (a phase change the systematic sample must follow). The estimate from one batch in
    eight must match the thread's CPU time over the whole loop. 512 batches a half: a
    preemption inside a timed batch counts eight times in the estimate, and over a hundred
    timed batches keep such hits on a busy machine within the tolerance (with 256 a half, a
    CI run once came out 26% high).
    """
    def burn_us(us):
        t = time.thread_time_ns()
        while time.thread_time_ns() - t < us * 1000:
            pass

    class Phases:
        sleeping = False

        def __getitem__(self, i):
            if self.sleeping:
                time.sleep(40e-6)  # ~100 µs with the timer slack: blocked
            else:
                burn_us(40)
            return i

    ds = Phases()
    f, timed, st = _fetcher(ds)
    wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
    for half in range(2):
        ds.sleeping = half == 1
        for _ in range(512):
            timed(f, list(range(16)))
    wall, cpu = time.perf_counter_ns() - wall, time.thread_time_ns() - cpu
    acc = dict(zip(W.ACC_NAMES, st.acc, strict=True))
    # the last batch (untimed) still marks the end of the loading: busy windows stay whole
    assert 0 <= time.perf_counter_ns() - acc["last_fetch_end_ns"] < 50e6
    # a timed batch preempted on a busy machine looks slow (>= 200 µs a sample), and the
    # next one is timed per sample: a few batches at most, never the cheap majority
    assert acc["batches"] == 1024 and acc["samples_timed"] <= 1024
    assert 128 <= acc["timed_batches"] <= 192  # one in eight, plus the batches timed per sample
    run = tmp_path / "run"
    (run / "workers").mkdir(parents=True)
    (run / "workers" / "1.json").write_bytes(json.dumps({
        "format": 1, "pid": 1, "role": "main", "updated_ns": time.perf_counter_ns(),
        "ended": True, "streams": [{**st.snapshot(), "loader_index": 0, "worker_id": None,
                                    "num_workers": 0, "generation": 1}]}).encode())
    w = summarize_workers(run)["loaders"][0]
    # every batch's samples counted (only the timing is one in eight): a count, not an estimate
    assert not w["samples_estimated"] and w["samples"] == 16384
    split = w["fetch_split"]
    # the truth: the wall and CPU time of the whole loop (timing included: a few %)
    assert w["sample_blocked_ms"]["mean"] + w["sample_cpu_ms"]["mean"] == pytest.approx(
        wall / 16384 / 1e6, rel=0.15)
    assert split["cpu"] + split["collate"] == pytest.approx(cpu / wall, abs=0.08), split
    assert w["sample_cpu_ms"]["mean"] == pytest.approx(cpu / 16384 / 1e6, rel=0.25), w
    assert w["sample_cpu_ms"]["mean"] >= 0.020  # at least the burn's 40 µs in half the samples


def test_samples_counted_on_a_few_timed_batches_are_shown_as_an_estimate(tmp_path):
    """num_workers=0, cheap samples and the script's own batch sampler: the training process
    times a few batches a second and scales the samples it saw to all batches - an estimate,
    shown with "~" (a run of exactly 6,000 samples read "6,016 samples"). (torch's own
    BatchSampler tells them exactly: the next test.)"""
    doc = run_script(tmp_path, """
class Cheap(Sleepy):
    def __len__(self):
        return 12_000
    def __getitem__(self, i):
        return torch.zeros(8), i % 2

batches = [list(range(i, i + 8)) for i in range(0, 12_000, 8)]
train(DataLoader(Cheap(), batch_sampler=batches), step_s=0.001)
""")
    w = loader_entry(doc)
    assert w["mode"] == "main" and w["batches"] == 1500
    if not w["samples_estimated"]:  # (a machine slow enough to time every batch)
        assert w["samples"] == 12_000
        return
    from trainprof.report.terminal import worker_rows

    assert w["samples"] == pytest.approx(12_000, rel=0.1)
    rows = worker_rows(doc["workers"], doc["dataloaders"])
    assert any(f"~{w['samples']:,} samples" in text for _, text in rows), rows


def test_samples_of_untimed_batches_are_counted_by_torchs_batch_sampler(tmp_path):
    """The same cheap samples with torch's BatchSampler: its batch size and the sampler's
    length count every batch's samples, the epoch's short last batch too, and an epoch left
    by a break: 2 epochs of 1,003 samples in batches of 8 (125 full, then 3), and 41 batches
    of a third (the 41st loaded, then the break)."""
    doc = run_script(tmp_path, """
class Cheap(Sleepy):
    def __len__(self):
        return 1003
    def __getitem__(self, i):
        return torch.zeros(8), i % 2

loader = DataLoader(Cheap(), batch_size=8, shuffle=True)
model = nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(3):
    for step, (x, y) in enumerate(loader):
        if epoch == 2 and step == 40:
            break
        loss = model(x).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
""")
    w = loader_entry(doc)
    assert (w["batches"], w["samples"]) == (2 * 126 + 41, 2 * 1003 + 41 * 8)
    assert not w["samples_estimated"]


def test_num_workers_0_is_measured_in_the_training_process(tmp_path):
    doc = run_script(tmp_path, """
train(DataLoader(Sleepy(), batch_size=8))
""")
    w = loader_entry(doc)
    assert (w["mode"], w["num_workers"], w["samples"], w["batches"]) == ("main", 0, 96, 12)
    # every batch timed but the 3 loaded under the op count's window (steps 8-10: the
    # tool's cost is in them); their samples are counted by torch's BatchSampler
    assert w["samples_timed"] == 72 and not w["samples_estimated"]
    assert doc["steps"]["profiled"] == 3
    assert w["processes"] == 1 and w["startup"] is None and w["busy_share"] is None
    assert w["cpu_wait_share"] is None  # no schedstat reads on the training thread
    assert 4.9 <= reads_ms(w) <= 6.5 and w["sample_cpu_ms"]["median"] < 1.0, w
    files = list((tmp_path / "run" / "workers").glob("*.json"))
    docs = [json.loads(p.read_text()) for p in files]
    assert [(d["role"], d["ended"]) for d in docs] == [("main", True)]  # the final write
    f = input_finding(doc)
    assert (f["cause"], f["severity"]) == ("too_few_workers", "high")
    assert f["evidence"]["fetch_split"]["blocked"] > 0.5
    assert "ms blocked (reads, latency)" in f["fix"]["text"]
    assert "num_workers=4,  # was 0" in f["fix"]["snippet"]


def test_num_workers_0_batches_under_a_heavy_tool_are_left_untimed(tmp_path):
    """--py's cProfile over steps 10-29 had made each 5 ms sample of a CPU-bound dataset
    about half as long again, and the input findings quoted it."""
    body = """
class Busy(Dataset):
    def __len__(self):
        return 160  # 40 batches of 4

    def __getitem__(self, i):
        t = time.thread_time()
        while time.thread_time() - t < 0.002:
            [str(k) for k in range(50)]  # Python work: what a profiler slows most
        return torch.zeros(8), i % 2

train(DataLoader(Busy(), batch_size=4))
"""
    doc = run_script(tmp_path, body, "--py")
    w = loader_entry(doc)
    assert doc["steps"]["profiled"] >= 20  # --py's window (steps 10-29) and the op count's
    assert w["samples_timed"] <= 4 * (40 - 20)  # the profiled steps' batches left out
    # what the timed ones took is the dataset's own 2 ms of CPU, not the profiler's
    assert 1.9 <= w["sample_cpu_ms"]["mean"] <= 2.6, w["sample_cpu_ms"]


def test_cheap_num_workers_0_batches_run_torchs_fetch_and_are_all_counted(tmp_path):
    """Cheap batches in the training process: torch's own fetch, a few timed, all counted.

    Three epochs of 40 batches (a new iterator each, let go at its end), one epoch
    left after 7 batches, and a last one still held when the run ends. Untimed
    batches must run the fetcher class's method untouched (no wrapper at all), and
    the batch count must be exact: it comes from the iterators themselves.
    """
    doc = run_script(tmp_path, """
from torch.utils.data._utils import fetch as F
original = F._MapDatasetFetcher.fetch

class Cheap(Dataset):
    def __len__(self):
        return 320
    def __getitem__(self, i):
        return torch.zeros(8), i % 2

loader = DataLoader(Cheap(), batch_size=8)
assert F._MapDatasetFetcher.fetch is original  # the class is never patched
train(loader, epochs=3, step_s=0.01)
for i, _ in enumerate(loader):
    if i == 6:
        break
held = iter(loader)
untimed = 0
for i in range(25):
    next(held)
    time.sleep(0.01)
    untimed += type(held._dataset_fetcher) is F._MapDatasetFetcher
assert untimed >= 10, untimed  # most batches ran torch's fetch, unwrapped
assert F._MapDatasetFetcher.fetch is original
""", "--sample-interval", "0.05")
    w = loader_entry(doc)
    assert w["mode"] == "main" and w["batches"] == 3 * 40 + 7 + 25
    assert w["samples"] == 8 * w["batches"]  # every batch full: the estimate is exact
    files = list((tmp_path / "run" / "workers").glob("*.json"))
    (stream,) = json.loads(files[0].read_text())["streams"]
    # timed about five times a second (~1.6 s of loading), and never all of them
    assert 4 <= stream["timed_batches"] <= 40, stream["timed_batches"]
    assert w["sample_blocked_ms"]["mean"] + w["sample_cpu_ms"]["mean"] < 1.0


def test_a_slow_collate_is_named(tmp_path):
    doc = run_script(tmp_path, """
class Cheap(Dataset):
    def __len__(self):
        return 512  # 32 batches a worker: the start-up stall is a small part of their time
    def __getitem__(self, i):
        return [float(v) for v in range(16)], i % 2

def slow_collate(batch):          # a per-element Python loop: ~15 ms of CPU per batch
    burn(15)
    return torch.tensor([x for x, _ in batch]), torch.tensor([y for _, y in batch])

if __name__ == "__main__":
    model = nn.Linear(16, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Cheap(), batch_size=8, num_workers=2, persistent_workers=True,
                        collate_fn=slow_collate)
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
""")
    w = loader_entry(doc)
    assert w["batches"] == 64 and w["samples"] == 512
    # cheap samples: timed per batch after each worker's first batch (a batch stretched by
    # preemption on the busy machine may be timed per sample again: it costs little)
    assert w["samples_timed"] < 128, w
    assert w["collate_ms"]["mean"] >= 14.0, w
    assert w["fetch_split"]["collate"] > 0.8, w
    f = input_finding(doc)
    assert f["cause"] == "collate", f
    assert f["evidence"]["collate_ms_per_batch"]["mean"] >= 14.0
    assert "collate_fn takes" in f["title"]
    assert "collate_fn=fast_collate," in f["fix"]["snippet"]
    compile(f["fix"]["snippet"], "snippet", "exec")  # the snippet is valid Python


def test_workers_restarted_every_epoch_record_their_start_up(tmp_path):
    doc = run_script(tmp_path, """
class Tagged(Dataset):
    tag = None
    def __len__(self):
        return 64
    def __getitem__(self, i):
        return torch.randn(8), self.tag

def open_shards(worker_id):       # the user's worker_init_fn still runs, first
    time.sleep(0.15)
    torch.utils.data.get_worker_info().dataset.tag = worker_id

if __name__ == "__main__":
    loader = DataLoader(Tagged(), batch_size=8, num_workers=2, worker_init_fn=open_shards)
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(3):
        for x, y in loader:
            assert set(y.tolist()) <= {0, 1}, y
            time.sleep(0.01)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
    assert loader.worker_init_fn is open_shards  # left as the user set it
""")
    w = loader_entry(doc)
    assert (w["generations"], w["processes"], w["samples"]) == (3, 6, 192)
    gens = w["startup"]["per_generation"]
    assert [g["generation"] for g in gens] == [1, 2, 3]
    assert all(g["workers"] == 2 for g in gens)
    assert all(0.14 <= g["init_s"] <= 1.0 for g in gens), gens  # the user's init, timed
    assert all(g["first_batch_s"] >= g["init_s"] for g in gens)
    assert gens[0]["at_s"] < gens[1]["at_s"] < gens[2]["at_s"]
    assert w["startup"]["avoidable_s"] == pytest.approx(
        gens[1]["first_batch_s"] + gens[2]["first_batch_s"])
    f = input_finding(doc)
    assert f["cause"] == "worker_startup_per_epoch", f
    assert f["evidence"]["worker_generations"] == 3
    assert f["evidence"]["worker_startup_s"] >= 0.15


def test_iterable_dataset_times_next_per_sample(tmp_path):
    doc = run_script(tmp_path, """
class Stream(IterableDataset):
    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        for i in range(info.id, 80, info.num_workers):
            time.sleep(0.004)
            yield torch.zeros(8), i % 2

if __name__ == "__main__":
    train(DataLoader(Stream(), batch_size=8, num_workers=2))
""")
    w = loader_entry(doc)
    assert w["samples"] == 80 and w["batches"] == 10
    assert 3.9 <= reads_ms(w) <= 5.5, w


KILLED = """
import signal

class Endless(Sleepy):
    def __len__(self):
        return 100_000

if __name__ == "__main__":
    loader = DataLoader(Endless(), batch_size=4, num_workers=2, persistent_workers=True)
    it = iter(loader)
    victim = it._workers[0].pid
    t0 = time.monotonic()
    try:
        while True:
            x, y = next(it)
            if time.monotonic() - t0 > 1.8:
                os.kill(victim, signal.SIGKILL)   # a worker dies mid-run (OOM killer, ...)
                time.sleep(0.5)
    except (RuntimeError, StopIteration) as exc:
        print("loader ended:", type(exc).__name__, exc, file=sys.stderr)
    print("victim", victim)
"""


def test_a_worker_killed_mid_run_leaves_a_readable_file(tmp_path):
    write_script(tmp_path, "train.py", COMMON + KILLED)
    res = trainprof("run", "train.py", cwd=tmp_path, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    victim = int(res.stdout.split("victim ")[1].split()[0])
    folder = tmp_path / "run" / "workers"
    doc = json.loads((folder / f"{victim}.json").read_text())
    assert doc["ended"] is False  # never closed: this is the last periodic write
    s = doc["streams"][0]
    # written at least once a second while it ran for ~1.8 s at 20 ms per batch (on 2 shared
    # cores, a sleep can take longer: a loose floor)
    assert s["batches"] >= 10, s
    # leftovers of a kill mid-write are skipped, never fatal
    (folder / f".{victim}.json.{victim}.tmp").write_bytes(b'{"format": 1, "str')
    (folder / "12345.json").write_bytes(b"not json")
    summary = summarize_workers(tmp_path / "run")
    assert summary is not None
    assert summary["loaders"][0]["processes"] == 2
    assert summary["loaders"][0]["samples"] >= 4 * s["batches"]


def test_sampled_worker_stacks_put_the_slow_transform_on_top(tmp_path):
    doc = run_script(tmp_path, """
def read_file(i):
    time.sleep(0.001)             # the read: ~1 ms blocked
    return torch.zeros(8)

def slow_transform(x):
    burn(8)                       # the transform: ~8 ms of CPU
    return x

class Images(Sleepy):
    def __getitem__(self, i):
        return slow_transform(read_file(i)), i % 2

if __name__ == "__main__":
    train(DataLoader(Images(), batch_size=8, num_workers=2, persistent_workers=True), epochs=2)
""", "--py")
    w = loader_entry(doc)
    assert doc["workers"]["sampled"] is True
    fns = w["functions"]
    assert fns["samples_in_fetch"] >= 80, fns  # ~100 Hz over >= 0.8 s of fetching per worker
    top = fns["top"]
    # burn() is where slow_transform spends its CPU, so it is the innermost frame (self time).
    # The samples are of wall time: ~8 ms of transform to ~1 ms of read, and on busy cores the
    # transform's CPU stretches more than the sleep. With the default 5 ms GIL switch interval
    # the sampler waited out the transform's last 5 ms and landed in the next read: read_file
    # got 0.59 of the samples in CI (see worker.py, sampling bias) - this guards that fix.
    names = [f["function"] for f in top]
    assert "burn" in names[:2], top
    by_name = {f["function"]: f for f in top}
    assert by_name["slow_transform"]["total_share"] >= by_name["burn"]["total_share"]
    assert by_name["slow_transform"]["self_samples"] == 0
    assert by_name["slow_transform"]["total_share"] >= 0.6, top
    assert 0 < by_name["read_file"]["total_share"] <= 0.3, top
    assert by_name["Images.__getitem__"]["total_share"] > 0.9, top
    assert all(f["where"].startswith("train.py:") for f in top[:2])
    stacks = list((tmp_path / "run" / "workers").glob("*.stacks.json"))
    assert len(stacks) == 2
    f = input_finding(doc)
    assert any("slow_transform" in s or "burn" in s for s in f["evidence"]["worker_functions"])


def test_no_worker_files_no_section(tmp_path):
    assert summarize_workers(tmp_path) is None
    (tmp_path / "workers").mkdir()
    assert summarize_workers(tmp_path) is None


# -- samples that cost microseconds: workers do not pay --------------------------------------


def test_cheap_samples_in_idle_workers_are_a_handoff_and_in_process_an_overhead():
    # 2 µs a sample, workers idle 80%: the loop waits for the batches' hand-over
    f, _, _ = diagnose_with(entry(0.0005, 0.0, 0.0015, 1.5, busy=0.2), data_ms=3.0)
    assert f["cause"] == "worker_handoff", f["cause"]
    assert "idle 80% of the time" in f["title"]
    assert f["evidence"]["sample_cost_ms"] == pytest.approx(0.002)
    assert "num_workers=0,  # was 2: samples cost 2 µs" in f["fix"]["snippet"]
    assert "BatchSampler(" in f["fix"]["snippet"] and f["verify"].startswith(
        "trainprof tune --knob num_workers=0,2 ")
    # the loop could keep what the samples cost itself: 32 x 2 µs of the 3 ms wait
    share = f["evidence"]["data_wait_share"]
    assert f["estimated_gain"] == pytest.approx(share * (1 - 0.064 / 3.0), rel=0.02)
    # the same samples dearer (1 ms each) in idle workers: not a hand-over
    f, _, _ = diagnose_with(entry(0.1, 0.0, 0.9, 0.5, busy=0.3))
    assert f["cause"] == "undetermined"
    # cheap samples loaded in the training process: workers would not pay either
    w = entry(0.0005, 0.0, 0.0015, 0.4)
    w.update(mode="main", num_workers=0)
    f, _, _ = diagnose_with(w, loader_kw={"num_workers": 0, "persistent_workers": False},
                            data_ms=1.0)
    assert f["cause"] == "per_sample_overhead", f["cause"]
    assert "samples that cost 2 µs each, loaded one sample at a time" in f["title"]
    assert "def __getitem__(self, indices)" in f["fix"]["snippet"]
    assert "num_workers=4" not in f["fix"]["snippet"]
    # dearer samples in the training process: workers, as before
    w = entry(0.0, 0.0, 0.5, 0.4)
    w.update(mode="main", num_workers=0)
    f, _, _ = diagnose_with(w, loader_kw={"num_workers": 0, "persistent_workers": False})
    assert f["cause"] == "too_few_workers"


def test_idle_workers_and_a_batch_cheaper_than_the_wait_are_a_handoff_whatever_the_mean():
    """An IterableDataset of 16 floats a sample (run on this machine): 9.5 µs a typical
    sample, but a 25 µs mean from a few first samples of each worker (above the 20 µs
    "cheap" line), 2 workers idle 75% of the time, 0.35 ms of collate, and a 1.8 ms wait.
    A batch would take ~0.65 ms in the training process: the wait is the hand-over.
    ``trainprof tune --knob num_workers=0,2`` measured num_workers=0 ×4.6 faster; the
    finding had said "undetermined" and suggested a third worker."""
    w = entry(0.0, 0.0, 0.0095, 0.35, busy=0.25)
    w["sample_blocked_ms"]["mean"] = 0.011  # a few slow first samples
    f, _, _ = diagnose_with(w, loader_kw={"iterable_dataset": True, "sampler": None,
                                          "batch_sampler": None}, data_ms=1.8)
    assert f["cause"] == "worker_handoff", (f["cause"], f["evidence"])
    assert f["evidence"]["in_process_batch_s"] == pytest.approx((32 * 0.0095 + 0.35) / 1e3)
    assert "A sample costs the workers 10 µs (typically), a batch 0.65 ms" in f["fix"]["text"]
    snippet = f["fix"]["snippet"]
    assert "num_workers=0,  # was 2: samples cost 10 µs" in snippet
    # an IterableDataset yields whole batches: no indices, no BatchSampler
    assert "def __iter__(self):" in snippet and "BatchSampler" not in snippet
    assert "batch_size=None,  # each item is a batch already" in snippet
    share = f["evidence"]["data_wait_share"]  # bound: the samples stay, hand-over and collate go
    assert f["estimated_gain"] == pytest.approx(share * (1 - 32 * 0.0095 / 1.8), rel=0.02)
    # a TensorDataset reads a batch from a list of indices as it is: no class to write
    f, _, _ = diagnose_with(w, loader_kw={"dataset": "torch.utils.data.dataset.TensorDataset"},
                            data_ms=1.8)
    assert "dataset = TensorDataset(...)  # as now" in f["fix"]["snippet"]
    assert "def __getitem__" not in f["fix"]["snippet"] and "BatchSampler(" in f["fix"]["snippet"]
    # a batch that costs more than half the wait to make: not shown to be the hand-over;
    # the workers are idle, so no more of them either
    f, _, _ = diagnose_with(entry(0.0, 0.0, 0.03, 0.5, busy=0.25), data_ms=1.8)
    assert f["cause"] == "undetermined", f["cause"]
    assert "num_workers=2,  # unchanged: busy only 25% of the time" in f["fix"]["snippet"]
    assert "more of them would not help" in f["fix"]["text"]
    assert f["verify"].startswith("trainprof tune --knob num_workers=0,2,4 ")


def test_a_collate_that_does_the_work_in_a_busy_training_process_gets_no_worker():
    """A collate_fn that tokenises (1.15 ms a batch of 32 sentences that cost 2 µs each to
    fetch) in a CPU run whose training process keeps both cores busy (181%). The finding
    said "per-sample overhead: read a batch at once", which leaves the collate's work;
    a worker would take a core from the model: ``trainprof tune --knob num_workers=0,1``
    measured one worker ×2.0 slower. Now: make the batch cheaper, the collate named."""
    w = entry(0.0001, 0.0, 0.0017, 1.15, busy=None)
    w.update(mode="main", num_workers=0, busy_share_active=None)
    busy = {"n_samples": 20, "proc_cpu_pct": 181.0, "workers_cpu_pct": 0.0,
            "sys_cpu_pct": 92.0}
    f, _, _ = diagnose_with(w, loader_kw={"num_workers": 0, "persistent_workers": False},
                            system=busy, data_ms=1.0)
    assert f["cause"] == "cpu_transforms", f["cause"]
    assert "in the training process" in f["title"] and "keeps every core busy" in f["title"]
    assert "collate_fn takes 95% of the loading" in f["fix"]["text"]
    assert "num_workers=0,  # unchanged" in f["fix"]["snippet"]
    assert "--knob num_workers=0,1 --knob torch_threads=1,2" in f["verify"]
    # the same loading with a core free: a worker overlaps it
    f, _, _ = diagnose_with(w, loader_kw={"num_workers": 0, "persistent_workers": False},
                            data_ms=1.0)
    assert f["cause"] == "too_few_workers", f["cause"]


def test_a_handoff_finding_withdraws_the_workers_contention_finding_it_makes_moot():
    """"num_workers=0" (the hand-over) and "keep the 2 workers, they use 0.6 cores"
    (cpu_contention) would contradict each other; with no workers left there is no
    contention, so that finding goes and the hand-over names it."""
    from test_diagnosis import MS, loader, make_steps, make_summary

    from trainprof.diagnosis import diagnose

    def findings(w, data_ms=1.8, proc=120.0, workers_cpu=60.0):
        steps = make_steps(60, data=data_ms * MS)
        summary = make_summary(
            steps, dataloaders=[loader(num_workers=2, persistent_workers=True)],
            system={"n_samples": 20, "proc_cpu_pct": proc, "workers_cpu_pct": workers_cpu,
                    "sys_cpu_pct": 95.0},
            workers={"loaders": [w]})
        return {(f["category"], f["cause"]): f for f in diagnose(summary, steps)}

    # workers that are busy (no hand-over): both findings stand
    both = findings(entry(0.0, 0.0, 0.03, 0.5, busy=0.9))
    assert ("cpu_contention", "workers_oversubscribe_cores") in both, list(both)
    # idle workers and cheap batches: the hand-over, and no contention finding
    found = findings(entry(0.0, 0.0, 0.0095, 0.35, busy=0.25))
    handoff = found[("input_pipeline", "worker_handoff")]
    assert ("cpu_contention", "workers_oversubscribe_cores") not in found, list(found)
    assert handoff["evidence"]["supersedes"] == ["cpu_contention/workers_oversubscribe_cores"]

    # a loop mostly waiting, the process's idle threads spinning (138% CPU where its work
    # needs 67%): without the workers nothing is left to spin against either
    def waiting(w):
        return findings(w, data_ms=20, proc=138.0, workers_cpu=48.0)

    busy = waiting(entry(0.0, 0.0, 0.3, 0.5, busy=0.9))
    assert ("cpu_contention", "spinning_threads") in busy, list(busy)
    found = waiting(entry(0.0, 0.0, 0.0095, 0.35, busy=0.25))
    assert ("cpu_contention", "spinning_threads") not in found, list(found)
    assert "cpu_contention/spinning_threads" in found[
        ("input_pipeline", "worker_handoff")]["evidence"]["supersedes"]


CHEAP = """
import numpy as np
from torch.utils.data import BatchSampler, RandomSampler

class Decoded(Dataset):          # pre-decoded images in memory: microseconds a sample
    def __init__(self, n=12000):
        g = np.random.default_rng(0)
        self.images = torch.from_numpy(g.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8))
        self.labels = torch.arange(n) % 2
    def __len__(self):
        return len(self.images)
    def __getitem__(self, i):     # one index, or a list of them (a whole batch)
        return self.images[i], self.labels[i]

def fit(loader, epochs=2):
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(epochs):
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x.float() / 255), y)
            opt.zero_grad(); loss.backward(); opt.step()

if __name__ == "__main__":
    data = Decoded()
    mode = sys.argv[1]
    if mode == "workers":
        fit(DataLoader(data, batch_size=256, shuffle=True, num_workers=2, persistent_workers=True))
    elif mode == "main":
        fit(DataLoader(data, batch_size=256, shuffle=True))
    else:
        batches = BatchSampler(RandomSampler(data), 256, False)
        fit(DataLoader(data, batch_size=None, sampler=batches))
"""


@pytest.mark.parametrize(("mode", "cause"), [
    ("workers", "worker_handoff"), ("main", "per_sample_overhead"), ("batched", "batched_read"),
])
def test_pre_decoded_samples_get_no_advice_to_add_workers(tmp_path, mode, cause):
    write_script(tmp_path, "train.py", COMMON + CHEAP)
    res = trainprof("run", "--json", "train.py", mode, cwd=tmp_path, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = res.json()
    w = loader_entry(doc)
    per_sample = w["sample_cpu_ms"]["mean"] + w["sample_blocked_ms"]["mean"]
    if mode == "batched":
        per_sample /= 256
    assert per_sample < 0.02, w  # microseconds: indexing a tensor
    hits = [f for f in doc["findings"] if f["category"] == "input_pipeline"]
    if not hits:  # the wait fell under the 5% band (a fast step on a quiet machine)
        assert doc["breakdown"]["data_wait"] < 0.05
        return
    (f,) = hits
    assert f["cause"] == cause, (f["cause"], f["title"])
    assert "num_workers=4" not in f["fix"]["snippet"] and "num_workers=3" not in f["fix"]["snippet"]
    # where the fix is a code change, the num_workers knob only checks that workers do not
    # help: verify must not judge it as the fix ("refuted" when they did not, as predicted)
    from trainprof.experiments.verify import knob_role

    assert knob_role(f["verify"]) == ("fix" if cause == "worker_handoff" else "bound"), f


# -- an IterableDataset every worker iterates whole -------------------------------------------


def test_a_batch_digest_reads_the_content_not_the_objects():
    import numpy as np
    import torch

    from trainprof.capture.batch_digest import MAX_BYTES, batch_digest

    x = torch.arange(64.0).reshape(8, 8)
    batch = {"x": x, "y": [1, 2], "name": "a"}
    same = {"x": x.clone(), "y": [1, 2], "name": "a"}
    assert batch_digest(batch) == batch_digest(same)
    for other in ({"x": x + 1, "y": [1, 2], "name": "a"}, {"x": x, "y": [1, 3], "name": "a"},
                  {"x": x.reshape(4, 16), "y": [1, 2], "name": "a"},
                  {"x": x.double(), "y": [1, 2], "name": "a"}, (x, [1, 2], "a")):
        assert batch_digest(other) != batch_digest(batch), other
    # views, dtypes numpy has not, numpy arrays, objects of any other kind: never raises
    assert batch_digest(x.t()) == batch_digest(x.t().contiguous())
    assert batch_digest(x.bfloat16()) != batch_digest(x.half())
    assert batch_digest(np.arange(5)) == batch_digest(np.arange(5))
    assert batch_digest(np.arange(5)) != batch_digest(np.arange(1, 6))
    assert batch_digest([object()]) == batch_digest([object()])  # its type only
    # a tensor's data past the first MAX_BYTES is not read
    big = torch.zeros(MAX_BYTES)  # 4 bytes an element
    tail = big.clone()
    tail[-1] = 1
    assert batch_digest(big) == batch_digest(tail)


def _stream(generation: int, *digests: str | None) -> dict[str, Any]:
    return {"generation": generation, "first_batches": list(digests)}


def test_same_stream_needs_equal_first_batches_and_data_that_varies():
    from trainprof.analysis.workers import _same_stream

    # two of three workers of generation 1 read the same stream; generation 2 was split
    streams = [_stream(1, "a", "b"), _stream(1, "a", "b"), _stream(1, "c", "d"),
               _stream(2, "e", "f"), _stream(2, "g", "h")]
    assert _same_stream(streams) == {"generation": 1, "identical_workers": 2,
                                     "workers_compared": 3}
    # one constant batch in every worker (synthetic data): not a stream read twice
    assert _same_stream([_stream(1, "k", "k"), _stream(1, "k", "k")])["identical_workers"] == 1
    # a worker that loaded one batch only, or fingerprints that failed: compared on the
    # first batch only where a second one shows the data varies
    assert _same_stream([_stream(1, "a"), _stream(1, "a", "b")])["identical_workers"] == 2
    assert _same_stream([_stream(1, "a", None), _stream(1, "a", None)])["identical_workers"] == 1
    assert _same_stream([_stream(1, "a", "b")]) is None  # nothing to compare with
    assert _same_stream([{"generation": 1}, {"generation": 1}]) is None  # map-style datasets


STREAMS = """
from torch.utils.data import get_worker_info

class Rows(IterableDataset):          # the whole table in every worker
    def __iter__(self):
        for i in range(320):
            yield torch.full((16,), float(i)), i % 2

class Shards(IterableDataset):        # split by get_worker_info(): each worker its share
    def __iter__(self):
        info = get_worker_info()
        for i in range(info.id, 320, info.num_workers):
            yield torch.full((16,), float(i)), i % 2

class Noise(IterableDataset):         # random samples: each worker is seeded apart
    def __iter__(self):
        for _ in range(160):
            yield torch.randn(16), 0

class Constant(IterableDataset):      # one sample, again and again (a benchmark's stand-in)
    def __iter__(self):
        for _ in range(160):
            yield torch.ones(16), 0

class Lines(Dataset):                 # map-style, but reads a stream: its index is ignored
    def __init__(self):
        self.rows = iter(range(10**9))
    def __len__(self):
        return 160
    def __getitem__(self, index):
        i = next(self.rows)
        return torch.full((16,), float(i)), i % 2

if __name__ == "__main__":
    model = nn.Linear(16, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for dataset in (Rows(), Shards(), Noise(), Constant(), Lines()):
        for x, y in DataLoader(dataset, batch_size=8, num_workers=2):
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
"""


def test_an_iterable_dataset_every_worker_reads_whole_is_found(tmp_path):
    """Only the stream both workers read whole is named: not the one split by
    get_worker_info(), nor random or constant samples (the same batches by design); and a
    map-style dataset whose __getitem__ reads a stream of its own, not its index."""
    write_script(tmp_path, "train.py", COMMON + STREAMS)
    res = trainprof("run", "--json", "--no-html", "train.py", cwd=tmp_path, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = res.json()
    datasets = [d["dataset"].rsplit(".", 1)[-1] for d in doc["dataloaders"]]
    assert datasets == ["Rows", "Shards", "Noise", "Constant", "Lines"]
    same = [loader_entry(doc, i)["same_stream"] for i in range(5)]
    assert [s["identical_workers"] for s in same] == [2, 1, 1, 1, 2], same
    assert loader_entry(doc, 0)["samples"] == 640  # the 320 rows, twice
    (f,) = [f for f in doc["findings"] if f["cause"] == "iterable_not_split"]
    assert (f["category"], f["severity"], f["estimated_gain"]) == ("input_pipeline", "high", 0)
    assert f["evidence"]["loader"]["dataset"].endswith("Rows")
    assert f["title"].startswith("Duplicated data, every sample 2 times an epoch: all 2 "
                                 "DataLoader workers load the same data, Rows")
    assert "get_worker_info()" in f["fix"]["snippet"] and "class Rows(" in f["fix"]["snippet"]
    report = trainprof("report", str(res.run_dir), cwd=tmp_path)
    assert "no faster step: fewer of them (each epoch repeats its data)" in report.stdout
    # a map-style dataset that reads a stream it holds: the workers' copies repeat it
    (m,) = [f for f in doc["findings"] if f["cause"] == "map_dataset_ignores_index"]
    assert (m["severity"], m["estimated_gain"]) == ("high", 0)
    assert m["title"].startswith("All 2 DataLoader workers load the same data: "
                                 "Lines.__getitem__ ignores its index")
    assert "def __getitem__(self, index)" in m["fix"]["snippet"]


# -- several loaders feeding one loop ---------------------------------------------------------


def test_of_two_loaders_zipped_in_one_loop_the_slower_ones_wait_is_diagnosed(tp):
    """``zip(labeled, unlabeled)``: both shuffled, both feed every step; the wait is the
    unlabelled one's reads (0.3 ms a sample), not the in-memory labelled set's. The
    finding named the first shuffled loader: "samples that cost 6 µs, read a batch at
    once" for a wait that was all the other loader's."""
    res = tp("""
        import time, torch, torch.nn as nn
        from torch.utils.data import DataLoader, Dataset, TensorDataset
        class Slow(Dataset):
            def __len__(self): return 1024
            def __getitem__(self, i):
                time.sleep(0.0003); return torch.randn(32)
        labeled = DataLoader(TensorDataset(torch.randn(1024, 32), torch.randint(0, 2, (1024,))),
                             batch_size=32, shuffle=True)
        unlabeled = DataLoader(Slow(), batch_size=32, shuffle=True)
        model = nn.Linear(32, 2); opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for (x, y), u in zip(labeled, unlabeled):
            loss = nn.functional.cross_entropy(model(x), y) + model(u).pow(2).mean() * 0.1
            opt.zero_grad(); loss.backward(); opt.step()
    """, "--json", "--no-html")
    assert res.returncode == 0, res.stderr[-3000:]
    doc = res.json()
    assert doc["breakdown"]["data_wait"] > 0.5, doc["breakdown"]
    f = input_finding(doc)
    assert f["evidence"]["loader"]["index"] == 1, f["evidence"]["loader"]
    assert f["cause"] == "too_few_workers", f["cause"]
    assert "Slow(...),  # your dataset, unchanged" in f["fix"]["snippet"]
    assert f["evidence"]["sample_blocked_ms"]["median"] > 0.25


def test_the_split_reminder_is_left_out_where_the_workers_streams_were_seen_to_differ():
    """An IterableDataset with 2 idle workers: the snippet reminds to split the stream by
    worker, unless the workers' first batches were compared and differed."""
    from test_diagnosis import MS, loader, make_steps, make_summary

    from trainprof.diagnosis import diagnose

    def snippet(same_stream):
        w = entry(0.0, 0.0, 0.2, 0.5, busy=0.2)  # idle workers, samples not cheap
        w["same_stream"] = same_stream
        steps = make_steps(60, data=5 * MS)
        summary = make_summary(
            steps, dataloaders=[loader(num_workers=2, iterable_dataset=True, len=None,
                                       sampler=None, batch_sampler=None)],
            system={"n_samples": 20, "proc_cpu_pct": 100.0, "workers_cpu_pct": 30.0,
                    "sys_cpu_pct": 70.0},
            workers={"loaders": [w]})
        f = next(f for f in diagnose(summary, steps) if f["category"] == "input_pipeline")
        return f["fix"]["snippet"]

    reminder = "split the stream by torch.utils.data.get_worker_info()"
    assert reminder in snippet(None)  # not compared
    assert reminder not in snippet(
        {"generation": 1, "identical_workers": 1, "workers_compared": 2})


def test_cpu_transforms_gives_the_image_recipe_only_for_images_and_no_cache_to_a_stream():
    """An IterableDataset was told to wrap itself in CachedDataset (which raises
    PackError: it needs len() and [i]); 1-D signal features got the image recipe
    (crop_flip_uint8, MEAN/STD, colour jitter)."""
    from test_diagnosis import MS, loader, make_steps, make_summary

    from trainprof.diagnosis import diagnose

    def fix(tensors, **loader_kw):
        steps = make_steps(60, data=10 * MS)
        summary = make_summary(
            steps, dataloaders=[loader(num_workers=2, persistent_workers=True, **loader_kw)],
            system={"n_samples": 20, "proc_cpu_pct": 40.0, "workers_cpu_pct": 60.0,
                    "sys_cpu_pct": 50.0},
            workers={"loaders": [entry(0.1, 0.3, 0.6, 0.5)]},
            batch_tensors=[{"loader_index": 0, "tensors": tensors}] if tensors else None)
        (f,) = [f for f in diagnose(summary, steps) if f["category"] == "input_pipeline"]
        assert f["cause"] == "cpu_transforms"
        compile(f["fix"]["snippet"], "snippet", "exec")
        return f, f["fix"]["text"] + f["fix"]["snippet"]

    image_words = ("crop_flip_uint8", "MEAN", "color_jitter", "uint8", "Normalize")
    images = [{"path": "batch[0]", "dtype": "uint8", "shape": [32, 3, 64, 64]}]
    f, said = fix(images, dataset="__main__.PngFolder")
    assert f["evidence"]["samples_are_images"] is True
    assert 'CachedDataset(PngFolder(...), "cache/train", transform=crop_flip_uint8)' in said
    assert all(w in said for w in image_words)
    signals = [{"path": "batch[0]", "dtype": "float32", "shape": [64, 36]},
               {"path": "batch[1]", "dtype": "int64", "shape": [64]}]
    for tensors in (signals, None):  # not images, or nothing known: no image names
        f, said = fix(tensors, dataset="__main__.Signals")
        assert 'dataset = CachedDataset(Signals(...), "cache/train")' in said
        assert not [w for w in image_words if w in said], said
    # a stream: packed once ahead of training, read back map-style; no CachedDataset
    tokens = [{"path": "batch[0]", "dtype": "int64", "shape": [16, 64]}] * 2
    f, said = fix(tokens, dataset="__main__.TextStream", iterable_dataset=True, len=None,
                  sampler="torch.utils.data.dataloader._InfiniteConstantSampler")
    snippet = f["fix"]["snippet"]
    assert "CachedDataset(" not in snippet and "crop_flip_uint8" not in said
    assert 'pack_dataset(TextStream(...), "cache/train.pack")' in snippet
    assert 'dataset = PackedDataset("cache/train.pack")' in snippet
    assert "    dataset,  # the packed samples above" in snippet
    assert "get_worker_info" not in snippet  # the packed dataset is map-style: no split
    assert "needs a map-style dataset" in f["fix"]["text"]
    assert "once the pack is written" in f["verify"]


def test_the_split_snippet_gives_each_worker_its_own_files_and_each_sample_once():
    """The fix split by sample (``i % shards == shard``): every worker still read and
    tokenised the whole stream (1.9 ms of worker CPU a sample against 0.96 ms split by
    file). It splits the files now, by sample only when there is a single file."""
    import torch
    from torch.utils.data import DataLoader, get_worker_info

    from trainprof.diagnosis.iterable_split import split_snippet

    snippet = split_snippet("Lines")
    assert "files[shard::shards]" in snippet and snippet.index(
        "files[shard::shards]") < snippet.index("i % shards == shard")
    scope: dict[str, Any] = {}
    exec(snippet, scope)
    reads: list[tuple[int, int]] = []  # (file, worker) of every sample read, kept or not

    class Lines(scope["Lines"]):
        def __init__(self, files):
            self.files = files

        def read(self, path):
            info = get_worker_info()
            for i in range(5):  # the worker that read it travels with the sample
                yield torch.tensor([int(path[1:]) * 100 + i, info.id if info else -1])

        def samples(self):
            for path in self.files:
                yield from self.read(path)

    for files in (["f0", "f1", "f2", "f3", "f4"], ["f7"]):
        rows = [tuple(r.tolist()) for b in DataLoader(Lines(files), batch_size=2) for r in b]
        split = [tuple(r.tolist()) for b in DataLoader(Lines(files), batch_size=2,
                                                       num_workers=2) for r in b]
        # each sample once, as without workers
        assert sorted(s for s, _ in split) == sorted(s for s, _ in rows)
        assert len({s for s, _ in split}) == 5 * len(files)
        reads.extend((s // 100, w) for s, w in split)
    # several files: each file read by one worker only
    by_file: dict[int, set[int]] = {}
    for file, worker in reads:
        by_file.setdefault(file, set()).add(worker)
    assert all(len(by_file[f]) == 1 for f in range(5)), by_file
    assert by_file[7] == {0, 1}  # a single file: both read it, each keeps its share


def _alive(pid: int) -> bool:
    """A process that runs (a zombie waiting for its re-parented reaper has ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.01)
    return [p for p in pids if _alive(p)]


KILLED_SELF = """
import signal

class Slow(Sleepy):
    def __len__(self):
        return 100_000

loader = DataLoader(Slow(), batch_size=4, num_workers=2, persistent_workers=True)
model = nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step, (x, y) in enumerate(loader):
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    if step == 10:
        print("workers", *[w.pid for w in loader._iterator._workers], flush=True)
        time.sleep(0.5)  # a long step: the workers' prefetch is done, they wait for indices
        os.kill(os.getpid(), signal.SIGKILL)   # a hard death mid-epoch (OOM killer, ...)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_workers_end_with_a_training_process_killed_hard(tmp_path):
    """Without a parent-death signal the workers stayed 4.5-5 s (torch's watchdog looks
    every 5 s); with it they end as the training process does."""
    write_script(tmp_path, "train.py", COMMON + KILLED_SELF)
    out = tmp_path / "out.txt"
    with open(out, "wb") as fh:  # a file, not a pipe: its reader would wait for the workers
        proc = subprocess.run([sys.executable, "-m", "trainprof", "run", "--out", "run",
                               "train.py"], cwd=tmp_path, stdout=fh, stderr=subprocess.STDOUT,
                              timeout=120)
    text = out.read_text()
    pids = [int(p) for p in text.split("workers ")[1].split()[:2]]
    try:
        assert proc.returncode == -signal.SIGKILL, (proc.returncode, text[-2000:])
        assert _gone_within(pids, 1.0) == []
    finally:
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


THREAD_STARTED = """
import threading

loader = DataLoader(Sleepy(), batch_size=4, num_workers=2, persistent_workers=True)
box = []
t = threading.Thread(target=lambda: box.append(iter(loader)))
t.start(); t.join()                     # the workers' forking thread has ended
time.sleep(0.5)                         # a parent-death signal would fire here
model = nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
n = 0
for epoch in range(2):
    for x, y in (box.pop() if box else loader):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        n += 1
print("steps", n)
"""


def test_workers_started_from_a_thread_outlive_that_thread(tmp_path):
    """PR_SET_PDEATHSIG fires when the forking *thread* exits: workers a thread of the
    script started must not be killed when that thread ends while training goes on."""
    write_script(tmp_path, "train.py", COMMON + THREAD_STARTED)
    res = trainprof("run", "train.py", cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "steps 48" in res.stdout


def test_a_loader_of_whole_batches_says_items_not_samples():
    """An IterableDataset yielding ready-made 48-sample batches with batch_size=None: the
    Loading row said "60 samples" while the throughput counted 2,880: each item is a batch."""
    from trainprof.report.terminal import worker_rows

    w = {"loader_index": 0, "mode": "main", "samples": 60, "samples_estimated": False,
         "sample_blocked_ms": None, "sample_cpu_ms": None, "collate_ms": None}
    whole = [{"index": 0, "batch_size": None, "batch_sampler": None}]
    ((_, row),) = worker_rows({"loaders": [w]}, whole)
    assert "60 items, each a whole batch (batch_size=None)" in row and "per item" in row
    batched = [{"index": 0, "batch_size": 48,
                "batch_sampler": "torch.utils.data.sampler.BatchSampler"}]
    ((_, row),) = worker_rows({"loaders": [w]}, batched)
    assert "60 samples" in row and "per sample" in row
