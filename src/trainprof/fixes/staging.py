"""Stage a dataset onto the node's local disk once, and read it from there.

The slow-reads finding's other remedy: data on network storage (NFS, Lustre, a
cloud-mounted bucket) pays a round trip per file read, every epoch, from every rank.
A copy on the node's own disk (``$SLURM_TMPDIR``, ``$TMPDIR``, an NVMe scratch) pays
it once. What a hand-written ``cp -r`` in a job script gets wrong, and this does not:

* **Once per node, whatever the number of ranks**: the ranks of one node stage to the
  same place; an ``fcntl`` lock beside it lets one copy while the others wait, then all
  read the one copy.
* **Once per version of the data**: the copy's name carries a digest of the source's
  file list (relative path, size, modification time), so a later job on the same node
  reuses it at no cost and a changed source gets a fresh copy, never a stale one.
* **Complete or absent**: files are copied into ``NAME.partial-PID``, renamed into
  place when all are there, and marked complete beside it (``.NAME.staged.json``); a
  killed job leaves a partial or unmarked copy that the next call removes, and a file
  of the wrong size after copying is an error.
* **Older versions named, not removed**: the complete copies of earlier versions of
  the same source stay (a job started before the change may still read one), and are
  returned (``Staged.older``) so that the command can say what they hold and how to
  remove them.
* **Room checked first**: the copy is refused, with the sizes, before anything is
  written when the local disk has not room for it plus :data:`HEADROOM`.

Files are copied by several threads (network storage serves parallel reads faster
than one stream; ``shutil.copyfile`` releases the GIL). Works on a file (a pack's
shard, an archive) or a folder (a pack, a folder of samples).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from trainprof.errors import UsageError
from trainprof.fixes.interrupts import deferred_sigint

#: the marker beside a complete copy (where it came from, its digest), so that the copy
#: itself holds exactly the source's files
MARKER = ".{name}.staged.json"
#: free space to leave on the local disk beyond the copy
HEADROOM = 0.05
#: environment variables naming node-local scratch space, in order of preference
LOCAL_DIR_VARS = ("TRAINPROF_STAGE_DIR", "SLURM_TMPDIR", "TMPDIR")
DEFAULT_THREADS = 8


@dataclass(frozen=True)
class Staged:
    """Where the data is to be read from now, and what staging it cost."""

    path: Path
    copied: bool  # False: an earlier complete copy was reused
    files: int
    bytes: int
    #: complete copies of earlier versions of the same source under the same folder
    older: tuple[Path, ...] = ()
    older_bytes: int = 0


def local_root() -> Path:
    """Where copies go by default: the first of :data:`LOCAL_DIR_VARS` set, else the
    system's temporary directory."""
    for var in LOCAL_DIR_VARS:
        value = os.environ.get(var)
        if value:
            return Path(value)
    return Path(tempfile.gettempdir())


def _listing(source: Path) -> list[tuple[str, int, int]]:
    """(relative path, size, mtime_ns) of every file under ``source``, sorted."""
    if source.is_file():
        st = source.stat()
        return [(source.name, st.st_size, st.st_mtime_ns)]
    out = []
    for dirpath, _dirnames, filenames in os.walk(source):
        for name in filenames:
            path = Path(dirpath) / name
            st = path.stat()
            out.append((path.relative_to(source).as_posix(), st.st_size, st.st_mtime_ns))
    return sorted(out)


def _digest(source: Path, listing: list[tuple[str, int, int]]) -> str:
    h = hashlib.sha1(str(source).encode())
    for rel, size, mtime in listing:
        h.update(f"\0{rel}\0{size}\0{mtime}".encode())
    return h.hexdigest()[:12]


def _marker(dest: Path) -> Path:
    return dest.parent / MARKER.format(name=dest.name)


def _complete(dest: Path, digest: str) -> bool:
    try:
        marker = json.loads(_marker(dest).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("digest") == digest and dest.exists()


def _older_copies(root: Path, src: Path, digest: str) -> tuple[tuple[Path, ...], int]:
    """Complete copies under ``root`` of other versions of ``src``, and their bytes."""
    found, size = [], 0
    for marker in sorted(root.glob(MARKER.format(name=f"{src.name}-*"))):
        try:
            doc = json.loads(marker.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict) or doc.get("source") != str(src) or doc.get(
                "digest") == digest:
            continue
        copy = root / f"{src.name}-{doc.get('digest')}"
        if copy.exists():
            found.append(copy)
            size += int(doc.get("bytes") or 0)
    return tuple(found), size


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def stage(source: str | os.PathLike[str], to: str | os.PathLike[str] | None = None, *,
          threads: int = DEFAULT_THREADS,
          progress: Callable[[int, int], None] | None = None) -> Staged:
    """Copy ``source`` (a file or a folder) under ``to`` (default :func:`local_root`)
    once per node and version, and return where to read it from (module docstring).

    For a file the returned path is the copied file; for a folder, the copied folder.
    ``progress(done_bytes, total_bytes)`` is called as files complete. Raises
    :class:`~trainprof.errors.UsageError` (one line) for a missing source or too
    little room.
    """
    src = Path(os.path.abspath(source))
    if not src.exists():
        raise UsageError(f"no such file or folder: {source}")
    root = Path(os.path.abspath(to)) if to is not None else local_root()
    if src.is_dir() and root.resolve().is_relative_to(src.resolve()):
        raise UsageError(f"cannot stage {source} into {root}, a folder inside it")
    if root.exists() and not root.is_dir():
        raise UsageError(f"--to {to}: a file, not a folder to stage into")
    listing = _listing(src)
    total = sum(size for _, size, _ in listing)
    digest = _digest(src, listing)
    root.mkdir(parents=True, exist_ok=True)
    dest = root / f"{src.name}-{digest}"
    target = dest / src.name if src.is_file() else dest
    with open(root / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one rank copies; the others wait, then reuse
        older, older_bytes = _older_copies(root, src, digest)
        if _complete(dest, digest):
            return Staged(target, False, len(listing), total, older, older_bytes)
        for stale in root.glob(f"{dest.name}.partial-*"):
            _remove(stale)  # a copy a killed job left
        _remove(dest)  # a copy whose marker was never written
        free = shutil.disk_usage(root).free
        if free < total * (1 + HEADROOM):
            raise UsageError(
                f"not enough room in {root} to stage {source}: it needs "
                f"{total / 2**30:.2f} GiB (+{HEADROOM:.0%}), {free / 2**30:.2f} GiB are free "
                "(choose another place with to=... or TRAINPROF_STAGE_DIR)")
        partial = root / f"{dest.name}.partial-{os.getpid()}"
        try:
            _copy(src, partial, listing, threads, progress, total)
            partial.rename(dest)
            # last: a copy without its marker (killed after the rename) is made again
            _marker(dest).write_text(json.dumps({
                "source": str(src), "digest": digest, "files": len(listing), "bytes": total}))
        except BaseException:
            _remove(partial)
            raise
    return Staged(target, True, len(listing), total, older, older_bytes)


def _copy(src: Path, partial: Path, listing: list[tuple[str, int, int]], threads: int,
          progress: Callable[[int, int], None] | None, total: int) -> None:
    partial.mkdir(parents=True)
    base = src.parent if src.is_file() else src
    for rel in {str(Path(rel).parent) for rel, _, _ in listing}:
        (partial / rel).mkdir(parents=True, exist_ok=True)
    done = [0]
    lock = threading.Lock()

    def one(item: tuple[str, int, int]) -> None:
        rel, size, _ = item
        out = partial / rel
        shutil.copyfile(base / rel, out)
        if out.stat().st_size != size:
            raise OSError(f"{base / rel} changed while it was copied")
        with lock:
            done[0] += size
            if progress is not None:
                progress(done[0], total)

    # Ctrl-C between files, never inside the pool's locks (trainprof.fixes.interrupts);
    # then the copies not started are cancelled, not waited for
    with deferred_sigint() as check:
        pool = ThreadPoolExecutor(max_workers=max(1, threads))
        try:
            for _ in pool.map(one, listing):
                check()
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown()
