"""``trainprof stage`` / ``trainprof.fixes.stage``: data copied to local disk once per node
and version, shared by the node's ranks, complete or absent."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from pathlib import Path

import pytest
from conftest import trainprof

from trainprof.errors import UsageError
from trainprof.fixes import stage


def _source(tmp_path: Path) -> Path:
    src = tmp_path / "data"
    for k in range(3):
        (src / f"class{k}").mkdir(parents=True)
        for i in range(20):
            (src / f"class{k}" / f"{i}.bin").write_bytes(os.urandom(1000 + i))
    return src


def _same_tree(a: Path, b: Path) -> bool:
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    return files_a == files_b and all((a / f).read_bytes() == (b / f).read_bytes()
                                      for f in files_a)


def test_a_folder_is_copied_once_per_version(tmp_path):
    src, local = _source(tmp_path), tmp_path / "local"
    first = stage(src, local)
    assert first.copied and (first.files, first.bytes) == (60, 3 * sum(1000 + i
                                                                        for i in range(20)))
    assert _same_tree(src, first.path)  # exactly the source's files: the marker is beside
    again = stage(src, local)
    assert (again.path, again.copied) == (first.path, False)
    (src / "class1" / "3.bin").write_bytes(b"changed")  # a new version of the data
    changed = stage(src, local)
    assert changed.copied and changed.path != first.path
    assert (changed.path / "class1" / "3.bin").read_bytes() == b"changed"


def test_a_file_is_staged_as_a_file(tmp_path):
    src = tmp_path / "train.bin"
    src.write_bytes(b"x" * 5000)
    got = stage(src, tmp_path / "local")
    assert got.path.name == "train.bin" and got.path.read_bytes() == src.read_bytes()


def _stage_in_child(args: tuple[str, str]) -> tuple[str, bool]:
    got = stage(args[0], args[1], threads=1)
    return str(got.path), got.copied


def test_the_ranks_of_a_node_share_one_copy(tmp_path):
    src, local = _source(tmp_path), tmp_path / "local"
    with multiprocessing.get_context("fork").Pool(4) as pool:
        results = pool.map(_stage_in_child, [(str(src), str(local))] * 4)
    assert len({path for path, _ in results}) == 1
    assert sorted(copied for _, copied in results) == [False, False, False, True]
    assert [p.name for p in local.iterdir() if not p.name.startswith(".")] == [
        Path(results[0][0]).name]


def test_what_a_killed_job_left_is_replaced(tmp_path):
    src, local = _source(tmp_path), tmp_path / "local"
    first = stage(src, local)
    marker = local / f".{first.path.name}.staged.json"
    marker.unlink()  # killed between the rename and the marker: not a complete copy
    stale = local / f"{first.path.name}.partial-999999"
    stale.mkdir()
    (stale / "half.bin").write_bytes(b"...")
    again = stage(src, local)
    assert again.copied and again.path == first.path and marker.exists()
    assert not stale.exists()
    assert _same_tree(src, again.path)


def test_a_failed_copy_leaves_nothing(tmp_path, monkeypatch):
    src, local = _source(tmp_path), tmp_path / "local"
    calls = []
    real = shutil.copyfile

    def flaky(a, b, *args, **kwargs):
        calls.append(a)
        if len(calls) == 10:
            raise OSError("the network storage went away")
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(shutil, "copyfile", flaky)
    with pytest.raises(OSError, match="went away"):
        stage(src, local, threads=1)
    assert [p.name for p in local.iterdir() if not p.name.endswith(".lock")] == []


def test_no_room_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    src, local = _source(tmp_path), tmp_path / "local"
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=10_000))
    with pytest.raises(UsageError, match=r"not enough room in .* it needs 0\.00 GiB"):
        stage(src, local)
    assert [p.name for p in local.iterdir() if not p.name.endswith(".lock")] == []


def test_the_command_prints_the_local_path(tmp_path):
    src = _source(tmp_path)
    res = trainprof("stage", str(src), "--to", str(tmp_path / "local"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    path = Path(res.stdout.strip())
    assert _same_tree(src, path)
    assert "trainprof: staged 60 files" in res.stderr
    res = trainprof("stage", str(src), "--to", str(tmp_path / "local"), cwd=tmp_path)
    assert res.stdout.strip() == str(path) and "reusing the copy" in res.stderr
    res = trainprof("stage", str(src), "--to", str(src / "class0"), cwd=tmp_path)
    assert res.returncode == 2 and "a folder inside it" in res.stderr
    (tmp_path / "afile").write_text("x")  # --to naming a file: one line, not a traceback
    res = trainprof("stage", str(src), "--to", str(tmp_path / "afile"), cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.strip() == (
        f"error: --to {tmp_path / 'afile'}: a file, not a folder to stage into")
    res = trainprof("stage", str(tmp_path / "nope"), cwd=tmp_path)
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr.strip() == f"error: no such file or folder: {tmp_path / 'nope'}"
    (tmp_path / "empty").mkdir()  # staged, and said: a job would train on nothing
    res = trainprof("stage", str(tmp_path / "empty"), "--to", str(tmp_path / "local"),
                    cwd=tmp_path)
    assert res.returncode == 0 and Path(res.stdout.strip()).is_dir()
    assert "staged 0 files" in res.stderr
    assert f"warning: {tmp_path / 'empty'} holds no files" in res.stderr
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "a.bin").write_bytes(b"x")
    res = trainprof("stage", str(tmp_path / "one"), "--to", str(tmp_path / "local"),
                    cwd=tmp_path)
    assert "staged 1 file," in res.stderr and "warning" not in res.stderr
    first = Path(res.stdout.strip())
    (tmp_path / "one" / "b.bin").write_bytes(b"yy")  # a new version: a fresh copy, and the
    res = trainprof("stage", str(tmp_path / "one"), "--to", str(tmp_path / "local"),
                    "--json", cwd=tmp_path)  # earlier one named, not removed (a job may read it)
    doc = json.loads(res.stdout)
    assert doc["copied"] and doc["older_copies"] == [str(first)] and doc["older_bytes"] == 1
    assert first.is_dir()
    res = trainprof("stage", str(tmp_path / "one"), "--to", str(tmp_path / "local"),
                    cwd=tmp_path)
    assert "reusing the copy" in res.stderr
    assert (f"1 copy of an earlier version of {tmp_path / 'one'} stays beside it (0.0 MiB); "
            f"once no job reads it: rm -rf {first}") in res.stderr


def test_ctrl_c_is_taken_between_items_and_the_handler_restored():
    import signal
    import time

    from trainprof.fixes.interrupts import deferred_sigint

    with pytest.raises(KeyboardInterrupt), deferred_sigint() as check:
        check()  # nothing yet
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the handler has run: no exception inside the block's work
        check()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
