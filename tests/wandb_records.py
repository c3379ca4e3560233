"""Read back an offline W&B run (``run-<id>.wandb``), for the W&B export's tests.

W&B's Python package no longer ships a reader (``wandb sync`` reads the file in its Go core),
so this is the few lines it takes: the file is W&B's header (``:W&B``, a 2-byte magic, a
version byte) followed by a LevelDB log (32 KiB blocks of records, each a 4-byte CRC, a 2-byte
length and a 1-byte type: full, first, middle or last part), whose payloads are W&B's
``Record`` protobufs (``wandb.proto.wandb_internal_pb2``).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2 as pb

_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_records(path: Path) -> list[Any]:
    """Every Record protobuf of a ``.wandb`` file, in order."""
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"not a W&B run file: {data[:7]!r}"
    pos, payloads, parts = 7, [], b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's tail too short for a header: padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        payload = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == _FULL:
            payloads.append(payload)
        elif kind == _FIRST:
            parts = payload
        elif kind == _MIDDLE:
            parts += payload
        elif kind == _LAST:
            payloads.append(parts + payload)
    records = []
    for raw in payloads:
        record = pb.Record()
        record.ParseFromString(raw)
        records.append(record)
    return records


def _items(items: Any) -> dict[str, Any]:
    return {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in items}


@dataclass
class OfflineRun:
    """What an offline run holds: its run record, history rows, config, final summary,
    metric definitions, and the kinds of every record (to check what is not there)."""

    folder: Path
    run: Any
    history: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    kinds: set[str] = field(default_factory=set)

    def media(self, key: str) -> Path:
        """The file a logged table or HTML went to, under the run's ``files/``."""
        return self.folder / "files" / self.summary[f"{key}/path"]


def read_offline_run(folder: Path) -> OfflineRun:
    """One ``offline-run-*`` folder, read back."""
    (path,) = Path(folder).glob("run-*.wandb")
    out = OfflineRun(folder=Path(folder), run=None)
    for record in read_records(path):
        kind = record.WhichOneof("record_type")
        out.kinds.add(kind)
        if kind == "run":
            out.run = record.run
            out.config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "history":
            out.history.append(_items(record.history.item))
        elif kind == "config":
            out.config.update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "summary":
            out.summary.update(_items(record.summary.update))
        elif kind == "metric":
            m = record.metric
            out.metrics[m.name or m.glob_name] = m
    return out


def offline_runs(wandb_dir: Path) -> list[OfflineRun]:
    """Every offline run under ``WANDB_DIR``, oldest first."""
    return [read_offline_run(p) for p in sorted((Path(wandb_dir) / "wandb").glob("offline-run-*"))]
