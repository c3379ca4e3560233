"""Two runs side by side: did B get slower than A, by how much, in which phase, and why?

The story this answers: a run became slower after an upgrade (or a config change), and finding
out why took a profiler and luck. :func:`compare_runs` puts the answer in one document:

**Which numbers are compared.** Steady-state steps only (warm-up detected per run with
:func:`trainprof.analysis.steps.detect_warmup`, the definition every trainprof report uses).
The compared quantity is what a run pays for its work: its **time per unit of work** over the
steady steps, total steady seconds over the work they did. The unit is the step (the mean
steady step time, 1 / steps/s: what ``trainprof tune`` and ``verify`` judge), or the
*sample* when the two runs put a different number of samples in a step (another batch size:
a step of 64 samples is not "slower" than a step of 32 because it takes longer; the samples
are those the run summary's samples/s counts, an evaluation loader's left out), or, when
either run counts no samples, the *GFLOP* when the op count's FLOPs a step differ between them
(gradient accumulation over 4 micro-batches makes a step 4 times the work). A loop whose
second optimizer steps once every k steps (a GAN's critic stepped k times a generator step,
:mod:`trainprof.analysis.iterations`) is compared by iterations of k steps (summed), since
its steps are of two kinds (per sample where the samples differ, never per GFLOP: the op
count's two steps are no whole iteration).

Why the mean and not the median: periodic work (an evaluation every N steps, a checkpoint,
an epoch's restart of the workers) lives in a few long steps that the median ignores, and a
step series that alternates (a step that finds its batch ready, one that waits for the next
worker) has a median that lands on either mode by chance. An explorer's evaluation interval
raised (examples/eval_every.py) read "+11.2% time per step" by the medians, and failed
``--fail-if-slower 5``, on a run whose steps/s were ×1.34. The median (of each step's time
per unit) is still given (``median_ratio``), and a note says when it moved the other way.

**Ratio and confidence interval.** ``ratio`` is the time per unit of B over A's. Its 95%
confidence interval is a percentile bootstrap (Efron & Tibshirani, *An Introduction to the
Bootstrap*, 1993, ch. 13) with :data:`N_BOOT` resamples from a fixed seed, so the same two
runs always give the same interval; each resample's statistic is its total seconds over its
total work (a ratio estimator: the steps' seconds and work drawn together). Step times are
autocorrelated (epoch boundaries, periodic evaluation, a neighbour's burst of load), which
makes an i.i.d. bootstrap too confident; each run is therefore resampled with the
*moving-block* bootstrap (Künsch 1989) with blocks of ``ceil(n ** (1/3))`` consecutive steps,
the usual rate for a variance-type statistic (Hall, Horowitz & Jing 1995). A rare long step
is in some resamples and not in others, so periodic work widens the interval as it should.
Runs longer than :data:`MAX_RESAMPLE` steady steps are resampled ``m``-out-of-``n`` with
``m = MAX_RESAMPLE`` (Bickel, Götze & van Zwet 1997), which keeps the cost bounded and can
only widen the interval. The interval covers the step-to-step noise within the two runs, not
the run-to-run variation of a machine (another node, a busy neighbour): for that, repeat runs
(``trainprof tune`` does).

**Verdict.** ``slower`` / ``faster`` when the interval excludes 1 *and* the change is at least
:data:`PRACTICAL_THRESHOLD` (2%) — a change smaller than that is within what an unchanged
script shows from one run to the next on a quiet machine, and not worth a CI failure even when
thousands of steps make it statistically detectable. Otherwise ``no_difference``; and
``insufficient_data`` when either run has fewer than :data:`MIN_STEADY_STEPS` steady steps,
so that a CI gate can tell "no slowdown" from "nothing compared". ``--fail-if-slower`` reads
the same ratio (:func:`exceeds_slowdown`).

**Phases.** Per phase (``data_wait``, ``forward``, ``backward``, ``optimizer``, ``gc``,
``other``, grouped as in :mod:`trainprof.analysis.steps`), its steady seconds per unit of work,
A vs B. Phases are exclusive and add up to the step exactly, so the phase deltas add up to
the change in the compared time per unit and each phase's ``share_of_change`` is meaningful.
``explains`` names the phase with the largest delta in the direction of the change.

**Environment diff, ranked.** Every fingerprint fact, DataLoader setting, thread setting and the
command line that differs between the runs, scored by how likely it explains the phases that
changed::

    score(item) = sum over phases p of  W[category(item)][p] * weight(p)

where ``weight(p)`` is phase ``p``'s share of the change, counting only phases that moved in the
direction of the change (normalised to 1; uniform when nothing changed), and ``W`` (in
:func:`_weights`) says how directly a category acts on a phase: DataLoader settings on
``data_wait`` (1.0); torch/CUDA/cuDNN/driver versions and the GPU on ``forward``/``backward``/
``optimizer``; thread settings and the CPU on compute when the math runs on the CPU (no GPU in
either run), and on ``data_wait`` when the input pipeline runs in the main process; Python
version on ``gc``/``other``; data-stack packages (Pillow, torchvision, ...) on ``data_wait``;
the command line and the code revision at 0.5 on every phase (they can change anything, but
name no mechanism); trainprof's own version and sampling settings last. A batch-size change acts
on every phase. Ties keep the category order above.

A DataLoader's changes are one row: its one changed setting (``dataloader[0].num_workers``),
or the loader (``dataloader[0]``) with each setting that differs, ``name=value``, where
several did; a loader in one run only is one row too. What torch sets for a loader without
workers (``prefetch_factor`` None) is no change of its own beside ``num_workers``.
``acts_on`` names the phase a fact acts on only where its kind says so (``W`` at least
:data:`ACTS_ON_WEIGHT` there and :data:`ACTS_ON_CONTRAST` times its least): a DataLoader
setting on data wait, the model's facts on forward/backward; the command line, the code,
a knob or a batch size name none, as they can act on any phase.

**Op timings.** The op-by-op attention time of each run (from its op count's window, two steps
timed op by op) is compared as a change only where the attention ops differ or a setting
of the model's math changed (:func:`_attention`): the same ops under the same settings
compute the same way, and the window's split has no replicate to tell its noise.
"""

from __future__ import annotations

import difflib
import math
import shlex
from pathlib import Path
from typing import Any

import numpy as np

from trainprof.analysis.iterations import group_steps, steps_per_iteration
from trainprof.analysis.steps import (
    BREAKDOWN_KEYS,
    PHASE_COLUMNS,
    complete_steps,
    detect_warmup,
    training_samples,
)
from trainprof.analysis.summary import summarize_run
from trainprof.analysis.system import OUTSIDE_LOAD_CORES, outside_cores
from trainprof.store import Run

#: Resamples of the bootstrap (each run resampled independently).
N_BOOT = 2000
#: Seed of the bootstrap: the same two runs always give the same interval.
SEED = 20240917
CONFIDENCE = 0.95
#: Smallest relative change called significant (see the module docstring).
PRACTICAL_THRESHOLD = 0.02
#: Fewer steady steps than this in either run: no verdict.
MIN_STEADY_STEPS = 5

#: What an attention shape of the op count's window is compared by (analysis/attention.py).
ATTENTION_OP_KEYS = ("batch", "query_len", "key_len", "head_dim", "dtype", "device",
                     "flops_per_step")

#: Resample size cap (m-out-of-n bootstrap beyond it).
MAX_RESAMPLE = 10_000
#: Samples per step differing by more than this fraction: compare time per sample.
BATCH_TOLERANCE = 0.01

#: Phase -> the step-record fields it groups (as in trainprof.analysis.steps' breakdown).
PHASE_FIELDS = PHASE_COLUMNS
assert tuple(PHASE_FIELDS) == BREAKDOWN_KEYS

COMPUTE = ("forward", "backward", "optimizer")

#: Order of categories, used to break ties (most specific mechanism first).
CATEGORIES = (
    "knob",
    "dataloader",
    "optimizer",
    "model",
    "eval",
    "torch_cuda",
    "gpu",
    "threads",
    "cpu",
    "packages",
    "python",
    "command",
    "code",
    "platform",
    "measurement",
)

#: Packages of the input pipeline: a change in them acts on data_wait.
DATA_PACKAGES = {
    "pillow", "pillow-simd", "torchvision", "torchaudio", "datasets", "ffcv", "webdataset",
    "litdata", "mosaicml-streaming", "h5py", "lmdb", "opencv-python", "opencv-python-headless",
    "numpy", "scipy",
}
#: Packages that run the model's math (kernels, fused optimizers, compilers).
COMPUTE_PACKAGES = {
    "triton", "apex", "deepspeed", "transformers", "timm", "accelerate", "lightning",
    "pytorch-lightning",
}
#: Tracked environment variables that set thread counts or placement (the rest: torch/CUDA).
THREAD_ENV_PREFIXES = ("OMP_", "MKL_", "OPENBLAS_", "VECLIB_", "NUMEXPR_", "KMP_", "GOMP_")
#: Environment variables that cannot change speed (paths of caches and the like).
NOISE_ENV = {"TORCHINDUCTOR_CACHE_DIR", "TORCH_LOGS"}
#: What an optimizer's record holds that can change its step's speed.
OPTIMIZER_FIELDS = ("class", "implementation", "param_tensors", "numel", "devices", "dtypes")
#: DataLoader description fields that are bookkeeping, not settings.
DATALOADER_SKIP = {"index", "kind"}
PRIMARY_DATALOADER = (
    ".num_workers", ".batch_size", ".dataset", ".collate_fn", ".pin_memory", ".sampler",
    ".batch_sampler", ".len",
)
#: Settings torch's DataLoader only uses with workers, and their default there: a loader of
#: no workers has ``prefetch_factor`` None, so num_workers 2 -> 0 is not also a change of
#: ``prefetch_factor`` 2 -> None (one change, not two rows).
WORKER_DEFAULTS: dict[str, Any] = {
    "prefetch_factor": 2, "persistent_workers": False, "multiprocessing_context": None,
    "timeout": 0, "in_order": True,
}
#: What a loader present in one run only is shown by.
LOADER_SHOWN = ("num_workers", "batch_size", "dataset")
#: A changed fact names the phase it acts on ("acts on") when its weight there (``_weights``)
#: is at least this ...
ACTS_ON_WEIGHT = 0.45
#: ... and this many times its weight on the phase it acts on least: a fact of a kind that
#: can act on any phase (the command line, the code revision, a knob, a batch size) names
#: none, where it had named whichever phase moved most ("--eval-interval 370 acts on data
#: wait", a DataLoader's every setting "acts on backward").
ACTS_ON_CONTRAST = 2.0
#: A changed fact acts on the model's math from this weight on forward or backward: what
#: makes a difference in the op-by-op attention time a change of the runs' (``_attention``).
MATH_WEIGHT = 0.6


# --------------------------------------------------------------------------- statistics


def block_bootstrap(x: np.ndarray, rng: np.random.Generator, n_boot: int,
                    stat: str = "median", work: np.ndarray | None = None) -> np.ndarray:
    """Medians, means or rates of ``n_boot`` moving-block bootstrap resamples of ``x`` (see
    the module docstring).

    ``stat="rate"``: each resample's ``sum(x) / sum(work)``, ``work`` drawn with the same
    blocks as ``x`` (the seconds of a run's steps over the work they did: samples, or FLOPs).
    A ratio of sums, not the mean of per-step ratios, because that is what a run's
    throughput is (samples/s over the steady steps), and a step that did little work (a
    short last batch) would otherwise count as much as a full one."""
    if stat == "rate" and (work is None or len(work) != len(x)):
        raise ValueError("stat='rate' needs a work value for each value of x")
    reduce = {"mean": np.mean, "median": np.median}.get(stat)
    n = len(x)
    m = min(n, MAX_RESAMPLE)
    block = max(1, math.ceil(m ** (1 / 3)))
    block = min(block, n)
    k = math.ceil(m / block)
    offsets = np.arange(block)
    out = np.empty(n_boot)
    # Chunks of resamples keep the index matrix to ~16 MB whatever the run length.
    chunk = max(1, 2_000_000 // (k * block))
    for lo in range(0, n_boot, chunk):
        hi = min(n_boot, lo + chunk)
        starts = rng.integers(0, n - block + 1, size=(hi - lo, k))
        idx = (starts[:, :, None] + offsets).reshape(hi - lo, k * block)[:, :m]
        if reduce is None:
            out[lo:hi] = x[idx].sum(axis=1) / work[idx].sum(axis=1)  # type: ignore[index]
        else:
            out[lo:hi] = reduce(x[idx], axis=1)
    return out


def bootstrap_ratio_ci(
    a: np.ndarray,
    b: np.ndarray,
    n_boot: int = N_BOOT,
    seed: int = SEED,
    confidence: float = CONFIDENCE,
    stat: str = "median",
    work_a: np.ndarray | None = None,
    work_b: np.ndarray | None = None,
) -> tuple[float, float]:
    """Percentile bootstrap interval of stat(b) / stat(a); both resampled independently.

    ``stat="rate"`` (what :func:`compare_runs` uses): the ratio of the two runs' time per
    unit of work, ``sum(b) / sum(work_b)`` over ``sum(a) / sum(work_a)``."""
    rng = np.random.default_rng(seed)

    def side(x: np.ndarray, work: np.ndarray | None) -> np.ndarray:
        return block_bootstrap(np.asarray(x, dtype=np.float64), rng, n_boot, stat,
                               None if work is None else np.asarray(work, dtype=np.float64))

    ma = side(a, work_a)
    mb = side(b, work_b)
    return percentile_ratio_interval(mb, ma, confidence)


def percentile_ratio_interval(
    num: np.ndarray, den: np.ndarray, confidence: float = CONFIDENCE
) -> tuple[float, float]:
    """Percentile interval of the bootstrap ratios ``num / den`` (NaN, NaN if none is finite)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = num / den
    ratios = ratios[np.isfinite(ratios)]
    if len(ratios) == 0:
        return (math.nan, math.nan)
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(ratios, [alpha, 1 - alpha])
    return float(lo), float(hi)


# --------------------------------------------------------------------------- one run


def _steady(run: Run) -> tuple[np.ndarray, int, int]:
    """Steady-state step records, the warm-up length and the complete-step count."""
    done = complete_steps(run.steps)
    if len(done) == 0:
        return done, 0, 0
    warm = detect_warmup(done["dur_ns"].astype(np.float64) / 1e9)
    return done[warm:], warm, len(done)


def _samples_per_step(steady: np.ndarray) -> float | None:
    """Median samples per step when every steady step counted some, else None (unknown)."""
    if len(steady) == 0:
        return None
    samples = steady["samples"]
    if (samples <= 0).any():
        return None
    return float(np.median(samples))


def _run_side(run: Run, steady: np.ndarray, warm: int, count: int) -> dict[str, Any]:
    """What the comparison shows of one run (a trimmed run summary)."""
    summary = summarize_run(run)
    system = summary.get("system") or {}
    durations = steady["dur_ns"].astype(np.float64) / 1e9
    stats: dict[str, Any] = {
        "count": count,
        "warmup": warm,
        "steady_count": len(steady),
        "median_s": None,
        "p10_s": None,
        "p90_s": None,
        "mean_s": None,
    }
    if len(durations):
        p10, p50, p90 = np.percentile(durations, [10, 50, 90])
        stats.update(median_s=float(p50), p10_s=float(p10), p90_s=float(p90),
                     mean_s=float(durations.mean()))
    return {
        "run_dir": str(run.path),
        "name": run.meta.get("name"),
        "status": run.status,
        "command": run.meta.get("command"),
        "started_at": run.meta.get("started_at"),
        "steps": stats,
        "samples_per_step": _samples_per_step(steady),
        "samples_per_s": summary.get("samples_per_s"),
        "steps_per_s": summary.get("steps_per_s"),
        "breakdown": summary.get("breakdown"),
        # the step's FLOPs and their share of the measured peak (analysis/compute_efficiency.py)
        "compute": {k: (summary.get("compute") or {}).get(k)
                    for k in ("flops_per_step", "flops_per_s", "utilization")},
        # the time of attention computed op by op a step (analysis/attention.py): 0 where the
        # op count's window ran and found none, None where it did not run
        # torch.compile's recompilations in the steady steps, and their seconds (None: it
        # compiled nothing; analysis/compiles.py)
        "recompilations": ({k: (summary.get("compiles") or {}).get(k)
                            for k in ("after_warmup", "after_warmup_s", "limit_hit")}
                           if summary.get("compiles") else None),
        # the share of the token positions that are padding, per loader that padded
        # (analysis/padding.py): what the padding finding's "compare" verify line reads
        "padding": {str(p.get("loader_index")): p.get("pad_share")
                    for p in summary.get("padding") or []} or None,
        "attention_s_per_step": ((summary.get("attention") or {}).get("s_per_step")
                                 if summary.get("attention")
                                 else 0.0 if summary.get("ops") else None),
        # ... and what it computed: each shape and its FLOPs a step (the same model, the
        # same ops), None where the window did not run
        "attention_ops": ([{k: sh.get(k) for k in ATTENTION_OP_KEYS}
                           for sh in (summary.get("attention") or {}).get("shapes") or []
                           if isinstance(sh, dict)]
                          if summary.get("attention") or summary.get("ops") else None),
        "system": {
            k: system.get(k)
            for k in ("proc_cpu_pct", "workers_cpu_pct", "n_workers_seen", "sys_cpu_pct",
                      "iowait_pct", "rss_peak_bytes", "disk_read_bps", "ctx_switches_ps")
        } | {
            # cores other processes kept busy while the run's steady steps ran
            "outside_load_cores": outside_cores(
                system, (summary.get("environment") or {}).get("usable_cores")),
        },
        "environment": summary.get("environment"),
    }


# --------------------------------------------------------------------------- environment


def _dataloaders(run: Run) -> list[dict[str, Any]]:
    loaders = run.meta.get("dataloaders")
    if not loaders:
        loaders = [ev for ev in run.events if ev.get("kind") == "dataloader"]
    return [dl for dl in loaders if isinstance(dl, dict)]


def _env_category(name: str) -> str:
    if name in NOISE_ENV:
        return "measurement"
    if name == "TORCH_NUM_THREADS" or name.startswith(THREAD_ENV_PREFIXES):
        return "threads"
    if name == "LD_PRELOAD":
        return "platform"
    if name == "SLURM_CPUS_PER_TASK":
        return "cpu"
    return "torch_cuda"


def _eval_autograd(rec: Any) -> str | None:
    """"on" when eval-mode model calls ran with autograd on, "off" when they ran without
    (torch.no_grad() in the script, or tune's eval_no_grad knob); None: no eval call."""
    if not isinstance(rec, dict):
        return None
    on, off = int(rec.get("grad_calls") or 0), int(rec.get("nograd_calls") or 0)
    if on and not rec.get("no_grad_knob"):
        return "on"
    return "off" if on or off else None


def _pct_of(part: Any, whole: Any) -> str | None:
    if not isinstance(part, int | float) or not isinstance(whole, int | float) or whole <= 0:
        return None
    return f"{part / whole * 100:.0f}%"


def _model_facts(run: Run) -> dict[str, str]:
    """How the model computed, from the op count's window (``ops.json``): the shares that
    the model-level fixes change - convolutions in NHWC (channels_last), FLOPs in float64,
    matrix products in float32 outside autocast. Empty without a window."""
    from trainprof.analysis.ops import load_ops

    ops = load_ops(Path(run.path))
    if not ops:
        return {}
    facts = {
        "model.convolutions_nhwc": _pct_of(ops.get("conv2d_channels_last_per_step"),
                                           ops.get("conv2d_per_step")),
        "model.flops_float64": _pct_of(
            (ops.get("float64_matmul_flops_per_step") or 0.0)
            + (ops.get("float64_conv_flops_per_step") or 0.0),
            ops.get("matmul_conv_flops_per_step")),
        "model.matmuls_float32_outside_autocast": _pct_of(
            (ops.get("cpu_fp32_matmul_per_step") or 0.0)
            + (ops.get("cuda_fp32_matmul_per_step") or 0.0), ops.get("matmul_per_step")),
    }
    # each trainable embedding table, by its shape (what pairs it across the runs): its
    # gradient dense or sparse (nn.Embedding(sparse=True)), and whether an optimizer steps
    # it (capture/opcount.py; diagnosis/embedding.py)
    for e in ops.get("embeddings") or []:
        if not isinstance(e, dict) or not e.get("rows") or not e.get("dim"):
            continue
        value = "sparse gradient" if e.get("sparse") else "dense gradient"
        if e.get("dense_use"):
            value += f" (its weight also in {e['dense_use']})"
        if e.get("stepped") is False:
            value += ", stepped by no optimizer"
        facts[f"model.embedding[{int(e['rows'])}x{int(e['dim'])}]"] = value
    return {k: v for k, v in facts.items() if v is not None}


def _facts(run: Run) -> tuple[dict[str, tuple[str, Any]], bool]:
    """Flat ``key -> (category, value)`` of everything about a run that could change its speed.

    The flag says whether the run has an environment fingerprint (a run killed before it was
    taken has none: its facts are unknown, not changed).
    """
    meta = run.meta
    fp = meta.get("fingerprint") or {}
    out: dict[str, tuple[str, Any]] = {}

    def put(key: str, category: str, value: Any) -> None:
        out[key] = (category, value)

    for i, dl in enumerate(_dataloaders(run)):
        idx = dl.get("index", i)
        for field, value in dl.items():
            if field == "batch_sampler_batch_size":
                continue  # folded into batch_size below
            if field == "sampler" and dl.get("batch_sampler") and not str(
                    dl["batch_sampler"]).endswith(".BatchSampler"):
                continue  # a batch_sampler of the script's makes the batches: torch's
                # default sampler beside it is unused (SequentialSampler), not a setting
            if field == "batch_size" and value is None:
                # a batch_sampler makes the batches: its batch size is the loader's, so a
                # change to a batch sampler of the same size is not a batch-size change
                value = dl.get("batch_sampler_batch_size")
            if field not in DATALOADER_SKIP:
                put(f"dataloader[{idx}].{field}", "dataloader", value)
    # the optimizers, in the order they first stepped (what their step runs: for-loop,
    # foreach, fused; trainprof.capture.optimizer_impl)
    for i, opt in enumerate(o for o in meta.get("optimizers") or [] if isinstance(o, dict)):
        for field in OPTIMIZER_FIELDS:
            if field in opt:
                put(f"optimizer[{i}].{field}", "optimizer", opt[field])
    # how the model's eval-mode calls ran: autograd on or off (capture/eval_autograd.py)
    mode = _eval_autograd(meta.get("eval_autograd"))
    if mode is not None:
        put("eval_mode.autograd", "eval", mode)
    for key, value in _model_facts(run).items():
        put(key, "model", value)
    # the knobs the run was a tune trial of (trainprof.capture.knobs): a setting changed
    # from outside the script, which no other fact may show (trim_padding, autocast)
    for name, value in ((meta.get("knobs") or {}).get("requested") or {}).items():
        put(f"knob.{name}", "knob", value)
    command = meta.get("command") or fp.get("command")
    if command:
        # The interpreter path is python.executable; the rest is what the user typed.
        put("command", "command", list(command[1:]) if len(command) > 1 else list(command))
    put("trainprof_version", "measurement", meta.get("trainprof_version"))
    put("sample_interval_s", "measurement", meta.get("sample_interval_s"))
    if not fp:
        return out, False

    torch_info = fp.get("torch") or {}
    for field in ("version", "cuda", "cudnn", "hip", "debug", "git_version", "cuda_available",
                  "cudnn_benchmark", "cudnn_deterministic"):
        if field in torch_info:
            put(f"torch.{field}", "torch_cuda", torch_info[field])
    put("driver_version", "torch_cuda", fp.get("driver_version"))
    gpus = fp.get("gpus") or []
    put("gpu count", "gpu", len(gpus))
    for g in gpus:
        for field in ("name", "total_memory_bytes", "capability"):
            put(f"gpu[{g.get('index')}].{field}", "gpu", g.get(field))

    threads = fp.get("threads") or {}
    training = meta.get("training_thread") or {}
    for field in ("torch_num_threads", "torch_num_interop_threads"):
        # The training thread's count is the one its ops use (OpenMP's is per thread).
        value = training.get(field, threads.get(field))
        if value is not None:
            put(field, "threads", value)
    for name, value in (threads.get("env") or {}).items():
        put(f"env.{name}", _env_category(name), value)

    for field, value in (fp.get("cpu") or {}).items():
        put(f"cpu.{field}", "cpu", value)

    for name, version in (fp.get("packages") or {}).items():
        category = {"torch": "torch_cuda", "trainprof": "measurement"}.get(name, "packages")
        put(f"packages.{name}", category, version)

    python = fp.get("python") or {}
    for field in ("version", "implementation"):
        if field in python:
            put(f"python.{field}", "python", python[field])
    if "executable" in python:
        put("python.executable", "platform", python["executable"])

    platform = fp.get("platform") or {}
    for field, value in platform.items():
        put(f"platform.{field}", "platform", value)
    put("hostname", "platform", fp.get("hostname", meta.get("hostname")))

    git = fp.get("git") or {}
    for field in ("commit", "dirty", "branch"):
        if field in git:
            put(f"git.{field}", "code", git[field])

    if "cwd" in fp:
        put("cwd", "command", fp["cwd"])
    return out, True


def _weights(category: str, key: str, cpu_compute: bool) -> dict[str, float]:
    """``W[category][phase]``: how directly a changed fact of this kind acts on each phase."""
    p = dict.fromkeys(BREAKDOWN_KEYS, 0.0)

    def setp(value: float, *phases: str) -> None:
        for ph in phases:
            p[ph] = value

    if category == "dataloader":
        setp(0.2, *BREAKDOWN_KEYS)
        # the settings people change; the others mostly follow them (prefetch_factor is
        # None once num_workers is 0)
        p["data_wait"] = 1.0 if key.endswith(PRIMARY_DATALOADER) else 0.8
        # a batch size, or a whole loader in one run only (key "dataloader[i]")
        if key.endswith((".batch_size", "]")):
            setp(0.9, *BREAKDOWN_KEYS)  # more samples per step: every phase does more
            p["data_wait"] = 1.0
        elif key.endswith(".num_workers") and cpu_compute:
            setp(0.4, *COMPUTE)  # workers compete with the model's threads for cores
    elif category == "model":
        setp(0.1, *BREAKDOWN_KEYS)
        setp(1.0, "forward", "backward")  # the model's own math
        p["optimizer"] = 0.5 if key.endswith("float64") else 0.1  # (the parameters' bytes)
    elif category == "eval":
        setp(0.1, *BREAKDOWN_KEYS)
        p["forward"] = 1.0  # the eval calls are timed as forward
    elif category == "knob":
        setp(0.9, *BREAKDOWN_KEYS)  # a fix applied on purpose: first suspect, on any phase
    elif category == "optimizer":
        setp(0.1, *BREAKDOWN_KEYS)
        p["optimizer"] = 1.0 if key.endswith((".implementation", ".class")) else 0.8
    elif category == "torch_cuda":
        setp(0.25, *BREAKDOWN_KEYS)
        setp(0.6 if cpu_compute else 0.9, *COMPUTE)
    elif category == "gpu":
        if not cpu_compute:
            setp(0.2, *BREAKDOWN_KEYS)
            setp(0.95, *COMPUTE)
    elif category == "threads":
        setp(0.2, *BREAKDOWN_KEYS)
        p["data_wait"] = 0.45  # transforms in the main process (num_workers=0) use these threads
        setp(0.9 if cpu_compute else 0.3, *COMPUTE)
    elif category == "cpu":
        setp(0.3, *BREAKDOWN_KEYS)
        p["data_wait"] = 0.7
        setp(0.8 if cpu_compute else 0.3, *COMPUTE)
    elif category == "packages":
        name = key.split(".", 1)[-1]
        setp(0.25, *BREAKDOWN_KEYS)
        if name in DATA_PACKAGES:
            p["data_wait"] = 0.8
        if name in COMPUTE_PACKAGES:
            setp(0.7, *COMPUTE)
    elif category == "python":
        setp(0.35, *BREAKDOWN_KEYS)
        p["gc"] = 0.7
        p["other"] = 0.5
        p["data_wait"] = 0.45
    elif category == "command":
        setp(0.2 if key == "cwd" else 0.5, *BREAKDOWN_KEYS)
    elif category == "code":
        setp(0.45, *BREAKDOWN_KEYS)
    elif category == "platform":
        setp(0.15, *BREAKDOWN_KEYS)
        p["data_wait"] = 0.25
    else:  # measurement
        setp(0.05, *BREAKDOWN_KEYS)
    return p


#: Longest command line (script and arguments, as written) shown whole as the change.
WHOLE_COMMAND = 80


def _command_change(a: list[str], b: list[str]) -> tuple[str, str]:
    """The differing stretches of two command lines, each with the option it belongs to.

    ``--steps 40 --num-workers 2`` vs ``--steps 40`` gives ``('--num-workers 2', '(none)')``;
    ``--lr 0.1`` vs ``--lr 0.2`` gives ``('--lr 0.1', '--lr 0.2')``. A positional
    argument has no option to name it, and the bare value said nothing ("command 5 → 2",
    "command (none) → 512", an explorer's compare): then the whole command lines are given
    where each is at most :data:`WHOLE_COMMAND` characters (``train.py 5`` → ``train.py
    2``), else each stretch with the word before it (``… sgd`` → ``… sgd 512``).
    """
    before, after = [], []
    positional = False
    matcher = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "equal":
            continue
        # a changed value alone says little: name the option it belongs to
        named = i1 > 0 and a[i1 - 1].startswith("-")
        changed = a[i1:i2] + b[j1:j2]
        if not named and not any(w.startswith("-") for w in changed):
            positional = True
        ctx = [a[i1 - 1]] if named and i2 > i1 and j2 > j1 else []
        if not named and not any(w.startswith("-") for w in changed) and i1 > 0:
            ctx = ["…", a[i1 - 1]]  # a positional argument: the word before places it
        before.append(_join(ctx + a[i1:i2]) if i2 > i1 or ctx else "(none)")
        after.append(_join(ctx + b[j1:j2]) if j2 > j1 or ctx else "(none)")
    whole_a, whole_b = shlex.join(a), shlex.join(b)
    if positional and max(len(whole_a), len(whole_b)) <= WHOLE_COMMAND:
        return whole_a, whole_b
    return "; ".join(before), "; ".join(after)


def _join(words: list[str]) -> str:
    """``shlex.join`` that leaves the ellipsis marking omitted words unquoted."""
    if words and words[0] == "…":
        return "… " + shlex.join(words[1:])
    return shlex.join(words)


def _render_value(value: Any) -> Any:
    if isinstance(value, list):
        return shlex.join(str(v) for v in value)
    return value


def _acts_on(weights: dict[str, float], phase_weights: dict[str, float]) -> str | None:
    """The phase a changed fact acts on, as far as its kind says (``ACTS_ON_*``): of the
    phases it acts on most, the one that moved most in the direction of the change; None
    where its kind names no phase."""
    top = max(weights.values())
    if top < ACTS_ON_WEIGHT or top < ACTS_ON_CONTRAST * min(weights.values()):
        return None
    return max((ph for ph in BREAKDOWN_KEYS if weights[ph] == top),
               key=lambda ph: phase_weights.get(ph, 0.0))


def _weight_key(item: dict[str, Any]) -> str:
    """The fact whose weights an item carries: a loader's row is its leading setting's."""
    settings = item.get("settings")
    return f"{item['key']}.{next(iter(settings))}" if settings else str(item["key"])


def _loader_text(settings: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in settings.items())


def _loader_items(changed: dict[str, list[dict[str, Any]]], fa: dict[str, Any],
                  fb: dict[str, Any], phase_weights: dict[str, float],
                  cpu_compute: bool) -> list[dict[str, Any]]:
    """One row per DataLoader whose settings differ (``changed``: its prefix -> the items of
    its settings that differ).

    A setting alone keeps its own row (``dataloader[0].num_workers``); several are one row
    of the loader, each as ``name=value``, the most telling first; a loader of one run only
    is one row, shown by its workers, batch size and dataset. An explorer's ``--workers 2``
    (a loader where the other run had none) had listed 13 rows, one per attribute."""
    out = []
    for prefix, fields in changed.items():
        in_a = any(k.startswith(prefix + ".") for k in fa)
        in_b = any(k.startswith(prefix + ".") for k in fb)
        if not (in_a and in_b):
            values = fa if in_a else fb
            shown = {f: values[f"{prefix}.{f}"][1] for f in LOADER_SHOWN
                     if f"{prefix}.{f}" in values}
            weights = _weights("dataloader", prefix, cpu_compute)
            text = _loader_text(shown) or "a DataLoader"
            out.append({"key": prefix, "category": "dataloader",
                        "a": text if in_a else "(none)", "b": text if in_b else "(none)",
                        "score": round(sum(weights[ph] * phase_weights.get(ph, 0.0)
                                           for ph in BREAKDOWN_KEYS), 4),
                        "acts_on": _acts_on(weights, phase_weights)})
            continue
        workers = [(f.get(f"{prefix}.num_workers") or (None, None))[1] for f in (fa, fb)]
        if all(isinstance(w, int) for w in workers) and (workers[0] == 0) != (workers[1] == 0):
            # what torch sets for a loader of no workers is not a setting of its own
            with_workers = 1 if workers[0] == 0 else 0
            fields = [it for it in fields if it["field"] not in WORKER_DEFAULTS or (
                (it["a"], it["b"])[with_workers] != WORKER_DEFAULTS[it["field"]])]
        if len(fields) == 1:
            out.append({k: v for k, v in fields[0].items() if k != "field"})
            continue
        if not fields:
            continue
        primary = {f.lstrip("."): i for i, f in enumerate(PRIMARY_DATALOADER)}
        fields.sort(key=lambda it: (-it["score"], primary.get(it["field"], len(primary)),
                                    it["field"]))
        settings = {it["field"]: [it["a"], it["b"]] for it in fields}
        out.append({"key": prefix, "category": "dataloader",
                    "a": _loader_text({k: v[0] for k, v in settings.items()}),
                    "b": _loader_text({k: v[1] for k, v in settings.items()}),
                    "settings": settings, "score": fields[0]["score"],
                    "acts_on": fields[0]["acts_on"]})
    return out


def environment_diff(
    a: Run, b: Run, phase_weights: dict[str, float], cpu_compute: bool
) -> tuple[list[dict[str, Any]], list[str]]:
    """The facts that differ between the runs, most likely explanation first (module docstring).

    Returns the ranked items and notes (a run without a fingerprint).
    """
    (fa, fp_a), (fb, fp_b) = _facts(a), _facts(b)
    notes = [f"run {side} has no environment fingerprint: only its settings and command line "
             "are compared" for side, has in (("A", fp_a), ("B", fp_b)) if not has]
    keys = set(fa) | set(fb) if fp_a and fp_b else set(fa) & set(fb)
    # how the model computed is known only where both runs had an op-count window
    keys = {k for k in keys if not k.startswith("model.") or (k in fa and k in fb)}
    items = []
    loaders: dict[str, list[dict[str, Any]]] = {}
    for key in sorted(keys):
        cat_a, va = fa.get(key, (None, None))
        cat_b, vb = fb.get(key, (None, None))
        if va == vb:
            continue
        category = cat_a or cat_b or "platform"
        weights = _weights(category, key, cpu_compute)
        score = sum(weights[ph] * phase_weights.get(ph, 0.0) for ph in BREAKDOWN_KEYS)
        item = {
            "key": key,
            "category": category,
            "a": _render_value(va),
            "b": _render_value(vb),
            "score": round(score, 4),
            "acts_on": _acts_on(weights, phase_weights),
        }
        if key == "command" and isinstance(va, list) and isinstance(vb, list):
            item["change_a"], item["change_b"] = _command_change(
                [str(v) for v in va], [str(v) for v in vb]
            )
        if category == "dataloader" and key.startswith("dataloader[") and "]." in key:
            prefix, field = key.split("].", 1)
            loaders.setdefault(prefix + "]", []).append({**item, "field": field})
            continue
        items.append(item)
    items += _loader_items(loaders, fa, fb, phase_weights, cpu_compute)
    order = {c: i for i, c in enumerate(CATEGORIES)}
    items.sort(key=lambda it: (-it["score"], order.get(it["category"], len(order)), it["key"]))
    for rank, it in enumerate(items, 1):
        it["rank"] = rank
    return items, notes


# --------------------------------------------------------------------------- the comparison


def _phase_totals(steady: np.ndarray, work: np.ndarray) -> dict[str, float | None]:
    """Seconds of each phase over the steady steps per unit of their ``work`` (a step, a
    sample, a GFLOP): the phases add up to the compared time per unit."""
    if len(steady) == 0:
        return dict.fromkeys(BREAKDOWN_KEYS)
    denom = float(work.sum())
    return {
        ph: sum(float(steady[f].sum()) for f in fields) / 1e9 / denom
        for ph, fields in PHASE_FIELDS.items()
    }


def per_unit(result: dict[str, Any]) -> str:
    """What one compared value is of: "sample", "GFLOP", "iteration" or "step" (the
    renderers' word)."""
    return {"time_per_sample": "sample", "time_per_flop": "GFLOP",
            "iteration_time": "iteration"}.get(str(result.get("metric")), "step")


def _training_steps(run: Run, steady: np.ndarray) -> np.ndarray:
    """The steady steps with each step's samples those of the training loader, as the run
    summary's samples/s counts them (:func:`trainprof.analysis.steps.training_samples`: an
    evaluation pass every N steps is not training work)."""
    kept, left_out = training_samples(steady["samples"], len(_dataloaders(run)))
    if not left_out:
        return steady
    out = steady.copy()
    out["samples"] = kept
    return out


def _flops_per_step(side: dict[str, Any]) -> float | None:
    value = (side.get("compute") or {}).get("flops_per_step")
    return float(value) if isinstance(value, int | float) and value > 0 else None


def _uses_gpu(run: Run) -> bool:
    fp = run.meta.get("fingerprint") or {}
    return bool(fp.get("gpus")) or bool(len(run.device))


def _attention(side_a: dict[str, Any], side_b: dict[str, Any], env: list[dict[str, Any]],
               cpu_compute: bool) -> dict[str, Any] | None:
    """Whether the runs' op-by-op attention times differ as a change of theirs: ``ratio``
    B / A where the attention ops differ (shapes, FLOPs) or a setting that acts on the
    model's math changed (weight :data:`MATH_WEIGHT`: the model's facts, a knob, torch or
    CUDA, the GPU, threads and the CPU on a CPU, compute packages); None otherwise.

    The time comes from the op count's window, two steps timed op by op, scaled to the
    steady forward and backward (analysis/attention.py): its split between ops has no
    replicate to tell its noise, and a window under other processes' load had read
    "attention op by op 420 µs → 6.4 ms ×15.4" for the same model with only a DataLoader
    setting changed. The same ops under the same settings compute the same way: their
    difference is the window's, and the steady phases, with their interval, say what changed.
    None where either run has no window."""
    x, y = side_a.get("attention_s_per_step"), side_b.get("attention_s_per_step")
    ops_a, ops_b = side_a.get("attention_ops"), side_b.get("attention_ops")
    if x is None or y is None or ops_a is None or ops_b is None:
        return None

    def signature(ops: list[dict[str, Any]]) -> list[str]:
        return sorted(repr(sorted(op.items())) for op in ops)

    same_ops = signature(ops_a) == signature(ops_b)
    math = [it["key"] for it in env if it["category"] != "dataloader" and max(
        _weights(it["category"], _weight_key(it), cpu_compute)[ph]
        for ph in ("forward", "backward")) >= MATH_WEIGHT]
    changed = not same_ops or bool(math)
    return {"same_ops": same_ops, "settings_changed": math,
            "ratio": y / x if changed and x and y else None}


def compare_runs(a: Run, b: Run) -> dict[str, Any]:
    """Compare run B against baseline A (see the module docstring for every definition).

    Returns a JSON-serialisable document: ``verdict`` (``faster``/``slower``/
    ``no_difference``/``insufficient_data``), ``ratio`` (B's time per unit of work over
    A's: ``mean_b / mean_a``), ``ci`` ([lo, hi], 95%), ``change_pct``, ``metric``, ``unit``,
    ``median_a``/``median_b``/``median_ratio`` (the secondary figure),
    ``phases``, ``explains``, ``throughput``, ``environment_diff`` (ranked), ``a``/``b``
    summaries and ``notes``.
    """
    sa, warm_a, count_a = _steady(a)
    sb, warm_b, count_b = _steady(b)
    notes: list[str] = []
    # a loop whose second optimizer steps once every k steps (a GAN's critic stepped k times
    # a generator step) has steps of two kinds: its iterations of k steps are compared
    ka = steps_per_iteration(a.meta.get("optimizers")) or 1
    kb = steps_per_iteration(b.meta.get("optimizers")) or 1
    by_iteration = ka > 1 or kb > 1
    side_a = _run_side(a, sa, warm_a, count_a)  # each side's own statistics: its steps'
    side_b = _run_side(b, sb, warm_b, count_b)
    sa, sb = _training_steps(a, sa), _training_steps(b, sb)
    if by_iteration:
        sa, sb = group_steps(sa, ka), group_steps(sb, kb)
        notes.append(
            ("an iteration of the loop is " + (f"{ka} steps in both runs" if ka == kb else
                                               f"{ka} step{'s' * (ka > 1)} in A and {kb} in B")
             + " (the script's other optimizer steps once an iteration): iterations are "
             "compared, not steps")
            + ("; the runs do different work per iteration, so a change is the algorithm's "
               "as much as the speed's" if ka != kb else ""))
    spa, spb = _samples_per_step(sa), _samples_per_step(sb)
    per_sample = (
        spa is not None and spb is not None and abs(spb - spa) > BATCH_TOLERANCE * spa
    )
    # the work a step does differs and no samples say how much (gradient accumulation in
    # a loop whose batches the capture does not count): the op count's FLOPs a step do.
    # Not for iterations of k steps: the window's two steps average steps of two kinds, and
    # an iteration (a generator step) is the unit there already
    fla, flb = _flops_per_step(side_a), _flops_per_step(side_b)
    per_flop = (not per_sample and not by_iteration and (spa is None or spb is None)
                and fla is not None and flb is not None
                and abs(flb - fla) > BATCH_TOLERANCE * fla)
    if per_sample:
        metric, unit = "time_per_sample", "s/sample"
        notes.append(
            f"the runs put different numbers of samples in a step ({spa:g} vs {spb:g}): "
            "time per sample is compared, not step time"
        )
        work_a, work_b = (x["samples"].astype(np.float64) for x in (sa, sb))
    elif per_flop:
        assert fla is not None and flb is not None
        metric, unit = "time_per_flop", "s/GFLOP"
        notes.append(
            f"B's steps do ×{flb / fla:.2f} the FLOPs of A's (the op count's window) and the "
            "runs count no samples a step: time per GFLOP is compared, not step time")
        work_a, work_b = np.full(len(sa), fla / 1e9), np.full(len(sb), flb / 1e9)
    else:
        metric, unit = (("iteration_time", "s/iteration") if by_iteration
                        else ("step_time", "s/step"))
        work_a, work_b = np.ones(len(sa)), np.ones(len(sb))
    da = sa["dur_ns"].astype(np.float64) / 1e9
    db = sb["dur_ns"].astype(np.float64) / 1e9
    # each step's time per unit: their median is the secondary figure
    with np.errstate(divide="ignore", invalid="ignore"):
        va, vb = da / work_a, db / work_b

    ratio = ci_lo = ci_hi = None
    verdict = "no_difference"
    significant = False
    mean_a = float(da.sum() / work_a.sum()) if len(da) else None
    mean_b = float(db.sum() / work_b.sum()) if len(db) else None
    median_a = float(np.median(va)) if len(va) else None
    median_b = float(np.median(vb)) if len(vb) else None
    median_ratio = (median_b / median_a if median_a and median_b is not None
                    and len(va) >= MIN_STEADY_STEPS and len(vb) >= MIN_STEADY_STEPS
                    else None)
    if len(va) < MIN_STEADY_STEPS or len(vb) < MIN_STEADY_STEPS:
        verdict = "insufficient_data"
        notes.append(
            f"too few steady steps to compare (A {len(va)}, B {len(vb)}; "
            f"at least {MIN_STEADY_STEPS} each): run longer"
        )
    elif mean_a and mean_b is not None:
        ratio = mean_b / mean_a
        ci_lo, ci_hi = bootstrap_ratio_ci(da, db, stat="rate", work_a=work_a, work_b=work_b)
        excludes_one = ci_lo > 1 or ci_hi < 1
        significant = bool(excludes_one and abs(ratio - 1) >= PRACTICAL_THRESHOLD)
        if significant:
            verdict = "slower" if ratio > 1 else "faster"
    if (significant and median_ratio is not None and ratio is not None
            and (median_ratio - 1) * (ratio - 1) < 0
            and abs(median_ratio - 1) >= PRACTICAL_THRESHOLD):
        # what the median alone had called the verdict (a --fail-if-slower failed on a 25%
        # speed-up: an evaluation interval raised, typical steps 11% slower)
        per = unit.split("/", 1)[1]
        notes.append(
            f"the median {per} changed {(median_ratio - 1) * 100:+.1f}% and the mean "
            f"{(ratio - 1) * 100:+.1f}%: typical steps and rare ones (an evaluation, a "
            "checkpoint, a stall) moved apart; the verdict is the mean's, what the run pays")

    pa = _phase_totals(sa, work_a)
    pb = _phase_totals(sb, work_b)
    total_a = sum(v for v in pa.values() if v is not None) if len(sa) else None
    total_b = sum(v for v in pb.values() if v is not None) if len(sb) else None
    total_delta = (
        total_b - total_a if total_a is not None and total_b is not None else None
    )
    if ratio is not None and ratio != 1:
        direction = 1.0 if ratio > 1 else -1.0
    else:
        direction = 1.0 if (total_delta or 0) >= 0 else -1.0
    phases: dict[str, dict[str, Any]] = {}
    for ph in BREAKDOWN_KEYS:
        x, y = pa[ph], pb[ph]
        delta = y - x if x is not None and y is not None else None
        phases[ph] = {
            "a": x,
            "b": y,
            "delta": delta,
            "delta_pct": (delta / x * 100) if delta is not None and x else None,
            "share_of_change": (delta / total_delta)
            if delta is not None and total_delta else None,
        }
    moved = {
        ph: max(0.0, direction * (v["delta"] or 0.0)) for ph, v in phases.items()
    }
    moved_total = sum(moved.values())
    explains = None
    if moved_total > 0 and total_delta:
        explains = max(moved, key=lambda ph: moved[ph])
        phase_weights = {ph: v / moved_total for ph, v in moved.items()}
    else:
        phase_weights = dict.fromkeys(BREAKDOWN_KEYS, 1 / len(BREAKDOWN_KEYS))

    cpu_compute = not (_uses_gpu(a) or _uses_gpu(b))
    thr = {
        "a_samples_per_s": side_a["samples_per_s"],
        "b_samples_per_s": side_b["samples_per_s"],
        "a_steps_per_s": side_a["steps_per_s"],
        "b_steps_per_s": side_b["steps_per_s"],
        "samples_per_s_ratio": (side_b["samples_per_s"] / side_a["samples_per_s"])
        if side_a["samples_per_s"] and side_b["samples_per_s"] else None,
    }
    # the slower run shared its machine with other processes' work, the other did not (by
    # half a core or more): that, more than any setting, is the likely cause
    loads = [side_a["system"].get("outside_load_cores"),
             side_b["system"].get("outside_load_cores")]
    load_change = None
    if significant and all(isinstance(x, int | float) for x in loads):
        slower_more = (loads[1] - loads[0]) if verdict == "slower" else (loads[0] - loads[1])
        if slower_more >= OUTSIDE_LOAD_CORES:
            load_change = {"a_cores": loads[0], "b_cores": loads[1]}
    for side, run, info in (("A", a, side_a), ("B", b, side_b)):
        if run.status != "finished":
            notes.append(f"run {side} is {run.status}: its last steps may be missing")
        load = info["system"].get("outside_load_cores")
        if isinstance(load, int | float) and load >= OUTSIDE_LOAD_CORES:
            notes.append(f"while run {side} ran, other processes kept ~{load:.1f} cores busy: "
                         "part of the difference may be the machine's, not the runs'")
    env, env_notes = environment_diff(a, b, phase_weights, cpu_compute)
    notes += env_notes
    likely = (likely_cause(env, phases, explains, load_change, cpu_compute, loads)
              if significant else None)
    attention = _attention(side_a, side_b, env, cpu_compute)
    return {
        "verdict": verdict,
        "significant": significant,
        "metric": metric,
        "unit": unit,
        "ratio": ratio,
        "change_pct": (ratio - 1) * 100 if ratio is not None else None,
        "ci": [ci_lo, ci_hi] if ci_lo is not None else None,
        "confidence": CONFIDENCE,
        "bootstrap": {"resamples": N_BOOT, "seed": SEED, "method": "moving-block percentile",
                      "statistic": "total time / total work"},
        "practical_threshold_pct": PRACTICAL_THRESHOLD * 100,
        # the compared statistic: the run's time per unit over its steady steps
        "statistic": "mean",
        "mean_a": mean_a,
        "mean_b": mean_b,
        # the secondary figure: the median step's (or sample's, GFLOP's) time
        "median_a": median_a,
        "median_b": median_b,
        "median_ratio": median_ratio,
        "mean_delta": total_delta,
        "phases": phases,
        "explains": explains,
        # other processes' load on the machine, when the slower run had clearly more of it
        "load_change": load_change,
        # what the headline names as the most likely cause (likely_cause)
        "likely_cause": likely,
        "throughput": thr,
        "compute_on": "cpu" if cpu_compute else "gpu",
        "environment_diff": env,
        # the op-by-op attention times, and whether their difference is a change (_attention)
        "attention": attention,
        "a": side_a,
        "b": side_b,
        "notes": notes,
    }


#: A changed setting acts directly on a phase from this weight on (``_weights``: a
#: DataLoader setting on data wait, the model's math on forward/backward, a knob anywhere).
DIRECT_WEIGHT = 0.8
#: ... and it is named before other processes' load when that phase is this much of the change.
DIRECT_SHARE = 0.5


def likely_cause(env: list[dict[str, Any]], phases: dict[str, Any], explains: str | None,
                 load_change: dict[str, Any] | None, cpu_compute: bool,
                 loads: list[Any] | None = None) -> dict[str, Any] | None:
    """The headline's most likely cause: the top-ranked changed fact, or other processes'
    load on the slower run's machine.

    Load comes first (it changes every phase and names no setting), unless the top fact
    acts directly on the phase that carries most of the change: ``num_workers`` 0 → 4 and
    data wait down 92% is the setting's doing, whatever the machine's load did besides
    (an explorer's compare had named the load, above the table that ranked the setting
    first). Then the load is named as well. None when the change has no explaining phase.
    Where both runs shared a busy machine (``loads``: other processes' cores, A and B), a
    setting named comes with that caveat (``both_loaded``): an explorer's ×10.7 had been
    "caused by" a command change that sped its code up.
    """
    top = env[0] if env else None
    if explains is None:
        return {"kind": "load", **load_change} if load_change else None
    share = (phases.get(explains) or {}).get("share_of_change")
    direct = bool(top) and _weights(top["category"], _weight_key(top), cpu_compute).get(
        explains, 0.0) >= DIRECT_WEIGHT and isinstance(share, int | float) and (
        share >= DIRECT_SHARE)
    if load_change and not direct:
        return {"kind": "load", **load_change}
    if top is None:
        return None
    cause = {"kind": "setting", "key": top["key"],
             "a": top.get("change_a", top.get("a")), "b": top.get("change_b", top.get("b")),
             "also_load": load_change}
    if loads and all(isinstance(x, int | float) and x >= OUTSIDE_LOAD_CORES for x in loads):
        cause["both_loaded"] = {"a_cores": loads[0], "b_cores": loads[1]}
    return cause


def exceeds_slowdown(result: dict[str, Any], pct: float) -> bool:
    """True when B is significantly slower than A (verdict ``slower``) by more than ``pct`` %.

    "By more than" is judged on the headline's figure, the ratio of the runs' time per unit
    of work (the median alone had failed a CI gate on a 25% speed-up); significance
    (interval excluding 1, change ≥ the practical threshold) is the verdict's.
    """
    ratio = result.get("ratio")
    return bool(
        result.get("verdict") == "slower" and ratio is not None and (ratio - 1) * 100 > pct
    )
