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
    from trainprof.analysis.trace.analyse import (
        analyse_file,
        drop_copies,
        merge_ranks,
        trace_files,
    )
    from trainprof.diagnosis.trace_rules import diagnose_trace

    path = Path(path)
    if not path.exists():
        raise UsageError(f"{path}: no such file or directory")
    run_warnings: list[str] = []
    if path.is_dir() and _is_run_folder(path):
        files, run_warnings = _run_traces(path)
        docs = [_guarded(analyse_file, f, rank) for rank, f in files]
        doc = docs[0] if len(docs) == 1 else merge_ranks(path, docs)
        doc["warnings"] = run_warnings + list(doc["warnings"])
        doc["findings"] = diagnose_trace(doc)
        return doc
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
        docs, copies = drop_copies(docs)
        doc = docs[0] if len(docs) == 1 else merge_ranks(path, docs)
        doc["warnings"] = ([f"skipped {s}" for s in skipped] + copies
                           + list(doc["warnings"]))
    else:
        doc = _guarded(analyse_file, path, 0)
    doc["findings"] = diagnose_trace(doc)
    return doc


def _is_run_folder(path: Path) -> bool:
    from trainprof.store import RANKS_DIR, RUN_JSON

    return (path / RUN_JSON).is_file() or (path / RANKS_DIR).is_dir()


def _run_traces(run_dir: Path) -> tuple[list[tuple[int, Path]], list[str]]:
    """The torch.profiler traces of a trainprof run folder (``--deep``), as ``(rank, file)``.

    A run of several ranks (:mod:`trainprof.analysis.ranks`): each rank's first window,
    merged as the ranks of one trace folder are. One process: its first window (``trainprof
    report`` analyses every window of a run). None: a one-line error saying what to do.
    """
    from trainprof.analysis.deep import DEEP_DIR
    from trainprof.analysis.ranks import rank_dirs
    from trainprof.analysis.trace.analyse import trace_files

    def first_window(folder: Path) -> tuple[Path | None, int]:
        deep = folder / DEEP_DIR
        found = trace_files(deep) if deep.is_dir() else []
        return (found[0] if found else None), len(found)

    warnings: list[str] = []
    ranks = rank_dirs(run_dir)
    folders = [(int(label) if label.isdigit() else i, folder)
               for i, (label, folder) in enumerate(ranks)] or [(0, run_dir)]
    files = []
    for rank, folder in folders:
        first, n = first_window(folder)
        if first is not None:
            files.append((rank, first))
            if n > 1:
                warnings.append(f"{folder}: {n} --deep windows, the first analysed "
                                f"(`trainprof report {folder}` shows every window)")
    if not files:
        raise UsageError(
            f"{run_dir} is a trainprof run folder with no torch.profiler trace: `trainprof "
            f"report {run_dir}` summarises it; `trainprof run --deep ...` records a trace")
    missing = len(folders) - len(files)
    if missing:
        warnings.append(f"{missing} of {len(folders)} ranks have no --deep trace")
    return files, warnings


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
