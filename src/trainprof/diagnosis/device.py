"""CUDA runs, without a trace: host-to-device copies, GPU idle between phases, memory, DataParallel.

These rules read what every CUDA run records, so they fire without ``--deep``:

* ``summary["device"]`` — device time per phase from CUDA events
  (:mod:`trainprof.capture.device_timer`, :mod:`trainprof.analysis.device`). Its
  ``gap`` is the device step minus the forward, backward and optimizer spans: stream
  time outside the training phases. Where the host keeps the GPU fed, that is only the
  little device work the loop does between phases (a functional loss, the batch
  copy); where it does not, it is the GPU waiting while the host waits for data,
  copies a pageable batch, logs, or runs Python between steps.
* ``summary["system"]["gpu"]`` — NVML samples per GPU over the steady steps: mean
  utilisation (share of time a kernel ran) and peak memory used / total.
* ``summary["cuda_memory"]`` — ``torch.cuda.memory_stats()`` read once when the run
  stops (allocator retries, OOMs, peak allocated and reserved bytes, per device).
* ``summary["forward_roots"]`` — the module classes timed as forward (``DataParallel``).
* ``summary["ops"]`` — the op sample's count of ``conv2d`` calls, and how many ran on
  channels_last tensors (:mod:`trainprof.capture.opcount`).

What a trace shows better (launch-bound kernels, the pageable copies themselves,
tensor cores) is left to :mod:`trainprof.diagnosis.trace_rules`: where the last
``--deep`` window already has a finding of the same category, these rules stay
silent, so that :func:`trainprof.analysis.deep.trace_findings` keeps the trace's
measured finding instead of dropping it for ours. No rule fires on a CPU run: each
needs CUDA-event records or allocator counters, which only a run that used CUDA has.

One bottleneck, one finding (expert-rules.md "Gaps" #3, TF's ladder). The device
gap is shared out: the data wait belongs to :mod:`.input_pipeline`, GC to
:mod:`.gc`, time blocked in syncs to :mod:`.sync` (which caps its own gain by the
gap), periodic work to :mod:`.periodic`; only the rest (:func:`idle_gap`) is
claimed here, once: by ``host_to_device`` when batches come from a DataLoader with
``pin_memory=False`` (the cheapest fix first, proved by one knob), else by
``host_launch``. When the input pipeline fires at all (data wait >= its 5% band),
neither does: on CUDA its finding already carries ``pin_memory=True``, and the
ladder fixes the input first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from trainprof.diagnosis.context import (
    SPIKE_ABS_S,
    SPIKE_REL,
    SPIKE_SIGMAS,
    Context,
    number,
    robust_scale,
)
from trainprof.diagnosis.finding import Finding, Fix, band
from trainprof.diagnosis.input_pipeline import MEDIUM as INPUT_MEDIUM
from trainprof.diagnosis.input_pipeline import loader_snippet
from trainprof.diagnosis.registry import rule

#: Bands on the idle device share (TF's host-bound bands, H1: >= 15% high, >= 3% moderate;
#: our medium is 5% because the device gap also holds the loop's own device work between
#: phases, a functional loss or metric, that TF's host-prepare time does not).
GAP_HIGH, GAP_MEDIUM, GAP_LOW = 0.15, 0.05, 0.02
#: Memory peak / capacity: near capacity (TB and HF, M1: > 90%) and under-used (a hint).
NEAR_CAPACITY, NEAR_CAPACITY_MEDIUM, UNDERUSED = 0.90, 0.95, 0.30
#: A "small" device step for the under-used hint: per-step costs that do not grow with the
#: batch (launches, the optimizer step) weigh most there.
SMALL_STEP_S = 0.10
#: Allocator retries per step: high at one every 10 steps, medium at one every 100.
RETRIES_HIGH, RETRIES_MEDIUM = 0.10, 0.01
#: The upper end of the channels_last speed-ups the PyTorch memory-format tutorial reports
#: for AMP conv nets on a V100 (8-35%, ResNet-50 22%); Composer reports ~30% on V100/A100.
CHANNELS_LAST_SPEEDUP = 1.35

GIB = 1024**3


# -- shared views of the summary ----------------------------------------------------------------


def _device(ctx: Context) -> dict[str, Any]:
    dev = ctx.summary.get("device")
    return dev if isinstance(dev, dict) else {}


def device_breakdown(ctx: Context) -> dict[str, float]:
    """Device-time shares per phase (``forward``, ``backward``, ``optimizer``, ``gap``)."""
    bd = _device(ctx).get("breakdown")
    return {k: float(v) for k, v in bd.items() if number(v) is not None} if isinstance(
        bd, dict) else {}


def cuda_devices(ctx: Context) -> list[dict[str, Any]]:
    """The allocator counters per device (``cuda_memory.devices``), if recorded."""
    cm = ctx.summary.get("cuda_memory")
    devices = cm.get("devices") if isinstance(cm, dict) else None
    return [d for d in devices or [] if isinstance(d, dict)]


def used_cuda(ctx: Context) -> bool:
    """The run put work on a CUDA device: CUDA-event records or allocator counters exist.

    Stricter than :attr:`Context.on_cuda`, which is also true for a CPU-only script run
    on a machine with a GPU: NVML then samples GPUs the run never touched.
    """
    return bool(device_breakdown(ctx)) or bool(cuda_devices(ctx))


def _gpus(ctx: Context) -> list[dict[str, Any]]:
    return [g for g in ctx.system.get("gpu") or [] if isinstance(g, dict)]


def input_share(ctx: Context) -> float:
    """The data wait share :mod:`.input_pipeline` judges (periodic steps' waits left out)."""
    share = float(number(ctx.breakdown.get("data_wait")) or 0.0)
    periodic = ctx.periodic
    if periodic is not None and ctx.total_s > 0:
        share -= periodic.excess_s["data_wait"] / ctx.total_s
    return max(0.0, share)


def _pct(x: float) -> str:
    return f"{x * 100:.0f}%" if x >= 0.095 else f"{x * 100:.1f}%"


def _run_dir(ctx: Context) -> str:
    return str(ctx.summary.get("run_dir") or "RUN_DIR")


def _compare(ctx: Context, other: str = "NEW_RUN") -> str:
    """The verify line's comparison of this run with the next one."""
    return f"trainprof compare {_run_dir(ctx)} {other}"


def _expandable_run(ctx: Context) -> str:
    """The run again with the allocator's expandable segments (memory verify lines)."""
    return f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True trainprof run {ctx.script}"


def _batch(ctx: Context) -> int | None:
    loader = ctx.train_loader or {}
    bs = loader.get("batch_size")
    if bs is None:  # a batch_sampler passed in (Hugging Face's Trainer): its batch size
        bs = loader.get("batch_sampler_batch_size")
    return bs if isinstance(bs, int) and not isinstance(bs, bool) and bs > 0 else None


def _by_trainer(ctx: Context) -> bool:
    """The loader is built by Hugging Face's Trainer: fixes go in its TrainingArguments."""
    return (ctx.train_loader or {}).get("driven_by") == "transformers.Trainer"


def _batch_line(ctx: Context, size: str, comment: str) -> str:
    """The line that sets the batch size: the DataLoader call's, or the Trainer's argument."""
    if _by_trainer(ctx):
        return f"args = TrainingArguments(..., per_device_train_batch_size={size})  # {comment}"
    return f"loader = DataLoader(..., batch_size={size})  # {comment}"


# -- the device gap, shared out ---------------------------------------------------------------


@dataclass
class IdleGap:
    """The device gap, what other families own of it, and what is left for this one."""

    gap: float
    owned: dict[str, float] = field(default_factory=dict)
    gpu_util: float | None = None  # busiest GPU's mean NVML utilisation, as a fraction

    @property
    def excess(self) -> float:
        """Gap share not explained by data waits, GC, syncs or periodic work."""
        return max(0.0, self.gap - sum(self.owned.values()))

    @property
    def gain(self) -> float:
        """The excess, capped by the time no kernel ran (NVML): device work is not idle."""
        if self.gpu_util is None:
            return self.excess
        return min(self.excess, max(0.0, 1.0 - self.gpu_util))

    def evidence(self, ctx: Context) -> dict[str, Any]:
        ev: dict[str, Any] = {
            "device_gap_share": self.gap,
            "device_idle_unexplained": self.gain,
            "host_other_share": ctx.breakdown.get("other"),
            "device_step_median_s": _device(ctx).get("median_step_s"),
            "step_median_s": ctx.step_info.get("median_s"),
        }
        ev.update({f"gap_owned_by_{k}": v for k, v in self.owned.items() if v > 0})
        if self.gpu_util is not None:
            ev["gpu_util"] = self.gpu_util
        return ev


def idle_gap(ctx: Context) -> IdleGap | None:
    """The device gap share, less what other families already claim (module docstring).

    Shares of the device step and of the host step are compared directly: in steady
    state the device completes steps at the host's rate, so both describe the same time.
    """
    gap = device_breakdown(ctx).get("gap")
    if gap is None:
        return None
    owned = {
        # all of it: input_pipeline owns the steady waits, periodic those in its steps
        "data_wait": float(number(ctx.breakdown.get("data_wait")) or 0.0),
        "gc": float(number(ctx.breakdown.get("gc")) or 0.0),
        "syncs": float(number((ctx.summary.get("syncs") or {}).get("share")) or 0.0),
    }
    periodic = ctx.periodic
    if periodic is not None and ctx.total_s > 0:  # evaluation/checkpointing between steps
        owned["periodic"] = periodic.excess_s["other"] / ctx.total_s
    utils = [u for g in _gpus(ctx) if (u := number(g.get("util_pct"))) is not None]
    # The busiest GPU (the run's, when NVML sees other idle GPUs): the smallest idle cap.
    util = max(utils) / 100 if utils else None
    return IdleGap(gap=gap, owned=owned, gpu_util=util)


def _gap_owner_ok(ctx: Context, category: str) -> IdleGap | None:
    """The idle gap, if this CUDA run's gap is ours to report under ``category``."""
    if not used_cuda(ctx) or input_share(ctx) >= INPUT_MEDIUM:
        return None
    if category in ctx.deep_categories:
        return None  # the deep window's trace measured it: its finding stands
    return idle_gap(ctx)


# -- 1. host_to_device: pageable batches ------------------------------------------------------


@rule("device.pageable_batches")
def pageable_batches(ctx: Context) -> Finding | None:
    """Batches from a ``pin_memory=False`` DataLoader while the GPU idles outside the phases.

    Sources (expert-rules.md): T1 — an async copy from pageable memory silently becomes
    synchronous (Nsight Systems, the PyTorch tuning guide, HF, TF); T2 — synchronous
    copies (Nsight Systems). CUDA's API-sync rules: a copy from pageable host memory is
    staged through a pinned buffer, and the driver may synchronise with the stream to
    do it, so the host cannot run ahead and the GPU waits while the host prepares the
    next work. The copy and that wait both land in the device gap, so the gain is the
    gap share left after the other owners (:func:`idle_gap`), capped by the time no
    kernel ran. The trace-level rule measures the copies themselves (``--deep``).
    """
    g = _gap_owner_ok(ctx, "host_to_device")
    loader = ctx.train_loader
    if g is None or loader is None or loader.get("pin_memory") is not False:
        return None
    severity = band(g.gain, GAP_HIGH, GAP_MEDIUM, GAP_LOW)
    if severity is None:
        return None
    nw = int(loader.get("num_workers") or 0)
    evidence = g.evidence(ctx)
    evidence["loader"] = {k: loader.get(k) for k in ("index", "dataset", "batch_size",
                                                     "num_workers", "pin_memory")}
    snippet = (
        loader_snippet(loader, num_workers=nw, pin_memory=True, comment="unchanged")
        + "\nfor x, y in loader:\n"
        "    # from pinned memory a copy is asynchronous: the host queues it and runs on\n"
        "    x = x.to(device, non_blocking=True)\n"
        "    y = y.to(device, non_blocking=True)"
    )
    text = (
        f"The DataLoader hands out batches in pageable memory (pin_memory=False), so each "
        f"copy to the GPU is staged through a pinned buffer and may block the host, and the "
        f"GPU sits idle {_pct(g.gain)} of the step outside forward/backward/optimizer "
        "(data waits, GC and syncs not counted). Pin the batches in the DataLoader and copy "
        "them with non_blocking=True. If pinning does not close the gap, the rest is host "
        "work between the phases (logging, metrics, Python): `trainprof run --py` shows it."
    )
    tune = f"trainprof tune --knob pin_memory=false,true {ctx.script}"
    return Finding(
        category="host_to_device",
        cause="pageable_batches",
        title=(
            f"Batches reach the GPU from pageable memory (pin_memory=False): the GPU idles "
            f"{_pct(g.gain)} of each step between the training phases"
        ),
        severity=severity,
        evidence=evidence,
        estimated_gain=g.gain,
        fix=Fix(text=text, snippet=snippet),
        verify=(
            f"{tune} (add non_blocking=True to the .to() calls first): the device gap (now "
            f"{_pct(g.gap)} of the device step) should shrink and the step with it"
        ),
        verify_commands=(tune,),
    )


# -- 2. host_launch: the GPU idles between phases ---------------------------------------------


@rule("device.idle_between_phases")
def idle_between_phases(ctx: Context) -> Finding | None:
    """The GPU idles between the training phases while the host prepares the next work.

    Sources (expert-rules.md): H1 — host-bound / kernel-launch bound (TF's host-prepare
    bands, NVIDIA's ``cudaLaunchKernel`` share; fixes: larger batch, fusion,
    ``torch.compile``, CUDA graphs); H3 — NVIDIA's "GPU idle gaps > 30% of step with no
    comm/sync cause → host-bound" and HTA's host-wait idle; H6 — per-step host extras
    (callbacks, metrics, logging) between steps; S5 — low GPU time-utilisation.

    Measured: the device gap (device step minus the phase spans, CUDA events) less the
    shares other families own (:func:`idle_gap`), capped by ``1 - NVML utilisation``
    (a busy GPU is not idle, whatever our markers say). Idle time *inside* a phase
    (launch-bound kernels) is not in the gap: the trace rule finds that from ``--deep``.
    Yields to :func:`pageable_batches` when batches come unpinned, to the input
    pipeline when the loop waits for data, and to :func:`data_parallel` (one process
    driving several GPUs is the host bound; the gap joins that finding's evidence).
    """
    g = _gap_owner_ok(ctx, "host_launch")
    if g is None or _data_parallel(ctx) is not None:
        return None  # with DataParallel on several GPUs, its one process is the host bound
    loader = ctx.train_loader
    if loader is not None and loader.get("pin_memory") is False:
        return None  # pageable_batches owns the gap (the ladder: cheapest fix first)
    severity = band(g.gain, GAP_HIGH, GAP_MEDIUM)
    if severity is None:
        return None
    bs = _batch(ctx)
    other = float(number(ctx.breakdown.get("other")) or 0.0)
    text = (
        f"Between optimizer.step() and the next forward the GPU has nothing to run for "
        f"{_pct(g.gain)} of the step (the host spends {_pct(other)} of its step outside the "
        "training phases, data waits not counted): the host, not the GPU, sets the pace. "
        "Make the per-step host work cheaper or rarer (logging and metrics every N steps, "
        "kept on the GPU in between), and launch fewer, larger kernels per step: "
        'torch.compile(model, mode="reduce-overhead") captures the step in CUDA graphs, '
        "fused optimizers do one launch for all parameters, and a larger batch does more "
        "work per launch. `trainprof run --py` shows where the host's time goes."
    )
    lines = [
        'model = torch.compile(model, mode="reduce-overhead")  # CUDA graphs: fewer launches',
        "opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)  # one launch",
    ]
    if bs:
        lines.append(_batch_line(ctx, str(2 * bs), f"was {bs}: more work per launch"))
    lines += [
        'running = torch.zeros((), device="cuda")',
        "for step, (x, y) in enumerate(loader):",
        "    ...",
        "    running += loss.detach()  # no per-step host work or sync",
        "    if step % 50 == 0:",
        "        log(running.item() / 50)",
        "        running.zero_()",
    ]
    commands = (f"trainprof run --py {ctx.script}", _compare(ctx))
    verify = (
        f"`{commands[0]}` names the host work between steps; after the change, "
        f"`{commands[1]}`: the device gap (now {_pct(g.gap)}) and the step time should fall"
    )
    if bs:
        tune = f"trainprof tune --knob batch_size={bs},{2 * bs},{4 * bs} {ctx.script}"
        verify = f"{tune} (time per sample falls if the host sets the pace); then " + verify
        commands = (tune, *commands)
    return Finding(
        category="host_launch",
        cause="device_idle_between_phases",
        title=(
            f"The GPU idles {_pct(g.gain)} of each step between the training phases "
            "while the host prepares the next work"
        ),
        severity=severity,
        evidence=g.evidence(ctx),
        estimated_gain=g.gain,
        fix=Fix(text=text, snippet="\n".join(lines)),
        verify=verify,
        verify_commands=commands,
    )


# -- 3, 4. memory ----------------------------------------------------------------------------


@dataclass
class MemoryPeak:
    ratio: float  # peak / capacity of the fullest device
    used_bytes: float
    total_bytes: float
    source: str  # "nvml" (all processes, the CUDA context) or "torch" (reserved by PyTorch)
    index: int | None


def memory_peak(ctx: Context) -> MemoryPeak | None:
    """The fullest device's memory peak, from NVML samples or PyTorch's reserved peak.

    NVML's "used" counts the CUDA context and other processes too, which count against
    capacity; PyTorch's reserved peak is what its caching allocator held. The larger
    ratio of the two is the one that decides how close to OOM the run came. NVML sees
    every GPU of the machine, numbered apart from ``CUDA_VISIBLE_DEVICES``: when it sees
    more GPUs than the run allocated on, another job's full GPU must not count, so only
    PyTorch's counters are used.
    """
    best: MemoryPeak | None = None
    used_devices = cuda_devices(ctx)
    nvml = _gpus(ctx)
    if used_devices and len(nvml) > len(used_devices):
        nvml = []
    for g in nvml:
        used, total = number(g.get("mem_used_bytes")), number(g.get("mem_total_bytes"))
        if used is not None and total and (best is None or used / total > best.ratio):
            best = MemoryPeak(used / total, used, total, "nvml", g.get("index"))
    for d in used_devices:
        used, total = number(d.get("reserved_bytes.all.peak")), number(d.get("total_bytes"))
        if used is not None and total and (best is None or used / total > best.ratio):
            best = MemoryPeak(used / total, used, total, "torch", d.get("index"))
    return best


def _memory_evidence(ctx: Context, peak: MemoryPeak) -> dict[str, Any]:
    ev: dict[str, Any] = {
        "memory_peak_share": peak.ratio,
        "memory_peak_gib": peak.used_bytes / GIB,
        "memory_total_gib": peak.total_bytes / GIB,
        "memory_source": peak.source,
        "device_index": peak.index,
    }
    for d in cuda_devices(ctx)[:4]:
        for key in ("num_alloc_retries", "num_ooms", "allocated_bytes.all.peak",
                    "reserved_bytes.all.peak"):
            v = number(d.get(key))
            if v is not None and key.endswith(".peak"):
                ev[f"cuda{d.get('index')}.{key.split('_bytes')[0]}_peak_gib"] = v / GIB
            elif v is not None:
                ev[f"cuda{d.get('index')}.{key}"] = int(v)
    if ctx.environment.get("gpu"):
        ev["gpu"] = ctx.environment["gpu"]
    return ev


def _memory_snippet(script: str, bs: int | None, trainer: bool = False) -> str:
    half = max(1, bs // 2) if bs else None
    lines = [
        "# 1. let the caching allocator grow segments instead of fragmenting fixed ones",
        f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python {script}",
        "",
        "# 2. half the batch per step, the same batch per update by accumulation",
    ]
    if trainer:  # Hugging Face's Trainer accumulates itself
        lines += [
            "args = TrainingArguments(",
            "    ...,  # your arguments, unchanged",
            f"    per_device_train_batch_size={half if half else 'B // 2'},"
            + (f"  # was {bs}" if bs else ""),
            "    gradient_accumulation_steps=2,",
            ")",
        ]
    else:
        lines += [
            f"loader = DataLoader(..., batch_size={half})  # was {bs}" if bs
            else "loader = DataLoader(..., batch_size=B // 2)",
            "accum = 2",
            "for i, (x, y) in enumerate(loader):",
            "    loss = criterion(model(x), y) / accum",
            "    loss.backward()",
            "    if (i + 1) % accum == 0:",
            "        opt.step()",
            "        opt.zero_grad(set_to_none=True)",
        ]
    lines += [
        "",
        "# 3. or recompute a block's activations in backward instead of keeping them",
        "from torch.utils.checkpoint import checkpoint",
        "h = checkpoint(block, h, use_reentrant=False)",
    ]
    return "\n".join(lines)


def _retries(ctx: Context) -> tuple[int, int]:
    """(allocator retries, OOMs) summed over the devices the run allocated on."""
    devs = cuda_devices(ctx)
    r = sum(int(number(d.get("num_alloc_retries")) or 0) for d in devs)
    o = sum(int(number(d.get("num_ooms")) or 0) for d in devs)
    return r, o


@rule("device.allocator_retries")
def allocator_retries(ctx: Context) -> Finding | None:
    """The caching allocator ran out of cached memory and had to free and retry.

    Sources (expert-rules.md): M1 — near OOM (TB, HF, the tuning guide: checkpointing,
    accumulation, AMP); M2 — allocator churn and fragmentation (the tuning guide). A
    retry (``num_alloc_retries``, ``torch.cuda.memory_stats``) happens when
    ``cudaMalloc`` fails: the allocator frees every cached unused block (``cudaFree``
    synchronises the device) and tries again, so the step stalls and later allocations
    pay ``cudaMalloc`` again. Counters are read once at the end of the run.

    The retries are not timed. The gain is bounded from the step times: a retry either
    made its step an outlier (counted in the stray spikes' excess time) or cost less
    than the outlier threshold (``max(5 sigma, 0.5 x median, 0.5 ms)``); so at most
    ``stray excess + quiet retries x threshold``. When retries happen in most steps the
    cost sits inside the median step itself and this is an estimate, not a bound.
    Severity follows the retry rate.
    """
    if not used_cuda(ctx):
        return None
    retries, ooms = _retries(ctx)
    if retries <= 0:
        return None
    steps = int(number(ctx.step_info.get("count")) or 0)
    rate = retries / steps if steps else float(retries)
    severity = "high" if rate >= RETRIES_HIGH else "medium" if rate >= RETRIES_MEDIUM else "low"
    if ooms > 0 and severity == "low":
        severity = "medium"
    gain = 0.0
    if ctx.has_steps() and ctx.total_s > 0:
        med, sigma = robust_scale(ctx.durations)
        threshold = max(SPIKE_SIGMAS * sigma, SPIKE_REL * med, SPIKE_ABS_S)
        stray = ctx.spike_groups.get("stray")
        stray_s = sum(stray.excess_s.values()) if stray is not None else 0.0
        n_stray = len(stray.indices) if stray is not None else 0
        quiet = max(0, min(retries, len(ctx.durations)) - n_stray)
        gain = min(1.0, (stray_s + quiet * threshold) / ctx.total_s)
    peak = memory_peak(ctx)
    evidence: dict[str, Any] = {
        "alloc_retries": retries,
        "retries_per_step": rate,
        "ooms": ooms,
        "steps": steps,
    }
    if peak is not None:
        evidence.update(_memory_evidence(ctx, peak))
    near = f" at {_pct(peak.ratio)} of the GPU's memory" if peak is not None else ""
    text = (
        f"PyTorch's caching allocator ran out of cached memory {retries} times in {steps} "
        f"steps{near}: each time it freed all its cached blocks (cudaFree synchronises the "
        "GPU) and asked the driver again, stalling the step. Give it headroom: expandable "
        "segments fight fragmentation; a smaller batch with gradient accumulation, "
        "activation checkpointing or mixed precision lower the peak. Variable input shapes "
        "(sequence lengths) fragment the cache: pad to a few fixed sizes."
    )
    if ooms:
        text += f" {ooms} allocations failed outright (OOM) and were caught by the script."
    return Finding(
        category="memory",
        cause="allocator_retries",
        title=(
            f"The CUDA caching allocator had to free its cache and retry {retries} times "
            f"({rate:.2g} per step){near}"
        ),
        severity=severity,
        evidence=evidence,
        estimated_gain=gain,
        fix=Fix(text=text, snippet=_memory_snippet(ctx.script, _batch(ctx), _by_trainer(ctx))),
        verify=(
            f"{_expandable_run(ctx)}, then `{_compare(ctx)}`: num_alloc_retries in run.json's "
            f"cuda_memory (now {retries}) should be 0 and the slow steps gone"
        ),
        verify_commands=(_expandable_run(ctx), _compare(ctx)),
    )


@rule("device.memory_near_capacity")
def memory_near_capacity(ctx: Context) -> Finding | None:
    """GPU memory peak >= 90% of capacity (TB/HF, expert-rules.md M1): close to OOM.

    No slowdown is measured (without retries the allocator served every request from
    its cache), so the gain is 0: it is a risk — the next longer sequence or larger
    evaluation batch fails, and fragmentation turns into retries. When retries did
    happen, :func:`allocator_retries` owns the symptom and carries these numbers.
    """
    if not used_cuda(ctx) or _retries(ctx)[0] > 0:
        return None
    peak = memory_peak(ctx)
    if peak is None or peak.ratio < NEAR_CAPACITY:
        return None
    severity = "medium" if peak.ratio >= NEAR_CAPACITY_MEDIUM else "low"
    evidence = _memory_evidence(ctx, peak)
    counters = bool(cuda_devices(ctx))
    text = (
        f"The run peaked at {peak.used_bytes / GIB:.1f} of {peak.total_bytes / GIB:.1f} GiB "
        f"({_pct(peak.ratio)}). "
        + ("The allocator has not had to retry yet, " if counters
           else "The allocator's retry counter was not recorded, ")
        + "but a longer sequence, a larger evaluation batch or fragmentation will push it "
        "into retries (each frees the cache and synchronises) or an OOM. Make headroom."
    )
    return Finding(
        category="memory",
        cause="near_capacity",
        title=f"GPU memory peaks at {_pct(peak.ratio)} of capacity: close to out-of-memory",
        severity=severity,
        evidence=evidence,
        estimated_gain=0.0,
        fix=Fix(text=text, snippet=_memory_snippet(ctx.script, _batch(ctx), _by_trainer(ctx))),
        verify=(
            f"{_expandable_run(ctx)}, then `{_compare(ctx)}`: the GPU memory peak (now "
            f"{_pct(peak.ratio)}) should fall with the step time unchanged"
        ),
        verify_commands=(_expandable_run(ctx), _compare(ctx)),
    )


@rule("device.memory_underused")
def memory_underused(ctx: Context) -> Finding | None:
    """A hint: a compute-bound small step that uses < 30% of the GPU's memory.

    Sources (expert-rules.md): C9 — GPU under-filled → increase the batch size (TB, TF,
    HF; TB warns that it may affect convergence); S5 — TB suggests a bigger batch for
    low GPU utilisation. Fires only when the GPU is the limit (data wait < 5%, and an
    idle gap too small for :func:`idle_between_phases`) and a device step is short
    (< 100 ms), where per-step costs that do not grow with the batch weigh most.

    Gain, per sample, from doubling the batch: at least half the optimizer's device
    share (the optimizer step's work does not depend on the batch); kernels too small
    to fill the GPU may add more, which only the batch-size sweep shows. Always low.
    """
    if not used_cuda(ctx) or input_share(ctx) >= INPUT_MEDIUM:
        return None
    peak = memory_peak(ctx)
    bd = device_breakdown(ctx)
    dev_step = number(_device(ctx).get("median_step_s"))
    if peak is None or peak.ratio >= UNDERUSED or not bd or dev_step is None:
        return None
    g = idle_gap(ctx)
    if g is None or g.gain >= GAP_MEDIUM or dev_step >= SMALL_STEP_S:
        return None  # the GPU idles (host_launch's finding), or a long step already fills it
    gain = float(bd.get("optimizer") or 0.0) / 2
    bs = _batch(ctx)
    factor = 2
    while factor < 4 and peak.ratio * factor * 2 <= 0.8:
        factor *= 2
    evidence = _memory_evidence(ctx, peak)
    evidence.update(device_gap_share=bd.get("gap"), device_step_median_s=dev_step,
                    device_optimizer_share=bd.get("optimizer"), batch_size=bs)
    text = (
        f"The GPU does the work of each step ({dev_step * 1e3:.1f} ms) with little idle time "
        f"but uses only {_pct(peak.ratio)} of its memory: the batch may be too small to fill "
        "it. A larger batch does more work per launch and amortises the optimizer step. "
        "It also changes the optimisation: scale the learning rate (linearly, with warm-up) "
        "and check that the loss curve still matches."
    )
    size, times = (str(bs * factor), factor) if bs else ("2 * B", 2)
    if _by_trainer(ctx):
        snippet = (
            "args = TrainingArguments(\n    ...,  # your arguments, unchanged\n"
            f"    per_device_train_batch_size={size},  # was {bs or 'B'}\n"
            f"    learning_rate={times} * base_lr,  # linear scaling rule\n"
            "    warmup_ratio=0.05,  # with a warm-up\n)"
        )
    else:
        snippet = (f"loader = DataLoader(..., batch_size={size})  # was {bs or 'B'}\n"
                   f"lr = base_lr * {times}  # linear scaling rule, with a warm-up")
    sizes = ",".join(str(bs * k) for k in (1, 2, 4) if k <= factor) if bs else None
    command = (f"trainprof tune --knob batch_size={sizes} {ctx.script}" if sizes
               else _compare(ctx))
    verify = (f"{command}: time per sample should fall" if sizes else
              f"re-run with a larger batch and `{command}`: samples per second should rise")
    return Finding(
        category="memory",
        cause="underused",
        title=(
            f"GPU memory peaks at only {_pct(peak.ratio)} of capacity on a short, "
            "GPU-bound step: a larger batch may use the GPU better"
        ),
        severity="low",
        evidence=evidence,
        estimated_gain=gain,
        fix=Fix(text=text, snippet=snippet),
        verify=verify,
        verify_commands=(command,),
    )


# -- 5. distributed: DataParallel -------------------------------------------------------------


def _data_parallel(ctx: Context) -> tuple[str, int] | None:
    """(the DataParallel root class, GPUs seen) when a CUDA run drives 2+ GPUs through it."""
    roots = ctx.summary.get("forward_roots") or []
    dp = [r for r in roots if isinstance(r, str) and r.rsplit(".", 1)[-1] == "DataParallel"]
    if not dp or not used_cuda(ctx):
        return None
    count = max(int(number(ctx.environment.get("gpu_count")) or 0), len(_gpus(ctx)))
    # over one GPU DataParallel calls the module directly: no cost to remove
    return (dp[0], count) if count >= 2 else None


@rule("device.data_parallel")
def data_parallel(ctx: Context) -> Finding | None:
    """``torch.nn.DataParallel`` on more than one GPU (expert-rules.md D2: TB, the tuning guide).

    DataParallel drives every GPU from one Python process: each step it replicates the
    model, scatters the batch, runs the replicas in threads that contend for the GIL,
    gathers the outputs on GPU 0 and reduces the gradients there. DDP runs one process
    per GPU and overlaps the gradient all-reduce with backward; PyTorch recommends it
    even on one machine. Gain: the GPUs' idle share (``1 - mean NVML utilisation`` over
    the GPUs in use), what one process per GPU can at best reclaim; without NVML, the
    device gap share.
    """
    found = _data_parallel(ctx)
    if found is None:
        return None
    root, count = found
    gpus = _gpus(ctx)
    active = [g for g in gpus if (number(g.get("util_pct")) or 0) > 0 or (
        (number(g.get("mem_used_bytes")) or 0)
        > 0.05 * (number(g.get("mem_total_bytes")) or math.inf))]
    utils = [u for g in active or gpus if (u := number(g.get("util_pct"))) is not None]
    n = len(active) if len(active) >= 2 else count
    evidence: dict[str, Any] = {"forward_root": root, "gpus": count, "gpus_in_use": n}
    gap = device_breakdown(ctx).get("gap")
    if gap is not None:
        evidence["device_gap_share"] = gap  # the current GPU's idle between phases, too
    if utils:
        mean = sum(utils) / len(utils) / 100
        gain = 1.0 - mean
        evidence["gpu_util_mean"] = mean
        evidence["gpu_util"] = [u / 100 for u in utils]
    else:
        gain = float(gap or 0.0)
    severity = band(gain, 0.20, 0.05) or "low"
    bs = _batch(ctx)
    per = max(1, bs // n) if bs else None
    snippet = "\n".join([
        f"# torchrun --nproc_per_node={n} {ctx.script}",
        "import os",
        "import torch.distributed as dist",
        "from torch.nn.parallel import DistributedDataParallel as DDP",
        "from torch.utils.data.distributed import DistributedSampler",
        "",
        'dist.init_process_group("nccl")',
        'rank = int(os.environ["LOCAL_RANK"])',
        "torch.cuda.set_device(rank)",
        "model = DDP(model.to(rank), device_ids=[rank])  # was nn.DataParallel(model)",
        "sampler = DistributedSampler(dataset)",
        (f"loader = DataLoader(dataset, batch_size={per}, sampler=sampler, ...)"
         f"  # {bs} per step over {n} processes") if per else
        "loader = DataLoader(dataset, batch_size=B // n_gpus, sampler=sampler, ...)",
        "for epoch in range(epochs):",
        "    sampler.set_epoch(epoch)",
        "    ...",
    ])
    sps = number(ctx.summary.get("samples_per_s"))
    util_txt = (f" The GPUs were busy {evidence['gpu_util_mean'] * 100:.0f}% of the time on "
                "average." if "gpu_util_mean" in evidence else "")
    return Finding(
        category="distributed",
        cause="data_parallel",
        title=f"nn.DataParallel drives {n} GPUs from one process: use DistributedDataParallel",
        severity=severity,
        evidence=evidence,
        estimated_gain=gain,
        fix=Fix(
            text=(
                "DataParallel runs one Python process for all GPUs: every step it copies the "
                "model to each GPU, splits the batch, runs the replicas in threads that "
                "compete for the GIL, and gathers outputs and gradients on GPU 0, which "
                f"then works more than the others.{util_txt} DistributedDataParallel runs "
                "one process per GPU and overlaps the gradient all-reduce with backward; "
                "keep the global batch the same by splitting it over the processes."
            ),
            snippet=snippet,
        ),
        verify=(
            f"run the DDP version under torchrun and compare its global samples per second "
            f"(per-rank samples/s x {n}) with this run's"
            + (f" ({sps:.1f} samples/s)" if sps else "")
            + f": `{_compare(ctx, 'RANK0_RUN')}`"
        ),
        verify_commands=(_compare(ctx, "RANK0_RUN"),),
    )


# -- 6. compute: channels_last -----------------------------------------------------------------


@rule("device.cudnn_benchmark")
def cudnn_benchmark(ctx: Context) -> Finding | None:
    """Convolutions on a GPU with cuDNN's autotuner off (expert-rules.md C8: the PyTorch
    tuning guide, "enable cuDNN auto-tuner" for fixed input shapes).

    Evidence: the op sample's ``conv2d`` calls per step and the fingerprint's
    ``torch.backends.cudnn.benchmark`` (read after the script's first step, so its own
    setting counts). No source publishes a speed-up, and it depends on the shapes (a
    shape that changes every batch is timed anew each time): the finding claims none
    (``gain_unknown``) and is low; ``trainprof tune --knob cudnn_benchmark=false,true``
    measures it. Left alone with ``cudnn.deterministic`` on (reproducibility asked for).
    """
    ops = ctx.summary.get("ops")
    env = ctx.environment
    if not isinstance(ops, dict) or not used_cuda(ctx):
        return None
    conv = number(ops.get("conv2d_per_step")) or 0.0
    if conv <= 0 or env.get("cudnn_benchmark") is not False or env.get("cudnn_deterministic"):
        return None
    tune = f"trainprof tune --knob cudnn_benchmark=false,true {ctx.script}"
    return Finding(
        category="compute",
        cause="cudnn_benchmark_off",
        title=(f"{conv:.0f} convolutions per step run with cuDNN's autotuner off "
               "(torch.backends.cudnn.benchmark = False)"),
        severity="low",
        evidence={"conv2d_per_step": conv, "cudnn_benchmark": False,
                  "gpu": env.get("gpu"), "gain_unknown": True},
        estimated_gain=0.0,
        fix=Fix(
            text=(
                "With benchmark off, cuDNN picks each convolution's algorithm by a "
                "heuristic. With it on, the first call of each input shape times the "
                "candidate algorithms and the fastest is kept for every later call: "
                "worth it when the shapes stay fixed (images of one size, a fixed batch), "
                "not when they change every batch (each new shape is timed again). The "
                "first steps get slower while it times them."
            ),
            snippet="torch.backends.cudnn.benchmark = True  # before the training loop",
        ),
        verify=(f"{tune}  (steps past the first few: the forward and backward shares should "
                "fall)"),
        verify_commands=(tune,),
    )


@rule("device.channels_last")
def channels_last(ctx: Context) -> Finding | None:
    """Convolutions in NCHW on a GPU (expert-rules.md C6: the tuning guide, TF, Composer).

    cuDNN's tensor-core convolutions work in NHWC; on NCHW tensors it transposes around
    every convolution. Evidence: the op sample's ``conv2d`` calls per step and how many
    had a channels_last input or weight (:mod:`trainprof.capture.opcount`). Gain: the
    device's forward + backward share x ``1 - 1/1.35`` (the top of the 8-35% speed-ups
    the PyTorch memory-format tutorial reports with AMP), an upper estimate; it needs
    tensor cores (Volta or newer, fp16/bf16 or TF32), hence always low. Yields to a
    ``--deep`` window's compute finding (tensor cores unused), which says it too.
    """
    ops = ctx.summary.get("ops")
    if not isinstance(ops, dict) or not used_cuda(ctx):
        return None
    conv = number(ops.get("conv2d_per_step")) or 0.0
    cl = number(ops.get("conv2d_channels_last_per_step")) or 0.0
    if conv <= 0 or cl >= 0.5 * conv:
        return None
    if input_share(ctx) >= INPUT_MEDIUM or "compute" in ctx.deep_categories:
        return None
    bd = device_breakdown(ctx)
    if bd:
        compute = float(bd.get("forward") or 0.0) + float(bd.get("backward") or 0.0)
    else:
        compute = float(number(ctx.breakdown.get("forward")) or 0.0) + float(
            number(ctx.breakdown.get("backward")) or 0.0)
    gain = compute * (1 - 1 / CHANNELS_LAST_SPEEDUP)
    if gain <= 0:
        return None
    evidence = {
        "conv2d_per_step": conv,
        "conv2d_channels_last_per_step": cl,
        "device_forward_backward_share": compute,
        "gpu": ctx.environment.get("gpu"),
    }
    run = f"trainprof run {ctx.script}"
    return Finding(
        category="compute",
        cause="channels_last",
        title=(
            f"{conv:.0f} convolutions per step run in NCHW: channels_last (NHWC) can speed "
            "them up on tensor cores"
        ),
        severity="low",
        evidence=evidence,
        estimated_gain=gain,
        fix=Fix(
            text=(
                "The model's Conv2d layers see NCHW tensors, and cuDNN's tensor-core "
                "convolutions transpose them to NHWC and back around each call. Convert the "
                "model and its input batch to channels_last once; the layout then carries "
                "through the network. The gain comes with tensor cores: mixed precision "
                "(bf16/fp16) or TF32, on a Volta or newer GPU."
            ),
            snippet=(
                "model = model.to(device, memory_format=torch.channels_last)\n"
                "for x, y in loader:\n"
                "    x = x.to(device, memory_format=torch.channels_last, non_blocking=True)\n"
                '    with torch.autocast("cuda", dtype=torch.bfloat16):\n'
                "        loss = criterion(model(x), y)"
            ),
        ),
        verify=(
            f"re-run `{run}` after the change and `{_compare(ctx)}`: the forward and backward "
            f"device time (now {_pct(compute)} of the device step) should fall"
        ),
        verify_commands=(run, _compare(ctx)),
    )
