"""Each optimizer's own ``step()`` time, once a script has more than one.

The step clock times the optimizer phase as a whole: every optimizer's ``step()`` in a
step adds to it. With one optimizer that phase is its step; with several (a GAN's two, a
recommender's ``SparseAdam`` over its embeddings beside an ``Adam`` over the MLP), the
optimizer finding must know whose time it is before it proposes a faster implementation
for one of them (:mod:`trainprof.diagnosis.optimizer`): a recommender's SparseAdam (no
fused one) took 11.4 ms a step beside an Adam at 0.36 ms, and the whole phase had been
put on the Adam.

So from the second optimizer a script steps on, each described optimizer gets a pair of
its own step hooks (``Optimizer.register_step_pre_hook`` / ``register_step_post_hook``,
torch's per-instance hooks) that add the step's time to a ``[ns, steps]`` list the record
keeps. A script with one optimizer pays nothing; one with several pays two Python calls
and two clock reads per optimizer step: 0.53 µs (SGD over one tensor, 10.34 µs a step
plain, 10.86 hooked, medians of 7 interleaved rounds of 20,000 steps, this VM).
Steps of the training thread only, as the clock's; where a step of an optimizer runs
inside another of its own (a subclass calling ``super().step()``, both hooked) the inner
one is what is counted.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any


class OptimizerTimes:
    """``[ns, steps]`` of each watched optimizer's outermost ``step()`` calls."""

    def __init__(self, owner: Callable[[], int | None]) -> None:
        #: the training thread's ident (the clock's owner), read at each call
        self._owner = owner
        self._handles: list[Any] = []

    def watch(self, optimizer: Any, spent: list[int]) -> bool:
        """Add ``optimizer``'s step time to ``spent`` from now on; False if it cannot be
        hooked (not a torch.optim.Optimizer)."""
        pre_register = getattr(optimizer, "register_step_pre_hook", None)
        post_register = getattr(optimizer, "register_step_post_hook", None)
        if not (callable(pre_register) and callable(post_register)):
            return False
        start = [0]  # when the open step began (0: none open)
        owner = self._owner

        def pre(_opt: Any, _args: Any, _kwargs: Any) -> None:
            if threading.get_ident() == owner():
                start[0] = perf_counter_ns()  # (a step that raised left one open: replaced)

        def post(_opt: Any, _args: Any, _kwargs: Any) -> None:
            if start[0] and threading.get_ident() == owner():
                spent[0] += perf_counter_ns() - start[0]
                spent[1] += 1
                start[0] = 0

        try:
            self._handles += [pre_register(pre), post_register(post)]
        except Exception:  # noqa: BLE001 - an optimizer that refuses hooks: not timed
            return False
        return True

    def close(self) -> None:
        """Remove every hook (the record is closing; the script's optimizers stay as they were)."""
        for handle in self._handles:
            with contextlib.suppress(Exception):  # the optimizer is gone: nothing to remove
                handle.remove()
        self._handles.clear()
