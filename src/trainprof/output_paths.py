"""Where a command may write what the user names (``report --html PATH``, ``compare --html
PATH``, ``export --perfetto PATH``, ``export --tensorboard LOGDIR``): one rule for every
command, checked before any work so that a refusal costs nothing and leaves nothing.

* Never onto a run's record: a file named as one of a record's (:data:`~trainprof.store.
  RECORD_FILES`) in a folder that holds one, or a record's tool folders (``deep/``,
  ``python/``) and their files. ``export --perfetto RUN/run.json`` replaced the run's own
  record with the export and destroyed the run.
* A file where a file goes, a folder where a folder goes.
* The folder an output goes in is created when missing, one folder and no more
  (``--perfetto out/timeline.json`` makes ``out/``, as ``report --html`` always did): a path
  whose folder's folder is missing too is more often a typo than a tree to make
  (``--html /nonexist/dir/x.html`` had made ``/nonexist/dir`` as root), and it is refused
  naming the folder that is missing.

Nothing is created here: the writer makes the folder as it writes, so a command refused
after this check (a bad run folder) leaves nothing behind.
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
    home = resolved if folder else resolved.parent  # the folder the output goes in
    named = path if folder else path.parent  # as the user wrote it, for the message
    if home.exists() and not home.is_dir():
        raise UsageError(f"{shown}: {named} is a file, not a folder")
    if not home.exists() and not home.parent.is_dir():
        raise UsageError(f"{shown}: no folder {named.parent} (only the output's own folder, "
                         f"{named.name}/, is created when missing)")
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
