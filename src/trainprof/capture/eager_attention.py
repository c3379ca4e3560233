"""Attention computed op by op ("eager attention"), found and timed in the op count's window.

Why: attention written as ``softmax(q @ k.transpose(-2, -1) / sqrt(d)) @ v`` (the
``"eager"`` implementation of Hugging Face models, ``nn.MultiheadAttention`` called with
its default ``need_weights=True``, hand-written blocks) builds the whole (batch x heads,
query length, key length) score matrix in memory, then reads and writes it again for the
scaling, the mask, the softmax, the dropout and the second product, forward and backward.
``torch.nn.functional.scaled_dot_product_attention`` computes the same in fused kernels
(FlashAttention, Dao et al. 2022; memory-efficient attention, Rabe & Staats 2021; the CPU's
flash kernel) that never store the score matrix. The trace of a TimeSformer on an H100 in
``shared/traces`` spends 127 ms of its 155 ms of kernels on that pattern.

How: the FLOP count's dispatch mode (:mod:`trainprof.capture.flop_count`) hands every op
to :meth:`EagerAttention.claim`. A batched product ``bmm(a, b)`` whose inner size ``d`` is
small (at most :data:`MAX_HEAD_DIM`, and at most half of each outer size) makes a *score
shape* ``(batch, Lq, Lk)``: a candidate. Every op that reads or writes a tensor of that shape
(its last two sizes ``(Lq, Lk)`` or ``(Lk, Lq)``, the same number of elements: the
``(B, H, Lq, Lk)`` view too) counts as that candidate's work, and is timed: on the CPU by
the clock around the op, on CUDA by a pair of events around it (resolved when the window's
record is written, at the end of the run: never a sync per op). A candidate is attention
once a softmax runs on its shape. The ops are few (about ten a layer, forward and
backward), so the timing costs nothing worth noting, and only in the window's two steps.

Where: the first frame outside torch and trainprof when the softmax is first seen (the
script's line), and whether ``nn.MultiheadAttention``'s ``multi_head_attention_forward``
is on the stack (its fix is ``need_weights=False``).
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any

#: The largest inner size of a product that makes attention scores (a head's dimension:
#: 64 or 128 in most models, 256 in a few).
MAX_HEAD_DIM = 256

_SKIP_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep
    for m in (__import__("torch"), __import__("trainprof"))
)


class EagerAttention:
    """Score shapes seen in the window, the time and FLOPs of the ops on them."""

    def __init__(self, torch: Any) -> None:
        aten = torch.ops.aten
        self._torch = torch
        self._products = frozenset(getattr(aten, n) for n in ("bmm", "baddbmm")
                                   if hasattr(aten, n))
        self._softmax = frozenset(getattr(aten, n) for n in ("_softmax", "_safe_softmax")
                                  if hasattr(aten, n))
        #: (batch, Lq, Lk) -> its record; also keyed by (batch, Lk, Lq), the same record
        self.shapes: dict[tuple[int, int, int], dict[str, Any]] = {}

    # -- in the dispatch mode ------------------------------------------------------
    def claim(self, packet: Any, args: tuple[Any, ...], out: Any) -> dict[str, Any] | None:
        """The attention shape an op just run works on (its time is added to the record by
        the caller, :class:`~trainprof.capture.op_time.OpClock`), or None."""
        record = self._matching(args) if self.shapes else None
        if record is None and packet in self._products:
            record = self._scores_of(args, out)
        if record is None:
            return None
        record["ops"] += 1
        if packet in self._softmax:
            record["calls"] += 1  # one softmax a forward of the attention
            if not record["softmax"]:
                record["softmax"] = True
                record.update(_where())
        return record

    def _matching(self, args: tuple[Any, ...]) -> dict[str, Any] | None:
        tensor = self._torch.Tensor
        for a in args:
            if isinstance(a, tensor) and a.dim() >= 3:
                s = a.shape
                rec = self.shapes.get((a.numel() // (s[-1] * s[-2] or 1), s[-2], s[-1]))
                if rec is not None:
                    return rec
        return None

    def _scores_of(self, args: tuple[Any, ...], out: Any) -> dict[str, Any] | None:
        """A new score shape, if ``bmm(a, b) -> out`` computes scores (a small inner size)."""
        if len(args) < 2 or not isinstance(out, self._torch.Tensor) or out.dim() != 3:
            return None
        a = args[-2] if len(args) >= 3 else args[0]  # baddbmm(input, batch1, batch2)
        if not isinstance(a, self._torch.Tensor) or a.dim() != 3:
            return None
        batch, lq, lk = (int(x) for x in out.shape)
        known = self.shapes.get((batch, lq, lk))
        if known is not None:  # backward's product of the scores' gradient
            return known
        d = int(a.shape[-1])
        if d > MAX_HEAD_DIM or 2 * d > min(lq, lk):
            return None
        record = {"batch": batch, "query_len": lq, "key_len": lk, "head_dim": d,
                  "dtype": str(out.dtype).removeprefix("torch."), "device": out.device.type,
                  "ops": 0, "calls": 0, "ns": 0, "flops": 0.0, "softmax": False}
        self.shapes[(batch, lq, lk)] = record
        self.shapes[(batch, lk, lq)] = record
        return record

    # -- after the window ------------------------------------------------------------
    def per_step(self, steps: int) -> list[dict[str, Any]]:
        """The attention found (score shapes a softmax ran on), per step, most time first."""
        if not steps:
            return []
        seen: dict[int, dict[str, Any]] = {id(r): r for r in self.shapes.values()}
        out = []
        for r in seen.values():
            if not r["softmax"]:
                continue
            out.append({
                "batch": r["batch"], "query_len": r["query_len"], "key_len": r["key_len"],
                "head_dim": r["head_dim"], "dtype": r["dtype"], "device": r["device"],
                # attention calls (softmaxes) and the ops on the scores, a step
                "calls_per_step": r["calls"] / steps,
                "ops_per_step": r["ops"] / steps,
                "s_per_step": r["ns"] / 1e9 / steps,
                "flops_per_step": r["flops"] / steps,
                **{k: r[k] for k in ("file", "line", "multihead_attention", "unresolved")
                   if k in r},
            })
        out.sort(key=lambda r: -r["s_per_step"])
        return out


def _where() -> dict[str, Any]:
    """The script's line that runs the softmax, and whether nn.MultiheadAttention does."""
    out: dict[str, Any] = {"multihead_attention": False}
    f = sys._getframe(2)
    while f is not None:
        code = f.f_code
        if code.co_name == "multi_head_attention_forward":
            out["multihead_attention"] = True
        if not code.co_filename.startswith(_SKIP_DIRS) and "file" not in out:
            out.update(file=code.co_filename, line=f.f_lineno)
            break
        f = f.f_back
    return out


#: The longest the measurement of the fix may take, per attention shape.
SDPA_BUDGET_S = 0.4


def measure_sdpa(torch: Any, shape: dict[str, Any],
                 budget_s: float = SDPA_BUDGET_S) -> dict[str, Any]:
    """The fix, timed on this machine at the run's shape, against the ops it replaces: the
    best times of one forward and backward of ``F.scaled_dot_product_attention`` and of the
    plain ``softmax(q @ k.T * scale) @ v`` on ``(1, batch, L, head_dim)`` queries, keys and
    values in the run's dtype and device, taken in turns (so that a busy moment slows both).
    Their ratio scales the ops' time measured in the run: the script's own attention may do
    more (a mask, dropout), which the fused kernel saves too, so the saving is, if anything,
    understated. No mask: a causal one would only make the fused kernel faster. At the end of
    a run, like the peak (:mod:`trainprof.capture.peak_flops`), with a generator of its own so
    the script's random stream is left alone."""
    device, dtype = shape["device"], getattr(torch, shape["dtype"])
    b, lq, lk, d = (int(shape[k]) for k in ("batch", "query_len", "key_len", "head_dim"))
    # the plain ops hold about four score matrices at once (scores, probabilities, their
    # gradients): never more than a quarter of the memory free now
    need = 4 * b * lq * lk * torch.tensor([], dtype=dtype).element_size()
    free = _free_bytes(torch, device)
    if free is not None and need > free / 4:
        raise MemoryError(f"not timed: the plain ops would need {need / 2**30:.1f} GiB, "
                          f"{free / 2**30:.1f} GiB free")
    generator = torch.Generator(device=device).manual_seed(0)

    def rand(length: int) -> Any:
        return torch.randn(1, b, length, d, device=device, generator=generator).to(dtype)

    q, k, v = (rand(n).requires_grad_() for n in (lq, lk, lk))
    grad = rand(lq)
    scale = 1.0 / math.sqrt(d)
    fused = torch.nn.functional.scaled_dot_product_attention

    def eager(q: Any, k: Any, v: Any) -> Any:
        return torch.softmax((q @ k.transpose(-2, -1)) * scale, dim=-1) @ v

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def once(attention: Any) -> float:
        t0 = time.perf_counter()
        attention(q, k, v).backward(grad)
        sync()
        q.grad = k.grad = v.grad = None
        return time.perf_counter() - t0

    with torch.enable_grad():
        start = time.perf_counter()
        best = {"fused": once(fused), "eager": once(eager)}  # first calls pick the kernels
        warm = time.perf_counter() - start
        deadline = time.perf_counter() + budget_s
        repeats = 0
        while repeats < 30 and (time.perf_counter() < deadline
                                or (repeats < 3 and warm < budget_s / 3)):
            best["fused"] = min(best["fused"], once(fused))
            best["eager"] = min(best["eager"], once(eager))
            repeats += 1
    return {"s_per_call": best["fused"], "eager_s_per_call": best["eager"],
            "ratio": best["fused"] / best["eager"], "repeats": repeats}


def _free_bytes(torch: Any, device: str) -> int | None:
    """Memory free for a measurement: the GPU's (``cudaMemGetInfo``) or the machine's."""
    try:
        if device == "cuda":
            return int(torch.cuda.mem_get_info()[0])
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - unknown: measure
        return None
