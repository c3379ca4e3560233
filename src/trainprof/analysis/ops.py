"""Torch calls per step by call site (``ops.json``), and the Python loops they reveal.

A call site that runs ``k`` times per step, where ``k`` is a small multiple
(1-4: one iteration may index two tensors) of a dimension ``d`` of the tensor
it operates on (counted per tensor it was called on, so that a line run once per
micro-batch is not taken for one), is taken for a Python loop over that dimension: the classic
case is ``for t in range(T): loss += F.cross_entropy(logits[:, t], y[:, t])``,
where ``logits[:, t]`` runs ``T`` times on a ``(B, T, V)`` tensor. All calls of
the loop's source line then count as the loop's work. Without a shape match a
single line with very many calls per step is still reported, as a hot line.

Loops are found from the recorded window (:mod:`trainprof.capture.opcount`);
their *time* is not measured (that would need the profiler), so their share of
torch calls stands in for their share of forward/backward time: small ops in
a loop cost mostly a fixed per-call overhead, which is what makes the loop slow.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from trainprof.analysis.system import OUTSIDE_LOAD_CORES

#: Smallest loop worth reporting: trip count, and calls per step of its line.
MIN_TRIPS = 8
MIN_LINE_CALLS = 16
#: Iterations may call the same function on the same line up to this many times.
MAX_CALLS_PER_TRIP = 4


def _match_dim(calls: float, shape: list[int] | None) -> tuple[int, int] | None:
    """(axis, size) of ``shape`` that ``calls`` is a small multiple of, largest size first."""
    if not shape or calls < MIN_TRIPS:
        return None
    k = round(calls)
    if abs(calls - k) > 1e-6:
        return None
    for axis, size in sorted(enumerate(shape), key=lambda a: -a[1]):
        if size >= MIN_TRIPS and k % size == 0 and k // size <= MAX_CALLS_PER_TRIP:
            return axis, size
    return None


def load_ops(run_dir: Path) -> dict[str, Any] | None:
    """The ``ops`` section of a run summary, or None when no sample was taken."""
    path = run_dir / "ops.json"
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or not doc.get("steps"):
        return None
    total = float(doc.get("calls_per_step") or 0.0)
    sites = [s for s in doc.get("sites", []) if isinstance(s, dict)]
    lines: dict[tuple[str, int], float] = {}
    for s in sites:
        key = (str(s.get("file")), int(s.get("line") or 0))
        lines[key] = lines.get(key, 0.0) + float(s.get("calls_per_step") or 0.0)
    loops = []
    seen: set[tuple[str, int]] = set()
    for s in sites:
        key = (str(s.get("file")), int(s.get("line") or 0))
        if key in seen:
            continue
        # calls per tensor: a line run once per micro-batch, or an nn.Module's internals
        # under it, sees a new tensor at each call; a loop indexes one tensor again and
        # again (older records lack the count: calls per step, as before)
        per_tensor = s.get("calls_per_arg_tensor", s.get("calls_per_step"))
        match = _match_dim(float(per_tensor or 0.0), s.get("arg_shape"))
        if match is None or lines[key] < MIN_LINE_CALLS:
            continue
        seen.add(key)
        axis, size = match
        loops.append({
            "file": key[0],
            "line": key[1],
            "source": source_line(*key),
            "function": s.get("function"),
            "trips_per_step": size,
            "axis": axis,
            "arg_shape": s.get("arg_shape"),
            "line_calls_per_step": lines[key],
            "share_of_calls": lines[key] / total if total else None,
        })
    loops.sort(key=lambda lp: -lp["line_calls_per_step"])
    compiled = bool(doc.get("compiled"))
    return {
        "steps_sampled": doc["steps"],
        # torch.compile had compiled a frame: the window counted FLOPs only, no calls
        # (capture/opcount.py), so every count below is None, not known
        "compiled": compiled,
        "calls_per_step": None if compiled else total,
        "top_sites": sites[:10],
        "loops": loops,
        # convolutions and how many ran in channels_last (NHWC), for diagnosis/device.py
        "conv2d_per_step": doc.get("conv2d_per_step"),
        "conv2d_channels_last_per_step": doc.get("conv2d_channels_last_per_step"),
        # matrix products, those TF32 could run, and the TF32 switches, for
        # diagnosis/tf32.py (records before these fields: None, not known)
        "matmul_per_step": doc.get("matmul_per_step"),
        "cuda_fp32_matmul_per_step": doc.get("cuda_fp32_matmul_per_step"),
        # float32 on the CPU outside autocast: what bfloat16 could run (diagnosis/precision.py)
        "cpu_fp32_matmul_per_step": doc.get("cpu_fp32_matmul_per_step"),
        "cpu_fp32_matmul_flops_per_step": doc.get("cpu_fp32_matmul_flops_per_step"),
        "cpu_fp32_big_matmul_flops_per_step": doc.get("cpu_fp32_big_matmul_flops_per_step"),
        # ... and CPU products under CPU autocast: small ones lose to its casts (precision.py)
        "cpu_autocast_matmul_per_step": doc.get("cpu_autocast_matmul_per_step"),
        "cpu_autocast_matmul_flops_per_step": doc.get("cpu_autocast_matmul_flops_per_step"),
        "cpu_autocast_big_matmul_flops_per_step": doc.get(
            "cpu_autocast_big_matmul_flops_per_step"),
        "cpu_autocast_dtype": doc.get("cpu_autocast_dtype"),
        # trainable embedding tables, their size and rows looked up (diagnosis/embedding.py)
        "embeddings": doc.get("embeddings"),
        # gradient clipping called in the window (it fails on sparse gradients)
        "clips_grads": doc.get("clips_grads"),
        "cuda_fp32_conv2d_per_step": doc.get("cuda_fp32_conv2d_per_step"),
        # products' and convolutions' FLOPs, all and float64 (diagnosis/float64.py)
        "matmul_conv_flops_per_step": doc.get("matmul_conv_flops_per_step"),
        "float64_matmul_flops_per_step": doc.get("float64_matmul_flops_per_step"),
        "float64_conv_flops_per_step": doc.get("float64_conv_flops_per_step"),
        "float64_matmul_conv_per_step": doc.get("float64_matmul_conv_per_step"),
        # the CPU's convolution FLOPs, all and NCHW (diagnosis/channels_last_cpu.py)
        "cpu_conv2d_flops_per_step": doc.get("cpu_conv2d_flops_per_step"),
        "cpu_nchw_conv2d_flops_per_step": doc.get("cpu_nchw_conv2d_flops_per_step"),
        "float32_matmul_precision": doc.get("float32_matmul_precision"),
        "cudnn_allow_tf32": doc.get("cudnn_allow_tf32"),
        # FLOPs of a step, forward and backward, by device and dtype (capture/flop_count.py;
        # analysis/compute_efficiency.py)
        "flops_by_kind_per_step": doc.get("flops_by_kind_per_step"),
        # attention computed op by op: score shapes a softmax ran on, with the time and
        # FLOPs of the ops on them a step (capture/eager_attention.py; diagnosis/attention.py)
        "eager_attention": doc.get("eager_attention"),
        # every op's time a step, by phase group (model: forward and backward) and kind
        # (product, attention, view, fusable) (capture/op_time.py; diagnosis/fusion.py)
        "op_time_per_step": doc.get("op_time_per_step"),
        # the steps the window covered, [first, end) each (records before: None)
        "window_steps": doc.get("window_steps"),
        # backward() calls a step: gradient accumulation when > 1 (diagnosis/distributed.py)
        "backward_per_step": doc.get("backward_per_step"),
        # sequences packed for an RNN (pack_padded_sequence): padding it skips already,
        # for diagnosis/padding.py (records before this field: None, not known)
        "packed_sequences_per_step": doc.get("packed_sequences_per_step"),
        # zeros written into gradients by zero_grad(set_to_none=False), for
        # diagnosis/zero_grad.py (records before this field: None, not known)
        "zero_grad_zeroing_calls_per_step": doc.get("zero_grad_zeroing_calls_per_step"),
        "zero_grad_zeroed_bytes_per_step": doc.get("zero_grad_zeroed_bytes_per_step"),
    }


def source_line(filename: str, lineno: int) -> str | None:
    """The text of a source line (linecache would cache whole files for the process)."""
    if not os.path.isfile(filename):
        return None
    try:
        with open(filename, encoding="utf-8", errors="replace") as f:
            for i, text in enumerate(f, 1):
                if i == lineno:
                    return text.strip()
    except OSError:
        return None
    return None




def summarize_op_time(ops: dict[str, Any] | None, step_s: float | None,
                      breakdown: dict[str, float] | None = None,
                      outside_cores: float | None = None,
                      device: dict[str, float] | None = None) -> dict[str, Any] | None:
    """The model's ops' time a step by kind (capture/op_time.py), with each kind's share of
    the model's op time and of the step: the summary's ``op_time``, or None without a
    timed window (or a steady step time).

    The window's two steps give the split between the kinds; each kind's seconds and share
    of the step are that split applied to forward and backward's steady seconds
    (``breakdown`` x ``step_s``) where those are shorter than the window's op seconds: two
    steps are few, an op descheduled once (workers starting at an epoch's end) would count
    its wait, and the timing itself adds to every op (the window's seconds stay in
    ``window_model_s_per_step``). Where forward and backward are longer than their ops,
    the rest is time outside torch's ops (Python between them, a module's hooks, a sleep),
    kept apart as ``outside_ops_s_per_step``: spread over the kinds, an explorer's forward
    with a 4 ms sleep read "pointwise 9.9 ms (93%)" for 2.2 ms of pointwise ops, the
    torch.compile hint's evidence. Without a breakdown, the window's seconds.

    Ops timed by CUDA events (``timed_by`` ``cuda events``) ran on the device: their split
    is applied to the device's forward and backward seconds a step (``device``'s
    ``model_s``, :func:`trainprof.analysis.device.device_seconds_per_step`), never the
    host's, which only launched them, and their shares are of the longer of the host's
    and the device's step (``step_s``: the step the shares are of); without device phase
    times, the window's own seconds.

    The row and the HTML report's tile read ``share_of_forward_backward``: each kind's
    seconds over forward and backward's, time outside the ops included, so the shares sit
    beside the seconds they divide and sum to one; ``share_of_model`` (of the ops' own time)
    stays the fusion rule's measure of what compiling could reach.

    ``outside_cores``: the cores other processes kept busy while the window ran
    (:func:`trainprof.analysis.system.outside_cores_during`). From
    :data:`~trainprof.analysis.system.OUTSIDE_LOAD_CORES` the split is ``disturbed``: other
    processes' work slows the ops unevenly (a product on every core loses more than a
    one-thread copy, or the reverse), and the rules do not read it."""
    timed = (ops or {}).get("op_time_per_step")
    model = timed.get("model") if isinstance(timed, dict) else None
    if not isinstance(model, dict) or not step_s or step_s <= 0:
        return None
    window = {k: float(v) for k, v in model.items() if isinstance(v, int | float)}
    window_total = sum(window.values())
    if window_total <= 0:
        return None
    share_of_model = {k: v / window_total for k, v in window.items()}
    phases = sum(float((breakdown or {}).get(p) or 0.0) for p in ("forward", "backward"))
    if timed.get("timed_by") == "cuda events":
        total = device["model_s"] if device else window_total
        step_s = max(step_s, device["step_s"]) if device else step_s
    else:
        total = phases * step_s if breakdown and phases > 0 else window_total
    # never scaled up: forward and backward longer than their ops is time outside the ops
    # (Python between them, a module's hooks, a sleep), not more of each kind
    scale = min(1.0, total / window_total)
    ops_s = window_total * scale
    outside = total - ops_s
    return {
        "model_s_per_step": total,
        "s_per_step": {k: v * ops_s for k, v in share_of_model.items()},
        "share_of_model": share_of_model,
        # each kind's share of forward and backward (``model_s_per_step``), the denominator
        # the row's seconds follow: with ``outside_ops_share_of_forward_backward`` they sum
        # to 1 (the op-time shares above, beside 16 ms of forward+backward and 4.3 ms
        # outside the ops, read "58% · 42% · 1% · 27%")
        "share_of_forward_backward": {k: v * ops_s / total if total > 0 else 0.0
                                      for k, v in share_of_model.items()},
        "outside_ops_share_of_forward_backward": outside / total if total > 0 else 0.0,
        "share_of_step": {k: v * ops_s / step_s for k, v in share_of_model.items()},
        # forward and backward's time outside torch's ops, and its share of the step
        "outside_ops_s_per_step": outside,
        "outside_ops_share_of_step": outside / step_s,
        # what the window's op seconds were multiplied by (at most 1)
        "scale": scale,
        "window_model_s_per_step": window_total,
        # the step the shares are of: the host's mean, or the device's where it is longer
        "step_s": step_s,
        "fusable_ops": [{**o, "s_per_step": float(o["s_per_step"]) * scale}
                        for o in timed.get("fusable_ops") or []
                        if isinstance(o, dict) and isinstance(o.get("s_per_step"), int | float)],
        "timed_by": timed.get("timed_by"),
        # CUDA event pairs still pending when the run's record closed (dropped)
        "unresolved": timed.get("unresolved"),
        "outside_load_cores": outside_cores,
        "disturbed": outside_cores is not None and outside_cores >= OUTSIDE_LOAD_CORES,
    }
