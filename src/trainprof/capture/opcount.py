"""Torch calls per step and where they come from, over a short sampled window of steps.

Why: a Python loop in the model or the loss (the per-token loss loop of a
GPT-style model, a per-sample augmentation on the GPU, a per-box loop in a
detector) turns one vectorised op into thousands of small ones; each costs a
Python call, a dispatch and, on CUDA, a kernel launch. The step clock sees
only that forward is slow. Counting the torch calls of a step, by call site,
shows the loop directly: a call site that runs ``k`` times per step where
``k`` equals a dimension of the tensor it indexes is a loop over that
dimension (expert-rules.md: TorchTidy's and the TensorBoard plugin's
"many small ops" rules, made specific).

How: a ``torch.overrides.TorchFunctionMode`` is pushed for a window of steps
(default: steps 8 and 9, after the usual warm-up and before
the default windows of the other tools, or the first two steps after that which no other
window covers: ``trainprof.capture.tools.clear_of``; the steps are flagged as profiled). Every
torch function or tensor method called from Python passes through
``__torch_function__``; the call site is the first frame outside torch. For
each call site it keeps the count, the function name and the shape of the
first tensor argument of its first call, and how many distinct tensors it was
called on: a loop over a dimension calls its line on the *same* tensor again and
again (``logits[:, t]``), while a line that merely runs once per micro-batch of a
gradient-accumulation loop (or whose calls come from inside an ``nn.Module`` it
calls, each on a new activation) sees a new tensor at each call. Tensors are told
apart by weak reference (an ``id`` alone could be reused once a tensor is freed);
none is kept alive. Calls made inside ``torch.optim``
(the optimizer's per-parameter loop) and in data loading (``torch.utils.data``,
a dataset's per-sample indexing) are counted apart: they are the library's
loops. Backward ops run in C++ and are not counted: the loop lives in the
Python that builds the graph.

Warnings: every torch call in the window runs inside the mode's frame, where Python would
place the warnings torch raises (``F.softmax``'s ``stacklevel=3``, a C++ ``TORCH_WARN``:
``opcount.py: return func(...)``, once more, past the script's filters for its module);
:mod:`trainprof.capture.window_warnings` places them as without the mode, at no cost per
call.

Output: ``RUN_DIR/ops.json`` (see :meth:`OpCountTool.close`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import weakref
from pathlib import Path
from typing import Any

from trainprof.capture import window_warnings
from trainprof.capture.flop_count import FlopCount
from trainprof.capture.window import Schedule
from trainprof.schema import BIG_MATMUL_FLOPS
from trainprof.store import OPS_JSON

#: The default sampling window: two steps, after the usual warm-up.
OPCOUNT_SCHEDULE = Schedule(skip_first=8, wait=0, warmup=0, active=2, repeat=1)
#: Call sites kept in the output (by calls per step).
TOP_SITES = 30

#: Frames in these folders are not call sites: torch's own Python, and trainprof's wrappers.
_SKIP_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep
    for m in (__import__("torch"), __import__("trainprof"))
)


#: Calls made inside these parts of torch (and trainprof's timed copy of the DataLoader's
#: fetch) are the library's own loops - the optimizer's per-parameter loop, a dataset's
#: per-sample indexing - not the user's: counted apart, by library.
_LIBRARIES = (
    ("optimizer", os.sep + os.path.join("torch", "optim") + os.sep),
    ("data_loading", os.sep + os.path.join("torch", "utils", "data") + os.sep),
    ("data_loading", os.sep + os.path.join("trainprof", "capture", "worker.py")),
)


#: What ``zero_grad(set_to_none=False)`` calls to write zeros into the gradients
#: (torch.optim's and nn.Module's: one ``zero_`` per gradient, or ``_foreach_zero_`` per
#: device and dtype); ``set_to_none=True``, the default since torch 2.0, calls neither.
_ZEROING = frozenset({"Tensor.zero_", "_foreach_zero_"})


#: Matrix products (what TF32 tensor cores run for float32 inputs, when allowed): the
#: functions a model calls from Python (nn.Linear calls ``linear``); their backward
#: runs in C++ and is not seen.
_MATMULS = frozenset({
    "linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "bilinear",
    "Tensor.matmul", "Tensor.__matmul__", "Tensor.__rmatmul__", "Tensor.mm", "Tensor.bmm",
    "Tensor.addmm", "Tensor.baddbmm",
})


#: Embedding lookups (``F.embedding``, ``F.embedding_bag``: what nn.Embedding(Bag) call), for
#: the tables whose dense gradients make every step write and update all of their rows
#: (diagnosis/embedding.py).
_EMBEDDINGS = frozenset({"embedding", "embedding_bag"})
#: The functions of torch.nn.utils that clip gradients, as the frame that calls the ops.
_CLIPPING = frozenset({"clip_grad_norm_", "_get_total_norm", "_clip_grads_with_norm_",
                       "clip_grads_with_norm_", "clip_grad_value_"})
#: Tables kept in ops.json, the largest first.
TOP_EMBEDDINGS = 8

#: backward() as scripts call it
_BACKWARDS = frozenset({"Tensor.backward", "backward"})
#: The op every ``pack_padded_sequence`` / ``pack_sequence`` runs: an RNN given a
#: PackedSequence computes on the real positions only (diagnosis/padding.py).
_PACKING = frozenset({"_VariableFunctionsClass._pack_padded_sequence",
                      "_pack_padded_sequence"})




def _matmul_flops(called: str, args: tuple[Any, ...]) -> float | None:
    """2 M N K of a matrix product from its arguments' shapes; None when not told."""
    try:
        if called == "linear":  # F.linear(input, weight, bias): weight is (N, K)
            return 2.0 * args[0].numel() * args[1].shape[0]
        if called in ("addmm", "Tensor.addmm", "baddbmm", "Tensor.baddbmm"):
            a, b = args[1], args[2]  # addmm(bias, a, b)
        elif called in ("matmul", "mm", "bmm", "Tensor.matmul", "Tensor.__matmul__",
                        "Tensor.mm", "Tensor.bmm"):
            a, b = args[0], args[1]
        else:
            return None
        return 2.0 * a.numel() * (b.shape[-1] if b.dim() > 1 else 1)
    except (AttributeError, IndexError, TypeError):
        return None


def _pair(value: Any) -> tuple[int, int]:
    return (int(value[0]), int(value[1])) if isinstance(value, list | tuple) else (
        int(value), int(value))


def _conv2d_flops(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> float | None:
    """2 N H_out W_out x (the weight's elements) of a ``torch.conv2d`` call: its
    multiply-adds, from the shapes (torch's Conv2d documentation gives H_out); None when not
    told (a string padding other than "same"/"valid", a batch-less input)."""
    kw = kwargs or {}
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    given = dict(zip(names, args, strict=False)) | kw
    try:
        x, w = given["input"], given["weight"]
        if x.dim() != 4:
            return None
        stride, dilation = _pair(given.get("stride", 1)), _pair(given.get("dilation", 1))
        padding = given.get("padding", 0)
        kh, kw_ = int(w.shape[2]), int(w.shape[3])
        h, wd = int(x.shape[2]), int(x.shape[3])
        if padding == "same":
            h_out, w_out = h, wd
        else:
            ph, pw = (0, 0) if padding == "valid" else _pair(padding)
            h_out = (h + 2 * ph - dilation[0] * (kh - 1) - 1) // stride[0] + 1
            w_out = (wd + 2 * pw - dilation[1] * (kw_ - 1) - 1) // stride[1] + 1
        return 2.0 * int(x.shape[0]) * max(h_out, 0) * max(w_out, 0) * w.numel()
    except (AttributeError, IndexError, KeyError, TypeError, ValueError):
        return None


def _conv_transpose2d_flops(args: tuple[Any, ...],
                            kwargs: dict[str, Any] | None) -> float | None:
    """2 N H_in W_in x (the weight's elements) of a ``torch.conv_transpose2d`` call: every
    input position multiplies the whole kernel into the output (the weight is C_in x
    C_out/groups x kH x kW); None when not told."""
    given = dict(zip(("input", "weight"), args, strict=False)) | (kwargs or {})
    try:
        x, w = given["input"], given["weight"]
        if x.dim() != 4:
            return None
        return 2.0 * int(x.shape[0]) * int(x.shape[2]) * int(x.shape[3]) * w.numel()
    except (AttributeError, IndexError, KeyError, TypeError, ValueError):
        return None


def _autocast_on(device_type: str) -> bool:
    """Autocast is on for ``device_type`` here (its matmuls run in 16 bits, not TF32)."""
    import torch

    try:
        return bool(torch.is_autocast_enabled(device_type))
    except TypeError:  # torch < 2.4: no argument, CUDA's
        return device_type == "cuda" and bool(torch.is_autocast_enabled())


def _nbytes(arg: Any) -> int:
    """Bytes of a tensor, or of a list of tensors (``_foreach_zero_``)."""
    if isinstance(arg, (list, tuple)):
        return sum(_nbytes(a) for a in arg)
    try:
        return int(arg.numel()) * int(arg.element_size())
    except AttributeError:
        return 0


#: How far above a user frame to look for a library that called it (a Dataset's
#: __getitem__ under the DataLoader's fetch is a few frames down).
_CALLER_DEPTH = 12


def _library_of(filename: str) -> str | None:
    for name, part in _LIBRARIES:
        if part in filename:
            return name
    return None


def _is_torch_frame(filename: str) -> bool:
    return filename.startswith(_SKIP_DIRS)


def _func_name(func: Any) -> str:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    if name.startswith("_TensorBase."):
        name = "Tensor." + name[len("_TensorBase."):]
    elif name.startswith("TensorBase."):
        name = "Tensor." + name[len("TensorBase."):]
    return name


def _first_tensor(args: tuple[Any, ...]) -> Any:
    import torch

    for a in args[:3]:
        if isinstance(a, torch.Tensor):
            return a
    return None


def _first_shape(args: tuple[Any, ...]) -> list[int] | None:
    a = _first_tensor(args)
    return None if a is None else list(a.shape)


def tf32_settings() -> dict[str, Any]:
    """The process's TF32 switches: ``torch.get_float32_matmul_precision()`` ("highest":
    float32 matmuls in full precision, torch's default since 1.12; "high"/"medium": TF32
    or bf16 allowed) and ``torch.backends.cudnn.allow_tf32`` (convolutions; on by
    default). Global flags: reading them initialises no CUDA. (The ``tf32`` knob records
    them too: trainprof.capture.knobs.)"""
    import torch

    out: dict[str, Any] = {}
    with contextlib.suppress(Exception):
        out["float32_matmul_precision"] = str(torch.get_float32_matmul_precision())
    with contextlib.suppress(Exception):
        out["cudnn_allow_tf32"] = bool(torch.backends.cudnn.allow_tf32)
    return out


def compiled_frames() -> int:
    """How many frames ``torch.compile`` has compiled in this process (Dynamo's counters; 0
    while Dynamo is not even imported)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return 0
    try:
        return int(dynamo.utils.counters["frames"]["ok"])
    except Exception:  # noqa: BLE001 - a torch without these counters: assume none
        return 0


def torch_compile_in_use() -> bool:
    """True once ``torch.compile`` has compiled a frame in this process."""
    return compiled_frames() > 0


class OpCountTool:
    """A :class:`~trainprof.capture.window.WindowTool` counting torch calls by call site."""

    name = "op_count"

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / OPS_JSON
        self.steps = 0
        self.total = 0
        self.library: dict[str, int] = {"optimizer": 0, "data_loading": 0}
        # (filename, lineno, function name) -> [count, shape of the first tensor arg,
        # distinct first tensor args, {id: weak reference} of those]
        self.sites: dict[tuple[str, int, str], list[Any]] = {}
        self._mode: Any = None
        self._started_at: int | None = None
        #: the steps each window covered, [first, end): the analysis reads the machine's
        #: load over them (an op time measured while other processes took the cores)
        self.windows: list[list[int]] = []
        #: torch.compile had compiled a frame when the window opened: FLOPs only
        self.compiled = False
        #: conv2d calls, and those with a channels_last input or weight (diagnosis/device.py)
        self.conv2d = [0, 0]
        #: FLOPs of the CPU's conv2d calls, and of those in NCHW (diagnosis/channels_last_cpu.py)
        self.cpu_conv2d_flops = [0.0, 0.0]
        #: FLOPs of every matrix product and convolution whose shapes tell them, and of the
        #: products and the convolutions in float64 (diagnosis/float64.py); the float64 calls
        self.flops = [0.0, 0.0, 0.0]
        self.float64_calls = 0
        self._float64: Any = None  # torch.float64, once torch is imported
        #: calls writing zeros into gradients inside a zero_grad, and their bytes
        #: (diagnosis/zero_grad.py)
        self.zeroing = [0, 0]
        #: matrix products, those in float32 on CUDA outside autocast, and float32 CUDA
        #: conv2d calls outside autocast: what TF32 would run on tensor cores
        #: (diagnosis/tf32.py)
        #: ... and those in float32 on the CPU outside CPU autocast (diagnosis/precision.py)
        self.matmuls = [0, 0, 0]
        self.cuda_fp32_conv2d = 0
        #: backward() calls: more than one a step is gradient accumulation (or several
        #: losses), where DDP all-reduces at each (diagnosis/distributed.py)
        self.backward = 0
        #: FLOPs of those CPU float32 products (where the shapes tell them), and of those of
        #: at least BIG_MATMUL_FLOPS each: only large products gain from bfloat16 on a CPU
        self.cpu_fp32_flops = [0.0, 0.0]
        #: CPU matrix products called under CPU autocast, their FLOPs and those of the
        #: products of at least BIG_MATMUL_FLOPS, and autocast's dtype then: small ones
        #: lose to the casts (diagnosis/precision.py)
        self.cpu_autocast = [0, 0.0, 0.0]
        self.cpu_autocast_dtype: str | None = None
        #: per trainable embedding table (by id of its weight): its lookups in the window
        #: (count_embedding)
        self.embeddings: dict[int, dict[str, Any]] = {}
        #: trainable leaf tensors (parameters) passed to a differentiable op other than a
        #: lookup, by id: (a weak reference, the op's name). A table whose weight is one of
        #: them (a tied output layer's ``linear``) gets a dense gradient whatever its
        #: ``sparse`` flag (note_dense_use)
        self.dense_uses: dict[int, tuple[Any, str]] = {}
        #: gradient clipping was called in the window (clip_grad_norm_ fails on sparse
        #: gradients: diagnosis/embedding.py)
        self.clips_grads = False
        #: the optimizers the run has stepped (the recorder sets it: a callable returning
        #: them): each table is marked whether one of them steps its weight
        self.optimizers: Any = None
        #: sequences packed for an RNN (pack_padded_sequence): padding it does not compute on
        self.packed_sequences = 0
        #: the script's TF32 settings when the window opened (after its set-up)
        self.tf32_settings: dict[str, Any] = {}
        #: FLOPs forward and backward, by the device and dtype that computed them
        self.flop_count = FlopCount()

    def count_embedding(self, called: str, args: tuple[Any, ...],
                        kwargs: dict[str, Any] | None) -> None:
        """A lookup in a trainable table: its size, whether its gradient is sparse, and the
        indices and distinct rows of the lookup (rows a sparse gradient would hold)."""
        import torch

        if len(args) < 2:
            return
        indices, weight = args[0], args[1]
        if called == "embedding_bag" and weight.dtype == torch.long:  # the legacy order
            indices, weight = weight, indices
        if (not isinstance(weight, torch.Tensor) or not isinstance(indices, torch.Tensor)
                or weight.dim() != 2 or not weight.requires_grad):
            return
        entry = self.embeddings.get(id(weight))
        if entry is None:
            entry = self.embeddings[id(weight)] = {
                "function": called, "rows": int(weight.shape[0]), "dim": int(weight.shape[1]),
                "dtype": str(weight.dtype).replace("torch.", ""),
                "device": weight.device.type, "sparse": False, "calls": 0, "indices": 0,
                "distinct_rows": 0, "_ref": weakref.ref(weight)}
        entry["calls"] += 1
        entry["sparse"] = entry["sparse"] or bool((kwargs or {}).get("sparse"))
        entry["indices"] += int(indices.numel())
        with contextlib.suppress(RuntimeError):
            entry["distinct_rows"] += int(torch.unique(indices).numel())

    def note_dense_use(self, called: str, args: tuple[Any, ...]) -> None:
        """A differentiable op other than a lookup, on the arguments given: the trainable
        leaf tensors among them (directly, or in a list such as ``torch.cat``'s) get a
        dense gradient from it. Only the first op seen per tensor is kept."""
        import torch

        tensor = torch.Tensor
        for a in args:
            for t in (a if isinstance(a, list | tuple) else (a,)):
                if (isinstance(t, tensor) and t.requires_grad and t.is_leaf
                        and id(t) not in self.dense_uses):
                    self.dense_uses[id(t)] = (weakref.ref(t), called)

    def _mark_tables(self) -> None:
        """At a window's end, while the tables live: whether each table's weight also went
        through a differentiable op other than a lookup (its gradient is dense whatever
        ``sparse`` says), and whether an optimizer steps it (compared by identity)."""
        stepped: set[int] | None = None
        if self.optimizers is not None:
            with contextlib.suppress(Exception):  # never the script's failure
                stepped = {id(p) for opt in self.optimizers() for g in opt.param_groups
                           for p in g.get("params") or []}
        for entry in self.embeddings.values():
            weight = entry["_ref"]()
            if weight is None:
                continue
            use = self.dense_uses.get(id(weight))
            if use is not None and use[0]() is weight:
                entry["dense_use"] = use[1]
            if stepped is not None:
                entry["stepped"] = id(weight) in stepped

    def count_cpu_autocast(self, flops: float | None) -> None:
        """A CPU matrix product under CPU autocast (the dispatcher casts it after this mode
        sees it: its arguments are still float32 here)."""
        import torch

        self.cpu_autocast[0] += 1
        if flops is not None:
            self.cpu_autocast[1] += flops
            if flops >= BIG_MATMUL_FLOPS:
                self.cpu_autocast[2] += flops
        if self.cpu_autocast_dtype is None:
            with contextlib.suppress(AttributeError, TypeError):  # torch < 2.4
                self.cpu_autocast_dtype = str(torch.get_autocast_dtype("cpu")).replace(
                    "torch.", "")

    def _make_mode(self) -> Any:
        from torch.overrides import TorchFunctionMode

        sites = self.sites
        tool = self
        getframe = sys._getframe
        is_torch = _is_torch_frame
        import torch

        conv2d, channels_last = torch.conv2d, torch.channels_last
        conv_transpose2d = torch.conv_transpose2d
        float32 = torch.float32
        tool._float64 = torch.float64

        def _is_cuda_fp32(t: Any) -> bool:
            return (isinstance(t, torch.Tensor) and t.dtype is float32 and t.is_cuda
                    and not _autocast_on("cuda"))

        def _is_cpu_fp32(t: Any) -> bool:
            return (isinstance(t, torch.Tensor) and t.dtype is float32
                    and t.device.type == "cpu" and not _autocast_on("cpu"))

        compiling = torch.compiler.is_compiling

        class _Count(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                if compiling():
                    # Dynamo, compiling a frame first called inside the window, traces this
                    # method: it gets the bare call (constant-folded), not the frame walk it
                    # could not trace, which would break the script's graph into pieces
                    return func(*args, **(kwargs or {}))
                tool.total += 1
                called = _func_name(func)
                if func is conv2d or func is conv_transpose2d:
                    # F.conv2d is torch.conv2d (and F.conv_transpose2d torch's): NCHW or NHWC
                    # (channels_last)? oneDNN and cuDNN reorder NCHW around both
                    tool.conv2d[0] += 1
                    nhwc = any(
                        isinstance(t, torch.Tensor) and t.dim() == 4 and not t.is_contiguous()
                        and t.is_contiguous(memory_format=channels_last) for t in args[:2])
                    tool.conv2d[1] += nhwc
                    flops = (_conv2d_flops(args, kwargs) if func is conv2d
                             else _conv_transpose2d_flops(args, kwargs))
                    tool.count_flops(args[0] if args else None, flops, True)
                    if args and _is_cuda_fp32(args[0]):
                        tool.cuda_fp32_conv2d += 1
                    elif (flops is not None and isinstance(args[0], torch.Tensor)
                          and not args[0].is_cuda):
                        tool.cpu_conv2d_flops[0] += flops
                        tool.cpu_conv2d_flops[1] += 0.0 if nhwc else flops
                elif called in _MATMULS:
                    tool.matmuls[0] += 1
                    arg = _first_tensor(args)
                    flops = _matmul_flops(called, args)
                    tool.count_flops(arg, flops, False)
                    if arg is not None and _is_cuda_fp32(arg):
                        tool.matmuls[1] += 1
                    elif arg is not None and _is_cpu_fp32(arg):
                        tool.matmuls[2] += 1
                        if flops is not None:
                            tool.cpu_fp32_flops[0] += flops
                            if flops >= BIG_MATMUL_FLOPS:
                                tool.cpu_fp32_flops[1] += flops
                    elif (isinstance(arg, torch.Tensor) and arg.device.type == "cpu"
                          and arg.is_floating_point() and _autocast_on("cpu")):
                        tool.count_cpu_autocast(flops)
                elif called in _EMBEDDINGS:
                    tool.count_embedding(called, args, kwargs)
                elif called in _BACKWARDS:
                    tool.backward += 1
                elif called in _PACKING:
                    tool.packed_sequences += 1
                f = getframe(1)
                library = None
                if f.f_code.co_name in _CLIPPING:
                    tool.clips_grads = True
                if f.f_code.co_name == "zero_grad" and is_torch(f.f_code.co_filename):
                    # torch's per-gradient loop, counted apart (nn.Module.zero_grad's too,
                    # whose file is no library's: its calls were sites of the script's line)
                    if called in _ZEROING and args:
                        tool.zeroing[0] += 1
                        tool.zeroing[1] += _nbytes(args[0])
                    library = "optimizer"
                    f = None
                while f is not None and is_torch(f.f_code.co_filename):
                    if library is None:
                        library = _library_of(f.f_code.co_filename)
                    f = f.f_back
                if library is None and f is not None:
                    # user code called by a library: a Dataset's __getitem__ run by the
                    # DataLoader's fetch is data loading, whatever it does
                    up = f.f_back
                    for _ in range(_CALLER_DEPTH):
                        if up is None:
                            break
                        name = up.f_code.co_filename
                        if is_torch(name):
                            library = _library_of(name)
                            if library is not None:
                                break
                        up = up.f_back
                if library is not None:
                    tool.library[library] += 1
                elif f is not None:
                    key = (f.f_code.co_filename, f.f_lineno, called)
                    entry = sites.get(key)
                    if entry is None:
                        entry = sites[key] = [0, _first_shape(args), 0, {}]
                    entry[0] += 1
                    arg = _first_tensor(args)
                    if arg is not None:  # a tensor not seen here before: one more
                        seen = entry[3]
                        ref = seen.get(id(arg))
                        if ref is None or ref() is not arg:
                            entry[2] += 1
                            seen[id(arg)] = weakref.ref(arg)
                out = func(*args, **(kwargs or {}))
                if called not in _EMBEDDINGS and getattr(out, "grad_fn", None) is not None:
                    tool.note_dense_use(called, args)
                return out

        # a warning torch raises in ``func`` (``stacklevel=k`` from torch's Python, or a
        # C++ TORCH_WARN: the innermost Python frame) would be placed at the line above,
        # not the script's: capture/window_warnings.py places it as without this mode
        window_warnings.watch(_Count.__torch_function__, function_mode=True)
        return _Count()

    def count_flops(self, first: Any, flops: float | None, conv: bool) -> None:
        """A product's or convolution's FLOPs (None: its shapes did not tell them), and
        whether it ran in float64 (its first tensor's dtype)."""
        if getattr(first, "dtype", None) is self._float64:
            self.float64_calls += 1
            if flops is not None:
                self.flops[2 if conv else 1] += flops
        if flops is not None:
            self.flops[0] += flops

    # -- WindowTool ------------------------------------------------------------
    def start(self, step: int) -> None:
        if self.steps and self.compiled != torch_compile_in_use():
            return  # a later window of another kind: its counts would not add up
        self.compiled = torch_compile_in_use()
        self._started_at = step
        if not self.tf32_settings:
            self.tf32_settings = tf32_settings()
        if not self.compiled:
            # Once torch.compile has compiled a frame, only the FLOPs are counted: the
            # call-site count's TorchFunctionMode would make Dynamo recompile (it guards on
            # the mode stack), trace its __torch_function__ and warn about sys._getframe;
            # and the calls of a compiled region are not the Python loops it looks for.
            # The FLOP count's dispatch mode steps aside while Dynamo compiles and sees
            # the products and convolutions the compiled code calls.
            self._mode = self._make_mode()
            self._mode.__enter__()
            window_warnings.open_window()  # warnings placed as without the mode
        self.flop_count.start()

    def stop(self, step: int) -> None:
        if self._started_at is None:
            return
        self.flop_count.stop()
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)
            window_warnings.close_window()
        self.steps += max(0, step - self._started_at)
        if step > self._started_at:
            self.windows.append([self._started_at, step])
        self._started_at = None
        for entry in self.sites.values():
            entry[3] = {}  # the weak references: only needed while counting
        self._mark_tables()
        self.dense_uses = {}

    def close(self) -> None:
        if self._started_at is not None:  # the run ended inside the window: partial steps
            self._mark_tables()
            self.flop_count.stop()
            if self._mode is not None:
                self._mode.__exit__(None, None, None)
                window_warnings.close_window()
                self._mode = None
            self._started_at = None
        if self.steps == 0:
            return
        attention, op_clock = self.flop_count.attention, self.flop_count.op_clock
        timed: dict[str, Any] = {}
        if attention is not None and op_clock is not None:
            op_clock.resolve()  # CUDA events to times: the run has ended
            timed = {
                # attention computed op by op: its score shapes, time and FLOPs a step
                # (capture/eager_attention.py; diagnosis/attention.py)
                "eager_attention": attention.per_step(self.steps),
                # every op's time a step by phase and kind (capture/op_time.py;
                # diagnosis/fusion.py)
                "op_time_per_step": op_clock.per_step(self.steps),
            }
        timed["window_steps"] = self.windows
        if self.compiled:
            self._write({
                "steps": self.steps,
                # torch.compile had compiled a frame: the FLOPs only (see start)
                "compiled": True,
                "flops_by_kind_per_step": self.flop_count.per_step(self.steps),
                **({"flop_count_errors": self.flop_count.errors}
                   if self.flop_count.errors else {}),
                **timed,
                **self.tf32_settings,
            })
            return
        sites = sorted(self.sites.items(), key=lambda kv: -kv[1][0])[:TOP_SITES]
        doc = {
            "steps": self.steps,
            "calls_per_step": self.total / self.steps,
            # of which inside optimizer.step and data loading (not attributed to call sites)
            "optimizer_calls_per_step": self.library["optimizer"] / self.steps,
            "data_loading_calls_per_step": self.library["data_loading"] / self.steps,
            "conv2d_per_step": self.conv2d[0] / self.steps,
            "conv2d_channels_last_per_step": self.conv2d[1] / self.steps,
            # matrix products, and those TF32 could run (float32 on CUDA, no autocast)
            "matmul_per_step": self.matmuls[0] / self.steps,
            "cuda_fp32_matmul_per_step": self.matmuls[1] / self.steps,
            "cpu_fp32_matmul_per_step": self.matmuls[2] / self.steps,
            "cpu_fp32_matmul_flops_per_step": self.cpu_fp32_flops[0] / self.steps,
            "cpu_fp32_big_matmul_flops_per_step": self.cpu_fp32_flops[1] / self.steps,
            # ... and those under CPU autocast (in its dtype: bfloat16 unless told)
            "cpu_autocast_matmul_per_step": self.cpu_autocast[0] / self.steps,
            "cpu_autocast_matmul_flops_per_step": self.cpu_autocast[1] / self.steps,
            "cpu_autocast_big_matmul_flops_per_step": self.cpu_autocast[2] / self.steps,
            "cpu_autocast_dtype": self.cpu_autocast_dtype,
            # trainable embedding tables looked up, the largest first: their rows, whether
            # their gradient is sparse, and the indices and distinct rows a step looks up
            # (distinct per lookup, summed: at least the rows a step touches)
            # ... ``dense_use``: a differentiable op other than a lookup that also took the
            # table's weight (a tied output layer's linear), ``stepped``: whether an
            # optimizer steps it (absent: not known); and whether gradients were clipped
            "clips_grads": self.clips_grads,
            "embeddings": [
                {**{k: v for k, v in e.items()
                    if k not in ("calls", "indices", "distinct_rows", "_ref")},
                 "lookups_per_step": e["calls"] / self.steps,
                 "indices_per_step": e["indices"] / self.steps,
                 "distinct_rows_per_step": e["distinct_rows"] / self.steps}
                for e in sorted(self.embeddings.values(),
                                key=lambda e: -e["rows"] * e["dim"])[:TOP_EMBEDDINGS]],
            "cuda_fp32_conv2d_per_step": self.cuda_fp32_conv2d / self.steps,
            # forward FLOPs of the products and convolutions, all and float64 ones
            "matmul_conv_flops_per_step": self.flops[0] / self.steps,
            "float64_matmul_flops_per_step": self.flops[1] / self.steps,
            "float64_conv_flops_per_step": self.flops[2] / self.steps,
            "float64_matmul_conv_per_step": self.float64_calls / self.steps,
            # forward FLOPs of the CPU's convolutions, and of those in NCHW
            "cpu_conv2d_flops_per_step": self.cpu_conv2d_flops[0] / self.steps,
            "cpu_nchw_conv2d_flops_per_step": self.cpu_conv2d_flops[1] / self.steps,
            "backward_per_step": self.backward / self.steps,
            # FLOPs of a step, forward and backward, by kind ("cpu float32", "cuda bfloat16")
            "flops_by_kind_per_step": self.flop_count.per_step(self.steps),
            **({"flop_count_errors": self.flop_count.errors} if self.flop_count.errors else {}),
            **timed,
            "packed_sequences_per_step": self.packed_sequences / self.steps,
            **self.tf32_settings,
            # zero_grad(set_to_none=False): zeros written into the gradients
            "zero_grad_zeroing_calls_per_step": self.zeroing[0] / self.steps,
            "zero_grad_zeroed_bytes_per_step": self.zeroing[1] / self.steps,
            "sites": [
                {
                    "file": filename,
                    "line": lineno,
                    "function": func,
                    "calls_per_step": count / self.steps,
                    "arg_shape": shape,
                    # calls per tensor it was called on, per step (see the module's docs)
                    "calls_per_arg_tensor": (
                        count / max(tensors, self.steps) if tensors else None),
                }
                for (filename, lineno, func), (count, shape, tensors, _) in sites
            ],
        }
        self._write(doc)

    def _write(self, doc: dict[str, Any]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, self.path)
