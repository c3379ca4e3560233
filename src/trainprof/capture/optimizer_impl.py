"""Which implementation an optimizer's step runs (for-loop, foreach, fused), and changing it.

torch.optim's optimizers have up to three implementations of one update (torch.optim
documentation, "Algorithms", and its note on foreach/fused): the *for-loop* one, which
updates the parameters one tensor at a time (a few small ops per tensor, each a
dispatch from Python), *foreach*, which runs each op over lists of tensors
(``torch._foreach_*``), and *fused*, one kernel that does the whole update of many
tensors (Adam, AdamW, SGD, Adagrad; on CUDA and, since torch 2.4, on CPU). Which one
runs is decided at each step from the param group's ``foreach`` and ``fused`` flags;
when the script left both at ``None`` torch's default applies
(``torch.optim.optimizer._default_to_fused_or_foreach``): foreach when every parameter
is a plain tensor on a device with foreach kernels (CUDA), the for-loop otherwise — on
CPU always — and never fused ("we want to give the fused impl bake-in time before
making it the default, even if it is typically faster", torch/optim/adam.py). An
optimizer with a ``fused`` flag that the script set to ``False`` gets no foreach
default either (``if fused is None and foreach is None``).

The for-loop over many small tensors is the expert-rules.md H7 symptom
(``_single_tensor_{adam,adamw,sgd}`` in a trace, TorchTidy and Hugging Face:
"use foreach / fused optimizers"). ``benchmarks/optimizer_step.py`` measures the three
side by side (AdamW on CPU over 96 small tensors: foreach ×0.60 of the for-loop's time,
fused ×0.17).

:func:`describe_optimizer` is what the capture records once per optimizer (at its first
step, a warm-up step; at most 16 per run); :func:`set_implementation` is the
``optimizer`` knob of ``trainprof tune`` (:mod:`trainprof.capture.knobs`), applied
right after the optimizer is built, before its state exists.
"""

from __future__ import annotations

from typing import Any

from trainprof.schema import IMPL_FOR_LOOP as SINGLE
from trainprof.schema import IMPL_FOREACH as FOREACH
from trainprof.schema import IMPL_FUSED as FUSED

#: the knob's spellings of each (``single`` as HTA and TorchTidy name the for-loop path)
KNOB_VALUES = {"for-loop": SINGLE, "forloop": SINGLE, "single": SINGLE,
               "single_tensor": SINGLE, "foreach": FOREACH, "fused": FUSED}


def _torch_step_owner(optimizer: Any) -> bool:
    """True when the ``step`` that runs is one of torch.optim's own (its flags mean what
    torch documents); a custom optimizer's step may do anything."""
    for cls in type(optimizer).__mro__:
        if "step" in cls.__dict__:
            return cls.__module__.startswith("torch.optim.")
    return False


def class_name(obj: Any) -> str:
    """``module.Qualname`` of an object's class, as run.json names optimizers."""
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _default_foreach(params: list[Any]) -> bool:
    """torch's own default (foreach on CUDA tensors, the for-loop elsewhere)."""
    try:
        from torch.optim.optimizer import _default_to_fused_or_foreach
    except ImportError:  # a torch that moved it: CUDA tensors are what foreach needs
        return bool(params) and all(getattr(p, "is_cuda", False) for p in params)
    return bool(_default_to_fused_or_foreach(params, False, use_fused=False)[1])


def group_implementation(group: dict[str, Any]) -> str:
    """The implementation torch.optim's step runs for one param group (module docstring)."""
    if group.get("differentiable"):
        return SINGLE  # neither foreach nor fused supports differentiable=True
    fused, foreach = group.get("fused"), group.get("foreach")
    if fused:
        return FUSED
    if foreach:
        return FOREACH
    if foreach is None and (fused is None or "fused" not in group):
        default = _default_foreach(list(group.get("params") or []))
        lr = group.get("lr")
        if default and type(lr).__name__ == "Tensor" and not group.get("capturable"):
            default = False  # torch turns foreach off for a Tensor lr without capturable
        return FOREACH if default else SINGLE
    return SINGLE


def _fused_problem(optimizer: Any) -> str | None:
    """Why fused cannot run on this optimizer's parameters (None: it can)."""
    try:
        from torch.optim.optimizer import _device_dtype_check_for_fused
    except ImportError:
        return None
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            return "fused does not support differentiable=True"
        for p in group["params"]:
            try:
                _device_dtype_check_for_fused(p)
            except RuntimeError as exc:
                return str(exc).splitlines()[0]
    return None


def describe_optimizer(optimizer: Any) -> dict[str, Any]:
    """One optimizer as run.json's ``optimizers`` keeps it: class, parameter tensors and
    elements, devices and dtypes, the implementation its step runs, and what it supports."""
    groups = list(getattr(optimizer, "param_groups", None) or [])
    params = [p for g in groups for p in g.get("params") or []]
    own = _torch_step_owner(optimizer)
    defaults = getattr(optimizer, "defaults", None) or {}
    impls = [group_implementation(g) for g in groups] if own else []
    out: dict[str, Any] = {
        "class": class_name(optimizer),
        "groups": len(groups),
        "param_tensors": len(params),
        "numel": int(sum(int(p.numel()) for p in params)),
        "devices": sorted({str(p.device.type) for p in params}),
        "dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in params}),
        "torch_step": own,
        # the implementation of each group (one value when all agree); None: a custom step
        "implementation": (impls[0] if len(set(impls)) == 1 else sorted(set(impls)))
        if impls else None,
        "flags": {k: groups[0].get(k) for k in ("foreach", "fused") if groups and k in groups[0]},
        "supports": [k for k in ("foreach", "fused") if own and k in defaults],
    }
    # at its first step (a post-step hook) the gradients are there: sparse ones (an
    # nn.Embedding(sparse=True)'s) make fused fail ("`_fused_sgd` does not support sparse
    # gradients"); foreach takes them (SGD, Adagrad: checked on torch 2.13)
    sparse = sum(1 for p in params if getattr(getattr(p, "grad", None), "is_sparse", False))
    if sparse:
        out["sparse_grad_tensors"] = sparse
        out["sparse_grad_numel"] = int(sum(int(p.numel()) for p in params
                                           if p.grad is not None and p.grad.is_sparse))
    if groups and "weight_decay" in groups[0]:
        out["weight_decay"] = groups[0].get("weight_decay")
    if own and "fused" in defaults:
        problem = _fused_problem(optimizer)
        if problem is None and sparse:
            problem = "fused does not support sparse gradients"
        if problem is not None:
            out["fused_unavailable"] = problem
    return out


def set_implementation(optimizer: Any, implementation: str) -> dict[str, Any]:
    """Make ``optimizer``'s steps run ``implementation`` (for-loop, foreach or fused).

    Sets every param group's ``foreach``/``fused`` flags and the defaults that later
    groups take (``add_param_group``), as the constructor would have with
    ``foreach=True`` or ``fused=True``; for fused also what the constructor sets beside
    the flag (``_step_supports_amp_scaling``: GradScaler hands the fused step its scale).
    Not applied, with the reason, to a custom optimizer, one without that
    implementation, differentiable groups, parameters fused cannot take, or an
    optimizer whose state exists already (a checkpoint loaded: its step counters
    are laid out for the implementation it had). Returns the record of what was done.
    """
    cls = type(optimizer)
    entry: dict[str, Any] = {"class": class_name(optimizer), "asked": implementation}
    defaults = getattr(optimizer, "defaults", None)
    why: str | None = None
    if not _torch_step_owner(optimizer) or not isinstance(defaults, dict):
        why = "not one of torch.optim's optimizers"
    elif implementation == FOREACH and "foreach" not in defaults:
        why = f"{cls.__qualname__} has no foreach implementation"
    elif implementation == FUSED and "fused" not in defaults:
        why = f"{cls.__qualname__} has no fused implementation"
    elif getattr(optimizer, "state", None):
        why = "its state existed already (loaded before the first step)"
    elif implementation != SINGLE and any(g.get("differentiable")
                                          for g in optimizer.param_groups):
        why = f"{implementation} does not support differentiable=True"
    elif implementation == FUSED:
        why = _fused_problem(optimizer)
    if why is not None:
        entry["dropped"] = why
        return entry
    flags = {"foreach": implementation == FOREACH, "fused": implementation == FUSED}
    for target in (defaults, *optimizer.param_groups):
        for key, value in flags.items():
            if key in defaults:
                target[key] = value
    if implementation == FUSED:
        optimizer._step_supports_amp_scaling = True
    entry["set"] = implementation
    return entry
