"""The event model: a trace's complete ('X') events as numpy columns, in integer nanoseconds.

Every analysis in this package is vectorised numpy over these columns; no
analysis loops over events in Python. Columns are built chunk by chunk while the
loader streams the file (:mod:`.loader`), so the decoded Python objects of one
chunk are freed before the next is read.

Format drift is absorbed here, once (Kineto's category names changed over the
years; the mapping follows the PyTorch-profiler TensorBoard plugin's
``EventTypeMap`` in ``torch_tb_profiler/profiler/trace.py``, extended to the
categories newer Kineto, ROCm and MTIA traces use):

=================  =====================================================
kind               categories (case-insensitive)
=================  =====================================================
KERNEL             ``Kernel``, ``kernel``, MTIA ``mtia_ccp_events``
MEMCPY             ``Memcpy``, ``gpu_memcpy`` (and MTIA ``dma_request``)
MEMSET             ``Memset``, ``gpu_memset``
RUNTIME            ``Runtime``, ``cuda_runtime``, ``cuda_driver``, ``mtia_runtime``,
                   ``xpu_runtime``, ``privateuse1_runtime``, ``glow_runtime``
CPU_OP             ``Operator``, ``cpu_op``
ANNOTATION         ``user_annotation`` (``record_function`` labels)
GPU_ANNOTATION     ``gpu_user_annotation`` (the same labels repeated on the GPU)
PYTHON             ``python`` (the plugin's "Python" type; counted as CPU work)
PYTHON_FUNCTION    ``python_function`` (with_stack Python frames; not CPU ops)
TRACE              ``Trace`` (the profiler's own span, e.g. "PyTorch Profiler (0)")
DEVICE_SYNC        ``cuda_sync`` (a stream waiting on the device; only HTA counts it)
=================  =====================================================

Timestamps: the Trace Event Format's ``ts``/``dur`` are microseconds, integers in
old traces and floats with nanosecond fractions in newer ones. They become
int64 nanoseconds relative to the first event (relative first, so the float
subtraction is exact and no precision is lost to the 1.6e15 epoch offset).
``pid``/``tid`` may be integers or strings; they are interned to small codes.

Memory events (``profile_memory=True``) are instant events, not complete ones: ``ph``
``"i"`` (or the older ``"I"``) named ``[memory]`` (category ``cpu_instant_event`` in
modern traces, none in old ones), with ``args`` ``Bytes`` (negative: a free), ``Total
Allocated``, ``Total Reserved`` (modern traces only), ``Device Type`` (c10's
``DeviceType``: 0 CPU, 1 CUDA, ...) and ``Device Id``. The TensorBoard plugin
recognises them by phase and name (``trace.py``, ``create_event``); so does this
module. They become :class:`MemoryEvents` columns on the same clock and thread codes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import msgspec
import numpy as np

from trainprof.analysis.trace.attention import ATTENTION_OPS
from trainprof.analysis.trace.loader import Event
from trainprof.analysis.trace.op_flops import FLOP_OPS

#: ops whose shapes are kept: those whose FLOPs count, and those attention's scores pass
#: through (trace/attention.py)
SHAPED_OPS = FLOP_OPS | ATTENTION_OPS


class Kind(IntEnum):
    """What an event is, independent of the trace's format generation."""

    OTHER = 0
    KERNEL = 1
    MEMCPY = 2
    MEMSET = 3
    RUNTIME = 4
    CPU_OP = 5
    ANNOTATION = 6
    GPU_ANNOTATION = 7
    PYTHON = 8
    PYTHON_FUNCTION = 9
    TRACE = 10
    DEVICE_SYNC = 11


CATEGORY_KIND: dict[str, Kind] = {
    "kernel": Kind.KERNEL,
    "mtia_ccp_events": Kind.KERNEL,
    "memcpy": Kind.MEMCPY,
    "gpu_memcpy": Kind.MEMCPY,
    "memset": Kind.MEMSET,
    "gpu_memset": Kind.MEMSET,
    "runtime": Kind.RUNTIME,
    "cuda_runtime": Kind.RUNTIME,
    "cuda_driver": Kind.RUNTIME,
    "mtia_runtime": Kind.RUNTIME,
    "xpu_runtime": Kind.RUNTIME,
    "privateuse1_runtime": Kind.RUNTIME,
    "glow_runtime": Kind.RUNTIME,
    "hip_runtime": Kind.RUNTIME,
    "operator": Kind.CPU_OP,
    "cpu_op": Kind.CPU_OP,
    "user_annotation": Kind.ANNOTATION,
    "gpu_user_annotation": Kind.GPU_ANNOTATION,
    "python": Kind.PYTHON,
    "python_function": Kind.PYTHON_FUNCTION,
    "trace": Kind.TRACE,
    "cuda_sync": Kind.DEVICE_SYNC,
}

#: ``Device Type`` values of memory events (c10 ``DeviceType``, c10/core/DeviceType.h).
DEVICE_TYPE_NAMES = (
    "cpu", "cuda", "mkldnn", "opengl", "opencl", "ideep", "hip", "fpga", "maia", "xla",
    "vulkan", "metal", "xpu", "mps", "meta", "hpu", "ve", "lazy", "ipu", "mtia",
    "privateuseone",
)
MEMORY_EVENT_NAME = "[memory]"

#: Kinds that run on a device (GPU/accelerator timeline).
DEVICE_KINDS = (Kind.KERNEL, Kind.MEMCPY, Kind.MEMSET)

_NO_INT = -1


def _int_or(v: Any, default: int = _NO_INT) -> int:
    """An integer id from an int, a float or a numeric string; ``default`` otherwise."""
    if v is None or isinstance(v, bool):
        return default
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return int(v) if math.isfinite(v) else default
    if isinstance(v, str):
        try:
            return int(v, 0) if v[:2].lower() == "0x" else int(v)
        except ValueError:
            return default
    return default


def _stream_from_tid(tid: Any) -> int:
    """Old traces name the GPU thread "stream 7"; newer ones use the integer 7."""
    if isinstance(tid, int):
        return tid
    if isinstance(tid, str):
        digits = tid.rsplit(" ", 1)[-1]
        if digits.isdigit():
            return int(digits)
    return _NO_INT


@dataclass
class MemoryEvents:
    """Columns of a trace's ``[memory]`` instant events (one row per allocation or free)."""

    ts: np.ndarray  # int64 ns, on the clock of :class:`Events` (relative to its base_us)
    thread: np.ndarray  # int32 code of (pid, tid), the same codes as Events.thread
    nbytes: np.ndarray  # int64 bytes, negative for a free
    total_allocated: np.ndarray  # float64 bytes after the event (nan: not recorded)
    total_reserved: np.ndarray  # float64 bytes (nan: not recorded)
    device_type: np.ndarray  # int16 c10 DeviceType (-1: not recorded)
    device_id: np.ndarray  # int32 (-1 for the CPU)

    def __len__(self) -> int:
        return int(self.ts.shape[0])


@dataclass
class Events:
    """Columns of the complete events of one trace file (one row per 'X' event)."""

    kind: np.ndarray  # int8, Kind
    name: np.ndarray  # int32 index into names
    ts: np.ndarray  # int64 ns, relative to base_us
    dur: np.ndarray  # int64 ns (negative durations clamped to 0)
    thread: np.ndarray  # int32 code of (pid, tid)
    pid: np.ndarray  # int32 code of pid
    corr: np.ndarray  # int64 correlation id (-1: none)
    ext: np.ndarray  # int64 external id (-1: none)
    device: np.ndarray  # int32 device index for device events (-1: none)
    stream: np.ndarray  # int64 stream for device events (-1: none)
    blocks_per_sm: np.ndarray  # float32 (nan: none)
    occupancy: np.ndarray  # float32 est. achieved occupancy % (nan: none)
    nbytes: np.ndarray  # int64 bytes of memcpy/memset (-1: none)
    names: list[str]
    pids: list[Any]
    threads: list[tuple[Any, Any]]
    base_us: float
    float_timestamps: bool
    categories: dict[str, int]
    n_all: int  # all events, every phase
    n_negative_dur: int
    process_labels: dict[Any, str] = field(default_factory=dict)
    memory: MemoryEvents | None = None  # None: the trace has no memory events
    #: row -> (Input Dims, Input type, Concrete Inputs) of the ops whose FLOPs are counted
    #: (:data:`SHAPED_OPS`: FLOP_OPS and ATTENTION_OPS), where the trace has shapes
    shapes: dict[int, tuple[Any, Any, Any]] = field(default_factory=dict)

    @property
    def end(self) -> np.ndarray:
        return self.ts + self.dur

    def __len__(self) -> int:
        return int(self.kind.shape[0])

    def where(self, *kinds: Kind) -> np.ndarray:
        """Row indices of the given kinds, in file order."""
        if len(kinds) == 1:
            return np.flatnonzero(self.kind == kinds[0])
        return np.flatnonzero(np.isin(self.kind, np.array([int(k) for k in kinds])))


class EventBuilder:
    """Accumulates decoded chunks into columns; :meth:`finish` returns :class:`Events`."""

    def __init__(self) -> None:
        self._cols: dict[str, list[np.ndarray]] = {
            k: []
            for k in (
                "kind", "name", "ts", "dur", "thread", "pid", "corr", "ext", "device",
                "stream", "bps", "occ", "nbytes",
            )
        }
        self._names: dict[str, int] = {}
        self._pids: dict[Any, int] = {}
        self._tids: dict[Any, int] = {}
        self._tid_codes: dict[Any, int] = {}  # normalised tid -> code
        self._tid_values: list[Any] = []  # code -> the first tid seen with it
        self._threads: dict[int, int] = {}
        self._mem: dict[str, list[np.ndarray]] = {
            k: [] for k in ("ts", "thread", "bytes", "alloc", "reserved", "dtype", "did")
        }
        self._cat_kind: dict[str, int] = {}
        self.categories: dict[str, int] = {}
        self.process_labels: dict[Any, str] = {}
        self.base_us: float | None = None
        self.float_ts = False
        self.n_all = 0
        self.n_negative = 0
        self._rows = 0  # complete events added so far: the next chunk's first row
        self._shapes: dict[int, tuple[Any, Any, Any]] = {}

    def _codes(self, table: dict[Any, int], values: list[Any]) -> np.ndarray:
        """Interned codes of ``values`` (new values get the next codes), as int32."""
        for v in set(values).difference(table):
            table[v] = len(table)
        return np.fromiter(map(table.__getitem__, values), dtype=np.int32, count=len(values))

    def _tid_code_array(self, values: list[Any]) -> np.ndarray:
        """Thread ids as codes; ``"25738"`` and ``25738`` are one thread (old traces write
        the tid of 'X' events as a string and that of memory events as a number)."""
        for v in set(values).difference(self._tids):
            key = int(v) if isinstance(v, str) and v.isdigit() else v
            code = self._tid_codes.get(key)
            if code is None:
                code = self._tid_codes[key] = len(self._tid_values)
                self._tid_values.append(v)
            self._tids[v] = code
        return np.fromiter(map(self._tids.__getitem__, values), dtype=np.int32,
                           count=len(values))

    def add(self, chunk: list[Event]) -> None:
        self.n_all += len(chunk)
        xs = [e for e in chunk if e.ph == "X" and e.ts is not None]
        if len(xs) < len(chunk):  # metadata ('M') and memory events ('i', or old 'I')
            mem = []
            for e in [e for e in chunk if e.ph != "X"]:
                ph = e.ph
                if ph == "i" or ph == "I":
                    if e.name == MEMORY_EVENT_NAME and e.ts is not None and e.args is not None:
                        mem.append(e)
                elif ph == "M" and e.name == "process_labels":
                    labels = e.args.labels if e.args is not None else None
                    if isinstance(labels, str):
                        self.process_labels[e.pid] = labels
            if mem:
                self._add_memory(mem)
        if not xs:
            return
        n = len(xs)
        cats = [e.cat for e in xs]
        for c in set(cats):
            if c not in self._cat_kind:
                self._cat_kind[c] = int(CATEGORY_KIND.get(str(c).lower(), Kind.OTHER))
            self.categories[c] = self.categories.get(c, 0) + 1
        kind = np.fromiter(map(self._cat_kind.__getitem__, cats), dtype=np.int8, count=n)
        del cats

        name = self._codes(self._names, [e.name for e in xs])
        ts_f = np.array([e.ts for e in xs], dtype=np.float64)
        dur_f = np.array([e.dur for e in xs], dtype=np.float64)  # None -> nan
        if self.base_us is None:
            finite = ts_f[np.isfinite(ts_f)]
            self.base_us = float(finite.min()) if finite.size else 0.0
        if not self.float_ts:
            frac = ts_f - np.floor(ts_f)
            self.float_ts = bool(np.any(frac[np.isfinite(frac)] != 0))
        bad = ~np.isfinite(ts_f)
        if bad.any():
            ts_f[bad] = self.base_us
        dur_f[~np.isfinite(dur_f) | bad] = 0.0
        ts = np.rint((ts_f - self.base_us) * 1000.0).astype(np.int64)
        dur = np.rint(dur_f * 1000.0).astype(np.int64)
        neg = dur < 0
        if neg.any():
            self.n_negative += int(neg.sum())
            dur[neg] = 0

        pid = self._codes(self._pids, [e.pid for e in xs])
        tid = self._tid_code_array([e.tid for e in xs])
        pair = pid.astype(np.int64) << 32 | tid.astype(np.int64)
        uniq, inv = np.unique(pair, return_inverse=True)
        thread = self._codes(self._threads, uniq.tolist())[inv.reshape(-1)]

        # External ids: CPU ops, annotations, runtimes and device events carry them.
        ext = np.full(n, _NO_INT, dtype=np.int64)
        corr = np.full(n, _NO_INT, dtype=np.int64)
        device = np.full(n, _NO_INT, dtype=np.int32)
        stream = np.full(n, _NO_INT, dtype=np.int64)
        bps = np.full(n, np.nan, dtype=np.float32)
        occ = np.full(n, np.nan, dtype=np.float32)
        nbytes = np.full(n, _NO_INT, dtype=np.int64)
        args = [e.args for e in xs]
        has = np.fromiter((a is not None for a in args), dtype=bool, count=n)
        if has.any():
            idx = np.flatnonzero(has)
            sub = [args[i] for i in idx.tolist()] if not has.all() else args
            ext[idx] = _ids([
                a.external_id if a.external_id is not None else a.external_id_old for a in sub
            ])
            # correlation, device and stream matter for runtime and device events only
            k = kind[idx]
            dev_rt = np.flatnonzero(
                ((k >= Kind.KERNEL) & (k <= Kind.RUNTIME)) | (k == Kind.DEVICE_SYNC)
            )
            if dev_rt.size:
                rows = idx[dev_rt]
                corr[rows] = _ids([sub[i].correlation for i in dev_rt.tolist()])
                dev_rows = rows[kind[rows] != Kind.RUNTIME]
                if dev_rows.size:
                    self._device_args(xs, dev_rows, device, stream, bps, occ, nbytes)
        for col, arr in (
            ("kind", kind), ("name", name), ("ts", ts), ("dur", dur), ("thread", thread),
            ("pid", pid), ("corr", corr), ("ext", ext), ("device", device), ("stream", stream),
            ("bps", bps), ("occ", occ), ("nbytes", nbytes),
        ):
            self._cols[col].append(arr)
        codes = [self._names[n] for n in SHAPED_OPS if n in self._names]
        for i in (np.flatnonzero(np.isin(name, codes)).tolist() if codes else []):
            a = xs[i].args
            if a is not None and len(a.input_dims):
                self._shapes[self._rows + i] = (
                    _decode(a.input_dims), _decode(a.input_type), _decode(a.concrete_inputs))
        self._rows += n

    @staticmethod
    def _device_args(
        xs: list[Event],
        rows: np.ndarray,
        device: np.ndarray,
        stream: np.ndarray,
        bps: np.ndarray,
        occ: np.ndarray,
        nbytes: np.ndarray,
    ) -> None:
        evs = [xs[r] for r in rows.tolist()]
        args = [e.args for e in evs]
        d = _ids([a.device for a in args])
        missing = np.flatnonzero(d < 0)
        for j in missing.tolist():  # no args.device: the device's pid is its index
            d[j] = _int_or(evs[j].pid)
        device[rows] = d
        raw = [a.stream for a in args]
        st = _ids(raw)
        for j, v in enumerate(raw):  # no args.stream (old traces): the row says "stream 7"
            if v is None:
                st[j] = _stream_from_tid(evs[j].tid)
        stream[rows] = st
        bps[rows] = _floats([a.blocks_per_sm for a in args])
        occ[rows] = _floats([a.occupancy for a in args])
        nbytes[rows] = _ids([a.bytes if a.bytes is not None else a.size for a in args])

    def _add_memory(self, mem: list[Event]) -> None:
        """Memory events to columns (timestamps stay raw µs until the base is known)."""
        args = [e.args for e in mem]
        ts = _floats([e.ts for e in mem])
        nbytes = _floats([a.mem_bytes for a in args])
        ok = np.isfinite(ts) & (np.abs(nbytes) < 2.0**53)  # nan (missing) and nonsense out
        pid = self._codes(self._pids, [e.pid for e in mem])
        tid = self._tid_code_array([e.tid for e in mem])
        pair = pid.astype(np.int64) << 32 | tid.astype(np.int64)
        uniq, inv = np.unique(pair, return_inverse=True)
        thread = self._codes(self._threads, uniq.tolist())[inv.reshape(-1)]
        dtype = _floats([a.device_type for a in args])
        did = _floats([a.device_id for a in args])
        for col, arr in (
            ("ts", ts), ("thread", thread),
            ("bytes", np.rint(np.where(ok, nbytes, 0.0)).astype(np.int64)),
            ("alloc", _floats([a.total_allocated for a in args])),
            ("reserved", _floats([a.total_reserved for a in args])),
            ("dtype", np.where((dtype >= 0) & (dtype < 1 << 15), dtype, -1).astype(np.int16)),
            ("did", np.where((did >= 0) & (did < 1 << 31), did, -1).astype(np.int32)),
        ):
            self._mem[col].append(arr[ok] if not ok.all() else arr)

    def _finish_memory(self) -> MemoryEvents | None:
        if not self._mem["ts"]:
            return None
        cols = {k: np.concatenate(v) for k, v in self._mem.items()}
        self._mem = {k: [] for k in self._mem}
        rel_ns = (cols["ts"] - (self.base_us or 0.0)) * 1000.0
        ok = np.abs(rel_ns) < 2.0**62  # a timestamp no clock gives is dropped, not wrapped
        if not ok.all():
            cols = {k: v[ok] for k, v in cols.items()}
            rel_ns = rel_ns[ok]
        if rel_ns.size == 0:
            return None
        return MemoryEvents(
            ts=np.rint(rel_ns).astype(np.int64),
            thread=cols["thread"],
            nbytes=cols["bytes"],
            total_allocated=cols["alloc"],
            total_reserved=cols["reserved"],
            device_type=cols["dtype"],
            device_id=cols["did"],
        )

    def finish(self) -> Events:
        def cat(col: str, dtype: Any) -> np.ndarray:
            parts = self._cols[col]
            if not parts:
                return np.zeros(0, dtype=dtype)
            return np.concatenate(parts) if len(parts) > 1 else parts[0]

        kind = cat("kind", np.int8)
        names = list(self._names)
        pid_list, tid_list = list(self._pids), self._tid_values
        ev = Events(
            kind=kind,
            name=cat("name", np.int32),
            ts=cat("ts", np.int64),
            dur=cat("dur", np.int64),
            thread=cat("thread", np.int32),
            pid=cat("pid", np.int32),
            corr=cat("corr", np.int64),
            ext=cat("ext", np.int64),
            device=cat("device", np.int32),
            stream=cat("stream", np.int64),
            blocks_per_sm=cat("bps", np.float32),
            occupancy=cat("occ", np.float32),
            nbytes=cat("nbytes", np.int64),
            names=names,
            pids=list(self._pids),
            threads=[(pid_list[k >> 32], tid_list[k & 0xFFFFFFFF]) for k in self._threads],
            base_us=self.base_us or 0.0,
            float_timestamps=self.float_ts,
            categories=dict(self.categories),
            n_all=self.n_all,
            n_negative_dur=self.n_negative,
            process_labels=dict(self.process_labels),
            memory=self._finish_memory(),
            shapes=self._shapes,
        )
        self._cols = {k: [] for k in self._cols}
        _reclassify_mtia(ev)
        return ev


def _decode(raw: Any) -> Any:
    """An undecoded JSON value (``msgspec.Raw``); None when empty or malformed."""
    if not len(raw):
        return None
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None


def _floats(values: list[Any]) -> np.ndarray:
    """Floats (nan for missing or non-numeric values)."""
    if values.count(None) == len(values):  # a field this trace does not record: no slow path
        return np.full(len(values), np.nan)
    try:
        return np.array(values, dtype=np.float64)
    except (TypeError, ValueError):
        return np.array([_float_or_nan(v) for v in values], dtype=np.float64)


def _float_or_nan(v: Any) -> float:
    if isinstance(v, int | float) and not isinstance(v, bool):
        return float(v)
    return math.nan


def _ids(values: list[Any]) -> np.ndarray:
    """Integer ids (-1 for missing ones) from a list of ints, Nones and numeric strings."""
    try:
        f = np.array(values, dtype=np.float64)  # None -> nan; fast for the usual ints
    except (TypeError, ValueError):
        return np.array([_int_or(v) for v in values], dtype=np.int64)
    if f.size and np.nanmax(f, initial=0.0) >= 2.0**53:  # beyond exact floats: go slowly
        return np.array([_int_or(v) for v in values], dtype=np.int64)
    out = np.full(f.shape, _NO_INT, dtype=np.int64)
    ok = np.isfinite(f) & (f >= 0)
    out[ok] = f[ok].astype(np.int64)
    return out


def _reclassify_mtia(ev: Events) -> None:
    """MTIA's device events share one category; its DMA requests are memory transfers."""
    if "dma_request" not in ev.names:
        return
    dma = ev.names.index("dma_request")
    ev.kind[(ev.name == dma) & (ev.kind == Kind.KERNEL)] = Kind.MEMCPY


def load_events(path: Any) -> tuple[Events, Any]:
    """Read one trace file into columns: (:class:`Events`, :class:`.loader.LoadInfo`)."""
    from trainprof.analysis.trace.loader import LoadInfo, iter_event_chunks

    info = LoadInfo(path)
    try:
        info.size_bytes = path.stat().st_size
    except OSError:
        info.size_bytes = 0
    builder = EventBuilder()
    for chunk in iter_event_chunks(path, info):
        builder.add(chunk)
        del chunk
    return builder.finish(), info
