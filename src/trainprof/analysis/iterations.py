"""Steps per iteration of the loop, where a script's optimizers step at different rates.

Steps are delimited by one optimizer's steps (:mod:`trainprof.capture.clock`: the first to
step). A GAN whose discriminator steps k times for each generator step (WGAN's
``n_critic = 5``; an explorer's ``--k 2``) has k steps an iteration, of two kinds: the
discriminator's alone (about 21 ms), and the one that adds the generator's step and a new
batch (about 40 ms). Their median is no real step, and the step-to-step variation is the
loop's structure, not noise. With several optimizers each one's ``step()`` calls are
counted (:mod:`trainprof.capture.optimizer_time`), from the second optimizer's first step
on: the delimiting one's count over the most any other made, when it is a whole number of
2 or more (within a tenth), is the steps an iteration.
"""

from __future__ import annotations

from typing import Any

#: How far from a whole number the ratio of step counts may be (a tenth of it).
TOLERANCE = 0.1


def steps_per_iteration(optimizers: Any) -> int | None:
    """k steps an iteration (see the module docstring); None where it is 1 or not known."""
    entries = [o for o in optimizers or [] if isinstance(o, dict)
               and isinstance(o.get("steps"), int) and o["steps"] > 0]
    primary = next((o for o in entries if o.get("primary")), None)
    others = [int(o["steps"]) for o in entries if not o.get("primary")]
    if primary is None or not others:
        return None
    ratio = int(primary["steps"]) / max(others)
    k = round(ratio)
    return k if k >= 2 and abs(ratio - k) <= TOLERANCE * k else None


def group_steps(records: Any, k: int | None) -> Any:
    """Step records summed by ``k`` consecutive steps: one record an iteration.

    Durations, phases and counters add up; ``step`` and ``t_start_ns`` are the first step's,
    ``flags`` all of the steps' together. Any ``k`` consecutive steps of a periodic loop hold
    one step of each kind (the generator's step among them), so no alignment is needed; the
    last steps that make no whole iteration are left out. ``k`` of 1 or None: unchanged.
    """
    import numpy as np

    if not k or k < 2 or len(records) < k:
        return records if not k or k < 2 else records[:0]
    whole = records[: len(records) // k * k]
    out = np.zeros(len(whole) // k, dtype=records.dtype)
    for name in records.dtype.names:
        column = whole[name].reshape(-1, k)
        if name in ("step", "t_start_ns"):
            out[name] = column[:, 0]
        elif name == "flags":
            out[name] = np.bitwise_or.reduce(column, axis=1)
        else:
            out[name] = column.sum(axis=1)
    return out
