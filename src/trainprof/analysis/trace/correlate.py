"""Links between events: device work ↔ the runtime call that launched it ↔ the CPU op.

Kineto gives a runtime call (``cudaLaunchKernel``, ``cudaMemcpyAsync``, ...) and the
device work it enqueued the same ``correlation`` id, and gives CPU ops, runtime
calls and device events the ``External id`` of the op that issued them (``external
id`` in old traces). Both links are resolved here once, vectorised, by sorting the
ids and searching them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from trainprof.analysis.trace.events import DEVICE_KINDS, Events, Kind


def _lookup(keys: np.ndarray, rows: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """For each wanted key, the row whose key matches (-1 if none); keys may repeat."""
    out = np.full(wanted.shape, -1, dtype=np.int64)
    if keys.size == 0 or wanted.size == 0:
        return out
    order = np.argsort(keys, kind="stable")
    k = keys[order]
    pos = np.searchsorted(k, wanted, side="left")
    pos_c = np.minimum(pos, k.size - 1)
    hit = (pos < k.size) & (k[pos_c] == wanted) & (wanted >= 0)
    out[hit] = rows[order[pos_c[hit]]]
    return out


@dataclass
class Links:
    """Row indices of the event kinds and their correlations, computed on first use."""

    ev: Events

    @cached_property
    def device_rows(self) -> np.ndarray:
        """Kernels, memcpys and memsets, in file order."""
        return self.ev.where(*DEVICE_KINDS)

    @cached_property
    def kernel_rows(self) -> np.ndarray:
        return self.ev.where(Kind.KERNEL)

    @cached_property
    def runtime_rows(self) -> np.ndarray:
        return self.ev.where(Kind.RUNTIME)

    @cached_property
    def op_rows(self) -> np.ndarray:
        """CPU ops and user annotations (record_function labels)."""
        return self.ev.where(Kind.CPU_OP, Kind.ANNOTATION)

    @cached_property
    def runtime_of_device(self) -> np.ndarray:
        """For each row of :attr:`device_rows`, the launching runtime row (-1: none)."""
        return self.runtime_of(self.device_rows)

    def runtime_of(self, rows: np.ndarray) -> np.ndarray:
        """For each of ``rows``, the runtime call with the same correlation id (-1: none)."""
        rt = self.runtime_rows
        rt = rt[self.ev.corr[rt] >= 0]
        return _lookup(self.ev.corr[rt], rt, self.ev.corr[rows])

    @cached_property
    def op_of_ext(self) -> tuple[np.ndarray, np.ndarray]:
        """(sorted external ids of ops, their rows) for :meth:`op_for_ext`."""
        rows = self.op_rows
        ext = self.ev.ext[rows]
        keep = ext >= 0
        rows, ext = rows[keep], ext[keep]
        order = np.argsort(ext, kind="stable")
        return ext[order], rows[order]

    def op_for_ext(self, ext: np.ndarray) -> np.ndarray:
        """The CPU op / annotation row with each external id (-1: none)."""
        keys, rows = self.op_of_ext
        out = np.full(ext.shape, -1, dtype=np.int64)
        if keys.size == 0 or ext.size == 0:
            return out
        pos = np.searchsorted(keys, ext, side="left")
        pos_c = np.minimum(pos, keys.size - 1)
        hit = (pos < keys.size) & (keys[pos_c] == ext) & (ext >= 0)
        out[hit] = rows[pos_c[hit]]
        return out

    @cached_property
    def launching_op_of_device(self) -> np.ndarray:
        """For each device row, the CPU op that issued it (by external id; -1: none).

        Device events carry the op's external id themselves in every Kineto generation;
        where one does not, the launching runtime call's external id is used.
        """
        ext = self.ev.ext[self.device_rows].copy()
        rt = self.runtime_of_device
        missing = (ext < 0) & (rt >= 0)
        ext[missing] = self.ev.ext[rt[missing]]
        return self.op_for_ext(ext)
