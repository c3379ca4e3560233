"""Synthetic input: every DataLoader yields its first batch again, at no cost.

The elimination test of expert-rules.md I7 ("Confirm by elimination: compare
throughput with synthetic/random input ... equal throughput → not input-bound", TF's
input-pipeline guide and Composer) and N7 ("synthetic or no-op baselines"). Run with
it (``trainprof tune --knob synthetic_data=false,true``), a script's step time is what
it would be if loading cost nothing: the most any fix of the input pipeline can give,
measured rather than estimated from the data-wait share (which misses what loading
takes from the model's cores: worker processes competing with intra-op threads).

How: the knob sets ``num_workers=0`` on every DataLoader (no worker loads anything;
:mod:`trainprof.capture.knobs`), and the single-process iterator's ``_next_data``
returns the loader's first batch (loaded once, really, with its pinning) for every
later batch. The sampler still advances, so an epoch of a map-style dataset has its
usual number of batches and ends where it did; an ``IterableDataset``'s epoch never
ends (its end is known only by reading it): ``trainprof tune`` stops each trial after
``--steps`` steps. The batch is the same tensors each time: a script that changes its
batch in place changes the next one too (harmless for timing).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any


def install(record: dict[str, Any]) -> Callable[[], None]:
    """Patch the single-process iterator; returns the function that undoes it.

    ``record`` (the knob's entry in run.json) gets ``batches_cached``: the loaders
    whose first batch was kept.
    """
    from torch.utils.data.dataloader import _SingleProcessDataLoaderIter

    original = _SingleProcessDataLoaderIter.__dict__["_next_data"]
    # one first batch per loader: keyed by the loader's index sampler (its batch sampler,
    # or its sampler without automatic batching), an object a loader keeps for its life
    first: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
    record["batches_cached"] = 0

    def _next_data(it: Any) -> Any:
        key = it._index_sampler
        try:
            batch = first[key]
        except (KeyError, TypeError):  # TypeError: a sampler that cannot be weakly keyed
            batch = original(it)
            try:
                first[key] = batch
                record["batches_cached"] += 1
            except TypeError:
                pass
            return batch
        it._next_index()  # the sampler advances: StopIteration where the epoch ends
        return batch

    _SingleProcessDataLoaderIter._next_data = _next_data  # type: ignore[method-assign]

    def undo() -> None:
        _SingleProcessDataLoaderIter._next_data = original  # type: ignore[method-assign]
        first.clear()

    return undo
