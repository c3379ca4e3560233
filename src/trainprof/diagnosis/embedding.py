"""A large embedding table with a dense gradient: every step writes and updates all its rows.

``nn.Embedding(rows, dim)`` (and ``nn.EmbeddingBag``) is trained with a dense gradient by
default: backward builds a ``rows x dim`` gradient, zeros everywhere but the rows the batch
looked up, and a dense optimizer (Adam, AdamW, SGD with momentum) then reads and writes the
whole table, and its state, at every step. A recommender's table of millions of rows of
which a batch touches a few thousand spends its step there. With ``sparse=True`` the
gradient holds only the looked-up rows (PyTorch's ``nn.Embedding`` documentation: "If True,
gradient w.r.t. weight matrix will be a sparse tensor"), and an optimizer that takes sparse
gradients (``torch.optim.SparseAdam``, ``SGD``, ``Adagrad``) updates only those: DLRM and
TorchRec train their tables this way. Measured here (2 cores): a table of 1,000,000 x 32
rows, 2,048 lookups a step, Adam: 0.59 s a step dense, 0.002-0.010 s sparse with SparseAdam.

Evidence: the op count's window records each trainable table it sees looked up (its rows,
width, whether the lookup asks for a sparse gradient, the distinct rows a step looks up:
:meth:`trainprof.capture.opcount.OpCountTool.count_embedding`), whether its weight also went
through another differentiable op (``dense_use``: a tied output layer's ``linear`` makes the
gradient dense whatever ``sparse`` says, and SparseAdam then fails with "SparseAdam does not
support dense gradients": no finding for such a table), whether an optimizer steps it
(``stepped``), and whether the script clips gradients (``clip_grad_norm_`` has no sparse
kernel). The bound: the lookups' op time (``op_time.share_of_step["lookup"]``, embedding ops
and their backward: :mod:`trainprof.capture.op_time`), scaled by the dense tables' share of
the trainable tables' elements, plus the optimizer's share of the step times the tables'
share of the stepped parameters, each times the share of their rows a step does not touch.
Without a timed window, backward's whole share stands for the lookups' (the old, looser
bound: a 200,000 x 32 table beside 2,048-wide layers was put at 45%, measured x0.91-0.95).

A table looked up with ``requires_grad=True`` that no optimizer steps (a pretrained table
left out of the optimizer to keep it frozen) is another finding,
``gradient_of_untrained_table``: backward computes its dense gradient every step for
nothing; ``weight.requires_grad_(False)`` stops that (bound: backward's share times the
table's share of the trainable tables; the lookups' op time fell short of the measured
gain). Sparse gradients would be the wrong advice: stepping the table would start training
it.

The snippet follows the script's optimizer: SGD and Adagrad take sparse gradients as they
are (checked on torch 2.13, SGD with momentum too), so ``sparse=True`` is the whole change
unless their weight decay is on (``add(sparse, dense) is not supported``: the tables go in a
group without it); other optimizers (Adam, AdamW) keep their class for the rest of the
model and SparseAdam steps the tables.

SparseAdam is "lazy" Adam: rows a batch does not look up keep their weights and moments,
where dense Adam moves every row with a non-zero moment at every step; it has no weight
decay. The fix says so: the loss curve is the check.
"""

from __future__ import annotations

from typing import Any

from trainprof.diagnosis.context import Context, number
from trainprof.diagnosis.finding import Finding, Fix, band
from trainprof.diagnosis.registry import rule

HIGH, MEDIUM, LOW = 0.20, 0.05, 0.02
#: A table counts from this many rows ...
MIN_ROWS = 10_000
#: ... when a step looks up at most this share of them.
MAX_TOUCHED = 0.1


def _rerun_commands(ctx: Context) -> tuple[str, str]:
    """A verify line's commands for a code change: the run again, and the comparison."""
    return f"trainprof run {ctx.script}", "trainprof compare RUN_BEFORE RUN_AFTER"


def _rerun(ctx: Context) -> str:
    """"after the change, `trainprof run ...`, then `trainprof compare ...`"."""
    run, compare = _rerun_commands(ctx)
    return f"after the change, `{run}`, then `{compare}`"


def _tables(ops: dict[str, Any]) -> list[dict[str, Any]]:
    """The large trainable tables of which a step looks up few rows."""
    tables = []
    for e in ops.get("embeddings") or []:
        if not isinstance(e, dict):
            continue
        rows, dim = number(e.get("rows")), number(e.get("dim"))
        touched = number(e.get("distinct_rows_per_step"))
        if not rows or not dim or touched is None or rows < MIN_ROWS:
            continue
        if touched > MAX_TOUCHED * rows:
            continue
        tables.append(e)
    return tables


def _numel(tables: list[dict[str, Any]]) -> float:
    return sum(float(e["rows"]) * float(e["dim"]) for e in tables)


def _trainable_numel(ops: dict[str, Any]) -> float:
    return sum((number(e.get("rows")) or 0.0) * (number(e.get("dim")) or 0.0)
               for e in ops.get("embeddings") or [] if isinstance(e, dict))


def _lookup_share(ctx: Context) -> float | None:
    """The lookups' share of the step (embedding ops and their backward), from the op-time
    window; None without one, or where other processes' load disturbed it."""
    timed = ctx.summary.get("op_time")
    if not isinstance(timed, dict) or timed.get("disturbed"):
        return None
    return number((timed.get("share_of_step") or {}).get("lookup"))


def _module(e: dict[str, Any]) -> str:
    return "nn.EmbeddingBag" if e.get("function") == "embedding_bag" else "nn.Embedding"


def _table_optimizer(ctx: Context) -> dict[str, Any] | None:
    """The optimizer that steps the tables: the one with the most parameters."""
    opts = [o for o in ctx.summary.get("optimizers") or [] if isinstance(o, dict)]
    return max(opts, key=lambda o: number(o.get("numel")) or 0.0) if opts else None


#: optimizers whose step takes sparse gradients as they are (torch.optim's docs; checked
#: on torch 2.13: SGD with and without momentum, Adagrad)
_TAKE_SPARSE = ("SGD", "Adagrad")


#: the lines that name the tables' parameters and the rest of the model's
_SPLIT = [
    "sparse = [p for m in model.modules()",
    "          if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse",
    "          for p in m.parameters()]",
    "dense = [p for p in model.parameters() if all(p is not q for q in sparse)]",
]


def _snippet(big: dict[str, Any], opt: dict[str, Any] | None, clips: bool) -> tuple[str, str]:
    """The change fitted to the script's optimizer (every line valid Python), and a
    sentence on it."""
    module, rows, dim = _module(big), int(big["rows"]), int(big["dim"])
    cls = str((opt or {}).get("class") or "torch.optim.Adam").rsplit(".", 1)[-1]
    decay = number((opt or {}).get("weight_decay")) or 0.0
    lines = [f"emb = {module}({rows}, {dim}, sparse=True)  # the gradient holds the rows "
             "looked up"]
    if cls in _TAKE_SPARSE and not decay:
        lines += [f"# torch.optim.{cls} takes sparse gradients: the optimizer stays as it is"]
        if clips:
            lines += _SPLIT
        say = f"torch.optim.{cls}, the script's optimizer, takes sparse gradients as it is."
    elif cls in _TAKE_SPARSE:
        lines += [*_SPLIT,
                  f"opt = torch.optim.{cls}([{{'params': sparse, 'weight_decay': 0}}, "
                  f"{{'params': dense}}], lr=lr, weight_decay={decay:g})"]
        say = (f"torch.optim.{cls}, the script's optimizer, takes sparse gradients but not "
               "with weight decay (add(sparse, dense) is not supported): the tables go in a "
               "group of their own without it.")
    else:
        lines += [*_SPLIT,
                  f"opts = [torch.optim.SparseAdam(sparse, lr=lr), torch.optim.{cls}(dense, "
                  "lr=lr)]",
                  "for o in opts: o.zero_grad()  # in the loop, in place of opt.zero_grad()",
                  "loss.backward()",
                  "for o in opts: o.step()  # in place of opt.step()"]
        say = (f"Step the tables with torch.optim.SparseAdam and the rest of the model with "
               f"torch.optim.{cls}, as now ({cls} rejects sparse gradients). SparseAdam is "
               "'lazy' Adam: rows a batch does not use keep their weights and moments "
               "(dense Adam moves every row at every step), and it has no weight decay; "
               "compare the loss curves.")
    if clips:
        clip = ("torch.nn.utils.clip_grad_norm_(dense, max_norm)  # in place of the script's "
                "clipping: it fails on sparse gradients")
        at = lines.index("loss.backward()") + 1 if "loss.backward()" in lines else len(lines)
        lines.insert(at, clip)
        say += (" The script clips gradients: torch.nn.utils.clip_grad_norm_ fails on sparse "
                "ones (linalg_vector_norm has no sparse kernel); clip the dense parameters.")
    else:
        say += " (torch.nn.utils.clip_grad_norm_ fails on sparse gradients.)"
    return "\n".join(lines), say


@rule("embedding.dense_gradient")
def dense_embedding_gradient(ctx: Context) -> Finding | None:
    ops = ctx.summary.get("ops")
    if not isinstance(ops, dict):
        return None
    found = [e for e in _tables(ops) if not e.get("sparse")]
    # a table whose weight another op also takes (a tied output layer) keeps a dense
    # gradient with sparse=True; one no optimizer steps has its own finding
    tied = [e for e in found if e.get("dense_use")]
    tables = [e for e in found if not e.get("dense_use") and e.get("stepped") is not False]
    stepped = sum(number(o.get("numel")) or 0.0 for o in ctx.summary.get("optimizers") or []
                  if isinstance(o, dict))
    if not tables or not stepped:
        return None
    numel = _numel(tables)
    table_share = min(1.0, numel / stepped)
    untouched = 1.0 - sum(min(1.0, float(e["distinct_rows_per_step"]) / float(e["rows"]))
                          * float(e["rows"]) * float(e["dim"]) for e in tables) / numel
    shares = ctx.breakdown
    optimizer = float(shares.get("optimizer") or 0.0)
    lookup = _lookup_share(ctx)
    of_tables = min(1.0, numel / (_trainable_numel(ops) or numel))
    if lookup is not None:
        # the lookups' op time (forward and backward; the dense tables' part of it) and the
        # optimizer's update of the tables, each for the rows a step does not touch
        gain = (lookup * of_tables + optimizer * table_share) * untouched
        phases = lookup * of_tables + optimizer
    else:  # no timed window: backward's whole share stands for the lookups'
        phases = optimizer + float(shares.get("backward") or 0.0)
        gain = phases * table_share * untouched
    severity = band(gain, HIGH, MEDIUM, LOW)
    if severity is None:
        return None
    big = max(tables, key=lambda e: float(e["rows"]) * float(e["dim"]))
    module = _module(big)
    rows, dim = int(big["rows"]), int(big["dim"])
    touched = float(big["distinct_rows_per_step"])
    several = f" ({len(tables)} such tables)" if len(tables) > 1 else ""
    clips = bool(ops.get("clips_grads"))
    snippet, say = _snippet(big, _table_optimizer(ctx), clips)
    title = (f"A {rows:,}-row embedding table with a dense gradient: every step updates all "
             f"its rows for the {touched:,.0f} it looks up; sparse gradients could save up "
             f"to {gain * 100:.0f}% of step time")
    timed = (f"the lookups and their backward are {lookup * 100:.0f}% of the step and the "
             f"optimizer {optimizer * 100:.0f}%" if lookup is not None else
             f"backward and the optimizer are {phases * 100:.0f}% of the step")
    tied_note = (f" Not counted: {len(tied)} table(s) whose weight another op also takes "
                 f"({', '.join(sorted({str(e['dense_use']) for e in tied}))}: a tied output "
                 "layer), whose gradient stays dense with sparse=True." if tied else "")
    text = (
        f"The model looks up {touched:,.0f} distinct rows a step of a {module}({rows:,}, "
        f"{dim}){several}, but its gradient is dense: backward writes a {rows:,} x {dim} "
        "gradient, and the optimizer reads and writes the whole table and its state at "
        f"every step. The tables are {table_share * 100:.0f}% of the parameters the "
        f"optimizers step; {timed}. Build the table with sparse=True: only the looked-up "
        f"rows are written and updated. {say}{tied_note}"
    )
    evidence = {
        "tables": [{k: v for k, v in e.items() if k in (
            "function", "rows", "dim", "device", "distinct_rows_per_step", "indices_per_step")}
            for e in tables],
        "table_share_of_stepped_params": table_share,
        "untouched_share": untouched,
        "optimizer_share": optimizer,
        "lookup_share": lookup,
        "dense_tables_share_of_tables": of_tables,
        "backward_optimizer_share": phases,
        "clips_grads": clips,
        "step_median_s": ctx.median_step_s,
    }
    if tied:
        evidence["tied_tables"] = [{k: e.get(k) for k in ("rows", "dim", "dense_use")}
                                   for e in tied]
    moot = [("host_launch", "for_loop_optimizer"), ("host_launch", "foreach_optimizer")]
    return Finding(
        category="compute", cause="dense_embedding_gradient", title=title, severity=severity,
        evidence=evidence, estimated_gain=gain, fix=Fix(text=text, snippet=snippet),
        verify=f"{_rerun(ctx)}: backward and optimizer should fall",
        verify_commands=_rerun_commands(ctx),
        # a faster implementation of the same dense update is moot where the tables are most
        # of what the optimizer steps; torch.compile does not make the dense gradient's
        # writes cheaper either
        supersedes=((*moot, ("compute", "unfused_ops")) if table_share >= 0.5
                    else (("compute", "unfused_ops"),)),
    )


@rule("embedding.untrained_table")
def gradient_of_untrained_table(ctx: Context) -> Finding | None:
    """A table with requires_grad=True that no optimizer steps: its dense gradient is
    computed every step for nothing."""
    ops = ctx.summary.get("ops")
    if not isinstance(ops, dict):
        return None
    tables = [e for e in _tables(ops) if e.get("stepped") is False and not e.get("sparse")]
    if not tables:
        return None
    of_tables = min(1.0, _numel(tables) / (_trainable_numel(ops) or 1.0))
    lookup = _lookup_share(ctx)
    # backward's share, not the lookups' op time: the dense gradient's allocation and
    # first-touch page faults land on other ops too (frozen2.py, 1,000,000 x 32: lookups
    # 55% of the step, requires_grad_(False) measured x0.35 of the step time, interleaved)
    gain = float(ctx.breakdown.get("backward") or 0.0) * of_tables
    severity = band(gain, HIGH, MEDIUM, LOW)
    if severity is None:
        return None
    big = max(tables, key=lambda e: float(e["rows"]) * float(e["dim"]))
    module, rows, dim = _module(big), int(big["rows"]), int(big["dim"])
    title = (f"A {rows:,}-row embedding table that no optimizer steps still gets its "
             f"gradient every step; requires_grad_(False) could save up to {gain * 100:.0f}% "
             "of step time")
    text = (
        f"The {module}({rows:,}, {dim}) is looked up with requires_grad=True, but it is in "
        "none of the optimizers' param_groups: backward writes its dense "
        f"{rows:,} x {dim} gradient every step, and nothing reads it. If the table is meant "
        "frozen (a pretrained one left out of the optimizer), turn its gradient off; if it is "
        "meant to train, add it to an optimizer (then see the sparse-gradient advice). "
        + (f"The lookups and their backward are {lookup * 100:.0f}% of the step."
           if lookup is not None else "")
    )
    snippet = "emb.weight.requires_grad_(False)  # frozen: backward no longer computes its gradient"
    return Finding(
        category="compute", cause="gradient_of_untrained_table", title=title,
        severity=severity,
        evidence={"tables": [{k: e.get(k) for k in ("function", "rows", "dim", "device",
                                                    "distinct_rows_per_step")}
                             for e in tables],
                  "lookup_share": lookup, "untrained_share_of_tables": of_tables,
                  "step_median_s": ctx.median_step_s},
        estimated_gain=gain, fix=Fix(text=text, snippet=snippet),
        verify=f"{_rerun(ctx)}: backward should fall",
        verify_commands=_rerun_commands(ctx),
        supersedes=(("compute", "unfused_ops"),),
    )
