"""Distributed: ranks of one run that do not keep pace with each other.

These rules read the merged view of a run recorded as several ranks
(:mod:`trainprof.analysis.ranks`: ``ranks`` and ``rank_spread``); a run of one
process has neither and they stay silent. The trace-based counterparts (exposed
communication, step-time spread across the ranks' traces) are in
:mod:`trainprof.diagnosis.trace_rules`, with the same bands.

* ``straggler_rank``: the ranks' mean step times differ by >= 10% of the slowest
  (30%: high). Ranks that synchronise every step (DDP) have equal means whatever
  their speed, so this fires for ranks that do not keep in step (independent
  processes, asynchronous updates, a rank that skips or repeats work).
* ``uneven_input_pipeline``: one rank waits for its batches longer than another by
  >= 5% of the step (10%: medium, 30%: high). Under DDP the step times agree (the
  others wait in the gradient all-reduce, inside backward) but the time one rank
  waits for data is added to every rank's step: the usual straggler. The estimated
  gain is the difference, per step of the main rank.
"""

from __future__ import annotations

from typing import Any

from trainprof.diagnosis.context import Context
from trainprof.diagnosis.finding import Finding, Fix, band
from trainprof.diagnosis.registry import rule

VERIFY = ("trainprof run the same launch again and compare the Ranks lines (`trainprof report "
          "RUN_DIR` shows them)")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


@rule("distributed.straggler_rank")
def straggler_rank(ctx: Context) -> Finding | None:
    spread = ctx.summary.get("rank_spread") or {}
    pct = float(spread.get("spread_pct") or 0.0) / 100.0
    severity = band(pct, 0.30, 0.10)
    if severity is None:
        return None
    slow, fast = spread.get("slowest_rank"), spread.get("fastest_rank")
    return Finding(
        category="distributed",
        cause="straggler_rank",
        title=(f"Rank {slow} takes {pct * 100:.0f}% longer per step than rank {fast}: "
               "the ranks do not keep in step"),
        severity=severity,
        evidence={"mean_step_s": spread.get("mean_step_s"), "spread": pct},
        estimated_gain=pct,
        fix=Fix(
            text=(
                f"Compare rank {slow}'s line and record (`trainprof report "
                f"RUN_DIR/ranks/{slow}`) with rank {fast}'s: uneven data (sequence lengths, "
                "shard sizes), a slower input pipeline or a busier host (other jobs, fewer "
                "cores, CPU threads that oversubscribe the machine: set OMP_NUM_THREADS to "
                "the cores per rank) make one rank late, and at every collective the others "
                "wait for it."
            ),
        ),
        verify=f"{VERIFY}: the spread of mean step times (now {pct * 100:.0f}%) should fall "
        "under 10%",
    )


@rule("distributed.uneven_input_pipeline")
def uneven_input_pipeline(ctx: Context) -> Finding | None:
    spread: dict[str, Any] = ctx.summary.get("rank_spread") or {}
    extra = spread.get("data_wait_spread_s")
    step = ctx.step_info.get("median_s")
    if not extra or not step:
        return None
    share = float(extra) / float(step)
    severity = band(share, 0.30, 0.10, 0.05)
    if severity is None:
        return None
    most, least = spread.get("most_data_wait_rank"), spread.get("least_data_wait_rank")
    waits = spread.get("data_wait_s") or {}
    return Finding(
        category="distributed",
        cause="uneven_input_pipeline",
        title=(f"Rank {most} waits {_ms(float(waits.get(most, 0.0)))} per step for data, rank "
               f"{least} {_ms(float(waits.get(least, 0.0)))}: every rank waits for rank {most}"),
        severity=severity,
        evidence={"data_wait_s_per_step": waits, "difference_s": float(extra),
                  "step_median_s": float(step), "difference_share": share},
        estimated_gain=min(1.0, share),
        fix=Fix(
            text=(
                f"The ranks load their batches at different speeds, and in synchronous "
                f"training the fastest waits for the slowest at every gradient all-reduce, "
                f"so rank {most}'s extra wait is paid by all. Give every rank the same "
                "loading setup (num_workers per rank, the same storage), shard the data "
                "evenly (DistributedSampler, equal shard sizes), and check that the ranks "
                f"on one host do not share too few cores (`trainprof report "
                f"RUN_DIR/ranks/{most}` shows that rank's loading and CPU)."
            ),
            snippet=(
                "sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank)\n"
                "loader = DataLoader(dataset, batch_size=per_rank_batch, sampler=sampler,\n"
                "                    num_workers=workers_per_rank, persistent_workers=True)"
            ),
        ),
        verify=f"{VERIFY}: the ranks' data wait per step should agree within 5% of the step "
        f"(now {share * 100:.0f}% apart)",
    )
