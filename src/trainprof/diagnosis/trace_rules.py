"""Findings from a profiler trace (``trainprof trace``), in the run findings' vocabulary.

Each rule is a pure function of the trace analysis document
(:func:`trainprof.analysis.trace.analyse_trace`) and returns a :class:`Finding` or
None; :func:`diagnose_trace` runs them all, merges duplicates and ranks them by
estimated gain (:func:`trainprof.diagnosis.registry.merge`/``rank``), like the run
diagnosis. Sources and thresholds:

* ``input_pipeline`` — the TensorBoard plugin recommends more DataLoader workers when
  the DataLoader share of the step exceeds 5% (``RunProfileData.analyze``); bands are
  TF's input-pipeline analyzer's (>= 20% high, >= 5% medium), as in
  :mod:`.input_pipeline`.
* ``host_launch`` — HTA's idle-time breakdown: GPU idle while the next kernel's launch
  call had not started yet (host wait), and gaps between back-to-back kernels (kernel
  wait). Data loading makes the GPU wait for the host too; that part belongs to the
  input-pipeline finding and is subtracted here. Many kernels under 10 µs (TraceLens's
  short-kernel threshold) make it launch-bound (CUDA graphs, fusion); otherwise the
  host code itself is slow.
* ``synchronization`` — blocking runtime calls (``cudaDeviceSynchronize``,
  ``cudaStreamSynchronize``, synchronous ``cudaMemcpy``; Nsight Systems' sync rule),
  and ``cudaMemcpyAsync`` into pageable host memory, which blocks as ``.item()`` does
  (its fix is a pinned destination, not removing a synchronize); the profiler's own
  closing synchronize is not the user's and is left out (``launches.py``); the gain is
  capped by the GPU's idle share, since time blocked while the GPU works is not lost.
* ``compute`` / tensor cores unused — the plugin's rule: compute capability >= 7.0, no
  kernel on tensor cores, and kernel time launched by tensor-core-eligible operators
  (convolution, matmul); the gain assumes those kernels at most halve with mixed
  precision (the usual AMP speed-up on convolution and GEMM), an upper bound.
* ``host_to_device`` — pageable host-to-device copies (Kineto's ``Pageable -> Device``):
  the driver stages them through a pinned buffer synchronously (CUDA C++ Best Practices
  Guide, "Pinned Memory").
* ``distributed`` — the plugin flags communication above 10% of the step; the Kernel
  role has priority in the breakdown, so its Communication is the exposed part. A
  rank whose steps are slower than the others' (> 10%) is a straggler.
* ``measurement_noise`` — fewer than 3 analysed steps, or no steps at all: the numbers
  describe a short window (no speed-up; it qualifies the rest).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainprof.diagnosis.finding import Finding, Fix, band
from trainprof.diagnosis.registry import merge, rank

TraceRule = Callable[[dict[str, Any]], Finding | None]

#: A median launch-to-start delay under this says the GPU's queue was empty: its kernels
#: start as soon as the host launches them (9.6 µs on an H100 loop of 1.7 µs kernels, 6 to
#: 11 µs in the launch-bound traces of ../shared/traces; 0.6 to 164 ms where long kernels
#: kept the queue full).
LAUNCH_DELAY_STARVED_US = 50.0

VERIFY_TRACE = (
    "record a new trace of the same steps (torch.profiler, or `trainprof run --deep`) and run "
    "`trainprof trace` on it"
)


def _num(v: Any) -> float:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else 0.0


def _share(doc: dict[str, Any], category: str) -> float:
    bd = doc.get("breakdown_us") or {}
    total = _num(bd.get("Total"))
    return _num(bd.get(category)) / total if total > 0 else 0.0


def _gpu_util(doc: dict[str, Any]) -> float | None:
    """Mean GPU utilization over devices, as a fraction (None: no GPU)."""
    vals = [_num(g.get("utilization")) for g in (doc.get("gpu") or {}).values()
            if isinstance(g.get("utilization"), int | float)]
    return sum(vals) / len(vals) / 100.0 if vals else None


def _temporal(doc: dict[str, Any]) -> dict[str, Any]:
    """HTA's numbers over ranks: span and idle (µs), and the idle time split by cause.

    HTA's idle-time categories are sums of per-stream gaps, which overlap in time when
    several streams are idle at once; their proportions are applied to the rank's idle
    time (span minus the union of device work) to get time shares of the span.
    """
    out = {"span_us": 0.0, "idle_us": 0.0, "host_wait_us": 0.0, "kernel_wait_us": 0.0}
    for t in (doc.get("temporal") or {}).values():
        if not isinstance(t, dict):
            continue
        idle_us = _num(t.get("idle_us"))
        out["span_us"] += _num(t.get("span_us"))
        out["idle_us"] += idle_us
        idle = t.get("idle_breakdown") or {}
        out["host_wait_us"] += idle_us * _num(idle.get("host_wait_pct")) / 100.0
        out["kernel_wait_us"] += idle_us * _num(idle.get("kernel_wait_pct")) / 100.0
    return out


def _ms(us: float) -> str:
    return f"{us / 1000:.1f} ms" if us >= 1000 else f"{us:.0f} µs"


def _dataloader(doc: dict[str, Any]) -> Finding | None:
    held = _holding_rank(doc)
    if held is not None and held[1] == "DataLoader":
        # one rank's extra wait is the uneven-ranks finding's; what every rank waits is
        # the least-waiting rank's (an average of both had fitted neither: 42% of 1.5% and
        # 82%)
        least = min((doc.get("ranks") or {}).values(),
                    key=lambda d: _share(d, "DataLoader"))
        return _dataloader(least)
    share = _share(doc, "DataLoader")
    severity = band(share, 0.20, 0.05)
    if severity is None:
        return None
    bd = doc["breakdown_us"]
    iters = (doc.get("dataloader") or {}).get("iterators") or []
    single = any("SingleProcess" in name for name in iters)
    multi = any("MultiProcessing" in name for name in iters)
    evidence: dict[str, Any] = {
        "dataloader_share": share,
        "dataloader_us_per_step": bd.get("DataLoader"),
        "step_us": bd.get("Total"),
        "steps": len(doc.get("steps") or []) or 1,
    }
    util = _gpu_util(doc)
    if util is not None:
        evidence["gpu_utilization"] = util
    if iters:
        evidence["dataloader_iterator"] = iters[0].split("#", 1)[-1].split(".", 1)[0]
    cpu_only = bool(doc.get("cpu_only"))
    if single or not multi:
        cause = "too_few_workers"
        text = (
            "The training loop waits for each batch: "
            + ("the DataLoader runs in the training process (num_workers=0), "
               if single else "")
            + "so loading and the model's work take turns. Load in worker processes, so the "
            "next batches are prepared while the model computes"
            + ("; on a CPU run the workers share the cores with the model's threads, and a "
               "trace does not tell how many are free: `trainprof run` of the script measures "
               "it, and `trainprof tune --knob num_workers=0,2,4` whether workers pay."
               if cpu_only else
               "; on a GPU, pinned batches also make the host-to-device copy asynchronous.")
        )
        workers = 4
    else:
        cause = "slow_loading"
        text = (
            "The DataLoader already uses worker processes, but they do not keep up: the "
            "loop still waits for batches. Give it more workers (up to the usable cores per "
            "GPU) and a larger prefetch_factor; if the workers are CPU-bound, make each "
            "sample cheaper (decode/augment on the GPU, packed or pre-processed data)."
        )
        workers = 8
    snippet = (
        "loader = DataLoader(\n"
        "    dataset,  # unchanged\n"
        "    batch_size=...,  # unchanged\n"
        f"    num_workers={workers},  # worker processes load the next batches\n"
        "    persistent_workers=True,  # start them once, not every epoch\n"
        + ("" if cpu_only else
           "    pin_memory=True,  # page-locked batches: async copies to the GPU\n")
        + "    prefetch_factor=4,\n"
        ")"
    )
    return Finding(
        category="input_pipeline",
        cause=cause,
        title=(
            f"Training waits for data {share * 100:.0f}% of the step: the DataLoader takes "
            f"{_ms(_num(bd.get('DataLoader')))} of {_ms(_num(bd.get('Total')))} per step"
        ),
        severity=severity,
        evidence=evidence,
        estimated_gain=share,
        fix=Fix(text=text, snippet=snippet),
        verify=f"{VERIFY_TRACE}: the DataLoader share (now {share * 100:.1f}%) should fall "
        "below 5% (the TensorBoard plugin's threshold)",
    )


def _host_launch(doc: dict[str, Any]) -> Finding | None:
    t = _temporal(doc)
    span = t["span_us"]
    if span <= 0:
        return None
    launch = doc.get("launch") or {}
    host_share = t["host_wait_us"] / span
    kernel_share = t["kernel_wait_us"] / span
    data_share = _share(doc, "DataLoader")
    gain = max(0.0, host_share - data_share) + kernel_share
    severity = band(gain, 0.20, 0.05)
    if severity is None:
        return None
    short_pct = _num(launch.get("short_kernel_pct"))
    median = _num(launch.get("kernel_median_us"))
    short_time = launch.get("short_kernel_time_pct")
    delay = (launch.get("launch_delay_us") or {}).get("median")
    # Mostly short kernels by count is not enough: they must also be what the GPU spends
    # its time on, or start as soon as they are launched (an empty queue: the GPU waits
    # for launches). On an H100 a loop of 14 kernels a step, 80% of them under 10 µs but
    # 0.8% of kernel time, started its kernels 0.58 ms after their launch (queued behind
    # long ones); its GPU waited for a host that read loss.item() and loaded batches, not
    # for launches. A genuinely launch-bound loop: 100% of kernel time short, 9.6 µs.
    starved = ((short_time is None or _num(short_time) >= 50.0)
               or (delay is not None and _num(delay) < LAUNCH_DELAY_STARVED_US))
    launch_bound = ((short_pct >= 50.0 and median < 10.0 and starved)
                    or kernel_share >= host_share)
    evidence: dict[str, Any] = {
        "gpu_idle_share": t["idle_us"] / span,
        "host_wait_share": host_share,
        "kernel_wait_share": kernel_share,
        "dataloader_share": data_share,
        "kernels_per_step": launch.get("kernels_per_step"),
        "kernel_median_us": median,
        "short_kernel_pct": short_pct,
    }
    util = _gpu_util(doc)
    if util is not None:
        evidence["gpu_utilization"] = util
    if delay is not None:
        evidence["launch_delay_median_us"] = delay
    if short_time is not None:
        evidence["short_kernel_time_pct"] = short_time
    top_cpu = [op["name"] for op in sorted(doc.get("operators") or [],
                                           key=lambda o: -_num(o.get("host_self_us")))[:3]]
    if launch_bound:
        cause = "launch_bound"
        title = (
            f"The GPU waits for kernel launches {gain * 100:.0f}% of the time: "
            f"{launch.get('kernels_per_step', 0):.0f} kernels per step, median "
            f"{median:.1f} µs each"
        )
        text = (
            "Kernels are so short that launching them costs as much as running them, so the "
            "GPU idles between them. Fuse them and launch them as a graph: torch.compile "
            "(mode='reduce-overhead' uses CUDA graphs), or capture the step with "
            "torch.cuda.graphs; a larger batch also makes each kernel do more work."
        )
        snippet = (
            "model = torch.compile(model, mode=\"reduce-overhead\")  # fused kernels, "
            "CUDA graphs\n# or a larger batch per step, if memory allows"
        )
    else:
        cause = "host_bound"
        evidence["top_cpu_ops"] = top_cpu
        title = (
            f"The GPU waits for the host {gain * 100:.0f}% of the time: the CPU does not "
            "enqueue work fast enough"
        )
        text = (
            "The GPU finishes its queue and then waits for the Python/CPU side to launch the "
            "next kernels (HTA's host wait). Look at the operators with the most CPU self "
            "time (table above"
            + (f": {', '.join(top_cpu)}" if top_cpu else "")
            + "): move CPU work out of the step, avoid per-step tensor creation and .item() "
            "calls, and let torch.compile fuse the Python-level ops."
        )
        snippet = "model = torch.compile(model)  # fewer, larger kernels and less Python per step"
    return Finding(
        category="host_launch",
        cause=cause,
        title=title,
        severity=severity,
        evidence=evidence,
        estimated_gain=gain,
        fix=Fix(text=text, snippet=snippet),
        verify=f"{VERIFY_TRACE}: HTA's host-wait plus kernel-wait share of the GPU time (now "
        f"{gain * 100:.1f}%, data loading excluded) should fall, and GPU utilization rise",
    )


def _sync(doc: dict[str, Any]) -> Finding | None:
    sync = doc.get("sync") or {}
    share = _num(sync.get("share_pct")) / 100.0
    calls = sync.get("calls") or []
    if share <= 0 or not calls:
        return None
    util = _gpu_util(doc)
    gain = min(share, 1.0 - util) if util is not None else share
    severity = band(gain, 0.20, 0.05, 0.01)
    if severity is None:
        return None
    top = calls[0]
    name = str(top.get("name"))
    blocking_copy = "Memcpy" in name
    per_step = sum(_num(c.get("per_step")) for c in calls)
    evidence = {
        "sync_share": share,
        "sync_us_per_step": sync.get("per_step_us"),
        "sync_calls_per_step": per_step,
        "calls": {str(c.get("name")): c.get("count") for c in calls[:4]},
    }
    if util is not None:
        evidence["gpu_utilization"] = util
    if top.get("pageable_dtoh"):
        # a .cpu()/.item() into pageable memory: cudaMemcpyAsync in name, blocking in effect
        cause = "blocking_memcpy"
        text = (
            f"Copies from the GPU into pageable host memory ({name}: .cpu(), .item(), "
            ".tolist(), .numpy() of a GPU tensor) block the host until the GPU has finished "
            "all queued work and the copy, although the runtime call is cudaMemcpyAsync: the "
            "driver cannot copy asynchronously into pageable memory. Copy into a pinned "
            "buffer with non_blocking=True and wait on an event only where the value is "
            "used, and copy less often (every N steps, or one stacked tensor instead of "
            "many)."
        )
        snippet = (
            "host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)  # once\n"
            "host.copy_(x, non_blocking=True); done = torch.cuda.Event(); done.record()\n"
            "...  # launch the next step's work\n"
            "done.synchronize(); use(host)  # or: read it every N steps"
        )
    elif blocking_copy:
        cause = "blocking_memcpy"
        text = (
            f"Synchronous copies ({name}) block the host until the GPU has finished all "
            "queued work and the copy. Copies of pinned memory with non_blocking=True are "
            "asynchronous; reading a value back (.item(), .cpu(), printing a tensor) is a "
            "blocking copy: do it every N steps, not every step."
        )
        snippet = (
            "x = x.to(device, non_blocking=True)  # from a pin_memory=True DataLoader\n"
            "if step % 100 == 0:\n"
            "    print(loss.item())  # one blocking read per 100 steps"
        )
    else:
        cause = "explicit_synchronize"
        text = (
            f"{name} calls make the host wait for the GPU to drain its queue, so the next "
            "step's kernels are launched late and the GPU idles. Remove synchronize calls "
            "left from timing code (time with CUDA events instead), and avoid per-step reads "
            "of GPU values."
        )
        snippet = (
            "start, end = torch.cuda.Event(enable_timing=True), "
            "torch.cuda.Event(enable_timing=True)\n"
            "start.record(); step(); end.record()  # no torch.cuda.synchronize() per step\n"
            "# read start.elapsed_time(end) every N steps"
        )
    return Finding(
        category="synchronization",
        cause=cause,
        title=(
            f"Host-device syncs block the host {share * 100:.0f}% of the step "
            f"({per_step:.2g} blocking calls per step, mostly {name})"
        ),
        severity=severity,
        evidence=evidence,
        estimated_gain=gain,
        fix=Fix(text=text, snippet=snippet),
        verify=f"{VERIFY_TRACE}: the sync share of the step (now {share * 100:.1f}%) should "
        "fall towards 0; torch.cuda.set_sync_debug_mode('warn') names the remaining ones",
    )


def _compute_capability(doc: dict[str, Any]) -> float | None:
    caps = []
    for g in (doc.get("gpu") or {}).values():
        cc = g.get("compute_capability")
        try:
            caps.append(float(cc))
        except (TypeError, ValueError):
            continue
    return max(caps) if caps else None


def _tensor_cores(doc: dict[str, Any]) -> Finding | None:
    cc = _compute_capability(doc)
    gpus = doc.get("gpu") or {}
    if cc is None or cc < 7.0 or not gpus:
        return None
    fmt = doc.get("format") or {}
    if fmt.get("device_type") not in (None, "CUDA"):
        return None
    tc = max(_num(g.get("tensor_core_pct")) for g in gpus.values())
    eligible = _num(doc.get("tc_eligible_kernel_pct")) / 100.0
    if tc >= 1.0 or eligible <= 0:
        return None
    kernel_share = _share(doc, "Kernel")
    gain = kernel_share * eligible * 0.5
    severity = band(gain, 0.20, 0.05, 0.01)
    if severity is None:
        return None
    ampere = cc >= 8.0
    evidence = {
        "tc_eligible_kernel_share": eligible,
        "tensor_core_pct": tc,
        "kernel_share_of_step": kernel_share,
        "compute_capability": cc,
    }
    text = (
        f"{eligible * 100:.0f}% of the kernel time is launched by operators that can use "
        "tensor cores (convolutions, matmuls), but no kernel uses them: the math runs in "
        "fp32 on the CUDA cores. Mixed precision (torch.autocast) runs them on tensor cores"
        + (
            "; on this GPU (compute capability >= 8.0) TF32 does too, with no code change "
            "beyond one setting"
            if ampere
            else ""
        )
        + ". channels_last memory format helps convolutions further."
    )
    dtype = "torch.bfloat16" if ampere else "torch.float16"
    snippet = (
        ("torch.backends.cuda.matmul.allow_tf32 = True  # TF32 tensor cores for fp32 matmuls\n"
         "torch.backends.cudnn.allow_tf32 = True\n" if ampere else "")
        + ("scaler = torch.amp.GradScaler(\"cuda\")  # fp16 needs loss scaling\n"
           if not ampere else "")
        + f"with torch.autocast(device_type=\"cuda\", dtype={dtype}):\n"
        "    loss = criterion(model(x), y)\n"
        + ("scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()"
           if not ampere else "loss.backward(); optimizer.step()")
    )
    return Finding(
        category="compute",
        cause="tensor_cores_unused",
        title=(
            f"Tensor cores unused: {eligible * 100:.0f}% of the kernel time comes from "
            "convolution/matmul operators running in fp32"
        ),
        severity=severity,
        evidence=evidence,
        estimated_gain=gain,
        fix=Fix(text=text, snippet=snippet),
        verify=f"{VERIFY_TRACE}: 'Kernel time using tensor cores' (now {tc:.1f}%) should "
        "become large and the Kernel share of the step fall",
    )


def _pageable_copies(doc: dict[str, Any]) -> Finding | None:
    kinds = (doc.get("memcpy") or {}).get("kinds") or []
    total = _num((doc.get("breakdown_us") or {}).get("Total"))
    if total <= 0:
        return None
    pageable = [k for k in kinds if k.get("pageable") and k.get("kind") == "HtoD"]
    if not pageable:
        return None
    per_step = sum(_num(k.get("per_step_us")) for k in pageable)
    share = per_step / total
    severity = band(share, 0.20, 0.05, 0.01)
    if severity is None:
        return None
    evidence = {
        "pageable_htod_us_per_step": per_step,
        "pageable_htod_share": share,
        "copies": sum(int(_num(k.get("count"))) for k in pageable),
        "bytes": sum(int(_num(k.get("bytes"))) for k in pageable),
    }
    bw = [k.get("gb_per_s") for k in pageable if k.get("gb_per_s")]
    if bw:
        evidence["gb_per_s"] = bw[0]
    return Finding(
        category="host_to_device",
        cause="pageable_memory",
        title=(
            f"Host-to-device copies from pageable memory take {share * 100:.1f}% of the step "
            f"({_ms(per_step)} per step)"
        ),
        severity=severity,
        evidence=evidence,
        estimated_gain=share,
        fix=Fix(
            text=(
                "Batches are copied from pageable host memory, which the driver stages "
                "through a pinned buffer synchronously, at lower bandwidth, and without "
                "overlap with compute. Pin the batches in the DataLoader and copy them "
                "asynchronously."
            ),
            snippet=(
                "loader = DataLoader(dataset, batch_size=..., num_workers=..., pin_memory=True)\n"
                "for x, y in loader:\n"
                "    x = x.to(device, non_blocking=True)\n"
                "    y = y.to(device, non_blocking=True)"
            ),
        ),
        verify=f"{VERIFY_TRACE}: the copies should read 'Pinned -> Device' and the memcpy time "
        f"per step (now {_ms(per_step)}) fall",
    )


def _communication(doc: dict[str, Any]) -> Finding | None:
    share = _share(doc, "Communication")
    held = _holding_rank(doc)
    if held is not None:
        # the ranks waiting for one that holds them up: that wait is its finding's
        share = max(0.0, share - held[3] * (len(doc.get("ranks") or {}) - 1)
                    / max(1, len(doc.get("ranks") or {})))
    severity = band(share, 0.20, 0.10)
    if severity is None:
        return None
    comm = doc.get("communication") or {}
    evidence = {
        "exposed_communication_share": share,
        "communication_us_per_step": comm.get("communication_us"),
        "overlap_pct_of_communication": comm.get("overlap_pct_of_communication"),
    }
    return Finding(
        category="distributed",
        cause="exposed_communication",
        title=(
            f"Communication not hidden behind computation takes {share * 100:.0f}% of the step"
        ),
        severity=severity,
        evidence=evidence,
        estimated_gain=share,
        fix=Fix(
            text=(
                "Gradient communication waits are not overlapped with the backward pass. "
                "Larger DDP buckets overlap more, gradient accumulation with no_sync() "
                "communicates less often, and a larger batch per GPU amortises it; check that "
                "NCCL (not Gloo) is used on GPUs."
            ),
            snippet=(
                "model = DistributedDataParallel(model, bucket_cap_mb=100)\n"
                "with model.no_sync():  # accumulate gradients without all-reduce\n"
                "    loss.backward()"
            ),
        ),
        verify=f"{VERIFY_TRACE} (every rank): the Communication share (now "
        f"{share * 100:.1f}%) should fall",
    )


#: Breakdown categories a rank's own work or waits fall in (not the collectives').
_OWN_WORK = {"DataLoader": "waiting for data", "CpuOp": "CPU work", "Other": "other host work",
             "Kernel": "kernels", "Runtime": "runtime calls", "Memcpy": "copies"}


def _holding_rank(doc: dict[str, Any]) -> tuple[str, str, float, float] | None:
    """In a trace of ranks of one job: the rank the others wait for, the category of its
    step that holds them (its excess over the other ranks' mean), that excess (µs a step)
    and its share of the step; None where no rank stands out by 5% of the step.

    Collectives make the ranks' step times equal: the rank that holds the others up has
    the least Communication (the others wait in theirs), and the excess of its own work
    tells why. Two gloo ranks, one with a slow dataset, had read as "[high] Communication
    not hidden ... 47%" beside a data wait averaged over both ranks."""
    ranks = doc.get("ranks") or {}
    if len(ranks) < 2 or (doc.get("rank_spread") or {}).get("one_job") is False:
        return None
    bd = {r: d.get("breakdown_us") or {} for r, d in ranks.items()}
    total = sum(_num(b.get("Total")) for b in bd.values()) / len(bd)
    if total <= 0:
        return None
    slow = min(bd, key=lambda r: _num(bd[r].get("Communication")))
    others = [b for r, b in bd.items() if r != slow]
    excess = {c: _num(bd[slow].get(c)) - sum(_num(b.get(c)) for b in others) / len(others)
              for c in _OWN_WORK}
    category = max(excess, key=lambda c: excess[c])
    share = excess[category] / total
    if share < 0.05:
        return None
    return str(slow), category, excess[category], share


def _uneven_ranks(doc: dict[str, Any]) -> Finding | None:
    held = _holding_rank(doc)
    if held is None:
        return None
    slow, category, excess_us, share = held
    what = _OWN_WORK[category]
    data = category == "DataLoader"
    return Finding(
        category="distributed",
        cause="uneven_input_pipeline" if data else "straggler_rank",
        title=(f"Rank {slow} holds the others up: its {what} takes {_ms(excess_us)} a step "
               "more than the other ranks', who wait for it in their collectives"),
        severity=band(share, 0.30, 0.10, 0.05) or "low",
        evidence={"rank": slow, "category": category, "excess_us_per_step": excess_us,
                  "share_of_step": share,
                  "communication_us": {r: _num((d.get("breakdown_us") or {}).get(
                      "Communication")) for r, d in (doc.get("ranks") or {}).items()}},
        estimated_gain=share,
        fix=Fix(text=(
            f"In synchronous training every rank waits at each collective for the slowest: "
            f"rank {slow}'s extra {what} is paid by all, and shows on the others as "
            "communication. "
            + ("Give every rank the same loading (num_workers per rank, the same storage) and "
               "an even shard of the data (DistributedSampler, equal sizes)."
               if data else
               "Compare its breakdown with the others' (under 'ranks'): uneven work (sequence "
               "lengths, shards), a busier host or fewer cores make one rank late."))),
        verify=f"{VERIFY_TRACE} on every rank's trace: rank {slow}'s {what} (now "
        f"{_ms(excess_us)} a step more than the others') should fall",
    )


def _straggler(doc: dict[str, Any]) -> Finding | None:
    spread = doc.get("rank_spread") or {}
    if spread.get("one_job") is False:  # separate runs: no collective makes one wait
        return None
    pct = _num(spread.get("spread_pct")) / 100.0
    severity = band(pct, 0.30, 0.10)
    if severity is None:
        return None
    return Finding(
        category="distributed",
        cause="straggler_rank",
        title=(
            f"Rank {spread.get('slowest_rank')} is {pct * 100:.0f}% slower per step than rank "
            f"{spread.get('fastest_rank')}: every rank waits for it at each collective"
        ),
        severity=severity,
        evidence={"step_time_mean_us": spread.get("step_time_mean_us"), "spread": pct},
        estimated_gain=pct,
        fix=Fix(
            text=(
                "Compare the slow rank's breakdown with the others' (under 'ranks'): uneven "
                "data (sequence lengths, shards), a slower input pipeline, or a busier host "
                "make one rank late, and the collectives make the others wait."
            ),
        ),
        verify=f"{VERIFY_TRACE} on every rank's trace: the step-time spread (now "
        f"{pct * 100:.0f}%) should fall under 10%",
    )


def _few_steps(doc: dict[str, Any]) -> Finding | None:
    steps = doc.get("steps") or []
    found = bool(doc.get("steps_found"))
    if found and len(steps) >= 3:
        return None
    return Finding(
        category="measurement_noise",
        cause="few_steps" if found else "no_steps",
        title=(
            f"Only {len(steps)} step(s) analysed: the averages describe a short window"
            if found
            else "No ProfilerStep ranges: the whole trace was analysed as one window"
        ),
        severity="low",
        evidence={"steps": len(steps), "steps_found": found},
        estimated_gain=0.0,
        fix=Fix(
            text=(
                "Record several steps after warm-up: a torch.profiler schedule "
                "(wait=1, warmup=1, active=3 or more) with prof.step() at the end of each "
                "training step."
            ),
            snippet=(
                "with torch.profiler.profile(\n"
                "    schedule=torch.profiler.schedule(wait=1, warmup=1, active=5),\n"
                "    on_trace_ready=torch.profiler.tensorboard_trace_handler(\"./traces\"),\n"
                ") as prof:\n"
                "    for batch in loader:\n"
                "        train_step(batch)\n"
                "        prof.step()"
            ),
        ),
        verify="`trainprof trace` the new trace: it should list 3 or more steps",
    )


def _eager_attention(doc: dict[str, Any]) -> Finding | None:
    """Attention computed op by op (trace/attention.py): the kernel time on its score
    matrices beyond their products' FLOPs at the datasheet's peak, as a share of the kernel
    time, times the kernels' share of the step (the TensorBoard breakdown's Kernel)."""
    att = doc.get("attention")
    if not isinstance(att, dict) or not att.get("shapes"):
        return None
    bound, total = _num(att.get("bound_us")), _num(att.get("total_kernel_us"))
    if bound <= 0 or total <= 0:
        return None
    kernel_share = _share(doc, "Kernel")
    gain = bound / total * kernel_share
    severity = band(gain, 0.20, 0.05, 0.02)
    if severity is None:
        return None
    top = att["shapes"][0]
    share = _num(att.get("kernel_us")) / total
    text = (
        f"{share * 100:.0f}% of the kernel time ({_ms(_num(att.get('kernel_us')))}) goes to "
        f"attention computed op by op on {top['batch']} x {top['query_len']} x "
        f"{top['key_len']} score matrices (batch x heads, queries, keys; heads of "
        f"{top['head_dim']}) in {top['dtype']}: the products, the scaling, mask and softmax "
        "each read and write the whole score matrix. Their products' "
        f"{_num(top.get('gflops')):,.0f} GFLOP would take "
        f"{_ms(_num(att.get('kernel_us')) - bound)} at the GPU's datasheet peak. "
        "torch.nn.functional.scaled_dot_product_attention computes the same in fused kernels "
        "(FlashAttention, memory-efficient attention) that never store the score matrix: "
        "a Hugging Face model takes it with attn_implementation=\"sdpa\", "
        "nn.MultiheadAttention with need_weights=False. `trainprof run` on the script times "
        "the fused kernel against these ops at this shape."
    )
    return Finding(
        category="compute", cause="eager_attention",
        title=(f"Attention is computed op by op: {share * 100:.0f}% of the kernel time, on "
               f"{top['query_len']} x {top['key_len']} score matrices"),
        severity=severity,
        evidence={"attention_kernel_share": share, "attention_kernel_us": att.get("kernel_us"),
                  "bound_us": bound, "kernel_share_of_step": kernel_share,
                  "scores": [top["batch"], top["query_len"], top["key_len"]],
                  "head_dim": top["head_dim"], "dtype": top["dtype"],
                  "softmax_calls": top.get("softmax_calls"), "shapes": len(att["shapes"])},
        estimated_gain=gain,
        fix=Fix(text=text, snippet=(
            "y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # was softmax(q @ k.T"
            " * scale + mask) @ v\n"
            'model = AutoModel.from_pretrained(name, attn_implementation="sdpa")  # Hugging Face')),
        verify=f"{VERIFY_TRACE}: the softmax and bmm kernels should give way to one attention "
        "kernel, the Kernel share of the step fall",
    )


RULES: dict[str, TraceRule] = {
    "trace.input_pipeline": _dataloader,
    "trace.host_launch": _host_launch,
    "trace.synchronization": _sync,
    "trace.tensor_cores": _tensor_cores,
    "trace.eager_attention": _eager_attention,
    "trace.pageable_copies": _pageable_copies,
    "trace.communication": _communication,
    "trace.straggler": _straggler,
    "trace.uneven_ranks": _uneven_ranks,
    "trace.steps": _few_steps,
}


def diagnose_trace(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Findings for a trace analysis document, highest estimated gain first (as dicts).

    A rule that meets a document it does not expect is skipped: a report never fails
    because of one rule (as :func:`trainprof.diagnosis.registry.diagnose`).
    """
    found: list[Finding] = []
    for name, fn in RULES.items():
        try:
            f = fn(result)
        except (KeyError, TypeError, ValueError, ZeroDivisionError, AttributeError):
            continue
        if f is not None:
            f.rule = name
            found.append(f)
    return [f.to_dict() for f in rank(merge(found))]
