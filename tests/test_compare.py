"""`trainprof compare`: verdict, bootstrap interval, phase deltas and the ranked environment diff.

Two real runs of one script whose dataset sleeps in ``__getitem__``: A loads with two
DataLoader workers, B with none, so B waits for data and the comparison must say that B is
slower, that data_wait explains it, and that num_workers 2 -> 0 is the most likely cause.
The statistics are also checked on run folders written with known step times.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import trainprof, write_script

from trainprof.analysis.compare import (
    PRACTICAL_THRESHOLD,
    bootstrap_ratio_ci,
    compare_runs,
    exceeds_slowdown,
)
from trainprof.errors import UsageError
from trainprof.report.compare_terminal import render_compare
from trainprof.schema import STEP_FIELDS
from trainprof.store import STEP_DTYPE, RunWriter, load_run

SLOW_DATA = """
    import sys, time
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    class Sleepy(Dataset):
        def __len__(self):
            return 4096
        def __getitem__(self, i):
            time.sleep(0.002)  # 8 ms per batch of 4: the input pipeline is the slow part
            return torch.randn(16), i % 2

    workers = int(sys.argv[1])
    torch.manual_seed(0)
    torch.set_num_threads(1)
    loader = DataLoader(Sleepy(), batch_size=4, num_workers=workers, shuffle=False)
    model = nn.Linear(16, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (x, y) in enumerate(loader):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.004)  # the model's "compute": three workers keep up (a batch each 2.7 ms)
        if step == 44:
            break
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compare")
    write_script(root, "train.py", SLOW_DATA)
    out = {}
    for name, workers in (("a", "3"), ("b", "0")):
        res = trainprof("run", "--out", str(root / name), "train.py", workers, cwd=root)
        assert res.returncode == 0, res.stderr
        out[name] = root / name
    return out


def test_slowed_data_phase_and_setting_are_named(runs: dict[str, Path]) -> None:
    a, b = load_run(runs["a"]), load_run(runs["b"])
    result = compare_runs(a, b)
    json.dumps(result)  # JSON-serialisable as it is
    assert result["verdict"] == "slower"
    assert result["significant"] is True
    # B waits ~8 ms per step for data (4 samples x 2 ms), A little: ~13 ms vs ~5 ms
    assert 1.5 < result["ratio"] < 5
    lo, hi = result["ci"]
    assert 1.0 < lo <= result["ratio"] <= hi
    assert result["explains"] == "data_wait"
    dw = result["phases"]["data_wait"]
    assert dw["b"] - dw["a"] == pytest.approx(dw["delta"])
    assert dw["delta"] > 0.004  # at least half of the ~8 ms the sleep adds per batch
    assert dw["share_of_change"] > 0.7
    # phase deltas add up to the change of the mean step time
    total = sum(p["delta"] for p in result["phases"].values())
    assert total == pytest.approx(result["mean_delta"], rel=1e-9)
    assert result["b"]["steps"]["mean_s"] - result["a"]["steps"]["mean_s"] == pytest.approx(
        result["mean_delta"], rel=1e-6)
    # the setting that changed is ranked first, the command line that changed it below
    top = result["environment_diff"][0]
    assert top["key"] == "dataloader[0].num_workers"
    assert (top["a"], top["b"], top["rank"], top["acts_on"]) == (3, 0, 1, "data_wait")
    command = next(it for it in result["environment_diff"] if it["key"] == "command")
    assert command["rank"] > 1
    # a positional argument: the command lines, not the bare "3" and "0"
    assert (command["change_a"], command["change_b"]) == ("train.py 3", "train.py 0")
    keys = {it["key"] for it in result["environment_diff"]}
    assert not keys & {"torch.version", "packages.torch", "cpu.model"}  # same machine
    thr = result["throughput"]
    assert thr["samples_per_s_ratio"] < 0.75
    assert result["a"]["samples_per_step"] == result["b"]["samples_per_step"] == 4
    assert result["metric"] == "step_time"
    assert exceeds_slowdown(result, 5)
    assert not exceeds_slowdown(result, (result["ratio"] - 1) * 100 + 1)


def test_reverse_is_faster_and_self_is_no_difference(runs: dict[str, Path]) -> None:
    a, b = load_run(runs["a"]), load_run(runs["b"])
    forward, reverse = compare_runs(a, b), compare_runs(b, a)
    assert reverse["verdict"] == "faster"
    assert reverse["ratio"] == pytest.approx(1 / forward["ratio"])
    assert reverse["explains"] == "data_wait"
    assert reverse["environment_diff"][0]["key"] == "dataloader[0].num_workers"
    assert not exceeds_slowdown(reverse, 5)
    same = compare_runs(a, a)
    assert same["verdict"] == "no_difference"
    assert same["ratio"] == 1.0
    assert same["ci"][0] <= 1.0 <= same["ci"][1]
    assert same["environment_diff"] == []
    assert not exceeds_slowdown(same, 0.0)
    # seeded: the same runs give the same interval
    assert compare_runs(a, b)["ci"] == forward["ci"]


def test_no_difference_shows_no_shares_of_the_change(runs: dict[str, Path], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    """Phases that moved against each other under a total that did not (gradient
    accumulation: the optimizer -62% a sample, the rest +20-33%) made "shares of the
    change" of +1025% and -1734%: with no difference there is no change to share out."""
    from trainprof.report.html import render_compare_html

    result = compare_runs(load_run(runs["a"]), load_run(runs["b"]))
    result["verdict"] = "no_difference"
    for phase, share in zip(result["phases"], (10.25, -17.34, 4.0, 3.0, 0.0, 1.09),
                            strict=False):
        result["phases"][phase]["share_of_change"] = share
    render_compare(result)
    out = capsys.readouterr().out
    table = out[out.index("Phases"):out.index("What changed")]
    assert "%" in table and "1025%" not in table and "-1734%" not in table
    assert all(line.rstrip().endswith("—") for line in table.splitlines()[2:] if line.strip())
    page = render_compare_html(result, tmp_path / "c.html").read_text()
    assert "1025%" not in page and "-1734%" not in page


def test_a_changed_command_reads_as_written() -> None:
    """An explorer's compare named "command (none) → 512" and "command 5 → 2": the bare
    positional values. An option keeps its name; a positional argument is shown with the
    command line it sits in (or, in a long one, the word before it)."""
    from trainprof.analysis.compare import _command_change

    assert _command_change(["x.py", "--batch-size", "64"], ["x.py", "--batch-size", "512"]) \
        == ("--batch-size 64", "--batch-size 512")
    assert _command_change(["x.py"], ["x.py", "--batch-size", "512"]) \
        == ("(none)", "--batch-size 512")
    assert _command_change(["emb.py", "1000000", "sgd"], ["emb.py", "1000000", "sgd", "512"]) \
        == ("emb.py 1000000 sgd", "emb.py 1000000 sgd 512")
    assert _command_change(["small.py", "5"], ["small.py", "2"]) == ("small.py 5", "small.py 2")
    long = ["train.py", "--data", "/data/" + "x" * 80, "sgd"]
    assert _command_change(long, [*long, "512"]) == ("… sgd", "… sgd 512")


def test_ratios_below_a_tenth_keep_two_significant_digits(runs: dict[str, Path],
                                                         capsys: pytest.CaptureFixture) -> None:
    """A ×0.0091 change read "×0.01, 95% CI ×0.01–×0.01" (an explorer's verify)."""
    from trainprof.report.console import fmt_ratio

    assert [fmt_ratio(x) for x in (0.0091, 0.00853, 0.099, 0.75, 12.34)] == [
        "×0.0091", "×0.0085", "×0.099", "×0.75", "×12.3"]
    result = compare_runs(load_run(runs["a"]), load_run(runs["b"]))
    result["ratio"], result["ci"] = 0.0091, [0.0085, 0.0098]
    render_compare(result)
    out = capsys.readouterr().out
    assert "×0.0091, 95% CI ×0.0085–×0.0098" in out


def test_terminal_rendering(runs: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    render_compare(compare_runs(load_run(runs["a"]), load_run(runs["b"])))
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("B is ") and "slower than A" in first
    assert "data wait" in first and "dataloader[0].num_workers 3 → 0" in first
    assert "95% CI" in first
    assert "What changed" in out
    assert all(len(line) <= 120 for line in out.splitlines()[1:])


# --------------------------------------------------------------------------- known step times


def _write_run(path: Path, durations_ms: np.ndarray, data_ms: np.ndarray | None = None,
               samples: int = 32, meta: dict | None = None, phase: str = "data_wait") -> Path:
    """A finished run folder whose steps have the given durations: ``data_ms`` of them in
    ``phase``, the rest in 'other'."""
    rec = np.zeros(len(durations_ms), dtype=STEP_DTYPE)
    dur = (np.asarray(durations_ms) * 1e6).astype(np.int64)
    data = np.zeros_like(dur) if data_ms is None else (np.asarray(data_ms) * 1e6).astype(np.int64)
    rec["step"] = np.arange(len(dur))
    rec["t_start_ns"] = np.concatenate([[0], np.cumsum(dur)[:-1]])
    rec["dur_ns"] = dur
    rec[f"{phase}_ns"] = data
    rec["other_ns"] = dur - data
    rec["samples"] = samples
    assert rec.dtype.names == STEP_FIELDS
    writer = RunWriter(path, {"name": path.name, "clock_origin_s": 0.0, "wall_origin_s": 0.0,
                              **(meta or {})})
    writer.append_step_bytes(rec.tobytes())
    writer.close("finished", 0)
    return path


def test_statistics_on_known_steps(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    base = 100 + rng.normal(0, 3, 400)
    a = load_run(_write_run(tmp_path / "a", base))
    # 10% slower: significant
    slower = load_run(_write_run(tmp_path / "b", base * 1.10, data_ms=base * 0.10))
    r = compare_runs(a, slower)
    assert r["verdict"] == "slower"
    assert r["ratio"] == pytest.approx(1.10, rel=0.01)
    assert r["ci"][0] > 1.05 and r["ci"][1] < 1.15
    assert r["explains"] == "data_wait"
    assert r["phases"]["data_wait"]["share_of_change"] > 0.99
    assert exceeds_slowdown(r, 5) and not exceeds_slowdown(r, 12)
    # 1% slower, statistically clear with 400 quiet steps, but under the practical threshold
    tiny = load_run(_write_run(tmp_path / "c", base * 1.01))
    r = compare_runs(a, tiny)
    assert r["ci"][0] > 1.0
    assert abs(r["ratio"] - 1) < PRACTICAL_THRESHOLD
    assert r["verdict"] == "no_difference" and not exceeds_slowdown(r, 0)
    # the same distribution shuffled: no difference, interval contains 1
    shuffled = load_run(_write_run(tmp_path / "d", rng.permutation(base)))
    r = compare_runs(a, shuffled)
    assert r["verdict"] == "no_difference" and r["ci"][0] <= 1 <= r["ci"][1]


def test_periodic_work_counts_in_the_verdict(tmp_path: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    """A evaluates every 10th step (+1 s in 'other'); B every 130th, on a machine 25%
    slower: the run pays a third less a step, and that is the verdict. By the medians it
    had read "B is slower than A: +24.7% time per step", and `--fail-if-slower 5` exited 1
    on the speed-up (seen on examples/eval_every.py with a larger --eval-interval)."""
    rng = np.random.default_rng(5)
    base = 100 + rng.normal(0, 2, 260)
    eval_a = np.where(np.arange(260) % 10 == 9, 1000.0, 0.0)
    eval_b = np.where(np.arange(260) % 130 == 129, 1000.0, 0.0)
    _write_run(tmp_path / "a", base + eval_a, data_ms=base, phase="forward")
    _write_run(tmp_path / "b", base * 1.25 + eval_b, data_ms=base * 1.25, phase="forward")
    a, b = load_run(tmp_path / "a"), load_run(tmp_path / "b")
    r = compare_runs(a, b)
    warm_a, warm_b = r["a"]["steps"]["warmup"], r["b"]["steps"]["warmup"]
    mean_a, mean_b = (base + eval_a)[warm_a:].mean(), (base * 1.25 + eval_b)[warm_b:].mean()
    assert r["metric"] == "step_time" and r["statistic"] == "mean"
    assert r["mean_a"] == pytest.approx(mean_a / 1e3) and r["mean_b"] == pytest.approx(
        mean_b / 1e3)
    # the mean steady step: 1 / steps/s, what tune and verify judge
    assert r["ratio"] == pytest.approx(mean_b / mean_a, rel=1e-6)  # (whole nanoseconds)
    thr = r["throughput"]
    assert r["ratio"] == pytest.approx(thr["a_steps_per_s"] / thr["b_steps_per_s"], rel=1e-9)
    assert r["ratio"] == pytest.approx(0.663, abs=0.005)
    assert r["verdict"] == "faster" and r["ci"][0] < r["ratio"] < r["ci"][1] < 0.8
    assert r["median_ratio"] == pytest.approx(1.25, rel=0.02)
    # the phases add up to the change of the mean: the evaluations gone explain it
    assert r["explains"] == "other"
    assert sum(v["share_of_change"] for v in r["phases"].values()) == pytest.approx(1.0)
    assert r["phases"]["forward"]["share_of_change"] < 0 < r["phases"]["forward"]["delta"]
    (note,) = [n for n in r["notes"] if "moved apart" in n]
    assert "median step changed +24.7% and the mean -33.7%" in note
    assert not exceeds_slowdown(r, 5) and exceeds_slowdown(compare_runs(b, a), 5)
    render_compare(r)
    head = capsys.readouterr().out.splitlines()[0]
    assert head == ("B is faster than A: -33.7% time per step (mean 199.9 ms → 132.6 ms, "
                    "×0.66, 95% CI ×0.58–×0.75; median step ×1.25); other accounts for 137% "
                    "of the change")
    # the CI gate reads the same figure: a speed-up passes, its reverse fails
    assert trainprof("compare", "a", "b", "--fail-if-slower", "5", cwd=tmp_path).returncode == 0
    res = trainprof("compare", "b", "a", "--fail-if-slower", "5", cwd=tmp_path)
    assert res.returncode == 1 and res.stdout.startswith("B is slower than A: +50.8% time per")


def test_steps_of_more_work_are_compared_per_flop_or_per_sample(tmp_path: Path) -> None:
    """Gradient accumulation over 4 micro-batches: B's step is 4 times A's FLOPs in 2.14 times
    its time, 1.87 times as fast per FLOP. With no samples counted it had read "B is slower
    than A: +114.3% time per step" (examples/ddp_allreduce.py --accumulate 4); with samples
    counted the same runs are compared per sample."""
    rng = np.random.default_rng(11)
    base = 100 + rng.normal(0, 2, 200)
    for name, scale, flops in (("a", 1.0, 2e9), ("b", 2.143, 8e9)):
        for samples in (0, 32):
            run = _write_run(tmp_path / f"{name}{samples}", base * scale,
                             samples=samples * (4 if name == "b" else 1))
            (run / "ops.json").write_text(json.dumps(
                {"steps": 2, "flops_by_kind_per_step": {"cpu float32": flops}}))
    r = compare_runs(load_run(tmp_path / "a0"), load_run(tmp_path / "b0"))
    assert r["a"]["compute"]["flops_per_step"] == 2e9
    assert (r["metric"], r["unit"]) == ("time_per_flop", "s/GFLOP")
    assert r["ratio"] == pytest.approx(2.143 / 4, rel=1e-6)
    assert r["verdict"] == "faster" and r["ci"][1] < 0.6
    # seconds a GFLOP: A's mean step over its 2 GFLOP a step, and the phases add up to it
    assert r["mean_a"] == pytest.approx(base[r["a"]["steps"]["warmup"]:].mean() / 1e3 / 2)
    assert sum(v["a"] for v in r["phases"].values()) == pytest.approx(r["mean_a"])
    assert any("×4.00 the FLOPs" in n and "per GFLOP" in n for n in r["notes"])
    out = io.StringIO()
    render_compare(r, file=out)
    text = out.getvalue()
    assert text.startswith("B is faster than A: -46.4% time per GFLOP (mean 50.")
    row = next(ln for ln in text.splitlines() if ln.lstrip().startswith("time per GFLOP"))
    assert row.split()[-5:] == ["50.0", "ms", "26.8", "ms", "×0.54"]
    # samples counted: per sample, the same ratio as samples/s's
    r = compare_runs(load_run(tmp_path / "a32"), load_run(tmp_path / "b32"))
    assert r["metric"] == "time_per_sample"
    assert r["ratio"] == pytest.approx(1 / r["throughput"]["samples_per_s_ratio"], rel=1e-9)
    # the same work a step: the FLOPs change nothing
    r = compare_runs(load_run(tmp_path / "a0"), load_run(tmp_path / "a32"))
    assert r["metric"] == "step_time" and r["verdict"] == "no_difference"


def test_time_per_sample_is_the_summarys_samples_per_second(tmp_path: Path) -> None:
    """Samples a step that vary (a short last batch, an evaluation loader's pass in one step):
    the time per sample is the steady steps' seconds over their training samples, what the
    summary's samples/s counts, not the median of each step's own ratio."""
    rng = np.random.default_rng(12)
    base = 100 + rng.normal(0, 2, 120)
    loaders = {"dataloaders": [{"index": 0, "batch_size": 32}, {"index": 1, "batch_size": 100}]}
    a = _write_run(tmp_path / "a", base, samples=32, meta=loaders)
    b = _write_run(tmp_path / "b", base * 1.5, samples=64, meta=loaders)
    # B's every 10th step also iterates the evaluation loader's 500 samples, in 5x the time
    rec = np.fromfile(b / "steps.bin", dtype=STEP_DTYPE)
    rec["samples"][9::10] += 500
    rec["dur_ns"][9::10] *= 5
    rec["other_ns"] = rec["dur_ns"]
    rec.tofile(b / "steps.bin")
    r = compare_runs(load_run(a), load_run(b))
    assert r["metric"] == "time_per_sample"
    # the evaluation's samples are no training work: 64 a step, the time all of it
    steady = rec[r["b"]["steps"]["warmup"]:]
    assert r["mean_b"] == pytest.approx(steady["dur_ns"].sum() / 1e9 / (64 * len(steady)))
    assert r["ratio"] == pytest.approx(1 / r["throughput"]["samples_per_s_ratio"], rel=1e-9)


def test_a_run_that_shared_its_machine_is_noted(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    base = 100 + rng.normal(0, 2, 100)
    cores = {"fingerprint": {"cpu": {"usable_cores": 2}}}
    a = _write_run(tmp_path / "a", base, meta=cores)
    b = _write_run(tmp_path / "b", base * 1.2, meta=cores)
    # B's 12 s of steps: our process on one core, another process on the other
    (b / "samples.jsonl").write_text("".join(
        json.dumps({"t": t, "proc_cpu_pct": 100.0, "workers": {},
                    "sys_cpu_pct": [100.0, 100.0]}) + "\n" for t in range(1, 12)))
    r = compare_runs(load_run(a), load_run(b))
    assert r["b"]["system"]["outside_load_cores"] == pytest.approx(1.0)
    assert r["a"]["system"]["outside_load_cores"] is None  # no samples
    assert any(n.startswith("while run B ran, other processes kept ~1.0 cores busy")
               for n in r["notes"])
    # B is slower and shared its machine, A had it to itself (no samples: not known)
    assert r["verdict"] == "slower" and r["load_change"] is None
    (a / "samples.jsonl").write_text("".join(
        json.dumps({"t": t, "proc_cpu_pct": 100.0, "workers": {},
                    "sys_cpu_pct": [100.0, 0.0]}) + "\n" for t in range(1, 12)))
    r = compare_runs(load_run(a), load_run(b))
    assert r["load_change"] == {"a_cores": pytest.approx(0.0), "b_cores": pytest.approx(1.0)}
    import io

    out = io.StringIO()
    render_compare(r, file=out)
    assert ("most likely cause: other processes' load on the machine (A ~0.0 cores, B ~1.0)"
            in " ".join(out.getvalue().split()))
    assert r["likely_cause"] == {"kind": "load", **r["load_change"]}


def test_a_setting_that_acts_on_the_changed_phase_is_named_before_the_load(
        tmp_path: Path) -> None:
    """num_workers 0 -> 4 and data wait down by most of the step: the setting, whatever
    the load did besides (A ran on a machine busier by a core)."""
    rng = np.random.default_rng(8)
    base = 100 + rng.normal(0, 2, 100)
    loader = {"dataset": "D", "batch_size": 32, "num_workers": 0, "index": 0}
    busy = [{"t": t, "proc_cpu_pct": 100.0, "workers": {}, "sys_cpu_pct": [100.0, 100.0]}
            for t in range(1, 12)]
    quiet = [{**x, "sys_cpu_pct": [100.0, 0.0]} for x in busy]

    def pair(a_data: np.ndarray, b_data: np.ndarray, b_loader: dict,
             b_busy: bool = False) -> dict:
        meta = {"fingerprint": {"cpu": {"usable_cores": 2}}}
        a = _write_run(tmp_path / f"a{len(list(tmp_path.iterdir()))}", base,
                       data_ms=a_data, meta={**meta, "dataloaders": [loader]})
        b = _write_run(tmp_path / f"b{len(list(tmp_path.iterdir()))}", base * 0.2,
                       data_ms=b_data, meta={**meta, "dataloaders": [b_loader]})
        (a / "samples.jsonl").write_text("".join(json.dumps(x) + "\n" for x in busy))
        (b / "samples.jsonl").write_text("".join(json.dumps(x) + "\n"
                                                 for x in (busy if b_busy else quiet)[:3]))
        return compare_runs(load_run(a), load_run(b))

    r = pair(base * 0.9, base * 0.1, {**loader, "num_workers": 4})
    assert r["verdict"] == "faster" and r["explains"] == "data_wait"
    assert r["load_change"] == {"a_cores": pytest.approx(1.0), "b_cores": pytest.approx(0.0)}
    assert r["likely_cause"] == {"kind": "setting", "key": "dataloader[0].num_workers",
                                 "a": 0, "b": 4, "also_load": r["load_change"]}
    out = io.StringIO()
    render_compare(r, file=out)
    assert ("most likely cause: dataloader[0].num_workers 0 → 4 (other processes' load "
            "changed too: A ~1.0 cores, B ~0.0)") in " ".join(out.getvalue().split())
    # both runs on a busy machine (a core each): the setting, with a caveat
    r = pair(base * 0.9, base * 0.1, {**loader, "num_workers": 4}, b_busy=True)
    assert r["load_change"] is None and r["likely_cause"]["both_loaded"] == {
        "a_cores": pytest.approx(1.0), "b_cores": pytest.approx(1.0)}
    out = io.StringIO()
    render_compare(r, file=out)
    assert "but both runs shared a busy machine" in " ".join(out.getvalue().split())
    # the same change in 'other', on which a DataLoader setting does not act: the load
    r = pair(base * 0.1, base * 0.02, {**loader, "num_workers": 4})
    assert r["explains"] == "other" and r["likely_cause"]["kind"] == "load"


def test_a_knob_the_runs_were_trials_of_is_named(tmp_path: Path) -> None:
    """Two trials of `trainprof tune --knob trim_padding=false,true`: no DataLoader setting or
    command shows the change, the knob does."""
    rng = np.random.default_rng(7)
    base = 100 + rng.normal(0, 2, 100)
    a = load_run(_write_run(tmp_path / "a", base, data_ms=base * 0.6, phase="backward",
                            meta={"knobs": {"requested": {"trim_padding": False}}}))
    b = load_run(_write_run(tmp_path / "b", base * 0.4, data_ms=base * 0.0, phase="backward",
                            meta={"knobs": {"requested": {"trim_padding": True}}}))
    r = compare_runs(a, b)
    assert r["verdict"] == "faster"
    top = r["environment_diff"][0]
    assert (top["key"], top["category"], top["a"], top["b"]) == (
        "knob.trim_padding", "knob", False, True)


def test_batch_size_change_compares_time_per_sample(tmp_path: Path) -> None:
    """Twice the samples in 1.5x the time is faster per sample, not slower."""
    rng = np.random.default_rng(2)
    base = 100 + rng.normal(0, 2, 200)
    loader = {"dataset": "D", "batch_size": 32, "num_workers": 2, "index": 0}
    a = load_run(_write_run(tmp_path / "a", base, samples=32, meta={"dataloaders": [loader]}))
    b = load_run(_write_run(tmp_path / "b", base * 1.5, samples=64,
                            meta={"dataloaders": [{**loader, "batch_size": 64}]}))
    r = compare_runs(a, b)
    assert r["metric"] == "time_per_sample" and r["unit"] == "s/sample"
    assert r["ratio"] == pytest.approx(0.75, rel=0.01)
    assert r["verdict"] == "faster"
    assert r["environment_diff"][0]["key"] == "dataloader[0].batch_size"
    assert any("samples in a step" in n for n in r["notes"])


def test_the_default_sampler_beside_a_scripts_batch_sampler_is_no_setting(tmp_path: Path) -> None:
    """Random batches, then a bucketing batch sampler: torch sets the unused `sampler` to a
    SequentialSampler, which had been ranked as a change acting on data wait."""
    rng = np.random.default_rng(9)
    base = 100 + rng.normal(0, 2, 100)
    a_loader = {"index": 0, "batch_size": 32, "sampler": "torch.utils.data.sampler.RandomSampler",
                "batch_sampler": "torch.utils.data.sampler.BatchSampler"}
    b_loader = {"index": 0, "batch_size": None, "batch_sampler_batch_size": 32,
                "sampler": "torch.utils.data.sampler.SequentialSampler",
                "batch_sampler": "__main__.Buckets"}
    a = load_run(_write_run(tmp_path / "a", base, meta={"dataloaders": [a_loader]}))
    b = load_run(_write_run(tmp_path / "b", base * 0.8, meta={"dataloaders": [b_loader]}))
    keys = [it["key"] for it in compare_runs(a, b)["environment_diff"]]
    assert keys == ["dataloader[0].batch_sampler"]


def _fingerprint(threads: int, pillow: str, torch: str = "2.13.0+cpu") -> dict:
    return {
        "fingerprint": {
            "torch": {"version": torch, "cuda": None, "cudnn": None},
            "gpus": [],
            "cpu": {"model": "AMD EPYC", "usable_cores": 8},
            "threads": {"torch_num_threads": threads, "env": {}},
            "packages": {"torch": torch, "pillow": pillow},
            "python": {"version": "3.11.7"},
        },
        "training_thread": {"torch_num_threads": threads},
        "command": ["python", "train.py"],
    }


@pytest.mark.parametrize("phase, first", [("forward", "torch_num_threads"),
                                          ("data_wait", "packages.pillow")])
def test_ranking_follows_the_phase_that_changed(tmp_path: Path, phase: str, first: str) -> None:
    """CPU run: thread settings explain slower math, an image library a slower input pipeline."""
    rng = np.random.default_rng(4)
    base = 100 + rng.normal(0, 2, 300)
    a = load_run(_write_run(tmp_path / "a", base, data_ms=base * 0.5, phase=phase,
                            meta=_fingerprint(8, "10.4.0")))
    b = load_run(_write_run(tmp_path / "b", base * 1.3, data_ms=base * 0.8, phase=phase,
                            meta=_fingerprint(2, "11.0.0")))
    r = compare_runs(a, b)
    assert r["verdict"] == "slower" and r["explains"] == phase
    assert r["compute_on"] == "cpu"
    ranked = [it["key"] for it in r["environment_diff"]]
    assert ranked[0] == first
    assert set(ranked) == {"torch_num_threads", "packages.pillow"}
    # the same two runs with a torch upgrade as well: on slower math it outranks pillow
    c = load_run(_write_run(tmp_path / "c", base * 1.3, data_ms=base * 0.8, phase=phase,
                            meta=_fingerprint(2, "11.0.0", torch="2.14.0+cpu")))
    ranked = [it["key"] for it in compare_runs(a, c)["environment_diff"]]
    if phase == "forward":
        assert ranked.index("torch.version") < ranked.index("packages.pillow")
    else:
        assert ranked.index("packages.pillow") < ranked.index("torch.version")


def test_too_few_steps_gives_no_verdict(tmp_path: Path) -> None:
    a = load_run(_write_run(tmp_path / "a", np.array([100.0, 101, 99])))
    b = load_run(_write_run(tmp_path / "b", np.array([200.0, 201, 199])))
    r = compare_runs(a, b)
    assert r["verdict"] == "insufficient_data" and r["ratio"] is None and r["ci"] is None
    assert any("too few steady steps" in n for n in r["notes"])
    assert not exceeds_slowdown(r, 0)
    out = io.StringIO()
    render_compare(r, file=out)
    assert out.getvalue().startswith("No verdict: too few steady steps to compare")
    # a CI gate that compared nothing does not pass
    res = trainprof("compare", str(tmp_path / "a"), str(tmp_path / "b"), "--fail-if-slower",
                    "5", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.strip().endswith(
        "error: --fail-if-slower: nothing compared, too few steady steps (at least 5 in "
        "each run)")
    res = trainprof("compare", str(tmp_path / "a"), str(tmp_path / "b"), "--json",
                    cwd=tmp_path)
    assert res.returncode == 0 and json.loads(res.stdout)["verdict"] == "insufficient_data"


def test_block_bootstrap_is_wider_on_autocorrelated_steps() -> None:
    """Slow stretches (a busy neighbour) make steps autocorrelated: the interval must widen.

    An AR(1) series and the same values shuffled have one distribution; only the ordering
    differs, and an i.i.d. bootstrap would give both the same interval.
    """
    rng = np.random.default_rng(3)
    n = 900
    level = np.zeros(n)
    noise = rng.normal(0, 1.5, n)
    for i in range(1, n):
        level[i] = 0.95 * level[i - 1] + noise[i]
    correlated = 100 + level
    reference = 100 + rng.normal(0, 5, n)
    lo1, hi1 = bootstrap_ratio_ci(rng.permutation(correlated), reference)
    lo2, hi2 = bootstrap_ratio_ci(correlated, reference)
    assert hi2 - lo2 > 1.5 * (hi1 - lo1)


def test_missing_run_folder_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no such run folder"):
        load_run(tmp_path / "nope")


# --------------------------------------------------------------------------- CLI


def test_cli_json_and_fail_if_slower(runs: dict[str, Path], tmp_path: Path) -> None:
    a, b = str(runs["a"]), str(runs["b"])
    res = trainprof("compare", a, b, "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    doc = res.json()
    assert doc["verdict"] == "slower"
    assert doc["environment_diff"][0]["key"] == "dataloader[0].num_workers"
    res = trainprof("compare", a, b, "--fail-if-slower", "5", cwd=tmp_path)
    assert res.returncode == 1
    assert res.stdout.splitlines()[0].startswith("B is ")
    assert trainprof("compare", b, a, "--fail-if-slower", "5", cwd=tmp_path).returncode == 0
    assert trainprof("compare", a, a, "--fail-if-slower", "5", cwd=tmp_path).returncode == 0
    res = trainprof("compare", a, str(tmp_path / "missing"), cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip().startswith("error: no such run folder")
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_a_batch_sampler_of_the_same_size_is_not_a_batch_size_change(tmp_path: Path) -> None:
    """``LengthGroupedBatchSampler(lengths, batch_size=32)`` in place of ``batch_size=32,
    shuffle=True``: the loader's own batch_size becomes None, its batches hold 32 as before.
    Named as a batch-size change it took the cause from the sampler (seen on
    examples/padded_text.py --group)."""
    from trainprof.analysis.compare import _facts
    from trainprof.store import Run

    def facts(**loader):
        run = Run(path=tmp_path, meta={"dataloaders": [{"index": 0, **loader}]},
                  steps=np.zeros(0, dtype=STEP_DTYPE), events=[], samples_path=tmp_path)
        return _facts(run)[0]

    before = facts(batch_size=32, batch_sampler="torch.utils.data.sampler.BatchSampler")
    after = facts(batch_size=None, batch_sampler_batch_size=32,
                  batch_sampler="trainprof.fixes.length_grouped.LengthGroupedBatchSampler")
    assert before["dataloader[0].batch_size"] == after["dataloader[0].batch_size"]
    assert "dataloader[0].batch_sampler_batch_size" not in after
    assert before["dataloader[0].batch_sampler"] != after["dataloader[0].batch_sampler"]


def test_flops_utilization_is_rounded_as_the_summary_rounds_it(tmp_path: Path) -> None:
    """An input-bound run at 0.38% of the peak and its fix at 1.02% read "0%" and "1%" in
    compare, "0.4%" and "1.0%" in each run's summary (one decimal below 10%)."""
    from trainprof.report.html import render_compare_html

    rng = np.random.default_rng(10)
    base = 100 + rng.normal(0, 2, 60)
    result = compare_runs(load_run(_write_run(tmp_path / "a", base)),
                          load_run(_write_run(tmp_path / "b", base * 0.4)))
    for side, used in (("a", 0.0038), ("b", 0.0102)):
        result[side]["compute"] = {"flops_per_step": 58.6e6, "flops_per_s": None,
                                   "utilization": used}
    out = io.StringIO()
    render_compare(result, file=out)
    row = next(ln for ln in out.getvalue().splitlines() if "FLOPs utilization" in ln)
    assert row.split()[-2:] == ["0.4%", "1.0%"]
    page = render_compare_html(result, tmp_path / "c.html").read_text()
    row = page[page.index("<th>compute.utilization</th>"):]
    assert row[:row.index("</tr>")].endswith("<td>0.4%</td><td>1.0%</td>")


def _loader(**settings: object) -> dict:
    """A DataLoader as the capture describes it (capture/hooks.describe_loader)."""
    return {"index": 0, "dataset": "__main__.Batches", "len": None, "batch_size": None,
            "num_workers": 0, "pin_memory": False, "prefetch_factor": None,
            "persistent_workers": False, "drop_last": False, "timeout": 0,
            "collate_fn": "torch.utils.data._utils.collate.default_convert",
            "sampler": "torch.utils.data.dataloader._InfiniteConstantSampler",
            "batch_sampler": None, "multiprocessing_context": None, "in_order": True,
            "iterable_dataset": True, **settings}


def test_what_changed_says_each_change_once_and_the_phase_only_where_known(
        tmp_path: Path) -> None:
    """examples/batches_in_loop.py --workers 2: its batches made in a DataLoader's workers,
    where the plain run made them in the loop. The table listed 13 rows, one per attribute
    of the new loader (``timeout``, ``in_order``, ...), each "acts on backward", and the
    command line "acts on" whichever phase moved most."""
    rng = np.random.default_rng(13)
    base = 100 + rng.normal(0, 2, 120)
    cmd = ["python", "batches_in_loop.py"]
    fp = {"cpu": {"usable_cores": 2}}
    # the loop's batch making is 'other' in A; B waits for the workers' batches instead
    a = _write_run(tmp_path / "a", base, data_ms=base * 0.1, phase="forward",
                   meta={"command": cmd, "fingerprint": fp})
    b = _write_run(tmp_path / "b", base * 0.5, data_ms=base * 0.1,
                   meta={"command": [*cmd, "--workers", "2"], "fingerprint": fp,
                         "dataloaders": [_loader(num_workers=2, prefetch_factor=2)]})
    r = compare_runs(load_run(a), load_run(b))
    assert r["verdict"] == "faster" and r["explains"] == "other"
    rows = {it["key"]: it for it in r["environment_diff"]}
    assert set(rows) == {"dataloader[0]", "command"}
    loader = rows["dataloader[0]"]
    assert (loader["a"], loader["b"]) == (
        "(none)", "num_workers=2, batch_size=None, dataset=__main__.Batches")
    # a new loader and a command line can act on any phase: neither names one
    assert loader["acts_on"] is None and rows["command"]["acts_on"] is None
    out = io.StringIO()
    render_compare(r, file=out)
    table = out.getvalue()[out.getvalue().index("What changed"):]
    assert len([ln for ln in table.splitlines()[2:] if ln.strip()]) == 2


def test_a_loaders_changed_settings_are_one_row(tmp_path: Path) -> None:
    """num_workers 0 -> 2 is one change: torch's prefetch_factor None -> 2 follows it. With
    pin_memory changed too, the loader's row holds both, the setting that acts most first."""
    rng = np.random.default_rng(14)
    base = 100 + rng.normal(0, 2, 120)
    a = _write_run(tmp_path / "a", base, data_ms=base * 0.8,
                   meta={"dataloaders": [_loader()]})
    b = _write_run(tmp_path / "b", base * 0.3, data_ms=base * 0.1,
                   meta={"dataloaders": [_loader(num_workers=2, prefetch_factor=2)]})
    c = _write_run(tmp_path / "c", base * 0.3, data_ms=base * 0.1,
                   meta={"dataloaders": [_loader(num_workers=2, prefetch_factor=2,
                                                 pin_memory=True, persistent_workers=True)]})
    r = compare_runs(load_run(a), load_run(b))
    (row,) = r["environment_diff"]
    assert (row["key"], row["a"], row["b"], row["acts_on"]) == (
        "dataloader[0].num_workers", 0, 2, "data_wait")
    assert r["likely_cause"]["key"] == "dataloader[0].num_workers"
    r = compare_runs(load_run(a), load_run(c))
    (row,) = r["environment_diff"]
    assert row["key"] == "dataloader[0]" and row["acts_on"] == "data_wait"
    assert row["settings"] == {"num_workers": [0, 2], "pin_memory": [False, True],
                               "persistent_workers": [False, True]}
    assert (row["a"], row["b"]) == (
        "num_workers=0, pin_memory=False, persistent_workers=False",
        "num_workers=2, pin_memory=True, persistent_workers=True")
    # the setting acts on the phase that carries the change: named before anything else
    assert r["likely_cause"] == {"kind": "setting", "key": "dataloader[0]", "a": row["a"],
                                 "b": row["b"], "also_load": None}


def test_a_command_line_change_names_no_phase(tmp_path: Path) -> None:
    """`--eval-interval 370` was marked "acts on data wait": the phase that happened to move
    most. A command line can change anything and names no mechanism."""
    rng = np.random.default_rng(15)
    base = 100 + rng.normal(0, 2, 120)
    a = _write_run(tmp_path / "a", base, data_ms=base * 0.5,
                   meta={"command": ["python", "train.py", "--eval-interval", "10"]})
    b = _write_run(tmp_path / "b", base * 0.7, data_ms=base * 0.2,
                   meta={"command": ["python", "train.py", "--eval-interval", "370"]})
    r = compare_runs(load_run(a), load_run(b))
    assert r["explains"] == "data_wait"
    (row,) = r["environment_diff"]
    assert (row["change_a"], row["change_b"], row["acts_on"]) == (
        "--eval-interval 10", "--eval-interval 370", None)
    out = io.StringIO()
    render_compare(r, file=out)
    line = next(ln for ln in out.getvalue().splitlines() if "--eval-interval 370" in ln
                and ln.lstrip().startswith("1"))
    assert line.split()[-1] == "—"


def test_op_timings_of_the_same_ops_are_no_change(tmp_path: Path) -> None:
    """The same model's attention, timed op by op in two steps of each run under load, read
    "attention op by op 420 µs → 6.4 ms ×15.4" as if it had changed. The same ops under the
    same settings: the times of each run, no ratio; other ops (a longer sequence) or a
    setting of the model's math (a torch upgrade): the ratio."""
    rng = np.random.default_rng(16)
    base = 100 + rng.normal(0, 2, 80)
    shape = {"batch": 8, "query_len": 128, "key_len": 128, "head_dim": 64,
             "dtype": "float32", "device": "cpu", "flops_per_step": 1.6e8}

    def run(name: str, seconds: float, meta: dict | None = None, **changed: object) -> Run:
        path = _write_run(tmp_path / name, base, meta=meta)
        (path / "ops.json").write_text(json.dumps({"steps": 2, "eager_attention": [
            {**shape, **changed, "s_per_step": seconds}]}))
        return load_run(path)

    from trainprof.store import Run

    a = run("a", 420e-6)
    r = compare_runs(a, run("b", 6.4e-3, meta={"command": ["python", "t.py", "--workers", "2"]}))
    assert r["a"]["attention_s_per_step"] == pytest.approx(420e-6)
    assert r["attention"] == {"same_ops": True, "settings_changed": [], "ratio": None}
    out = io.StringIO()
    render_compare(r, file=out)
    row = next(ln for ln in out.getvalue().splitlines() if "attention op by op" in ln)
    assert row.split()[-6:] == ["420", "µs", "6.4", "ms", "same", "ops"]
    # longer sequences: other ops, a change
    r = compare_runs(a, run("c", 6.4e-3, query_len=512, key_len=512, flops_per_step=2.6e9))
    assert r["attention"]["same_ops"] is False
    assert r["attention"]["ratio"] == pytest.approx(6.4e-3 / 420e-6)
    out = io.StringIO()
    render_compare(r, file=out)
    assert "×15.2" in next(ln for ln in out.getvalue().splitlines() if "attention op by" in ln)
    # the same ops on another torch: a setting of the model's math changed
    torch = {"fingerprint": {"torch": {"version": "2.13.0"}, "gpus": []}}
    base_torch = run("d", 420e-6, meta=torch)
    r = compare_runs(base_torch, run("e", 6.4e-3, meta={
        "fingerprint": {"torch": {"version": "2.14.0"}, "gpus": []}}))
    assert r["attention"]["settings_changed"] == ["torch.version"]
    assert r["attention"]["ratio"] == pytest.approx(6.4e-3 / 420e-6)
