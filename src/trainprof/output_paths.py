"""Where a command may write what the user names (``report --html PATH``, ``compare --html
PATH``, ``export --perfetto PATH``, ``export --tensorboard LOGDIR``): one rule for every
command, checked before any work so that a refusal costs nothing and leaves nothing.

* Never onto a run's record: a file named as one of a record's (:data:`~trainprof.store.
  RECORD_FILES`) in a folder that holds one, or a record's tool folders (``deep/``,
  ``python/``) and their files. ``export --perfetto RUN/run.json`` replaced the run's own
  record with the export and destroyed the run.
* A file where a file goes, a folder where a folder goes.
"""

from __future__ import annotations

from pathlib import Path

from trainprof.errors import UsageError
from trainprof.store import RANKS_DIR, RECORD_DIRS, RECORD_FILES, RUN_JSON, TUNE_JSON


def check_output(path: Path, option: str, *, folder: bool = False) -> Path:
    """``path`` as ``option`` may write it (a file, or with ``folder`` a folder), by the
    module's rule; a path that breaks it is a UsageError naming the option and the path."""
    path = Path(path)
    shown = f"{option} {path}"
    resolved = path.resolve()  # through links: a link to run.json is run.json
    record = record_of(resolved)
    if record is not None:
        raise UsageError(f"{shown}: part of the record of the run in {record}; writing it "
                         "would destroy the run")
    if folder and path.exists() and not path.is_dir():
        raise UsageError(f"{shown}: a file, not a folder")
    if not folder and path.is_dir():
        raise UsageError(f"{shown}: a folder, not a file (name the file to write)")
    return path


def record_of(path: Path) -> Path | None:
    """The run or tune folder whose record the (resolved) ``path`` is part of, if any."""
    if path.name in RECORD_FILES and _holds_record(path.parent):
        return path.parent
    for folder in (path, path.parent):  # a tool folder itself (a log folder), or a file in it
        if folder.name in RECORD_DIRS and _holds_record(folder.parent):
            return folder.parent
    return None


def _holds_record(folder: Path) -> bool:
    """A run folder (its own record, or its ranks') or a tune folder."""
    return ((folder / RUN_JSON).is_file() or (folder / TUNE_JSON).is_file()
            or (folder / RANKS_DIR).is_dir())
