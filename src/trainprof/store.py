"""The Run record: a folder written crash-safely while training runs, read back later.

Layout (schema version :data:`SCHEMA_VERSION`; a **contract**, see DESIGN.md)::

    run.json        metadata, fingerprint, status, exit code, summary
    steps.bin       one fixed-width little-endian record per step (fields in run.json)
    device.bin      on CUDA: device time per step and phase, from CUDA events
    samples.jsonl   system samples, one JSON object per line
    events.jsonl    things that happen once or rarely: DataLoaders seen, regions, notes
    stacks.jsonl    the training thread's stack 4-20 times a second (trainprof.capture.loop_stacks)
    findings.json   the diagnosis at the end of the run
    faulthandler.log  only after a fatal signal: every thread's Python stack (capture.fault_log)

Why this shape: a 1,000,000-step run must stay small and load in seconds, so
steps are binary (144 bytes each, read with one ``numpy.frombuffer``), while rare,
variable-shaped events stay human-readable JSON lines. Every file is
append-only and flushed at least once a second (by the Recorder's flush thread
and the sampler process), so a crash or ``kill -9`` loses at most the last
second; ``run.json`` is replaced
atomically (write, fsync, rename), so it is never half-written. A reader drops
a torn last record or line.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from trainprof.errors import UsageError
from trainprof.fault_dump import read_fault_dump
from trainprof.schema import DEVICE_FIELDS, STEP_FIELDS

SCHEMA_VERSION = 1

#: Every field is int64 (times in nanoseconds: exact sums), so the capture can
#: write its flat in-memory buffer as it is.
STEP_DTYPE = np.dtype([(name, "<i8") for name in STEP_FIELDS])

DEVICE_DTYPE = np.dtype([(name, "<i8") for name in DEVICE_FIELDS])

RUN_JSON = "run.json"
#: Sub-folder of a run with one run folder per rank (trainprof.capture.ranks).
RANKS_DIR = "ranks"
DEVICE_BIN = "device.bin"
STEPS_BIN = "steps.bin"
SAMPLES_JSONL = "samples.jsonl"
EVENTS_JSONL = "events.jsonl"
STACKS_JSONL = "stacks.jsonl"
FINDINGS_JSON = "findings.json"
#: faulthandler's dump of a process killed by a fatal signal (trainprof.capture.fault_log).
FAULT_LOG = "faulthandler.log"
#: A ``trainprof tune`` folder's result, beside its trials' run folders.
TUNE_JSON = "tune.json"
#: ``trainprof verify``'s judgement, beside tune.json in its tune folder.
VERIFY_JSON = "verify.json"
#: The op count's sample of torch calls a step (trainprof.capture.opcount).
OPS_JSON = "ops.json"
#: The heavy tools' output: torch.profiler traces, cProfile and line_profiler results.
DEEP_DIR = "deep"
PYTHON_DIR = "python"

#: Every file of a record, in a run folder or a tune folder: what no output may overwrite
#: (trainprof.output_paths).
RECORD_FILES = frozenset({RUN_JSON, STEPS_BIN, DEVICE_BIN, SAMPLES_JSONL, EVENTS_JSONL,
                          STACKS_JSONL, FINDINGS_JSON, OPS_JSON, TUNE_JSON, VERIFY_JSON,
                          FAULT_LOG})
#: A record's folders of tool output, every file in them part of the record.
RECORD_DIRS = frozenset({DEEP_DIR, PYTHON_DIR})

STATUSES = ("running", "finished", "crashed", "interrupted")


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def safe_name(name: str) -> str:
    """``name`` with anything but letters, digits, ``-_.`` replaced: a folder name part."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "run"


def default_run_dir(name: str, root: Path | None = None) -> Path:
    """``./trainprof-runs/<timestamp>-<name>/``, made unique if it already exists.

    The folder is created here, atomically: processes that start in the same second
    with the same name (the ranks of a job, each with ``trainprof.profile()``) each
    get a folder of their own rather than the same one.
    """
    root = root if root is not None else Path.cwd() / "trainprof-runs"
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    safe = safe_name(name)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create {root}: {exc.strerror or exc}") from exc
    n = 1
    path = root / f"{stamp}-{safe}"
    while True:
        try:
            path.mkdir()
            return path
        except FileExistsError:
            n += 1
            path = root / f"{stamp}-{safe}-{n}"
        except OSError as exc:
            raise UsageError(f"cannot create run folder {path}: {exc.strerror or exc}") from exc


def _write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class RunWriter:
    """Writes one Run folder while the training script runs.

    ``append_step_bytes`` and ``event`` may be called from the flush thread;
    metadata updates come from the main thread. Writes are small and appended.
    """

    def __init__(self, run_dir: Path, meta: dict[str, Any]) -> None:
        # a second run appended to a folder's files would mix two runs' steps and samples
        if (run_dir / RUN_JSON).exists():
            raise UsageError(f"{run_dir} already holds a recorded run: record into a new "
                             "folder (or remove that one)")
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"cannot create run folder {run_dir}: {exc.strerror}") from exc
        self.run_dir = run_dir
        self.meta: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "status": "running",
            "exit_code": None,
            "started_at": now_iso(),
            "ended_at": None,
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            "step_fields": [[n, STEP_DTYPE[n].str] for n in STEP_DTYPE.names],
            **meta,
        }
        self._steps = open(run_dir / STEPS_BIN, "ab")  # noqa: SIM115 - open for the whole run
        self._device = open(run_dir / DEVICE_BIN, "ab")  # noqa: SIM115
        self._events = open(run_dir / EVENTS_JSONL, "ab")  # noqa: SIM115
        self.write_meta()

    def write_meta(self) -> None:
        _write_json_atomic(self.run_dir / RUN_JSON, self.meta)

    def update_meta(self, **values: Any) -> None:
        self.meta.update(values)
        self.write_meta()

    def append_step_bytes(self, data: bytes) -> None:
        """Whole step records, already in :data:`STEP_DTYPE` layout (the capture's buffer)."""
        if not data or self._steps.closed:
            return
        self._steps.write(data)
        self._steps.flush()

    def append_device(self, records: list[tuple[int, ...]]) -> None:
        if not records or self._device.closed:
            return
        self._device.write(np.array(records, dtype=DEVICE_DTYPE).tobytes())
        self._device.flush()

    def event(self, kind: str, **data: Any) -> None:
        if self._events.closed:
            return
        self._events.write(orjson.dumps({"kind": kind, **data}) + b"\n")
        self._events.flush()

    def close(self, status: str, exit_code: int | None, **extra: Any) -> None:
        assert status in STATUSES, status
        self._steps.close()
        self._device.close()
        self._events.close()
        self.update_meta(status=status, exit_code=exit_code, ended_at=now_iso(), **extra)


@dataclass
class Run:
    """A Run folder, loaded. ``status`` is the effective status (see :func:`load_run`)."""

    path: Path
    meta: dict[str, Any]
    steps: np.ndarray
    events: list[dict[str, Any]]
    samples_path: Path
    device: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=DEVICE_DTYPE))

    @property
    def status(self) -> str:
        return str(self.meta.get("status"))


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    with open(path, "rb") as f:
        for line in f:
            try:
                out.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                break  # a torn last line from a crash
    return out


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def record_is_open(run_dir: Path) -> bool:
    """True while the process that writes this record still runs it (see :func:`load_run`)."""
    try:
        meta = orjson.loads((Path(run_dir) / RUN_JSON).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return True  # not written yet
    if not isinstance(meta, dict) or meta.get("status") != "running":
        return False
    pid = meta.get("pid")
    if meta.get("hostname") == socket.gethostname() and isinstance(pid, int):
        return _process_alive(pid)
    return True


def load_records(path: Path, dtype: np.dtype = STEP_DTYPE) -> np.ndarray:
    """Fixed-width records from a binary file; a torn last record is dropped."""
    if not path.exists():
        return np.zeros(0, dtype=dtype)
    raw = path.read_bytes()
    usable = len(raw) - len(raw) % dtype.itemsize
    return np.frombuffer(raw[:usable], dtype=dtype)


def _load_steps(path: Path, meta: dict[str, Any]) -> np.ndarray:
    """Step records in the layout run.json declares, converted to today's :data:`STEP_DTYPE`.

    The writer records its field names and types in ``step_fields``, so a
    folder written by another trainprof version (other fields, narrower
    counters) still reads correctly: known fields are copied, missing ones are 0.
    """
    fields = meta.get("step_fields")
    if not fields:
        return load_records(path)
    try:
        dtype = np.dtype([(str(name), str(kind)) for name, kind in fields])
    except (TypeError, ValueError) as exc:
        raise UsageError(f"unreadable step layout in {path.parent / RUN_JSON}: {exc}") from exc
    raw = load_records(path, dtype)
    if dtype == STEP_DTYPE:
        return raw
    out = np.zeros(len(raw), dtype=STEP_DTYPE)
    for name in STEP_DTYPE.names:
        if name in dtype.names:
            out[name] = raw[name]
    return out


def _read_meta(meta_path: Path) -> dict[str, Any]:
    """A record's run.json; anything else there is a UsageError that says what it is
    (orjson's own words for bytes that are not UTF-8, 'str is not valid UTF-8:
    surrogates not allowed', told the user nothing)."""
    def refused(why: str) -> UsageError:
        return UsageError(f"{meta_path}: not a trainprof run record ({why})")

    try:
        data = meta_path.read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {meta_path}: {exc.strerror or exc}") from exc
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        raise refused("not UTF-8 JSON") from None
    try:
        meta = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise refused(f"not JSON: {exc}") from None
    if not isinstance(meta, dict) or "schema_version" not in meta:
        raise refused("no schema_version")
    return meta


def _not_a_run_folder(run_dir: Path) -> str:
    """Why ``run_dir`` (no run.json) is refused, naming what it is where it can tell: a
    ``trainprof tune`` or ``verify`` folder holds one run folder per trial, which is what
    compare and report read (an explorer's compare of a verify folder was told only
    "not a run folder")."""
    plain = f"{run_dir} is not a run folder (no {RUN_JSON})"
    kind = next((name.split(".")[0] for name in ("verify.json", "tune.json")
                 if (run_dir / name).is_file()), None)
    try:
        trials = sorted(p for p in run_dir.iterdir() if (p / RUN_JSON).is_file())
    except OSError:
        trials = []
    if kind is None and not trials:
        return plain
    what = f"a trainprof {kind} folder" if kind else "a folder of run folders"
    if not trials:
        return f"{run_dir} is {what}, not a run folder, and holds no trial's run folder"
    shown = ", ".join(str(p) for p in trials[:4]) + (", …" if len(trials) > 4 else "")
    text = f"{run_dir} is {what}, not a run folder: its trials' run folders are {shown}"
    if len(trials) >= 2:
        text += f" (e.g. trainprof compare {trials[0]} {trials[-1]})"
    return text


def load_run(run_dir: Path) -> Run:
    """Read a Run folder in any status.

    A record still marked ``running`` whose process is gone (same host) was
    killed without a chance to close it (``kill -9``, OOM killer, a segfault): it is
    reported as ``crashed``, with ``recorded_status`` keeping what the file says. If
    faulthandler's dump is there (a fatal signal: trainprof.fault_dump), ``crash`` holds
    the signal and the crashing thread's frames, and the note names the signal.
    """
    run_dir = Path(run_dir)
    meta_path = run_dir / RUN_JSON
    if run_dir.exists() and not run_dir.is_dir():
        hint = (" (a trace: trainprof trace FILE)"
                if run_dir.name.endswith((".json", ".json.gz", ".pt.trace.json")) else "")
        raise UsageError(f"{run_dir} is a file, not a run folder{hint}")
    if not run_dir.is_dir():
        raise UsageError(f"no such run folder: {run_dir}")
    if not meta_path.exists():
        raise UsageError(_not_a_run_folder(run_dir))
    meta = _read_meta(meta_path)
    if meta["schema_version"] > SCHEMA_VERSION:
        raise UsageError(
            f"{run_dir} was written by a newer trainprof (schema {meta['schema_version']}); "
            "upgrade trainprof to read it"
        )
    if (
        meta.get("status") == "running"
        and meta.get("hostname") == socket.gethostname()
        and isinstance(meta.get("pid"), int)
        and not _process_alive(meta["pid"])
    ):
        meta["recorded_status"] = "running"
        meta["status"] = "crashed"
        crash = read_fault_dump(run_dir / FAULT_LOG)
        if crash is not None:
            meta["crash"] = crash
            how = f"died of {crash['signal']} ({crash['message']}) without closing the record"
        else:
            how = "ended without closing the record (killed?)"
        meta.setdefault("notes", []).append(
            f"the process {how}; steps up to its last second are kept")
    steps = _load_steps(run_dir / STEPS_BIN, meta)
    recorded = meta.get("steps_recorded")
    if isinstance(recorded, int) and len(steps) < recorded:
        # closed with more steps than the file holds: say so, rather than "no step seen"
        held = ("is missing (not copied with the folder?)"
                if not (run_dir / STEPS_BIN).exists() else
                f"holds only {len(steps)} of them (cut short: a full disk, or copied while "
                "the run was writing it)")
        meta.setdefault("notes", []).append(f"the run recorded {recorded} steps but "
                                            f"{STEPS_BIN} {held}")
    return Run(
        path=run_dir,
        meta=meta,
        steps=steps,
        device=load_records(run_dir / DEVICE_BIN, DEVICE_DTYPE),
        events=_read_jsonl(run_dir / EVENTS_JSONL),
        samples_path=run_dir / SAMPLES_JSONL,
    )


def save_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    """Store the end-of-run summary in run.json (atomically), keeping everything else."""
    meta_path = Path(run_dir) / RUN_JSON
    meta = orjson.loads(meta_path.read_bytes())
    meta["summary"] = {k: v for k, v in summary.items() if k != "findings"}
    _write_json_atomic(meta_path, meta)
    _write_json_atomic(Path(run_dir) / FINDINGS_JSON, summary.get("findings", []))
