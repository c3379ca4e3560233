"""Reading a Kineto / Chrome-trace JSON file in bounded memory: bytes in, decoded event chunks out.

Why this is not ``json.load``: a torch.profiler trace is one JSON object whose
``traceEvents`` array holds every event, and traces reach gigabytes. Building
Python dicts for all of them is what makes other tools slow and memory-hungry:
on the 35 MB shared ResNet-50 trace, ``json.loads`` takes 0.37 s, ``orjson.loads``
0.46 s and msgspec's untyped decode 0.40 s (measured here), and the dicts take 96 MB
(2.7x the JSON); HTA needs 5-7x. Here the file is read (and gunzipped) incrementally,
the events array is cut into pieces of about :data:`CHUNK_BYTES` at event
boundaries, and each piece is decoded by msgspec straight into small typed structs
that keep only the fields the analysis reads (0.05 s for the same file). The caller
turns each piece into numpy columns and drops it, so peak memory is a few chunks
plus the columns, whatever the file size. There is one path for every size: small
files are simply one or a few chunks. Gzip is inflated by ISA-L (``isal``) when it
is installed: 5 ms instead of zlib's 34 ms for the same file.

Where an event piece ends is found by a regular expression (``}`` ``,`` ``{``)
and *checked by decoding*: a cut inside a string or inside a nested object
cannot decode (an unterminated string or unbalanced brackets), so the loader
falls back to an earlier candidate. Truncated files (a crashed profiler, a
partial copy) are analysed up to the last complete event, with a warning.

Both layouts of the Trace Event Format are read: the JSON object with a
``traceEvents`` key (what Kineto writes; other top-level keys such as
``deviceProperties`` and ``distributedInfo`` may come before or after it) and
the bare JSON array of events.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from trainprof.errors import UsageError

try:  # ISA-L's inflate: 7x faster than zlib on traces (4.8 vs 34 ms for the 35 MB trace)
    from isal import isal_zlib as _gzip_impl
except ImportError:  # pragma: no cover - isal is a dependency; zlib is the fallback
    _gzip_impl = zlib

#: Size of the decoded text handed to msgspec at a time. 4 MiB keeps the peak (the text,
#: its decoded structs, the columns) well under the JSON size for large files and costs
#: nothing measurable on small ones.
CHUNK_BYTES = 4 << 20
#: A single event larger than this is not a profiler trace (or the file is corrupt).
MAX_EVENT_BYTES = 256 << 20
#: Bytes read (and, for gzip, decompressed) per step.
_READ_BYTES = 1 << 20
#: Compressed bytes fed to zlib per step (traces compress ~30x).
_GZ_READ_BYTES = 64 << 10

_EVENT_GAP = re.compile(rb"\}\s*,\s*\{")
_EVENT_END = re.compile(rb"\}\s*\]")
_TRACE_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
_WS = b" \t\r\n"
_JSON_TYPE = {"int": "number", "float": "number", "str": "string", "dict": "object",
              "NoneType": "null", "bool": "boolean"}
_NON_WS = re.compile(rb"\S")


class Args(msgspec.Struct, gc=False, omit_defaults=True):
    """The ``args`` fields the analysis reads; msgspec skips every other key unparsed."""

    correlation: int | str | None = None
    external_id: int | str | None = msgspec.field(default=None, name="External id")
    external_id_old: int | str | None = msgspec.field(default=None, name="external id")
    device: int | str | None = None
    stream: int | str | None = None
    blocks_per_sm: float | None = msgspec.field(default=None, name="blocks per SM")
    occupancy: float | None = msgspec.field(default=None, name="est. achieved occupancy %")
    bytes: int | float | None = None
    #: MTIA device events carry a transfer direction and size instead of a name.
    direction: str | None = None
    size: int | str | None = None
    #: 'M' (metadata) events: process_name / process_labels / thread_name values.
    name: Any = None
    labels: Any = None
    #: ``[memory]`` instant events (``profile_memory=True``): the allocator's record.
    mem_bytes: int | float | None = msgspec.field(default=None, name="Bytes")
    total_allocated: int | float | None = msgspec.field(default=None, name="Total Allocated")
    total_reserved: int | float | None = msgspec.field(default=None, name="Total Reserved")
    device_type: int | None = msgspec.field(default=None, name="Device Type")
    device_id: int | None = msgspec.field(default=None, name="Device Id")
    #: ``record_shapes=True``: an op's argument shapes, dtypes and scalar values, kept
    #: undecoded (a slice of the input) and read only for the ops whose FLOPs are counted
    #: (:mod:`trainprof.analysis.trace.op_flops`)
    input_dims: msgspec.Raw = msgspec.field(default=msgspec.Raw(), name="Input Dims")
    input_type: msgspec.Raw = msgspec.field(default=msgspec.Raw(), name="Input type")
    concrete_inputs: msgspec.Raw = msgspec.field(default=msgspec.Raw(), name="Concrete Inputs")


class Event(msgspec.Struct, gc=False):
    """One trace event, reduced to what the analysis reads (Trace Event Format keys)."""

    ph: str = ""
    cat: str = ""
    name: str = ""
    pid: int | str | float | None = None
    tid: int | str | float | None = None
    ts: float | None = None
    dur: float | None = None
    args: Args | None = None


_EVENTS_DECODER = msgspec.json.Decoder(list[Event])
_ANY_DECODER = msgspec.json.Decoder()


@dataclass
class LoadInfo:
    """Facts about the file itself, for the report and for warnings."""

    path: Path
    compressed: bool = False
    size_bytes: int = 0
    json_bytes: int = 0
    layout: str = "object"  # "object" (traceEvents key) or "array"
    truncated: bool = False
    n_events: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def _open_text_stream(path: Path, info: LoadInfo) -> Iterator[bytes]:
    """Yield the file's (decompressed) bytes in pieces; gzip is detected by its magic bytes."""
    try:
        f = path.open("rb")
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    with f:
        head = f.read(2)
        if head != b"\x1f\x8b":
            info.compressed = False
            yield head
            while True:
                data = f.read(_READ_BYTES)
                if not data:
                    return
                yield data
        info.compressed = True
        d = _gzip_impl.decompressobj(wbits=31)
        pending = head
        while True:
            data = d.unconsumed_tail or pending or f.read(_GZ_READ_BYTES)
            pending = b""
            if not data:
                if not d.eof:
                    info.truncated = True
                    info.warnings.append(
                        f"{path.name}: the gzip stream is truncated; analysed what it holds"
                    )
                return
            try:
                out = d.decompress(data, _READ_BYTES)
            except (zlib.error, _gzip_impl.error) as exc:
                raise UsageError(f"{path}: not a valid gzip file ({exc})") from None
            if out:
                yield out
            if d.eof:
                rest = d.unused_data
                if rest.strip(b"\x00"):  # concatenated gzip members (gzip allows it)
                    d = _gzip_impl.decompressobj(wbits=31)
                    pending = rest
                elif not d.unconsumed_tail:
                    more = f.read(_GZ_READ_BYTES)
                    if not more:
                        return
                    d = _gzip_impl.decompressobj(wbits=31)
                    pending = more


def _decode_events(text: bytes | bytearray | memoryview) -> list[Event] | None:
    """Decode a JSON array of events; None if it is not valid JSON (a bad cut, or corrupt text).

    Valid JSON whose values have types the typed decoder does not expect (a name that is a
    number, a timestamp given as a string) is decoded loosely instead, event by event.
    """
    try:
        return _EVENTS_DECODER.decode(text)
    except msgspec.ValidationError:
        pass
    except msgspec.DecodeError:
        return None
    try:
        items = _ANY_DECODER.decode(text)
    except msgspec.DecodeError:
        return None
    if not isinstance(items, list):
        return None
    return [_loose_event(item) for item in items]


def _decode_in_place(buf: bytearray, close: int) -> list[Event] | None:
    """Decode ``buf[0:close+1]`` as an array: ``buf[0]`` becomes ``[`` and ``buf[close]`` ``]``.

    ``buf[0]`` is the separator slot before the first event (the array's ``[`` or a
    comma) and ``buf[close]`` the byte after an event's closing brace (whitespace, a
    comma or the array's ``]``), so overwriting them wraps the events without copying
    megabytes of text. ``buf[close]`` is restored when the cut does not decode.
    """
    saved = buf[close]
    buf[0] = 0x5B  # [
    buf[close] = 0x5D  # ]
    if buf.find(b'"Input Dims"', 0, close) >= 0:
        # shapes are kept undecoded (msgspec.Raw), as slices of what was decoded: of a copy
        # here, since this buffer is reused for the next chunk
        events = _decode_events(bytes(buf[: close + 1]))
    else:
        view = memoryview(buf)
        piece = view[: close + 1]
        try:
            events = _decode_events(piece)
        finally:
            piece.release()
            view.release()
    if events is None:
        buf[close] = saved
    return events


def _loose_event(item: Any) -> Event:
    """An event from an arbitrary JSON value: wrong types become missing fields."""
    if not isinstance(item, dict):
        return Event(ph="?")
    try:
        return msgspec.convert(item, Event, strict=False)
    except msgspec.ValidationError:
        pass
    name = item.get("name")
    ts, dur = item.get("ts"), item.get("dur")
    args = item.get("args")
    loose_args = None
    if isinstance(args, dict):
        try:
            loose_args = msgspec.convert(args, Args, strict=False)
        except msgspec.ValidationError:
            loose_args = None
    return Event(
        ph=str(item.get("ph", "")),
        cat=str(item.get("cat", "")),
        name=name if isinstance(name, str) else str(name),
        pid=item.get("pid") if isinstance(item.get("pid"), int | str) else None,
        tid=item.get("tid") if isinstance(item.get("tid"), int | str) else None,
        ts=_as_float(ts),
        dur=_as_float(dur),
        args=loose_args,
    )


def _as_float(v: Any) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int | float):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return None
    return None


def _decode_object(text: bytes, what: str, path: Path) -> dict[str, Any]:
    try:
        value = _ANY_DECODER.decode(text)
    except msgspec.DecodeError as exc:
        raise UsageError(f"{path}: not valid JSON ({what}: {exc})") from None
    if not isinstance(value, dict):
        raise UsageError(f"{path}: not a profiler trace ({what} is not a JSON object)")
    return value


class _Splitter:
    """Cuts the text of the events array into decodable pieces (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0  # bytes of the events text consumed so far (for messages)

    def take(self, buf: bytearray) -> tuple[list[Event], int]:
        """Decode as many whole events from the front of ``buf`` as one cut allows.

        ``buf[0]`` is the separator slot before the first event. Returns the events and the
        position of the separator before the next event (0: need more text).
        """
        n = len(buf)
        window = max(1, n - (1 << 20))
        while True:
            cands = list(_EVENT_GAP.finditer(buf, window))
            if cands or window == 1:
                break
            window = max(1, window - (8 << 20))
        # Newest candidates first; a failure means a cut inside a string or a nested object.
        tries = cands[::-1][:32] + cands[-33 :: -max(1, len(cands) // 16)]
        for m in tries:
            close = m.start() + 1
            events = _decode_in_place(buf, close)
            if events is not None:
                comma = buf.find(b",", close + 1, m.end())
                return events, comma if comma >= 0 else close
        if cands and n >= 2 * CHUNK_BYTES:
            raise UsageError(
                f"{self.path}: not valid JSON near byte {self.offset} of the traceEvents array"
            )
        if n > MAX_EVENT_BYTES:
            raise UsageError(
                f"{self.path}: no event boundary in {n >> 20} MiB of text near byte "
                f"{self.offset}: not a profiler trace, or corrupt"
            )
        return [], 0


def iter_event_chunks(path: Path, info: LoadInfo) -> Iterator[list[Event]]:
    """Yield the trace's events in decoded chunks; fill ``info`` (metadata, layout, warnings).

    Raises :class:`UsageError` for input that is not a profiler trace: empty, not JSON,
    JSON of another shape, a gzip file that is not one.
    """
    stream = _open_text_stream(path, info)
    buf = bytearray()
    eof = False

    def more() -> bool:
        nonlocal eof
        if eof:
            return False
        for data in stream:
            info.json_bytes += len(data)
            buf.extend(data)
            return True
        eof = True
        return False

    # --- the start: object with a traceEvents key, or a bare array of events
    while True:
        m = _NON_WS.search(buf)
        if m is not None and len(buf) - m.start() >= 4 or not more():
            break
    if m is not None and buf[m.start() : m.start() + 3] == b"\xef\xbb\xbf":  # a BOM
        del buf[: m.start() + 3]
        m = _NON_WS.search(buf)
    if m is None:
        raise UsageError(f"{path}: the file is empty")
    del buf[: m.start()]
    first = buf[:1]
    if first == b"[":
        info.layout = "array"
    elif first == b"{":
        info.layout = "object"
        while True:
            m = _TRACE_EVENTS_KEY.search(buf)
            if m is not None:
                break
            if len(buf) > MAX_EVENT_BYTES:
                raise UsageError(f"{path}: no 'traceEvents' array in the first "
                                 f"{len(buf) >> 20} MiB: not a profiler trace")
            if not more():
                # No events array: decide between "not JSON", "another shape", "truncated".
                whole = _decode_object_or_none(bytes(buf))
                if whole is None:
                    raise UsageError(
                        f"{path}: not valid JSON, or truncated before its traceEvents array"
                    )
                if "traceEvents" in whole:
                    kind = _JSON_TYPE.get(type(whole["traceEvents"]).__name__, "value")
                    raise UsageError(
                        f"{path}: not a profiler trace ('traceEvents' is a {kind}, not an array)"
                    )
                raise UsageError(
                    f"{path}: not a profiler trace (a JSON object without 'traceEvents'; "
                    f"keys: {', '.join(list(whole)[:6]) or 'none'})"
                )
        header = bytes(buf[: m.start()]).rstrip(_WS)
        if header.endswith(b","):
            header = header[:-1]
        try:
            info.metadata.update(_decode_object(header + b"}", "header", path))
        except UsageError:
            info.warnings.append(f"{path.name}: could not read the keys before traceEvents")
        del buf[: m.end() - 1]  # keep the '[' as the first separator slot
    else:
        raise UsageError(_not_a_json_trace(path, bytes(buf[:4096]), info.compressed))

    # --- the events; buf[0] is always the separator slot before the next event
    splitter = _Splitter(path)
    while True:
        if not eof and len(buf) < CHUNK_BYTES:
            more()
            continue
        m = _NON_WS.search(buf, 1)
        if m is None:
            if eof:  # the text ends inside the array, right after a comma
                info.truncated = True
                info.warnings.append(f"{path.name}: the trace is truncated (no end of the "
                                     "traceEvents array); analysed the complete events")
                buf.clear()
                break
            more()
            continue
        if buf[m.start()] == 0x5D:  # ]
            del buf[: m.start()]
            break
        if not eof:
            events, used = splitter.take(buf)
            if used:
                splitter.offset += used
                del buf[:used]
                info.n_events += len(events)
                yield events
            else:
                more()
            continue
        # End of input: the last events end with '}' then ']' and the trailer.
        events = _take_tail(buf, info, path)
        info.n_events += len(events)
        if events:
            yield events
        break

    # --- the trailer: keys after the events array (object layout)
    while more():
        pass
    if buf[:1] != b"]":
        return
    if info.layout == "object":
        trailer = bytes(buf[1:]).strip(_WS)
        if trailer.startswith(b","):
            try:
                info.metadata.update(_decode_object(b"{" + trailer[1:], "trailer", path))
            except UsageError:
                info.truncated = True
                info.warnings.append(
                    f"{path.name}: could not read the keys after traceEvents (truncated?)"
                )
        elif trailer != b"}":
            info.truncated = True
            info.warnings.append(f"{path.name}: the trace ends early, after its events")


def _not_a_json_trace(path: Path, head: bytes, compressed: bool) -> str:
    """Why ``path`` (whose first bytes are ``head``) is no JSON trace, in the user's terms: an
    HTML page (trainprof's own report is the usual one, beside the run's traces: 'binary
    data' told nothing), else the text it starts with, else binary data."""
    start = head.strip(_WS)
    gz = " after gunzip" if compressed else ""
    if start[:16].lower().startswith((b"<!doctype html", b"<html")):
        ours = b"<title>trainprof" in head
        what = "trainprof's HTML report" if ours else "an HTML page"
        hint = " (open it in a browser)" if ours else ""
        return (f"{path}: {what}{gz}, not a trace{hint}; trainprof trace reads a "
                "torch.profiler / Kineto trace: Chrome-trace JSON, plain or gzipped, or a "
                "folder of them")
    text = " ".join(start[:24].decode("ascii", "replace").split())  # newlines are text too
    what = f"it starts with {text!r}" if text.isprintable() else "binary data"
    return f"{path}: not a JSON trace ({what}{gz})"


def _decode_object_or_none(buf: bytes) -> dict[str, Any] | None:
    try:
        value = _ANY_DECODER.decode(buf)
    except msgspec.DecodeError:
        return None
    return value if isinstance(value, dict) else {}


def _take_tail(buf: bytearray, info: LoadInfo, path: Path) -> list[Event]:
    """Decode the last events, up to the array's closing ``]``; salvage a truncated end.

    On return ``buf`` holds the text from the closing ``]`` on (empty when truncated).
    """
    if info.layout == "array":  # the whole rest may be the array (no trailer can follow)
        rest = bytes(buf).rstrip(_WS)
        if rest.endswith(b"]"):
            events = _decode_events(b"[" + rest[1:])
            if events is not None:
                buf[:] = b"]"
                return events
    for m in list(_EVENT_END.finditer(buf, 1)):
        close = m.start() + 1
        events = _decode_in_place(buf, close)
        if events is not None:
            del buf[: m.end() - 1]
            buf[0] = 0x5D  # the ']' (it may have been the byte we overwrote)
            return events
    # No closing bracket after a complete event: the file is truncated. Keep what decodes.
    info.truncated = True
    text = bytes(buf[1:]).rstrip(_WS)
    if text.endswith(b","):
        text = text[:-1]
    events = _decode_events(b"[" + text + b"]")
    if events is None:
        events = []
        for m in reversed(list(_EVENT_GAP.finditer(buf, 1))):
            got = _decode_in_place(buf, m.start() + 1)
            if got is not None:
                events = got
                break
    info.warnings.append(
        f"{path.name}: the trace is truncated or corrupt after its first "
        f"{info.n_events + len(events)} events (no end of the traceEvents array); "
        "analysed the complete events before the cut"
    )
    buf.clear()
    return events
