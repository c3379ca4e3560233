"""Input pipeline: the training loop waits for the next batch.

Sources (expert-rules.md, table 1):

* I1 — *step waits on input*: the TensorFlow/XProf input-pipeline analyzer's bands
  (input share of step >= 20% high, >= 5% moderate), the same 5% as the
  PyTorch-profiler TensorBoard plugin's DataLoader share. We use TF's bands.
* I2 — *synchronous loader*: ``num_workers=0`` (TorchTidy, Lightning's "workers < 2"
  warning, the PyTorch tuning guide), ``persistent_workers`` (tuning guide).
* I5/I6 — *slow or CPU-saturated transformation* (TF): workers at 100% CPU with no
  core left means more workers cannot help; make each sample cheaper.
* I4 — *slow source read* (TF): workers mostly blocked (not on CPU) while the loop
  waits: reads or latency dominate; more workers than cores help, and so do packed
  formats and local copies (data-loading.md §2, §4).
* Worker start-up per epoch: data-loading.md §3 measured 2.0 s vs 0.03 s for the
  first batch of an epoch without vs with ``persistent_workers`` (spawn).

One bottleneck, one finding: the cause is chosen from the evidence in the order of
TF's ladder, and the other symptoms go into the evidence. Data waits inside steps
that :mod:`trainprof.diagnosis.periodic` owns (an evaluation loader every N steps)
are not counted here. The ladder:

1. ``worker_startup_per_epoch``: no ``persistent_workers``, and restarting the workers
   (data-wait spikes at the epoch length, or the start-ups the workers measured after
   the first one) is at least half of the wait.
2. ``too_few_workers`` with ``num_workers=0``: loading in the training process, unless
   the samples were measured to cost less than :data:`CHEAP_SAMPLE_MS` each:
   ``per_sample_overhead`` then (a worker would cost more than it saves; the wait is
   the sample-by-sample path, and reading a batch at once removes it).
3. With the worker-side measurements (:mod:`trainprof.analysis.workers`: per-sample
   blocked and CPU time in ``__getitem__``, ``collate_fn`` per batch, run-queue
   waits), the stage that takes most of the workers' time names the cause, as TF's
   analyzer names the slowest stage (I4-I6): ``slow_reads`` (blocked: reads, sleeps,
   the network), ``collate``, or CPU work (decode, transforms): ``too_few_workers``
   when cores are idle and the workers do not wait for one, else ``cpu_transforms``.
   Workers that wait for a core count as CPU-bound, not blocked: that wait is a CPU
   shortage. Only when the workers are busy (at least :data:`BUSY` of their time
   since their first batch) and measured :data:`MIN_SAMPLES` samples. Measured
   workers that are mostly idle are not what the loop waits for: ``worker_handoff``
   when their samples cost less than :data:`CHEAP_SAMPLE_MS`, or a batch would take
   under :data:`HANDOFF` of the wait to make in the training process (the batches' trip
   through shared memory is what the loop waits for; data-loading.md §2: 925k samples/s
   with no worker, 113k with 2); else ``shared_memory_handoff`` when the training
   thread was measured receiving the batches' tensors for at least :data:`HANDOFF` of
   the wait (:mod:`trainprof.capture.handoff`, :mod:`trainprof.diagnosis.handoff`);
   else ``undetermined``, and the fix points at how batches reach the training
   process, with as many workers as now (their low CPU use is idleness, not blocked
   reads).
4. Without them (fewer samples, a run recorded by an older trainprof, a trace),
   "blocked vs CPU" is estimated from the workers' CPU use sampled from outside.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from trainprof.analysis.handoff import handoff_of_loader
from trainprof.analysis.padding import holds_images
from trainprof.analysis.system import OUTSIDE_LOAD_CORES
from trainprof.diagnosis.context import Context
from trainprof.diagnosis.context import stat as _ms
from trainprof.diagnosis.finding import Finding, Fix, band, sweep
from trainprof.diagnosis.handoff import (
    handoff_evidence,
    handoff_sentence,
    shared_memory_handoff_finding,
)
from trainprof.diagnosis.registry import rule

HIGH, MEDIUM = 0.20, 0.05  # TF input-pipeline analyzer bands (I1)
#: Per-worker CPU above which a worker counts as saturated (CPU-bound), below which as
#: mostly blocked (waiting on reads, sleeps, the network).
SATURATED, BLOCKED = 0.80, 0.50
#: Per-sample loading cost (CPU + blocked, means, ms; in the training process the
#: collate's share of a sample too) below which a worker process costs more than it saves:
#: handing a batch over (shared memory, unpickling in the training process) outweighs the
#: loading. data-loading.md §2: pre-decoded samples at 8 µs (npy memmap) and 17 µs (h5py)
#: loaded no faster with 2 workers than with none (99k vs 89k, 56k vs 57k samples/s); PNG
#: decoding at 70-100 µs gained 1.5-1.7× from 2 workers.
CHEAP_SAMPLE_MS = 0.02
#: Idle workers, and a batch that would take under this fraction of the loop's median wait
#: to load in the training process (a typical sample's cost times the batch, plus collate,
#: as the workers measured them): the wait is the hand-over, not the loading, whatever
#: the samples cost. Seen on an IterableDataset of 16 floats a sample (9.5 µs typical,
#: but a 25 µs mean from a few first samples): 2 workers idle 75% of the time, the loop
#: waiting 1.8 ms a step for batches that cost ~0.65 ms to make; num_workers=0 ran
#: ×4.6 faster (``trainprof tune``, 3 trials each).
HANDOFF = 0.5

#: What removes per-file reads (data-loading.md §4): the pack tool, in a finding's words.
PACK_HINT = (
    "pack the sample files once into a few large files (`trainprof pack DATA_DIR OUT`, read "
    "by `trainprof.fixes.PackedDataset`); on network storage, copy the data (or the pack) "
    "to the node's local disk once: `DATA=$(trainprof stage DATA_DIR)` in the job script."
)
#: The pack in a snippet, after the loader: samples and order as ImageFolder's.
PACK_SNIPPET = (
    "# when each sample is a file: pack them once (`trainprof pack DATA_DIR DATA.pack`), then\n"
    "from trainprof.fixes import PackedDataset\n"
    "dataset = PackedDataset(\"DATA.pack\", transform=...)  # (sample, label) as ImageFolder"
)


def cache_snippet(dataset: str, loader_call: str, *, on_cuda: bool,
                  images: bool | None = None, iterable: bool = False) -> str:
    """The cpu_transforms fix: the deterministic part done once, the rest per sample.

    ``CachedDataset`` needs a map-style dataset (``len`` and ``[i]``: it raises
    ``PackError`` otherwise), so an ``IterableDataset`` is packed instead, one pass of its
    stream ahead of training (:func:`trainprof.fixes.pack_dataset`), and read back as a
    map-style ``PackedDataset``. The image recipe (crop and flip in uint8, the float work,
    colour jitter and Normalize, once per batch by ``DevicePrefetcher``) only where the
    samples are images (``images``: :func:`trainprof.analysis.padding.holds_images`);
    else, or when unknown, no image names. A dataset that is a ``CachedDataset`` already
    keeps its cache: what is left per sample is its transform."""
    mine = f"    {dataset}(...),  # your dataset, unchanged"
    if iterable:
        return (
            "from trainprof.fixes import PackedDataset, pack_dataset\n\n"
            "# once, ahead of training (one process, one pass over a finite stream): the\n"
            "# deterministic work (parsing, tokenising, decoding) written to disk\n"
            f"pack_dataset({dataset}(...), \"cache/train.pack\")\n"
            "dataset = PackedDataset(\"cache/train.pack\")  # map-style: the same samples\n"
            + loader_call.replace(mine, "    dataset,  # the packed samples above"))
    if images:
        device = "cuda" if on_cuda else "cpu"
        if dataset == "CachedDataset":
            head = ("from trainprof.fixes import DevicePrefetcher\n\n"
                    "# cached already: what each sample still costs is its transform; keep "
                    "it to\n# the random part, in uint8 (crop, flip), and batch the rest below\n"
                    "dataset = CachedDataset(..., transform=crop_flip_uint8)\n")
        else:
            head = ("from trainprof.fixes import CachedDataset, DevicePrefetcher\n\n"
                    "# the deterministic part (decode, resize) once, kept on disk; the random "
                    "part\n# per sample, in uint8 (crop, flip)\n"
                    f"dataset = CachedDataset({dataset}(...), \"cache/train\", "
                    "transform=crop_flip_uint8)\n")
        return (
            head
            + loader_call.replace(mine, "    dataset,  # the cached dataset above")
            + "\n# float conversion, colour jitter and Normalize once per batch, where the "
            "model runs\n"
            f"for x, y in DevicePrefetcher(loader, \"{device}\", mean=MEAN, std=STD, "
            "batch_transform=color_jitter):\n"
            "    ..."
        )
    if dataset == "CachedDataset":
        head = ("# cached already: what each sample still costs is its transform; keep it to "
                "the\n# random part, and do what can be done on a whole batch once per batch\n"
                "dataset = CachedDataset(..., transform=random_part_only)\n")
    else:
        head = ("from trainprof.fixes import CachedDataset\n\n"
                "# the deterministic per-sample work once, kept on disk (random augmentation, "
                "if any,\n# goes in transform=, which runs on every read)\n"
                f"dataset = CachedDataset({dataset}(...), \"cache/train\")\n")
    return head + loader_call.replace(mine, "    dataset,  # the cached dataset above")


#: Samples the workers must have measured before their stage split names the cause.
MIN_SAMPLES = 16
#: Busy share (time in fetch since the first batch) below which workers are not the bottleneck.
BUSY = 0.5
#: Share of the workers' CPU-bound time spent waiting for a core above which no core is free.
CPU_WAIT = 0.2
#: Idle cores from which one more worker has room, though not a whole core (cpu_transforms):
#: examples/png_folder.py, 1 worker on 2 cores with 0.9 of a core idle, ran ×0.72 with a
#: second worker (`trainprof tune`, 2 trials each) while its finding said "no core is free".
SPARE_CORE = 0.5


def _spare_core_text(spare: float, nw: int) -> str:
    """What the fix says of CPU-bound workers with ``spare`` of a core idle (at least
    :data:`SPARE_CORE`, less than one)."""
    return (f"; {spare:.1f} of a core is idle: one more worker (num_workers={nw + 1}) can "
            "use it, but each sample's CPU is the cost, and making each sample cheaper "
            "saves more.")


def _cache_advice(images: bool | None, iterable: bool) -> str:
    """What makes each sample cheaper (see :func:`cache_snippet`), in words."""
    if iterable:
        return (
            "Do the deterministic work (parsing, tokenising, decoding) once, ahead of "
            "training, not every epoch: `trainprof.fixes.pack_dataset` runs a finite stream "
            "once in one process and writes its samples to a pack, which "
            "`trainprof.fixes.PackedDataset` reads back (map-style, a slice of a mapped file "
            "per sample); `CachedDataset` does not apply, it needs a map-style dataset. Only "
            "random augmentations stay per sample. A stream too large to pass once: "
            "tokenise (or decode) its files ahead of time into files of the results "
            "(token ids as .npy) and stream those."
        )
    if images:
        return (
            "Do the deterministic work (decoding, resizing) once, not every epoch: "
            "`trainprof.fixes.CachedDataset` keeps each item on disk the first time it is "
            "computed (or `trainprof pack --decode` stores decoded images ahead of time), "
            "and only the random augmentations stay per sample. Keep those in uint8 (crop, "
            "flip), collate uint8, and do the float work (colour jitter, Normalize) once per "
            "batch where the model runs: `trainprof.fixes.DevicePrefetcher`."
        )
    return (
        "Do the deterministic per-sample work (parsing, feature extraction, tokenising, "
        "decoding) once, not every epoch: `trainprof.fixes.CachedDataset` keeps each item "
        "on disk the first time it is computed, and only random augmentations, if any, stay "
        "per sample (its transform=). Work that can be done on a whole batch at once "
        "(vectorised, in the model's dtype) is cheaper once per batch than once per sample."
    )


def _short(qualname: Any, default: str) -> str:
    return str(qualname).rsplit(".", 1)[-1] if qualname else default


def workers_bound(share: float, workers: int) -> float:
    """What ``workers`` loading processes can save of a step whose loading, done in the
    training process, takes ``share`` of it: they make the batches beside the rest of the
    step, ``workers`` at a time, so a step takes at least the longer of the rest
    (``1 - share``) and the loading spread over them (``share / workers``) - Amdahl's
    bound with the loading as the parallel part. An explorer's 20 ms batches beside a 1 ms
    model were told "up to 95%" for one worker on 2 cores: it can save 5%."""
    if workers < 1:
        return 0.0
    return max(0.0, min(share, 1.0 - max(1.0 - share, share / workers)))


def suggest_workers(
    current: int, cores: int | None, gpus: int, blocked: bool, on_cuda: bool
) -> int:
    """A ``num_workers`` fitted to the machine.

    CPU-bound loading: at most one worker per usable core (data-loading.md §3, item 7),
    per GPU, capped at 8; on a CPU-only run half the cores, because the model's own
    intra-op threads need the rest (else :mod:`.contention` fires next). Blocked loading
    (reads, latency) overlaps beyond the core count: twice the cores, capped at 16.
    """
    per_device = max(1, (cores or 2) // max(1, gpus))
    if blocked:
        target = min(2 * per_device, 16)
    elif on_cuda:
        target = min(per_device, 8)
    else:
        target = max(1, per_device // 2)
    return max(target, current + 1)


def loader_snippet(
    loader: dict[str, Any] | None, *, num_workers: int, pin_memory: bool, comment: str,
    collate_fn: str | None = None, split_verified: bool = False,
) -> str:
    """The user's DataLoader call, rewritten with the suggested settings.

    Rebuilt from the settings capture recorded (dataset class, batch size, sampler,
    collate function, ...), so the snippet reads like the line it replaces.
    """
    loader = loader or {}
    if loader.get("driven_by") == "transformers.Trainer":
        return _training_arguments_snippet(loader, num_workers=num_workers,
                                           pin_memory=pin_memory, comment=comment,
                                           collate_fn=collate_fn)
    dataset = _short(loader.get("dataset"), "dataset")
    lines = ["loader = DataLoader(", f"    {dataset}(...),  # your dataset, unchanged"]
    batch_sampler = str(loader.get("batch_sampler") or "")
    sampler = str(loader.get("sampler") or "")
    batch_size = loader.get("batch_size")
    if batch_size is None and loader.get("batch_sampler_batch_size") is not None:
        # a plain BatchSampler passed in: the same batches as batch_size and its sampler
        batch_size = loader["batch_sampler_batch_size"]
        sampler = str(loader.get("batch_sampler_sampler") or "")
    if batch_sampler and not batch_sampler.endswith("sampler.BatchSampler"):
        lines.append(f"    batch_sampler={_short(batch_sampler, 'batch_sampler')}(...),")
    else:
        lines.append(f"    batch_size={batch_size if batch_size is not None else 32},")
        if sampler.endswith("RandomSampler"):
            lines.append("    shuffle=True,")
        elif loader.get("driven_by") == "lightning" and sampler.endswith("DistributedSampler"):
            # PyTorch Lightning rebuilt the user's loader with a DistributedSampler of its
            # own (shuffling in training whatever the user's loader said): not in their call
            lines.append("    # shuffle as before; Lightning adds the DistributedSampler")
        elif sampler and not sampler.endswith(("SequentialSampler", "_InfiniteConstantSampler")):
            # (torch gives an IterableDataset's loader an _InfiniteConstantSampler itself; a
            # sampler passed with one is an error)
            lines.append(f"    sampler={_short(sampler, 'sampler')}(...),")
        if loader.get("drop_last"):
            lines.append("    drop_last=True,")
    collate = str(loader.get("collate_fn") or "")
    if collate_fn:
        lines.append(f"    collate_fn={collate_fn},")
    elif collate and not collate.endswith("default_collate"):
        lines.append(f"    collate_fn={_short(collate, 'collate_fn')},")
    lines.append(f"    num_workers={num_workers},  # {comment}")
    if loader.get("iterable_dataset") and num_workers > 1 and not split_verified:
        # each worker runs the dataset's own __iter__: unsplit, every sample comes N times
        # (not said where the workers' first batches were measured to differ)
        lines.append("    # an IterableDataset: split the stream by torch.utils.data."
                     "get_worker_info()")
        lines.append("    # in __iter__, or each of the workers yields all of it")
    if num_workers > 0:
        lines.append("    persistent_workers=True,  # start the workers once, not every epoch")
        pf = loader.get("prefetch_factor")
        if isinstance(pf, int) and pf != 2:
            lines.append(f"    prefetch_factor={pf},")
        ctx = loader.get("multiprocessing_context")
        if ctx and ctx != "fork":
            lines.append(f'    multiprocessing_context="{ctx}",')
    if pin_memory:
        lines.append("    pin_memory=True,  # page-locked batches: async copies to the GPU")
    lines.append(")")
    return "\n".join(lines)


def _training_arguments_snippet(
    loader: dict[str, Any], *, num_workers: int, pin_memory: bool, comment: str,
    collate_fn: str | None,
) -> str:
    """The fix for a loader Hugging Face's Trainer builds: its ``TrainingArguments``.

    The Trainer makes its DataLoaders from ``dataloader_num_workers``,
    ``dataloader_persistent_workers``, ``dataloader_prefetch_factor`` and
    ``dataloader_pin_memory`` (on by default), and a collate function from
    ``Trainer(data_collator=...)``: a DataLoader call would be nowhere to put.
    """
    lines = ["args = TrainingArguments(", "    ...,  # your arguments, unchanged",
             f"    dataloader_num_workers={num_workers},  # {comment}"]
    if num_workers > 0:
        lines.append("    dataloader_persistent_workers=True,  # start the workers once, "
                     "not every epoch")
        pf = loader.get("prefetch_factor")
        if isinstance(pf, int) and pf != 2:
            lines.append(f"    dataloader_prefetch_factor={pf},")
    if pin_memory:
        lines.append("    dataloader_pin_memory=True,  # page-locked batches: async copies "
                     "to the GPU")
    lines.append(")")
    if collate_fn:
        lines.append(f"trainer = Trainer(model=model, args=args, ..., data_collator={collate_fn})")
    return "\n".join(lines)


def _blocked_share_min(ctx: Context, share: float) -> float | None:
    """Lower bound on the part of the data wait spent blocked (off-CPU), ``num_workers=0``.

    With loading in the training process, the process's CPU use is the loading's plus
    the rest of the step's. Outside the data wait a CPU run's main thread computes, so
    it uses at least one core for ``1 - share`` of the time; whatever CPU is left over
    is the most the loading can have used. The rest of the wait was off-CPU: reads,
    sleeps, network latency. Only on CPU runs (on CUDA the main thread may sit in syncs).
    """
    proc = ctx.system.get("proc_cpu_pct")
    if ctx.on_cuda or not isinstance(proc, int | float) or share <= 0:
        return None
    loading_cpu = max(0.0, proc / 100 - (1 - share))
    return max(0.0, min(1.0, 1 - loading_cpu / share))


def _samples_per_step(ctx: Context) -> float | None:
    """The median batch of the steady steps (the records count samples per step)."""
    if ctx.has_steps():
        samples = ctx.steady["samples"]
        if len(samples) and float(np.median(samples)) > 0:
            return float(np.median(samples))
    rate, steps = ctx.summary.get("samples_per_s"), ctx.summary.get("steps_per_s")
    return float(rate) / float(steps) if rate and steps else None


def _batched_read_finding(ctx: Context, evidence: dict[str, Any], share: float,
                          sample_ms: float, pct: str, run_dir: str) -> Finding:
    """Cheap samples read a batch at a time already: workers are ruled out, nothing else."""
    cause = "batched_read"
    us = sample_ms * 1000
    per_step = float(evidence.get("samples_per_step") or 1)
    batch_ms = sample_ms * per_step
    title = (f"Training waits for data {pct} of step time: reading each batch "
             f"({per_step:.0f} samples, {us:.1f} µs each) in the training process")
    text = (
        f"The batches are read at once already and a sample costs {us:.1f} µs, so worker "
        "processes would cost more than they save: handing a batch over through shared "
        f"memory costs more than reading it. What remains is the read, {batch_ms:.2f} ms "
        "a batch: keep the stored data as small as it can be (uint8 images, not float32) "
        "and in one array (not a list of arrays), so that a batch is one gather."
    )
    snippet = (
        "images = torch.from_numpy(np.stack(images_list))  # one uint8 array: one gather\n"
        "loader = DataLoader(dataset, batch_size=None, sampler=BatchSampler(...), "
        "num_workers=0)  # keep: no workers\n"
        "for x, y in loader:\n"
        "    x = x.to(device).float().div_(255)  # convert after the read, on the device"
    )
    tune = f"trainprof tune --knob num_workers=0,2 {ctx.script}"
    compare = f"trainprof compare {run_dir} <the new run>"
    return Finding(  # low: no change is known to remove it, but workers are ruled out
        category="input_pipeline", cause=cause, title=title, severity="low",
        evidence=evidence, estimated_gain=share, fix=Fix(text=text, snippet=snippet),
        # the change first: the knob only checks that workers are ruled out (led by it,
        # verify read workers that did not help, as predicted, as "refuted")
        verify=f"after a change, {compare}; workers should not help: {tune}",
        verify_commands=(compare, tune),
    )


def _read_at_once(loader: dict[str, Any] | None, dataset: str,
                  batch: int | None) -> tuple[str, str]:
    """(the advice, the snippet) for reading a whole batch in one go, as fits the dataset:
    a map-style one indexed with the batch's list of indices (a ``TensorDataset`` already
    is: its ``__getitem__`` indexes its tensors with whatever it is given), an
    ``IterableDataset`` yielding whole batches (it has no indices to take)."""
    batch_txt = f"{batch} " if batch else ""
    size = batch or 32
    done_by_loader = "    num_workers=0,  # samples this cheap do not pay for a worker\n)"
    if (loader or {}).get("iterable_dataset"):
        return (
            "Yield whole batches instead: make each batch in `__iter__` (slices of arrays, "
            "or one stack) and pass batch_size=None: one `next` a batch instead of "
            f"{batch_txt}`next` calls and a collate.",
            f"class {dataset}(IterableDataset):  # your dataset, yielding batches:\n"
            "    def __iter__(self):\n"
            f"        for start in range(0, len(self.x), {size}):  # e.g. arrays\n"
            f"            yield self.x[start:start + {size}], self.y[start:start + {size}]\n\n"
            f"loader = DataLoader(\n    {dataset}(...),\n"
            "    batch_size=None,  # each item is a batch already\n" + done_by_loader)
    if str((loader or {}).get("dataset") or "") == "torch.utils.data.dataset.TensorDataset":
        dataset_code = ("dataset = TensorDataset(...)  # as now: it indexes its tensors with a "
                        "list of indices, a whole batch at once\n\n")
    else:
        dataset_code = (
            f"class {dataset}(...):  # your dataset, plus a batched read:\n"
            "    def __getitem__(self, indices):  # a list of indices: the whole batch\n"
            "        return self.images[indices], self.labels[indices]  # e.g. numpy or tensors"
            "\n\n")
    sampler = ("RandomSampler(dataset)" if str((loader or {}).get("sampler") or "")
               .endswith("RandomSampler") else "SequentialSampler(dataset)")
    return (
        "Read a batch at once instead: give the dataset the whole list of indices "
        "(batch_size=None and a BatchSampler) and index its arrays with it, one vectorised "
        f"read instead of {batch_txt}`__getitem__` calls and a collate.",
        "from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler\n\n"
        + dataset_code
        + "loader = DataLoader(\n    dataset,\n"
        "    batch_size=None,  # the sampler below makes the batches\n"
        f"    sampler=BatchSampler({sampler}, batch_size={size}, drop_last=False),\n"
        + done_by_loader)


def _cheap_samples_finding(ctx: Context, cause: str, loader: dict[str, Any] | None,
                           evidence: dict[str, Any], share: float, severity: str, nw: int,
                           sample_ms: float, collate_ms: float, worker_busy: float | None,
                           pct: str) -> Finding:
    """Samples that cost microseconds: workers do not pay; batches read at once do."""
    us = sample_ms * 1000
    evidence["sample_cost_ms"] = sample_ms
    run_dir = ctx.summary.get("run_dir") or "RUN"
    if cause == "batched_read":
        return _batched_read_finding(ctx, evidence, share, sample_ms, pct, run_dir)
    batch = int((loader or {}).get("batch_size") or 0) or None
    dataset = _short((loader or {}).get("dataset"), "Dataset")
    wait_s = evidence.get("data_wait_median_s")
    batch_txt = f"{batch} " if batch else ""
    read_at_once, batched = _read_at_once(loader, dataset, batch)
    if cause == "per_sample_overhead":
        title = (f"Training waits for data {pct} of step time: batches of samples that cost "
                 f"{us:.0f} µs each, loaded one sample at a time (collate {collate_ms:.2f} ms "
                 "a batch)")
        text = (
            f"Each sample costs only {us:.0f} µs to load, so worker processes would not pay "
            "for themselves: handing a batch over from a worker (shared memory, unpickling "
            "in the training process) costs more than loading it (data-loading.md: "
            "pre-decoded samples loaded no faster with 2 workers than with none). The wait "
            f"is the per-sample path itself: {batch_txt}`__getitem__` calls and a collate of "
            f"{collate_ms:.2f} ms per batch. {read_at_once}"
        )
        commands: tuple[str, ...] = (f"trainprof compare {run_dir} <the new run>",
                                     f"trainprof tune --knob num_workers=0,2 {ctx.script}")
        verify = (f"after the change, {commands[0]} (data wait now {pct}); `{commands[1]}` "
                  "shows whether workers help")
        gain = share
    else:
        # what a batch costs to make (a typical sample's cost times the batch, collate
        # included), as the workers measured it
        batch_s = evidence.get("in_process_batch_s")
        if batch_s is None:
            batch_s = (sample_ms * (batch or 1) + collate_ms) / 1000
        else:
            us = 1000 * (_ms(evidence.get("sample_cpu_ms"), "median")
                         + _ms(evidence.get("sample_blocked_ms"), "median"))
        # the gain's bound: in the training process the samples still cost their time; the
        # hand-over goes, and the collate too once batches are read at once
        samples_s = us / 1e6 * (batch or 1)
        gain = share * max(0.0, 1.0 - samples_s / float(wait_s)) if wait_s else share
        wait_txt = f"{float(wait_s) * 1000:.2f} ms" if wait_s else "a share of each step"
        workers, busy, loaders = _workers_out_and_busy(ctx, loader, nw, worker_busy)
        of_loaders = (f" of the {loaders} loaders iterated together" if loaders > 1 else "")
        if loaders > 1:
            evidence["workers_iterated_together"] = workers
            evidence["workers_busy_share_together"] = busy
        title = (f"Training waits for data {pct} of step time while the {workers} DataLoader "
                 f"workers{of_loaders} are idle {(1 - (busy or 0)) * 100:.0f}% of the time: "
                 "handing batches over costs more than loading them")
        text = (
            f"A sample costs the workers {us:.0f} µs (typically), a batch "
            f"{batch_s * 1000:.2f} ms with its collate; they are busy only "
            f"{(busy or 0) * 100:.0f}% "
            f"of the time, and yet the loop waits {wait_txt} per step: the time goes to "
            "handing each batch over (written to shared memory by a worker, unpickled in the "
            "training process), not to loading it. Samples this cheap load faster in the "
            "training process: num_workers=0"
            + (f" (on each of the {loaders} loaders)" if loaders > 1 else "")
            + f". {read_at_once}"
        )
        if evidence.get("batch_handoff"):
            text += " " + handoff_sentence(evidence["batch_handoff"])
        verify = f"trainprof tune --knob num_workers=0,{nw} {ctx.script}"
        commands = (verify,)
        severity = band(gain, HIGH, MEDIUM) or "low"
    snippet = (loader_snippet(loader, num_workers=0, pin_memory=False,
                              comment=f"was {nw}: samples cost {us:.0f} µs, less than a "
                                      "batch's hand-over")
               + "\n\n# better: read each batch at once\n" + batched
               if cause == "worker_handoff" else batched)
    return Finding(
        category="input_pipeline", cause=cause, title=title, severity=severity,
        evidence=evidence, estimated_gain=gain, fix=Fix(text=text, snippet=snippet),
        verify=verify, verify_commands=commands,
        # no workers left to compete with the model's threads for the cores
        supersedes=((("cpu_contention", "workers_oversubscribe_cores"),
                     ("cpu_contention", "spinning_threads"))
                    if cause == "worker_handoff" else ()),
    )


def _workers_out_and_busy(ctx: Context, loader: dict[str, Any] | None, nw: int,
                          busy: float | None) -> tuple[int, float | None, int]:
    """The workers the loop waits on, their busy share, and how many loaders they are of.

    Loaders iterated together (``zip(a, b)``, :meth:`Context.loaders_alongside`) feed every
    step, their workers run at once, and the step's wait is on all of them: their workers
    count together, as the contention rules count them, and their busy share is each
    loader's measured median (``busy_share_active``) weighted by its workers. A loader
    whose workers were not measured is left out of both; ``loader``'s alone otherwise.
    """
    measured: list[tuple[int, float]] = []
    for d in ctx.loaders_alongside(loader):
        n = int(d.get("num_workers") or 0)
        share = ((ctx.worker_stats(d) or {}).get("busy_share_active") or {}).get("median")
        if n > 0 and isinstance(share, int | float):
            measured.append((n, float(share)))
    if len(measured) < 2:
        return nw, busy, 1
    workers = sum(n for n, _ in measured)
    return workers, sum(n * b for n, b in measured) / workers, len(measured)


def _split_verified(w: dict[str, Any] | None) -> bool:
    """The workers' first batches were compared and no two were the same: an
    ``IterableDataset`` that splits its stream (analysis/workers.py, ``same_stream``)."""
    same = (w or {}).get("same_stream")
    return (isinstance(same, dict) and same.get("identical_workers") == 1
            and int(same.get("workers_compared") or 0) >= 2)


def _worker_evidence(w: dict[str, Any] | None) -> dict[str, Any] | None:
    """The worker-side measurements as evidence, or ``None`` if too few samples were measured."""
    if not w or int(w.get("samples") or 0) < MIN_SAMPLES or not w.get("fetch_split"):
        return None
    ev: dict[str, Any] = {
        "sample_blocked_ms": w.get("sample_blocked_ms"),
        "sample_cpu_ms": w.get("sample_cpu_ms"),
        "collate_ms_per_batch": w.get("collate_ms"),
        "fetch_split": w["fetch_split"],
        "samples_measured": w.get("samples"),
    }
    busy = (w.get("busy_share_active") or {}).get("median")
    if busy is not None:
        ev["worker_busy_share"] = busy
    functions = _top_functions(w)
    if functions:
        ev["worker_functions"] = functions
    return ev


def _top_functions(w: dict[str, Any], n: int = 5) -> list[str]:
    """``name (file:line) 45%`` for the functions the sampled workers spent most time in."""
    fns = (w.get("functions") or {}).get("top") or []
    return [f"{f['function']} ({f['where']}) {(f.get('self_share') or 0) * 100:.0f}%"
            for f in fns[:n] if f.get("self_share")]


def _stage(split: dict[str, float]) -> str:
    """Where the workers' fetch time goes: ``reads`` (blocked), ``cpu`` or ``collate``."""
    reads = float(split.get("blocked") or 0.0)
    cpu = float(split.get("cpu") or 0.0) + float(split.get("waiting_for_cpu") or 0.0)
    collate = float(split.get("collate") or 0.0)
    return max((reads, "reads"), (cpu, "cpu"), (collate, "collate"))[1]


def batch_cost_s(loader: dict[str, Any] | None, w: dict[str, Any] | None,
                 key: str = "mean") -> float | None:
    """Seconds one batch costs to load where it is loaded (a worker, or the training process
    with ``num_workers=0``): the batch size times a sample's blocked and CPU time, plus the
    collate, each by the statistic ``key`` of what the workers measured. ``median`` gives a
    typical batch: a worker's first sample or two (its iterator starting) can take
    milliseconds and lift the mean many times over, but is paid once, not per batch. None
    without enough measured samples or a batch size."""
    if not w or int(w.get("samples") or 0) < MIN_SAMPLES:
        return None
    loader = loader or {}
    batch = loader.get("batch_size") or loader.get("batch_sampler_batch_size")
    if not isinstance(batch, int) or batch <= 0:
        return None
    per_sample = _ms(w.get("sample_blocked_ms"), key) + _ms(w.get("sample_cpu_ms"), key)
    return (batch * per_sample + _ms(w.get("collate_ms"), key)) / 1e3


def _measured_startup(ctx: Context, w: dict[str, Any] | None) -> tuple[float, float | None]:
    """(avoidable start-up seconds in the steady window, median start-up) the workers measured."""
    startup = (w or {}).get("startup") or {}
    gens = [g for g in startup.get("per_generation") or [] if isinstance(g, dict)]
    if w is None or w.get("persistent_workers") or len(gens) < 2 or not ctx.has_steps():
        return 0.0, startup.get("median_s")
    steady_start = float(ctx.steady["t_start_ns"][0]) / 1e9
    avoidable = sum(
        float(g.get("first_batch_s") or 0.0) for g in gens[1:]
        if g.get("at_s") is None or float(g["at_s"]) >= steady_start
    )
    return avoidable, startup.get("median_s")


@rule("input_pipeline.data_wait")
def data_wait(ctx: Context) -> Finding | None:
    """Input-bound steps, with their cause; every such finding's ``verify`` also names the
    elimination test (expert-rules.md I7): the step time with the input made free,
    ``synthetic_data=true``, is the most any fix of the input pipeline can give."""
    finding = _data_wait(ctx)
    if finding is not None and ctx.loaders:
        bound = f"trainprof tune --knob synthetic_data=false,true {ctx.script}"
        finding.verify += f"; the most any input fix can give: {bound}"
        finding.verify_commands += (bound,)
    return finding


def _data_wait(ctx: Context) -> Finding | None:
    """Input-bound steps, with their cause (see the module docstring)."""
    raw_share = float(ctx.breakdown.get("data_wait") or 0.0)
    periodic = ctx.periodic
    excluded = 0.0
    if periodic is not None and ctx.total_s > 0:
        excluded = periodic.excess_s["data_wait"] / ctx.total_s
    share = max(0.0, raw_share - excluded)
    severity = band(share, HIGH, MEDIUM)
    if severity is None:
        return None

    loader = ctx.train_loader
    nw = int(loader.get("num_workers") or 0) if loader else 0
    persistent = bool(loader.get("persistent_workers")) if loader else False
    cores = ctx.cores
    gpus = int(ctx.environment.get("gpu_count") or 0)
    sysinfo = ctx.system
    evidence: dict[str, Any] = {
        "data_wait_share": share,
        "step_median_s": ctx.step_info.get("median_s"),
        "steady_steps": ctx.step_info.get("steady_count"),
        "usable_cores": cores,
    }
    if excluded > 0:
        evidence["data_wait_share_in_periodic_steps"] = excluded
    if ctx.has_steps():
        evidence["data_wait_median_s"] = float(np.median(ctx.phase_seconds("data_wait")))
    if loader:
        evidence["loader"] = {
            k: loader.get(k)
            for k in ("index", "dataset", "len", "batch_size", "num_workers",
                      "persistent_workers", "pin_memory", "prefetch_factor")
        }
    else:
        evidence["loader"] = None  # waits on a DataLoader we could not describe
    for key in ("proc_cpu_pct", "workers_cpu_pct", "iowait_pct", "sys_cpu_pct"):
        if sysinfo.get(key) is not None:
            evidence[key] = sysinfo[key]
    w = ctx.worker_stats(loader)
    measured = _worker_evidence(w)
    if measured:
        evidence.update(measured)
    # receiving the workers' batches, timed in the training process (capture/handoff.py)
    # (the training loader's own: an evaluation loader's batches are received too)
    handoff = handoff_evidence(handoff_of_loader(
        ctx.summary.get("batch_handoff"), loader.get("index") if loader else None)
    ) if nw > 0 else None
    handoff_share = 0.0
    if handoff:
        evidence["batch_handoff"] = handoff
        handoff_share = float(handoff.get("training_thread_share") or 0.0)

    # Start-up per epoch: data-wait spikes at the epoch length, or measured in the workers.
    startup_share = 0.0
    epoch = ctx.epoch_spikes
    if epoch is not None and epoch.fit is not None and ctx.total_s > 0:
        startup_share = epoch.excess_s["data_wait"] / ctx.total_s
        evidence["epoch_spikes"] = {
            "period_steps": epoch.fit.period,
            "batches_per_epoch": ctx.epoch_batches(loader),
            "occurrences": len(epoch.indices),
            "at_steps": ctx.step_numbers(epoch.indices)[:10],
            "excess_per_epoch_s": epoch.excess_s["data_wait"] / len(epoch.indices),
            "excess_share": startup_share,
        }
    avoidable_s, startup_median_s = _measured_startup(ctx, w) if nw > 0 else (0.0, None)
    if startup_median_s is not None:
        evidence["worker_startup_s"] = startup_median_s
        evidence["worker_generations"] = (w or {}).get("generations")
    if avoidable_s > 0 and ctx.total_s > 0:
        evidence["worker_startup_share"] = avoidable_s / ctx.total_s
        startup_share = max(startup_share, avoidable_s / ctx.total_s)

    per_worker = blocked_min = None
    # the sampler's workers_cpu_pct is every worker's: of loaders zipped in one loop, all
    # of theirs (the step's data wait, too, is its waits on all of them together)
    alongside = ctx.loaders_alongside(loader)
    if len(alongside) > 1:
        evidence["loaders_iterated_together"] = [d.get("index") for d in alongside]
    workers_out = sum(int(d.get("num_workers") or 0) for d in alongside) or nw
    if nw > 0 and isinstance(sysinfo.get("workers_cpu_pct"), int | float):
        per_worker = sysinfo["workers_cpu_pct"] / 100 / workers_out
        evidence["per_worker_cpu"] = per_worker
    if nw == 0:
        blocked_min = _blocked_share_min(ctx, share)
        if blocked_min is not None:
            evidence["blocked_share_min"] = blocked_min
    cores_free = None
    if cores and isinstance(sysinfo.get("proc_cpu_pct"), int | float):
        busy = (sysinfo.get("proc_cpu_pct") or 0) + (sysinfo.get("workers_cpu_pct") or 0)
        cores_free = cores - busy / 100
        evidence["cores_free"] = cores_free

    split = measured["fetch_split"] if measured else None
    stage = _stage(split) if split else None
    worker_busy = measured.get("worker_busy_share") if measured else None
    decisive = stage is not None and nw > 0 and (worker_busy is None or worker_busy >= BUSY)
    cpu_waiting = 0.0
    if split:
        cpu_part = float(split.get("cpu") or 0) + float(split.get("waiting_for_cpu") or 0)
        cpu_waiting = float(split.get("waiting_for_cpu") or 0) / cpu_part if cpu_part else 0.0
    idle_cores = cores_free
    if cores and isinstance(sysinfo.get("sys_cpu_pct"), int | float):
        # cores nobody uses, this run or other processes
        idle = cores * (1 - sysinfo["sys_cpu_pct"] / 100)
        idle_cores = idle if idle_cores is None else min(idle_cores, idle)

    sample_ms = None
    batched_reads = bool(loader) and loader.get("batch_size") is None  # a fetch is a batch
    if measured:
        sample_ms = _ms(measured.get("sample_cpu_ms")) + _ms(measured.get("sample_blocked_ms"))
        if batched_reads:  # per sample: the fetch over the samples a step gets
            per_step = _samples_per_step(ctx)
            sample_ms = sample_ms / per_step if per_step else None
            evidence["samples_per_step"] = per_step
    cheap = sample_ms is not None and sample_ms < CHEAP_SAMPLE_MS
    # in the training process, a collate_fn that does the work (tokenising a batch of
    # sentences: 1.15 ms for 32 samples of 2 µs each) is loading, not per-sample overhead
    # that a batched read removes (idle workers: the hand-over test weighs the collate)
    batch = (loader or {}).get("batch_size")
    collate_per_sample_ms = (_ms(measured.get("collate_ms_per_batch")) / batch
                             if measured and isinstance(batch, int) and batch > 0 else 0.0)
    cheap_in_process = cheap and collate_per_sample_ms < CHEAP_SAMPLE_MS
    # what a typical batch would take to make in the training process
    in_process_s = batch_cost_s(loader, w, "median") if nw > 0 and measured else None
    wait_median = evidence.get("data_wait_median_s")
    if in_process_s is not None:
        evidence["in_process_batch_s"] = in_process_s
    handoff_bound = (in_process_s is not None and isinstance(wait_median, float)
                     and in_process_s < HANDOFF * wait_median)

    if nw > 0 and not persistent and startup_share >= 0.5 * share:
        cause = "worker_startup_per_epoch"
    elif nw == 0 and cheap_in_process:
        cause = "batched_read" if batched_reads else "per_sample_overhead"
    elif nw == 0:
        # CPU work in a training process that already keeps every core busy (a CPU run's
        # intra-op threads): a worker would take a core from the model, not overlap with it
        # (a tokenising collate_fn, 1.15 ms a batch, the process at 181% of 2 cores: one
        # worker made the step ×2.0 slower, `trainprof tune`, 3 trials each)
        busy_host = (not ctx.on_cuda and stage in ("cpu", "collate") and idle_cores is not None
                     and idle_cores < 0.5)
        cause = "cpu_transforms" if busy_host else "too_few_workers"
    elif (cheap or handoff_bound) and worker_busy is not None and worker_busy < BUSY:
        # idle workers, samples that cost microseconds, and still a wait: the loop waits
        # for the hand-over of each batch, not for its loading
        cause = "worker_handoff"
    elif decisive and stage == "reads":
        cause = "slow_reads"
    elif decisive and stage == "collate":
        cause = "collate"
    elif decisive:  # CPU work: more workers help only while cores are idle
        if cpu_waiting < CPU_WAIT and (
            (idle_cores is not None and idle_cores >= 1) or (idle_cores is None and cores
                                                              and nw < cores)):
            cause = "too_few_workers"
        else:
            cause = "cpu_transforms"
    elif handoff_share >= HANDOFF * share:
        # workers not busy, and most of the wait is the training thread receiving the
        # batches' tensors. (Busy workers come first: a worker busy in Python holds its
        # GIL, and the receive, which needs a thread of the worker, waits for the
        # batch being made: 4.9 ms a tensor behind a 15 ms collate_fn, still the cause.)
        cause = "shared_memory_handoff"
    elif stage is not None and nw > 0:
        # measured, but the workers mostly wait to be asked: their speed is not what the
        # loop waits for, and their low CPU use says nothing about reads
        cause = "undetermined"
    elif per_worker is None:
        cause = "too_few_workers" if cores and nw < cores else "undetermined"
    elif per_worker < BLOCKED:
        cause = "slow_reads"
    elif cores_free is not None and cores_free >= 1:
        cause = "too_few_workers"
    else:
        cause = "cpu_transforms"

    if measured and stage is not None:
        blocked = stage == "reads"
    else:
        blocked = (blocked_min is not None and blocked_min >= 0.5) or (
            per_worker is not None and per_worker < BLOCKED
        )
    idle_workers = (cause == "undetermined" and nw > 0 and worker_busy is not None
                    and worker_busy < BUSY)
    # CPU-bound workers with most of a core idle, short of the whole one that makes them
    # too few: making samples cheaper stays the fix, and one more worker can use that room
    spare = None
    if cause == "cpu_transforms" and nw > 0 and cpu_waiting < CPU_WAIT:
        free = idle_cores if decisive else cores_free
        spare = free if free is not None and free >= SPARE_CORE else None
    if spare is not None:
        suggested = nw + 1
    elif cause in ("worker_startup_per_epoch", "cpu_transforms", "collate") or idle_workers:
        suggested = nw
    else:
        suggested = suggest_workers(nw, cores, gpus, blocked, ctx.on_cuda)
        free = idle_cores if decisive else cores_free
        if nw > 0 and not blocked and free is not None:
            # CPU-bound workers: add no more than the cores measured free.
            suggested = max(nw + 1, min(suggested, nw + math.floor(free)))
    pin = ctx.on_cuda and not (loader or {}).get("pin_memory")
    pct = f"{share * 100:.0f}%"
    core_txt = f"{cores} usable cores" if cores else "the usable cores"
    # idle workers: whether fewer or more change anything at all
    counts = [0, nw, 2 * nw] if idle_workers else sweep(nw, suggested)
    knob = f"trainprof tune --knob num_workers={','.join(map(str, counts))}"
    verify = f"{knob} {ctx.script}"
    commands: tuple[str, ...] = (verify,)  # the commands in verify, as it stands there
    # per-sample costs as measured in the workers (means: they add up to the fetch time)
    blocked_ms = cpu_ms = collate_ms = reads_ms = 0.0
    if measured and split:
        blocked_ms = _ms(measured["sample_blocked_ms"])
        cpu_ms = _ms(measured["sample_cpu_ms"])
        collate_ms = _ms(measured["collate_ms_per_batch"])
        off_cpu = float(split.get("blocked") or 0) + float(split.get("waiting_for_cpu") or 0)
        reads_ms = blocked_ms * float(split.get("blocked") or 0) / off_cpu if off_cpu else 0.0
    stage_txt = (
        f" Per sample the loading spends {reads_ms:.2f} ms blocked (reads, latency) and "
        f"{cpu_ms:.2f} ms on the CPU (decode, transforms); collate_fn takes {collate_ms:.2f} "
        "ms per batch."
        if measured else ""
    )
    functions = measured.get("worker_functions") if measured else None
    fn_txt = (f" Where the workers' time goes (sampled): {', '.join(functions[:3])}."
              if functions else "")

    if cause == "worker_startup_per_epoch":
        spikes = evidence.get("epoch_spikes")
        per_epoch = (spikes["excess_per_epoch_s"] if spikes else startup_median_s) or 0.0
        title = (
            f"DataLoader workers restart every epoch: {per_epoch:.2f} s per epoch start, "
            f"{startup_share * 100:.0f}% of step time (data wait {pct} in all)"
        )
        text = (
            "Without persistent_workers=True the DataLoader stops its worker processes at the "
            "end of every epoch and starts new ones (re-importing, re-building the dataset) "
            "before the first batch of the next. Keep them alive across epochs."
        )
        restarting = [d for d in alongside
                      if int(d.get("num_workers") or 0) > 0 and not d.get("persistent_workers")]
        if len(restarting) > 1:  # zipped: every epoch start waits on all their start-ups
            text += (f" The {len(restarting)} loaders iterated together (" + ", ".join(
                f"#{d.get('index')}" for d in restarting) + ") each restart theirs: "
                "set it on every one.")
        rest = share - startup_share
        if rest >= MEDIUM:
            # the start-ups are the larger part, not all of it: say what stays
            text += (
                f" That removes the start-ups ({startup_share * 100:.0f}% of step time); the "
                f"rest of the wait ({rest * 100:.0f}%) is the loading itself, which a run "
                f"with persistent workers diagnoses on its own.{stage_txt}"
            )
        comment = "unchanged"
        verify = f"trainprof tune --knob persistent_workers=false,true {ctx.script}"
        commands = (verify,)
    elif cause == "too_few_workers":
        if nw == 0:
            title = (
                f"Training waits for data {pct} of step time: batches are loaded in the "
                "training process (num_workers=0)"
            )
            text = (
                f"With num_workers=0 every sample is read and transformed in the training "
                f"process while the model waits.{stage_txt} Load in {suggested} worker "
                f"process{'' if suggested == 1 else 'es'} so the next batches are prepared "
                "while the model computes "
                f"({core_txt})."
            )
            if blocked and (measured or (blocked_min is not None and blocked_min >= 0.5)):
                most = (
                    "Most of the loading time is off-CPU (reads, latency)" if measured
                    else f"At least {(blocked_min or 0) * 100:.0f}% of the wait is off-CPU "
                    "(reads, latency)"
                )
                text += (
                    f" {most}, so workers overlap it even beyond the core count; if it stays "
                    f"slow, {PACK_HINT}"
                )
                outside = ctx.external_cores
                if outside is not None and outside >= OUTSIDE_LOAD_CORES:
                    # the training process does not read its run-queue wait (a system call
                    # a batch): under outside load, waiting for a core reads as blocked
                    evidence["outside_load_cores"] = outside
                    text += (
                        f" Other processes kept ~{outside:.1f} cores busy meanwhile, and the "
                        "training process's waits for a core count as blocked time: part of "
                        "it may be the machine's load, which no number of workers removes; "
                        "measure again on a quiet machine before adding workers beyond the "
                        "cores."
                    )
        elif decisive:
            title = (
                f"Training waits for data {pct} of step time: {nw} DataLoader workers spend "
                f"{cpu_ms:.2f} ms of CPU per sample and cores are idle"
            )
            text = (
                f"The {nw} workers are busy and CPU-bound ({cpu_ms:.2f} ms of CPU per sample, "
                f"{reads_ms:.2f} ms blocked) while {idle_cores or 0:.1f} cores are idle: use "
                f"{suggested} workers ({core_txt}).{fn_txt}"
            )
        else:
            title = (
                f"Training waits for data {pct} of step time: {nw} DataLoader workers are "
                "busy and cores are free"
            )
            text = (
                f"The {nw} workers are near saturation ({(per_worker or 0) * 100:.0f}% CPU "
                f"each) while cores are free: use {suggested} workers ({core_txt})."
            )
        comment = f"was {nw}; {core_txt}"
    elif cause == "cpu_transforms":
        iterable = bool((loader or {}).get("iterable_dataset"))
        images = holds_images(loader, ctx.batch_tensors(loader),
                              _top_functions(w, 20) if w else None)
        evidence["samples_are_images"] = images
        if nw == 0:
            title = (
                f"Training waits for data {pct} of step time: batches are made on the CPU in "
                f"the training process (collate_fn {collate_ms:.2f} ms a batch, "
                f"{cpu_ms * 1000:.1f} µs a sample), which keeps every core busy"
            )
            outside = ctx.external_cores
            busy_by = (f"this process {sysinfo.get('proc_cpu_pct') or 0:.0f}% CPU, 100% = one "
                       "core" + (f"; other processes ~{outside:.1f} cores"
                                 if outside is not None and outside >= 0.5 else ""))
            why = (
                "With num_workers=0 the loading runs in the training process, and the "
                f"{core_txt} are busy already ({busy_by}): a worker process would take a core "
                "from the model's threads rather than overlap with it. Make each batch "
                "cheaper."
            )
            if stage == "collate":
                why += (
                    f" collate_fn takes {float((split or {}).get('collate') or 0) * 100:.0f}% "
                    "of the loading: per-sample work it does (tokenising, decoding) belongs in "
                    "the dataset, where it can be done once, and the collate then only stacks "
                    "or pads."
                )
        elif decisive:
            title = (
                f"Training waits for data {pct} of step time: each sample takes {cpu_ms:.2f} ms "
                "of CPU in the DataLoader workers (decode, transforms) and "
                + ("no core is free" if spare is None else f"{spare:.1f} of a core is idle")
            )
            why = (
                f"The {nw} workers spend most of their time on the CPU ({cpu_ms:.2f} ms per "
                f"sample vs {reads_ms:.2f} ms blocked on reads)"
                + (f"; {cpu_waiting * 100:.0f}% of that time they wait for a core" if
                   cpu_waiting >= 0.05 else "")
                + ("; no core is free, so more workers cannot help: make each sample cheaper."
                   if spare is None else _spare_core_text(spare, nw))
            )
        else:
            title = (
                f"Training waits for data {pct} of step time: the DataLoader workers saturate "
                "the CPU" + ("" if spare is None else f" ({spare:.1f} of a core idle)")
            )
            why = (
                f"The {nw} workers are at {(per_worker or 0) * 100:.0f}% CPU each"
                + (" and no core is free, so more workers cannot help: make each sample "
                   "cheaper." if spare is None else _spare_core_text(spare, nw))
            )
        text = f"{why}{fn_txt} " + _cache_advice(images, iterable)
        if decisive and not functions:
            text += f" `trainprof run --py {ctx.script}` shows which functions take the time."
        comment = (f"unchanged: the {core_txt} are busy" if spare is None
                   else f"was {nw}: {spare:.1f} of a core is idle")
        run_dir = ctx.summary.get("run_dir") or "RUN"
        filled = ("once the pack is written" if iterable
                  else "(twice: the first run fills the cache)")
        commands = (f"trainprof run {ctx.script}", f"trainprof compare {run_dir} <the new run>")
        verify = (
            f"`{commands[0]}` after the change {filled}, then {commands[1]}: the data wait "
            f"share (now {pct}) should fall"
        )
        threads = ctx.environment.get("torch_num_threads")
        if spare is not None:
            aside = f"trainprof tune --knob num_workers={nw},{nw + 1} {ctx.script}"
            verify += f"; one more worker on its own: {aside}"
            commands += (aside,)
        elif nw == 0 and isinstance(threads, int) and threads > 1:
            # the trade a worker would make: a core from the model's threads
            aside = (f"trainprof tune --knob num_workers=0,1 "
                     f"--knob torch_threads={threads - 1},{threads} {ctx.script}")
            verify += f"; a worker for a thread: {aside}"
            commands += (aside,)
        elif nw > 0 and not ctx.on_cuda:
            # the reverse trade on a CPU run: workers that take cores from the model's
            # threads and add a hand-over (a dataset building samples in Python, 1 worker
            # on 2 cores: num_workers=0 ran ×0.59 of the step, `trainprof tune`, 3 trials)
            aside = f"trainprof tune --knob num_workers=0,{nw} {ctx.script}"
            verify += ("; with no core free the workers may cost the model more than they "
                       f"give: {aside}")
            commands += (aside,)
    elif cause == "shared_memory_handoff":
        return shared_memory_handoff_finding(ctx, loader, evidence, share, pct)
    elif cause in ("per_sample_overhead", "worker_handoff", "batched_read"):
        return _cheap_samples_finding(ctx, cause, loader, evidence, share, severity, nw,
                                      sample_ms or 0.0, collate_ms, worker_busy, pct)
    elif cause == "collate":
        col_share = float((split or {}).get("collate") or 0)
        title = (
            f"Training waits for data {pct} of step time: collate_fn takes {collate_ms:.1f} ms "
            f"per batch, {col_share * 100:.0f}% of the DataLoader workers' time"
        )
        text = (
            f"Building each batch from its samples (collate_fn: {collate_ms:.2f} ms per batch) "
            f"costs more than loading them ({reads_ms:.2f} ms blocked and {cpu_ms:.2f} ms CPU "
            f"per sample).{fn_txt} Build the batch with one vectorised call: return numpy "
            "arrays or tensors (not lists of Python numbers) from the dataset, stack them once, "
            "keep images uint8 and convert and normalise after the copy to the device."
        )
        snippet = (
            "def fast_collate(batch):  # one stack per field, uint8 kept as uint8\n"
            "    images = torch.from_numpy(np.stack([img for img, _ in batch]))\n"
            "    labels = torch.tensor([label for _, label in batch])\n"
            "    return images, labels\n\n"
            + loader_snippet(loader, num_workers=nw, pin_memory=pin, comment="unchanged",
                             split_verified=_split_verified(w),
                             collate_fn="fast_collate")
            + "\n# after the copy: x = x.to(device, non_blocking=True).float().sub_(mean)"
            ".div_(std)"
        )
        return Finding(
            category="input_pipeline", cause=cause, title=title, severity=severity,
            evidence=evidence, estimated_gain=share, fix=Fix(text=text, snippet=snippet),
            verify=(
                f"time collate_fn on one batch before and after; then `trainprof run "
                f"{ctx.script}`: collate (now {collate_ms:.2f} ms per batch) and the data wait "
                f"share (now {pct}) should fall"
            ),
            verify_commands=(f"trainprof run {ctx.script}",),
        )
    elif cause == "slow_reads":
        if decisive:
            title = (
                f"Training waits for data {pct} of step time: each sample waits "
                f"{reads_ms:.2f} ms on reads or latency in the DataLoader workers "
                f"(CPU work {cpu_ms:.2f} ms)"
            )
            text = (
                f"The {nw} workers spend most of their time blocked ({reads_ms:.2f} ms per "
                f"sample, against {cpu_ms:.2f} ms of CPU): they wait on storage or the network."
                f"{fn_txt} More workers overlap more of that wait (beyond the core count); "
                f"removing it is better: {PACK_HINT}"
            )
        else:
            title = (
                f"Training waits for data {pct} of step time: the DataLoader workers are "
                "mostly blocked (reads or latency)"
            )
            text = (
                f"The {nw} workers use only {(per_worker or 0) * 100:.0f}% CPU each while the "
                "loop waits: they wait on storage or the network. More workers overlap more of "
                f"that wait (beyond the core count); removing it is better: {PACK_HINT}"
            )
        comment = f"was {nw}: blocked workers can exceed the {core_txt}"
    else:
        title = f"Training waits for data {pct} of step time"
        text = (
            "The loop waits for its input. Give the DataLoader worker processes "
            "(num_workers), keep them across epochs (persistent_workers=True) and measure "
            "which stage is slow: reading, transforming or collating."
        )
        comment = f"was {nw}"
        if idle_workers:
            text = (
                f"The loop waits for its input while its {nw} DataLoader workers are busy "
                f"only {(worker_busy or 0) * 100:.0f}% of the time, so their speed is not "
                "what the loop waits for, and more of them would not help: look at how "
                "batches reach the training process (batch size in bytes, pin_memory, a "
                "slow batch holding the in-order queue: in_order=False, a larger "
                f"prefetch_factor).{stage_txt}"
            )
            comment = f"unchanged: busy only {(worker_busy or 0) * 100:.0f}% of the time"
    if pin:
        text += " Pin host memory (pin_memory=True) so copies to the GPU run asynchronously."
    snippet = loader_snippet(loader, num_workers=suggested, pin_memory=pin, comment=comment,
                             split_verified=_split_verified(w))
    if cause == "slow_reads" or (cause == "too_few_workers" and nw == 0 and blocked):
        snippet += "\n\n" + PACK_SNIPPET
    if cause == "cpu_transforms":
        if iterable:  # the loader of the packed samples: map-style, nothing to split
            snippet = loader_snippet({**(loader or {}), "iterable_dataset": False},
                                     num_workers=suggested, pin_memory=pin, comment=comment)
        snippet = cache_snippet(_short((loader or {}).get("dataset"), "Dataset"), snippet,
                                on_cuda=ctx.on_cuda, images=images, iterable=iterable)
    gain = share
    if cause == "too_few_workers" and nw == 0:
        gain = workers_bound(share, suggested)
        evidence["suggested_workers"] = suggested
        if gain < share:
            evidence["bound_with_suggested_workers"] = gain
            severity = band(gain, HIGH, MEDIUM) or "low"
            text += (
                f" With {suggested} worker{'' if suggested == 1 else 's'} the loading "
                f"({pct} of the step) runs beside the rest of the step, "
                f"{suggested} batch{'' if suggested == 1 else 'es'} at a time, and the step "
                f"falls at most to the longer of the two: up to {gain * 100:.0f}% saved. "
                "The rest needs cheaper loading: cache or pack the prepared samples, or "
                "make the transforms cheaper."
            )
    return Finding(
        category="input_pipeline",
        cause=cause,
        title=title,
        severity=severity,
        evidence=evidence,
        estimated_gain=gain,
        fix=Fix(text=text, snippet=snippet),
        verify=verify,
        verify_commands=commands,
    )
