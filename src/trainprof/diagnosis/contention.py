"""CPU contention: more runnable threads than usable cores, so the model's math waits for a core.

Sources (expert-rules.md): H11 — the PyTorch tuning guide and TF on CPU threading
(``OMP_NUM_THREADS``, affinity); TF I6 (``max_intra_op_parallelism=1`` for input
work, > 10% gain); data-loading.md §3 item 7 (at most one worker per core).

The thread demand of a run is the main process's intra-op threads plus one per
DataLoader worker alive at once (of loaders zipped in one loop, all their workers:
:attr:`Context.concurrent_workers`): PyTorch sets ``torch.set_num_threads(1)`` in every worker
(``torch/utils/data/_utils/worker.py``, torch 2.13), so workers do not multiply the
intra-op pool; ``threads x (1 + workers)`` would overstate it. A nominal excess is not
enough to report: workers that sleep on I/O take no core. The rule therefore uses the
*measured* CPU of the workers (the sampler's per-worker CPU, in cores) and asks how
many cores the intra-op pool is left with. With ``T`` intra-op threads, ``W`` cores
used by workers and ``C`` usable cores, the pool has ``C - W`` cores for ``T``
threads; compute could run up to ``T / (C - W)`` times faster with a core per thread,
so the estimated gain is ``compute_share x (1 - (C - W) / T)``. On CUDA the math runs
on the device and the host needs about one thread to launch it, so ``T = 1`` there.

OpenMP pools that lose a thread to the scheduler can stall at every barrier, so the
real loss can exceed this estimate; the verify sweep measures it.

``torch_num_threads`` is the count the training thread had when the script ended (the
recorder reads it there: a ``torch.set_num_threads`` in the script counts), else the
fingerprint's, read before the script ran. A script that changes it mid-run is judged
by its last value.
"""

from __future__ import annotations

import math
from typing import Any

from trainprof.diagnosis.context import Context
from trainprof.diagnosis.finding import Finding, Fix, band, sweep
from trainprof.diagnosis.registry import rule

HIGH, MEDIUM, LOW = 0.20, 0.05, 0.02
#: Worker CPU (in cores) below which workers are not competing for cores in earnest
#: (workers that sleep on I/O); the gain bands then decide whether it is worth a finding.
MIN_WORKER_CORES = 0.10


def _csv(values: set[int]) -> str:
    return ",".join(str(v) for v in sorted(values))


def _share(workers: int, loaders: int) -> int:
    """Each loader's workers where ``loaders`` iterated together share ``workers`` (at least
    one each where there are any: a loader cannot have half a worker)."""
    return 0 if workers <= 0 else max(1, math.ceil(workers / max(1, loaders)))


@rule("contention.oversubscribed_cores")
def oversubscribed_cores(ctx: Context) -> Finding | None:
    cores = ctx.cores
    threads = ctx.environment.get("torch_num_threads")
    if not cores or not isinstance(threads, int) or threads <= 0:
        return None
    compute = ctx.compute_share
    nw = ctx.concurrent_workers  # the workers out at once (loaders zipped: all theirs)
    sysinfo = ctx.system
    worker_cores = sysinfo.get("workers_cpu_pct")
    worker_cores = worker_cores / 100 if isinstance(worker_cores, int | float) else None
    pool = 1 if ctx.on_cuda else threads

    # Intra-op threads alone exceed the cores (containers that show the host's cores).
    gain_threads = compute * (1 - cores / pool) if pool > cores else 0.0
    # Workers busy on cores the intra-op pool wants.
    gain_workers = 0.0
    if nw and worker_cores is not None and worker_cores >= MIN_WORKER_CORES and pool + nw > cores:
        left = max(cores - worker_cores, 0.5)
        gain_workers = compute * max(0.0, 1 - left / pool)
    gain = max(gain_threads, gain_workers)
    severity = band(gain, HIGH, MEDIUM, LOW)
    if severity is None:
        return None

    evidence: dict[str, Any] = {
        "usable_cores": cores,
        "torch_num_threads": threads,
        "num_workers": nw,
        "thread_demand": pool + nw,
        "compute_share": compute,
    }
    together = max((len(g) for g in ctx.loader_groups), default=0)
    if together > 1:
        evidence["loaders_iterated_together"] = together
    if worker_cores is not None:
        evidence["worker_cores_used"] = worker_cores
    for key in ("proc_cpu_pct", "sys_cpu_pct", "ctx_switches_ps"):
        if sysinfo.get(key) is not None:
            evidence[key] = sysinfo[key]
    if ctx.external_cores is not None:
        # Other processes' CPU is not counted in the gain (the script cannot change it),
        # but it explains a slower run: see the measurement_noise finding.
        evidence["external_load_cores"] = ctx.external_cores
    data_share = float(ctx.breakdown.get("data_wait") or 0.0)
    evidence["data_wait_share"] = data_share

    if gain_workers >= gain_threads:
        cause = "workers_oversubscribe_cores"
        w = worker_cores or 0.0
        new_threads = max(1, math.floor(cores - w + 0.5)) if not ctx.on_cuda else threads
        # Enough workers for the CPU they actually use (with half a core of headroom),
        # when the input keeps up; otherwise the input pipeline needs them all.
        new_workers = min(nw, max(1, math.ceil(w + 0.5))) if data_share < 0.05 else nw
        title = (
            f"{nw} DataLoader worker{'' if nw == 1 else 's'} and {pool} intra-op "
            f"thread{'' if pool == 1 else 's'} share {cores} cores: "
            f"the model's math waits for a core (up to {gain * 100:.0f}% of step time)"
        )
        text = (
            f"The {nw} worker{'' if nw == 1 else 's'} keep{'s' if nw == 1 else ''} {w:.1f} of "
            f"the {cores} usable cores busy while PyTorch runs "
            f"the model's ops on {pool} threads: {pool + nw} runnable threads for {cores} cores, "
            "so the op threads wait for a core and then for each other."
        )
        lines: list[str] = []
        # Neither count may follow from the numbers: workers that use about half a core,
        # which the loop still waits for (2 workers at 0.49 cores, 2 threads on 2 cores,
        # data wait 14%: the finding once said to keep both, while `trainprof tune`
        # measured num_workers=0 at x0.77 of the step and one thread fewer at x0.91).
        alt_threads = max(1, pool - math.ceil(w))
        if new_workers >= nw and (new_threads >= pool or ctx.on_cuda):
            if ctx.on_cuda:
                text += (
                    f" The loop also waits for their batches ({data_share * 100:.0f}% of step "
                    "time), so fewer workers may cost more than they give back: the sweep "
                    "below measures it."
                )
                lines.append(f"loader = DataLoader(..., num_workers={nw})  # fewer: see verify")
            else:
                text += (
                    " Which side should give way does not follow from these numbers: the "
                    f"workers use {w:.1f} of a core, and the loop waits for their batches "
                    f"{data_share * 100:.0f}% of step time. Measure both ways out: one "
                    f"intra-op thread fewer (torch.set_num_threads({alt_threads})), or no "
                    "workers (num_workers=0: the training process makes each batch itself, "
                    "with no hand-over and no core to share)."
                )
                lines += [
                    "import torch",
                    "",
                    f"# either leave the workers a core: {alt_threads} intra-op thread(s)",
                    f"torch.set_num_threads({alt_threads})",
                    "# or load in the training process: no workers to share the cores with",
                    "loader = DataLoader(..., num_workers=0)",
                ]
                new_threads = alt_threads
        else:
            if new_workers < nw:
                text += (
                    f" Use fewer workers: {new_workers} should keep up (the loop waits for "
                    f"data {data_share * 100:.0f}% of step time)."
                )
            if new_threads < pool:
                text += (
                    f" Give the model only the cores the workers leave free: "
                    f"torch.set_num_threads({new_threads})."
                )
                lines += [
                    "import torch",
                    "",
                    f"torch.set_num_threads({new_threads})  # {cores} cores - ~{w:.1f} for workers",
                ]
            else:
                lines.append(f"# keep torch's {pool} threads: the workers use less than a core")
            lines.append(
                f"loader = DataLoader(..., num_workers={new_workers}, persistent_workers=True)"
            )
        if together > 1:
            # the counts above are all the loaders' workers; each loader sets its own, and
            # tune's num_workers knob sets every loader's: an equal share each
            lines = [line.replace(f"num_workers={new_workers}",
                                  f"num_workers={_share(new_workers, together)}")
                     for line in lines]
            lines.append(f"# for each of the {together} loaders iterated together "
                         f"({_share(new_workers, together) * together} workers in all, "
                         f"now {nw})")
        snippet = "\n".join(lines)
        knobs = []
        if not ctx.on_cuda:
            knobs.append(f"--knob torch_threads={_csv(set(sweep(1, pool)) | {new_threads})}")
        each = max(1, together)
        knobs.append("--knob num_workers=" + _csv(
            {_share(v, each) for v in set(sweep(1, nw)) | {0, new_workers}}))
        verify = f"trainprof tune {' '.join(knobs)} {ctx.script}"
    else:
        cause = "threads_exceed_cores"
        title = (
            f"PyTorch runs {threads} intra-op threads on {cores} usable cores "
            f"(up to {gain * 100:.0f}% of step time)"
        )
        text = (
            f"torch uses {threads} threads for each op but the process may use only {cores} "
            "cores (CPU affinity, a container's CPU set): threads wait for each other at "
            f"every parallel region. Match the thread count to the usable cores."
        )
        snippet = (
            f"OMP_NUM_THREADS={cores} python {ctx.script}\n"
            f"# or, first thing in the script:\ntorch.set_num_threads({cores})"
        )
        verify = f"trainprof tune --knob torch_threads={_csv({cores, threads})} {ctx.script}"
    return Finding(
        category="cpu_contention",
        cause=cause,
        title=title,
        severity=severity,
        evidence=evidence,
        estimated_gain=gain,
        fix=Fix(text=text, snippet=snippet),
        verify=verify,
        verify_commands=(verify,),  # a command, all of it
    )


#: CPU of the training process (in cores) beyond what its work can use, from which idle
#: intra-op threads are taken to be spinning (the sampler, the flush thread and the
#: hand-over's round trips use a few hundredths; see spinning_threads).
SPIN_EXCESS_CORES = 0.4


@rule("contention.spinning_threads")
def spinning_threads(ctx: Context) -> Finding | None:
    """torch's idle intra-op threads spin while the loop waits for its workers' batches.

    OpenMP's idle threads busy-wait after each parallel region before they sleep (GNU
    libgomp, which torch's Linux CPU builds use, spins for ``GOMP_SPINCOUNT`` iterations
    unless ``OMP_WAIT_POLICY=PASSIVE``). On a CPU run whose loop waits for DataLoader
    workers, that spinning takes cores the workers need. The training process's CPU is
    then far above what its work can use: the math on ``T`` threads plus one core for
    the rest of the step, and nothing while it waits for a worker's batch. Measured on
    this project's 2-core VM: a loop waiting 71% of its step for 1 worker used 124% CPU
    where its work accounts for 52%; with ``OMP_WAIT_POLICY=PASSIVE`` it used 48%, the
    worker 75% instead of 60%, and the median step went from 4.4 to 3.4 ms (2 workers
    serving in-memory tensors: 2.7 to 1.7 ms, the process 128% to 68%).

    The gain bound gives the workers the spun cores: ``data_wait x S / (S + W)`` for
    ``S`` cores spun and ``W`` the workers' cores. Passive threads pay a wake-up at each
    parallel region instead, which can slow loops of many small ops: the verify sweep
    measures the trade.
    """
    if ctx.on_cuda:
        return None
    threads = ctx.environment.get("torch_num_threads")
    nw = ctx.concurrent_workers  # the workers out at once (loaders zipped: all theirs)
    if not isinstance(threads, int) or threads < 2 or nw == 0:
        return None
    env = ctx.environment.get("thread_env") or {}
    if str(env.get("OMP_WAIT_POLICY") or "").upper() == "PASSIVE":
        return None
    b = ctx.breakdown
    data_share = float(b.get("data_wait") or 0.0)
    proc = ctx.system.get("proc_cpu_pct")
    if data_share < 0.05 or not isinstance(proc, int | float):
        return None
    # the most the work can use: the math on every thread, one core for the rest, and
    # no CPU while the loop waits for a worker's batch
    needed = ctx.compute_share * threads + float(b.get("other") or 0) + float(b.get("gc") or 0)
    spin = proc / 100 - needed
    if spin < SPIN_EXCESS_CORES:
        return None
    workers = float(ctx.system.get("workers_cpu_pct") or 0.0) / 100
    gain = data_share * spin / (spin + max(workers, 0.1))
    severity = band(gain, HIGH, MEDIUM, LOW)
    if severity is None:
        return None
    evidence: dict[str, Any] = {
        "torch_num_threads": threads, "num_workers": nw, "data_wait_share": data_share,
        "proc_cpu_pct": proc, "cores_needed": needed, "cores_spun": spin,
        "worker_cores_used": workers, "usable_cores": ctx.cores,
    }
    if env:
        evidence["thread_env"] = env
    title = (f"torch's {threads} intra-op threads spin while the loop waits for its "
             f"{nw} DataLoader worker{'' if nw == 1 else 's'}: {spin:.1f} of a core "
             f"burnt (up to {gain * 100:.0f}% of step time)")
    text = (
        f"The training process used {proc:.0f}% CPU (100% = one core) where its work can "
        f"use at most {needed * 100:.0f}%: the math on {threads} threads for "
        f"{ctx.compute_share * 100:.0f}% of the step, one core for the rest, nothing "
        f"while it waits for a batch ({data_share * 100:.0f}% of the step). The rest is "
        "OpenMP's idle threads busy-waiting after each op before they sleep (GNU libgomp, "
        "in torch's Linux CPU builds), on cores the workers need: they use "
        f"{workers * 100:.0f}% CPU. OMP_WAIT_POLICY=PASSIVE makes idle threads sleep at "
        "once. Set it in the environment before Python starts: the OpenMP runtime reads "
        "it as torch loads. Passive threads pay a wake-up at each parallel op instead, "
        "which can cost loops of many small ops more than it gives: measure it."
    )
    snippet = (
        f"OMP_WAIT_POLICY=PASSIVE python {ctx.script}\n"
        "# or first thing in the script, before torch is imported (not under trainprof\n"
        "# run, which imports torch first):\n"
        "import os\n"
        'os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")'
    )
    verify = f"trainprof tune --knob omp_wait_policy=script,passive {ctx.script}"
    return Finding(
        category="cpu_contention", cause="spinning_threads", title=title,
        severity=severity, evidence=evidence, estimated_gain=gain,
        fix=Fix(text=text, snippet=snippet), verify=verify, verify_commands=(verify,),
    )
