"""Memory that keeps growing through the steady state: a leak that ends the run.

Sources (expert-rules.md): M3 — "Leaks. Memory growth ≥ 1% and per-line leak
likelihood ≥ 0.95" (Scalene). trainprof reads the trend of the system samples
(:mod:`trainprof.analysis.memory_growth`: anonymous RSS of the training process, each
GPU's used memory), growth that holds to the end of the run, at least 32 MiB and 3%.

The usual causes in a training loop: tensors kept across steps with their autograd
graph (``losses.append(loss)``, ``total_loss += loss``: the graph, and on a step
without backward its activations, stay alive), batches or outputs kept for metrics,
and Python containers that grow per step (a cache with no bound). No speed-up is
claimed (``estimated_gain`` 0): the finding is about the run's end. Severity by the
projected time until the memory is full (an upper bound: other processes use it
too): within an hour high, within a day medium, otherwise low.
"""

from __future__ import annotations

from typing import Any

from trainprof.diagnosis.context import Context
from trainprof.diagnosis.finding import Finding, Fix
from trainprof.diagnosis.registry import rule

HOUR_S, DAY_S = 3600.0, 86400.0
MIB = 2**20


def _severity(seconds_to_full: float | None) -> str:
    if seconds_to_full is not None and seconds_to_full < HOUR_S:
        return "high"
    if seconds_to_full is not None and seconds_to_full < DAY_S:
        return "medium"
    return "low"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * HOUR_S:
        return f"{seconds / 60:.0f} minutes"
    return f"{seconds / HOUR_S:.1f} hours"


def _growth_finding(ctx: Context, g: dict[str, Any], where: str, cause: str) -> Finding:
    per_step = g.get("bytes_per_step")
    rate = float(g.get("slope_bytes_per_s") or 0.0)
    full = g.get("seconds_to_full")
    per_step_txt = f"{per_step / 1024:,.0f} KiB a step, " if per_step else ""
    title = (f"{where} memory grows {per_step_txt}{rate / MIB:,.1f} MiB/s to the end of the run"
             + (f": full in about {_duration(float(full))}" if full else ""))
    evidence: dict[str, Any] = {
        "series": g.get("series", "mem_used_bytes"),
        "bytes_per_step": per_step,
        "bytes_per_s": rate,
        "first_quarter_bytes": g.get("first_bytes"),
        "last_bytes": g.get("last_bytes"),
        "quarter_medians_bytes": g.get("quarter_medians_bytes"),
        "quarter_floors_bytes": g.get("quarter_floors_bytes"),
        "window_s": g.get("window_s"),
        "capacity_bytes": g.get("capacity_bytes"),
        "seconds_to_full": full,
    }
    text = (
        f"{where} memory rose through the whole steady state, in each quarter of it more "
        "than in the one before: something is kept from every step. Most often a tensor "
        "kept with its autograd graph (losses.append(loss), total_loss += loss: keep "
        "loss.item() or loss.detach()), batches or model outputs kept for metrics (keep "
        "the numbers, or detach and move them to the CPU), or a cache with no bound (an "
        "in-memory cache that fills through the first epoch stops there: check that "
        "it fits). "
        "tracemalloc (host) or torch.cuda.memory._record_memory_history (GPU) names the "
        "allocation that grows."
    )
    snippet = (
        "running_loss += loss.item()  # not `+= loss`: that keeps every step's graph\n"
        "outputs.append(logits.detach().cpu())  # if outputs are needed at all"
    )
    run = f"trainprof run {ctx.script}"
    verify = f"{run} after the change: this finding should be gone from its report"
    return Finding(category="memory", cause=cause, title=title, severity=_severity(full),
                   evidence=evidence, estimated_gain=0.0,
                   fix=Fix(text=text, snippet=snippet), verify=verify,
                   verify_commands=(run,))


@rule("memory_growth.leak")
def leak(ctx: Context) -> list[Finding]:
    growth = ctx.summary.get("memory_growth")
    if not isinstance(growth, dict):
        return []
    out: list[Finding] = []
    host = growth.get("host")
    if isinstance(host, dict) and host.get("grows"):
        out.append(_growth_finding(ctx, host, "Host", "host_memory_growth"))
    for index, g in sorted((growth.get("gpus") or {}).items()):
        if isinstance(g, dict) and g.get("grows"):
            out.append(_growth_finding(ctx, g, f"GPU {index}", "gpu_memory_growth"))
    return out


#: a worker must write at least this much memory of its own to be reported...
WORKER_MIN_GROWTH = 64 * MIB
#: ...or have copied at least this much of what it shared with the training process
WORKER_MIN_COPIED = 32 * MIB
#: ...and all workers together at least this much
WORKERS_MIN_TOTAL = 128 * MIB
#: of the host's memory, held privately by the workers at one time: high, medium
WORKERS_HIGH, WORKERS_MEDIUM = 0.25, 0.05


@rule("memory_growth.worker_copies")
def worker_copies(ctx: Context) -> Finding | None:
    """DataLoader workers each writing a large private copy: data-loading.md pitfall 6,
    "Copy-on-read from Python lists or dicts: store as numpy or Arrow" (measured there:
    a list of 3 M paths, worker USS 48 → 187 MiB each over one epoch; as a numpy ``S``
    array, 47 → 48 MiB; pytorch#13246). A forked worker shares the training process's
    memory until it writes a page; reading a Python object writes its reference count,
    so every page of the dataset's lists, dicts and strings that a worker reads is
    copied into it. Told apart from a worker's own allocations (a per-worker cache) by
    its shared dirty memory, which shrinks by what is copied.

    A worker's own allocations count from the end of its start-up (its first batch:
    trainprof.analysis.memory_growth.worker_memory), not from the sampler's first sight
    of it: a ``spawn`` worker is first seen while its interpreter imports torch, and
    counting that (~130 MiB a worker) reported a dataset holding nothing as a cache.
    The per-worker figure in the title is the total over the workers alive at the
    peak divided by their number, so the two always agree (the total is never summed
    over workers that were not alive together, nor mixed with a median of another
    quantity: it once read "135 MiB each (290 MiB across 2 workers)", growth beside
    whole private sizes)."""
    growth = ctx.summary.get("memory_growth")
    w = growth.get("workers") if isinstance(growth, dict) else None
    if not isinstance(w, dict):
        return None
    growth_per_worker = int(w.get("private_growth_median_bytes") or 0)
    dropped = int(w.get("shared_dirty_drop_median_bytes") or 0)
    # copies: memory shared with the training process at a worker's first reading, private
    # later; the copying starts with the first samples, so the worker's whole private
    # size is what it holds. Otherwise only what it allocated after its start-up.
    copied = dropped >= WORKER_MIN_COPIED
    if copied:
        total = int(w.get("concurrent_private_peak_bytes") or 0)
        n = int(w.get("concurrent_private_peak_workers") or 0)
    else:
        total = int(w.get("concurrent_growth_peak_bytes") or 0)
        n = int(w.get("concurrent_growth_peak_workers") or 0)
    if (n <= 0 or total < WORKERS_MIN_TOTAL
            or (not copied and growth_per_worker < WORKER_MIN_GROWTH)):
        return None
    per_worker = total / n
    host = growth.get("host_memory_bytes")
    share = total / float(host) if host else None
    severity = ("high" if share is not None and share >= WORKERS_HIGH else
                "medium" if share is not None and share >= WORKERS_MEDIUM else "low")
    dataset = str((ctx.train_loader or {}).get("dataset") or "the dataset").rsplit(".", 1)[-1]
    title = ((f"Each DataLoader worker holds {per_worker / MIB:,.0f} MiB of memory of its own "
              if copied else
              f"Each DataLoader worker's memory grew by {per_worker / MIB:,.0f} MiB after "
              "its first batch ")
             + f"({total / MIB:,.0f} MiB across {n} workers at once)"
             + (": the dataset's Python objects copied into every worker" if copied else ""))
    evidence = {
        "workers": int(w.get("workers") or 0),
        "workers_at_peak": n,
        "per_worker_at_peak_bytes": int(per_worker),
        "private_per_worker_bytes": w.get("private_peak_median_bytes"),
        "private_first_per_worker_bytes": w.get("private_first_median_bytes"),
        "private_after_startup_per_worker_bytes": w.get("private_baseline_median_bytes"),
        "private_growth_per_worker_bytes": growth_per_worker,
        "shared_dirty_drop_per_worker_bytes": w.get("shared_dirty_drop_median_bytes"),
        "workers_private_peak_bytes": w.get("concurrent_private_peak_bytes"),
        "workers_growth_peak_bytes": w.get("concurrent_growth_peak_bytes"),
        "host_memory_bytes": host,
        "share_of_host_memory": share,
        "dataset": (ctx.train_loader or {}).get("dataset"),
    }
    if copied:
        text = (
            f"Memory each worker shared with the training process became its own as it ran "
            f"({(w.get('shared_dirty_drop_median_bytes') or 0) / MIB:,.0f} MiB per worker): "
            f"reading a Python object writes its reference count, so every page of "
            f"{dataset}'s lists, dicts and strings a worker reads is copied into it "
            "(copy-on-read; pytorch#13246). With more workers or a larger dataset this "
            "multiplies until memory runs out. Keep per-sample metadata in numpy arrays "
            "(or Arrow, or a pack: `trainprof pack`): one buffer, read without writing."
        )
        snippet = (
            "# in the dataset's __init__: one numpy buffer instead of millions of objects\n"
            "self.paths = np.array(paths, dtype=np.bytes_)  # was a list of str\n"
            "self.labels = np.array(labels, dtype=np.int64)  # was a list of int\n"
            "# in __getitem__:\n"
            "path = self.paths[i].decode()"
        )
    else:
        text = (
            "Each worker allocates memory of its own as it runs, after its first batch "
            "(its start-up is not counted; nor are copies of the training process's "
            "memory): a cache inside the dataset, or per-sample buffers kept "
            "alive, held once per worker. Bound the cache, or keep it on disk shared by "
            "all workers (`trainprof.fixes.CachedDataset`)."
        )
        snippet = "dataset = CachedDataset(dataset, \"cache_dir\")  # one on-disk copy for all"
    run = f"trainprof run {ctx.script}"
    verify = (f"{run} after the change: the workers' private memory "
              f"(now {per_worker / MIB:,.0f} MiB each"
              + ("" if copied else " grown after the first batch")
              + ") should fall, and this finding go")
    return Finding(category="memory",
                   cause="worker_copy_on_read" if copied else "worker_memory_growth",
                   title=title, severity=severity, evidence=evidence, estimated_gain=0.0,
                   fix=Fix(text=text, snippet=snippet), verify=verify,
                   verify_commands=(run,))
