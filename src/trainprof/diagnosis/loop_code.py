"""The training loop's own code: "other" time that one line of the script accounts for.

"Other" is what a step spends outside the DataLoader, the model, backward,
zero_grad, the optimizer and GC: the script's own code between them - batches
made by hand (nanoGPT's ``get_batch``, no DataLoader), logging, metrics, checks,
file writes every step. The step clock measures its share exactly; the sampled
stacks (:mod:`trainprof.analysis.loop_stacks`) say which line of the loop it is
spent on. This is TF's "All Others" rule (expert-rules.md H5: host time outside
the input pipeline and the device work, >= 15% high, >= 3% moderate) and its
"per-step host extras" rule (H6: callbacks, metrics, logging every step -> run
them every N steps), made specific: the finding names the line.

Gain: the line's share of the "other" samples times the "other" share of steady
step time, less the time spent in host-device syncs (reads such as ``.item()``
wait for the device inside whatever line makes them: the synchronization rule owns
that part). Bands: :data:`HIGH` is TF's; the medium band is raised from TF's 3% to
:data:`MEDIUM` because the split of "other" between lines is sampled (20 samples a
second while "other" is 5% of the step or more), and a line needs
:data:`MIN_LINE_SAMPLES` samples to be named at all.

Not reported here: a line that also runs the model or the optimizer (sampled in those
phases too: ``loss = F.cross_entropy(model(x), y)``, whose "other" part is the loss);
a line that calls torch itself and spends most of its time inside (a functional loss
on a line of its own, gradient clipping: the step's compute, where the user put it);
"other" that is the wait for a DataLoader iterated in another
thread (:mod:`.loader_thread` owns it), a Python loop the op count already found
on the same line (:mod:`.python_loop`), and work done every N steps (left out of
the samples by the analysis; :mod:`.periodic` reports it).
"""

from __future__ import annotations

import ast
import os
import re
from typing import Any

from trainprof.diagnosis.context import Context
from trainprof.diagnosis.finding import Finding, Fix, band
from trainprof.diagnosis.registry import rule

HIGH, MEDIUM = 0.15, 0.05
#: Samples in "other" needed before its split between lines is trusted, and per line named.
MIN_OTHER_SAMPLES = 10
MIN_LINE_SAMPLES = 5
#: A loop line with this many ticks in the model's phases per tick in "other" is a line of
#: the step's own work (the model's call and a functional loss on one line), not reported.
OWN_WORK = 0.25
#: A line that moves tensors to the GPU (``x.cuda()``, ``x.to(device, ...)``).
DEVICE_COPY = re.compile(r"\.(?:cuda|to)\s*\(")


def _where(file: str | None, line: int | None) -> str:
    return f"{os.path.basename(file or '?')}:{line}"


def _statement(source: str | None) -> ast.stmt | None:
    """The one statement a source line holds, if it parses on its own."""
    try:
        body = ast.parse(source or "").body
    except SyntaxError:
        return None
    return body[0] if len(body) == 1 else None


def _call_expr(node: ast.stmt | None) -> str | None:
    """The expression a line evaluates (an assignment's right-hand side)."""
    if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
        return ast.unparse(node.value)
    if isinstance(node, ast.Expr):
        return ast.unparse(node.value)
    return None


def _target(node: ast.stmt | None) -> str | None:
    """What a plain assignment assigns to (``x, y``), or None."""
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
        target = node.targets[0]
        if isinstance(target, ast.Tuple):  # unparse would add parentheses
            return ", ".join(ast.unparse(e) for e in target.elts)
        return ast.unparse(target)
    if isinstance(node, ast.AnnAssign):
        return ast.unparse(node.target)
    return None


def _updates_in_place(node: ast.stmt | None) -> bool:
    """The line updates a tensor in place: a call of an in-place method
    (``pe.copy_(...)``, ``p.mul_(d)``: torch's trailing underscore) or an augmented
    assignment (``p += ...``). Such a line makes no batch: it is the step's bookkeeping,
    an EMA of the weights or a manual update, where a batch recipe would move it into
    worker processes that cannot see the model (an explorer's EMA line got one)."""
    if isinstance(node, ast.AugAssign):
        return True
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        func = node.value.func
        return (isinstance(func, ast.Attribute) and func.attr.endswith("_")
                and not func.attr.startswith("_"))
    return False


def _script_path(ctx: Context, file: str) -> str:
    """``file`` as ``--lines`` resolves it: the script as the user typed it, else absolute."""
    cmd = ctx.summary.get("command")
    typed = str(cmd[1]) if isinstance(cmd, list) and len(cmd) >= 2 else ""
    if typed and not typed.startswith("-") and os.path.basename(typed) == os.path.basename(file):
        return typed
    return file


def _torch_math(row: dict[str, Any]) -> bool:
    """The loop line calls torch itself and most of its time is inside that call.

    ``loss = F.cross_entropy(out, y)`` on a line of its own, ``clip_grad_norm_(...)``:
    tensor work the step needs, written where it is on purpose (the compute of the
    step, outside a module), not code to move or to run less often. A line that calls a
    function of the user's (``compute_metrics(out, y)``) is still reported.
    """
    call = row.get("library_call") or {}
    return (row.get("inner") is None and str(call.get("name") or "").startswith("torch.")
            and float(call.get("samples") or 0) >= 0.5 * float(row.get("samples") or 0))


def _loop_python_lines(ctx: Context) -> set[tuple[str, int]]:
    loops = (ctx.summary.get("ops") or {}).get("loops") or []
    return {(str(lp.get("file")), int(lp.get("line") or 0)) for lp in loops}


def _loop_rows(ctx: Context) -> tuple[list[dict[str, Any]], int, float] | None:
    """The loop lines "other" goes to that are the loop's own code, the "other" samples
    and the "other" share of step time; None where no line can be named."""
    stacks = ctx.summary.get("loop_stacks") or {}
    other_info = stacks.get("other") or {}
    # a framework's loop (Trainer(...).train(), trainer.fit(model)): the user's own lines in
    # it - its callbacks, hooks, training_step - not the framework's, which the script
    # cannot change (the report's "Other" line still shows those)
    framework = bool((stacks.get("loop") or {}).get("library"))
    rows: list[dict[str, Any]] = other_info.get("user_lines" if framework else "lines") or []
    n_other = int(other_info.get("samples") or 0)
    # "other" alone: the breakdown's "other" also holds named regions (prof.region), which
    # the samples keep apart
    detail = ctx.summary.get("breakdown_detail") or {}
    other = float(detail.get("other", ctx.breakdown.get("other")) or 0.0)
    if not rows or n_other < MIN_OTHER_SAMPLES or other < MEDIUM:
        return None
    if any(ld.get("iterated_in_thread") for ld in ctx.loaders):
        return None  # the wait for that thread's batches: loader_thread's finding
    # a line that also runs the model or the optimizer (``loss = F.cross_entropy(model(x),
    # y)``) is the step's own work: its "other" part is a functional loss, not extra code
    rows = [r for r in rows if r.get("file") is not None
            and float(r.get("phase_samples") or 0) < OWN_WORK * float(r.get("samples") or 0)
            and not _torch_math(r)]
    return rows, n_other, other


def _pageable_copy_row(ctx: Context, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The loop line that copies the DataLoader's pageable batches to the GPU, if one of
    the lines "other" goes to does (expert-rules.md T1: an async copy from pageable
    memory silently becomes synchronous). A CUDA run, a DataLoader with
    ``pin_memory=False``, and a line naming ``.cuda(`` or ``.to(``."""
    from trainprof.diagnosis.device import used_cuda

    if not used_cuda(ctx) or not any(ld.get("pin_memory") is False for ld in ctx.loaders):
        return None
    for r in rows:
        if int(r.get("samples") or 0) < MIN_LINE_SAMPLES:
            break
        if DEVICE_COPY.search(str(r.get("source") or "")):
            return r
    return None


def _claim(ctx: Context, row: dict[str, Any], other: float) -> tuple[float, float, str] | None:
    """(the share of syncs in step time, the line's gain, its severity), or None below the
    bands: the line's share of the "other" samples times what syncs leave of "other"."""
    sync_share = float((ctx.summary.get("syncs") or {}).get("share") or 0.0)
    gain = float(row["share"]) * max(0.0, other - sync_share)
    severity = band(gain, HIGH, MEDIUM)
    return None if severity is None else (sync_share, gain, severity)


def _line_evidence(row: dict[str, Any], other: float, sync_share: float,
                   n_other: int) -> dict[str, Any]:
    return {
        "other_share": other,
        "sync_share": sync_share,
        "line": f"{row['file']}:{row['line']}",
        "line_source": row.get("source") or "",
        "line_share_of_other_samples": row["share"],
        "line_samples": row["samples"],
        "other_samples": n_other,
    }


@rule("host_to_device.pageable_copy")
def pageable_copy(ctx: Context) -> Finding | None:
    """A loop line that copies pageable batches to the GPU: pin them, copy asynchronously.

    On an H100 (2026-11-26) a conv net fed 28 MB float batches by 2 workers with
    ``pin_memory=False`` spent 49% of its "other" samples on its
    ``x, y = x.cuda(non_blocking=True), ...`` line: from pageable memory the copy waits
    for the host to stage every byte, ``non_blocking`` or not.
    """
    found = _loop_rows(ctx)
    if found is None:
        return None
    rows, n_other, other = found
    row = _pageable_copy_row(ctx, rows)
    if row is None:
        return None
    claim = _claim(ctx, row, other)
    if claim is None:
        return None
    sync_share, gain, severity = claim
    from trainprof.diagnosis.input_pipeline import loader_snippet

    where = _where(row["file"], row["line"])
    source = row.get("source") or ""
    loader = next((ld for ld in ctx.loaders if ld.get("pin_memory") is False), None)
    workers = int((loader or {}).get("num_workers") or 0)
    evidence = {**_line_evidence(row, other, sync_share, n_other), "pin_memory": False}
    copy_line = "x = x.to(device, non_blocking=True)  # from pinned memory: asynchronous"
    snippet = (loader_snippet(loader, num_workers=workers, pin_memory=True,
                              comment="unchanged")
               + "\n...\n" + copy_line)
    title = (f"{gain * 100:.0f}% of step time goes to copying pageable batches to the GPU "
             f"at {where}" + (f" `{source}`" if source else ""))
    text = (
        f"{row['share'] * 100:.0f}% of {n_other} stack samples in the loop's own code "
        f"('other', {other * 100:.0f}% of the step) were on {where}, which copies a batch "
        "to the GPU, and the DataLoader's batches are in pageable memory "
        "(pin_memory=False): such a copy waits while the host stages every byte, whatever "
        "non_blocking says. With pin_memory=True the loader's pin thread copies each batch "
        "into page-locked memory in the background, and the copy to the GPU then runs "
        "asynchronously (non_blocking=True), overlapped with the step."
    )
    tune = f"trainprof tune --knob pin_memory=false,true {ctx.script}"
    verify = (f"{tune}  (the copy line's share of 'other', now {row['share'] * 100:.0f}%, "
              "should fall)")
    return Finding(category="host_to_device", cause="pageable_copy", title=title,
                   severity=severity, evidence=evidence, estimated_gain=gain,
                   fix=Fix(text=text, snippet=snippet), verify=verify, verify_commands=(tune,))


@rule("host_launch.loop_code")
def loop_code(ctx: Context) -> Finding | None:
    found = _loop_rows(ctx)
    if found is None:
        return None
    rows, n_other, other = found
    copy = _pageable_copy_row(ctx, rows)
    if copy is not None:  # that line's finding is the pageable copy's
        rows = [r for r in rows if r is not copy]
    if not rows or int(rows[0].get("samples") or 0) < MIN_LINE_SAMPLES:
        return None
    top = rows[0]
    inner = top.get("inner") or None
    python_loops = _loop_python_lines(ctx)
    if (top["file"], top["line"]) in python_loops or (
        inner and (inner["file"], inner["line"]) in python_loops
    ):
        return None  # the op count found a Python loop there: python_loop's finding
    claim = _claim(ctx, top, other)
    if claim is None:
        return None
    sync_share, gain, severity = claim

    where = _where(top["file"], top["line"])
    source = top.get("source") or ""
    loop = (ctx.summary.get("loop_stacks") or {}).get("loop") or {}
    evidence: dict[str, Any] = {
        **_line_evidence(top, other, sync_share, n_other),
        "step_median_s": ctx.step_info.get("median_s"),
        "loop_function": loop.get("function"),
    }
    detail = (f"{top['share'] * 100:.0f}% of {n_other} stack samples taken there were on "
              f"{where}" + (f" `{source}`" if source else ""))
    if loop.get("library"):
        called = loop.get("called_from") or {}
        detail += (f" (your code, which {loop.get('function')}, the training loop of the "
                   "framework" + (f" that {_where(called.get('file'), called.get('line'))} runs"
                                  if called else "") + ", calls every step)")
    elif loop.get("function"):
        detail += f" (in {loop['function']})"
    if inner:
        evidence["inner_line"] = f"{inner['file']}:{inner['line']}"
        evidence["inner_function"] = inner["function"]
        evidence["inner_share_of_other_samples"] = inner["share"]
        detail += (f", {inner['share'] * 100:.0f}% inside {inner['function']} at "
                   f"{_where(inner['file'], inner['line'])} `{inner.get('source') or ''}`")
    call = top.get("library_call") or None
    if call and call["share"] >= 0.5 * float(top["share"]):
        evidence["library_call"] = call["name"]
        detail += f", in {call['name']}"
    others = [r for r in rows[1:3] if r.get("file") is not None and r.get("share", 0) >= 0.1]
    if others:
        evidence["next_lines"] = [
            {"line": f"{r['file']}:{r['line']}", "share_of_other_samples": r["share"]}
            for r in others
        ]

    no_loader = not ctx.loaders
    node = _statement(source)
    expr, target = _call_expr(node), _target(node)
    in_place = _updates_in_place(node)
    text = (
        f"{other * 100:.0f}% of each step is spent in the training loop's own code, outside "
        "the DataLoader, the model, backward, zero_grad and the optimizer (phase 'other'); "
        f"{detail}. "
    )
    snippet = ""
    if no_loader:
        evidence["dataloader"] = None
    if in_place:
        evidence["updates_in_place"] = True
        text += (
            "The line updates a tensor in place, one tensor a call: run once per parameter "
            "(an average of the weights, a manual update), it launches a few small ops per "
            "tensor. Do it over all the tensors at once: torch's _foreach_ ops take lists "
            "(one op each for all of them), and torch.optim.swa_utils.AveragedModel keeps "
            "an exponential moving average of the weights that way."
        )
        snippet = (
            "from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn\n\n"
            "ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))  # once\n"
            f"ema.update_parameters(model)  # each step, instead of {where}\n"
            "# or, for any per-tensor update, all tensors in one op:\n"
            "# torch._foreach_lerp_(ema_params, model_params, 1 - 0.999)"
        )
    elif no_loader and target and expr:
        text += (
            "The run uses no DataLoader, so batches are made in the loop while the model "
            "waits. If this line makes the batch, let DataLoader worker processes make the "
            "next batches while the model computes (each worker reseeds torch, numpy and "
            "random, so random batches stay independent)."
        )
        snippet = (
            "from torch.utils.data import DataLoader, IterableDataset\n\n"
            "class Batches(IterableDataset):\n"
            "    def __iter__(self):\n"
            "        while True:\n"
            f"            yield {expr}  # was: {where}\n\n"
            "batches = iter(DataLoader(Batches(), batch_size=None, num_workers=2,\n"
            "                          persistent_workers=True, prefetch_factor=4))\n"
            "# in the loop, instead of the line above:\n"
            f"{target or 'batch'} = next(batches)"
        )
    else:
        text += (
            "If it is logging, a metric or a check, do it every N steps instead of every step; "
            "if it is data work, move it into the Dataset, where the DataLoader's workers do "
            "it in parallel; if it is per-element Python work on tensors, vectorise it."
        )
        if isinstance(node, ast.Expr):  # a call for its effect: log, check, write
            snippet = f"if step % 100 == 0:  # was: every step\n    {source}"
            if loop.get("library"):
                snippet = ("# step: the framework's step counter (Lightning: self.global_step;"
                           " a Hugging Face callback: state.global_step)\n" + snippet)
    text += " `trainprof run --py` profiles its functions."
    lines_target = None
    if inner and inner.get("function") and not str(inner["function"]).startswith("<"):
        lines_target = f"{_script_path(ctx, inner['file'])}:{inner['function']}"
    lines = f"trainprof run --lines {lines_target} {ctx.script}" if lines_target else ""
    measure = f"{lines}  (its time line by line); " if lines else ""
    compare = f"trainprof compare {ctx.summary.get('run_dir') or 'RUN'} <the new run>"
    verify = (
        f"{measure}after the change: {compare}  "
        f"('other', now {other * 100:.0f}% of the step, should fall by up to "
        f"{gain * 100:.0f} points)"
    )
    title = (f"{gain * 100:.0f}% of step time goes to {where}"
             + (f" `{source}`" if source else "")
             + " in the training loop, outside the model and the optimizer")
    return Finding(
        category="host_launch",
        cause="loop_code",
        title=title,
        severity=severity,
        evidence=evidence,
        estimated_gain=gain,
        fix=Fix(text=text, snippet=snippet),
        verify=verify,
        verify_commands=tuple(c for c in (lines, compare) if c),
    )
