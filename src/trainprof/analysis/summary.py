"""One Run, summarised: the document `trainprof run --json` and `trainprof report --json` print.

Everything a renderer shows is computed here, so the terminal, JSON and HTML
outputs cannot disagree.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime
from typing import Any

import numpy as np

from trainprof.analysis.attention import model_scale, summarize_attention
from trainprof.analysis.checkpointing import summarize_checkpointing
from trainprof.analysis.compiles import summarize_compiles
from trainprof.analysis.compute_efficiency import compute_efficiency
from trainprof.analysis.crash import summarize_crash
from trainprof.analysis.ddp import summarize_ddp
from trainprof.analysis.deep import analyse_deep_windows
from trainprof.analysis.device import device_seconds_per_step, device_statistics
from trainprof.analysis.handoff import summarize_handoff
from trainprof.analysis.iterations import steps_per_iteration
from trainprof.analysis.loop_stacks import summarize_loop_stacks
from trainprof.analysis.memory_growth import memory_growth, worker_starts
from trainprof.analysis.ops import load_ops, summarize_op_time
from trainprof.analysis.padding import batch_tensors, summarize_padding
from trainprof.analysis.python_profile import summarize_python_profile
from trainprof.analysis.steps import complete_steps, step_statistics
from trainprof.analysis.system import load_samples, outside_cores_during, summarize_system
from trainprof.analysis.workers import load_worker_files, summarize_workers
from trainprof.store import Run


def _duration_s(meta: dict[str, Any]) -> float | None:
    try:
        start = datetime.fromisoformat(meta["started_at"])
        end = datetime.fromisoformat(meta["ended_at"])
    except (KeyError, TypeError, ValueError):
        return None
    return (end - start).total_seconds()


def _regions(events: list[dict[str, Any]], steady: np.ndarray) -> dict[str, dict[str, float]]:
    """Each named region's calls and wall time (``total_s``: from its start to its end,
    whatever ran inside), and the wall time of those that began in the ``steady`` steps as
    a share of their time (``steady_share``: what the region costs the steady state; the
    breakdown's region share counts only the time no training phase claimed, see
    :func:`_region_notes`)."""
    out: dict[str, dict[str, float]] = defaultdict(
        lambda: {"count": 0, "total_s": 0.0, "steady_share": 0.0})
    starts, ends = steady["t_start_ns"], steady["t_start_ns"] + steady["dur_ns"]
    steady_ns = float(steady["dur_ns"].sum()) if len(steady) else 0.0
    for ev in events:
        if ev.get("kind") == "region":
            r = out[str(ev.get("name"))]
            r["count"] += 1
            r["total_s"] += ev.get("dur_ns", 0) / 1e9
            # begun in a steady step (not in a warm-up step, nor one a tool's window took)
            t = int(ev.get("t_start_ns", -1))
            i = int(np.searchsorted(starts, t, side="right")) - 1
            if steady_ns > 0 and i >= 0 and t < ends[i]:
                r["steady_share"] += ev.get("dur_ns", 0) / steady_ns
    return dict(out)


def _region_notes(events: list[dict[str, Any]], steps: np.ndarray) -> list[str]:
    """Regions whose wall time is well above what the steps count as region time: say why.

    A region's time in the step records is exclusive, like every phase's: what ran inside
    it at top level and the forward calls it made (an evaluation's forward passes are the
    evaluation) count as region, but data waits, backward passes, optimizer steps and GC
    inside it count as those phases. For an evaluation or a checkpoint the two agree; a
    region around training steps (or one that reads a DataLoader) runs longer than the
    breakdown's region share, and the Region rows' wall time would not add up with it."""
    spans = sorted((int(ev.get("t_start_ns", 0)), int(ev.get("t_start_ns", 0))
                    + int(ev.get("dur_ns", 0))) for ev in events if ev.get("kind") == "region")
    wall = 0
    end = None
    for a, b in spans:  # the union: a nested region is inside its outer one
        if end is None or a >= end:
            wall += b - a
            end = b
        elif b > end:
            wall += b - end
            end = b
    counted = int(steps["region_ns"].sum()) if len(steps) else 0
    if wall - counted <= max(0.1 * wall, 1e6):
        return []
    return [f"the named regions ran {wall / 1e6:,.1f} ms (wall time, the Region rows); "
            f"{counted / 1e6:,.1f} ms of it is region time in the breakdown: the data "
            "waits, backward passes, optimizer steps and GC inside them count as those phases"]


#: environment switches meant for debugging that slow a CUDA run (expert-rules.md H10):
#: every launch waits for its kernel; every allocation goes to cudaMalloc/cudaFree
DEBUG_ENV = ("CUDA_LAUNCH_BLOCKING", "PYTORCH_NO_CUDA_MEMORY_CACHING")


def _debug_modes(meta: dict[str, Any]) -> dict[str, Any]:
    """Debugging switches seen on while training (trainprof.capture.debug_modes): per
    switch the share of samples it was on, and the step first seen on; the environment's."""
    rec = meta.get("debug_modes") or {}
    n = int(rec.get("samples") or 0)
    on = rec.get("on") or {}
    out: dict[str, Any] = {
        "samples": n,
        "share": {k: int(v) / n for k, v in on.items() if n and v},
        "first_on_step": rec.get("first_on_step") or {},
    }
    if "anomaly_check_nan" in rec:
        out["anomaly_check_nan"] = rec["anomaly_check_nan"]
    env = ((meta.get("fingerprint") or {}).get("threads") or {}).get("env") or {}
    out["env"] = {k: env[k] for k in DEBUG_ENV
                  if str(env.get(k, "")).strip() not in ("", "0")}
    return out


#: The environment variables that size torch's intra-op pool and say how its idle
#: threads wait (capture/fingerprint.py records them when set).
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
              "KMP_BLOCKTIME")


def _environment(fp: dict[str, Any] | None, training: dict[str, Any] | None,
                 launch: dict[str, Any] | None = None) -> dict[str, Any]:
    """The few fingerprint facts worth a line in the summary (the rest stays in run.json).

    Thread counts come from the training thread when recorded (``training``):
    OpenMP's intra-op count is per thread. ``launch``: run.json's environment as the
    command started, which tells the thread variables the script set itself.
    """
    if not fp:
        return {}
    torch_info = fp.get("torch") or {}
    cpu = fp.get("cpu") or {}
    threads = fp.get("threads") or {}
    gpus = fp.get("gpus") or []
    launch_env = (launch or {}).get("env")
    return {
        "python": (fp.get("python") or {}).get("version"),
        "torch": torch_info.get("version"),
        "cuda": torch_info.get("cuda"),
        "cudnn_benchmark": torch_info.get("cudnn_benchmark"),
        "cudnn_deterministic": torch_info.get("cudnn_deterministic"),
        "gpu": gpus[0].get("name") if gpus else None,
        # "8.0": TF32 tensor cores from 8.0 (Ampere) on (diagnosis/tf32.py)
        "gpu_capability": gpus[0].get("capability") if gpus else None,
        "gpu_count": len(gpus),
        "cpu_model": cpu.get("model"),
        "usable_cores": cpu.get("usable_cores"),
        "physical_cores": cpu.get("physical_cores"),
        "logical_cores": cpu.get("logical_cores"),
        "memory_total_bytes": cpu.get("memory_total_bytes"),
        # native bfloat16 instructions (amx_bf16, avx512_bf16; diagnosis/precision.py)
        "cpu_bf16": cpu.get("bf16"),
        # oneDNN for CPU convolutions (diagnosis/channels_last_cpu.py); "x86_64", "aarch64"
        "cpu_onednn": torch_info.get("mkldnn"),
        "machine": (fp.get("platform") or {}).get("machine"),
        "torch_num_threads": (training or {}).get("torch_num_threads")
        or threads.get("torch_num_threads"),
        "cgroup_cpu_limit": cpu.get("cgroup_cpu_limit"),
        # thread-count variables the environment set (a launcher's OMP_NUM_THREADS=1)
        "thread_env": {k: v for k, v in (threads.get("env") or {}).items()
                       if k in THREAD_ENV} or None,
        # ...of which the script set itself (os.environ before its import of torch)
        "thread_env_by_script": sorted(
            k for k, v in (threads.get("env") or {}).items()
            if k in THREAD_ENV and isinstance(launch_env, dict) and k in launch_env
            and launch_env.get(k) != v) or None,
    }


def _explicit_gc(rec: dict[str, Any], steps_total_s: float) -> dict[str, Any]:
    """The script's gc.collect() calls (capture/explicit_gc.py): their share of the time
    of all complete steps, and how many steps apart they come."""
    calls = int(rec.get("calls") or 0)
    first, last = rec.get("first_step"), rec.get("last_step")
    every = ((last - first) / (calls - 1) if calls > 1 and isinstance(first, int)
             and isinstance(last, int) else None)
    return {**rec, "share": float(rec.get("total_s") or 0) / steps_total_s
            if steps_total_s > 0 else None, "every_steps": every}


def _step_spans(steps: np.ndarray, windows: Any, origin: float | None
                ) -> list[tuple[float, float]]:
    """The clock spans (seconds, the samples' clock) of the steps in ``windows`` (lists of
    [first, end) step numbers: the op count's window), one per window."""
    if origin is None or not isinstance(windows, list) or not len(steps):
        return []
    spans = []
    for window in windows:
        if not (isinstance(window, list) and len(window) == 2):
            continue
        inside = steps[(steps["step"] >= window[0]) & (steps["step"] < window[1])]
        if len(inside):
            spans.append((origin + float(inside["t_start_ns"].min()) / 1e9,
                          origin + float((inside["t_start_ns"] + inside["dur_ns"]).max()) / 1e9))
    return spans


def _first_gpu(meta: dict[str, Any]) -> dict[str, Any]:
    """The fingerprint's first GPU (its name and multiprocessors: datasheet peaks)."""
    gpus = (meta.get("fingerprint") or {}).get("gpus") or []
    return gpus[0] if gpus and isinstance(gpus[0], dict) else {}


def summarize_run(run: Run) -> dict[str, Any]:
    """The summary document of a Run, in whatever status it is."""
    meta = run.meta
    loaders = meta.get("dataloaders") or [
        ev for ev in run.events if ev.get("kind") == "dataloader"]
    stats = step_statistics(run.steps, len(loaders) if isinstance(loaders, list) else 1)
    stats["steps"]["per_iteration"] = steps_per_iteration(meta.get("optimizers"))
    recorded = meta.get("steps_recorded")
    if isinstance(recorded, int) and recorded > len(run.steps):
        # closed with more steps than steps.bin holds (cut short, or missing)
        stats["steps"]["recorded"] = recorded
    done = complete_steps(run.steps)
    done_s = float(done["dur_ns"].sum()) / 1e9  # every complete step's time, warm-up too
    t_start = t_end = None
    warm = stats["steps"]["warmup"]
    origin = meta.get("clock_origin_s")
    if origin is not None and len(done) > warm:
        steady = done[warm:]
        t_start = origin + float(steady["t_start_ns"][0]) / 1e9
        t_end = origin + float(steady["t_start_ns"][-1] + steady["dur_ns"][-1]) / 1e9
    worker_files = load_worker_files(run.path)  # read once: loading stats and memory
    first_batches = batch_tensors(meta.get("padding"))
    workers = summarize_workers(run.path, meta.get("clock_origin_s"), worker_files)
    samples = load_samples(run.samples_path)
    system = summarize_system(samples, t_start, t_end)
    if system.get("n_samples", 0) == 0 and samples:
        system = summarize_system(samples)  # run too short for a steady window
    usable_cores = ((meta.get("fingerprint") or {}).get("cpu") or {}).get("usable_cores")
    if origin is not None and warm > 0 and samples:
        # other processes' load while the warm-up steps ran: a burst of it at the start
        # looks like warm-up (diagnosis/noise.py's warmup_under_load)
        head = done[:warm]
        system["outside_cores_warmup"] = outside_cores_during(samples, [(
            origin + float(head["t_start_ns"][0]) / 1e9,
            origin + float(head["t_start_ns"][-1] + head["dur_ns"][-1]) / 1e9)], usable_cores)
    explicit = meta.get("explicit_gc")
    if explicit and isinstance(stats.get("gc"), dict):
        stats["gc"]["explicit"] = _explicit_gc(explicit, done_s)
    ops = load_ops(run.path)
    gpu = _first_gpu(meta)
    mean_step_s = 1.0 / stats["steps_per_s"] if stats.get("steps_per_s") else None
    first_steady = int(done["step"][warm]) if len(done) > warm else 0
    op_time = summarize_op_time(
        ops, mean_step_s, stats.get("breakdown"),
        outside_cores_during(samples, _step_spans(run.steps, (ops or {}).get("window_steps"),
                                                  origin), usable_cores),
        device_seconds_per_step(run.device, first_steady))
    summary: dict[str, Any] = {
        "run_dir": str(run.path),
        "name": meta.get("name"),
        "status": run.status,
        "exit_code": meta.get("exit_code"),
        "command": meta.get("command"),
        "started_at": meta.get("started_at"),
        "ended_at": meta.get("ended_at"),
        "duration_s": _duration_s(meta),
        **stats,
        "regions": _regions(run.events, done[warm:]),
        "dataloaders": meta.get("dataloaders")
        or [ev for ev in run.events if ev.get("kind") == "dataloader"],
        # each optimizer seen stepping: class, parameters, the implementation its step runs
        "optimizers": [{k: v for k, v in o.items() if k != "id"}  # (a Python object's id)
                       for o in meta.get("optimizers") or [] if isinstance(o, dict)],
        "optimizers_not_described": meta.get("optimizers_not_described") or None,
        # debugging switches left on while training (anomaly detection, the profiler, env)
        "debug_modes": _debug_modes(meta),
        # model calls in eval mode, with autograd on and off (capture/eval_autograd.py)
        "eval_autograd": meta.get("eval_autograd"),
        "system": system,
        # RSS and GPU memory that keep growing through the steady state (a leak)
        "memory_growth": memory_growth(
            samples, t_start, t_end, stats.get("steps_per_s"),
            ((meta.get("fingerprint") or {}).get("cpu") or {}).get("memory_total_bytes"),
            worker_starts(worker_files[0])),
        # inside the DataLoader workers: blocked vs CPU per sample, collate, start-up
        "workers": workers,
        # receiving the workers' batches in the training process (capture/handoff.py)
        "batch_handoff": summarize_handoff(meta.get("batch_handoff"), workers,
                                           done_s, first_batches),
        # the first pass of activation-checkpointed regions: what the backward recomputes
        "activation_checkpointing": summarize_checkpointing(
            meta.get("activation_checkpointing"), done_s, len(done)),
        # how much of the first batches' sequences is padding (capture/padding.py)
        "padding": summarize_padding(meta.get("padding")),
        # what the first batch of each loader holds: dtypes and shapes (capture/padding.py)
        "batch_tensors": first_batches,
        "device": device_statistics(run.device, first_steady),
        "environment": _environment(meta.get("fingerprint"), meta.get("training_thread"),
                                    meta.get("launch")),
        # CUDA caching-allocator counters at the end of a CUDA run (capture/recorder.py)
        "cuda_memory": meta.get("cuda_memory"),
        # root module classes timed as forward (the model, the loss; DataParallel shows here)
        "forward_roots": meta.get("forward_roots") or [],
        # DistributedDataParallel.no_sync() contexts the script entered (None: not known)
        "ddp_no_sync_calls": meta.get("ddp_no_sync_calls"),
        # this process's torch.distributed rank, world size and backend, once seen
        "distributed": meta.get("distributed"),
        # DDP's own timing of its gradient all-reduce, per DDP model (analysis/ddp.py)
        "ddp": summarize_ddp(meta, (stats.get("steps") or {}).get("median_s")),
        "ops": ops,
        # the step's FLOPs against the machine's measured peak (analysis/compute_efficiency.py)
        "compute": compute_efficiency(ops, meta.get("peak_flops"), mean_step_s,
                                      stats.get("breakdown"), gpu.get("name"),
                                      gpu.get("multiprocessors")),
        # the model's ops' time by kind: products, attention, fusable, views (analysis/ops.py)
        "op_time": op_time,
        # torch.compile's compilations, those after the warm-up and why (analysis/compiles.py)
        "compiles": summarize_compiles(meta.get("compiles"), done, warm),
        # attention computed op by op, and the fused kernel's saving measured at its shapes
        # (analysis/attention.py), in steady seconds
        "attention": summarize_attention(
            ops, meta.get("attention_fix_measured"),
            (op_time or {}).get("step_s") or mean_step_s, meta.get("peak_flops"),
            model_scale(op_time)),
        # which lines of the loop the "other" time goes to (sampled stacks)
        "loop_stacks": summarize_loop_stacks(
            run.path, run.steps, warm, (stats.get("breakdown_detail") or {}).get("other"),
            (stats.get("steps") or {}).get("per_iteration"),
        ),
        "python_profile": summarize_python_profile(run.path),
        # torch.profiler windows (--deep): breakdown, GPU summary, top operators per window
        "deep": analyse_deep_windows(run.path),
        "missing": meta.get("missing", []),
        "notes": [*meta.get("notes", []), *_compile_notes(meta, stats),
                  *_uncounted_flops(ops), *_iteration_notes(stats),
                  *_region_notes(run.events, run.steps),
                  *_host_ahead_notes(stats, device_statistics(run.device, first_steady))],
        "findings": [],  # filled by the diagnosis (trainprof.commands.analyse)
    }
    if "recorded_status" in meta:
        summary["recorded_status"] = meta["recorded_status"]
    crash = summarize_crash(meta.get("crash"))
    if crash is not None:  # an exception or a fatal signal: which, and where (analysis/crash.py)
        summary["crash"] = crash
    return summary


#: The device's median step over the host's from which the host is said to run ahead.
HOST_AHEAD = 1.5


def _host_ahead_notes(stats: dict[str, Any], device: dict[str, Any] | None) -> list[str]:
    """A host whose median step is far shorter than the device's ran ahead of the GPU: its
    steps only launched kernels, and it caught up in the steps that read a device tensor
    (``loss.item()`` every N steps). Its median step time then says how fast kernels are
    launched, not how fast the run trains: say so, with the device's."""
    host = (stats.get("steps") or {}).get("median_s")
    dev = (device or {}).get("median_step_s")
    if not isinstance(host, int | float) or not isinstance(dev, int | float) or host <= 0:
        return []
    if dev < HOST_AHEAD * host:
        return []
    return [f"the host ran ahead of the GPU: its median step took {host * 1e3:.3g} ms "
            f"(launching the step's kernels) against the device's {dev * 1e3:.3g} ms, and it "
            "waited for the device where it read a device tensor: the device's median is "
            "the step time that counts (samples/s is over the wall clock either way)"]


def _iteration_notes(stats: dict[str, Any]) -> list[str]:
    """Steps that are a part of the loop's iteration (a GAN's discriminator stepped k times
    a generator step): say so, since their times alternate with it."""
    k = (stats.get("steps") or {}).get("per_iteration")
    if not k:
        return []
    return [f"the optimizer whose steps delimit steps stepped {k} times for each step of the "
            f"script's other optimizer: an iteration of the loop is {k} steps, and step times "
            f"alternate with it (the noise rule judges iterations of {k} steps)"]


def _uncounted_flops(ops: dict[str, Any] | None) -> list[str]:
    """A compiled run whose op-count window saw no FLOPs has no FLOPs utilization: say why,
    rather than leave the Compute row out unexplained (an eager model without products,
    a bare loop, needs no word)."""
    if not ops or not ops.get("compiled"):
        return []
    by_kind = ops.get("flops_by_kind_per_step") or {}
    if sum(float(v) for v in by_kind.values()) > 0:
        return []
    return ["no FLOPs counted, so no FLOPs utilization: the compiled model called no matrix "
            "product or convolution of torch's in the op count's window (kernels replayed as "
            "CUDA graphs, mode=\"reduce-overhead\", and products torch.compile generates "
            "itself call none)"]


def _compile_notes(meta: dict[str, Any], stats: dict[str, Any]) -> list[str]:
    """A run whose forward is hidden in a compiled function: say where its time went.

    A model called inside a ``torch.compile``-d function (a compiled training step) runs in
    the function's graph, where no module call happens that trainprof could time: its
    forward counts as "other", which a reader of a 0% forward share should know."""
    frames = meta.get("compiled_frames")
    forward = (stats.get("breakdown") or {}).get("forward")
    if not isinstance(frames, int) or frames <= 0 or forward is None or forward > 0:
        return []
    return [f"torch.compile compiled {frames} frame{'s' if frames != 1 else ''} and no "
            "forward pass was seen: a model called inside a compiled function runs in its "
            "graph, so its forward counts as \"other\" (compile the model, "
            "torch.compile(model), to see forward apart)"]
