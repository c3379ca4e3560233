"""Garbage collection: time the training loop spends in Python's cyclic GC.

None of the peers in expert-rules.md has a GC rule (Scalene splits Python and native
memory but not collector time). trainprof measures it exactly: every collection in
the training thread is timed by a ``gc.callbacks`` hook and counted by generation
(:mod:`trainprof.capture.hooks`), so the GC share is the same time-weighted share as
the rest of the breakdown. The remedy is CPython's own: ``gc.freeze()`` (Python 3.7+)
moves every object alive at that point into a permanent generation that collections
never scan again (the model, the dataset index, imported modules), which makes full
(generation-2) collections cheap; ``gc.set_threshold`` makes young collections rarer.
When the script's own ``gc.collect()`` calls (:mod:`trainprof.capture.explicit_gc`) take
at least :data:`EXPLICIT` of the run's GC time, they are the finding instead
(``explicit_collect``): thresholds do not make them rarer, and each is a full collection.
Collections in the steps where torch.compile compiled are left out: Dynamo collects while
it compiles, a cost of the compilation (:mod:`trainprof.diagnosis.recompile`).
Bands: >= 10% high, >= 3% medium, >= 1% low (the same order as TF's "All Others"
overhead bands, H5, scaled down because GC has a single, cheap fix).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trainprof.diagnosis.context import Context
from trainprof.diagnosis.finding import Finding, Fix, band
from trainprof.diagnosis.registry import rule

HIGH, MEDIUM, LOW = 0.10, 0.03, 0.01
#: Share of the run's GC time in the script's own gc.collect() calls from which those
#: calls are the finding (capture/explicit_gc.py): freezing and thresholds do not stop
#: them.
EXPLICIT = 0.5


def _compiling_gc_s(ctx: Context) -> float:
    """GC seconds of the steady steps in which torch.compile compiled: Dynamo collects
    while it compiles (``gc.collect(1)``), the compilation's cost (diagnosis/recompile.py),
    which gc.freeze() would not remove."""
    steps = set((ctx.summary.get("compiles") or {}).get("steps") or [])
    if not steps or not ctx.has_steps():
        return 0.0
    inside = np.isin(ctx.steady["step"], list(steps))
    return float(ctx.seconds("gc_ns")[inside].sum())


@rule("gc.collector_time")
def collector_time(ctx: Context) -> Finding | None:
    share = float(ctx.breakdown.get("gc") or 0.0)
    compiling = _compiling_gc_s(ctx)
    if compiling > 0 and ctx.total_s > 0:
        share = max(0.0, share - compiling / ctx.total_s)
    severity = band(share, HIGH, MEDIUM, LOW)
    if severity is None:
        return None
    info = ctx.summary.get("gc") or {}
    evidence: dict[str, object] = {
        "gc_share": share,
        "collections_per_step": info.get("collections_per_step"),
        "gen2_per_step": info.get("gen2_per_step"),
        "step_median_s": ctx.step_info.get("median_s"),
    }
    if compiling > 0:
        evidence["gc_while_compiling_s"] = compiling  # left out: torch.compile's
    gen2_fraction = None
    if ctx.has_steps():
        gc_s = ctx.seconds("gc_ns")
        n = int(ctx.steady["gc_n"].sum())
        if n:
            evidence["mean_collection_s"] = float(gc_s.sum()) / n
        full = ctx.steady["gc_gen2_n"] > 0
        if gc_s.sum() > 0:
            gen2_fraction = float(gc_s[full].sum() / gc_s.sum())
            evidence["gc_time_in_steps_with_full_collections"] = gen2_fraction
        group = ctx.spike_groups.get("gc")
        if group is not None:
            evidence["gc_spike_steps"] = ctx.step_numbers(group.indices)[:10]
    explicit = info.get("explicit") or {}
    explicit_s = float(explicit.get("total_s") or 0.0)
    run_gc_s = float(ctx.steps["gc_ns"].sum()) / 1e9 if ctx.has_steps() else 0.0
    if explicit_s > 0 and run_gc_s > 0 and explicit_s >= EXPLICIT * run_gc_s:
        return _explicit_finding(ctx, share, severity, evidence, explicit)
    if gen2_fraction is not None and gen2_fraction >= 0.5:
        cause = "full_collections"
        title = (
            f"Full garbage collections take {share * 100:.1f}% of step time "
            f"({info.get('gen2_per_step') or 0:.2g} per step)"
        )
        text = (
            "Most GC time goes to full (generation 2) collections, which walk every tracked "
            "Python object, including everything built at set-up (model, dataset index, "
            "modules). Call gc.freeze() once set-up is done: those objects are never scanned "
            "again. Raise the thresholds too, so that collections run less often."
        )
    else:
        cause = "frequent_collections"
        title = (
            f"Garbage collection takes {share * 100:.1f}% of step time "
            f"({info.get('collections_per_step') or 0:.2g} collections per step)"
        )
        text = (
            "The loop allocates enough container objects (lists, dicts, per-sample Python "
            "objects) to trigger the cyclic collector every step or two. Raise the "
            "generation-0 threshold so it runs less often, and gc.freeze() after set-up so "
            "each collection has less to scan; creating fewer Python objects per step (numpy "
            "arrays instead of lists of dicts) removes the cause."
        )
    snippet = (
        "import gc\n\n"
        "# after the model, optimizer and dataset are built, before the training loop:\n"
        "gc.collect()\n"
        "gc.freeze()  # set-up objects move to a generation that is never scanned\n"
        "gc.set_threshold(50_000, 50, 100)  # CPython's default is (700, 10, 10)"
    )
    tune = (f"trainprof tune --knob gc_freeze=false,true --knob gc_threshold=700,50000 "
            f"{ctx.script}")
    verify = f"{tune}  (the gc share, now {share * 100:.1f}%, should fall below 1%)"
    return Finding(
        category="gc",
        cause=cause,
        title=title,
        severity=severity,
        evidence=evidence,
        estimated_gain=share,
        fix=Fix(text=text, snippet=snippet),
        verify=verify,
        verify_commands=(tune,),
    )


def _explicit_finding(ctx: Context, share: float, severity: str, evidence: dict[str, object],
                      explicit: dict[str, Any]) -> Finding:
    """The script's own gc.collect() calls: each a full collection (measured at the call)."""
    calls = int(explicit.get("calls") or 0)
    total_s = float(explicit.get("total_s") or 0.0)
    sites = sorted((explicit.get("sites") or {}).items(),
                   key=lambda kv: -float(kv[1].get("total_s") or 0))
    every = explicit.get("every_steps")
    evidence["explicit_collect"] = {
        "calls": calls, "total_s": total_s, "every_steps": every,
        "sites": [site for site, _ in sites[:5]],
    }
    where = ""
    if sites:
        site, entry = sites[0]
        short = site.rsplit("/", 1)[-1]
        code = entry.get("code")
        where = f" at {short}" + (f" (`{code}`)" if code else "")
    pace = f", every {every:.0f} steps" if isinstance(every, int | float) and every >= 1 else ""
    each_ms = total_s / calls * 1e3 if calls else 0.0
    title = (f"gc.collect() called by the script takes {share * 100:.1f}% of step time "
             f"({calls} call{'' if calls == 1 else 's'}{pace}, {each_ms:.0f} ms "
             f"{'' if calls == 1 else 'each'}{where})").replace(" ms  at", " ms at").replace(
                 " ms )", " ms)")
    text = (
        f"The script calls gc.collect() itself{where}: each call is a full collection, which "
        f"walks every tracked Python object (torch's modules, the model, the dataset index), "
        f"{each_ms:.0f} ms here. A tensor is freed when its last reference goes; a "
        "collection frees only objects caught in reference cycles, which CPython's own "
        "collections reach too. Remove the call, or make it rare (once per epoch); where "
        "one must stay, "
        "gc.freeze() after set-up keeps the objects alive then out of every later "
        "collection, which makes each call cheap."
    )
    snippet = (
        "import gc\n\n"
        "# after the model, optimizer and dataset are built, before the training loop:\n"
        "gc.collect()\n"
        "gc.freeze()  # set-up objects are never scanned again, by any collection\n\n"
        "# in the loop: no gc.collect() (or once per epoch)"
    )
    tune = f"trainprof tune --knob explicit_gc=true,false {ctx.script}"
    kept = f"trainprof tune --knob gc_freeze=false,true {ctx.script}"
    verify = (f"{tune}  (false: the script's gc.collect() calls do nothing; the gc share, now "
              f"{share * 100:.1f}%, should fall below 1%); with the calls kept: {kept}")
    return Finding(
        category="gc", cause="explicit_collect", title=title, severity=severity,
        evidence=evidence, estimated_gain=share, fix=Fix(text=text, snippet=snippet),
        verify=verify, verify_commands=(tune, kept),
    )
