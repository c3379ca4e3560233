"""Per-GPU counters through NVML, for the system sampler (:mod:`trainprof.capture.sampler`).

NVML is what ``nvidia-smi`` and nvitop read: utilisation, memory, power, temperature and
clocks, per physical device, without a CUDA context. ``pynvml`` comes from the optional
``nvidia-ml-py`` package (``pip install -e '.[gpu]'``) and is imported only when the
sampler starts, so CPU-only hosts need neither the package nor a driver.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

#: Files NVIDIA's kernel driver creates when it is loaded (Linux).
DRIVER_FILES = ("/proc/driver/nvidia/version", "/dev/nvidiactl")


def nvidia_driver_present() -> bool:
    """Whether NVIDIA's kernel driver is loaded here: a host that has NVIDIA GPUs to sample."""
    return any(os.path.exists(path) for path in DRIVER_FILES)


class NvmlReader:
    """Per-GPU counters via NVML (``pynvml`` from the optional ``nvidia-ml-py`` package).

    Imported lazily so the sampler works on CPU-only hosts without the package.  ``util_pct`` is
    NVML's "percent of time a kernel was running" over the driver's sample period, not SM
    occupancy: a GPU running one tiny kernel at a time shows 100 %.  All physical devices are
    sampled (NVML ignores CUDA_VISIBLE_DEVICES, and mapping it to NVML indices is ambiguous);
    ``index`` is the NVML index.
    """

    def __init__(self, note: Callable[[str, str], None]) -> None:
        self._note = note
        self._nv: Any = None
        self._handles: list[Any] = []
        self._unsupported: set[tuple[int, str]] = set()

    def open(self) -> int:
        """Initialise NVML; return the device count (0, with a note, when unavailable)."""
        try:
            import pynvml
        except ImportError:
            # without the package, a host with NVIDIA's driver has GPUs that go unsampled;
            # a host without it has none to miss (no note: nothing is missing there)
            if nvidia_driver_present():
                self._note("gpu", "gpu: nvidia-ml-py not installed, so no GPU counters "
                                  "(pip install nvidia-ml-py)")
            return 0
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self._note("gpu", f"gpu: no NVIDIA GPU (NVML init failed: {exc})")
            return 0
        try:
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except Exception as exc:
            self._note("gpu", f"gpu: NVML device enumeration failed: {exc}")
            self._shutdown(pynvml)
            return 0
        if not self._handles:
            self._note("gpu", "gpu: NVML reports no devices")
            self._shutdown(pynvml)
            return 0
        self._nv = pynvml
        return len(self._handles)

    def read(self, pid: int | None = None) -> list[dict[str, Any]] | None:
        """Return one dict per device, or None when NVML is not in use; ``pid``: the
        training process, whose own memory on each device is read too."""
        if self._nv is None:
            return None
        return [self._read_device(i, h, pid) for i, h in enumerate(self._handles)]

    def close(self) -> None:
        """Shut NVML down (idempotent)."""
        if self._nv is not None:
            self._shutdown(self._nv)
            self._nv = None

    @staticmethod
    def _shutdown(nv: Any) -> None:
        with contextlib.suppress(Exception):  # nothing useful to do at shutdown
            nv.nvmlShutdown()

    def _read_device(self, index: int, handle: Any, pid: int | None) -> dict[str, Any]:
        nv = self._nv
        util = self._field(index, "util_pct", lambda: nv.nvmlDeviceGetUtilizationRates(handle).gpu)
        mem = self._field(index, "memory", lambda: nv.nvmlDeviceGetMemoryInfo(handle))
        power_mw = self._field(index, "power_w", lambda: nv.nvmlDeviceGetPowerUsage(handle))
        temp = self._field(
            index, "temp_c", lambda: nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU)
        )
        sm_clock = self._field(
            index, "sm_clock_mhz", lambda: nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM)
        )
        mem_clock = self._field(
            index, "mem_clock_mhz", lambda: nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_MEM)
        )
        own = None
        if pid is not None:
            procs = self._field(index, "proc_mem_used_bytes",
                                lambda: nv.nvmlDeviceGetComputeRunningProcesses(handle))
            own = _own_memory(procs, pid)
        return {
            "index": index,
            "util_pct": util,
            "mem_used_bytes": None if mem is None else mem.used,
            "proc_mem_used_bytes": own,
            "mem_total_bytes": None if mem is None else mem.total,
            "power_w": None if power_mw is None else round(power_mw / 1000.0, 1),
            "temp_c": temp,
            "sm_clock_mhz": sm_clock,
            "mem_clock_mhz": mem_clock,
        }

    def _field(self, index: int, name: str, fn: Callable[[], Any]) -> Any:
        """Read one field; on error return None and note it once.

        A field the board does not support (power on many consumer or MIG configurations) is not
        asked for again: each NVML call is a driver round trip and a GIL release.  Other errors
        may be transient, so those fields are retried on the next tick.
        """
        if (index, name) in self._unsupported:
            return None
        try:
            return fn()
        except Exception as exc:
            not_supported = getattr(self._nv, "NVMLError_NotSupported", None)
            if isinstance(not_supported, type) and isinstance(exc, not_supported):
                self._unsupported.add((index, name))
            self._note(f"gpu:{name}", f"gpu {name}: unavailable ({exc})")
            return None


def _own_memory(procs: Any, pid: int) -> int | None:
    """The device memory NVML lists for ``pid`` (its CUDA context and every allocation),
    or None where NVML lists no such process: it has none on that device, or NVML sees
    the host's process ids (a container with a PID namespace of its own) and nothing
    matches.

    The device's used memory (``mem_used_bytes``) counts every process on it: on a
    shared GPU another job's growth would read as this run's leak (tests/test_cuda.py,
    six runs on one H200)."""
    if not procs:
        return None
    used = [getattr(p, "usedGpuMemory", None) for p in procs if getattr(p, "pid", None) == pid]
    used = [int(u) for u in used if isinstance(u, int)]
    return sum(used) if used else None
