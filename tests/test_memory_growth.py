"""Memory that keeps growing through the steady state (expert rule M3): the trend test, the
finding, and real runs — a leak, its fix, and a memory-mapped file that is not a leak."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import trainprof, write_script
from test_diagnosis import make_steps, make_summary

from trainprof.analysis.memory_growth import series_growth, theil_sen_slope
from trainprof.diagnosis import diagnose

MB = 2**20


def test_theil_sen_ignores_outliers():
    t = np.arange(50, dtype=float)
    y = 3.0 * t + 7
    y[[5, 20, 40]] += 1e6  # three wild samples
    assert theil_sen_slope(t, y) == pytest.approx(3.0)


@pytest.mark.parametrize("shape, grows", [
    ("linear", True),
    ("filled_then_flat", False),  # a cache that filled in the first half
    ("flat_noise", False),
    ("one_jump", False),  # an allocator block taken once
    ("jump_mid_second_half", False),  # one rise between quarters 2 and 3, then flat: the
    # last quarter's median a hair above the third's had passed "rising in each quarter"
    ("too_small", False),  # 10 MB over the run
])
def test_growth_must_hold_to_the_end(shape, grows):
    rng = np.random.default_rng(0)
    t = np.linspace(0, 20, 100)
    base = 500 * MB + rng.normal(0, 2 * MB, t.size)
    y = {
        "linear": base + 10 * MB * t,
        "filled_then_flat": base + 20 * MB * np.minimum(t, 9),
        "flat_noise": base,
        "one_jump": base + 200 * MB * (t > 7),
        "jump_mid_second_half": 500 * MB + 0.01 * MB * t + 110 * MB * (t > 10),
        "too_small": base + 0.5 * MB * t,
    }[shape]
    g = series_growth(t, y, steps_per_s=50.0, capacity=4096 * MB)
    assert g["grows"] is grows
    if shape == "linear":
        assert g["slope_bytes_per_s"] == pytest.approx(10 * MB, rel=0.05)
        assert g["bytes_per_step"] == pytest.approx(10 * MB / 50, rel=0.05)
        assert g["seconds_to_full"] == pytest.approx((4096 * MB - y[-1]) / (10 * MB), rel=0.05)


def test_too_few_samples_say_nothing():
    assert series_growth(np.arange(5.0), np.arange(5.0) * MB * 100, 10.0, None) is None


def _growth(seconds_to_full, **kw):
    g = {"grows": True, "slope_bytes_per_s": 2 * MB, "bytes_per_step": 40 * 1024,
         "first_bytes": 400 * MB, "last_bytes": 900 * MB, "series": "rss_anon_bytes",
         "seconds_to_full": seconds_to_full, **kw}
    return g


def _findings(growth):
    steps = make_steps(60)
    return [f for f in diagnose(make_summary(steps, memory_growth=growth), steps)
            if f["category"] == "memory"]


def test_severity_follows_the_time_left():
    (f,) = _findings({"host": _growth(1800.0), "gpus": {}})
    assert (f["cause"], f["severity"], f["estimated_gain"]) == ("host_memory_growth", "high", 0)
    assert f["title"] == ("Host memory grows 40 KiB a step, 2.0 MiB/s to the end of the run: "
                          "full in about 30 minutes")
    assert f["evidence"]["seconds_to_full"] == 1800.0
    assert _findings({"host": _growth(5 * 3600.0), "gpus": {}})[0]["severity"] == "medium"
    assert _findings({"host": _growth(None), "gpus": {}})[0]["severity"] == "low"
    assert _findings({"host": _growth(10.0, grows=False), "gpus": {}}) == []
    (f,) = _findings({"host": None, "gpus": {"0": _growth(600.0, series=None)}})
    assert (f["cause"], f["title"][:5]) == ("gpu_memory_growth", "GPU 0")


LEAK = """
    import time
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    y = torch.randint(0, 10, (256,))
    kept = []
    for step in range(1000):
        x = torch.randn(256, 512)  # 512 KB
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        kept.append((x, logits))  # every batch stays alive
        time.sleep(0.008)  # 10 s of steps: shorter windows are not judged
"""


def test_a_leaking_loop_is_found(tmp_path):
    write_script(tmp_path, "train.py", LEAK)
    res = trainprof("run", "--json", "--no-html", "train.py", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    (f,) = [f for f in res.json()["findings"] if f["category"] == "memory"]
    assert f["cause"] == "host_memory_growth"
    # 512 KB of input and 10 KB of logits a step
    assert 400 * 1024 < f["evidence"]["bytes_per_step"] < 800 * 1024, f["evidence"]
    assert f["evidence"]["series"] == "rss_anon_bytes"
    assert f["evidence"]["window_s"] >= 8


def test_a_short_window_is_not_judged():
    t = np.linspace(0, 5, 30)
    assert series_growth(t, 500 * MB + 50 * MB * t, 100.0, None) is None  # 5 s < 8 s
    assert series_growth(t, 500 * MB + 50 * MB * t, 100.0, None, min_window_s=0)["grows"]


MAPPED = """
    import time
    import numpy as np
    import torch
    data = np.load("data.npy", mmap_mode="r")  # 160 MB, read once in order: file pages
    model = torch.nn.Linear(1024, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rows = 256
    for step in range(data.shape[0] // rows):
        x = torch.from_numpy(np.array(data[step * rows:(step + 1) * rows]))
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.010)
"""


def test_a_memory_mapped_file_read_through_is_not_a_leak(tmp_path):
    np.save(tmp_path / "data.npy", np.ones((40960, 1024), dtype=np.float32))
    write_script(tmp_path, "train.py", MAPPED)
    res = trainprof("run", "--json", "--no-html", "train.py", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    samples = [json.loads(line) for line in (res.run_dir / "samples.jsonl").open()]
    samples = samples[:-1]  # the last, at the end, after the script unmapped the file
    t = np.array([s["t"] for s in samples])
    rss = np.array([s["rss_bytes"] for s in samples], dtype=float)
    anon = np.array([s["rss_anon_bytes"] for s in samples], dtype=float)
    assert (anon <= rss).all()
    assert rss.max() - rss[0] > 100 * MB  # the file's pages count in RSS...
    assert anon.max() - anon[0] < 64 * MB  # ...not in anonymous memory
    # judged on the run's samples (however short): RSS would read as a leak, anon does not
    assert series_growth(t, rss, None, None, min_window_s=0)["grows"] is True
    assert series_growth(t, anon, None, None, min_window_s=0)["grows"] is False
    assert not [f for f in res.json()["findings"] if f["category"] == "memory"]


def test_worker_memory_from_samples_and_the_rollup_parser():
    from trainprof.analysis.memory_growth import worker_memory
    from trainprof.capture.proc_stats import _parse_rollup

    text = (b"55d0c0000000-7ffd5e5f4000 ---p 00000000 00:00 0    [rollup]\n"
            b"Rss:              437252 kB\nShared_Dirty:     133820 kB\n"
            b"Private_Dirty:    280140 kB\nAnonymous:        413696 kB\n")
    assert _parse_rollup(text) == (280140 * 1024, 133820 * 1024)
    samples = [
        {"t": 0.0, "workers_dirty_bytes": {"11": [20 * MB, 380 * MB], "12": [22 * MB, 380 * MB]}},
        {"t": 0.2},  # read once a second only
        {"t": 1.0, "workers_dirty_bytes": {"11": [200 * MB, 200 * MB], "12": [150 * MB, 250 * MB]}},
        {"t": 2.0, "workers_dirty_bytes": {"11": [260 * MB, 140 * MB]}},  # 12 exited
    ]
    w = worker_memory(samples)  # no worker files: forked workers, counted from first sight
    assert w == {"workers": 2, "private_first_median_bytes": 21 * MB,
                 "private_peak_median_bytes": 205 * MB,
                 "private_baseline_median_bytes": 21 * MB,
                 "private_growth_median_bytes": 184 * MB, "growth_measured_workers": 2,
                 "shared_dirty_drop_median_bytes": 185 * MB,
                 "concurrent_private_peak_bytes": 350 * MB,
                 "concurrent_private_peak_workers": 2,
                 "concurrent_growth_peak_bytes": (180 + 128) * MB,
                 "concurrent_growth_peak_workers": 2}
    assert worker_memory([{"t": 0.0}]) is None


def test_a_spawned_workers_growth_counts_from_its_first_batch():
    """A spawn worker first seen importing torch (17 MB, then 150 MB) has not grown; its
    growth counts from its own reading after its first batch, or failing that from the
    sampler's first reading after it; with neither it is not judged."""
    from trainprof.analysis.memory_growth import worker_memory, worker_starts

    def doc(pid, **stream):
        return {"pid": pid, "role": "worker", "streams": [{"start_method": "spawn", **stream}]}

    starts = worker_starts([
        doc(11, first_batch_ns=int(1.5e9), dirty_after_first_batch=[150 * MB, 0, int(1.6e9)]),
        doc(12, first_batch_ns=int(1.5e9)),  # recorded before the worker read its own
        doc(13),  # never finished a batch
        {"pid": 99, "role": "main", "streams": [{}]},
    ])
    assert set(starts) == {"11", "12", "13"}
    samples = [
        {"t": 1.0, "workers_dirty_bytes": {"11": [17 * MB, 0], "12": [17 * MB, 0],
                                           "13": [17 * MB, 0]}},
        {"t": 2.0, "workers_dirty_bytes": {"11": [151 * MB, 0], "12": [150 * MB, 0],
                                           "13": [150 * MB, 0]}},
        {"t": 3.0, "workers_dirty_bytes": {"11": [152 * MB, 0], "12": [152 * MB, 0],
                                           "13": [150 * MB, 0]}},
    ]
    w = worker_memory(samples, starts)
    assert w["growth_measured_workers"] == 2  # 13: only start-up seen, not judged
    assert w["private_growth_median_bytes"] == 2 * MB
    assert w["concurrent_growth_peak_bytes"] == 4 * MB
    assert w["concurrent_growth_peak_workers"] == 2
    assert w["private_baseline_median_bytes"] == 150 * MB
    # counted from the first sight, as before: 135 MB a worker of start-up
    assert worker_memory(samples)["private_growth_median_bytes"] == 135 * MB


def _worker_finding(**workers):
    return _findings({"host": None, "gpus": {}, "host_memory_bytes": 16 * 1024 * MB,
                      "workers": workers})


def test_the_worker_finding_per_worker_and_total_figures_agree():
    """The title's per-worker figure times its workers is its total: growth beside
    growth (not a median growth beside a sum of whole private sizes: "135 MiB each
    (290 MiB across 2 workers)"), over the workers alive at the peak."""
    (f,) = _worker_finding(
        workers=6, private_first_median_bytes=17 * MB, private_peak_median_bytes=290 * MB,
        private_baseline_median_bytes=150 * MB, private_growth_median_bytes=140 * MB,
        shared_dirty_drop_median_bytes=0, concurrent_private_peak_bytes=580 * MB,
        concurrent_private_peak_workers=2, concurrent_growth_peak_bytes=270 * MB,
        concurrent_growth_peak_workers=2)
    assert f["cause"] == "worker_memory_growth"
    assert f["title"].startswith("Each DataLoader worker's memory grew by 135 MiB after its "
                                 "first batch (270 MiB across 2 workers at once)")
    assert f["evidence"]["workers_at_peak"] == 2
    assert "135 MiB each" in f["verify"]
    # start-up only: no growth after the first batch, whatever the private sizes
    assert _worker_finding(
        workers=2, private_peak_median_bytes=150 * MB, private_growth_median_bytes=0,
        shared_dirty_drop_median_bytes=0, concurrent_private_peak_bytes=300 * MB,
        concurrent_private_peak_workers=2, concurrent_growth_peak_bytes=0,
        concurrent_growth_peak_workers=2) == []
    (f,) = _worker_finding(
        workers=2, private_peak_median_bytes=200 * MB, private_growth_median_bytes=180 * MB,
        shared_dirty_drop_median_bytes=150 * MB, concurrent_private_peak_bytes=390 * MB,
        concurrent_private_peak_workers=2, concurrent_growth_peak_bytes=350 * MB,
        concurrent_growth_peak_workers=2)
    assert f["cause"] == "worker_copy_on_read"
    assert f["title"].startswith("Each DataLoader worker holds 195 MiB of memory of its own "
                                 "(390 MiB across 2 workers at once)")


COPIES = """
    import sys
    import numpy as np
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Paths(Dataset):
        def __init__(self, n, as_numpy):
            paths = [f"/data/train/class_{i % 1000:04d}/image_{i:08d}.JPEG" for i in range(n)]
            labels = [i % 1000 for i in range(n)]
            self.paths = np.array(paths, dtype=np.bytes_) if as_numpy else paths
            self.labels = np.array(labels) if as_numpy else labels

        def __len__(self):
            return len(self.paths)

        def __getitem__(self, i):
            return torch.tensor([float(len(self.paths[i]))]), int(self.labels[i])

    dataset = Paths(1_000_000, "--numpy" in sys.argv)
    loader = DataLoader(dataset, batch_size=256, shuffle=True, num_workers=2)
    model = torch.nn.Linear(1, 1000)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (x, y) in enumerate(loader):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if step == 400:
            break
"""


def test_workers_copying_a_list_dataset_are_found_and_numpy_storage_fixes_it(tmp_path):
    write_script(tmp_path, "train.py", COPIES)
    res = trainprof("run", "--json", "--no-html", "train.py", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    (f,) = [f for f in res.json()["findings"] if f["category"] == "memory"]
    assert f["cause"] == "worker_copy_on_read"
    ev = f["evidence"]
    assert ev["workers"] == 2
    assert ev["private_per_worker_bytes"] > 64 * MB  # measured: ~120 MB for 1 M paths
    assert ev["shared_dirty_drop_per_worker_bytes"] > 32 * MB  # copied from the parent
    assert "np.array(paths, dtype=np.bytes_)" in f["fix"]["snippet"]
    fixed = trainprof("run", "--json", "--no-html", "train.py", "--numpy", cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    assert not [f for f in fixed.json()["findings"] if f["category"] == "memory"]
    workers = fixed.json()["memory_growth"]["workers"]
    assert workers["private_growth_median_bytes"] < 16 * MB


WORKER_CACHE = """
    import sys
    import time
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Data(Dataset):
        def __init__(self, cache):
            self.cache = {} if cache else None

        def __len__(self):
            return 512

        def __getitem__(self, i):
            if self.cache is not None:  # 1 MiB a sample, kept: 256 MiB a worker
                self.cache.setdefault(i, torch.ones(2**18))
            return torch.full((16,), float(i)), i % 2

    def main():
        loader = DataLoader(Data("--cache" in sys.argv), batch_size=16, num_workers=2,
                            multiprocessing_context=sys.argv[1], persistent_workers=True)
        model = torch.nn.Linear(16, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for epoch in range(3):
            for x, y in loader:
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                time.sleep(0.05)

    if __name__ == "__main__":
        main()
"""


@pytest.mark.parametrize("args, cause", [
    (["spawn"], None),  # start-up only: a fresh interpreter importing torch (~150 MB)
    (["spawn", "--cache"], "worker_memory_growth"),
    (["fork", "--cache"], "worker_memory_growth"),
])
def test_spawned_workers_start_up_is_not_growth_and_a_cache_is(tmp_path, args, cause):
    write_script(tmp_path, "train.py", WORKER_CACHE)
    res = trainprof("run", "--json", "--no-html", "train.py", *args, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    doc = res.json()
    found = [f for f in doc["findings"] if f["category"] == "memory"]
    assert [f["cause"] for f in found] == ([cause] if cause else []), found
    workers = doc["memory_growth"]["workers"]
    assert workers["growth_measured_workers"] == 2, workers
    if cause is None:
        assert workers["private_baseline_median_bytes"] > 64 * MB  # torch imported
        assert workers["private_growth_median_bytes"] < 16 * MB
        return
    ev = found[0]["evidence"]
    assert ev["private_growth_per_worker_bytes"] > 128 * MB, ev  # of the 256 MiB cached
    assert ev["per_worker_at_peak_bytes"] * ev["workers_at_peak"] == pytest.approx(
        ev["workers_growth_peak_bytes"], abs=2)


SHARED_ARRAY = """
import time, numpy as np, torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

class Big(Dataset):        # a 200 MB array, read (never written) by every fork worker
    def __init__(self):
        self.data = np.ones((200, 2**20 // 8), dtype=np.float64) * 1.5
    def __len__(self):
        return 100_000
    def __getitem__(self, i):
        time.sleep(0.002)
        return torch.from_numpy(self.data[i % 200, :8].copy()), i % 2

loader = DataLoader(Big(), batch_size=4, num_workers=4,
                    multiprocessing_context="fork", persistent_workers=True)
model = nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
t0 = time.monotonic()
for x, y in loader:
    loss = nn.functional.cross_entropy(model(x.float()), y)
    opt.zero_grad(); loss.backward(); opt.step()
    if time.monotonic() - t0 > 2.5:
        break
"""


def test_workers_memory_in_the_chart_and_timeline_is_their_own(tmp_path):
    """Fork workers map the training process's 200 MB array: their RSS, summed, counted it
    once per worker (~1 GB of 'workers' measured); the chart and the Perfetto counter
    show the memory the workers hold alone: a few to tens of MB."""
    import re

    write_script(tmp_path, "train.py", SHARED_ARRAY)
    res = trainprof("run", "train.py", cwd=tmp_path, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    assert trainprof("report", str(res.run_dir), "--html", "report.html",
                     cwd=tmp_path).returncode == 0
    html = (tmp_path / "report.html").read_text()
    data = json.loads(re.search(r'id="tp-data">(.*?)</script>', html, re.S).group(1))
    series = data["samples"]["series"]
    rss = [v for v in series["workers_rss_bytes"]["y"] if v]
    assert max(rss) > 4 * 150 * MB  # what was charted before: the array once per worker
    private = [v for v in series["workers_private_bytes"]["y"] if v is not None]
    assert len(private) >= 5
    assert 1 * MB < max(private) < 4 * 60 * MB, [round(v / MB) for v in private]
    assert "workers_private_bytes" in re.search(r'key: "memory".*?\]\}', html, re.S).group(0)

    out = tmp_path / "timeline.json"
    assert trainprof("export", str(res.run_dir), "--perfetto", str(out),
                     cwd=tmp_path).returncode == 0
    counters = [e["args"]["MiB"] for e in json.loads(out.read_text())["traceEvents"]
                if e.get("ph") == "C" and e.get("name") == "workers private memory"]
    assert counters and 1 < max(counters) < 4 * 60, counters
    assert not any(e.get("name", "").startswith("workers RSS")
                   for e in json.loads(out.read_text())["traceEvents"])


    # the TensorBoard and W&B exports (one set of series, analysis/scalars.py) write the
    # same private figure, per sample, at the MiB the chart has; the RSS sum no longer
    from trainprof.analysis.scalars import scalar_series
    from trainprof.store import load_run

    run = load_run(res.run_dir)
    series = scalar_series(run)
    tags = {tag for p in series.samples for tag, _ in p.values}
    assert "workers/private_mib" in tags and "workers/rss_mib" not in tags
    exported = [v for p in series.samples for tag, v in p.values if tag == "workers/private_mib"]
    assert exported == pytest.approx([v / MB for v in private])  # the chart's, sample by sample
    assert 1 < max(exported) < 4 * 60, exported
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.plugin_event_accumulator import (
        EventAccumulator,
    )
    from tensorboard.util import tensor_util

    assert trainprof("export", str(res.run_dir), "--tensorboard", "tb",
                     cwd=tmp_path).returncode == 0
    (folder,) = [p.parent for p in (tmp_path / "tb").rglob("events.out.tfevents.*")]
    acc = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    acc.Reload()
    assert "workers/rss_mib" not in acc.Tags()["tensors"]
    written = [float(tensor_util.make_ndarray(e.tensor_proto))
               for e in acc.Tensors("workers/private_mib")]
    assert written == pytest.approx(exported, rel=1e-6)
    assert 1 < max(written) < 4 * 60, written


#: Sample times (µs) and RssAnon (KiB) of an explorer's embedding run (emb.py 1000000
#: adam), sampled every 0.2 s through its steady window: a 128 MB dense gradient made and
#: freed every step swings it between ~600 and ~950 MB while nothing is kept; the
#: quarters' medians rose by chance ("[high] Host memory grows 5,483 KiB a step ... full
#: in about 14 minutes", 1 run in 3).
EMB_US = [
    0, 199943, 399954, 599955, 799958, 999959, 1199963, 1399968, 1600142, 1799957, 1999958,
    2199989, 2399995, 2599980, 2799960, 2999972, 3199982, 3400117, 3599986, 3799975,
    3999985, 4199978, 4399983, 4599982, 4799989, 4999981, 5199976, 5399990, 5599976,
    5799985, 5999991, 6203813, 6399989, 6599971, 6799958, 6999971, 7203822, 7400001,
    7599987, 7799974, 7999961, 8199973, 8399969, 8600049, 8799977, 9003860, 9199993,
    9399984, 9599993, 9799988, 9999971, 10199990, 10399992, 10599993, 10799987, 10999984,
    11199987, 11399993, 11600002,
]
EMB_KIB = [
    514084, 708808, 655136, 604012, 657568, 628896, 602272, 635352, 660600, 736604, 900352,
    899652, 852776, 814064, 689060, 629520, 685468, 756768, 831148, 814064, 727772, 753016,
    787212, 744936, 852780, 727776, 754464, 781280, 819204, 860240, 920208, 861776, 852908,
    736772, 611768, 642212, 645352, 976904, 852908, 736772, 611768, 968132, 827740, 689192,
    617440, 661512, 704784, 744500, 803624, 853164, 728160, 738940, 768988, 796984, 826652,
    852512, 912216, 916652, 966208,
]


def test_memory_freed_within_each_step_is_no_growth():
    t, y = np.array(EMB_US) / 1e6, np.array(EMB_KIB, dtype=float) * 1024
    g = series_growth(t, y, 20.0, None)
    medians, floors = g["quarter_medians_bytes"], g["quarter_floors_bytes"]
    assert medians[1] < medians[2] < medians[3]  # the medians alone read as growth...
    assert not floors[1] < floors[2] < floors[3]  # ...the floors do not rise
    assert g["grows"] is False
    edges = np.linspace(t[0], t[-1], 5)
    assert floors == [int(y[(t >= edges[k]) & (t <= edges[k + 1])].min()) for k in range(4)]


def test_a_gpus_growth_is_judged_on_the_processs_own_memory_where_nvml_lists_it():
    """Six runs on one GPU: the device's used memory swings with the others' work, while
    the process's own memory (NVML's per-process list) grows steadily: the leak is found
    on the process's series, and a device that grows with another job's memory is not
    this run's leak."""
    from trainprof.analysis.memory_growth import memory_growth

    t = np.arange(0.0, 12.0, 0.2)
    swing = [6.0e9, 9.3e9, 7.7e9, 9.4e9]

    def samples(own: np.ndarray | None, device: np.ndarray) -> list[dict]:
        return [{"t": float(x), "rss_bytes": 5e8, "gpu": [{
            "index": 0, "mem_used_bytes": float(d), "mem_total_bytes": 140e9,
            "proc_mem_used_bytes": None if own is None else float(o)}]}
            for x, d, o in zip(t, device, own if own is not None else device, strict=True)]

    leaking = 1e9 + 4e6 * 5 * t  # 4 MB a step, 5 steps a second
    shared = np.array([swing[min(3, int(x // 3))] for x in t])
    g = memory_growth(samples(leaking, shared), 0.0, 12.0, 5.0, 64e9)["gpus"]["0"]
    assert g["grows"] and g["series"] == "proc_mem_used_bytes"
    assert g["bytes_per_step"] == pytest.approx(4e6, rel=0.05)
    # the device grows with another job; the process holds its 1 GB
    g = memory_growth(samples(np.full(t.size, 1e9), 1e9 + 5e7 * t), 0.0, 12.0, 5.0,
                      64e9)["gpus"]["0"]
    assert not g["grows"] and g["series"] == "proc_mem_used_bytes"
    # a record without the process's series: the device's, as before
    g = memory_growth(samples(None, 1e9 + 5e7 * t), 0.0, 12.0, 5.0, 64e9)["gpus"]["0"]
    assert g["grows"] and g["series"] == "mem_used_bytes"
