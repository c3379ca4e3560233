"""The ranks of one run, merged: DESIGN.md's "one record per rank, merged".

A run whose training happened in several processes has one complete run folder
per process under ``RUN_DIR/ranks/<k>/`` (:mod:`trainprof.capture.ranks`). Each is
summarised on its own, exactly as ``trainprof report RUN_DIR/ranks/<k>`` would; the
merged document is then the *main* record's summary - the run's own when its
process trained, else the lowest-numbered rank with steps (rank 0 in the usual
data-parallel run: every rank runs the same loop) - with, added:

``ranks``
    a row per rank: its status, steps, median / p10 / p90 step time, data-wait
    share and seconds per step, samples/s, and its torch.distributed rank when the
    process group was up; the run's own process first where it trained as a rank
    itself (it ran the script again for the others, as PyTorch Lightning's DDP
    launcher does: its record's ``rank_label``);
``rank_spread``
    the spread of mean step times across the ranks, defined as for merged
    torch.profiler traces (:func:`trainprof.analysis.trace.analyse.merge_ranks`):
    ``(slowest - fastest) / slowest``, over the step numbers every rank has past all
    ranks' warm-up (at least :data:`MIN_COMMON_STEPS`; else no spread). Ranks that
    synchronise every step (DDP) then have the same mean whatever their speed - the
    fast ones wait for the slowest inside backward, in the gradient all-reduce - so
    this spread shows ranks that do *not* keep in step. Medians, or means over each
    rank's own steady steps, are left out on purpose: they differ with the shape of
    each distribution and with where each rank's warm-up ended, not with its pace.
    And the spread of data-wait seconds per step: the usual cause of a straggler,
    which synchronous training hides from step times, with a 95% moving-block bootstrap
    interval of the difference between the two ranks' mean per-step waits over their steady
    steps (``data_wait_spread_ci_s``; :func:`data_wait_difference_ci`): a rank whose few
    waits on a busy machine ran long differs by chance, not in pace. The step-time spread
    gets one too (``spread_ci_pct``, :func:`step_spread_ci`);
``samples_per_s_all_ranks``
    the run's throughput, the sum over ranks (each rank loads its own share of the data).
``rank_data``
    whether the ranks load the same data: per DataLoader (by its index in each rank),
    the ranks whose first batches have the same fingerprint
    (:mod:`trainprof.capture.batch_digest`, ``workers.loaders[].first_batch``), on
    data that varies from batch to batch; the loader with the most such ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from trainprof.analysis.compare import CONFIDENCE, N_BOOT, SEED, block_bootstrap
from trainprof.analysis.steps import complete_steps
from trainprof.analysis.workers import same_data_group
from trainprof.store import RANKS_DIR, RUN_JSON, Run, load_run

#: Fewest steps every rank shares (past warm-up) for a step-time spread: fewer, and a
#: spike or where the boundaries fall within a step decides it.
MIN_COMMON_STEPS = 20

#: How a merged run's status is told from its ranks' when it has no record of its own
#: (a torchrun launch): the worst one wins.
_STATUS_ORDER = ("crashed", "interrupted", "running", "finished")


def _label_key(label: str) -> tuple[int, int | str]:
    return (0, int(label)) if label.isdigit() else (1, label)


def rank_dirs(run_dir: Path) -> list[tuple[str, Path]]:
    """``(label, folder)`` of every rank recorded under ``run_dir/ranks``, in rank order."""
    root = Path(run_dir) / RANKS_DIR
    if not root.is_dir():
        return []
    found = [(p.name, p) for p in root.iterdir() if (p / RUN_JSON).is_file()]
    return sorted(found, key=lambda item: _label_key(item[0]))


def _data_wait_s(summary: dict[str, Any]) -> float | None:
    """Mean seconds per steady step spent waiting for data (share x mean step)."""
    share = (summary.get("breakdown") or {}).get("data_wait")
    mean = (summary.get("steps") or {}).get("mean_s")
    if share is None or mean is None:
        return None
    return float(share) * float(mean)


def rank_row(label: str, summary: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """One rank's line of the merged view."""
    steps = summary.get("steps") or {}
    dist = meta.get("distributed") or {}
    env = summary.get("environment") or {}
    workers_pct = (summary.get("system") or {}).get("workers_cpu_pct")
    return {
        "label": label,
        "rank": dist.get("rank"),
        "world_size": dist.get("world_size"),
        "pid": meta.get("pid"),
        "run_dir": summary.get("run_dir"),
        "status": summary.get("status"),
        "exit_code": summary.get("exit_code"),
        "steps": steps.get("count", 0),
        "median_s": steps.get("median_s"),
        "mean_s": steps.get("mean_s"),
        "p10_s": steps.get("p10_s"),
        "p90_s": steps.get("p90_s"),
        "data_wait": (summary.get("breakdown") or {}).get("data_wait"),
        "data_wait_s": _data_wait_s(summary),
        "samples_per_s": summary.get("samples_per_s"),
        # this rank's own findings, as category/cause, highest gain first
        "findings": [f"{f.get('category')}/{f.get('cause')}"
                     for f in summary.get("findings") or []],
        # what the ranks of one host ask of its cores (diagnosis.distributed)
        "host": meta.get("hostname"),
        "torch_num_threads": env.get("torch_num_threads"),
        "usable_cores": env.get("usable_cores"),
        "on_cuda": bool(summary.get("device")) or bool(env.get("cuda") and env.get("gpu_count")),
        "workers_cpu_pct": workers_pct,
        # DDP's all-reduce not hidden behind this rank's backward, s a step (analysis.ddp)
        "ddp_exposed_comm_s": _ddp_exposed_s(summary),
        # ... and as a share of this rank's step (analysis.ddp: never above 1)
        "ddp_exposed_share": _ddp_exposed_share(summary),
    }


def _ddp_exposed_s(summary: dict[str, Any]) -> float | None:
    """The rank's DDP communication left exposed, seconds a step (all its DDP models).

    Only models whose sampled iterations were usable as steady ones (``exposed_share``
    set: analysis.ddp): a warm-up iteration's all-reduce is no figure for a step."""
    values = [m["exposed_ms"] / 1e3 for m in _usable_ddp(summary)]
    return sum(values) if values else None


def _ddp_exposed_share(summary: dict[str, Any]) -> float | None:
    """The share of the rank's step its DDP models' exposed all-reduces take (at most 1)."""
    values = [float(m["exposed_share"]) for m in _usable_ddp(summary)]
    return min(1.0, sum(values)) if values else None


def _usable_ddp(summary: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in summary.get("ddp") or [] if isinstance(m, dict)
            and isinstance(m.get("exposed_ms"), int | float)
            and isinstance(m.get("exposed_share"), int | float)]


def common_step_durations(
    steps: dict[str, tuple[np.ndarray, int]],
) -> tuple[dict[str, np.ndarray], int]:
    """Each rank's step times (seconds) over the step numbers all ranks share past warm-up.

    ``steps``: per label, the rank's complete step records (``step``, ``dur_ns``) and
    its warm-up count. Returns the durations and how many steps they cover.
    """
    done = {k: (d, w) for k, (d, w) in steps.items() if len(d) > w}
    if len(done) < 2:
        return {}, 0
    first = max(int(d["step"][w]) for d, w in done.values())
    common = None
    for d, _ in done.values():
        numbers = d["step"][d["step"] >= first]
        common = numbers if common is None else np.intersect1d(common, numbers)
    if common is None or len(common) == 0:
        return {}, 0
    return ({k: d["dur_ns"][np.isin(d["step"], common)].astype(np.float64) / 1e9
             for k, (d, _) in done.items()}, len(common))


def common_step_means(durations: dict[str, np.ndarray]) -> dict[str, float]:
    """Each rank's mean step time over the steps they share (:func:`common_step_durations`)."""
    return {k: float(v.mean()) for k, v in durations.items()}


def steady_data_waits(steps: dict[str, tuple[np.ndarray, int]]) -> dict[str, np.ndarray]:
    """Per rank, the seconds each steady step waited for data (complete steps past warm-up)."""
    return {label: d["data_wait_ns"][w:].astype(np.float64) / 1e9
            for label, (d, w) in steps.items() if len(d) > w}


def _boot_means(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bootstrap means of two ranks' per-step series, each resampled in moving blocks
    (:func:`trainprof.analysis.compare.block_bootstrap`: steps are autocorrelated) and
    independently of the other's."""
    rng = np.random.default_rng(SEED)
    return block_bootstrap(a, rng, N_BOOT, "mean"), block_bootstrap(b, rng, N_BOOT, "mean")


def _interval(values: np.ndarray) -> tuple[float, float]:
    alpha = (1 - CONFIDENCE) / 2
    lo, hi = np.quantile(values[np.isfinite(values)], [alpha, 1 - alpha])
    return float(lo), float(hi)


def data_wait_difference_ci(most: np.ndarray, least: np.ndarray) -> tuple[float, float]:
    """95% percentile interval of mean(most) - mean(least), per-step data waits (seconds)."""
    a, b = _boot_means(most, least)
    return _interval(a - b)


def step_spread_ci(slow: np.ndarray, fast: np.ndarray) -> tuple[float, float]:
    """95% percentile interval of the step-time spread (mean(slow) - mean(fast)) / mean(slow)
    in percent, over the steps the ranks share."""
    a, b = _boot_means(slow, fast)
    with np.errstate(divide="ignore", invalid="ignore"):
        lo, hi = _interval((a - b) / a * 100.0)
    return lo, hi


def rank_spread(
    rows: list[dict[str, Any]], step_means: dict[str, float] | None = None, n_common: int = 0,
    waits_per_step: dict[str, np.ndarray] | None = None,
    step_durations: dict[str, np.ndarray] | None = None,
) -> dict[str, Any] | None:
    """How far apart the ranks are (see the module docstring).

    ``step_means``: from :func:`common_step_means` over ``n_common`` shared steps; the
    step-time spread is left out below :data:`MIN_COMMON_STEPS` of them.
    ``waits_per_step``: :func:`steady_data_waits`, for the data-wait difference's interval;
    ``step_durations``: :func:`common_step_durations`, for the step-time spread's.
    """
    out: dict[str, Any] = {}
    means = step_means or {}
    if len(means) >= 2 and n_common >= MIN_COMMON_STEPS:
        slow = max(means, key=lambda k: means[k])
        fast = min(means, key=lambda k: means[k])
        out.update({
            "mean_step_s": means,
            "common_steps": n_common,
            "slowest_rank": slow,
            "fastest_rank": fast,
            "spread_pct": (means[slow] - means[fast]) / means[slow] * 100.0,
        })
        durations = step_durations or {}
        if slow in durations and fast in durations:
            out["spread_ci_pct"] = list(step_spread_ci(durations[slow], durations[fast]))
    waits = [r for r in rows if r.get("mean_s") and r.get("data_wait_s") is not None]
    if len(waits) >= 2:
        most = max(waits, key=lambda r: r["data_wait_s"])
        least = min(waits, key=lambda r: r["data_wait_s"])
        out["data_wait_s"] = {r["label"]: r["data_wait_s"] for r in waits}
        out["most_data_wait_rank"] = most["label"]
        out["least_data_wait_rank"] = least["label"]
        out["data_wait_spread_s"] = most["data_wait_s"] - least["data_wait_s"]
        per_step = waits_per_step or {}
        a, b = per_step.get(most["label"]), per_step.get(least["label"])
        if a is not None and b is not None and len(a) >= 2 and len(b) >= 2:
            out["data_wait_spread_ci_s"] = list(data_wait_difference_ci(a, b))
    return out or None


def pick_main(own_steps: int | None, rank_steps: list[tuple[str, int]]) -> str | None:
    """The label of the rank whose figures lead the merged view (None: the run's own).

    ``own_steps``: the run's own step count (None: a launch, no record of its own);
    ``rank_steps``: ``(label, step count)`` per rank, in rank order.
    """
    if own_steps:
        return None
    with_steps = [label for label, n in rank_steps if n]
    if with_steps:
        return with_steps[0]
    return None if own_steps is not None or not rank_steps else rank_steps[0][0]


def _count(summary: dict[str, Any]) -> int:
    return int((summary.get("steps") or {}).get("count") or 0)


def merged_status(ranks: list[tuple[str, dict[str, Any]]]) -> tuple[str, int | None]:
    """A launch's status and exit code from its ranks' (no record of its own): the worst."""
    statuses = [str(s.get("status")) for _, s in ranks]
    status = next((st for st in _STATUS_ORDER if st in statuses), "finished")
    codes = [s.get("exit_code") for _, s in ranks]
    code = next((c for c in codes if c not in (0, None)), 0 if codes else None)
    return status, code


def same_data(ranks: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> dict[str, Any] | None:
    """The ranks that loaded the same first batch, per loader (``rank_data``, above).

    ``identical_ranks``: the labels of the largest group of ranks with one fingerprint
    (:func:`~trainprof.analysis.workers.same_data_group`: one of them saw its data
    vary); empty when no two ranks agree. None when no loader has fingerprints from two
    ranks.
    """
    by_index: dict[int, dict[str, dict[str, Any]]] = {}
    for label, summary, _ in ranks:
        for e in (summary.get("workers") or {}).get("loaders") or []:
            fb, index = e.get("first_batch"), e.get("loader_index")
            if isinstance(fb, dict) and isinstance(fb.get("digest"), str) and isinstance(
                    index, int):
                by_index.setdefault(index, {})[label] = fb
    best: dict[str, Any] | None = None
    for index, per in sorted(by_index.items()):
        if len(per) < 2:
            continue
        same = same_data_group({label: (fb["digest"], bool(fb.get("varies")))
                                for label, fb in per.items()})
        found = {"loader_index": index, "identical_ranks": sorted(same, key=_label_key),
                 "ranks_compared": len(per)}
        if best is None or len(same) > len(best["identical_ranks"]):
            best = found
    return best


def merge_ranks(
    run_dir: Path,
    own: dict[str, Any] | None,
    ranks: list[tuple[str, dict[str, Any], dict[str, Any]]],
    steps: dict[str, tuple[np.ndarray, int]] | None = None,
    *,
    own_label: str | None = None,
    own_meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The merged summary of a run with ranks (see the module docstring).

    ``own``: the run's own summary (None for a launch with no record of its own);
    ``ranks``: ``(label, summary, meta)`` per rank, each summary complete with its
    findings; ``steps``: per label, the complete step records and warm-up count (for
    the step-time spread). ``own_label``: the rank the run's own process is, where it
    trained as one (a script that ran itself again for the other ranks, as PyTorch
    Lightning's DDP launcher does; its record's ``rank_label``), with ``own_meta`` its
    record's metadata: it leads the merged view and has the first row. The caller
    diagnoses the merged document again (the distributed rules read ``ranks`` and
    ``rank_spread``).
    """
    main_label = pick_main(None if own is None else _count(own),
                           [(label, _count(s)) for label, s, _ in ranks])
    by_label = {label: s for label, s, _ in ranks}
    main = dict(own if main_label is None and own is not None else by_label[main_label or ""])
    if own is not None:
        # the run is the process the user started: its status, exit code and command
        for key in ("status", "exit_code", "command", "name", "started_at", "ended_at",
                    "duration_s"):
            main[key] = own.get(key)
        if "recorded_status" in own:
            main["recorded_status"] = own["recorded_status"]
    else:
        main["status"], main["exit_code"] = merged_status([(lb, s) for lb, s, _ in ranks])
    main["run_dir"] = str(run_dir)
    rows = [rank_row(label, s, meta) for label, s, meta in ranks]
    if own is not None and own_label is not None and main_label is None:
        rows.insert(0, rank_row(own_label, own, own_meta or {}))
        main["main_rank"] = own_label
    else:
        main["main_rank"] = main_label
    main["ranks"] = rows
    durations, n_common = common_step_durations(steps or {})
    main["rank_spread"] = rank_spread(
        rows, common_step_means(durations), n_common,
        waits_per_step=steady_data_waits(steps or {}), step_durations=durations)
    rates = [r["samples_per_s"] for r in rows if r.get("samples_per_s")]
    main["samples_per_s_all_ranks"] = sum(rates) if rates else None
    trained = list(ranks)
    if own is not None and own_label is not None and main_label is None:
        trained.insert(0, (own_label, own, own_meta or {}))  # it trained as a rank too
    main["rank_data"] = same_data(trained)
    if main_label is not None:
        # the rank's own notes, the launching process's (less the one this replaces)
        own_notes = [n for n in (own or {}).get("notes") or [] if f"{RANKS_DIR}/<k>/" not in n]
        main["notes"] = [
            f"{len(rows)} ranks recorded under {RANKS_DIR}/: the figures above are rank "
            f"{main_label}'s; every rank has a line under Ranks",
            *own_notes,
            *(main.get("notes") or []),
        ]
    main["findings"] = []  # diagnosed again on the merged document
    return main


def load_ranks(run_dir: Path) -> tuple[Run, list[tuple[str, Run]]]:
    """A folder's main Run (:func:`pick_main`) and every rank's ``(label, Run)``, each read once.

    For what reads one record (``compare``, ``export``, ``tune``'s trials): a torchrun
    launch's folder has no record of its own, and a script that spawned its ranks
    trained in them. A folder without ranks is its own main run, with no ranks.
    """
    run_dir = Path(run_dir)
    ranks = rank_dirs(run_dir)
    if not ranks:
        return load_run(run_dir), []
    own = load_run(run_dir) if (run_dir / RUN_JSON).exists() else None
    runs = [(label, load_run(path)) for label, path in ranks]
    label = pick_main(None if own is None else len(complete_steps(own.steps)),
                      [(k, len(complete_steps(r.steps))) for k, r in runs])
    main = own if label is None else dict(runs)[label]
    assert main is not None
    return main, runs


def load_main_run(run_dir: Path) -> Run:
    """The Run whose figures stand for a folder (see :func:`load_ranks`)."""
    return load_ranks(run_dir)[0]
