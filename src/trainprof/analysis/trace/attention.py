"""Attention computed op by op in a trace: the score matrices and the kernel time on them.

The trace-side twin of :mod:`trainprof.capture.eager_attention` (which has the reasons),
from the shapes a trace records with ``record_shapes=True`` (``Input Dims``):

* a batched product ``aten::bmm`` ``(B, M, K) x (B, K, N)`` (``aten::baddbmm``: its last two
  inputs) whose inner size ``K`` is a head's (at most
  :data:`~trainprof.capture.eager_attention.MAX_HEAD_DIM`, at most half of ``M`` and ``N``)
  makes a score shape ``(B, M, N)``;
* the shape is attention once ``aten::_softmax`` runs on it (an input whose last two sizes
  are ``(M, N)`` and whose leading sizes multiply to ``B``: the ``(batch, heads, M, N)``
  view);
* its time is the kernel time under every op with an input of that shape (or its transpose)
  among the products, softmax and its backward, and the elementwise ops that scale, mask and
  drop out scores (:data:`ATTENTION_OPS`), plus the products that make it; its FLOPs are
  those products' (TraceLens's GEMM definition, :mod:`~trainprof.analysis.trace.op_flops`).

A bound on what the fused kernel saves follows where the GPU's datasheet peak is known: the
kernel time less the time the products' FLOPs take at that peak. No fused kernel can be
timed here (the trace's machine is not this one): that is what the run-side measurement
does (``trainprof run``).
"""

from __future__ import annotations

import math
from typing import Any

from trainprof.analysis.trace.op_flops import call_flops, gemm_shape, kind_of

#: The most a head's dimension is (as capture/eager_attention.py's; not imported: the
#: analysis stage reads no capture code).
MAX_HEAD_DIM = 256
#: Ops whose shapes the trace loader keeps for this analysis (besides the counted products).
ATTENTION_OPS = frozenset({
    "aten::_softmax", "aten::_safe_softmax", "aten::_softmax_backward_data",
    "aten::mul", "aten::div", "aten::add", "aten::masked_fill", "aten::where",
    "aten::native_dropout", "aten::native_dropout_backward",
})
_SOFTMAX = frozenset({"aten::_softmax", "aten::_safe_softmax"})
_PRODUCTS = frozenset({"aten::bmm", "aten::baddbmm"})


def _key(dims: Any) -> tuple[int, int, int] | None:
    """(leading sizes' product, last, second-to-last... as (B, M, N)) of one input's dims."""
    if not isinstance(dims, list) or len(dims) < 3:
        return None
    try:
        sizes = [int(x) for x in dims]
    except (TypeError, ValueError):
        return None
    return math.prod(sizes[:-2]), sizes[-2], sizes[-1]


def eager_attention(names: list[str], name_of_row: Any, shapes: dict[int, tuple[Any, Any, Any]],
                    kernel_ns_of_row: dict[int, float], gpu_name: str | None,
                    total_kernel_ns: float) -> dict[str, Any] | None:
    """The trace's ``attention`` section, or None when no attention was computed op by op."""
    from trainprof.analysis.datasheet_peaks import datasheet_peak

    rows = [(r, names[int(name_of_row[r])], dims) for r, (dims, _, _) in shapes.items()]
    scores: dict[tuple[int, int, int], dict[str, Any]] = {}
    for r, name, dims in rows:
        if name not in _PRODUCTS:
            continue
        shape = gemm_shape(name, dims)
        if shape is None:
            continue
        b, m, n, k, _ = shape
        if k <= MAX_HEAD_DIM and 2 * k <= min(m, n) and (b, m, n) not in scores:
            rec = {"batch": b, "query_len": m, "key_len": n, "head_dim": k,
                   "dtype": kind_of(shapes[r][1]), "rows": set(), "softmax": 0}
            scores[(b, m, n)] = scores[(b, n, m)] = rec
    if not scores:
        return None
    for r, name, dims in rows:
        if not isinstance(dims, list):
            continue
        rec = None
        if name in _PRODUCTS:
            shape = gemm_shape(name, dims)
            if shape is not None:
                rec = scores.get((shape[0], shape[1], shape[2]))
        for d in dims:
            if rec is None:
                key = _key(d)
                rec = scores.get(key) if key is not None else None
        if rec is None:
            continue
        rec["rows"].add(r)
        if name in _SOFTMAX:
            rec["softmax"] += 1
    found = []
    for rec in {id(v): v for v in scores.values()}.values():
        if not rec["softmax"]:
            continue
        by_op: dict[str, float] = {}
        for r in rec["rows"]:
            name = names[int(name_of_row[r])]
            by_op[name] = by_op.get(name, 0.0) + kernel_ns_of_row.get(r, 0.0) / 1e3
        kernel_ns = sum(by_op.values()) * 1e3
        flops = sum(call_flops(names[int(name_of_row[r])], shapes[r][0], shapes[r][2]) or 0.0
                    for r in rec["rows"] if names[int(name_of_row[r])] in _PRODUCTS)
        sheet = datasheet_peak(gpu_name, f"cuda {rec['dtype']}") if gpu_name else None
        found.append({
            **{k: rec[k] for k in ("batch", "query_len", "key_len", "head_dim", "dtype")},
            "softmax_calls": rec["softmax"], "ops": len(rec["rows"]),
            "kernel_us": kernel_ns / 1e3, "gflops": flops / 1e9,
            # the kernel time by op, most first
            "kernel_us_by_op": dict(sorted(by_op.items(), key=lambda kv: -kv[1])),
            # the kernel time beyond the products' FLOPs at the datasheet's peak
            "bound_us": (max(0.0, kernel_ns / 1e3 - flops / sheet[1] * 1e6)
                         if sheet is not None else None),
        })
    if not found:
        return None
    found.sort(key=lambda f: -f["kernel_us"])
    kernel_us = sum(f["kernel_us"] for f in found)
    bounds = [f["bound_us"] for f in found]
    return {
        "shapes": found,
        "kernel_us": kernel_us,
        "kernel_share": kernel_us * 1e3 / total_kernel_ns if total_kernel_ns > 0 else None,
        "bound_us": sum(bounds) if all(b is not None for b in bounds) else None,
        "total_kernel_us": total_kernel_ns / 1e3,
    }
