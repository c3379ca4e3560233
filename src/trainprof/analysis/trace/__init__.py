"""``trainprof trace``: analyse any torch.profiler / Kineto Chrome-trace file, or a directory.

:func:`analyse_trace` is the one entry point (the CLI calls it). The package is a
pipeline of small modules, each with one job:

========================  ===============================================================
:mod:`.loader`            bytes to decoded event chunks (gzip, streaming, bounded memory)
:mod:`.events`            chunks to numpy columns (format drift absorbed here)
:mod:`.correlate`         runtime ↔ device ↔ operator links (correlation / external ids)
:mod:`.steps`             ProfilerStep ranges moved onto the device timeline
:mod:`.tb_breakdown`      the TensorBoard plugin's step-time breakdown
:mod:`.gpu_metrics`       the plugin's GPU summary (utilization, SM efficiency, ...)
:mod:`.hta_temporal`      HTA's temporal and idle-time breakdowns
:mod:`.operators`         top operators and kernels, tensor-core eligibility, memory
:mod:`.launches`          kernel launches, memcpy kinds, syncs
:mod:`.analyse`           one document per file, merged across ranks
========================  ===============================================================
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainprof.errors import UsageError

__all__ = ["analyse_trace"]


def analyse_trace(path: Path) -> dict[str, Any]:
    """Analyse a trace file (``.json`` or ``.json.gz``) or a directory of them, one per rank.

    Returns a JSON-serialisable document (see :mod:`.analyse`) with ``findings`` from
    :func:`trainprof.diagnosis.trace_rules.diagnose_trace`. Raises :class:`UsageError`
    (one line) for input that cannot be analysed: missing, empty, not JSON, not a trace.
    """
    from trainprof.analysis.trace.analyse import analyse_file, merge_ranks, trace_files
    from trainprof.diagnosis.trace_rules import diagnose_trace

    path = Path(path)
    if not path.exists():
        raise UsageError(f"{path}: no such file or directory")
    if path.is_dir():
        files = trace_files(path)
        if not files:
            raise UsageError(f"{path}: no trace files (*.json, *.json.gz) in this directory")
        docs, skipped = [], []
        for f in files:
            try:
                docs.append(_guarded(analyse_file, f, len(docs)))
            except UsageError as exc:  # another JSON file beside the traces: say so, go on
                skipped.append(str(exc))
        if not docs:
            raise UsageError(skipped[0] if len(skipped) == 1 else
                             f"{path}: none of its {len(files)} JSON files is a trace "
                             f"({skipped[0]})")
        doc = docs[0] if len(docs) == 1 else merge_ranks(path, docs)
        doc["warnings"] = [f"skipped {s}" for s in skipped] + list(doc["warnings"])
    else:
        doc = _guarded(analyse_file, path, 0)
    doc["findings"] = diagnose_trace(doc)
    return doc


def _guarded(fn: Any, path: Path, index: int) -> dict[str, Any]:
    """Run one file's analysis; input that breaks it is a one-line error, not a traceback."""
    try:
        return fn(path, index)
    except UsageError:
        raise
    except MemoryError:
        raise UsageError(f"{path}: not enough memory to analyse this trace") from None
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError) as exc:
        raise UsageError(
            f"{path}: could not analyse this trace ({type(exc).__name__}: {exc})"
        ) from None
