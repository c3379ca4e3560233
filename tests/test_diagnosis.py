"""The diagnosis engine: each rule on hand-made runs with exact expectations, then the examples
run end to end under `trainprof run --json`, asserting their top finding."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import trainprof, write_script

from trainprof.analysis.steps import step_statistics
from trainprof.diagnosis import CATEGORIES, Finding, Fix, diagnose
from trainprof.diagnosis import registry as reg
from trainprof.diagnosis.context import Context, fit_period
from trainprof.diagnosis.finding import band, sweep
from trainprof.diagnosis.input_pipeline import suggest_workers
from trainprof.report.terminal import render_summary
from trainprof.schema import FLAG_PROFILED
from trainprof.store import STEP_DTYPE, load_run

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MS = 1e-3
FIELDS = {
    "data": "data_wait_ns",
    "forward": "forward_ns",
    "backward": "backward_ns",
    "optimizer": "optimizer_ns",
    "zero_grad": "zero_grad_ns",
    "gc": "gc_ns",
    "region": "region_ns",
    "other": "other_ns",
}


# -- hand-made runs ---------------------------------------------------------------------------


def make_steps(n: int, jitter: float = 0.02, seed: int = 0, **phases: Any) -> np.ndarray:
    """``n`` complete steps; each phase in seconds (a scalar or one value per step).

    By default a compute-bound step: 3 ms forward, 6 ms backward, 1 ms optimizer, with a
    deterministic +-2% jitter on forward and backward so that robust statistics are defined.
    """
    rng = np.random.default_rng(seed)
    base = {"forward": 3 * MS, "backward": 6 * MS, "optimizer": 1 * MS}
    base.update(phases)
    steps = np.zeros(n, dtype=STEP_DTYPE)
    steps["step"] = np.arange(n)
    wobble = 1 + jitter * rng.uniform(-1, 1, n)
    for name, value in base.items():
        vals = np.broadcast_to(np.asarray(value, dtype=np.float64), (n,)).copy()
        if name in ("forward", "backward"):
            vals = vals * wobble
        steps[FIELDS[name]] = np.round(vals * 1e9).astype(np.int64)
    dur = sum(steps[f].astype(np.int64) for f in FIELDS.values())
    steps["dur_ns"] = dur
    steps["t_start_ns"] = np.concatenate([[0], np.cumsum(dur)[:-1]])
    return steps


def make_summary(steps: np.ndarray, **parts: Any) -> dict[str, Any]:
    """A summary as `summarize_run` builds it: real step statistics plus the given parts."""
    summary: dict[str, Any] = {
        "command": [sys.executable, "train.py"],
        **step_statistics(steps),
        "regions": {},
        "dataloaders": [],
        "system": {"n_samples": 20, "proc_cpu_pct": 195.0, "workers_cpu_pct": 0.0,
                   "sys_cpu_pct": 98.0, "iowait_pct": 0.0},
        "device": None,
        "environment": {"usable_cores": 2, "torch_num_threads": 2, "cuda": None,
                        "gpu_count": 0},
    }
    summary.update(parts)
    return summary


def loader(**kw: Any) -> dict[str, Any]:
    config = {
        "index": 0, "dataset": "__main__.Images", "len": 320, "batch_size": 32,
        "num_workers": 0, "pin_memory": False, "prefetch_factor": None,
        "persistent_workers": False, "drop_last": False,
        "collate_fn": "torch.utils.data._utils.collate.default_collate",
        "sampler": "torch.utils.data.sampler.RandomSampler",
        "batch_sampler": "torch.utils.data.sampler.BatchSampler",
        "multiprocessing_context": None, "iterable_dataset": False,
    }
    config.update(kw)
    return config


def only(findings: list[dict[str, Any]], category: str) -> dict[str, Any]:
    hits = [f for f in findings if f["category"] == category]
    assert len(hits) == 1, findings
    return hits[0]


def share(steps: np.ndarray, field: str, summary: dict[str, Any]) -> float:
    steady = steps[summary["steps"]["warmup"]:]
    return float(steady[field].sum() / steady["dur_ns"].sum())


# -- the finding contract, bands, the registry --------------------------------------------------


def test_finding_validates_the_contract():
    ok = {"category": "gc", "cause": "c", "title": "t", "severity": "low",
          "evidence": {"x": np.float64(0.123456789)}, "estimated_gain": 1.7,
          "fix": Fix("do this", "code()"), "verify": "measure"}
    d = Finding(**ok).to_dict()
    assert set(d) == {"category", "cause", "title", "severity", "evidence", "estimated_gain",
                      "fix", "verify", "verify_commands", "rule"}
    assert d["estimated_gain"] == 1.0  # an upper bound on a share: clipped
    assert d["evidence"] == {"x": 0.1235} and type(d["evidence"]["x"]) is float
    assert d["fix"] == {"text": "do this", "snippet": "code()"}
    assert d["verify_commands"] == []
    # the verify line's commands, each as it stands in the line
    cmd = "trainprof run train.py"
    assert Finding(**{**ok, "verify": f"`{cmd}` after the change",
                      "verify_commands": (cmd,)}).to_dict()["verify_commands"] == [cmd]
    for bad in ({"category": "speed"}, {"severity": "critical"}, {"evidence": {}},
                {"verify": ""}, {"estimated_gain": float("nan")},
                {"verify_commands": ("trainprof run other.py",)}, {"verify_commands": ("",)}):
        with pytest.raises(ValueError):
            Finding(**{**ok, **bad})
    assert len(CATEGORIES) == 12 and "periodic_overhead" in CATEGORIES


def test_severity_bands_are_inclusive_at_their_lower_edge():
    assert band(0.20, 0.20, 0.05) == "high"
    assert band(0.1999, 0.20, 0.05) == "medium"
    assert band(0.05, 0.20, 0.05) == "medium"
    assert band(0.0499, 0.20, 0.05) is None
    assert band(0.02, 0.20, 0.05, 0.02) == "low"


def test_every_family_is_registered():
    names = set(reg.rules())
    assert {n.split(".")[0] for n in names} == {
        "input_pipeline", "periodic", "gc", "contention", "sync", "noise", "python_loop",
        "device", "distributed", "host_launch", "optimizer", "debug_modes", "memory_growth",
        "eval_autograd", "host_to_device", "zero_grad", "tf32", "cpu_threads", "padding",
        "checkpointing", "precision", "channels_last_cpu", "float64", "small_batch",
        "attention", "fusion", "recompile", "embedding"}


def test_a_failing_rule_is_skipped_and_ranking_is_by_gain():
    def finding(cat: str, gain: float, severity: str = "low") -> Finding:
        return Finding(cat, "x", "t", severity, {"n": 1}, gain, Fix("f"), "v")

    @reg.rule("test.broken")
    def broken(ctx: Context) -> None:
        raise KeyError("a field this rule did not expect")

    @reg.rule("test.two")
    def two(ctx: Context) -> list[Finding]:
        return [finding("gc", 0.1), finding("compute", 0.3, "high"), finding("gc", 0.2)]

    try:
        out = diagnose({}, None, only=["test.broken", "test.two"])
    finally:
        del reg._RULES["test.broken"], reg._RULES["test.two"]
    # the broken rule adds nothing; the two gc findings with one cause merge into the larger
    assert [(f["category"], f["estimated_gain"]) for f in out] == [("compute", 0.3), ("gc", 0.2)]
    assert out[0]["rule"] == "test.two"


def test_unreadable_input_gives_no_findings_and_no_error():
    assert diagnose({}, None) == []
    assert diagnose({"steps": {"count": 0}}, np.zeros(0, dtype=STEP_DTYPE)) == []
    garbage = {"steps": "x", "breakdown": {"data_wait": "a lot"}, "system": 3,
               "environment": None, "dataloaders": [{"error": "boom"}], "syncs": []}
    assert diagnose(garbage, make_steps(20)) == []


def test_healthy_run_gives_nothing():
    steps = make_steps(100)
    summary = make_summary(steps)
    assert summary["steps"]["steady_count"] >= 90
    assert diagnose(summary, steps) == []


# -- input pipeline ---------------------------------------------------------------------------


def test_num_workers_0_is_too_few_workers_with_a_fitted_snippet():
    steps = make_steps(60, data=5 * MS)  # 5 ms wait on a 15 ms step: 33%
    summary = make_summary(
        steps, dataloaders=[loader()],
        system={"n_samples": 20, "proc_cpu_pct": 70.0, "workers_cpu_pct": 0.0},
    )
    out = diagnose(summary, steps)
    f = out[0]
    expected = share(steps, "data_wait_ns", summary)
    assert (f["category"], f["cause"], f["severity"]) == ("input_pipeline", "too_few_workers",
                                                          "high")
    assert f["estimated_gain"] == pytest.approx(expected, abs=1e-4)
    assert f["evidence"]["data_wait_share"] == pytest.approx(expected, rel=1e-3)
    # 0.70 cores of process CPU, at least 0.67 of it outside the wait: >= 90% of the wait blocked
    assert f["evidence"]["blocked_share_min"] == pytest.approx(
        1 - (0.70 - (1 - expected)) / expected, rel=1e-3)
    snippet = f["fix"]["snippet"]
    assert "Images(...)" in snippet and "batch_size=32," in snippet and "shuffle=True," in snippet
    assert "num_workers=4,  # was 0; 2 usable cores" in snippet  # blocked: 2x the cores
    assert "persistent_workers=True" in snippet and "pin_memory" not in snippet
    assert f["verify"] == ("trainprof tune --knob num_workers=0,1,2,4 train.py; the most any "
                           "input fix can give: trainprof tune --knob synthetic_data=false,true "
                           "train.py")


def test_blocked_loading_on_a_busy_machine_says_the_wait_may_be_for_a_core():
    """The training process does not read its run-queue wait: under outside load a wait for
    a core reads as blocked, and "workers beyond the core count" was advised on it."""
    steps = make_steps(60, data=5 * MS)

    def fix_text(sys_cpu: float) -> str:
        summary = make_summary(steps, dataloaders=[loader()], system={
            "n_samples": 20, "proc_cpu_pct": 70.0, "workers_cpu_pct": 0.0,
            "sys_cpu_pct": sys_cpu})
        return only(diagnose(summary, steps), "input_pipeline")["fix"]["text"]

    assert "Other processes kept ~1.3 cores busy meanwhile" in fix_text(100.0)
    assert "Other processes kept" not in fix_text(40.0)  # 0.8 - 0.7: a tenth of a core


def test_workers_can_save_no_more_than_the_loading_spread_over_them():
    """Amdahl over the loading: 20 ms batches beside a 1 ms model, one worker (2 cores,
    CPU-bound loading): the step falls from 21 ms to 20 at best, not by the 95% waited."""
    from trainprof.diagnosis.input_pipeline import workers_bound

    assert workers_bound(0.95, 1) == pytest.approx(0.05)
    assert workers_bound(0.855, 4) == pytest.approx(1 - 0.855 / 4)  # slow_input: 79%
    assert workers_bound(0.33, 4) == pytest.approx(0.33)  # the rest of the step is longer
    steps = make_steps(60, data=190 * MS)  # 190 ms of loading in a 200 ms step, all CPU
    summary = make_summary(steps, dataloaders=[loader()],
                           system={"n_samples": 20, "proc_cpu_pct": 100.0,
                                   "workers_cpu_pct": 0.0, "sys_cpu_pct": 50.0})
    f = only(diagnose(summary, steps), "input_pipeline")
    wait = f["evidence"]["data_wait_share"]
    suggested = f["evidence"]["suggested_workers"]
    assert f["cause"] == "too_few_workers" and suggested == 1  # CPU-bound, 2 cores
    assert f["estimated_gain"] == pytest.approx(workers_bound(wait, suggested))
    assert f["estimated_gain"] < wait
    assert "the step falls at most to the longer of the two" in f["fix"]["text"]


def test_an_iterable_datasets_snippet_has_no_sampler_and_says_to_split_the_stream():
    """torch gives an IterableDataset's loader an ``_InfiniteConstantSampler`` itself (a
    sampler passed with one is an error), and each worker runs the dataset's own
    ``__iter__``: more workers without a split repeat every sample."""
    steps = make_steps(60, data=5 * MS)
    stream = loader(dataset="__main__.Stream", len=None, iterable_dataset=True, num_workers=2,
                    sampler="torch.utils.data.dataloader._InfiniteConstantSampler")
    summary = make_summary(
        steps, dataloaders=[stream],
        system={"n_samples": 20, "proc_cpu_pct": 70.0, "workers_cpu_pct": 20.0},
    )
    snippet = only(diagnose(summary, steps), "input_pipeline")["fix"]["snippet"]
    assert "Stream(...)" in snippet and "sampler" not in snippet.replace("get_worker", "")
    assert "num_workers=4" in snippet and "get_worker_info()" in snippet
    one = make_summary(steps, dataloaders=[{**stream, "num_workers": 0}],
                       system={"n_samples": 20, "proc_cpu_pct": 70.0, "workers_cpu_pct": 0.0})
    snippet = only(diagnose(one, steps), "input_pipeline")["fix"]["snippet"]
    assert "num_workers=4" in snippet and "get_worker_info()" in snippet


@pytest.mark.parametrize(
    ("data_ms", "severity"),  # share = data / (10 ms + data)
    [(0.5, None), (0.55, "medium"), (2.4, "medium"), (2.6, "high")],
)
def test_input_severity_bands(data_ms, severity):
    steps = make_steps(60, jitter=0.0, data=data_ms * MS)
    summary = make_summary(steps, dataloaders=[loader()])
    found = [f for f in diagnose(summary, steps) if f["category"] == "input_pipeline"]
    assert [f["severity"] for f in found] == ([severity] if severity else [])


def test_cuda_run_gets_pin_memory_and_one_worker_per_core():
    steps = make_steps(60, data=5 * MS)
    summary = make_summary(
        steps, dataloaders=[loader(num_workers=2)],
        environment={"usable_cores": 8, "torch_num_threads": 8, "cuda": "12.4", "gpu_count": 1},
        system={"n_samples": 20, "proc_cpu_pct": 60.0, "workers_cpu_pct": 190.0},
    )
    f = only(diagnose(summary, steps), "input_pipeline")
    assert f["cause"] == "too_few_workers"  # 2 workers at 95% each, 5.5 cores free
    assert f["evidence"]["per_worker_cpu"] == pytest.approx(0.95)
    # 8 - 0.6 (process) - 1.9 (workers) = 5.5 cores free: 5 more workers
    assert "num_workers=7,  # was 2; 8 usable cores" in f["fix"]["snippet"]
    assert "pin_memory=True" in f["fix"]["snippet"]
    assert f["verify"].startswith("trainprof tune --knob num_workers=2,4,7 ")


def test_saturated_workers_without_free_cores_are_cpu_transforms():
    steps = make_steps(60, data=5 * MS)
    summary = make_summary(
        steps, dataloaders=[loader(num_workers=2, persistent_workers=True)],
        system={"n_samples": 20, "proc_cpu_pct": 15.0, "workers_cpu_pct": 180.0},
    )
    f = only(diagnose(summary, steps), "input_pipeline")
    assert f["cause"] == "cpu_transforms"
    assert "num_workers=2,  # unchanged" in f["fix"]["snippet"]


def test_idle_workers_while_waiting_are_slow_reads():
    steps = make_steps(60, data=5 * MS)
    summary = make_summary(
        steps, dataloaders=[loader(num_workers=4, persistent_workers=True)],
        system={"n_samples": 20, "proc_cpu_pct": 100.0, "workers_cpu_pct": 40.0,
                "iowait_pct": 30.0},
    )
    f = only(diagnose(summary, steps), "input_pipeline")
    assert f["cause"] == "slow_reads"
    assert f["evidence"]["iowait_pct"] == 30.0
    assert "num_workers=4,  # was 4" not in f["fix"]["snippet"]  # more than now
    assert suggest_workers(4, 2, 0, blocked=True, on_cuda=False) == 5
    assert sweep(0, 4) == [0, 1, 2, 4] and sweep(2, 8) == [2, 4, 8]


def test_worker_startup_spikes_at_the_epoch_length():
    data = np.full(60, 0.2 * MS)
    data[10::10] = 30 * MS  # 320 samples / 32 per batch = 10 batches per epoch
    steps = make_steps(60, data=data)
    summary = make_summary(steps, dataloaders=[loader(num_workers=2)],
                           system={"n_samples": 20, "proc_cpu_pct": 90.0,
                                   "workers_cpu_pct": 20.0})
    out = diagnose(summary, steps)
    f = out[0]
    assert (f["category"], f["cause"]) == ("input_pipeline", "worker_startup_per_epoch")
    spikes = f["evidence"]["epoch_spikes"]
    assert spikes["period_steps"] == 10 and spikes["batches_per_epoch"] == 10
    assert spikes["at_steps"] == [10, 20, 30, 40, 50]
    assert spikes["excess_per_epoch_s"] == pytest.approx(29.8 * MS, rel=1e-3)
    assert "persistent_workers=false,true" in f["verify"]
    assert not [g for g in out if g["category"] == "periodic_overhead"]  # one finding
    assert "rest of the wait" not in f["fix"]["text"]  # the start-ups are all of it
    # a wait at every step besides: the fix says what persistent workers leave
    data += 2 * MS
    steps = make_steps(60, data=data)
    summary = make_summary(steps, dataloaders=[loader(num_workers=2)],
                           system={"n_samples": 20, "proc_cpu_pct": 90.0,
                                   "workers_cpu_pct": 20.0})
    f = diagnose(summary, steps)[0]
    assert f["cause"] == "worker_startup_per_epoch"
    rest = f["evidence"]["data_wait_share"] - f["evidence"]["epoch_spikes"]["excess_share"]
    assert rest > 0.05
    assert f"the rest of the wait ({rest * 100:.0f}%) is the loading itself" in f["fix"]["text"]


def test_worker_startup_spikes_with_a_batch_sampler():
    """A loader given a batch_sampler (Hugging Face's Trainer) has batch_size None: the
    epoch's length comes from the batches recorded (len(loader))."""
    data = np.full(60, 0.2 * MS)
    data[10::10] = 30 * MS
    steps = make_steps(60, data=data)
    summary = make_summary(
        steps, dataloaders=[loader(num_workers=2, batch_size=None, batches=10,
                                   batch_sampler_batch_size=32)],
        system={"n_samples": 20, "proc_cpu_pct": 90.0, "workers_cpu_pct": 20.0})
    f = diagnose(summary, steps)[0]
    assert (f["category"], f["cause"]) == ("input_pipeline", "worker_startup_per_epoch")
    assert f["evidence"]["epoch_spikes"]["batches_per_epoch"] == 10
    # with persistent workers the same spikes are not a start-up cost
    summary["dataloaders"] = [loader(num_workers=2, persistent_workers=True)]
    assert only(diagnose(summary, steps), "input_pipeline")["cause"] != (
        "worker_startup_per_epoch")


# -- periodic overhead -------------------------------------------------------------------------


def test_evaluation_every_n_steps():
    fwd = np.full(80, 3 * MS)
    fwd[5::10] = 63 * MS  # +60 ms of forward (evaluation) every 10 steps
    steps = make_steps(80, forward=fwd)
    summary = make_summary(steps)
    f = diagnose(summary, steps)[0]
    assert (f["category"], f["cause"]) == ("periodic_overhead", "evaluation")
    ev = f["evidence"]
    assert ev["period_steps"] == 10 and ev["occurrences"] == 8
    assert ev["at_steps"] == [5, 15, 25, 35, 45, 55, 65, 75]
    steady = steps[summary["steps"]["warmup"]:]
    med = np.median(steady["forward_ns"][steady["forward_ns"] < 10e6])
    expected = (steady["forward_ns"][5::10] - med).sum() / steady["dur_ns"].sum()
    assert f["estimated_gain"] == pytest.approx(expected, rel=1e-3)
    assert f["severity"] == "high"  # 480 ms of 1.28 s
    assert ev["excess_by_phase"]["forward"] > 0.99
    assert "EVAL_INTERVAL" in f["fix"]["snippet"]


def _gpu_bound_logging_loop(eval_on_device: bool) -> tuple[np.ndarray, np.ndarray]:
    """A GPU-bound loop whose host only launches kernels (1 ms a step) and reads
    ``loss.item()`` every 10 steps: there it waits 80 ms for the 10 steps the device ran
    at 9 ms each. With ``eval_on_device``, those steps also evaluate on the device
    (60 ms more device work each)."""
    from trainprof.store import DEVICE_DTYPE

    other = np.full(100, 0.1 * MS)
    other[5::10] = 80 * MS
    steps = make_steps(100, forward=0.3 * MS, backward=0.4 * MS, optimizer=0.2 * MS,
                       other=other)
    steps["sync_n"][5::10] = 1
    steps["host_reads"][5::10] = 1
    steps["sync_ns"][5::10] = int(79.5 * MS * 1e9)
    device = np.zeros(100, dtype=DEVICE_DTYPE)
    device["step"] = steps["step"]
    rng = np.random.default_rng(1)
    device["dev_step_ns"] = (9 * MS * (1 + 0.02 * rng.uniform(-1, 1, 100)) * 1e9).astype(int)
    if eval_on_device:
        device["dev_step_ns"][5::10] += int(60 * MS * 1e9)
    device["dev_forward_ns"] = device["dev_step_ns"] // 3
    device["dev_backward_ns"] = device["dev_step_ns"] // 2
    return steps, device


def test_a_gpu_bound_loop_reading_its_loss_every_n_steps_has_no_periodic_work():
    """The host waits at each ``.item()`` for the steps the device ran meanwhile, at the
    device's usual pace: no work of that step's own, and logging less often would save
    none of it (the device's work is the same). It had been "[high] Every 10 steps,
    periodic work adds 80 ms". The same steps evaluating on the device (the device's
    step long too) stay periodic work; without device times nothing can tell, as before."""
    steps, device = _gpu_bound_logging_loop(eval_on_device=False)
    summary = make_summary(steps, device={"steps": 100, "median_step_s": 9 * MS,
                                          "breakdown": {"forward": 0.33, "backward": 0.5,
                                                        "optimizer": 0.1, "gap": 0.07}})
    out = diagnose(summary, steps, device=device)
    assert not [f for f in out if f["category"] == "periodic_overhead"], out
    ctx = Context(summary, steps, device)
    wait = ctx.spike_groups["device_wait"]
    assert ctx.step_numbers(wait.indices) == list(range(5, 100, 10))[-len(wait.indices):]
    assert "periodic" not in ctx.spike_groups and "stray" not in ctx.spike_groups

    steps, device = _gpu_bound_logging_loop(eval_on_device=True)
    out = diagnose(make_summary(steps), steps, device=device)
    assert [f["evidence"]["period_steps"] for f in out
            if f["category"] == "periodic_overhead"] == [10], out
    out = diagnose(make_summary(steps), steps)
    assert [f["category"] for f in out].count("periodic_overhead") == 1, out


def test_a_host_that_ran_ahead_of_the_gpu_is_said_so_with_the_devices_step_time():
    from trainprof.analysis.summary import _host_ahead_notes

    steps, device = _gpu_bound_logging_loop(eval_on_device=False)
    stats = step_statistics(steps)
    host = stats["steps"]["median_s"]
    (note,) = _host_ahead_notes(stats, {"median_step_s": 9 * MS})
    assert f"its median step took {host * 1e3:.3g} ms" in note and "device's 9 ms" in note
    assert _host_ahead_notes(stats, {"median_step_s": 1.2 * host}) == []
    assert _host_ahead_notes(stats, None) == []


def test_data_waits_every_num_workers_steps_are_the_input_pipeline_not_an_evaluation():
    """Workers that cannot keep up deliver in turns: the loop waits every num_workers steps.

    The fix of examples/slow_input.py (num_workers=4) produced exactly this, and it was
    reported as "every 4 steps, evaluation adds 0.04 s".
    """
    data = np.full(60, 0.2 * MS)
    data[2::4] = 40 * MS  # the wait for the next round of 4 workers
    steps = make_steps(60, data=data)
    summary = make_summary(steps, dataloaders=[loader(num_workers=4, persistent_workers=True)])
    out = diagnose(summary, steps)
    assert not [f for f in out if f["category"] == "periodic_overhead"], out
    top = out[0]
    assert top["category"] == "input_pipeline", top
    # the whole wait counts, the spikes included (none is left to another rule)
    assert top["estimated_gain"] == pytest.approx(share(steps, "data_wait_ns", summary), rel=0.05)
    assert "data_wait_share_in_periodic_steps" not in top["evidence"]


def test_an_evaluation_loader_iterated_every_n_steps_is_periodic_work_not_the_input():
    """A validation pass every 7 steps (the loader's epoch is 10) whose loader starts its
    workers each time: most of the spike is data wait, but on another loader's batches,
    which the steps' sample counts show (672 against 32 in a real run). It had been left
    to the input pipeline, with no periodic finding for two-thirds of the run."""
    data = np.full(70, 0.2 * MS)
    fwd = np.full(70, 3 * MS)
    data[5::7] = 80 * MS  # the evaluation loader's workers starting, and its batches
    fwd[5::7] = 13 * MS  # its forwards, under no_grad
    steps = make_steps(70, data=data, forward=fwd)
    steps["samples"] = 32
    steps["samples"][5::7] = 32 + 640
    summary = make_summary(steps, dataloaders=[loader(num_workers=1, persistent_workers=True)])
    out = diagnose(summary, steps)
    periodic = [f for f in out if f["category"] == "periodic_overhead"]
    assert len(periodic) == 1, out
    f = periodic[0]
    assert f["cause"] == "evaluation"
    assert f["evidence"]["period_steps"] == 7
    steady = steps[summary["steps"]["warmup"]:]
    spikes = steady[steady["data_wait_ns"] > 10 * MS]
    excess = (spikes["dur_ns"] - np.median(steady["dur_ns"])).sum() / steady["dur_ns"].sum()
    assert f["estimated_gain"] == pytest.approx(excess, rel=0.05)
    # the data wait left to the input pipeline is the training loader's own: none here
    assert not [g for g in out if g["category"] == "input_pipeline"], out
    # the same spikes without the extra samples: workers delivering late, the input's
    steps["samples"][5::7] = 32
    out = diagnose(make_summary(steps, dataloaders=[loader(num_workers=1)]), steps)
    assert not [g for g in out if g["category"] == "periodic_overhead"], out


def test_steps_under_a_heavy_tool_leave_the_rules_and_the_period_intact():
    """The op-count sample (steps 8-9, and the step carrying its stop) is slow and flagged.

    The rules see the steps the summary's statistics see; the evaluation every 10 steps
    is still found at its step numbers although three steps are missing between them.
    """
    fwd = np.full(80, 3 * MS)
    fwd[5::10] = 63 * MS
    fwd[8:11] = 40 * MS  # the profiled steps: slow, but not the user's
    steps = make_steps(80, forward=fwd)
    steps["flags"][8:11] |= FLAG_PROFILED
    summary = make_summary(steps)
    assert summary["steps"]["profiled"] == 3 and summary["steps"]["count"] == 80
    out = diagnose(summary, steps)
    f = out[0]
    assert (f["category"], f["cause"]) == ("periodic_overhead", "evaluation")
    ev = f["evidence"]
    assert ev["period_steps"] == 10 and ev["occurrences"] == 8
    assert ev["at_steps"] == [5, 15, 25, 35, 45, 55, 65, 75]
    assert not [g for g in out if g["category"] == "measurement_noise"], out
    ctx = Context(summary, steps)
    assert len(ctx.steady) == summary["steps"]["steady_count"]


#: Step times (ms) of examples/eval_every.py --steps 80 recorded while another process kept one
#: of the 2 cores busy: evaluation every 10 steps (400-750 ms) among thread stalls (100-200 ms).
BUSY_MACHINE_MS = [
    605, 34, 37, 69, 33, 32, 33, 34, 31, 36, 394, 31, 32, 36, 33, 175, 33, 179, 115, 96,
    551, 170, 32, 33, 32, 32, 120, 32, 32, 33, 684, 33, 33, 32, 159, 33, 38, 34, 180, 36,
    755, 31, 32, 139, 27, 30, 25, 30, 169, 34, 472, 29, 25, 26, 120, 23, 24, 24, 24, 147,
    209, 24, 29, 26, 25, 37, 128, 29, 30, 32, 495, 26, 29, 30, 152, 32, 27, 29, 192, 33,
]


def test_evaluation_found_among_stalls_on_a_busy_machine():
    steps = make_steps(80, jitter=0.0, forward=np.array(BUSY_MACHINE_MS) * MS - 10 * MS)
    out = diagnose(make_summary(steps), steps)
    f = out[0]
    assert (f["category"], f["cause"]) == ("periodic_overhead", "evaluation")
    assert f["evidence"]["at_steps"] == [10, 20, 30, 40, 50, 60, 70]  # the stalls are not


def test_periodic_spikes_of_the_steps_own_work_made_slower_are_no_periodic_work():
    """Every 4th step 40% slower in every phase alike (another process's work at its own
    period): nothing was added to those steps, so no interval helps. examples/healthy.py
    on a busy machine had read "[medium] Every 4 steps, periodic work adds 3.2 ms" with the
    checkpointing recipe. Extra work in one phase (an EMA in the optimizer every 4 steps)
    stays periodic, said as what it is."""
    scale = np.ones(80)
    scale[3::4] = 1.4
    steps = make_steps(80, forward=3 * MS * scale, backward=6 * MS * scale,
                       optimizer=1 * MS * scale)
    out = diagnose(make_summary(steps), steps)
    assert not [f for f in out if f["category"] == "periodic_overhead"], out
    optimizer = np.full(80, 1 * MS)
    optimizer[3::4] = 9 * MS  # +8 ms in the optimizer every 4 steps
    steps = make_steps(80, optimizer=optimizer)
    (f,) = [f for f in diagnose(make_summary(steps), steps)
            if f["category"] == "periodic_overhead"]
    assert f["cause"] == "periodic_work" and f["evidence"]["period_steps"] == 4
    assert "mostly in optimizer (100%)" in f["fix"]["text"]
    assert "checkpoint" not in f["fix"]["text"] and "SAVE_INTERVAL" not in f["fix"]["snippet"]
    compile(f["fix"]["snippet"].replace("...", "pass"), "fix", "exec")


def test_checkpoint_every_n_steps_and_irregular_spikes():
    other = np.zeros(90)
    other[9::15] = 20 * MS  # torch.save every 15 steps: time outside the training phases
    steps = make_steps(90, other=other)
    f = diagnose(make_summary(steps), steps)[0]
    assert (f["category"], f["cause"], f["severity"]) == (
        "periodic_overhead", "checkpoint_or_logging", "medium")
    assert f["evidence"]["period_steps"] == 15
    assert "SAVE_INTERVAL" in f["fix"]["snippet"]
    # the checkpoint keeps the optimizer's state, copied before the thread writes it
    assert '"optimizer": optimizer.state_dict()' in f["fix"]["snippet"]
    assert "saver.join()" in f["fix"]["snippet"]
    assert f["verify"].startswith("re-run with the interval raised to ")
    # where the script's command set the period, the verify line is the command to run
    summary = make_summary(steps)
    summary["command"] = [sys.executable, "train.py", "--save_every=15", "--max_iters=15"]
    f = diagnose(summary, steps)[0]
    interval = f["verify"].split("raised to ")[1].split()[0]
    assert int(interval) > 15 and (
        f"(`trainprof run train.py --save_every={interval} --max_iters=15`)" in f["verify"])
    irregular = np.zeros(90)
    irregular[[7, 11, 40, 43, 77]] = 40 * MS
    steps = make_steps(90, other=irregular)
    assert not [g for g in diagnose(make_summary(steps), steps)
                if g["category"] == "periodic_overhead"]


def test_a_checkpoint_period_is_found_under_bursts_of_outside_load():
    """Every 5th step saves a checkpoint (+0.3 s of "other"); bursts of outside load stall
    a quarter of the steps by 0.5-1.5 s in forward and backward, more than the checkpoints:
    the outliers together fit no period, the larger ones are the bursts, and the period is
    found among the outliers that are mostly "other"."""
    rng = np.random.default_rng(11)
    n = 40  # a short run: so many outliers that all of them together fit no period
    other = np.zeros(n)
    other[4::5] = 0.3
    fwd, bwd = np.full(n, 40 * MS), np.full(n, 80 * MS)
    hit = rng.choice(np.setdiff1d(np.arange(n), np.arange(4, n, 5)), size=10, replace=False)
    burst = rng.uniform(0.5, 1.5, size=10)
    fwd[hit] += burst / 3
    bwd[hit] += 2 * burst / 3
    steps = make_steps(n, forward=fwd, backward=bwd, other=other)
    (f,) = [f for f in diagnose(make_summary(steps), steps)
            if f["category"] == "periodic_overhead"]
    assert (f["cause"], f["evidence"]["period_steps"]) == ("checkpoint_or_logging", 5)
    assert f["evidence"]["excess_by_phase"]["other"] > 0.9


def test_fit_period_tolerates_a_missed_occurrence_and_strays_but_not_chaos():
    fit = fit_period(np.array([10, 20, 30, 50, 60, 70]), 80)
    assert fit is not None and fit.period == 10 and fit.coverage == 6 / 8
    # noise spikes off the grid do not break the fit, and are not members
    fit = fit_period(np.array([4, 10, 17, 20, 30, 33, 40, 50, 63, 70]), 80)
    assert fit is not None and fit.period == 10 and fit.strays == 4
    assert fit.indices.tolist() == [10, 20, 30, 40, 50, 70]
    # strays on a sub-multiple grid do not halve the period
    fit = fit_period(np.array([*range(0, 100, 10), 15, 45, 75]), 100)
    assert fit is not None and (fit.period, fit.strays) == (10, 3)
    # too few occurrences among many strays: could be chance (a busy machine)
    assert fit_period(np.array([10, 20, 30, 40, 3, 17, 26, 44, 45]), 49) is None
    assert fit_period(np.array([6, 24, 42, 2, 11, 15, 30, 38, 48]), 49) is None
    fit = fit_period(np.arange(5, 50, 5), 50)  # a genuine period of 5
    assert fit is not None and fit.period == 5
    assert fit_period(np.array([3, 9, 30, 31, 70]), 80) is None
    # three equally spaced spikes in a long run are a coincidence, not a period
    assert fit_period(np.array([7, 11, 15]), 60) is None
    assert fit_period(np.array([10, 20]), 30) is None  # two points do not make a period
    assert fit_period(np.array([8, 18]), 25, expected=10) is not None  # two epochs


# -- gc, contention, sync, noise ------------------------------------------------------------------


def test_gc_share_bands_and_full_collections():
    gc_s = np.full(60, 1.5 * MS)  # 1.5 ms of 11.5 ms: 13%
    steps = make_steps(60, gc=gc_s)
    steps["gc_n"] = 1
    steps["gc_gen2_n"][::5] = 1
    steps["gc_ns"][::5] = 6e6  # full collections are the slow ones
    summary = make_summary(steps)
    summary["gc"] = {"collections_per_step": 1.0, "gen2_per_step": 0.2}
    f = only(diagnose(summary, steps), "gc")
    assert f["severity"] == "high" and f["cause"] == "full_collections"
    assert f["estimated_gain"] == pytest.approx(share(steps, "gc_ns", summary), abs=1e-4)
    assert "gc.freeze()" in f["fix"]["snippet"]
    light = make_steps(60, gc=0.2 * MS)  # 2%: low
    light["gc_n"] = 1
    out = diagnose(make_summary(light), light)
    assert only(out, "gc")["severity"] == "low"
    assert only(out, "gc")["cause"] == "frequent_collections"
    none = make_steps(60, gc=0.05 * MS)
    assert not [g for g in diagnose(make_summary(none), none) if g["category"] == "gc"]


def test_workers_competing_with_intra_op_threads():
    steps = make_steps(60, data=0.1 * MS)
    summary = make_summary(
        steps, dataloaders=[loader(num_workers=4, persistent_workers=True)],
        system={"n_samples": 20, "proc_cpu_pct": 140.0, "workers_cpu_pct": 60.0},
    )
    f = diagnose(summary, steps)[0]
    assert (f["category"], f["cause"]) == ("cpu_contention", "workers_oversubscribe_cores")
    compute = summary["breakdown"]["forward"] + summary["breakdown"]["backward"] + \
        summary["breakdown"]["optimizer"]
    # 2 threads, 0.6 cores taken by workers: the pool has 1.4 cores for 2 threads
    assert f["estimated_gain"] == pytest.approx(compute * (1 - 1.4 / 2), abs=1e-4)
    assert f["severity"] == "high"
    assert f["evidence"]["thread_demand"] == 6
    assert "num_workers=2" in f["fix"]["snippet"]  # ceil(0.6 + 0.5)
    assert f["verify"] == (
        "trainprof tune --knob torch_threads=1,2 --knob num_workers=0,1,2,4 train.py")
    # workers that hardly use the CPU do not compete
    summary["system"]["workers_cpu_pct"] = 5.0
    assert not [g for g in diagnose(summary, steps) if g["category"] == "cpu_contention"]
    # on CUDA the host needs one thread: 4 workers at 0.6 cores leave it enough
    summary["system"]["workers_cpu_pct"] = 60.0
    summary["environment"] = {"usable_cores": 2, "torch_num_threads": 2, "cuda": "12.4",
                              "gpu_count": 1}
    assert not [g for g in diagnose(summary, steps) if g["category"] == "cpu_contention"]


def test_workers_at_half_a_core_that_the_loop_waits_for_get_both_ways_out():
    """Measured on a script decoding PNGs in 2 workers, 2 intra-op threads, 2 cores:
    workers at 0.49 cores, data wait 14%. Rounding kept both counts, and the fix once
    said to change nothing; `trainprof tune` measured num_workers=0 at x0.77."""
    steps = make_steps(60, data=1.6 * MS)  # ~14% of the step
    summary = make_summary(
        steps, dataloaders=[loader(num_workers=2, persistent_workers=True)],
        system={"n_samples": 20, "proc_cpu_pct": 140.0, "workers_cpu_pct": 49.0},
    )
    f = [g for g in diagnose(summary, steps) if g["category"] == "cpu_contention"][0]
    assert f["cause"] == "workers_oversubscribe_cores"
    snippet = f["fix"]["snippet"]
    assert "torch.set_num_threads(1)" in snippet and "num_workers=0" in snippet
    assert "num_workers=2" not in snippet and "keep torch's" not in snippet
    assert "Measure both ways out" in f["fix"]["text"]
    assert f["verify"] == (
        "trainprof tune --knob torch_threads=1,2 --knob num_workers=0,1,2 train.py")


def test_more_intra_op_threads_than_cores():
    steps = make_steps(60)
    summary = make_summary(steps, environment={"usable_cores": 2, "torch_num_threads": 8,
                                               "cuda": None, "gpu_count": 0})
    f = only(diagnose(summary, steps), "cpu_contention")
    assert f["cause"] == "threads_exceed_cores"
    assert f["estimated_gain"] == pytest.approx(0.75, abs=1e-3)  # compute is 100% here
    assert "OMP_NUM_THREADS=2" in f["fix"]["snippet"]


def test_device_syncs():
    steps = make_steps(60)
    syncs = {"per_step": 2.0, "share": 0.30, "host_reads_per_step": 2.0}
    f = only(diagnose(make_summary(steps, syncs=syncs), steps), "synchronization")
    assert (f["cause"], f["severity"], f["estimated_gain"]) == ("host_reads", "high", 0.3)
    # what is removable is capped by the time the GPU sits idle
    device = {"breakdown": {"forward": 0.4, "backward": 0.4, "optimizer": 0.1, "gap": 0.1}}
    f = only(diagnose(make_summary(steps, syncs=syncs, device=device), steps), "synchronization")
    assert (f["severity"], f["estimated_gain"]) == ("medium", 0.1)
    assert f["evidence"]["device_idle_share"] == 0.1
    explicit = {"per_step": 3.0, "share": 0.08, "host_reads_per_step": 0.0}
    f = only(diagnose(make_summary(steps, syncs=explicit), steps), "synchronization")
    assert (f["cause"], f["severity"]) == ("explicit_synchronize", "medium")
    for quiet in ({"per_step": 0.0, "share": 0.0, "host_reads_per_step": 5.0},
                  {"per_step": 1.0, "share": 0.001, "host_reads_per_step": 1.0}):
        assert not [g for g in diagnose(make_summary(steps, syncs=quiet), steps)
                    if g["category"] == "synchronization"]


def test_measurement_noise():
    steps = make_steps(8)
    f = only(diagnose(make_summary(steps), steps), "measurement_noise")
    assert (f["cause"], f["severity"], f["estimated_gain"]) == ("too_few_steps", "medium", 0.0)
    noisy = make_steps(100, jitter=0.6, seed=3)
    summary = make_summary(noisy, system={"n_samples": 20, "proc_cpu_pct": 190.0,
                                          "sys_cpu_pct": 98.0})
    f = only(diagnose(summary, noisy), "measurement_noise")
    steady = noisy[summary["steps"]["warmup"]:]["dur_ns"] / 1e9
    med = np.median(steady)
    cv = 1.4826 * np.median(np.abs(steady - med)) / med
    assert f["evidence"]["robust_cv"] == pytest.approx(cv, rel=1e-3)
    assert f["severity"] == ("medium" if cv >= 0.25 else "low")
    assert f["cause"] == "unstable_step_time"
    assert f["evidence"]["resolution"] == pytest.approx(2.8 * cv / np.sqrt(len(steady)),
                                                        rel=1e-3)
    summary["system"] = {"n_samples": 20, "proc_cpu_pct": 100.0, "sys_cpu_pct": 100.0}
    f = only(diagnose(summary, noisy), "measurement_noise")
    assert f["cause"] == "external_load" and f["evidence"]["external_load_cores"] == 1.0
    # noise never outranks a bottleneck, and is never high
    assert all(g["severity"] != "high" for g in diagnose(summary, noisy)
               if g["category"] == "measurement_noise")


def test_steps_of_a_k_step_iteration_are_judged_as_iterations():
    """A GAN's discriminator stepped twice a generator step: steps of 10 and 30 ms in turn,
    every iteration 40 ms. Not noise; the same iterations varying are."""
    from trainprof.analysis.iterations import steps_per_iteration

    opts = [{"class": "D", "primary": True, "steps": 119},
            {"class": "G", "primary": False, "steps": 59}]
    assert steps_per_iteration(opts) == 2
    assert steps_per_iteration([{**opts[0], "steps": 59}, opts[1]]) is None  # in step
    assert steps_per_iteration([{**opts[0], "steps": 150}, opts[1]]) is None  # 2.5: no
    assert steps_per_iteration(opts[:1]) is None
    fwd = np.tile([7 * MS, 27 * MS], 60)
    steps = make_steps(120, forward=fwd)
    summary = make_summary(steps)
    assert only(diagnose(summary, steps), "measurement_noise")["cause"] == "unstable_step_time"
    summary["steps"]["per_iteration"] = 2
    assert not [f for f in diagnose(summary, steps) if f["category"] == "measurement_noise"]
    rng = np.random.default_rng(5)
    noisy = make_steps(120, forward=fwd * rng.uniform(0.5, 1.5, 120))
    summary = make_summary(noisy)
    summary["steps"]["per_iteration"] = 2
    f = only(diagnose(summary, noisy), "measurement_noise")
    assert f["title"].startswith("Iteration times (2 steps each) vary by")
    assert f["evidence"]["steps_per_iteration"] == 2


def test_a_long_warm_up_under_outside_load_is_named():
    # 20 steps at 25 ms while other processes kept 1.5 cores busy, then 60 at 10 ms
    fwd = np.full(80, 3 * MS)
    fwd[:20] = 18 * MS
    steps = make_steps(80, forward=fwd)
    quiet = {"n_samples": 20, "proc_cpu_pct": 100.0, "sys_cpu_pct": 50.0}  # 0 outside

    def found(**system):
        summary = make_summary(steps, system={**quiet, **system})
        return [f for f in diagnose(summary, steps) if f["cause"] == "warmup_under_load"]

    (f,) = found(outside_cores_warmup=1.5)
    assert f["category"] == "measurement_noise" and f["estimated_gain"] == 0.0
    warm = f["evidence"]["warmup_steps"]
    assert warm == 20 and f["title"].startswith(
        "The first 20 steps (25% of the run), counted as warm-up, ran while other processes "
        "kept ~1.5 cores busy")
    assert f["evidence"]["warmup_median_s"] == pytest.approx(25 * MS, rel=0.05)
    text = " ".join(f["fix"]["text"].split())
    assert "steps took 25.1 ms (median) against 10.0 ms after them" in text  # (the jitter)
    assert "~1.5 of the 2 usable cores busy, and ~0.0 after" in text
    # the load no higher than after; under half a core; no slower than the steady steps
    assert found(outside_cores_warmup=1.5, sys_cpu_pct=125.0) == []  # 1.5 after as well
    assert found(outside_cores_warmup=0.4) == []
    assert found() == []  # no samples in the warm-up
    flat = make_steps(80)
    summary = make_summary(flat, system={**quiet, "outside_cores_warmup": 1.5})
    summary["steps"]["warmup"] = 20  # long, but as fast as the rest
    summary["steps"]["warmup_median_s"] = summary["steps"]["median_s"]
    assert not [g for g in diagnose(summary, flat) if g["cause"] == "warmup_under_load"]
    # compiling in the warm-up (Dynamo's workers read as outside load): not named
    summary = make_summary(steps, system={**quiet, "outside_cores_warmup": 1.5},
                           compiles={"steps": [0, 1], "steps_after_warmup": []})
    assert not [g for g in diagnose(summary, steps) if g["cause"] == "warmup_under_load"]


def test_composite_ranking():
    fwd = np.full(80, 3 * MS)
    fwd[5::10] = 23 * MS
    steps = make_steps(80, forward=fwd, data=6 * MS, gc=0.4 * MS)
    summary = make_summary(steps, dataloaders=[loader()])
    out = diagnose(summary, steps)
    gains = [f["estimated_gain"] for f in out]
    assert gains == sorted(gains, reverse=True)
    assert [f["category"] for f in out] == ["input_pipeline", "periodic_overhead", "gc"]


def test_terminal_shows_every_part_of_a_finding():
    steps = make_steps(60, data=5 * MS)
    summary = make_summary(steps, dataloaders=[loader()], run_dir="r", status="finished",
                           name="t", missing=[], notes=[],
                           system={"n_samples": 20, "proc_cpu_pct": 70.0})
    summary["findings"] = diagnose(summary, steps)
    buf = io.StringIO()
    render_summary(summary, file=buf)
    text = buf.getvalue()
    f = summary["findings"][0]
    assert "[high]" in text and " ".join(f["title"].split()) in " ".join(text.split())
    assert "could save up to" in text and "evidence: data_wait_share=" in text
    assert "    num_workers=4,  # was 0; 2 usable cores" in text  # the snippet, unwrapped
    # the verify line's commands, each whole on a line of its own under its prose
    assert "   verify:\n      trainprof tune --knob num_workers=0,1,2,4 train.py\n" in text
    # off a terminal: 120 columns, and no line padded with blanks to the table's width
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 120
    assert not [line for line in lines if line != line.rstrip()]


# -- end to end: the examples under `trainprof run --json` ------------------------------------


def run_example(tmp_path: Path, script: str, *args: str) -> dict[str, Any]:
    res = trainprof("run", "--json", str(EXAMPLES / script), *args, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = res.json()
    stored = (res.run_dir / "findings.json").read_text()
    durations = (load_run(res.run_dir).steps["dur_ns"] / 1e6).round(1).tolist()
    assert doc["findings"] and '"category"' in stored, (doc["steps"], durations)
    return doc


def test_example_slow_input(tmp_path):
    doc = run_example(tmp_path, "slow_input.py", "--steps", "30")
    top = doc["findings"][0]
    assert (top["category"], top["cause"], top["severity"]) == (
        "input_pipeline", "too_few_workers", "high")
    assert "num_workers=" in top["fix"]["snippet"] and "RemoteImages(...)" in top["fix"]["snippet"]
    # mostly blocked reads: the second fix removes them (test_example_slow_input_packed)
    assert 'dataset = PackedDataset("DATA.pack"' in top["fix"]["snippet"]
    assert "`trainprof pack DATA_DIR OUT`" in top["fix"]["text"]
    loading = doc["workers"]["loaders"][0]
    assert loading["sample_blocked_ms"]["median"] >= 1.4  # 1.5 ms of latency per file
    # `report` diagnoses the stored run again and agrees
    rep = trainprof("report", "--json", str(tmp_path / "run"), cwd=tmp_path)
    assert rep.returncode == 0
    assert rep.json()["findings"][0]["cause"] == "too_few_workers"


def test_example_slow_input_packed(tmp_path):
    """The finding's second fix: the same samples from a pack, without per-file latency."""
    data = tmp_path / "data"
    rng = np.random.default_rng(0)
    for i in range(512):  # the example's layout: class folders of .npy images
        (data / f"class{i % 10}").mkdir(parents=True, exist_ok=True)
        np.save(data / f"class{i % 10}" / f"{i}.npy", rng.integers(0, 256, (3, 32, 32), np.uint8))
    (data / "done").touch()
    packed = trainprof("pack", "--no-check", str(data), str(tmp_path / "pack"), cwd=tmp_path)
    assert packed.returncode == 0, packed.stderr
    res = trainprof("run", "--json", str(EXAMPLES / "slow_input.py"), "--steps", "30",
                    "--data", str(data), "--packed", str(tmp_path / "pack"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = res.json()
    assert doc["dataloaders"][0]["dataset"] == "trainprof.fixes.packed_dataset.PackedDataset"
    loading = doc["workers"]["loaders"][0]
    assert loading["samples"] >= 30 * 32 - 32  # timed a batch at a time (__getitems__)
    # the latency is gone: each sample is a slice of a mapped file (was >= 1.4 ms blocked)
    assert loading["sample_blocked_ms"]["median"] < 0.5, loading["sample_blocked_ms"]
    assert doc["breakdown"]["data_wait"] < 0.6, doc["breakdown"]  # 85% in the README run


def test_example_eval_every(tmp_path):
    # 120 steps: 11 evaluations past warm-up, so that the period still fits if a busy
    # machine adds stray slow steps (80 steps failed once in a CI-style run: a
    # measurement_noise finding on top; the message carries every finding and the
    # step times, to tell why if it happens again)
    doc = run_example(tmp_path, "eval_every.py", "--steps", "120", "--data",
                      str(tmp_path / "data"), "--ckpt-dir", str(tmp_path))
    top = doc["findings"][0]
    assert (top["category"], top["cause"]) == ("periodic_overhead", "evaluation"), (
        [(f["category"], f["cause"], f["severity"], f["estimated_gain"], f["evidence"])
         for f in doc["findings"]], doc["steps"])
    assert top["evidence"]["period_steps"] == 10
    assert top["severity"] == "high"


def test_example_healthy(tmp_path):
    res = trainprof("run", "--json", str(EXAMPLES / "healthy.py"), "--steps", "50", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    findings = res.json()["findings"]
    assert not [f for f in findings if f["severity"] == "high"], findings
    # nothing to fix: noise notes, or a low hint that claims no gain (the torch.compile
    # hint's op-time split of this small model read 19-25% fusable here, 41% in one CI run:
    # just over its 40% line)
    assert [f for f in findings if f["category"] != "measurement_noise"
            and (f["severity"] != "low" or f["estimated_gain"] > 0)] == [], findings


def test_example_png_folder(tmp_path):
    pytest.importorskip("PIL")
    doc = run_example(tmp_path, "png_folder.py", "--data", str(tmp_path / "png"))
    top = doc["findings"][0]
    assert (top["category"], top["cause"]) == ("input_pipeline", "cpu_transforms")
    # the cause comes from the workers: CPU per sample, next to nothing blocked on reads
    ev = top["evidence"]
    assert ev["sample_cpu_ms"]["median"] > 0.3
    assert ev["sample_blocked_ms"]["median"] < 0.1 * ev["sample_cpu_ms"]["median"]
    assert "CachedDataset(PngFolder(...)" in top["fix"]["snippet"]
    assert "DevicePrefetcher(loader" in top["fix"]["snippet"]
    # the fix, as the example applies it: decode and resize once (a first run of one
    # epoch fills the cache, the next run reads it), crop and flip in uint8, the float
    # work per batch (one run of both: loading is timed a few times a second, so the
    # slower filling epoch could hold half of the timed samples)
    cache = tmp_path / "cache"
    fix = ("png_folder.py", "--data", str(tmp_path / "png"), "--cache", str(cache), "--uint8")
    fill = trainprof("run", "--out", str(tmp_path / "fill"), str(EXAMPLES / fix[0]), *fix[1:],
                     "--steps", "16", cwd=tmp_path)
    assert fill.returncode == 0, fill.stderr[-3000:]
    assert np.load(cache / "filled.npy").tolist() == [1] * 1024
    fixed = run_example(tmp_path, *fix)
    before = doc["workers"]["loaders"][0]["sample_cpu_ms"]["median"]
    after = fixed["workers"]["loaders"][0]["sample_cpu_ms"]["median"]
    assert after < 0.4 * before, (before, after)  # CPU time: holds on a busy machine too
    assert fixed["dataloaders"][0]["dataset"].endswith("CachedDataset")


def test_example_many_workers(tmp_path):
    doc = run_example(tmp_path, "many_workers.py", "--steps", "30")
    found = [(f["category"], f["cause"]) for f in doc["findings"]]
    busy = [f["evidence"] for f in doc["findings"] if f["cause"] == "external_load"]
    if ("cpu_contention", "workers_oversubscribe_cores") not in found and busy:
        # Other processes on the cores leave the workers less CPU than the example's
        # contention needs (seen with two busy loops beside the suite: gain 0.14 alone,
        # 0.06 or nothing then). What the run says then is the machine's load.
        pytest.skip(f"machine busy: {busy[0]['external_load_cores']:.1f} cores of other work")
    (contention,) = [f for f in doc["findings"] if f["cause"] == "workers_oversubscribe_cores"]
    assert contention["evidence"]["num_workers"] == 4
    # its CNN runs in NCHW: the CPU channels_last finding comes first (34% claimed, x0.76
    # measured by `trainprof tune --knob channels_last=false,true` on 2026-11-27)
    top = doc["findings"][0]
    assert (top["cause"], top["severity"]) == ("channels_last", "medium")


WORKER_STARTUP = """
import time, torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

class Small(Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        return torch.randn(16), i % 2

def open_shards(worker_id):
    time.sleep(0.1)   # each new worker opens its files / connections

model = nn.Linear(16, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(Small(), batch_size=8, shuffle=True, num_workers=2,
                    worker_init_fn=open_shards)
for epoch in range(8):  # the spike at step 8 falls in the op count's (profiled) steps
    for x, y in loader:
        time.sleep(0.01)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
"""


def test_worker_startup_every_epoch_end_to_end(tmp_path):
    write_script(tmp_path, "train.py", WORKER_STARTUP)
    res = trainprof("run", "--json", "train.py", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    # the input finding (the loop's time.sleep(0.01), half of each step, is named beside it
    # as loop code once the stack timer has sampled it 10 times, which this one-second run
    # reaches only sometimes; it then comes first, with its larger gain)
    findings = res.json()["findings"]
    top = next(f for f in findings if f["category"] == "input_pipeline")
    assert top["cause"] == "worker_startup_per_epoch", findings
    assert {f["cause"] for f in findings} <= {
        "worker_startup_per_epoch", "loop_code", "unstable_step_time"}, findings
    assert top["evidence"]["epoch_spikes"]["period_steps"] == 8
    assert "persistent_workers=True" in top["fix"]["snippet"]


def test_terminal_breaks_long_values_between_parts_never_inside_one(monkeypatch):
    """rich wraps at any space ("CPU 292" / "µs"): long values break at their " · " first."""
    from trainprof.report.terminal import _fit

    value = ("in the training process (num_workers=0) · 1,920 samples · per sample blocked "
             "1.6 ms (p90 1.6 ms), CPU 292 µs (p90 468 µs) · collate 237 µs (p90 279 µs)/batch")
    assert _fit(value, 200) == value
    for room in (40, 60, 80, 100):
        lines = _fit(value, room).splitlines()
        assert len(lines) > 1
        assert all(line.endswith(" ·") for line in lines[:-1])
        assert " ".join(lines) == value  # whole parts, in order
        # each line fits, unless it is one part longer than a line (rich wraps that one)
        assert [ln for ln in lines if len(ln) > room and " · " in ln.rstrip(" ·")] == []
    # a row of several lines (one per loader): each line broken between its parts
    two = _fit(value + "\n" + value, 60).splitlines()
    assert len(two) > 2 and all(ln.endswith(" ·") or ln.endswith("/batch") for ln in two)
    # rendered at 70 columns: no unit or separator left alone on a line
    steps = make_steps(60, data=5 * MS)
    summary = make_summary(steps, dataloaders=[loader()], run_dir="r", status="finished",
                           name="t", missing=[], notes=[],
                           system={"n_samples": 20, "proc_cpu_pct": 70.0, "workers_cpu_pct": 0.0,
                                   "sys_cpu_pct": 50.0, "iowait_pct": 1.0})
    monkeypatch.setenv("COLUMNS", "70")
    buf = io.StringIO()
    render_summary(summary, file=buf)
    lines = buf.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 70
    cpu = [ln for ln in lines if "process 70%" in ln]
    assert cpu and cpu[0].rstrip().endswith("·")  # the CPU row broke between its parts
    # "system" is the mean over all cores, the process and its workers count in cores
    assert ("system 50% of all cores · iowait 1% (2 usable cores; process, workers: 100% = "
            "one core)") in " ".join(buf.getvalue().split())
    assert not [ln for ln in lines if ln.strip() in ("·", "ms", "µs", "%")]


def test_the_breakdown_bar_is_always_40_cells():
    from trainprof.report.terminal import _breakdown_bar

    # six shares that each round up (17/14/22/19/0.1/28%): alone they made 41 cells
    amp = {"data_wait": 0.1693, "forward": 0.1378, "backward": 0.2189, "optimizer": 0.1886,
           "gc": 0.0015, "other": 0.2839}
    assert len(_breakdown_bar(amp).plain) == 40
    assert len(_breakdown_bar({"data_wait": 1 / 3, "forward": 1 / 3, "other": 1 / 3}).plain) == 40
    assert len(_breakdown_bar({"data_wait": 0.012, "other": 0.988}).plain) == 40


def test_the_workers_fix_follows_who_builds_the_loader():
    """A loader given a BatchSampler is rewritten with its batch size and shuffling; one
    Hugging Face's Trainer builds gets its TrainingArguments, not a DataLoader call."""
    steps = make_steps(60, data=5 * MS)
    sampled = loader(batch_size=None, sampler="torch.utils.data.sampler.SequentialSampler",
                     batch_sampler_batch_size=16,
                     batch_sampler_sampler="torch.utils.data.sampler.RandomSampler")
    f = only(diagnose(make_summary(steps, dataloaders=[sampled]), steps), "input_pipeline")
    snippet = f["fix"]["snippet"]
    assert "    batch_size=16,\n    shuffle=True,\n" in snippet and "None" not in snippet
    trainer = {**sampled, "driven_by": "transformers.Trainer"}
    f = only(diagnose(make_summary(steps, dataloaders=[trainer]), steps), "input_pipeline")
    snippet = f["fix"]["snippet"]
    assert snippet.startswith("args = TrainingArguments(\n    ...,  # your arguments, unchanged")
    assert "    dataloader_num_workers=" in snippet and "DataLoader(" not in snippet
    assert "dataloader_persistent_workers=True" in snippet
    assert f["verify"].startswith("trainprof tune --knob num_workers=")
    # PyTorch Lightning rebuilt the loader with a DistributedSampler (shuffling in training
    # whatever the user's loader said): the user's own call has no sampler
    dist = "torch.utils.data.distributed.DistributedSampler"
    pl = loader(sampler=dist, sampler_shuffle=True, driven_by="lightning")
    f = only(diagnose(make_summary(steps, dataloaders=[pl]), steps), "input_pipeline")
    snippet = f["fix"]["snippet"]
    assert "sampler=" not in snippet and "shuffle=" not in snippet
    assert "    # shuffle as before; Lightning adds the DistributedSampler\n" in snippet
    # the script's own DistributedSampler (torchrun) stays in its call
    f = only(diagnose(make_summary(steps, dataloaders=[loader(sampler=dist)]), steps),
             "input_pipeline")
    assert "    sampler=DistributedSampler(...),\n" in f["fix"]["snippet"]


LOADER_IN_THREAD = """
import queue, sys, threading, time
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

class Slow(Dataset):
    def __len__(self):
        return 768
    def __getitem__(self, i):
        time.sleep(0.001)   # 1 ms per sample: 16 ms a batch
        return torch.randn(16), i % 2

class BackgroundGenerator(threading.Thread):  # prefetch_generator's, in short
    def __init__(self, it):
        super().__init__(daemon=True, name="prefetcher")
        self.queue, self.it = queue.Queue(2), it
        self.start()
    def run(self):
        for item in self.it:
            self.queue.put(item)
        self.queue.put(None)
    def __iter__(self):
        while (item := self.queue.get()) is not None:
            yield item

model = nn.Linear(16, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(Slow(), batch_size=16)
batches = BackgroundGenerator(loader) if sys.argv[1] == "thread" else loader
for x, y in batches:
    time.sleep(0.004)  # 4 ms of compute
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
"""


def test_a_loader_iterated_in_a_thread_of_its_own_is_found_end_to_end(tmp_path):
    """A prefetching thread iterates the DataLoader and hands batches over a queue: the
    training thread's wait for them was "other" (about 75% here) and no rule fired. The
    loader's thread is recorded, the loading cost measured there (16 ms a batch) bounds
    the gain, and the fix loads in workers in the training loop. The same loop iterating
    the loader itself gets the usual data-wait finding, and not this one."""
    write_script(tmp_path, "train.py", LOADER_IN_THREAD)
    res = trainprof("run", "--json", "train.py", "thread", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = res.json()
    assert doc["dataloaders"][0]["iterated_in_thread"] == "prefetcher"
    assert doc["breakdown"]["data_wait"] < 0.02 and doc["breakdown"]["other"] > 0.5
    top = doc["findings"][0]
    assert (top["category"], top["cause"], top["severity"]) == (
        "input_pipeline", "loader_in_thread", "high")
    ev = top["evidence"]
    assert ev["iterated_in_thread"] == "prefetcher"
    # 16 samples of ~1 ms (sleeps overshoot, more on a busy machine) and a collate
    assert 0.015 < ev["batch_load_s"] < 0.06, ev
    assert top["estimated_gain"] == pytest.approx(
        min(ev["other_share"], ev["batch_load_s"] / ev["step_median_s"]), abs=1e-4)
    assert "num_workers=4,  # was 0; iterate it in the training loop" in top["fix"]["snippet"]
    assert top["verify"] == "trainprof tune --knob num_workers=0,1,2,4 train.py thread"

    res = trainprof("run", "--json", "train.py", "main", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = res.json()
    assert "iterated_in_thread" not in doc["dataloaders"][0]
    causes = [(f["category"], f["cause"]) for f in doc["findings"]]
    assert causes[0] == ("input_pipeline", "too_few_workers"), causes
    assert ("input_pipeline", "loader_in_thread") not in causes


def test_a_loader_in_a_thread_with_little_other_time_is_no_finding():
    """The thread keeps up (other 3% of the step): nothing is hidden worth reporting; and an
    evaluation loader some thread iterates is not the training loader's problem."""
    steps = make_steps(60, other=0.3 * MS)
    summary = make_summary(steps, dataloaders=[loader(iterated_in_thread="prefetcher")])
    assert not [f for f in diagnose(summary, steps) if f["cause"] == "loader_in_thread"]
    steps = make_steps(60, other=8 * MS)
    summary = make_summary(steps, dataloaders=[
        loader(), loader(index=1, sampler="torch.utils.data.sampler.SequentialSampler",
                         iterated_in_thread="eval")])
    assert not [f for f in diagnose(summary, steps) if f["cause"] == "loader_in_thread"]
    # the training loader in a thread, unmeasured: the bound is the other share
    summary = make_summary(steps, dataloaders=[loader(iterated_in_thread="prefetcher")])
    f = next(f for f in diagnose(summary, steps) if f["cause"] == "loader_in_thread")
    assert f["estimated_gain"] == pytest.approx(summary["breakdown"]["other"], abs=1e-4)
    assert "batch_load_s" not in f["evidence"]


def test_summary_rows_print_code_as_text_not_markup():
    """A loop line with brackets (`text[i + 1 : j]`) lost them: rich read them as a style."""
    import io

    from trainprof.report.console import make_console
    from trainprof.report.terminal import _Rows

    rows = _Rows()
    code = "train.py:41 y = torch.stack([text[i + 1 : i + block + 1] for i in ix]) 72%"
    rows.add_row("Other", code)
    out = io.StringIO()
    make_console(out).print(rows.layout(200))
    assert code in out.getvalue()


@pytest.mark.parametrize(("name", "cause"), [
    ("eval", "evaluation"), ("save_ckpt", "checkpoint_or_logging"), ("ema", "periodic_work")])
def test_periodic_spikes_of_a_named_region_are_named_by_it(name, cause):
    """Inside prof.region("eval") the evaluation's forward passes are region time (in
    "other"), which read as "checkpointing or logging" with the checkpoint recipe, though
    the evidence named the region: the finding names it, with advice for what it is."""
    region = np.zeros(80)
    region[5::10] = 60 * MS
    steps = make_steps(80, region=region)
    summary = make_summary(steps, regions={name: {"count": 8, "total_s": 0.48}})
    f = diagnose(summary, steps)[0]
    assert (f["category"], f["cause"]) == ("periodic_overhead", cause)
    assert f["evidence"]["region"] == name
    assert f"Every 10 steps, the region '{name}' adds 60.0 ms" in f["title"]
    assert f"The region '{name}'" in f["fix"]["text"]
    assert f"with prof.region({name!r}):" in f["fix"]["snippet"] or cause != "evaluation"
    if cause == "evaluation":
        assert "torch.no_grad()" in f["fix"]["text"] and "background" in f["fix"]["text"]
        assert "save checkpoints" not in f["fix"]["text"] and "saver" not in f["fix"]["snippet"]
        compile(f["fix"]["snippet"].replace("...", "pass"), "fix", "exec")
    elif cause == "periodic_work":
        assert "checkpoint" not in f["fix"]["text"]
        compile(f["fix"]["snippet"].replace("...", "pass"), "fix", "exec")
    else:
        assert "SAVE_INTERVAL" in f["fix"]["snippet"]
    # a region of another count is not these spikes: the phases decide as before
    summary = make_summary(steps, regions={name: {"count": 2, "total_s": 0.1}})
    f = diagnose(summary, steps)[0]
    assert f["cause"] == "checkpoint_or_logging" and "region" not in f["evidence"]


def test_a_few_huge_steps_that_pull_the_mean_are_named():
    """Two ~2 s steps among 10 ms ones: the throughput (the mean's) and the median step
    disagree 5x, and the robust CV leaves the two out by design: a finding names them, and
    the Throughput row says why it disagrees with the Step time row."""
    fwd = np.full(60, 3 * MS)
    fwd[[23, 41]] = 2.0
    steps = make_steps(60, forward=fwd)
    summary = make_summary(steps, run_dir="r", status="finished", name="t", missing=[],
                           notes=[])
    out = diagnose(summary, steps)
    (f,) = [f for f in out if f["cause"] == "rare_long_steps"]
    assert f["category"] == "measurement_noise" and f["severity"] == "low"
    assert f["evidence"]["at_steps"] == [23, 41] and f["evidence"]["long_steps"] == 2
    assert f["title"].startswith("2 long steps make the mean step ")
    assert "Steps 23, 41 took 2.0" in f["fix"]["text"] and "recur at no period" in f["fix"]["text"]
    summary["findings"] = out
    buf = io.StringIO()
    render_summary(summary, file=buf)
    mean, med = summary["steps"]["mean_s"], summary["steps"]["median_s"]
    assert (f"mean step {mean * 1e3:.1f} ms, median {med * 1e3:.1f} ms: a few long steps "
            "weigh") in " ".join(buf.getvalue().split())
    # a periodic evaluation is the periodic rule's, however much it pulls the mean
    fwd = np.full(80, 3 * MS)
    fwd[5::10] = 63 * MS
    steps = make_steps(80, forward=fwd)
    assert not [g for g in diagnose(make_summary(steps), steps)
                if g["cause"] == "rare_long_steps"]
