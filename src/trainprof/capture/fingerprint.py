"""Environment fingerprint recorded with every profiled training run.

When a run "got slower after an upgrade", the first question is *what changed*. This module
collects, cheaply and without ever raising, the facts that most often explain a change in
training throughput: library versions (torch, CUDA, cuDNN, data-loading stack), the hardware
and how much of it the process may actually use (affinity masks, cgroup quotas), threading
knobs, and the code revision being run. Two fingerprints can then be diffed key by key.

Design rules:

* **Never raise.** Every probe is guarded; a failing probe yields ``None`` and a short message
  in ``notes``. A profiler that crashes the run it is measuring is worse than no profiler.
* **Be fast and side-effect free.** No CUDA context is created beyond what ``torch.cuda``
  queries need, git is called with a short timeout and ``GIT_OPTIONAL_LOCKS=0``, package
  versions come from a single metadata scan, and nothing reads stdin.
* **JSON only.** Values are ``str``/``int``/``float``/``bool``/``None``/lists/dicts.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

T = TypeVar("T")

GIT_TIMEOUT_S = 2.0

#: Distributions whose version can change training speed. Keys are the names reported.
TRACKED_PACKAGES: tuple[str, ...] = (
    "torch",
    "numpy",
    "pillow",
    "pillow-simd",
    "torchvision",
    "torchaudio",
    "transformers",
    "accelerate",
    "datasets",
    "timm",
    "lightning",
    "pytorch-lightning",
    "deepspeed",
    "apex",
    "triton",
    "ffcv",
    "webdataset",
    "litdata",
    "mosaicml-streaming",
    "h5py",
    "lmdb",
    "opencv-python",
    "opencv-python-headless",
    "scipy",
    "psutil",
    "trainprof",
)

#: Distribution-name prefixes tracked as a family (e.g. nvidia-dali-cuda120).
TRACKED_PREFIXES: tuple[str, ...] = ("nvidia-dali-",)

#: Environment variables that change threading, device visibility, allocation, kernel choice
#: or collectives.
TRACKED_ENV_VARS: tuple[str, ...] = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "TORCH_NUM_THREADS",
    "OMP_PROC_BIND",
    "OMP_PLACES",
    "KMP_AFFINITY",
    "KMP_BLOCKTIME",
    "OMP_WAIT_POLICY",
    "GOMP_SPINCOUNT",
    "GOMP_CPU_AFFINITY",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_LAUNCH_BLOCKING",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "CUDA_MODULE_LOADING",
    "CUBLAS_WORKSPACE_CONFIG",
    "NVIDIA_TF32_OVERRIDE",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
    "PYTORCH_NVML_BASED_CUDA_CHECK",
    "PYTORCH_NO_CUDA_MEMORY_CACHING",
    "TORCHINDUCTOR_MAX_AUTOTUNE",
    "TORCHINDUCTOR_CACHE_DIR",
    "TORCH_LOGS",
    "LD_PRELOAD",
    # collectives of a run of several ranks: algorithm, transport, interfaces, error handling
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_IB_DISABLE",
    "NCCL_P2P_DISABLE",
    "NCCL_P2P_LEVEL",
    "NCCL_SHM_DISABLE",
    "NCCL_NET_GDR_LEVEL",
    "NCCL_SOCKET_IFNAME",
    "NCCL_MIN_NCHANNELS",
    "NCCL_MAX_NCHANNELS",
    "NCCL_BUFFSIZE",
    "NCCL_NTHREADS",
    "NCCL_DEBUG",
    "GLOO_SOCKET_IFNAME",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_BLOCKING_WAIT",
    "TORCH_NCCL_HIGH_PRIORITY",
    # the cores SLURM gives each task (its cgroup and affinity set the usable cores)
    "SLURM_CPUS_PER_TASK",
)


#: Variables that decide what a command imports and how its interpreter runs: the
#: search path (a relative ``PYTHONPATH`` is read from the folder the command ran in), the
#: shared libraries found (which cuDNN, NCCL, BLAS), and the interpreter's own modes (asserts
#: on or off, the debug allocator, dev mode's extra checks). With :data:`TRACKED_ENV_VARS`
#: they are the launch setting ``trainprof verify`` reproduces for its trials.
LAUNCH_ENV_VARS: tuple[str, ...] = (
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONOPTIMIZE",
    "PYTHONMALLOC",
    "PYTHONDEVMODE",
    "LD_LIBRARY_PATH",
)


def launch_environment() -> dict[str, str | None]:
    """Every variable of :data:`TRACKED_ENV_VARS` and :data:`LAUNCH_ENV_VARS`, its value or
    ``None`` where unset: read as the command starts (before the script can set any), so
    that a rerun (``trainprof verify``'s trials) can set and unset each as it was. Unset
    ones are named too: "not set" is a setting (OpenMP then takes every core)."""
    return {name: os.environ.get(name) for name in (*TRACKED_ENV_VARS, *LAUNCH_ENV_VARS)}


class _Notes:
    """Collects messages from failed probes; ``run`` is the single guard used everywhere."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, message: str) -> None:
        self.items.append(message)

    def run(self, name: str, probe: Callable[[], T], default: T | None = None) -> T | None:
        """Call ``probe``; on any exception record ``name: error`` and return ``default``."""
        try:
            return probe()
        except Exception as exc:  # a fingerprint must never raise
            self.add(f"{name}: {type(exc).__name__}: {exc}"[:300])
            return default


def _norm(name: str) -> str:
    """PEP 503 normalisation so ``Pillow``, ``pillow`` and ``opencv_python`` all match."""
    return re.sub(r"[-_.]+", "-", name).lower()


# --------------------------------------------------------------------------- small probes


def _python_info() -> dict[str, Any]:
    """Interpreter version/implementation: e.g. 3.11 -> 3.12 changes dataloader overheads."""
    return {
        "version": platform.python_version(),
        "implementation": platform.python_implementation(),
        "executable": sys.executable,
    }


def _platform_info() -> dict[str, Any]:
    """OS and kernel release: kernel/driver upgrades change I/O and scheduling behaviour."""
    return {
        "system": platform.system(),
        "release": platform.release(),
        "machine": platform.machine(),
    }


def _import_torch() -> ModuleType:
    """Torch is normally already imported by the training script, so this is a dict lookup."""
    import torch

    return torch


def _torch_info(torch: ModuleType, notes: _Notes) -> dict[str, Any]:
    """Torch build: CUDA/cuDNN/HIP versions pick kernels; a debug build is far slower."""
    version = getattr(torch, "version", None)

    def cudnn() -> int | None:
        # torch.backends.cudnn.version() checks the cuDNN build against the GPU's compute
        # capability (torch 2.11), which initialises CUDA: on an H100 machine a CPU-only
        # script got a CUDA context from this read alone (2026-11-26). A script that never
        # initialised CUDA runs no cuDNN kernel: its version is left out.
        if not torch.cuda.is_initialized():
            return None
        backend = torch.backends.cudnn
        return int(backend.version()) if backend.is_available() else None

    def onednn() -> bool | None:
        backend = getattr(getattr(torch, "backends", None), "mkldnn", None)
        return None if backend is None else bool(backend.is_available() and backend.enabled)

    return {
        "version": notes.run("torch.version", lambda: str(torch.__version__)),
        "cuda": getattr(version, "cuda", None),
        "cudnn": notes.run("torch.cudnn", cudnn),
        "cuda_available": notes.run(
            "torch.cuda_available", lambda: bool(torch.cuda.is_available())
        ),
        # cuDNN's autotuner and determinism: global flags (no CUDA initialised to read
        # them), as the script set them before its first step
        "cudnn_benchmark": notes.run(
            "torch.cudnn_benchmark", lambda: bool(torch.backends.cudnn.benchmark)),
        "cudnn_deterministic": notes.run(
            "torch.cudnn_deterministic", lambda: bool(torch.backends.cudnn.deterministic)),
        # oneDNN, which runs CPU convolutions (and prefers NHWC: diagnosis/channels_last_cpu.py)
        "mkldnn": notes.run("torch.mkldnn", onednn),
        "hip": getattr(version, "hip", None),
        "debug": getattr(version, "debug", None),
        "git_version": getattr(version, "git_version", None),
    }


def _gpus(torch: ModuleType) -> list[dict[str, Any]]:
    """Visible GPUs: a different model or memory size explains most cross-machine deltas.

    Read from torch only where the script has initialised CUDA itself:
    ``torch.cuda.get_device_properties`` initialises it, and on a GPU machine a
    CPU-only script then carried a CUDA context it never asked for, and trainprof's
    device timer (which starts once CUDA is up) timed its phases on a GPU it never
    used (seen on an H100 machine, 2026-11-26). Otherwise NVML names the GPUs,
    without a context.
    """
    if not torch.cuda.is_initialized():
        return _gpus_nvml()
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append(
            {
                "index": index,
                "name": str(props.name),
                "total_memory_bytes": int(props.total_memory),
                "capability": f"{props.major}.{props.minor}",
                # fewer than the model's full count: a MIG slice (analysis/datasheet_peaks.py)
                "multiprocessors": int(props.multi_processor_count),
            }
        )
    return gpus


def _gpus_nvml() -> list[dict[str, Any]]:
    """The machine's GPUs through NVML (no CUDA context); [] without nvidia-ml-py.

    NVML numbers every GPU of the machine, whatever ``CUDA_VISIBLE_DEVICES`` hides
    from the script, so each entry says ``"source": "nvml"``.
    """
    if importlib.util.find_spec("pynvml") is None:
        return []
    import pynvml

    pynvml.nvmlInit()
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            gpus.append(
                {
                    "index": index,
                    "name": name.decode() if isinstance(name, bytes) else str(name),
                    "total_memory_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                    "capability": f"{major}.{minor}",
                    "source": "nvml",
                }
            )
        return gpus
    finally:
        pynvml.nvmlShutdown()


def _driver_version_nvml() -> str:
    """Driver version through NVML (package ``nvidia-ml-py``), imported only when needed."""
    import pynvml

    pynvml.nvmlInit()
    try:
        version = pynvml.nvmlSystemGetDriverVersion()
    finally:
        pynvml.nvmlShutdown()
    return version.decode() if isinstance(version, bytes) else str(version)


def _driver_version_proc() -> str | None:
    """Fallback without pynvml: the kernel module version line on Linux."""
    text = Path("/proc/driver/nvidia/version").read_text()
    match = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", text)
    return match.group(1) if match else None


def _driver_version(cuda_available: bool, notes: _Notes) -> str | None:
    """NVIDIA driver: driver upgrades change kernel launch cost and CUDA compatibility."""
    has_pynvml = importlib.util.find_spec("pynvml") is not None
    if not cuda_available and not has_pynvml:
        return None
    if has_pynvml:
        try:
            return _driver_version_nvml()
        except Exception as exc:  # NVML missing/broken: try /proc next
            if cuda_available:
                notes.add(f"driver_version: pynvml: {type(exc).__name__}: {exc}")
    if cuda_available:
        return notes.run("driver_version", _driver_version_proc)
    return None


def _cpu_model() -> str | None:
    """CPU model name; a different CPU generation changes data-loading and augmentation cost."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


#: Native bfloat16 instructions, best first (Linux's /proc/cpuinfo flag names): AMX tiles
#: (Sapphire Rapids on), AVX-512 BF16 dot products (Cooper Lake, AMD Zen 4 on).
BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def _cpu_bf16(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The CPU's best native bfloat16 instructions (a ``BF16_FLAGS`` name), or None.

    Without them torch computes bfloat16 on the CPU by conversions, often slower than
    float32 (diagnosis/precision.py asks for them before proposing autocast). Linux only:
    elsewhere None, unknown.
    """
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return next((f for f in BF16_FLAGS if f in flags), None)
    except OSError:
        pass
    return None


def _usable_cores() -> int | None:
    """CPUs in the affinity mask: taskset/Slurm/containers can hide cores from dataloaders."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return len(os.sched_getaffinity(0))


def _parse_cpu_max(text: str) -> float | None:
    """Parse cgroup v2 ``cpu.max`` ("quota period" or "max period") into a core count."""
    parts = text.split()
    if not parts or parts[0] == "max":
        return None
    period = int(parts[1]) if len(parts) > 1 else 100_000
    return int(parts[0]) / period


def _own_cgroup_v2_path() -> str:
    """This process's cgroup v2 path ("0::/path" line), or "/" when unknown."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                return line[3:].strip() or "/"
    except OSError:
        pass
    return "/"


def _cgroup_cpu_limit() -> float | None:
    """CPU quota in cores: a quota below the core count throttles workers (looks like I/O wait).

    Reads cgroup v2 ``cpu.max`` (own cgroup first, then the root of the mount, which is what a
    container sees), then falls back to cgroup v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``.
    ``None`` means no limit (or no cgroup information).
    """
    root = Path("/sys/fs/cgroup")
    own = root / _own_cgroup_v2_path().lstrip("/") / "cpu.max"
    for candidate in (own, root / "cpu.max"):
        if candidate.is_file():
            return _parse_cpu_max(candidate.read_text())
    v1 = root / "cpu"
    quota_file, period_file = v1 / "cpu.cfs_quota_us", v1 / "cpu.cfs_period_us"
    if quota_file.is_file() and period_file.is_file():
        quota = int(quota_file.read_text())
        return quota / int(period_file.read_text()) if quota > 0 else None
    return None


def _physical_cores() -> int | None:
    import psutil

    return psutil.cpu_count(logical=False)


def _memory_total() -> int:
    """Host RAM: too little forces page-cache misses when the dataset no longer fits."""
    import psutil

    return int(psutil.virtual_memory().total)


def _cpu_info(notes: _Notes) -> dict[str, Any]:
    """CPU capacity actually available to this process (host, affinity mask and cgroup)."""
    return {
        "model": notes.run("cpu.model", _cpu_model),
        "logical_cores": notes.run("cpu.logical_cores", os.cpu_count),
        "physical_cores": notes.run("cpu.physical_cores", _physical_cores),
        "usable_cores": notes.run("cpu.usable_cores", _usable_cores),
        "cgroup_cpu_limit": notes.run("cpu.cgroup_cpu_limit", _cgroup_cpu_limit),
        "memory_total_bytes": notes.run("cpu.memory_total_bytes", _memory_total),
        "bf16": notes.run("cpu.bf16", _cpu_bf16),
    }


def _thread_env() -> dict[str, str]:
    """Threading / device / allocator / collective env vars that are set (unset: omitted)."""
    return {name: os.environ[name] for name in TRACKED_ENV_VARS if name in os.environ}


def _threads_info(torch: ModuleType | None, notes: _Notes) -> dict[str, Any]:
    """Intra/inter-op thread counts: oversubscription with dataloader workers is a top cause
    of CPU-side slowdowns. Reading them does not prevent a later ``set_num_*_threads``."""
    intra = interop = None
    if torch is not None:
        intra = notes.run("threads.torch_num_threads", torch.get_num_threads)
        interop = notes.run("threads.torch_num_interop_threads", torch.get_num_interop_threads)
    return {
        "torch_num_threads": intra,
        "torch_num_interop_threads": interop,
        "env": notes.run("threads.env", _thread_env, default={}),
    }


def _dist_name(dist: importlib.metadata.Distribution) -> str:
    """Distribution name, preferring the one derived from the ``.dist-info`` directory name,
    which avoids parsing METADATA (~0.7 ms each) for every installed package."""
    name = getattr(dist, "_normalized_name", None)
    if not isinstance(name, str) or not name:
        name = dist.metadata["Name"] or ""
    return _norm(name)


def _packages() -> dict[str, str]:
    """Versions of the libraries that matter for training speed, only those installed.

    One ``distributions()`` scan (first match on ``sys.path`` wins, as for imports), reading
    METADATA only for the tracked ones; this also covers prefix families such as DALI.
    """
    wanted = {_norm(name): name for name in TRACKED_PACKAGES}
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = _dist_name(dist)
        key = wanted.get(name) or (name if name.startswith(TRACKED_PREFIXES) else None)
        if key is None or key in found:
            continue
        version = dist.version
        if version:
            found[key] = str(version)
    return dict(sorted(found.items()))


# --------------------------------------------------------------------------------- git


def _git(args: list[str], cwd: str) -> subprocess.CompletedProcess[str]:
    """Run git; FileNotFoundError when it is not on the PATH.

    git is looked up here, not by ``subprocess``: given a bare name, ``subprocess`` searches
    ``os.get_exec_path()``, which enters ``warnings.catch_warnings()``. That resets the
    once-per-location memory of every module's warnings (``__warningregistry__``), and this
    runs on the recorder's thread in the middle of the script's steps: a warning the script
    had already shown once showed again."""
    env = dict(os.environ, GIT_OPTIONAL_LOCKS="0", GIT_TERMINAL_PROMPT="0", LC_ALL="C")
    exe = shutil.which("git", path=env.get("PATH", os.defpath))
    if exe is None:
        raise FileNotFoundError("git")
    return subprocess.run(
        [exe, *args],
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=GIT_TIMEOUT_S,
        env=env,
        check=False,
    )


def _stdout(proc: subprocess.CompletedProcess[str]) -> str | None:
    """Stripped stdout of a successful git call, else ``None`` (e.g. no commit yet)."""
    out = proc.stdout.strip()
    return out if proc.returncode == 0 and out else None


def _script_dir(script_path: str) -> str | None:
    path = Path(script_path).expanduser().resolve()
    directory = path if path.is_dir() else path.parent
    return str(directory) if directory.is_dir() else None


def _git_info(script_path: str | None, notes: _Notes) -> dict[str, Any] | None:
    """Code revision of the training script: the first suspect when a run changes speed.

    ``dirty`` reflects tracked files only (untracked scratch files are ignored).
    """
    if not script_path:
        return None
    cwd = _script_dir(script_path)
    if cwd is None:
        return None
    try:
        top = _git(["rev-parse", "--show-toplevel"], cwd)
    except FileNotFoundError:
        notes.add("git: executable not found")
        return None
    if top.returncode != 0:
        if "dubious ownership" in top.stderr:
            notes.add("git: repository ownership check failed (safe.directory)")
        return None
    head = _git(["rev-parse", "--verify", "-q", "HEAD"], cwd)
    branch = _git(["symbolic-ref", "--short", "-q", "HEAD"], cwd)
    status = _git(["status", "--porcelain", "--untracked-files=no"], cwd)
    dirty: bool | None = bool(status.stdout.strip()) if status.returncode == 0 else None
    if dirty is None:
        notes.add(f"git.dirty: git status failed: {status.stderr.strip()[:200]}")
    return {
        "commit": _stdout(head),
        "branch": _stdout(branch),
        "dirty": dirty,
        "root": _stdout(top),
    }


# ----------------------------------------------------------------------------- public API


def collect_fingerprint(script_path: str | None, argv: list[str]) -> dict[str, Any]:
    """Collect the environment fingerprint of this process; never raises.

    Args:
        script_path: the training script being profiled; its directory decides ``git``.
        argv: the exact command line, recorded verbatim as ``command``.

    Call it after the script has set ``CUDA_VISIBLE_DEVICES`` etc.: when CUDA is present,
    ``torch.cuda`` queries initialise the driver, which freezes device visibility.
    """
    notes = _Notes()
    torch = notes.run("torch: import", _import_torch)
    torch_info = notes.run("torch", lambda: _torch_info(torch, notes)) if torch else None
    cuda_available = bool(torch_info and torch_info.get("cuda_available"))
    gpus = notes.run("gpus", lambda: _gpus(torch), default=[]) if cuda_available else []
    return {
        "command": notes.run("command", lambda: [str(arg) for arg in argv]),
        "cwd": notes.run("cwd", os.getcwd),
        "python": notes.run("python", _python_info),
        "platform": notes.run("platform", _platform_info),
        "hostname": notes.run("hostname", socket.gethostname),
        "torch": torch_info,
        "gpus": gpus,
        "driver_version": notes.run(
            "driver_version", lambda: _driver_version(cuda_available, notes)
        ),
        "cpu": notes.run("cpu", lambda: _cpu_info(notes)),
        "threads": notes.run("threads", lambda: _threads_info(torch, notes)),
        "packages": notes.run("packages", _packages, default={}),
        "git": notes.run("git", lambda: _git_info(script_path, notes)),
        "notes": notes.items,
    }
