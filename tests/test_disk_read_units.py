"""Disk reads in MiB/s in every export, as the HTML report and every memory figure: the
TensorBoard tag and the Perfetto counter were decimal MB/s (``disk_read_mb_per_s``) beside
MiB/s in the HTML report."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from trainprof.analysis.scalars import _sample_values, describe
from trainprof.report.perfetto import PID_SYSTEM, _add_samples, _Builder

MIB = 1024 * 1024


def test_the_scalar_series_reads_disk_reads_in_mib_per_s() -> None:
    values = dict(_sample_values({"disk_read_bps": 3 * MIB, "iowait_pct": 0.0}, None))
    assert values["system/disk_read_mib_per_s"] == pytest.approx(3.0)
    assert "system/disk_read_mb_per_s" not in values
    assert "MiB/s" in (describe("system/disk_read_mib_per_s") or "")


def test_the_perfetto_counter_reads_disk_reads_in_mib_per_s(tmp_path: Path) -> None:
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps({"t": 1.0 + i * 0.2, "iowait_pct": 0.0,
                                        "disk_read_bps": 5 * MIB}) + "\n" for i in range(3)))
    run = SimpleNamespace(meta={"sample_interval_s": 0.2}, samples_path=path)
    b = _Builder()
    _add_samples(b, run, 1, 0.0, None)  # type: ignore[arg-type]
    disk = [e for e in b.events if e.get("ph") == "C" and e["name"] == "disk read"
            and e["pid"] == PID_SYSTEM]
    assert disk and all(e["args"] == {"MiB/s": 5.0} for e in disk)
    assert "disk read MiB/s" in b.tracks
