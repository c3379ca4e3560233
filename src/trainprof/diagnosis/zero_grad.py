"""``zero_grad(set_to_none=False)``: zeros written into every gradient, every step.

Source (expert-rules.md): H8 — "zero_grad writes zeros: ``aten::zero_`` under
``zero_grad`` → ``set_to_none=True``" (the PyTorch performance tuning guide,
TorchTidy's pattern matcher); no peer publishes a threshold. The op count's window
(:mod:`trainprof.capture.opcount`) sees the ``zero_`` / ``_foreach_zero_`` calls that
torch.optim's and nn.Module's ``zero_grad`` make when asked to keep the gradients
(``set_to_none=True``, the default since torch 2.0, makes none), and their bytes.

Why it costs more than ``zero_grad`` itself: with the gradients kept, backward adds
each new gradient into the zeros (a read of both, a write of the sum); with them
dropped, autograd keeps the new gradient tensor as it is. So the one pass over the
gradients that ``zero_grad`` makes (a write) comes with three more in backward (two
reads, a write): :data:`MOST_SAVED_PER_SHARE` = 4 times ``zero_grad``'s share of the
step is the gain claimed, an upper bound where the passes are memory-bound. Measured
on the CPU (one thread, SGD with momentum, 2026-11-26): ``benchmarks/zero_grad.py``,
an MLP of 6.3 M parameters ×0.88 a step with ``set_to_none=True`` (95% CI
×0.88–×0.90) while ``zero_grad`` held 4.7% of it (2.6 times the share), a small MLP
(0.1 M parameters, where ``zero_grad`` is mostly Python per tensor) ×0.97 with 4.8%;
``trainprof tune --knob zero_grad_set_to_none=false,true`` on the test's script (1.6 M
parameters, ~5% in ``zero_grad``) ×0.82 (×0.75–×0.91), about 3.6 times. On a GPU
``zero_grad`` only launches the writes, so its host time understates them: the claim
is low there, and the ``verify`` line measures it.

Bands: the optimizer rule's (H5's ≥ 15% high, ≥ 3% medium), else ``low``: the fix
is a keyword, and dropped gradients free their memory between steps.
"""

from __future__ import annotations

from typing import Any

from trainprof.diagnosis.context import Context
from trainprof.diagnosis.finding import Finding, Fix, band
from trainprof.diagnosis.registry import rule

HIGH, MEDIUM = 0.15, 0.03
#: step time saved per unit of zero_grad's share, at most (module docstring)
MOST_SAVED_PER_SHARE = 4.0


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB" if n >= 1e5 else f"{n / 1e3:,.0f} KB"


@rule("zero_grad.writes_zeros")
def zero_grad_writes_zeros(ctx: Context) -> Finding | None:
    ops: dict[str, Any] = ctx.summary.get("ops") or {}
    calls = float(ops.get("zero_grad_zeroing_calls_per_step") or 0.0)
    if calls <= 0:
        return None
    zeroed = float(ops.get("zero_grad_zeroed_bytes_per_step") or 0.0)
    detail = ctx.summary.get("breakdown_detail") or {}
    share = ctx.steady_share("zero_grad_ns", float(detail.get("zero_grad") or 0.0))
    gain = min(1.0, share * MOST_SAVED_PER_SHARE)
    severity = band(gain, HIGH, MEDIUM) or "low"
    evidence: dict[str, Any] = {
        "zeroing_calls_per_step": calls,
        "zeroed_bytes_per_step": zeroed,
        "zero_grad_share": round(share, 4),
        "most_saved_per_share": MOST_SAVED_PER_SHARE,
        "steps_sampled": ops.get("steps_sampled"),
    }
    title = (f"zero_grad writes zeros into the gradients every step ({_mb(zeroed)}, "
             f"{share * 100:.1f}% of step time in zero_grad): set_to_none=True drops them")
    text = (
        "zero_grad(set_to_none=False) fills every gradient with zeros, and backward then "
        "adds each new gradient into them: two passes over the gradients a step that "
        "set_to_none=True (the default since torch 2.0) skips, since autograd then keeps "
        "each new gradient as it comes. On the CPU an MLP of 6.3 M parameters ran its step "
        "12% faster (benchmarks/zero_grad.py), 2.6 times zero_grad's own share. Keep "
        "set_to_none=False only if code reads p.grad between zero_grad and backward "
        "expecting zeros (None there means the same to torch.optim), or accumulates into "
        "p.grad by hand."
        + (" On a GPU the writes run as kernels: zero_grad's host time understates them."
           if ctx.on_cuda else "")
    )
    snippet = ("opt.zero_grad(set_to_none=True)  # the default: opt.zero_grad()\n"
               "# likewise model.zero_grad(), if the script zeroes through the model")
    tune = f"trainprof tune --knob zero_grad_set_to_none=false,true {ctx.script}"
    verify = (f"{tune}  (every zero_grad drops the gradients: the step should shorten by more "
              "than zero_grad's share)")
    return Finding(category="host_launch", cause="zero_grad_writes_zeros", title=title,
                   severity=severity, evidence=evidence, estimated_gain=round(gain, 4),
                   fix=Fix(text=text, snippet=snippet), verify=verify, verify_commands=(tune,))
