"""Datasheet peak FLOP/s of common training GPUs, dense, per dtype: the denominator of the
MFU figures people publish.

Why beside the measured peak (:mod:`trainprof.capture.peak_flops`): MFU as PaLM defines it
(Chowdhery et al. 2022, appendix B), and as nanoGPT's ``estimate_mfu``, Lightning's
``ThroughputMonitor`` and Composer report it, divides by the vendor's peak. A utilization
against that number is comparable with theirs; against the measured one it says how near
the step runs to what ``torch.mm`` reaches on this very card (clocks, power cap).

Values are NVIDIA's datasheets' tensor-core (and, for float32 without TF32, CUDA-core)
peaks *without* structured sparsity: the datasheets print the sparse figure, twice the
dense one, for TF32 and the 16-bit types on Ampere and later. H100 SXM5 (and H200, the
same compute): float32 67, TF32 494.7, bfloat16/float16 989.4 TFLOP/s; H100 PCIe: 51,
378, 756; A100 (SXM4 and PCIe): 19.5, 156, 312; L40S: 91.6, 183, 362; L4: 30.3, 60, 121;
A10: 31.2, 62.5, 125; V100 SXM2: 15.7 and 125 (float16; no bfloat16, no TF32); V100
PCIe: 14 and 112; T4: 8.1 and 65 (float16).

Matched on the name CUDA reports (``torch.cuda.get_device_name``), lower-cased, by the
first entry whose every word it contains; a GPU not listed has no datasheet figure, and
neither has a MIG slice (a name with "MIG", or fewer multiprocessors than the full chip's
:data:`_SMS`): its share of the chip's peak is not published.
"""

from __future__ import annotations

T = 1e12

#: H100 SXM5 and H200 (the same compute)
_HOPPER_SXM = {"float32": 67 * T, "float32 tf32": 494.7 * T,
               "bfloat16": 989.4 * T, "float16": 989.4 * T}

#: (words of the device name, {kind's dtype part: dense peak FLOP/s}), most specific first.
_TABLE: tuple[tuple[tuple[str, ...], dict[str, float]], ...] = (
    (("h100", "nvl"), {}),  # the NVL's per-GPU figures vary by datasheet version: none
    (("h100", "pcie"), {"float32": 51 * T, "float32 tf32": 378 * T,
                        "bfloat16": 756 * T, "float16": 756 * T}),
    (("h100",), _HOPPER_SXM),
    (("h200",), _HOPPER_SXM),
    (("a100",), {"float32": 19.5 * T, "float32 tf32": 156 * T,
                 "bfloat16": 312 * T, "float16": 312 * T}),
    (("l40s",), {"float32": 91.6 * T, "float32 tf32": 183 * T,
                 "bfloat16": 362 * T, "float16": 362 * T}),
    (("l4",), {"float32": 30.3 * T, "float32 tf32": 60 * T,
               "bfloat16": 121 * T, "float16": 121 * T}),
    (("a10",), {"float32": 31.2 * T, "float32 tf32": 62.5 * T,
                "bfloat16": 125 * T, "float16": 125 * T}),
    (("v100", "pcie"), {"float32": 14 * T, "float16": 112 * T}),
    (("v100",), {"float32": 15.7 * T, "float16": 125 * T}),
    (("t4",), {"float32": 8.1 * T, "float16": 65 * T}),
)


#: Streaming multiprocessors of the full chips above (the datasheets' and the CUDA
#: programming guide's figures), by the table's name.
_SMS = {"H100 PCIE": 114, "H100": 132, "H200": 132, "A100": 108, "L40S": 142, "L4": 58,
        "A10": 72, "V100 PCIE": 80, "V100": 80, "T4": 40}


def datasheet_peak(device_name: str | None, kind: str,
                   multiprocessors: int | None = None) -> tuple[str, float] | None:
    """(the table's name for the GPU, its dense peak) for a kind such as
    ``"cuda bfloat16"`` or ``"cuda float32 tf32"``; None for a CPU, an unlisted GPU, a MIG
    slice or a dtype its datasheet gives no tensor-core figure for."""
    if not device_name or not kind.startswith("cuda "):
        return None
    name = device_name.lower()
    words = set(name.replace("-", " ").replace("_", " ").split())
    if "mig" in words:
        return None
    dtype = kind.removeprefix("cuda ")
    for keys, peaks in _TABLE:
        if all(k in words or (len(k) > 3 and k in name) for k in keys):
            peak, label = peaks.get(dtype), " ".join(keys).upper()
            if peak is None or (multiprocessors is not None
                                and multiprocessors < _SMS.get(label, 0)):
                return None
            return label, peak
    return None
