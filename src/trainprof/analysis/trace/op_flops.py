"""FLOPs of a trace's matrix products and attention, and the rate their kernels reached.

Why: a trace shows how long each GEMM's kernels took, not whether that was fast. With the
op's shapes (``record_shapes=True``: ``Input Dims``, ``Input type``, ``Concrete Inputs``)
its FLOPs follow, then its rate (FLOPs over the kernel time it launched) and, on a GPU
whose datasheet :mod:`trainprof.analysis.datasheet_peaks` knows, the share of the peak.

Definitions, TraceLens's (AMD-AGI/TraceLens, its GEMM and SDPA tables), which the tests
check against the tables TraceLens published for real H100 traces:

* ``aten::mm`` ``(M, K) x (K, N)``: 2 M N K; ``aten::addmm`` ``(bias, (M, K), (K, N))``:
  2 M N K + M N (the bias add); ``aten::bmm`` ``(B, M, K) x (B, K, N)``: 2 B M N K;
  ``aten::baddbmm``: 2 B M N K + B M N.
* fused attention (``_scaled_dot_product_flash_attention``, ``_efficient_attention``,
  ``_cudnn_attention``; query ``(B, H, N_q, d_qk)``, key ``(B, H, N_kv, d_qk)``, value
  ``(B, H, N_kv, d_v)``): 2 B H N_q N_kv (d_qk + d_v), halved when causal
  (``is_causal`` among the concrete inputs). Their backward ops: 2.5 times that, torch's
  ``sdpa_backward_flop_count`` (the two products of the forward recomputed, four more).
* Each call's kernel time is that of every kernel launched under it (its subtree: the
  attention ops launch theirs from an inner op); its rate is its FLOPs over that time,
  and a table row's rate the mean of its calls' rates (TraceLens's ``TFLOPS/s_mean``).
  A CPU-only trace has no kernels: the op's own duration, its children's included, stands
  in (``time_basis``).

* ``aten::convolution`` and ``aten::convolution_backward``: :func:`conv_flops` (TraceLens's
  CONV table, the bias add left out).

Calls whose shapes are missing (a trace recorded without ``record_shapes``; traces before
torch 2.x lack the concrete inputs a convolution's stride needs) or whose kernels were not
recorded count nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_GEMMS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"})
#: attention ops -> the index of ``is_causal`` among their inputs
_ATTENTION = {
    "aten::_scaled_dot_product_flash_attention": 4,
    "aten::_scaled_dot_product_efficient_attention": 6,
    "aten::_scaled_dot_product_cudnn_attention": 6,
}
_ATTENTION_BACKWARD = {f"{name}_backward": None for name in _ATTENTION}
_CONVS = frozenset({"aten::convolution", "aten::convolution_backward"})
#: every op this module counts (read by the trace loader, which keeps their shapes)
FLOP_OPS = frozenset(_GEMMS | set(_ATTENTION) | set(_ATTENTION_BACKWARD) | _CONVS)
#: torch's FLOPs of attention's backward over its forward (``sdpa_backward_flop_count``)
ATTENTION_BACKWARD_FACTOR = 2.5


def _dims(dims: Any, i: int) -> list[int] | None:
    try:
        d = dims[i]
    except (IndexError, TypeError):
        return None
    return [int(x) for x in d] if isinstance(d, list) and d else None


def gemm_shape(name: str, dims: Any) -> tuple[int, int, int, int, bool] | None:
    """(B, M, N, K, bias) of a matrix product's call, or None when its shapes don't say."""
    bias = name in ("aten::addmm", "aten::baddbmm")
    a, b = (_dims(dims, 1), _dims(dims, 2)) if bias else (_dims(dims, 0), _dims(dims, 1))
    if a is None or b is None:
        return None
    if name in ("aten::mm", "aten::addmm") and len(a) == 2 and len(b) == 2:
        return 1, a[0], b[1], a[1], bias
    if name in ("aten::bmm", "aten::baddbmm") and len(a) == 3 and len(b) == 3:
        return a[0], a[1], b[2], a[2], bias
    return None


def call_flops(name: str, dims: Any, concrete: Any) -> float | None:
    """One call's FLOPs (module docstring), or None when its shapes don't say."""
    if name in _GEMMS:
        shape = gemm_shape(name, dims)
        if shape is None:
            return None
        b, m, n, k, bias = shape
        return 2.0 * b * m * n * k + (b * m * n if bias else 0)
    if name in _CONVS:
        return conv_flops(name, dims, concrete)
    base = name.removesuffix("_backward")
    if base in _ATTENTION:
        first = 0 if name == base else 1  # backward's inputs start with the output's grad
        q, k, v = _dims(dims, first), _dims(dims, first + 1), _dims(dims, first + 2)
        if q is None or k is None or v is None or len(q) != 4 or len(k) != 4 or len(v) != 4:
            return None
        flops = 2.0 * q[0] * q[1] * q[2] * k[2] * (q[3] + v[3])
        if name == base and _causal(concrete, _ATTENTION[base]):
            flops /= 2
        return flops * (ATTENTION_BACKWARD_FACTOR if name != base else 1.0)
    return None


def _is_flop_op(name: str) -> bool:
    """An op whose FLOPs :func:`call_flops` counts when its shapes say."""
    return name in _GEMMS or name in _CONVS or name.removesuffix("_backward") in _ATTENTION


def _ints(text: Any) -> list[int] | None:
    """``"[1, 1]"`` (a concrete input) -> [1, 1]."""
    try:
        return [int(x) for x in str(text).strip("[]() ").split(",") if x.strip()]
    except ValueError:
        return None


def conv_flops(name: str, dims: Any, concrete: Any) -> float | None:
    """A convolution's FLOPs: 2 N C_out (output positions) C_in/groups (kernel positions),
    as TraceLens counts it (the bias add left out). Forward (``aten::convolution``): the
    output positions from the input's, the stride, padding and dilation (the concrete
    inputs; a transposed convolution: 2 N C_in (input positions) C_out/groups (kernel)).
    Backward (``aten::convolution_backward``, the output's gradient first): the forward's
    FLOPs once for the input's gradient and once for the weight's, as ``output_mask``
    asks."""
    backward = name == "aten::convolution_backward"
    first = _dims(dims, 0)
    weight = _dims(dims, 2 if backward else 1)
    try:
        args = list(concrete)
        at = 4 if backward else 3  # stride, padding, dilation, transposed, output_padding,
        stride, padding, dilation = (_ints(args[at]), _ints(args[at + 1]),  # groups
                                     _ints(args[at + 2]))
        transposed = str(args[at + 3]).strip().lower() == "true"
        groups = int(args[at + 5])
        mask = str(args[at + 6]) if backward else ""
    except (IndexError, TypeError, ValueError):
        return None
    if first is None or weight is None or len(first) != len(weight) or len(first) < 3:
        return None
    kernel = int(np.prod(weight[2:]))
    n = first[0]
    if backward:  # the output's gradient has the output's shape
        if transposed:
            return None
        fwd = 2.0 * n * first[1] * int(np.prod(first[2:])) * weight[1] * kernel
        # output_mask: (input, weight, bias) gradients; the bias's is a sum, not counted
        wanted = [m.strip().lower() == "true" for m in mask.strip("[]() ").split(",")]
        return fwd * (sum(wanted[:2]) if len(wanted) >= 2 else 2)
    if transposed:
        return 2.0 * n * first[1] * int(np.prod(first[2:])) * weight[1] * kernel
    if stride is None or padding is None or dilation is None:
        return None
    spatial = len(first) - 2
    stride, padding, dilation = (
        (v * spatial if len(v) == 1 else v) for v in (stride, padding, dilation))
    out = 1
    for i in range(spatial):
        size = (first[2 + i] + 2 * padding[i] - dilation[i] * (weight[2 + i] - 1) - 1
                ) // stride[i] + 1
        out *= max(size, 0)
    return 2.0 * n * weight[0] * out * (first[1] // max(groups, 1)) * kernel


def _causal(concrete: Any, index: int) -> bool:
    try:
        return str(concrete[index]).strip().lower() == "true"
    except (IndexError, TypeError):
        return False


def _dtype(types: Any) -> str:
    """The first tensor's dtype as the trace names it (``c10::BFloat16``, ``float``)."""
    for t in types if isinstance(types, list) else []:
        if isinstance(t, str) and t not in ("", "Scalar", "ScalarList", "TensorList"):
            return t
    return "?"


#: the trace's dtype names -> the compute kinds' (analysis/datasheet_peaks.py)
_KIND = {"c10::BFloat16": "bfloat16", "c10::Half": "float16", "float": "float32",
         "double": "float64"}


def kind_of(types: Any) -> str:
    """The first tensor's dtype as the compute kinds name it (``bfloat16``, ``float32``)."""
    dtype = _dtype(types)
    return _KIND.get(dtype, dtype)


def op_flops(names: list[str], name_of_row: np.ndarray, shapes: dict[int, tuple[Any, Any, Any]],
             kernel_ns_of_row: dict[int, float], gpu_name: str | None = None,
             top: int = 30, time_basis: str = "kernels") -> dict[str, Any] | None:
    """The trace's ``flops`` section: per distinct call (op, shapes, dtype) its count,
    FLOPs, mean kernel time and mean rate; the totals; the share of the datasheet's peak.

    ``kernel_ns_of_row``: the kernel time under each op row that has any (ns). A CPU-only
    trace has no kernels: there it is the op's own duration (``time_basis`` "cpu op"), which
    the ``kernel_us`` fields then hold."""
    from trainprof.analysis.datasheet_peaks import datasheet_peak

    groups: dict[tuple[str, str, str], dict[str, Any]] = {}
    # FLOP ops whose shapes did not tell their FLOPs (a convolution's stride, which traces
    # before torch 2.x lack): ResNet-50's "2.36 GFLOP" was its fc layer alone, said as all
    uncounted: dict[str, list[float]] = {}
    for row, (dims, types, concrete) in shapes.items():
        name = names[int(name_of_row[row])]
        flops = call_flops(name, dims, concrete)
        kernel = kernel_ns_of_row.get(row, 0.0)
        if flops is None and kernel > 0 and _is_flop_op(name):
            acc = uncounted.setdefault(name, [0, 0.0])
            acc[0] += 1
            acc[1] += kernel / 1e3
        if flops is None or kernel <= 0:
            continue
        dtype = _dtype(types)
        key = (name, repr(dims), dtype)
        g = groups.get(key)
        if g is None:
            g = groups[key] = {"name": name, "input_dims": dims, "dtype": dtype,
                               "calls": 0, "gflops": flops / 1e9, "kernel_us": [],
                               "tflops_per_s": []}
            if name in _GEMMS:
                b, m, n, k, bias = gemm_shape(name, dims) or (None,) * 5
                g.update(B=b, M=m, N=n, K=k, bias=bias)
        g["calls"] += 1
        g["kernel_us"].append(kernel / 1e3)
        g["tflops_per_s"].append(flops / kernel / 1e3)  # FLOP/ns = 1e-3 TFLOP/s
    if not groups:
        return None
    rows = []
    total_flops = total_kernel_us = 0.0
    by_kind: dict[str, list[float]] = {}
    for g in groups.values():
        k_us, rates = g.pop("kernel_us"), g.pop("tflops_per_s")
        flops = g["gflops"] * 1e9 * g["calls"]
        g.update(kernel_us_mean=float(np.mean(k_us)), kernel_us_total=float(np.sum(k_us)),
                 tflops_per_s_mean=float(np.mean(rates)), gflops_total=flops / 1e9)
        total_flops += flops
        total_kernel_us += g["kernel_us_total"]
        kind = _KIND.get(g["dtype"], g["dtype"])
        acc = by_kind.setdefault(kind, [0.0, 0.0])
        acc[0] += flops
        acc[1] += g["kernel_us_total"]
        rows.append(g)
    rows.sort(key=lambda g: -g["kernel_us_total"])
    kinds = []
    for kind, (flops, k_us) in sorted(by_kind.items(), key=lambda kv: -kv[1][1]):
        entry: dict[str, Any] = {"dtype": kind, "gflops": flops / 1e9, "kernel_us": k_us,
                                 "tflops_per_s": flops / k_us / 1e6 if k_us else None}
        sheet = datasheet_peak(gpu_name, f"cuda {kind}")
        if sheet is not None and entry["tflops_per_s"] is not None:
            entry.update(datasheet_gpu=sheet[0], datasheet_tflops_per_s=sheet[1] / 1e12,
                         of_datasheet_peak=entry["tflops_per_s"] * 1e12 / sheet[1])
        kinds.append(entry)
    return {
        "calls": rows[:top],
        "distinct_calls": len(rows),
        "gflops": total_flops / 1e9,
        "kernel_us": total_kernel_us,
        "tflops_per_s": total_flops / total_kernel_us / 1e6 if total_kernel_us else None,
        "by_dtype": kinds,
        "gpu": gpu_name,
        "time_basis": time_basis,
        # FLOP ops left out (their shapes did not say), by time: what the total misses
        "uncounted": [{"name": n, "calls": int(c), "kernel_us": us}
                      for n, (c, us) in sorted(uncounted.items(), key=lambda kv: -kv[1][1])],
    }
