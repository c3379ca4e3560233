"""Too few intra-op threads: a CPU run whose math leaves cores idle.

The mirror image of :mod:`trainprof.diagnosis.contention`. On a CPU run the model's
ops (matmuls, convolutions, element-wise kernels) split over torch's intra-op pool,
``torch.get_num_threads()``. A pool smaller than the usable cores leaves them idle
while the math runs: ``OMP_NUM_THREADS=1`` exported by a launcher (``torchrun`` sets
it for every worker when several share a node, and warns), a job script, or a
``torch.set_num_threads(1)`` meant for DataLoader workers and left in the training
process. Seen here: a compute-bound MLP (97% of its step in forward and backward) on
1 thread of 2 usable cores, the machine 50% busy; ``trainprof tune --knob
torch_threads=1,2`` measured x0.54 of the step with 2 (3 trials each, 95% CI
x0.51-x0.56).

The fix is a larger pool, up to the cores that are idle while the loop runs (the
workers' cores left to them), and no further than the usable cores' physical share:
torch's own default is one thread per physical core, and a hyperthread sibling adds
little to the math. The gain claimed is Amdahl's bound with the math as
the parallel part: ``compute_share x (1 - T / T')`` for ``T`` threads now and ``T'``
proposed; ops too small to split gain less, which the verify sweep measures.
Not on CUDA runs, where the host needs about one thread to launch the device's work.
Ranks that share a host share its cores: the pool is not pushed past a rank's share of
them (the ranks on the host in a merged launch, else the process group's world size, an
upper bound), so that two ranks of one thread each on 2 cores, one of them idle while it
waits for the other, are not told to take both cores each.
Bands as the contention rule's: >= 20% high, >= 5% medium, >= 2% low.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from trainprof.diagnosis.context import Context
from trainprof.diagnosis.finding import Finding, Fix, band
from trainprof.diagnosis.registry import rule

HIGH, MEDIUM, LOW = 0.20, 0.05, 0.02
#: Idle cores (measured) from which a larger pool is proposed.
MIN_IDLE_CORES = 0.75


@rule("cpu_threads.too_few_threads")
def too_few_threads(ctx: Context) -> Finding | None:
    cores = ctx.cores
    threads = ctx.environment.get("torch_num_threads")
    if ctx.on_cuda or not cores or not isinstance(threads, int) or threads <= 0:
        return None
    # torch's own default is the physical cores: a hyperthread sibling adds little to
    # a matmul (and can slow it), so the pool is not pushed past them
    physical, logical = (ctx.environment.get("physical_cores"),
                         ctx.environment.get("logical_cores"))
    cap = cores
    if (isinstance(physical, int) and isinstance(logical, int)
            and 0 < physical < logical):
        cap = max(1, round(cores * physical / logical))
    ranks = _ranks_on_host(ctx)
    if ranks > 1:
        cap = max(1, cap // ranks)
    if threads >= cap:
        return None
    sysinfo = ctx.system
    proc = sysinfo.get("proc_cpu_pct")
    if not isinstance(proc, int | float):
        return None
    workers = float(sysinfo.get("workers_cpu_pct") or 0.0) / 100
    idle = cores - proc / 100 - workers
    if isinstance(sysinfo.get("sys_cpu_pct"), int | float):
        # cores nobody uses: other processes' load counts against the pool too
        idle = min(idle, cores * (1 - sysinfo["sys_cpu_pct"] / 100))
    if idle < MIN_IDLE_CORES:
        return None
    # the workers keep the cores they use (a quarter of a core is not one); the pool
    # grows by the idle cores, rounded up from three quarters
    workers_keep = math.ceil(workers - 0.25) if workers > 0.25 else 0
    target = min(cap - workers_keep, threads + math.floor(idle + 0.25))
    if target <= threads:
        return None
    compute = ctx.compute_share
    gain = compute * (1 - threads / target)
    severity = band(gain, HIGH, MEDIUM, LOW)
    if severity is None:
        return None
    env = ctx.environment.get("thread_env") or {}
    evidence: dict[str, Any] = {
        "torch_num_threads": threads,
        "usable_cores": cores,
        "max_threads": cap,
        "idle_cores": idle,
        "compute_share": compute,
        "proc_cpu_pct": proc,
        "proposed_threads": target,
    }
    if workers:
        evidence["worker_cores_used"] = workers
    if env:
        evidence["thread_env"] = env
    plural = "thread" if threads == 1 else "threads"
    title = (f"PyTorch runs the model's ops on {threads} {plural} while {idle:.1f} of "
             f"{cores} usable cores are idle (up to {gain * 100:.0f}% of step time)")
    text = (
        f"The math takes {compute * 100:.0f}% of step time, and torch splits each op over "
        f"{threads} intra-op {plural} (torch.get_num_threads()), while the training "
        f"process uses {proc:.0f}% CPU (100% = one core) and {idle:.1f} of the {cores} usable "
        "cores stay idle. "
        f"Give the pool those cores: {target} threads"
        + (f" (the DataLoader workers keep {workers:.1f} cores)" if workers > 0.25 else "")
        + "."
    )
    where = ", ".join(f"{k}={v}" for k, v in env.items())
    by_script = ctx.environment.get("thread_env_by_script") or []
    if where and by_script and set(env) <= set(by_script):
        text += (f" The script sets {where} itself (os.environ, before it imports torch): "
                 "torch sizes its pool from it.")
    elif where:
        text += (f" The environment sets {where}: a launcher or job script exported it; "
                 "torch sizes its pool from it.")
    else:
        text += " Look for a torch.set_num_threads call in the script or a library it uses."
    snippet = (
        f"torch.set_num_threads({target})  # first thing in the script (was {threads})\n"
        f"# or, from outside: OMP_NUM_THREADS={target} python {ctx.script}"
    )
    verify = f"trainprof tune --knob torch_threads={threads},{target} {ctx.script}"
    return Finding(
        category="compute", cause="too_few_threads", title=title, severity=severity,
        evidence=evidence, estimated_gain=gain, fix=Fix(text=text, snippet=snippet),
        verify=verify, verify_commands=(verify,),
    )


def _ranks_on_host(ctx: Context) -> int:
    """Ranks sharing this host: the most on one host among a merged launch's ranks, else
    the process group's world size (an upper bound: a rank's own record), else 1."""
    rows = [r for r in ctx.summary.get("ranks") or [] if isinstance(r, dict)]
    if rows:
        hosts = Counter(r.get("host") for r in rows)
        return hosts.most_common(1)[0][1]
    dist = ctx.summary.get("distributed") or {}
    size = dist.get("world_size") if isinstance(dist, dict) else None
    return size if isinstance(size, int) and size > 1 else 1
