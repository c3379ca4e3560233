"""GPU summary per device: utilization, Est. SM efficiency, Est. achieved occupancy, tensor cores.

Definitions (torch-tb-profiler 0.4.3, ``profiler/gpu_metrics_parser.py`` and
``profiler/tensor_cores_parser.py``), over the window from the first step's start to
the last step's end (:mod:`.steps`):

* **GPU utilization** = |union of the device's kernel intervals ∩ window| / window.
* **Est. SM efficiency** = ∫ min(Σ blocks-per-SM of the kernels running at t, 1) dt /
  window, with Kineto's per-kernel ``blocks per SM`` (grid blocks / SM count); kernels
  with a non-positive value are left out (the plugin's workaround).
* **Est. achieved occupancy** = mean of the kernels' ``est. achieved occupancy %``
  weighted by the part of each kernel inside the window.
* **Kernel time using tensor cores** = time of kernels whose name matches a tensor-core
  pattern / all kernel time, per device, over the whole trace (the plugin sums the
  kernels launched by operators, which in a Kineto trace is all of them).

The plugin's tensor-core list (from NVIDIA PyProf, 2021) predates Ampere and Hopper
kernel naming; :data:`TC_PATTERNS` extends it (see its comment). On devices whose
traces carry no ``blocks per SM``/occupancy fields (AMD, MTIA, CPU) those two values
are None, as in the plugin.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from trainprof.analysis.trace import intervals as iv
from trainprof.analysis.trace.correlate import Links
from trainprof.analysis.trace.events import Events

#: Substrings of tensor-core kernel names. First the plugin's own allowlist
#: (``tensor_core.py``, from NVIDIA PyProf ``prof/tc.py``), then newer names:
#: cuBLAS/cuDNN ``sm80_xmma_*``/``sm90_xmma_*`` (every xmma kernel is an MMA kernel),
#: CUTLASS ``*tensorop*`` (its SIMT kernels say ``simt``), Ampere/Hopper cuBLAS
#: ``*_s16816gemm*``/``*16816*``/``*1688*`` (bf16/fp16/tf32 MMA shapes), ``hmma``/``imma``/
#: ``dmma`` (fp16/int8/fp64 MMA instructions), Hopper ``gmma``/``wgmma`` and cuBLASLt's
#: ``nvjet`` kernels, and FlashAttention / fused multi-head attention (``flash_fwd``,
#: ``flash_bwd``, ``flash::``, ``fmha``). A name that says ``simt`` (CUTLASS's CUDA-core
#: kernels) never counts.
TC_PATTERNS: tuple[str, ...] = (
    # torch-tb-profiler 0.4.3 TC_Allowlist
    "h884", "s884", "h1688", "s1688", "hmma", "i8816", "16816",
    "dgrad_1x1_stride_2x2", "first_layer_wgrad_kernel", "conv1x1",
    "conv2d_c1_k1", "direct_group", "xmma_implicit_gemm",
    "xmma_sparse_conv", "xmma_warp_specialized_implicit_gemm",
    "xmma_gemm", "xmma_sparse_gemm", "c1688",
    # Ampere / Hopper / Blackwell and libraries
    "xmma", "tensorop", "gmma", "wgmma", "imma", "dmma", "nvjet",
    "s16816", "h16816", "bf16816", "1688gemm", "884gemm",
    "flash_fwd", "flash_bwd", "flash::", "fmha",
)
#: AMD Tensile/hipBLASLt kernels that use matrix cores name their MFMA tile ``_MI32x32x8``.
_AMD_MFMA = re.compile(r"_MI\d+x\d+x\d+")


def uses_tensor_cores(name: str) -> bool:
    """Whether a kernel name says it runs on tensor cores (matrix cores on AMD)."""
    lowered = name.lower()
    if "simt" in lowered:
        return False
    return any(p in lowered for p in TC_PATTERNS) or _AMD_MFMA.search(name) is not None


def _device_info(props: list[dict[str, Any]], device: int) -> dict[str, Any]:
    for p in props:
        if isinstance(p, dict) and p.get("id") == device:
            info: dict[str, Any] = {"name": p.get("name")}
            mem = p.get("totalGlobalMem")
            if isinstance(mem, int | float):
                info["memory_gb"] = round(mem / 1024**3, 2)
            major, minor = p.get("computeMajor"), p.get("computeMinor")
            if isinstance(major, int) and isinstance(minor, int):
                info["compute_capability"] = f"{major}.{minor}"
            if isinstance(p.get("numSms"), int):
                info["num_sms"] = p["numSms"]
            return info
    return {}


def gpu_summary(
    ev: Events,
    links: Links,
    window: tuple[int, int],
    device_props: list[dict[str, Any]],
    process_labels: dict[Any, str],
) -> dict[str, dict[str, Any]]:
    """Per device (keyed by its id as a string): the plugin's GPU summary, percentages."""
    rows = links.kernel_rows
    if rows.size == 0:
        return {}
    lo, hi = window
    span = hi - lo
    dev = ev.device[rows]
    tc_name = np.fromiter(
        (uses_tensor_cores(n) for n in ev.names), dtype=bool, count=len(ev.names)
    )
    out: dict[str, dict[str, Any]] = {}
    for d in np.unique(dev).tolist():
        r = rows[dev == d]
        s, e = ev.ts[r], ev.end[r]
        busy = iv.total(*iv.clip(*iv.union(s, e), lo, hi))
        entry: dict[str, Any] = {"device": int(d)}
        entry.update(_device_info(device_props, int(d)))
        if "name" not in entry:
            label = process_labels.get(int(d))
            if label:
                entry["name"] = label
        entry["utilization"] = busy / span * 100.0 if span > 0 else None

        bps = ev.blocks_per_sm[r].astype(np.float64)
        ok = np.isfinite(bps) & (bps > 0)
        if ok.any() and span > 0:
            entry["sm_efficiency"] = (
                iv.weighted_level_time(s[ok], e[ok], bps[ok], lo, hi) / span * 100.0
            )
        else:
            entry["sm_efficiency"] = None

        occ = ev.occupancy[r].astype(np.float64)
        ok = np.isfinite(occ) & (occ >= 0)
        w = (np.minimum(e, hi) - np.maximum(s, lo)).astype(np.float64)
        ok &= w > 0
        entry["achieved_occupancy"] = (
            float((occ[ok] * w[ok]).sum() / w[ok].sum()) if ok.any() else None
        )

        kdur = (e - s).astype(np.float64)
        ktotal = kdur.sum()
        tc = tc_name[ev.name[r]]
        entry["tensor_core_pct"] = float(kdur[tc].sum() / ktotal * 100.0) if ktotal > 0 else 0.0
        entry["kernel_time_us"] = float(ktotal / 1000.0)
        entry["kernel_busy_in_window_us"] = busy / 1000.0
        entry["kernels"] = int(r.size)
        out[str(int(d))] = entry
    return out
