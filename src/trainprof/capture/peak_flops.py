"""The machine's matrix-multiply peak, measured once per device, dtype and thread count.

Why: "is this the fastest it can go?" needs a ceiling. A FLOPs utilization (achieved
FLOP/s over peak FLOP/s: MFU in PaLM, Chowdhery et al. 2022, appendix B; Lightning's and
Composer's throughput monitors report it against datasheet peaks) needs the peak of the
dtype the model computes in. A datasheet gives GPUs' peaks but not a CPU's, and neither
what this process can reach: its thread count, its cgroup, its clocks, the BLAS its torch
was built with. So the peak here is measured: the best rate of ``torch.mm`` on square
matrices large enough to run at the BLAS's full speed (``_size``), in the dtype and on the
device the model used, with the process's own threads and TF32 settings. It is the
"attainable" peak of a roofline (Williams et al. 2009), which is what a step could reach.

Cost: at most about :data:`BUDGET_S` per dtype (a dtype too slow to repeat in it is timed
by one product; on a GPU the products take milliseconds, unmeasured here). It is measured at
the end of a run (after the DataLoader workers are gone, so nothing competes for the
cores) and kept in a cache file (:func:`cache_path`), keyed by everything that sets the
rate, so a machine pays for it once. On a CPU, ranks of a multi-process launch only read
the cache:
several ranks measuring at once on one host would each see a share of the cores; each
rank measures its own GPU, though, since no other rank computes on it. A run stopped by
Ctrl-C or a crash only reads the cache: its user is not kept waiting.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

#: The longest one dtype's measurement may take (the best of as many products as fit).
BUDGET_S = 0.25
#: Products timed at least, after one untimed warm-up product, and at most.
MIN_REPEATS, MAX_REPEATS = 3, 50
CACHE_ENV = "TRAINPROF_CACHE_DIR"
CACHE_FILE = "peak_flops.json"


def cache_path() -> Path:
    """``$TRAINPROF_CACHE_DIR/peak_flops.json``, else under ``$XDG_CACHE_HOME/trainprof``
    (``~/.cache/trainprof``). Delete it to measure again."""
    base = os.environ.get(CACHE_ENV)
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "trainprof")
    return Path(base) / CACHE_FILE


def split_key(compute: str) -> tuple[str, str, bool]:
    """``"cuda bfloat16"`` / ``"cuda float32 tf32"`` -> (device type, dtype name, tf32)."""
    parts = compute.split()
    return parts[0], parts[1], len(parts) > 2 and parts[2] == "tf32"


def _size(device: str, dtype_name: str, threads: int) -> int:
    """The side of the square matrices: large enough that the product runs at full speed
    (its three matrices far beyond the caches, thousands of tiles for the threads), small
    enough to take milliseconds."""
    if device == "cuda":
        return 8192 if dtype_name in ("bfloat16", "float16") else 4096
    if dtype_name == "float64":
        return 512 if threads <= 8 else 1024
    return 1024 if threads <= 8 else 2048


def machine_key(torch: Any, compute: str) -> str:
    """What sets the rate of ``compute``: the device's name, torch's version and, on a CPU,
    the threads torch uses and the cores the process may run on."""
    device, dtype_name, tf32 = split_key(compute)
    if device == "cuda":
        name = str(torch.cuda.get_device_name(torch.cuda.current_device()))
        where = f"{name} | cuda {torch.version.cuda}"
    else:
        from trainprof.capture.fingerprint import _cpu_model, _usable_cores

        where = (f"{_cpu_model() or 'cpu'} | {_usable_cores() or os.cpu_count()} cores | "
                 f"{torch.get_num_threads()} threads")
    return f"{where} | torch {torch.__version__} | {dtype_name}{' tf32' if tf32 else ''}"


def measure(torch: Any, compute: str, budget_s: float = BUDGET_S) -> dict[str, Any]:
    """The best FLOP/s of ``torch.mm`` in ``compute`` (``"cpu float32"``, ``"cuda bfloat16"``,
    ``"cuda float32 tf32"``); raises what torch raises for a dtype it cannot multiply."""
    device, dtype_name, tf32 = split_key(compute)
    dtype = getattr(torch, dtype_name)
    n = _size(device, dtype_name, torch.get_num_threads())
    flops = 2.0 * n ** 3
    # a generator of its own: the script's random stream is left as it was (the profile()
    # API stops here while the script goes on)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad(), _matmul_precision(torch, device, tf32):
        a = torch.rand(n, n, device=device, generator=generator).to(dtype)
        b = torch.rand(n, n, device=device, generator=generator).to(dtype)
        out = torch.empty(n, n, device=device, dtype=dtype)
        start = time.perf_counter()
        torch.mm(a, b, out=out)  # warm-up: the BLAS's first call sets itself up
        _sync(torch, device)
        best = warm = time.perf_counter() - start
        deadline = start + budget_s
        repeats = 0
        # at least MIN_REPEATS timed products, unless the dtype is so slow here (float16 on
        # a CPU without it) that they would overrun the budget: then the warm-up's rate
        while repeats < MAX_REPEATS and (time.perf_counter() < deadline or (
                repeats < MIN_REPEATS and warm < budget_s / MIN_REPEATS)):
            t0 = time.perf_counter()
            torch.mm(a, b, out=out)
            _sync(torch, device)
            best = min(best, time.perf_counter() - t0)
            repeats += 1
    return {"flops_per_s": flops / best, "matrix": n, "repeats": repeats}


def _sync(torch: Any, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def _matmul_precision(torch: Any, device: str, tf32: bool):  # noqa: ANN202
    """float32 products on CUDA as the run computed them: TF32 ("high") or full precision."""
    if device != "cuda" or not hasattr(torch, "set_float32_matmul_precision"):
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _write_cache(path: Path, key: str, entry: dict[str, Any]) -> None:
    """Add one entry; a cache that cannot be written costs a measurement next time, no more."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = _read_cache(path)
        doc[key] = entry
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
        os.replace(tmp, path)


def peaks(torch: Any, computes: list[str],
          may_measure: frozenset[str] | set[str]) -> dict[str, dict[str, Any]]:
    """run.json's ``peak_flops``: for each compute kind, its peak FLOP/s and whether it was
    ``measured`` now or read from the cache, or why there is none (``error``). Only kinds
    on the device types in ``may_measure`` are measured; the others are read from the
    cache or go without."""
    path = cache_path()
    cache = _read_cache(path)
    out: dict[str, dict[str, Any]] = {}
    for compute in computes:
        try:
            key = machine_key(torch, compute)
        except Exception as exc:  # noqa: BLE001 - no device name: no peak, said why
            out[compute] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        entry = cache.get(key)
        if isinstance(entry, dict) and isinstance(entry.get("flops_per_s"), int | float):
            out[compute] = {**entry, "source": "cache", "key": key}
            continue
        if split_key(compute)[0] not in may_measure:
            out[compute] = {"error": "not measured: a rank of a launch shares the CPU, a run "
                                     "stopped early is not kept waiting", "key": key}
            continue
        try:
            entry = measure(torch, compute)
        except Exception as exc:  # noqa: BLE001 - a dtype torch cannot multiply here
            out[compute] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}",
                            "key": key}
            continue
        entry["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        _write_cache(path, key, entry)
        out[compute] = {**entry, "source": "measured", "key": key}
    return out
