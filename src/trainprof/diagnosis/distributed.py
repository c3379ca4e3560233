"""Distributed: ranks of one run that do not keep pace with each other, or share out badly.

DistributedDataParallel's own behaviour (its all-reduce, its settings) is
:mod:`trainprof.diagnosis.ddp`'s. These rules read the merged view of a run recorded as
several ranks (:mod:`trainprof.analysis.ranks`: ``ranks`` and ``rank_spread``); a run of one
process has neither and they stay silent. The trace-based counterparts (exposed
communication, step-time spread across the ranks' traces) are in
:mod:`trainprof.diagnosis.trace_rules`, with the same bands.

* ``straggler_rank``: the ranks' mean step times differ by >= 10% of the slowest
  (30%: high). Ranks that synchronise every step (DDP) have equal means whatever
  their speed, so this fires for ranks that do not keep in step (asynchronous updates, a
  rank that skips or repeats work). Processes that never joined a process group
  (independent trainings side by side) wait for nobody: a low note with no gain.
* ``uneven_input_pipeline``: one rank waits for its batches longer than another by
  >= 5% of the step (10%: medium, 30%: high). Under DDP the step times agree (the
  others wait in the gradient all-reduce, inside backward) but the time one rank
  waits for data is added to every rank's step: the usual straggler. The estimated
  gain is the difference, per step of the main rank.
* ``ranks_oversubscribe_cores``: the ranks on one host ask for more cores than it has:
  each CPU rank's intra-op threads (one for a rank on CUDA: it only launches kernels)
  plus the cores its DataLoader workers were measured to use (ranks at their share of
  threads already, one each say, are over by their workers: the fix is then fewer
  workers a rank, not fewer threads). Every rank sizes its
  thread pool to the whole machine by default; ``torchrun`` sets ``OMP_NUM_THREADS=1``,
  ``torch.multiprocessing.spawn`` does not. The per-process rule
  (:mod:`trainprof.diagnosis.contention`) sees one rank and cannot tell. Gain and
  bands as there: ``compute_share x (1 - cores / demand)``; 20% / 5% / 2%.
* ``every_rank_reads_all_data`` (expert-rules.md D9, "shard early"): a
  DistributedDataParallel (or FSDP) model of two or more ranks whose training DataLoader
  has torch's own sampler (``RandomSampler`` / ``SequentialSampler``: no
  ``DistributedSampler``) over a map-style dataset: every rank iterates the whole
  dataset, so an epoch is ``world_size`` passes over the data and its gradients average
  the same samples' in different orders. Medium from the settings alone: a dataset may
  be split per rank when it is built (a ``Subset`` of the rank's share is left out; a
  class that reads its rank's files cannot be told apart). High when the data shows it:
  all the ranks' first batches have one fingerprint (``rank_data``,
  :func:`trainprof.analysis.ranks.same_data`), whatever the sampler - which also catches
  an ``IterableDataset`` not split by rank, which no setting shows. No step-time gain:
  the steps are as fast, there are ``world_size`` times too many of them.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from trainprof.diagnosis.context import Context
from trainprof.diagnosis.finding import Finding, Fix, band, sweep
from trainprof.diagnosis.iterable_split import split_snippet
from trainprof.diagnosis.registry import rule

VERIFY = ("trainprof run the same launch again and compare the Ranks lines (`trainprof report "
          "RUN_DIR` shows them)")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _by_chance(ci: Any) -> bool:
    """A difference between ranks whose 95% interval (``rank_spread``'s ``*_ci_*``) reaches
    zero: a few long steps or waits of one rank on a busy machine, not its pace. Records
    analysed before the intervals existed have none: judged on the difference alone."""
    return isinstance(ci, list) and len(ci) == 2 and not float(ci[0]) > 0


@rule("distributed.straggler_rank")
def straggler_rank(ctx: Context) -> Finding | None:
    spread = ctx.summary.get("rank_spread") or {}
    pct = float(spread.get("spread_pct") or 0.0) / 100.0
    severity = band(pct, 0.30, 0.10)
    if severity is None:
        return None
    ci = spread.get("spread_ci_pct")
    if _by_chance(ci):
        return None  # a few slow steps of one rank: not its pace
    slow, fast = spread.get("slowest_rank"), spread.get("fastest_rank")
    rows = ctx.summary.get("ranks") or []
    if rows and not any(isinstance(r.get("world_size"), int) and r["world_size"] > 1
                        for r in rows if isinstance(r, dict)):
        return _independent_processes(pct, slow, fast, spread, ci)
    return Finding(
        category="distributed",
        cause="straggler_rank",
        title=(f"Rank {slow} takes {pct * 100:.0f}% longer per step than rank {fast}: "
               "the ranks do not keep in step"),
        severity=severity,
        evidence={"mean_step_s": spread.get("mean_step_s"), "spread": pct,
                  **({"spread_ci_pct": ci} if isinstance(ci, list) else {})},
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


def _independent_processes(pct: float, slow: Any, fast: Any, spread: dict[str, Any],
                           ci: Any) -> Finding:
    """Processes of one run that never joined a process group (``multiprocessing`` trials
    side by side): none waits for another, so the slower one costs the others nothing; the
    run lasts as long as the slowest. A low note with no gain: two independent trainings
    had read "[high] Rank 1 takes 66% longer per step ... could save up to 66%", "at every
    collective the others wait for it", with no collective in the script."""
    return Finding(
        category="distributed",
        cause="straggler_rank",
        title=(f"Process {slow} takes {pct * 100:.0f}% longer per step than process {fast}; "
               "they do not communicate (no torch.distributed), so neither waits for the "
               "other"),
        severity="low",
        evidence={"mean_step_s": spread.get("mean_step_s"), "spread": pct,
                  "independent_processes": True,
                  **({"spread_ci_pct": ci} if isinstance(ci, list) else {})},
        estimated_gain=0.0,
        fix=Fix(
            text=(
                f"The run lasts as long as its slowest process. Compare process {slow}'s "
                f"record (`trainprof report RUN_DIR/ranks/{slow}`) with process {fast}'s: "
                "more or heavier work, a slower input pipeline, or the cores they share "
                "(each process's CPU threads sized to the whole machine oversubscribe it: "
                "set OMP_NUM_THREADS to the cores per process)."
            ),
        ),
        verify=f"{VERIFY}: the spread of mean step times (now {pct * 100:.0f}%) should fall",
    )


def _even_loading_snippet(loader: dict[str, Any] | None) -> str:
    """The same loading on every rank, written where the script sets it up.

    A script of its own builds the DistributedSampler and the DataLoader; Hugging Face's
    Trainer and PyTorch Lightning add the sampler themselves (``driven_by``, recorded with
    the loader), so the fix there is the loader's settings alone.
    """
    by = (loader or {}).get("driven_by")
    if by == "transformers.Trainer":
        return ("args = TrainingArguments(\n"
                "    ...,  # your arguments, unchanged; the Trainer shards the data itself\n"
                "    dataloader_num_workers=workers_per_rank,\n"
                "    dataloader_persistent_workers=True,\n"
                ")")
    if by == "lightning":
        return ("# Lightning adds a DistributedSampler itself (Trainer(use_distributed_sampler="
                "True), the default)\n"
                "loader = DataLoader(dataset, batch_size=per_rank_batch,\n"
                "                    num_workers=workers_per_rank, persistent_workers=True)")
    return ("sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank)\n"
            "loader = DataLoader(dataset, batch_size=per_rank_batch, sampler=sampler,\n"
            "                    num_workers=workers_per_rank, persistent_workers=True)")


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
    ci = spread.get("data_wait_spread_ci_s")
    if _by_chance(ci):
        return None  # a few long waits of one rank: not its pace
    most, least = spread.get("most_data_wait_rank"), spread.get("least_data_wait_rank")
    waits = spread.get("data_wait_s") or {}
    return Finding(
        category="distributed",
        cause="uneven_input_pipeline",
        title=(f"Rank {most} waits {_ms(float(waits.get(most, 0.0)))} per step for data, rank "
               f"{least} {_ms(float(waits.get(least, 0.0)))}: every rank waits for rank {most}"),
        severity=severity,
        evidence={"data_wait_s_per_step": waits, "difference_s": float(extra),
                  **({"difference_ci_s": ci} if isinstance(ci, list) else {}),
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
            snippet=_even_loading_snippet(ctx.train_loader),
        ),
        verify=f"{VERIFY}: the ranks' data wait per step should agree within 5% of the step "
        f"(now {share * 100:.0f}% apart)",
    )


@rule("distributed.ranks_oversubscribe_cores")
def ranks_oversubscribe_cores(ctx: Context) -> Finding | None:
    rows = [r for r in ctx.summary.get("ranks") or [] if r.get("steps")]
    hosts = Counter(r.get("host") for r in rows)
    if not hosts:
        return None
    host, n = hosts.most_common(1)[0]
    mine = [r for r in rows if r.get("host") == host]
    cores = ctx.cores
    if n < 2 or not cores or any(not isinstance(r.get("torch_num_threads"), int) for r in mine):
        return None
    threads = sum(1 if r.get("on_cuda") else int(r["torch_num_threads"]) for r in mine)
    worker_cores = sum(float(r.get("workers_cpu_pct") or 0.0) for r in mine) / 100.0
    demand = threads + worker_cores
    if demand <= cores:
        return None
    gain = ctx.compute_share * (1 - cores / demand)
    severity = band(gain, 0.20, 0.05, 0.02)
    if severity is None:
        return None
    per_rank = max(1, math.floor((cores - worker_cores) / n)) if not ctx.on_cuda else 1
    current = max(int(r["torch_num_threads"]) for r in mine)
    evidence = {"ranks_on_host": n, "usable_cores": cores, "intra_op_threads": threads,
                "worker_cores_used": worker_cores, "core_demand": demand,
                "compute_share": ctx.compute_share}
    title = (f"{n} ranks on one host ask for {demand:.1f} cores ({threads} intra-op threads"
             + (f", {worker_cores:.1f} cores of DataLoader workers" if worker_cores else "")
             + f") of its {cores}: their math waits for a core")
    if per_rank >= current:
        # the threads are at their share already (one each, say): what is over the
        # cores is the DataLoader workers' - fewer of them, not fewer threads
        return _workers_over_cores(ctx, n, cores, threads, worker_cores, current, title,
                                   severity, gain, evidence)
    threads_sweep = ",".join(str(v) for v in sorted(set(sweep(per_rank, current))))
    tune = f"trainprof tune --knob torch_threads={threads_sweep} {ctx.script}"
    return Finding(
        category="distributed",
        cause="ranks_oversubscribe_cores",
        title=title,
        severity=severity,
        evidence=evidence,
        estimated_gain=gain,
        fix=Fix(
            text=(
                f"Each rank sizes its thread pool for the whole machine, so {n} ranks run "
                f"{threads} op threads on {cores} cores and wait for each other at every "
                f"op. Give each rank its share: {per_rank} thread"
                f"{'s' if per_rank > 1 else ''} per rank (torchrun sets OMP_NUM_THREADS=1 "
                "for this reason; torch.multiprocessing.spawn does not), counting the "
                "DataLoader workers in the same budget."
            ),
            snippet=(
                "def train(rank, world_size):\n"
                f"    torch.set_num_threads({per_rank})  # {cores} cores / {n} ranks on this host\n"
                "    ..."
            ),
        ),
        verify=f"{tune} (the knob applies in every rank)",
        verify_commands=(tune,),
    )


def _workers_over_cores(ctx: Context, n: int, cores: int, threads: int, worker_cores: float,
                        current: int, title: str, severity: str, gain: float,
                        evidence: dict[str, Any]) -> Finding | None:
    """The ranks' threads are at their share: the DataLoader workers take the cores over.

    Each rank's workers get the cores its threads leave, ``(cores - threads) / n``; the
    suggested count scales a rank's workers (rank 0's settings: every rank runs the same
    loop) by that budget over what they were measured to use. A rank's workers are those
    of all the loaders it iterates together (``zip(a, b)``; :attr:`Context.concurrent_workers`,
    as the per-process rule counts them): the measured cores are all of theirs.
    """
    nw = ctx.concurrent_workers
    if nw <= 0 or worker_cores <= 0:
        return None
    budget = max(0.0, cores - threads) / n
    suggested = max(0, min(nw - 1, math.floor(nw * budget / (worker_cores / n))))
    together = max(ctx.loader_groups, key=lambda g: sum(int(d.get("num_workers") or 0)
                                                        for d in g))
    of_loaders = (f" (of the {len(together)} DataLoaders it iterates together, in all)"
                  if len(together) > 1 else "")
    text = (
        f"The {n} ranks run {current} op thread{'s' if current > 1 else ''} each already "
        f"({threads} on {cores} cores); their DataLoader workers use {worker_cores:.1f} cores "
        "more, so the workers and the ranks' math take turns on the cores. Each rank's "
        f"workers have {budget:.1f} cores beside its threads: {suggested} workers a rank "
        f"instead of {nw}{of_loaders} (as few as keep the data wait down; a worker costs "
        "more than it saves where samples are cheap), or fewer ranks on this host."
    )
    extra: dict[str, Any] = {"num_workers": nw, "suggested_num_workers": suggested}
    if len(together) > 1:
        # the tune knob sets every loader's num_workers: an equal share each, against the
        # script's own settings
        each = suggested // len(together)
        now = ", ".join(str(int(d.get("num_workers") or 0)) for d in together)
        snippet = (f"# each of the {len(together)} loaders iterated together: {each} workers "
                   f"({each * len(together)} a rank in all, now {nw}: {now})\n"
                   f"loader = DataLoader(dataset, ..., num_workers={each})  # {n} ranks' "
                   f"workers within {cores} cores")
        knob = f"{each},script"
        extra["loaders_iterated_together"] = [d.get("index") for d in together]
    else:
        snippet = (f"loader = DataLoader(dataset, ..., num_workers={suggested})  # was {nw}: "
                   f"{n} ranks' workers within {cores} cores")
        knob = f"{suggested},{nw}"
    tune = f"trainprof tune --knob num_workers={knob} {ctx.script}"
    return Finding(
        category="distributed", cause="ranks_oversubscribe_cores", title=title,
        severity=severity, evidence={**evidence, **extra},
        estimated_gain=gain, fix=Fix(text=text, snippet=snippet),
        verify=f"{tune} (the knob applies in every rank)",
        verify_commands=(tune,),
    )


#: Model wrappers that shard the data across ranks by contract: each rank needs its own.
DATA_PARALLEL_ROOTS = ("DistributedDataParallel", "FullyShardedDataParallel")
#: The samplers torch's DataLoader makes itself (``shuffle=True`` / the default).
DEFAULT_SAMPLERS = ("sampler.RandomSampler", "sampler.SequentialSampler")


@rule("distributed.every_rank_reads_all_data")
def every_rank_reads_all_data(ctx: Context) -> Finding | None:
    world = int((ctx.summary.get("distributed") or {}).get("world_size") or 0)
    root = forward_root(ctx, DATA_PARALLEL_ROOTS)
    loader = ctx.train_loader
    if world < 2 or root is None or loader is None:
        return None
    proof = ctx.summary.get("rank_data") or {}
    same = [str(r) for r in proof.get("identical_ranks") or []]
    # every rank compared: tensor-parallel peers load the same batch by design, and are
    # only some of the ranks (the data-parallel groups differ)
    proven = (len(same) >= 2 and len(same) == proof.get("ranks_compared")
              and proof.get("loader_index") == loader.get("index"))
    sampler = str(loader.get("sampler") or "")
    batch_sampler = str(loader.get("batch_sampler") or "")
    iterable = bool(loader.get("iterable_dataset"))
    unsharded = not (  # a sampler of its own (or a framework's), or a dataset cut per rank
        iterable or loader.get("driven_by") or not sampler.endswith(DEFAULT_SAMPLERS)
        or (batch_sampler and not batch_sampler.endswith("sampler.BatchSampler"))
        or str(loader.get("dataset") or "").endswith("Subset"))
    if not (proven or unsharded):
        return None
    wrapper = root.rsplit(".", 1)[-1]
    evidence: dict[str, Any] = {
        "world_size": world,
        "wrapper": wrapper,
        "sampler": sampler,
        "loader": {k: loader.get(k) for k in ("index", "dataset", "len", "batch_size",
                                              "num_workers", "iterable_dataset")},
    }
    if proven:
        evidence["identical_first_batch_ranks"] = same
        evidence["ranks_compared"] = proof.get("ranks_compared")
    name = str(loader.get("dataset") or "").rsplit(".", 1)[-1] or "the dataset"
    ranks_txt = f"ranks {', '.join(same)}" if len(same) < world else f"all {world} ranks"
    intro = f"The model is wrapped in {wrapper} over {world} ranks"
    if iterable:
        title, text, snippet = _stream_per_rank_fix(name, intro, ranks_txt, world)
    else:
        title, text, snippet = _sampler_fix(loader, name, intro, ranks_txt, world, proven,
                                            unsharded)
    return Finding(
        category="distributed", cause="every_rank_reads_all_data", title=title,
        severity="high" if proven else "medium", evidence=evidence, estimated_gain=0.0,
        fix=Fix(text=text, snippet=snippet),
        verify=(f"trainprof run {ctx.script}: this finding is gone, and the steps of an epoch "
                f"fall to 1/{world}"),
        verify_commands=(f"trainprof run {ctx.script}",),
    )


def _stream_per_rank_fix(name: str, intro: str, ranks_txt: str,
                         world: int) -> tuple[str, str, str]:
    """An IterableDataset every rank iterates whole (shown by the ranks' first batches)."""
    title = (f"The first batches of {name} are identical on {ranks_txt}: the "
             "IterableDataset is not split by rank, so every rank trains on the same data")
    text = (
        f"{intro}, and the training data is {name}, an IterableDataset: every rank runs "
        f"its __iter__, and the first batches of {ranks_txt} were identical (the data "
        "itself, compared by a hash). Each rank yields the whole stream: the ranks' "
        f"gradients average the same samples, and a pass over the data takes {world} "
        "times the work. Split the stream by rank as well as by worker "
        "(torch.distributed.get_rank() and get_world_size(), with get_worker_info() in "
        "each worker): by its files first, so that each worker of each rank reads only "
        "its own; by sample only for a single source."
    )
    return title, text, split_snippet(name, by_rank=True)


def _sampler_fix(loader: dict[str, Any], name: str, intro: str, ranks_txt: str, world: int,
                 proven: bool, unsharded: bool) -> tuple[str, str, str]:
    """A map-style loader with the same indices on every rank: a DistributedSampler."""
    sampler = str(loader.get("sampler") or "")
    length = loader.get("len")
    size = f" ({length:,} samples)" if isinstance(length, int) else ""
    if proven:
        title = (f"The first batches of {name} are identical on {ranks_txt}: every rank "
                 "trains on the same data" + (" (no DistributedSampler)" if unsharded else ""))
        how = (f"the first batches of {ranks_txt} were identical (the data itself, compared "
               "by a hash): the ranks draw the same indices")
    else:
        title = (f"Each of the {world} ranks iterates all of {name}{size}: the DataLoader has "
                 f"no DistributedSampler, so an epoch is {world} passes over the data")
        how = (f"unless {name} holds only this rank's share (split when it was built), every "
               "rank trains on every sample")
    own = ", torch's own, which covers the whole dataset in every rank" if unsharded else ""
    shuffle = not sampler.endswith("SequentialSampler")
    text = (
        f"{intro}, and the training DataLoader draws its indices with "
        f"{sampler.rsplit('.', 1)[-1] or 'its sampler'}{own}; {how}. An epoch takes {world} "
        "times the steps it should, and the ranks' gradients average the same samples. A "
        "DistributedSampler gives each rank its own 1/world_size of the indices (shuffled "
        "per epoch with set_epoch); the batch size stays per rank."
    )
    snippet = (
        "from torch.utils.data.distributed import DistributedSampler\n\n"
        f"sampler = DistributedSampler(dataset, shuffle={shuffle})  # this rank's share\n"
        f"loader = DataLoader(dataset, batch_size={loader.get('batch_size') or 'B'}, "
        "sampler=sampler, ...)  # no shuffle= with a sampler\n"
        "for epoch in range(epochs):\n"
        "    sampler.set_epoch(epoch)  # a new order each epoch, the same on every rank\n"
        "    for batch in loader:\n"
        "        ..."
    )
    return title, text, snippet


def forward_root(ctx: Context, names: tuple[str, ...]) -> str | None:
    """The first forward root (the model's class) whose class name is one of ``names``."""
    roots = ctx.summary.get("forward_roots") or []
    return next((r for r in roots if isinstance(r, str) and r.rsplit(".", 1)[-1] in names),
                None)
