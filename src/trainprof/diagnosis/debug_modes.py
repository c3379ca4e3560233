"""Debugging switches left on while training: anomaly detection, the profiler, CUDA's.

Sources (expert-rules.md): H10 — "Debug APIs left on. Anomaly detection, emit_nvtx,
autograd profiler, gradcheck → Disable" (the PyTorch performance tuning guide,
"Disable debugging APIs"); no peer publishes a threshold. The capture samples the
process-wide switches five times a second while steps are made
(:mod:`trainprof.capture.debug_modes`); ``CUDA_LAUNCH_BLOCKING`` and
``PYTORCH_NO_CUDA_MEMORY_CACHING`` come from the environment fingerprint.

Gains are upper bounds on what the switch can cost, times the share of samples it was
on: anomaly detection acts in forward (a Python stack kept per autograd node) and
backward (outputs checked for NaN), so forward + backward; the profiler records every
op, so forward + backward + optimizer; the CUDA switches act on every kernel launch or
allocation, so the same. A switch on in fewer than :data:`MIN_ON` of the samples, or in
fewer than :data:`MIN_ON_SAMPLES` of them (a debugging block around a few steps), is
left alone. Bands: ≥ 15% high, ≥ 5% medium,
≥ 2% low, as the other host-overhead shares.
"""

from __future__ import annotations

from typing import Any

from trainprof.diagnosis.context import Context
from trainprof.diagnosis.finding import Finding, Fix, band
from trainprof.diagnosis.registry import rule

HIGH, MEDIUM, LOW = 0.15, 0.05, 0.02
#: the least share of samples a switch must be on in to be reported
MIN_ON = 0.10
#: ... and the fewest samples: one alone can be a debugging block around a few steps
#: (3 steps under detect_anomaly() took 1 sample of 9 in a 2-second run: 11%)
MIN_ON_SAMPLES = 2
#: how a verify line compares the runs before and after a change
COMPARE = "trainprof compare RUN_BEFORE RUN_AFTER"


def _phases(ctx: Context, *names: str) -> float:
    return sum(float(ctx.breakdown.get(n) or 0.0) for n in names)


def _modes(ctx: Context) -> dict[str, Any]:
    modes = ctx.summary.get("debug_modes")
    return modes if isinstance(modes, dict) else {}


def _switch_cost(ctx: Context, name: str, phases: float) -> tuple[float, float, str] | None:
    """(share of samples on, gain, severity) of a sampled switch; None: not worth a finding."""
    modes = _modes(ctx)
    on = float((modes.get("share") or {}).get(name) or 0.0)
    if on < MIN_ON or on * float(modes.get("samples") or 0) < MIN_ON_SAMPLES - 0.5:
        return None
    severity = band(on * phases, HIGH, MEDIUM, LOW)
    return None if severity is None else (on, on * phases, severity)


def _evidence(ctx: Context, name: str, on: float, phases: float) -> dict[str, Any]:
    modes = _modes(ctx)
    return {
        f"{name}_on_share": on,
        "samples": modes.get("samples"),
        "seen_on_from_step": (modes.get("first_on_step") or {}).get(name),
        "affected_phases_share": phases,
        "step_median_s": ctx.step_info.get("median_s"),
    }


@rule("debug_modes.anomaly_detection")
def anomaly_detection(ctx: Context) -> Finding | None:
    phases = _phases(ctx, "forward", "backward")
    cost = _switch_cost(ctx, "anomaly_detection", phases)
    if cost is None:
        return None
    on, gain, severity = cost
    evidence = _evidence(ctx, "anomaly_detection", on, phases)
    check_nan = _modes(ctx).get("anomaly_check_nan")
    if check_nan is not None:
        evidence["check_nan"] = check_nan
    title = (f"Autograd anomaly detection is on ({on * 100:.0f}% of the run): it slows "
             f"forward and backward, {phases * 100:.0f}% of step time")
    text = (
        "torch.autograd.detect_anomaly / set_detect_anomaly(True) is a debugging mode: "
        "every operation of the forward keeps the Python stack that made it, and backward "
        "checks every result for NaN" + (" (on a GPU, a device-to-host read each)"
                                         if ctx.on_cuda else "")
        + ". Turn it off for training (Lightning: Trainer(detect_anomaly=False)); to "
        "catch a NaN cheaply, check the loss every N steps and switch anomaly detection "
        "on only to find where it comes from."
    )
    snippet = (
        "torch.autograd.set_detect_anomaly(False)  # or remove the detect_anomaly() block\n"
        "...\n"
        "if step % 100 == 0 and not torch.isfinite(loss):  # a cheap NaN check instead\n"
        '    raise FloatingPointError(f"loss is {loss.item()} at step {step}")'
    )
    tune = f"trainprof tune --knob anomaly_detection=script,false {ctx.script}"
    verify = f"{tune}  (forward and backward should shrink)"
    return Finding(category="host_launch", cause="anomaly_detection", title=title,
                   severity=severity, evidence=evidence, estimated_gain=gain,
                   fix=Fix(text=text, snippet=snippet), verify=verify,
                   verify_commands=(tune,))


@rule("debug_modes.profiler")
def profiler_left_on(ctx: Context) -> Finding | None:
    phases = ctx.compute_share
    cost = _switch_cost(ctx, "profiler", phases)
    if cost is None:
        return None
    on, gain, severity = cost
    title = (f"A torch profiler records {on * 100:.0f}% of the run: every op it records "
             "costs extra host time")
    text = (
        "The script's own torch.profiler (or torch.autograd.profiler) records for most of "
        "the run: each operator is timed and kept, which adds host time to every op "
        "(on a ~1 ms CPU step, +31% to +102% measured by trainprof's overhead "
        "benchmark). Record a few steps with a schedule and prof.step(), or let "
        "`trainprof run --deep` record a bounded window."
    )
    snippet = (
        "with torch.profiler.profile(\n"
        "    schedule=torch.profiler.schedule(wait=5, warmup=1, active=3, repeat=1),\n"
        "    on_trace_ready=torch.profiler.tensorboard_trace_handler(\"./log\"),\n"
        ") as prof:\n"
        "    for batch in loader:\n"
        "        ...  # the training step\n"
        "        prof.step()"
    )
    run = f"trainprof run {ctx.script}"
    verify = f"{run} with the profiler scheduled or removed, then {COMPARE}"
    return Finding(category="host_launch", cause="profiler_left_on", title=title,
                   severity=severity,
                   evidence=_evidence(ctx, "profiler", on, phases), estimated_gain=gain,
                   fix=Fix(text=text, snippet=snippet), verify=verify,
                   verify_commands=(run, COMPARE))


#: the switches the summary keeps (trainprof.analysis.summary.DEBUG_ENV), what each does
_ENV_SWITCHES = {
    "CUDA_LAUNCH_BLOCKING": (
        "synchronization", "launch_blocking",
        "every kernel launch waits until the kernel has finished, so the host never "
        "runs ahead of the GPU and every gap between kernels is idle time. It exists to "
        "get the right stack for an asynchronous CUDA error."),
    "PYTORCH_NO_CUDA_MEMORY_CACHING": (
        "memory", "allocator_caching_off",
        "the CUDA caching allocator is off: every tensor is allocated with cudaMalloc and "
        "freed with cudaFree, both of which synchronize the device. It exists for memory "
        "checkers (compute-sanitizer)."),
}


@rule("debug_modes.cuda_env")
def cuda_env(ctx: Context) -> list[Finding]:
    env = _modes(ctx).get("env") or {}
    if not ctx.on_cuda or not env:
        return []
    out: list[Finding] = []
    phases = ctx.compute_share
    run = f"trainprof run {ctx.script}"
    for name, value in env.items():
        if name not in _ENV_SWITCHES:
            continue
        category, cause, what = _ENV_SWITCHES[name]
        severity = band(phases, HIGH, MEDIUM, LOW)
        if severity is None:
            continue
        out.append(Finding(
            category=category, cause=cause,
            title=f"{name}={value} is set: a debugging switch that slows every step",
            severity=severity,
            evidence={"env": {name: value}, "affected_phases_share": phases,
                      "step_median_s": ctx.step_info.get("median_s")},
            estimated_gain=phases,
            fix=Fix(text=f"With {name} set, {what} Unset it for training.",
                    snippet=f"unset {name}  # in the job script or shell profile that sets it"),
            verify=f"env -u {name} {run}, then {COMPARE}",
            verify_commands=(f"env -u {name} {run}", COMPARE),
        ))
    return out
