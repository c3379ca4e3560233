"""FLOPs of a training step, forward and backward, by the device and dtype that computed them.

Why: a FLOPs utilization (:mod:`trainprof.analysis.compute_efficiency`) divides the FLOPs
a step computes by the rate the hardware reaches in the same dtype; a step that mixes
float32 and bfloat16 needs each kind counted apart.

How: the formulas are torch's own (``torch.utils.flop_counter.flop_registry``: matrix
products, convolutions and their backward, the attention kernels), applied at the aten
level by a ``TorchDispatchMode`` pushed for the op count's window of steps. At that level
autocast has already cast the inputs, so an op's dtype is the dtype it computed in, and
backward's products are seen too: the autograd engine carries the mode into the threads
that run backward. Ops with no formula (pointwise ops, reductions, the optimizer's
updates) count nothing, as in PaLM's model FLOPs (Chowdhery et al. 2022, appendix B) and
torch's ``FlopCounterMode``. Recomputed forwards (activation checkpointing) are counted:
these are the FLOPs the hardware ran (PaLM's "hardware FLOPs").

Not counted: work on threads the mode does not reach (``nn.DataParallel``'s replicas run
forward in threads of their own). A tensor subclass (``DTensor``) is counted at its level,
with the formula applied to its global shape.

Not in torch's registry and added here: the CPU's attention kernel,
``_scaled_dot_product_flash_attention_for_cpu`` and its backward, with the formulas the
registry gives the CUDA kernels; and the fused recurrent layers, ``mkldnn_rnn_layer`` (an
``nn.LSTM`` on the CPU: one call per layer and direction) and cuDNN's ``_cudnn_rnn``
(every layer in one call), with their backward: each time step's gate products,
``2 x rows x gates*H x (in + H)`` for ``rows`` time steps times batch rows (a packed
sequence's tokens), ``gates*H x in`` and ``gates*H x H`` the input's and the hidden
state's weights (4 gates for an LSTM, 3 for a GRU), and twice that backward (the inputs'
and the weights' gradients), as a matrix product's. An LSTM's steps had counted nothing
but its head (24.6 kFLOP a step) and its kernels read as pointwise ops.
Gated recurrent layers that run as separate ops (a GRU on the CPU, packed sequences) are
counted through their products.

The same mode times every op it passes on (:mod:`trainprof.capture.op_time`: the model's
op time by kind) and watches for attention computed op by op
(:mod:`trainprof.capture.eager_attention`): one mode, one pass over the ops. It declares
``ignore_compile_internals``, so it runs beside a ``torch.compile``-d model too: off while
Dynamo compiles, on while the compiled code runs.

Warnings raised under it are placed as without it (:mod:`trainprof.capture.window_warnings`):
a warning from an op's Python kernel (``stacklevel=k``) would otherwise count the mode's
frames and those torch calls it through. (A C++ warning of an op it runs needs nothing: the
op's C++ call hands it to the Python call that dispatched to the mode.)

Kinds are named ``"<device type> <dtype>"``, ``"cuda float32 tf32"`` for float32 products
and convolutions that TF32 tensor cores may run (``torch.backends.cuda.matmul.allow_tf32``
and ``torch.backends.cudnn.allow_tf32``, read when the window opens).
"""

from __future__ import annotations

import sys
from typing import Any

from trainprof.capture import window_warnings
from trainprof.capture.eager_attention import EagerAttention
from trainprof.capture.op_time import OpClock, kind_of

#: aten ops whose float32 CUDA version TF32 governs through the cuBLAS switch (products) ...
_PRODUCTS = frozenset({"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm"})


def _skip_dynamo_import(mode_class: Any) -> None:
    """Let ``mode_class``'s ``__torch_dispatch__`` run without importing torch._dynamo.

    torch wraps a dispatch mode's ``__torch_dispatch__`` in ``torch._disable_dynamo``, whose
    first call imports torch._dynamo to make the disabled function: 0.9 s, paid inside the
    op count's window by a script that never imports it itself (no ``torch.optim``, whose
    step imports it, and no ``torch.compile``): an explorer's manual-update loop stalled
    921 ms at its step 64, a run of 150 steps 127 it/s against python's 721. The wrapper
    looks for the disabled function on the wrapped one first (``__dynamo_disable``); ours
    calls the hook as it is while torch._dynamo is not loaded (no code can be compiled
    then, so there is nothing to keep Dynamo out of), and torch's disabled function from
    the first call after it is."""
    wrapper = mode_class.__dict__.get("__torch_dispatch__")
    raw = getattr(wrapper, "__wrapped__", None)
    if raw is None or sys.modules.get("torch._dynamo") is not None:
        return

    def disabled_once_loaded(*args: Any, **kwargs: Any) -> Any:
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is None:
            return raw(*args, **kwargs)
        try:
            real = dynamo.disable(raw, recursive=True, wrapping=False)
        except TypeError:  # a torch whose disable() takes no ``wrapping``
            real = dynamo.disable(raw, recursive=True)
        setattr(raw, "__dynamo_disable", real)
        return real(*args, **kwargs)

    setattr(raw, "__dynamo_disable", disabled_once_loaded)


def _cpu_attention_formulas(aten: Any, fc: Any) -> dict[Any, Any]:
    """The CPU's fused attention: the registry's formulas for the CUDA kernels, whose
    arguments it shares (query, key, value first; grad_out first in backward)."""
    out: dict[Any, Any] = {}
    forward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if forward is not None:
        out[forward] = lambda q, k, v, *a, **kw: fc.sdpa_flop_count(q.shape, k.shape, v.shape)
    if backward is not None:
        out[backward] = lambda g, q, k, v, *a, **kw: fc.sdpa_backward_flop_count(
            g.shape, q.shape, k.shape, v.shape)
    return out


def _rnn_rows(x: Any) -> int:
    """Time steps x batch rows of a recurrent layer's input ((T, B, in), (B, T, in) or a
    packed sequence's (tokens, in))."""
    return x.numel() // x.shape[-1] if x.dim() >= 2 and x.shape[-1] else 0


def _gate_products(rows: int, w_ih: Any, w_hh: Any) -> float:
    """Forward FLOPs of one layer and direction: the input's and the hidden state's gate
    products at every time step."""
    return 2.0 * rows * w_ih.shape[0] * (w_ih.shape[1] + w_hh.shape[1])


def _cudnn_layers(weights: Any, stride: int) -> float:
    """Per time-step row, the forward FLOPs of cuDNN's flat weight list: ``stride``
    tensors per layer and direction, w_ih and w_hh first (then biases, a projection)."""
    total = 0.0
    for i in range(0, len(weights) - 1, max(1, stride)):
        w_ih, w_hh = weights[i], weights[i + 1]
        total += _gate_products(1, w_ih, w_hh)
        if stride in (3, 5):  # a projection (proj_size > 0): w_hr, proj x H
            w_hr = weights[i + stride - 1]
            total += 2.0 * w_hr.shape[0] * w_hr.shape[1]
    return total


def _rnn_formulas(aten: Any) -> dict[Any, Any]:
    """The fused recurrent layers' FLOPs (see the module's docs)."""
    out: dict[Any, Any] = {}
    pairs = (
        ("mkldnn_rnn_layer", 1.0,
         lambda x, w_ih, w_hh, *a, **kw: _gate_products(_rnn_rows(x), w_ih, w_hh)),
        ("mkldnn_rnn_layer_backward", 2.0,
         lambda x, w_ih, w_hh, *a, **kw: _gate_products(_rnn_rows(x), w_ih, w_hh)),
        ("_cudnn_rnn", 1.0,
         lambda x, weights, stride, *a, **kw: _rnn_rows(x) * _cudnn_layers(weights, stride)),
        ("_cudnn_rnn_backward", 2.0,
         lambda x, weights, stride, *a, **kw: _rnn_rows(x) * _cudnn_layers(weights, stride)),
    )
    for name, times, formula in pairs:
        op = getattr(aten, name, None)
        if op is not None:
            out[op] = (lambda f, k: lambda *a, **kw: k * f(*a, **kw))(formula, times)
    return out


def _first_tensor(torch: Any, args: tuple[Any, ...]) -> Any:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    return None


def _step_phase() -> Any:
    """A reader of the active recorder's step-clock phase (None without a recorder)."""
    from trainprof.capture.recorder import active_recorder

    recorder = active_recorder()
    if recorder is None:
        return None
    clock = recorder.clock
    return lambda: clock.current


class FlopCount:
    """FLOPs by kind over the steps of the windows it was open for."""

    def __init__(self) -> None:
        self.by_kind: dict[str, float] = {}
        self.errors: dict[str, str] = {}
        self._mode: Any = None
        #: attention computed op by op, found in the same ops (capture/eager_attention.py)
        self.attention: EagerAttention | None = None
        #: every op's time by phase and kind (capture/op_time.py)
        self.op_clock: OpClock | None = None

    def start(self) -> None:
        """Push the dispatch mode on this (the training) thread."""
        import torch
        import torch.utils.flop_counter as fc
        from torch.utils._python_dispatch import TorchDispatchMode

        if self.attention is None:
            self.attention = EagerAttention(torch)
            self.op_clock = OpClock(torch, _step_phase())
        claim = self.attention.claim
        clock_start, clock_stop = self.op_clock.start, self.op_clock.stop
        registry = dict(fc.flop_registry)
        registry.update(_cpu_attention_formulas(torch.ops.aten, fc))
        registry.update(_rnn_formulas(torch.ops.aten))
        kinds: dict[Any, str] = {}  # op overload -> product, view or fusable
        by_kind, errors = self.by_kind, self.errors
        tf32_products = bool(torch.backends.cuda.matmul.allow_tf32)
        tf32_convs = bool(torch.backends.cudnn.allow_tf32)
        float32 = torch.float32

        def kind(packet: Any, first: Any) -> str:
            dtype = first.dtype
            name = f"{first.device.type} {str(dtype).removeprefix('torch.')}"
            if dtype is float32 and first.is_cuda and (
                    tf32_products if str(packet) in _PRODUCTS else tf32_convs):
                name += " tf32"
            return name

        class _Flops(TorchDispatchMode):
            @classmethod
            def ignore_compile_internals(cls) -> bool:
                # Off while torch.compile compiles, on while its compiled code runs: the
                # products a compiled graph calls are counted, and a frame first called
                # inside the window is compiled as usual (Dynamo would skip it for good
                # under a mode that does not say this)
                return True

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                kwargs = kwargs or {}
                packet = func._overloadpacket
                began = clock_start(args)
                out = func(*args, **kwargs)
                record = claim(packet, args, out)
                op_kind = kinds.get(func)
                if op_kind is None:
                    op_kind = kinds[func] = kind_of(func, packet, registry)
                clock_stop(began, "attention" if record is not None else op_kind,
                           packet.__name__, record)
                formula = registry.get(packet)
                if formula is not None:
                    try:
                        flops = float(formula(*args, **kwargs, out_val=out))
                        first = _first_tensor(torch, args)
                        if first is not None and flops > 0:
                            k = kind(packet, first)
                            by_kind[k] = by_kind.get(k, 0.0) + flops
                            if record is not None:  # a product of attention's scores
                                record["flops"] += flops
                    except Exception as exc:  # noqa: BLE001 - never the script's failure
                        errors.setdefault(str(packet), f"{type(exc).__name__}: {exc}")
                return out

        # a warning raised in an op's Python (a Python kernel's ``stacklevel=k``) would count
        # this mode's frames, and the frames torch calls it through: placed as without them
        # (capture/window_warnings.py). Used alone when the model is torch.compile'd.
        _skip_dynamo_import(_Flops)
        window_warnings.watch(_Flops.__torch_dispatch__, function_mode=False)
        self._mode = _Flops()
        self._mode.__enter__()
        window_warnings.open_window()

    def stop(self) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)
            window_warnings.close_window()

    def per_step(self, steps: int) -> dict[str, float]:
        return {k: v / steps for k, v in sorted(self.by_kind.items())} if steps else {}
