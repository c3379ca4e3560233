"""DistributedDataParallel's own behaviour: how it all-reduces the gradients, and its settings.

Read from one rank's record (each rank runs the same loop) and, for the all-reduce's time,
from DDP's own timing of its iterations (:mod:`trainprof.analysis.ddp`), merged over the
ranks where there are several.

* ``allreduce_every_micro_step`` (expert-rules.md D4: the tuning guide, Hugging Face):
  a DistributedDataParallel model trained with gradient accumulation - more than one
  ``backward()`` per optimizer step, counted by the op count's window - while the
  script never entered ``model.no_sync()``: DDP all-reduces the gradients at every
  micro-batch's backward, where only the last one's is needed. Read from one rank's
  record (each rank runs the same loop). No gain is claimed: the all-reduce's time
  is inside backward (a ``--deep`` window shows it as communication), so the finding
  is low and says so (``gain_unknown``); the saving is ``(k - 1) / k`` of the
  all-reduces for ``k`` micro-batches a step.
* ``exposed_communication`` (expert-rules.md D1: the TensorBoard plugin's communication
  share, bands 10% / 20% as the trace rule's): DDP's gradient all-reduce that the step waits
  for once its backward compute is done, from DDP's own timing
  (:mod:`trainprof.analysis.ddp`; no trace needed), on the rank that waits least - a
  straggler's delay shows as every other rank's communication. Only DDP's samples past
  its first ten iterations, or three of them at least, and only iterations no longer
  than the steady step allows (analysis.ddp's ``exposed_share``: a sampled warm-up
  iteration set against the steady median step once read "397% of step"; a share is
  never above 1, and none is given from such samples). The fix follows the numbers: Gloo
  on GPUs -> NCCL; an all-reduce shorter than the backward compute -> smaller buckets
  (the first starts sooner); else fewer all-reduces (``no_sync()`` accumulation, a larger
  batch per rank) or 16-bit gradients - which two Gloo ranks of one host measured slower
  (the casts cost more than the bytes saved), so the text says to measure it with the
  ``ddp_comm_hook`` / ``ddp_bucket_cap_mb`` knobs. Where the fix is fewer all-reduces, a
  code change, the verify line leads with it and the ``ddp_comm_hook`` knob comes after as
  an aside: ``trainprof verify`` then judges the knob, not the finding (led by the knob,
  it called the finding "refuted" when 16-bit gradients cost more than they saved).
* ``find_unused_parameters`` (expert-rules.md D5's flag; DDP's own runtime warning): a
  DDP model built with ``find_unused_parameters=True`` whose sampled iterations found no
  unused parameter. Low, no gain claimed (the graph walk is not timed on its own); the
  ``ddp_find_unused_parameters`` knob measures it.
"""

from __future__ import annotations

from typing import Any

from trainprof.analysis.ddp import judgeable
from trainprof.diagnosis.context import Context, number
from trainprof.diagnosis.distributed import forward_root
from trainprof.diagnosis.finding import Finding, Fix, band
from trainprof.diagnosis.registry import rule


@rule("distributed.allreduce_every_micro_step")
def allreduce_every_micro_step(ctx: Context) -> Finding | None:
    ddp = forward_root(ctx, ("DistributedDataParallel",))
    if ddp is None or ctx.summary.get("ddp_no_sync_calls") != 0:
        return None  # not DDP, no_sync used, or a record from before the count
    world = int((ctx.summary.get("distributed") or {}).get("world_size") or 0)
    backward = float((ctx.summary.get("ops") or {}).get("backward_per_step") or 0.0)
    k = round(backward)
    if world < 2 or k < 2:
        return None
    evidence = {
        "backward_per_step": backward,
        "world_size": world,
        "no_sync_calls": 0,
        "allreduces_not_needed_per_step": k - 1,
        "gain_unknown": True,
    }
    title = (f"DDP all-reduces the gradients at each of {k} backward() calls a step "
             "(gradient accumulation without model.no_sync()): only the last is needed")
    text = (
        f"Each optimizer step takes {k} backward() calls, and the model is wrapped in "
        "DistributedDataParallel, which all-reduces every gradient across the "
        f"{world} ranks during each backward unless it runs inside model.no_sync(). The "
        f"first {k - 1} all-reduces of every step are thrown away: the gradients keep "
        "accumulating locally and the last backward's all-reduce carries their sum. Run "
        "the micro-batches but the last under model.no_sync() (Hugging Face Accelerate's "
        "accelerator.accumulate() and Lightning's accumulate_grad_batches do). The "
        "saving is that communication: a --deep window shows its time."
    )
    snippet = _no_sync_snippet(k)
    run = f"trainprof run {ctx.script}"
    verify = (f"re-run `{run}` with no_sync() and `trainprof compare` the two runs (or "
              "`trainprof run --deep` on each: the communication time should fall by about "
              f"{(k - 1) / k:.0%})")
    return Finding(category="distributed", cause="allreduce_every_micro_step", title=title,
                   severity="low", evidence=evidence, estimated_gain=0.0,
                   fix=Fix(text=text, snippet=snippet), verify=verify,
                   verify_commands=(run,))


def _no_sync_snippet(k: int) -> str:
    """Gradient accumulation over ``k`` micro-batches with one all-reduce (DDP's no_sync)."""
    return (
        "import contextlib\n"
        f"accum = {k}\n"
        "for i, (x, y) in enumerate(loader):\n"
        "    last = (i + 1) % accum == 0\n"
        "    with contextlib.nullcontext() if last else model.no_sync():\n"
        "        loss = criterion(model(x), y) / accum\n"
        "        loss.backward()\n"
        "    if last:\n"
        "        opt.step()\n"
        "        opt.zero_grad()"
    )


#: Exposed communication bands (the TensorBoard plugin flags communication above 10% of the
#: step; the trace rule uses the same bands).
COMM_HIGH, COMM_MEDIUM = 0.20, 0.10


def _mib(n: Any) -> str:
    return f"{float(n) / 2**20:.1f} MiB" if isinstance(n, int | float) else "?"


@rule("distributed.exposed_communication")
def exposed_communication(ctx: Context) -> Finding | None:
    # DDP's figures past its first ten iterations (bucket rebuilding, caches warming, one
    # sample a second read of those), or three of those at least: a 30-step run's single
    # sample of iteration 10 once put 39% on the all-reduce (--deep measures a short run)
    # Only models whose share of the step could be given (analysis.ddp: exposed_share is
    # None where DDP's sampled iterations ran far longer than the steady step - a warm-up
    # iteration 10 in trainprof's op-count window once read "397% of step").
    models = [m for m in ctx.summary.get("ddp") or []
              if isinstance(m, dict) and isinstance(m.get("exposed_ms"), int | float)
              and isinstance(m.get("exposed_share"), int | float) and judgeable(m)]
    step = number(ctx.step_info.get("median_s"))
    if not models or not step:
        return None
    exposed_s = sum(float(m["exposed_ms"]) for m in models) / 1e3
    share = sum(float(m["exposed_share"]) for m in models)
    # every rank waits in the all-reduce for the slowest one: a fast rank's "communication"
    # holds the straggler's delay (uneven_input_pipeline's finding). The rank that waits
    # least shows the communication itself.
    per_rank = {str(r.get("label")): float(r["ddp_exposed_comm_s"])
                for r in ctx.summary.get("ranks") or []
                if isinstance(r.get("ddp_exposed_comm_s"), int | float)}
    rank_share = {str(r.get("label")): float(r["ddp_exposed_share"])
                  for r in ctx.summary.get("ranks") or []
                  if isinstance(r.get("ddp_exposed_share"), int | float)}
    least = None
    if len(per_rank) >= 2:
        least = min(per_rank, key=lambda k: per_rank[k])
        exposed_s = per_rank[least]
        share = rank_share.get(least, exposed_s / step)
    if share > 1.0:  # figures of no steady step: nothing to report (never "397% of step")
        return None
    severity = band(share, COMM_HIGH, COMM_MEDIUM)
    if severity is None:
        return None
    m = max(models, key=lambda x: float(x["exposed_ms"]))
    comm, overlap, bwd = (float(m.get(k) or 0.0) for k in
                          ("comm_ms", "overlap_ms", "backward_compute_ms"))
    buckets = int(m.get("buckets") or 0)
    backend = str(m.get("backend") or "?")
    world = m.get("world_size")
    evidence: dict[str, Any] = {
        "exposed_communication_share": share,
        "exposed_ms": exposed_s * 1e3,
        "allreduce_ms": comm,
        "overlapped_ms": overlap,
        "backward_compute_ms": bwd,
        "step_median_s": step,
        "gradient_bytes": m.get("gradient_bytes"),
        "buckets": buckets or None,
        "bucket_cap_bytes": m.get("bucket_cap_bytes"),
        "backend": backend,
        "world_size": world,
        "comm_hook": m.get("comm_hook"),
        "ddp_iterations_sampled": m.get("iterations"),
    }
    if least is not None:
        evidence["rank_waiting_least"] = least
        evidence["exposed_s_per_rank"] = per_rank
    where = (f" (rank {least}, the one that waits least: the others' wait also holds the "
             "slowest rank's delay)" if least is not None else "")
    sampled = list(m.get("iterations") or [])
    text = (
        f"DDP's own timing (its reducer's, on sampled iteration{'s' if len(sampled) != 1 else ''}"
        f" {', '.join(map(str, sampled[:5]))}): the all-reduce of the "
        f"{_mib(m.get('gradient_bytes'))} of "
        f"gradients over {world} ranks ({backend}, {buckets or '?'} bucket"
        f"{'s' if buckets != 1 else ''}) takes {comm:.1f} ms a step; {overlap:.1f} ms of it "
        f"runs while the backward pass still computes ({bwd:.1f} ms), and the step waits "
        f"{exposed_s * 1e3:.1f} ms for the rest after the backward is done{where}. "
    )
    on_cuda = bool(ctx.summary.get("device")) or any(
        bool(r.get("on_cuda")) for r in ctx.summary.get("ranks") or [])
    hook = "bf16_compress_hook" if on_cuda else "fp16_compress_hook"
    aside = ""
    commands: tuple[str, ...] = ()
    if on_cuda and backend == "gloo":
        text += ("The model is on GPUs but its gradients go through Gloo, which copies "
                 "them to the host: NCCL all-reduces on the GPUs. ")
        snippet = 'dist.init_process_group("nccl")  # was: "gloo"'
        command = f"trainprof run {ctx.script}"
        verify = f"re-run `{command}` after the change and `trainprof compare`"
    elif comm >= bwd:
        hosts = {r.get("host") for r in ctx.summary.get("ranks") or [] if r.get("host")}
        text += (
            "The all-reduce takes as long as the whole backward compute or longer, so no "
            "bucket size can hide it: communicate less often, or fewer bytes. Accumulate the "
            "gradients of several micro-batches under model.no_sync(), so that one all-reduce "
            "serves them all, or train with a larger batch per rank (more compute per "
            f"all-reduce). DDP's {hook} sends the gradients as 16-bit numbers (half the "
            "bytes; the optimizer still sees float32 gradients): it pays where the network is "
            "the limit" + (", less between ranks of one host, where casting the gradients can "
                           "cost more than it saves: measure it" if len(hosts) == 1 else "")
            + ". "
        )
        snippet = (
            _no_sync_snippet(4) + "\n\n# or: 16-bit gradients for the all-reduce\n"
            "from torch.distributed.algorithms.ddp_comm_hooks import default_hooks\n"
            f"model.register_comm_hook(None, default_hooks.{hook})"
        )
        # the fix is a code change, written first; the hook is only an aside of it (a
        # verify that led with it said "refuted" of a sound finding when 16-bit gradients
        # cost more than they saved between two ranks of one host)
        run_dir = ctx.summary.get("run_dir") or "RUN"
        tune = f"trainprof tune --knob ddp_comm_hook=script,{hook[:4]} {ctx.script}"
        verify = (f"`trainprof run {ctx.script}` after the change (the gradients of several "
                  "micro-batches accumulated under model.no_sync(), one all-reduce for them "
                  f"all), then trainprof compare {run_dir} <the new run>")
        aside = f"; 16-bit gradients alone: {tune}"
        commands = (f"trainprof run {ctx.script}", f"trainprof compare {run_dir} <the new run>",
                    tune)
    else:
        cap = m.get("bucket_cap_bytes")
        smaller = max(1, int(float(cap or 25 * 2**20) / 2**20 / 4))
        text += (
            "The backward compute is longer than the all-reduce, so more of it can be "
            "hidden: a bucket's all-reduce starts only when every gradient in it is ready, and "
            f"with {buckets or '?'} bucket{'s' if buckets != 1 else ''} of at most "
            f"{_mib(cap)} the first starts late. Smaller buckets start sooner "
            f"(bucket_cap_mb={smaller}); gradient_as_bucket_view=True saves the copy of the "
            "gradients into the buckets; 16-bit compression halves what is sent. "
        )
        snippet = (f"model = DistributedDataParallel(model, ..., bucket_cap_mb={smaller},\n"
                   "                                gradient_as_bucket_view=True)")
        command = verify = f"trainprof tune --knob ddp_bucket_cap_mb=script,{smaller} {ctx.script}"
    verify += (f"  (DDP's exposed all-reduce, now {exposed_s * 1e3:.1f} ms a step, "
               f"{share * 100:.0f}% of it, should fall)") + aside
    title = (f"The step waits {share * 100:.0f}% of its time for DDP's gradient all-reduce "
             f"after the backward pass ({exposed_s * 1e3:.1f} ms of {comm:.1f} ms not hidden)")
    return Finding(category="distributed", cause="exposed_communication", title=title,
                   severity=severity, evidence=evidence, estimated_gain=share,
                   fix=Fix(text=text, snippet=snippet), verify=verify,
                   verify_commands=commands or (command,))


@rule("distributed.find_unused_parameters")
def find_unused_parameters(ctx: Context) -> Finding | None:
    """DDP built with ``find_unused_parameters=True`` that found none unused (expert-rules
    D5's flag; DDP's own warning): after every forward it walks the autograd graph from the
    outputs to find parameters that will get no gradient, and it keeps its buckets in
    construction order (it rebuilds them in the gradients' ready order only without the
    flag). The walk's cost is not measured on its own, so no gain is claimed: the knob
    measures it."""
    models = [m for m in ctx.summary.get("ddp") or [] if isinstance(m, dict)
              and m.get("find_unused_parameters") and m.get("unused_parameter_bytes") == 0
              and int(m.get("samples") or 0) >= 1]
    if not models:
        return None
    m = models[0]
    its = list(m.get("iterations") or [])
    hf = (ctx.train_loader or {}).get("driven_by") == "transformers.Trainer"
    evidence = {
        "find_unused_parameters": True,
        "unused_parameter_bytes": 0,
        "ddp_iterations_sampled": its,
        "gradient_bytes": m.get("gradient_bytes"),
        "gain_unknown": True,
    }
    text = (
        "The DistributedDataParallel model was built with find_unused_parameters=True, and "
        f"on every iteration DDP sampled ({', '.join(map(str, its[:5]))}) no parameter was "
        "unused: each forward pass is followed by a walk of the autograd graph for nothing, "
        "and DDP keeps its gradient buckets in construction order instead of rebuilding them "
        "in the order the gradients become ready. Turn it off; if some parameters go unused "
        "only in some iterations, keep it (DDP would fail without it, saying so); if the same "
        "ones are always unused, static_graph=True finds them once. "
        + ("Hugging Face's Trainer turns it on by default under DDP (unless gradient "
           "checkpointing is on): set ddp_find_unused_parameters=False in TrainingArguments."
           if hf else "")
    )
    snippet = ("args = TrainingArguments(..., ddp_find_unused_parameters=False)" if hf else
               "model = DistributedDataParallel(model, ..., find_unused_parameters=False)")
    tune = f"trainprof tune --knob ddp_find_unused_parameters=script,false {ctx.script}"
    verify = (f"{tune}  (the step time with the flag off; a run that needs it fails, and tune "
              "says so)")
    return Finding(
        category="distributed", cause="find_unused_parameters",
        title=("DDP looks for unused parameters after every forward pass "
               "(find_unused_parameters=True) and found none"),
        severity="low", evidence=evidence, estimated_gain=0.0,
        fix=Fix(text=text.rstrip(), snippet=snippet), verify=verify, verify_commands=(tune,))
