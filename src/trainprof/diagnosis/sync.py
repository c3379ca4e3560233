"""Synchronization: the host blocks on the device every step.

Sources (expert-rules.md): S1 — Nsight Systems lists explicit
``cudaDeviceSynchronize``/``cudaStreamSynchronize`` calls by duration; S2 — the
PyTorch tuning guide and NVIDIA's ``perf-torch-sync-free`` skill: implicit syncs from
``.item()``, ``.cpu()``, ``.tolist()``, ``print(t)`` (remove them or defer them to
logging steps). No peer publishes a threshold; bands follow the other shares.

Capture counts every ``torch.cuda.synchronize`` and every read of a device tensor
(``.item/.tolist/.numpy/.cpu``) and times how long the host blocked in them; this
rule fires only when device syncs happened (``syncs.per_step > 0``; CPU runs never
sync). Time blocked in a sync is the device finishing queued work, so it is only
*removable* where the device then sits idle; when CUDA-event timings exist, the
gain is capped by the device's idle share (``device.breakdown.gap``).
"""

from __future__ import annotations

from typing import Any

from trainprof.diagnosis.context import Context
from trainprof.diagnosis.finding import Finding, Fix, band
from trainprof.diagnosis.registry import rule

HIGH, MEDIUM, LOW = 0.20, 0.05, 0.01


@rule("sync.device_syncs")
def device_syncs(ctx: Context) -> Finding | None:
    syncs = ctx.summary.get("syncs") or {}
    per_step = float(syncs.get("per_step") or 0.0)
    if per_step <= 0:
        return None
    share = float(syncs.get("share") or 0.0)
    reads = float(syncs.get("host_reads_per_step") or 0.0)
    gain = share
    evidence: dict[str, Any] = {
        "syncs_per_step": per_step,
        "sync_share": share,
        "host_reads_per_step": reads,
        "step_median_s": ctx.step_info.get("median_s"),
    }
    device = ctx.summary.get("device") or {}
    gap = (device.get("breakdown") or {}).get("gap")
    if isinstance(gap, int | float):
        evidence["device_idle_share"] = gap
        gain = min(share, float(gap))
    severity = band(gain, HIGH, MEDIUM, LOW)
    if severity is None:
        return None
    # Reads of device tensors are syncs too; more syncs than reads means explicit calls.
    if reads >= per_step:
        cause = "host_reads"
        title = (
            f"{per_step:.2g} device syncs per step from .item()/.cpu()-style reads "
            f"block the host {share * 100:.0f}% of step time"
        )
        text = (
            "Every .item(), .cpu(), .tolist() or print(tensor) of a CUDA tensor waits for "
            "all queued GPU work, so the host cannot run ahead and the GPU idles while the "
            "next step is prepared. Keep running values on the device and read them every "
            "N steps (logging steps only)."
        )
    else:
        cause = "explicit_synchronize"
        title = (
            f"{per_step:.2g} torch.cuda.synchronize() calls per step block the host "
            f"{share * 100:.0f}% of step time"
        )
        text = (
            "Explicit torch.cuda.synchronize() in the loop (often left from timing code) "
            "drains the GPU queue every step. Remove it, or time with CUDA events "
            "(torch.cuda.Event(enable_timing=True)) read at logging steps."
        )
    snippet = (
        'running = torch.zeros((), device="cuda")\n'
        "for step, (x, y) in enumerate(loader):\n"
        "    ...\n"
        "    running += loss.detach()  # stays on the GPU: no sync\n"
        "    if step % 100 == 0:\n"
        '        print(f"loss {running.item() / 100:.3f}")  # one sync per 100 steps\n'
        "        running.zero_()"
    )
    verify = (
        "torch.cuda.set_sync_debug_mode('warn') prints every remaining sync; re-run "
        f"`trainprof run {ctx.script}`: syncs per step (now {per_step:.2g}) should fall "
        "towards 0.01 and the sync share (now "
        f"{share * 100:.1f}%) with them"
    )
    return Finding(
        category="synchronization",
        cause=cause,
        title=title,
        severity=severity,
        evidence=evidence,
        estimated_gain=gain,
        fix=Fix(text=text, snippet=snippet),
        verify=verify,
        verify_commands=(f"trainprof run {ctx.script}",),
    )
