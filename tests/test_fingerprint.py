"""Tests for the environment fingerprint (real git, real torch, no mocks except forced failures)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy
import orjson
import pytest
import torch

from trainprof.capture import fingerprint as fp
from trainprof.capture.fingerprint import collect_fingerprint

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")


def _git(repo: Path, *args: str) -> str:
    cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    done = subprocess.run(
        [*cmd, *args], cwd=repo, check=True, capture_output=True, text=True, timeout=10
    )
    return done.stdout.strip()


@pytest.fixture
def isolated_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temp dir that git will never resolve to an enclosing repository."""
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    work = tmp_path / "work"
    work.mkdir()
    return work


@pytest.fixture
def git_repo(isolated_tmp: Path) -> Path:
    _git(isolated_tmp, "init", "-q")
    (isolated_tmp / "train.py").write_text("print('train')\n")
    _git(isolated_tmp, "add", "train.py")
    _git(isolated_tmp, "commit", "-q", "-m", "initial")
    return isolated_tmp


@needs_git
def test_git_commit_and_dirty_flag(git_repo: Path) -> None:
    script = git_repo / "train.py"
    head = _git(git_repo, "rev-parse", "HEAD")

    clean = collect_fingerprint(str(script), ["python", str(script)])["git"]
    assert clean is not None
    assert clean["commit"] == head
    assert clean["dirty"] is False
    assert Path(clean["root"]).resolve() == git_repo.resolve()
    assert clean["branch"] == _git(git_repo, "symbolic-ref", "--short", "HEAD")

    (git_repo / "untracked.txt").write_text("scratch")  # untracked files do not count
    assert collect_fingerprint(str(script), [])["git"]["dirty"] is False

    script.write_text("print('changed')\n")
    assert collect_fingerprint(str(script), [])["git"]["dirty"] is True


@needs_git
def test_git_none_outside_work_tree(isolated_tmp: Path) -> None:
    script = isolated_tmp / "train.py"
    script.write_text("pass\n")
    result = collect_fingerprint(str(script), [])
    assert result["git"] is None
    assert result["notes"] == []
    assert collect_fingerprint(None, [])["git"] is None


def test_git_missing_gives_null_and_note(
    isolated_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = isolated_tmp / "train.py"
    script.write_text("pass\n")
    monkeypatch.setenv("PATH", str(isolated_tmp))  # no git executable reachable
    result = collect_fingerprint(str(script), [])
    assert result["git"] is None
    assert any(note.startswith("git") for note in result["notes"])


def test_command_and_basic_fields() -> None:
    argv = ["python", "train.py", "--lr", "0.1"]
    result = collect_fingerprint(None, argv)
    assert result["command"] == argv
    assert result["cwd"] == os.getcwd()
    assert result["python"]["executable"] == sys.executable
    assert result["torch"]["version"] == torch.__version__
    assert result["torch"]["cuda_available"] == torch.cuda.is_available()
    if not torch.cuda.is_available():
        assert result["gpus"] == []
    assert result["threads"]["torch_num_threads"] == torch.get_num_threads()


def test_threads_env_reflects_omp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    env = collect_fingerprint(None, [])["threads"]["env"]
    assert env["OMP_NUM_THREADS"] == "3"
    assert "MKL_NUM_THREADS" not in env


def test_collective_and_slurm_settings_are_in_the_fingerprint_and_compared(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from trainprof.analysis.compare import _env_category

    monkeypatch.setenv("NCCL_ALGO", "Ring")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "8")
    monkeypatch.setenv("SLURM_JOB_ID", "123")  # an id, not a setting: left out
    env = collect_fingerprint(None, [])["threads"]["env"]
    assert (env["NCCL_ALGO"], env["SLURM_CPUS_PER_TASK"]) == ("Ring", "8")
    assert "SLURM_JOB_ID" not in env
    assert _env_category("SLURM_CPUS_PER_TASK") == "cpu"


def test_packages_versions() -> None:
    import importlib.metadata

    packages = collect_fingerprint(None, [])["packages"]
    # the installed distribution's version, as pip lists it: PyPI's CUDA wheel is "2.13.0"
    # where torch.__version__ says "2.13.0+cu130" (the local CPU build has "+cpu" in both)
    assert packages["torch"] == importlib.metadata.version("torch")
    assert packages["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert packages["numpy"] == numpy.__version__
    try:  # an installed trainprof is listed (not one run from a source tree's PYTHONPATH)
        assert packages["trainprof"] == importlib.metadata.version("trainprof")
    except importlib.metadata.PackageNotFoundError:
        assert "trainprof" not in packages
    assert "not-a-real-package" not in packages


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no sched_getaffinity")
def test_usable_cores_matches_affinity() -> None:
    cpu = collect_fingerprint(None, [])["cpu"]
    assert cpu["usable_cores"] == len(os.sched_getaffinity(0))
    assert cpu["logical_cores"] == os.cpu_count()
    assert cpu["memory_total_bytes"] > 0


def test_orjson_round_trip() -> None:
    result = collect_fingerprint(__file__, ["a", "b"])
    assert orjson.loads(orjson.dumps(result)) == result


def test_fast_enough() -> None:
    collect_fingerprint(__file__, [])  # warm-up: first metadata scan / imports
    start = time.perf_counter()
    collect_fingerprint(__file__, [])
    assert time.perf_counter() - start < 1.0


def _boom() -> None:
    raise RuntimeError("forced failure")


def test_failing_probe_becomes_null_and_note(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp, "_cpu_model", _boom)
    monkeypatch.setattr(fp, "_packages", _boom)
    result = collect_fingerprint(__file__, [])
    assert result["cpu"]["model"] is None
    assert result["cpu"]["logical_cores"] == os.cpu_count()  # sibling fields unaffected
    assert result["packages"] == {}
    assert any(n.startswith("cpu.model: RuntimeError: forced failure") for n in result["notes"])
    assert any(n.startswith("packages: RuntimeError") for n in result["notes"])


def test_failing_section_and_torch_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp, "_git_info", lambda *_: _boom())
    monkeypatch.setattr(fp, "_import_torch", _boom)
    result = collect_fingerprint(__file__, [])
    assert result["git"] is None
    assert result["torch"] is None
    assert result["gpus"] == []
    assert result["threads"]["torch_num_threads"] is None
    assert any(n.startswith("git: RuntimeError") for n in result["notes"])
    assert any(n.startswith("torch: import: RuntimeError") for n in result["notes"])
    orjson.dumps(result)


@pytest.mark.parametrize(
    ("text", "cores"),
    [("max 100000\n", None), ("200000 100000\n", 2.0), ("50000 100000", 0.5), ("", None)],
)
def test_parse_cpu_max(text: str, cores: float | None) -> None:
    assert fp._parse_cpu_max(text) == cores


def test_gpus_of_a_script_that_never_initialised_cuda_come_from_nvml(monkeypatch) -> None:
    """torch.cuda.get_device_properties initialises CUDA: on a GPU machine a CPU-only
    script then had a CUDA context and device timing it never asked for (H100,
    2026-11-26). Before the script initialises CUDA, NVML names the GPUs."""
    import importlib.machinery
    import types

    class NoInit:
        @staticmethod
        def is_initialized() -> bool:
            return False

        @staticmethod
        def get_device_properties(index):
            raise AssertionError("this would initialise CUDA")

    fake_torch = types.SimpleNamespace(cuda=NoInit)
    nvml = types.ModuleType("pynvml")
    nvml.__spec__ = importlib.machinery.ModuleSpec("pynvml", None)
    calls = []
    nvml.nvmlInit = lambda: calls.append("init")
    nvml.nvmlShutdown = lambda: calls.append("shutdown")
    nvml.nvmlDeviceGetCount = lambda: 2
    nvml.nvmlDeviceGetHandleByIndex = lambda i: i
    nvml.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3" if h == 0 else "NVIDIA L4"
    nvml.nvmlDeviceGetCudaComputeCapability = lambda h: (9, 0) if h == 0 else (8, 9)
    nvml.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=(80 - 56 * h) * 2**30)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    gpus = fp._gpus(fake_torch)
    assert gpus == [
        {"index": 0, "name": "NVIDIA H100 80GB HBM3", "total_memory_bytes": 80 * 2**30,
         "capability": "9.0", "source": "nvml"},
        {"index": 1, "name": "NVIDIA L4", "total_memory_bytes": 24 * 2**30,
         "capability": "8.9", "source": "nvml"},
    ]
    assert calls == ["init", "shutdown"]
    monkeypatch.delitem(sys.modules, "pynvml")
    monkeypatch.setattr(fp.importlib.util, "find_spec", lambda name: None)
    assert fp._gpus(fake_torch) == []  # no nvidia-ml-py: no names, still no CUDA


def test_cudnn_version_is_not_read_before_the_script_initialises_cuda() -> None:
    """torch.backends.cudnn.version() initialises CUDA (it checks the GPU's capability):
    read only once the script has CUDA up."""
    import types

    state = {"initialised": False}

    def version() -> int:
        assert state["initialised"], "this would initialise CUDA"
        return 91002

    fake = types.SimpleNamespace(
        __version__="2.11.0", version=types.SimpleNamespace(cuda="13.0"),
        cuda=types.SimpleNamespace(is_initialized=lambda: state["initialised"],
                                   is_available=lambda: True),
        backends=types.SimpleNamespace(cudnn=types.SimpleNamespace(
            is_available=lambda: True, version=version, benchmark=False,
            deterministic=False)),
    )
    notes = fp._Notes()
    info = fp._torch_info(fake, notes)
    assert info["cudnn"] is None and info["cuda_available"] is True and notes.items == []
    state["initialised"] = True
    assert fp._torch_info(fake, notes)["cudnn"] == 91002 and notes.items == []
