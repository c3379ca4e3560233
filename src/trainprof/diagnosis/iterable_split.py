"""An ``IterableDataset`` every DataLoader worker iterates whole: each sample loaded N times.

With ``num_workers=N`` the DataLoader gives each worker a copy of an ``IterableDataset``
and calls its ``__iter__`` in every one. Unless ``__iter__`` splits the stream by
``torch.utils.data.get_worker_info()`` (``id``, ``num_workers``), or a
``worker_init_fn`` does, every worker yields the whole stream: an epoch loads, and
trains on, each sample N times, N times the work (the PyTorch documentation of
``torch.utils.data.IterableDataset`` shows this duplication and both ways to split).
No setting shows it; the workers' data does: each worker fingerprints its first two
batches (:mod:`trainprof.capture.batch_digest`), and
:func:`trainprof.analysis.workers._same_stream` finds workers of one generation whose
first batches are identical while their data varies.

The step is no slower, so there is no step-time gain to claim (``estimated_gain`` 0):
the cost is N times the steps for one pass over the data, and a model that sees its
data in N-fold repeats. Severity is high: it is a correctness bug with a time cost.
Findings are ordered by estimated gain (DESIGN.md's JSON contract), so it comes after
those with a gain; its title says first that the data is duplicated.

The fix splits the stream's sources (files, shards) between the workers first, and
its samples only where there is a single source: split by sample, every worker still
reads and decodes the whole stream (see :func:`split_snippet`).

A map-style ``Dataset`` can do the same (``map_dataset_ignores_index``): its workers are
given different indices, so identical first batches mean ``__getitem__`` does not read the
sample its index names - it takes the next item of a stream it holds (an iterator, a
generator, a file read line by line), and each worker's copy of that stream starts at the
same place. Every worker then returns the same samples, and most of the dataset is never
read.
"""

from __future__ import annotations

from typing import Any

from trainprof.diagnosis.context import Context
from trainprof.diagnosis.finding import Finding, Fix
from trainprof.diagnosis.registry import rule


def split_snippet(name: str, by_rank: bool = False) -> str:
    """``__iter__`` of the dataset ``name``, each worker (and with ``by_rank``, each rank's
    worker) taking its own share of the stream: its own sources (files, shards) when there
    are at least as many as shares, so that each reads and decodes only its own; every
    ``shards``-th sample only as the fallback for fewer sources (every worker still reads,
    and decodes, the whole stream to keep its share: 1.9 ms of worker CPU a sample against
    0.96 ms split by file, a tokenised text stream of 8 files in 2 workers)."""
    lines = ["import torch.distributed as dist"] if by_rank else []
    lines += [
        "from torch.utils.data import IterableDataset, get_worker_info",
        "",
        f"class {name}(IterableDataset):",
        "    def __iter__(self):",
        "        info = get_worker_info()",
        "        worker, workers = (info.id, info.num_workers) if info else (0, 1)",
    ]
    if by_rank:
        lines += ["        shard = dist.get_rank() * workers + worker",
                  "        shards = dist.get_world_size() * workers"]
    else:
        lines += ["        shard, shards = worker, workers"]
    lines += [
        "        files = self.files  # your stream's sources: files, shards, URLs",
        "        if len(files) >= shards:  # each reads and decodes only its own files",
        "            for path in files[shard::shards]:",
        "                yield from self.read(path)  # your stream of one file, as before",
        "        else:  # fewer sources than shares: each keeps every shards-th sample",
        "            for i, sample in enumerate(self.samples()):  # your stream, as before",
        "                if i % shards == shard:",
        "                    yield sample",
    ]
    return "\n".join(lines)


#: Why the split is by source first, in a finding's words.
SPLIT_BY_SOURCE = (
    "Split by source first (each worker takes files[worker::num_workers]), so that each "
    "worker reads and decodes only its own files; taking every num_workers-th sample "
    "instead still has every worker read and decode (tokenise) the whole stream, to throw "
    "most of it away (1.9 ms of worker CPU a sample against 0.96 ms split by file, a "
    "tokenised text stream of 8 files in 2 workers): keep that for a single source."
)


@rule("input_pipeline.iterable_not_split")
def iterable_not_split(ctx: Context) -> Finding | None:
    for loader in ctx.loaders:
        if not loader.get("iterable_dataset"):
            continue
        w = ctx.worker_stats(loader) or {}
        same = w.get("same_stream")
        if not isinstance(same, dict) or int(same.get("identical_workers") or 0) < 2:
            continue
        return _finding(ctx, loader, same)
    return None


def _finding(ctx: Context, loader: dict[str, Any], same: dict[str, Any]) -> Finding:
    n = int(same["identical_workers"])
    compared = int(same.get("workers_compared") or n)
    nw = int(loader.get("num_workers") or compared)
    dataset = str(loader.get("dataset") or "dataset").rsplit(".", 1)[-1]
    who = "all" if n >= compared else f"{n} of the"
    title = (f"Duplicated data, every sample {n} times an epoch: {who} {compared} DataLoader "
             f"workers load the same data, {dataset} (an IterableDataset) is not split "
             "between them")
    text = (
        f"The DataLoader runs {dataset}.__iter__ in each of its {nw} worker processes. "
        f"The first batches of {who} {compared} workers were identical (the data itself, "
        "compared by a hash of each worker's first batches), so each one yields the "
        f"whole stream: an epoch takes {n} times the steps it should, and the model sees "
        f"each sample {n} times in a row of batches. Split the stream in __iter__ with "
        "torch.utils.data.get_worker_info(), or in a worker_init_fn. "
        f"{SPLIT_BY_SOURCE} Libraries that stream data (webdataset's split_by_worker, "
        "Hugging Face datasets' IterableDataset) do it for you."
    )
    evidence = {
        "identical_workers": n,
        "workers_compared": compared,
        "generation": same.get("generation"),
        "loader": {k: loader.get(k) for k in ("index", "dataset", "batch_size",
                                              "num_workers")},
    }
    return Finding(
        category="input_pipeline",
        cause="iterable_not_split",
        title=title,
        severity="high",
        evidence=evidence,
        estimated_gain=0.0,
        fix=Fix(text=text, snippet=split_snippet(dataset)),
        verify=(f"trainprof run {ctx.script}: this finding is gone, and the steps of an "
                f"epoch fall to 1/{n}"),
        verify_commands=(f"trainprof run {ctx.script}",),
    )


@rule("input_pipeline.map_dataset_ignores_index")
def map_dataset_ignores_index(ctx: Context) -> Finding | None:
    for loader in ctx.loaders:
        if loader.get("iterable_dataset"):
            continue
        w = ctx.worker_stats(loader) or {}
        same = w.get("same_stream")
        if not isinstance(same, dict) or int(same.get("identical_workers") or 0) < 2:
            continue
        n = int(same["identical_workers"])
        compared = int(same.get("workers_compared") or n)
        dataset = str(loader.get("dataset") or "dataset").rsplit(".", 1)[-1]
        who = "all" if n >= compared else f"{n} of the"
        text = (
            f"The DataLoader's sampler gives each of its workers different indices, yet the "
            f"first batches of {who} {compared} workers were identical (the data itself, "
            f"compared by a hash of each worker's first batches): {dataset}.__getitem__ does "
            "not read the sample its index names. It takes the next item of a stream it "
            "holds - an iterator, a generator, a file read line by line - and each worker "
            "has a copy of that stream, at the same place. So every worker returns the "
            f"same samples ({n} copies of each), and most of the dataset is never read. Read "
            "the sample at the index (an offsets table into the file, a memory map, a list "
            "loaded once), or make the dataset an IterableDataset that splits its stream "
            "between the workers with get_worker_info()."
        )
        snippet = (
            f"class {dataset}(Dataset):\n"
            "    def __init__(self, path):\n"
            "        self.rows = load_rows(path)  # or offsets into the file, a np.memmap\n"
            "    def __len__(self):\n"
            "        return len(self.rows)\n"
            "    def __getitem__(self, index):\n"
            "        return parse(self.rows[index])  # the sample the index names\n\n"
            "# or, kept as a stream:\n" + split_snippet(dataset)
        )
        return Finding(
            category="input_pipeline",
            cause="map_dataset_ignores_index",
            title=(f"{who.capitalize()} {compared} DataLoader workers load the same data: "
                   f"{dataset}.__getitem__ ignores its index, so each worker returns the "
                   f"same samples"),
            severity="high",
            evidence={"identical_workers": n, "workers_compared": compared,
                      "generation": same.get("generation"),
                      "loader": {k: loader.get(k) for k in ("index", "dataset", "batch_size",
                                                            "num_workers", "sampler")}},
            estimated_gain=0.0,
            fix=Fix(text=text, snippet=snippet),
            verify=(f"trainprof run {ctx.script}: this finding is gone (each worker's first "
                    "batch differs)"),
            verify_commands=(f"trainprof run {ctx.script}",),
        )
    return None
