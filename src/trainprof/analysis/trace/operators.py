"""Top operators and top kernels, with the TensorBoard plugin's operator and kernel views.

Operators (torch-tb-profiler 0.4.3 ``OperatorAgg``): per op name, the number of calls,
host total time (the op's own ranges), host self time (minus its children on the same
thread), device self time (the device work launched by the op itself, matched by
external id) and device total time (its own plus its descendants'). Nesting is by
time containment on each thread, as the plugin's ``OpTreeBuilder`` does.

Kernels (``KernelParser``): per kernel name, calls, total/mean/min/max time, the
duration-weighted mean blocks per SM and est. achieved occupancy, and whether it uses
tensor cores (:func:`.gpu_metrics.uses_tensor_cores`).

Tensor-core eligibility (``TensorCoresParser._get_tc_eligible_ops_kernel_ratio``): the
share of kernel time launched by the *bottom-most* tensor-core-eligible operators
(``TC_OP_Allowlist``: convolutions, matmuls, linear, RNN cells, their backward ops).
The plugin recommends mixed precision when this share is above zero and no kernel
uses tensor cores, on a GPU with compute capability 7.0 or higher.

Memory (``profile_memory=True``; torch-tb-profiler ``MemoryParser`` and
``OperatorNode.get_memory_metrics``): each ``[memory]`` record belongs to the innermost
operator on the same thread whose range contains its timestamp, left-closed and
right-open (``start <= ts < end``, so that a record at one op's end and the next op's
start is counted once). A record whose innermost range is a ``ProfilerStep`` (a free
when Python drops a tensor between ops, typically), or that no range contains, belongs
to no operator. Per operator and device class (host = ``Device Type`` 0, device = any
other): *self* allocated bytes and count (records with ``Bytes > 0``) and *self*
increase (the sum of ``Bytes``, frees included: the plugin's "Size Increase"); *total*
allocated bytes add those of every operator nested inside. Unlike the plugin, threads
are (pid, tid) pairs and user annotations (``record_function``) are operators, as in
the time table. The run-level summary per device (``cpu``, ``cuda:0``, ...) holds the
peak ``Total Allocated`` / ``Total Reserved`` the allocator reported (modern traces
only), the highest net growth of the recorded ``Bytes`` since the trace began (every
trace), and the allocations and allocated bytes per analysed step (records inside the
steps' host ranges, any thread).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trainprof.analysis.trace.correlate import Links
from trainprof.analysis.trace.events import DEVICE_TYPE_NAMES, Events, Kind, MemoryEvents
from trainprof.analysis.trace.gpu_metrics import uses_tensor_cores
from trainprof.analysis.trace.steps import STEP_PREFIX, Steps

TOP_N = 30

#: torch-tb-profiler 0.4.3 ``TC_OP_Allowlist`` (from ATen's autocast lower-precision list),
#: plus the ATen names that replaced some of them since (``convolution_backward``,
#: ``_scaled_dot_product_*`` attention, ``_scaled_mm``, ``addbmm``...).
TC_ELIGIBLE_OPS = frozenset({
    "aten::_convolution", "aten::conv1d", "aten::conv2d", "aten::conv3d", "aten::conv_tbc",
    "aten::conv_transpose1d", "aten::conv_transpose2d", "aten::conv_transpose3d",
    "aten::convolution", "aten::cudnn_convolution", "aten::cudnn_convolution_transpose",
    "aten::prelu", "aten::addmm", "aten::addmv", "aten::addr",
    "aten::matmul", "aten::mm", "aten::mv",
    "aten::linear", "aten::addbmm", "aten::baddbmm", "aten::bmm",
    "aten::chain_matmul", "aten::linalg_multi_dot",
    "aten::_thnn_fused_lstm_cell", "aten::_thnn_fused_gru_cell", "aten::lstm_cell",
    "aten::gru_cell", "aten::rnn_tanh_cell", "aten::rnn_relu_cell",
    "CudnnConvolutionBackward", "BmmBackward0",
    "aten::cudnn_convolution_transpose_backward", "CudnnConvolutionTransposeBackward",
    "MmBackward", "aten::cudnn_convolution_backward_weight", "aten::addmm_",
    "AddmvBackward", "MvBackward",
    "aten::cudnn_convolution_transpose_backward_weight",
    "aten::cudnn_convolution_transpose_backward_input",
    "AddmmBackward", "aten::cudnn_convolution_backward_input",
    "AddbmmBackward", "aten::cudnn_convolution_backward",
    # newer ATen
    "aten::convolution_backward", "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention", "aten::_flash_attention_forward",
    "aten::_flash_attention_backward", "aten::_efficient_attention_forward",
    "aten::_efficient_attention_backward", "aten::_scaled_mm", "aten::_grouped_mm",
})


def op_tree(ev: Events, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(parent position, depth) of each op in ``rows`` by time containment per thread.

    Positions refer to ``rows``; -1 means a root. Vectorised: with the ops of a thread
    sorted by (start, longest first), the ancestors of op ``i`` are the earlier ops still
    open at its start (``end > start_i``), so its depth is a count found by binary search,
    and its parent is the latest earlier op one level up (a later op at that level would
    start inside the parent and so be nested deeper). Zero-length ops at the same start
    come last and are not open.
    """
    n = rows.size
    parent = np.full(n, -1, dtype=np.int64)
    depth = np.zeros(n, dtype=np.int64)
    if n == 0:
        return parent, depth
    ts = ev.ts[rows]
    dur = ev.dur[rows]
    thread = ev.thread[rows].astype(np.int64)
    order = np.lexsort((-dur, ts, thread))
    t0 = int(ts.min())
    span = int((ts + dur).max()) - t0
    if span >= 1 << 44 or int(thread.max()) >= 1 << 18:
        return _op_tree_loop(ev, rows)
    th = thread[order] << 44
    s = ts[order] - t0
    e = s + dur[order]
    pos = np.arange(n)
    key_s = th | s
    key_e = np.sort(th | e)
    # earlier ops that ended at or before my start (all ops ending <= my start are earlier,
    # except zero-length ops at my start, which sort after me)
    ended = np.searchsorted(key_e, key_s, side="right") - np.searchsorted(key_e, th, side="left")
    zero = dur[order] == 0
    zkeys = key_s[zero]
    z_at = np.searchsorted(zkeys, key_s, side="right") - np.searchsorted(zkeys, key_s, "left")
    zpos = pos[zero]
    first_z = zpos[np.searchsorted(zkeys, key_s[zero], side="left")]
    z_before = np.zeros(n, dtype=np.int64)
    z_before[zero] = zpos - first_z
    ended -= z_at - z_before
    first_in_thread = np.searchsorted(th, th, side="left")
    dep = (pos - first_in_thread) - ended
    dep = np.maximum(dep, 0)
    key = (dep << 40) | pos
    srt = np.sort(key)
    cand = np.searchsorted(srt, ((dep - 1) << 40) | pos, side="left") - 1
    ok = (dep > 0) & (cand >= 0)
    cpos = srt[np.maximum(cand, 0)] & ((1 << 40) - 1)
    ok &= (srt[np.maximum(cand, 0)] >> 40) == dep - 1
    par = np.where(ok, cpos, -1)
    parent[order] = np.where(par >= 0, order[np.maximum(par, 0)], -1)
    depth[order] = np.where(ok | (dep == 0), dep, 0)
    return parent, depth


def _op_tree_loop(ev: Events, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The same tree with a stack (for traces whose times do not fit the packed keys)."""
    n = rows.size
    ts = ev.ts[rows]
    end = ev.end[rows]
    thread = ev.thread[rows]
    order = np.lexsort((-(end - ts), ts, thread))
    th = thread[order].tolist()
    st = ts[order].tolist()
    en = end[order].tolist()
    par = [-1] * n
    dep = [0] * n
    stack: list[int] = []
    cur = None
    for i in range(n):
        if th[i] != cur:
            stack.clear()
            cur = th[i]
        s = st[i]
        while stack and en[stack[-1]] <= s:
            stack.pop()
        if stack:
            par[i] = stack[-1]
            dep[i] = len(stack)
        stack.append(i)
    parent = np.full(n, -1, dtype=np.int64)
    depth = np.zeros(n, dtype=np.int64)
    par_arr = np.array(par, dtype=np.int64)
    parent[order] = np.where(par_arr >= 0, order[np.maximum(par_arr, 0)], -1)
    depth[order] = np.array(dep, dtype=np.int64)
    return parent, depth


def innermost_op(
    ev: Events, rows: np.ndarray, parent: np.ndarray, q_thread: np.ndarray, q_ts: np.ndarray
) -> np.ndarray:
    """For each query (thread code, time), the position in ``rows`` of the innermost op on
    that thread whose ``[start, end)`` contains the time (-1: none).

    Vectorised: ops and queries are merged in one sort by (thread, time), ops before
    queries at equal times and, among ops starting together, longest first. The last op
    before a query is the latest to start on its thread, at or before the query; if it
    has ended, the containing op is one of its ancestors, so each unresolved query moves
    to its candidate's parent, one tree level per round (rounds <= tree depth).
    """
    n, q = rows.size, q_ts.size
    out = np.full(q, -1, dtype=np.int64)
    if n == 0 or q == 0:
        return out
    op_thread = ev.thread[rows]
    op_end = ev.end[rows]
    order = np.lexsort((
        np.concatenate([-ev.dur[rows], np.zeros(q, dtype=np.int64)]),
        np.concatenate([np.zeros(n, dtype=np.int8), np.ones(q, dtype=np.int8)]),
        np.concatenate([ev.ts[rows], q_ts]),
        np.concatenate([op_thread, q_thread]),
    ))
    is_op = order < n
    ops_sorted = order[is_op]
    before = np.cumsum(is_op) - 1  # index into ops_sorted of the last op at or before
    at_q = ~is_op
    k = before[at_q]
    qi = order[at_q] - n
    cand = np.full(q, -1, dtype=np.int64)
    ok = k >= 0
    cand[qi[ok]] = ops_sorted[k[ok]]
    same = cand >= 0
    same[same] = op_thread[cand[same]] == q_thread[same]
    cand[~same] = -1
    active = np.flatnonzero(cand >= 0)
    while active.size:
        j = cand[active]
        inside = op_end[j] > q_ts[active]
        out[active[inside]] = j[inside]
        up = active[~inside]
        cand[up] = parent[j[~inside]]
        active = up[cand[up] >= 0]
    return out


def _accumulate_up(values: np.ndarray, parent: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """Each node's value plus all its descendants' (deepest level first)."""
    total = values.astype(np.float64).copy()
    for d in range(int(depth.max()) if depth.size else 0, 0, -1):
        at = np.flatnonzero(depth == d)
        np.add.at(total, parent[at], total[at])
    return total


def operators_and_kernels(ev: Events, links: Links, steps: Steps | None = None
                          ) -> dict[str, Any]:
    """Top operators, top kernels, tensor-core eligibility and, when the trace has memory
    events, memory per operator and per device (see the module docstring)."""
    rows = links.op_rows
    names = ev.names
    step_name = np.fromiter((n.startswith(STEP_PREFIX) for n in names), bool, count=len(names))
    parent, depth = op_tree(ev, rows)
    dur = ev.dur[rows].astype(np.float64)
    has_parent = parent >= 0
    child_sum = np.bincount(parent[has_parent], weights=dur[has_parent], minlength=rows.size)
    self_host = np.maximum(dur - child_sum[: rows.size], 0.0)

    # device work launched by each op (by external id)
    dev = links.device_rows
    dev_op = links.launching_op_of_device
    pos_of_row = np.full(len(ev), -1, dtype=np.int64)
    pos_of_row[rows] = np.arange(rows.size)
    dev_pos = np.where(dev_op >= 0, pos_of_row[np.maximum(dev_op, 0)], -1)
    ok = dev_pos >= 0
    dev_dur = ev.dur[dev].astype(np.float64)
    self_dev = np.bincount(dev_pos[ok], weights=dev_dur[ok], minlength=rows.size)[: rows.size]
    total_dev = _accumulate_up(self_dev, parent, depth)

    # aggregate by name (steps and GPU copies of annotations are not operators)
    op_name = ev.name[rows]
    table = ~step_name[op_name]
    nn = len(names)
    agg = {
        "calls": np.bincount(op_name[table], minlength=nn),
        "host_total": np.bincount(op_name[table], weights=dur[table], minlength=nn),
        "host_self": np.bincount(op_name[table], weights=self_host[table], minlength=nn),
        "device_self": np.bincount(op_name[table], weights=self_dev[table], minlength=nn),
        "device_total": np.bincount(op_name[table], weights=total_dev[table], minlength=nn),
    }
    present = np.flatnonzero(agg["calls"] > 0)
    has_device = bool(agg["device_self"].sum() > 0)
    key = (agg["device_self"][present], agg["host_self"][present])
    order = np.lexsort((-key[1], -key[0])) if has_device else np.argsort(-key[1], kind="stable")
    mem = None
    if ev.memory is not None:
        mem = _memory(ev, ev.memory, rows, parent, depth, op_name, table, step_name, steps)
    ops = [
        {
            "name": names[i],
            "calls": int(agg["calls"][i]),
            "host_self_us": float(agg["host_self"][i] / 1000.0),
            "host_total_us": float(agg["host_total"][i] / 1000.0),
            "device_self_us": float(agg["device_self"][i] / 1000.0),
            "device_total_us": float(agg["device_total"][i] / 1000.0),
            **(_memory_fields(mem["by_name"], i) if mem is not None else {}),
        }
        for i in present[order][:TOP_N].tolist()
    ]

    # tensor-core eligibility of the bottom-most eligible ops
    eligible_name = np.fromiter((n in TC_ELIGIBLE_OPS for n in names), bool, count=nn)
    elig = eligible_name[op_name]
    below = _accumulate_up(elig.astype(np.float64), parent, depth) - elig
    bottom = elig & (below == 0)
    k_rows = ev.kind[dev] == Kind.KERNEL
    launched = k_rows & (links.runtime_of_device >= 0)
    k_pos = dev_pos
    bottom_k = launched & (k_pos >= 0)
    bottom_k[bottom_k] = bottom[k_pos[bottom_k]]
    launched_t = float(dev_dur[launched].sum())
    tc_eligible_pct = float(dev_dur[bottom_k].sum() / launched_t * 100.0) if launched_t else 0.0

    shaped = np.fromiter(ev.shapes, dtype=np.int64, count=len(ev.shapes))
    shaped_pos = pos_of_row[shaped] if shaped.size else shaped
    return {
        # the kernel time under each op whose FLOPs are counted (trace/op_flops.py)
        "kernel_ns_of_shaped_rows": {
            int(r): float(total_dev[p]) for r, p in zip(shaped.tolist(), shaped_pos.tolist(),
                                                        strict=True)
            if p >= 0 and total_dev[p] > 0},
        "operators": ops,
        "operator_count": int(present.size),
        "kernels": _kernel_table(ev, links),
        "tc_eligible_kernel_pct": tc_eligible_pct,
        "memory": _memory_doc(mem, names, agg["calls"]) if mem is not None else None,
    }


#: Per-operator memory metrics, in the column order of the per-op and by-name tables.
_MEM_FIELDS = (
    "host_alloc_bytes", "host_alloc_total_bytes", "host_allocs", "host_net_bytes",
    "device_alloc_bytes", "device_alloc_total_bytes", "device_allocs", "device_net_bytes",
)


def _memory_fields(by_name: np.ndarray, i: int) -> dict[str, int]:
    return {f: int(by_name[i, c]) for c, f in enumerate(_MEM_FIELDS)}


def device_name(device_type: int, device_id: int) -> str:
    """``cpu``, ``cuda:0``, ...: torch's device strings for c10 ``DeviceType`` values."""
    if device_type == 0:
        return "cpu"
    if 0 < device_type < len(DEVICE_TYPE_NAMES):
        kind = DEVICE_TYPE_NAMES[device_type]
    else:
        kind = "unknown" if device_type < 0 else f"device_type_{device_type}"
    return kind if device_id < 0 else f"{kind}:{device_id}"


def _memory(
    ev: Events,
    m: MemoryEvents,
    rows: np.ndarray,
    parent: np.ndarray,
    depth: np.ndarray,
    op_name: np.ndarray,
    table: np.ndarray,
    step_name: np.ndarray,
    steps: Steps | None,
) -> dict[str, Any]:
    """Memory records attributed to operators (by name) and summarised per device."""
    pos = innermost_op(ev, rows, parent, m.thread, m.ts)
    in_op = pos >= 0
    in_op[in_op] = ~step_name[op_name[pos[in_op]]]  # a ProfilerStep is no operator
    nb = m.nbytes.astype(np.float64)
    alloc = nb > 0
    host = m.device_type == 0
    device = m.device_type > 0
    n = rows.size
    p, nb_in = pos[in_op], nb[in_op]
    self_cols = {  # column: (records, weighted by bytes?)
        "host_alloc_bytes": (host & alloc, True), "host_allocs": (host & alloc, False),
        "host_net_bytes": (host, True), "device_alloc_bytes": (device & alloc, True),
        "device_allocs": (device & alloc, False), "device_net_bytes": (device, True),
    }
    per_op = np.zeros((n, len(_MEM_FIELDS)))
    for col, (sel, weighted) in self_cols.items():
        s = sel[in_op]
        per_op[:, _MEM_FIELDS.index(col)] = np.bincount(
            p[s], weights=nb_in[s] if weighted else None, minlength=n)[:n]
    self_alloc = [_MEM_FIELDS.index("host_alloc_bytes"), _MEM_FIELDS.index("device_alloc_bytes")]
    total_alloc = [_MEM_FIELDS.index("host_alloc_total_bytes"),
                   _MEM_FIELDS.index("device_alloc_total_bytes")]
    for c_self, c_total in zip(self_alloc, total_alloc, strict=True):
        per_op[:, c_total] = _accumulate_up(per_op[:, c_self], parent, depth)
    nn = len(ev.names)
    by_name = np.zeros((nn, len(_MEM_FIELDS)))
    names_t, per_op_t = op_name[table], per_op[table]
    for c in range(len(_MEM_FIELDS)):
        by_name[:, c] = np.bincount(names_t, weights=per_op_t[:, c], minlength=nn)
    return {
        "by_name": by_name,
        "devices": _device_summary(m, in_op, steps),
        "events": len(m),
        "in_operators": int(in_op.sum()),
    }


def _device_summary(m: MemoryEvents, in_op: np.ndarray, steps: Steps | None
                    ) -> dict[str, dict[str, Any]]:
    """Per device: allocations, frees, peaks, and allocations per analysed step."""
    key = m.device_type.astype(np.int64) * (1 << 33) + m.device_id.astype(np.int64) + 1
    uniq, inv = np.unique(key, return_inverse=True)  # (type, id); ids are >= -1
    inv = inv.reshape(-1)
    nb = m.nbytes
    n_steps = len(steps) if steps is not None else 0
    step_of = np.full(len(m), -1, dtype=np.int64)
    if n_steps:
        idx = np.searchsorted(steps.host_starts, m.ts, side="right") - 1
        ok = idx >= 0
        ok[ok] = m.ts[ok] < steps.host_ends[idx[ok]]
        step_of[ok] = idx[ok]
    out: dict[str, dict[str, Any]] = {}
    order = np.argsort(m.ts, kind="stable")
    for d, k in enumerate(uniq.tolist()):
        sel = inv == d
        b = nb[sel]
        a = b > 0
        growth = np.cumsum(nb[order][sel[order]])
        in_steps = (step_of[sel] >= 0) & a
        alloc_bytes = int(b[a].sum())
        peak_alloc = m.total_allocated[sel]
        peak_res = m.total_reserved[sel]
        device_type, device_id = divmod(k, 1 << 33)
        out[device_name(device_type, device_id - 1)] = {
            "allocations": int(a.sum()),
            "alloc_bytes": alloc_bytes,
            "frees": int((b < 0).sum()),
            "freed_bytes": int(-b[b < 0].sum()),
            "peak_allocated_bytes": _nanmax_int(peak_alloc),
            "peak_reserved_bytes": _nanmax_int(peak_res),
            "peak_growth_bytes": int(max(growth.max(), 0)) if growth.size else 0,
            "allocs_per_step": float(in_steps.sum() / n_steps) if n_steps else None,
            "alloc_bytes_per_step": float(b[in_steps].sum() / n_steps) if n_steps else None,
            "in_operators_pct": float(b[a & in_op[sel]].sum() / alloc_bytes * 100.0)
            if alloc_bytes else 0.0,
        }
    return out


def _nanmax_int(x: np.ndarray) -> int | None:
    ok = np.isfinite(x)
    return int(x[ok].max()) if ok.any() else None


def _memory_doc(mem: dict[str, Any], names: list[str], calls: np.ndarray) -> dict[str, Any]:
    """The ``memory`` section: per device, then the top operators by allocated bytes."""
    by_name = mem["by_name"]
    col = {f: by_name[:, c] for c, f in enumerate(_MEM_FIELDS)}
    dev_b, host_b = col["device_alloc_bytes"], col["host_alloc_bytes"]
    some = np.flatnonzero(
        (col["host_alloc_total_bytes"] + col["device_alloc_total_bytes"] > 0) & (calls > 0))
    order = np.lexsort((-host_b[some], -dev_b[some]))
    return {
        "events": mem["events"],
        "in_operators": mem["in_operators"],
        "devices": mem["devices"],
        "operators": [
            {"name": names[i], "calls": int(calls[i]), **_memory_fields(by_name, i)}
            for i in some[order][:TOP_N].tolist()
        ],
    }


def _kernel_table(ev: Events, links: Links) -> list[dict[str, Any]]:
    rows = links.kernel_rows
    if rows.size == 0:
        return []
    nid = ev.name[rows]
    dur = ev.dur[rows].astype(np.float64)
    uniq, inv = np.unique(nid, return_inverse=True)
    calls = np.bincount(inv)
    total = np.bincount(inv, weights=dur)
    dmin = np.full(uniq.size, np.inf)
    dmax = np.zeros(uniq.size)
    np.minimum.at(dmin, inv, dur)
    np.maximum.at(dmax, inv, dur)

    def weighted(col: np.ndarray) -> np.ndarray:
        v = col[rows].astype(np.float64)
        ok = np.isfinite(v)
        w = np.where(ok, dur, 0.0)
        num = np.bincount(inv, weights=np.where(ok, v, 0.0) * w, minlength=uniq.size)
        den = np.bincount(inv, weights=w, minlength=uniq.size)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)

    bps = weighted(ev.blocks_per_sm)
    occ = weighted(ev.occupancy)
    order = np.argsort(-total, kind="stable")[:TOP_N]
    grand = float(total.sum())
    out = []
    for j in order.tolist():
        name = ev.names[int(uniq[j])]
        out.append({
            "name": name,
            "calls": int(calls[j]),
            "total_us": float(total[j] / 1000.0),
            "mean_us": float(total[j] / calls[j] / 1000.0),
            "min_us": float(dmin[j] / 1000.0),
            "max_us": float(dmax[j] / 1000.0),
            "share_pct": float(total[j] / grand * 100.0) if grand else 0.0,
            "blocks_per_sm": None if np.isnan(bps[j]) else float(bps[j]),
            "occupancy_pct": None if np.isnan(occ[j]) else float(occ[j]),
            "tensor_cores": uses_tensor_cores(name),
        })
    return out
