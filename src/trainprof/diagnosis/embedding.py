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
:meth:`trainprof.capture.opcount.OpCount.count_embedding`), and run.json's optimizers the
parameters they step. The bound: the dense tables' share of the stepped parameters, times
the optimizer's and backward's share of the step, times the share of their rows a step does
not touch. Backward's part is an estimate (the dense gradient is ``rows x dim`` written each
step; the rest of backward is the model's), and the verify line measures the change.

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


def _dense_tables(ops: dict[str, Any]) -> list[dict[str, Any]]:
    tables = []
    for e in ops.get("embeddings") or []:
        if not isinstance(e, dict) or e.get("sparse"):
            continue
        rows, dim = number(e.get("rows")), number(e.get("dim"))
        touched = number(e.get("distinct_rows_per_step"))
        if not rows or not dim or touched is None or rows < MIN_ROWS:
            continue
        if touched > MAX_TOUCHED * rows:
            continue
        tables.append(e)
    return tables


@rule("embedding.dense_gradient")
def dense_embedding_gradient(ctx: Context) -> Finding | None:
    ops = ctx.summary.get("ops")
    if not isinstance(ops, dict):
        return None
    tables = _dense_tables(ops)
    stepped = sum(number(o.get("numel")) or 0.0 for o in ctx.summary.get("optimizers") or []
                  if isinstance(o, dict))
    if not tables or not stepped:
        return None
    numel = sum(float(e["rows"]) * float(e["dim"]) for e in tables)
    table_share = min(1.0, numel / stepped)
    untouched = 1.0 - sum(min(1.0, float(e["distinct_rows_per_step"]) / float(e["rows"]))
                          * float(e["rows"]) * float(e["dim"]) for e in tables) / numel
    shares = ctx.breakdown
    phases = float(shares.get("optimizer") or 0.0) + float(shares.get("backward") or 0.0)
    gain = phases * table_share * untouched
    severity = band(gain, HIGH, MEDIUM, LOW)
    if severity is None:
        return None
    big = max(tables, key=lambda e: float(e["rows"]) * float(e["dim"]))
    module = "nn.EmbeddingBag" if big.get("function") == "embedding_bag" else "nn.Embedding"
    rows, dim = int(big["rows"]), int(big["dim"])
    touched = float(big["distinct_rows_per_step"])
    several = f" ({len(tables)} such tables)" if len(tables) > 1 else ""
    title = (f"A {rows:,}-row embedding table with a dense gradient: every step updates all "
             f"its rows for the {touched:,.0f} it looks up; sparse gradients could save up "
             f"to {gain * 100:.0f}% of step time")
    text = (
        f"The model looks up {touched:,.0f} distinct rows a step of a {module}({rows:,}, "
        f"{dim}){several}, but its gradient is dense: backward writes a {rows:,} x {dim} "
        "gradient, and the optimizer reads and writes the whole table and its state at "
        f"every step. The tables are {table_share * 100:.0f}% of the parameters the "
        f"optimizers step; backward and the optimizer are {phases * 100:.0f}% of the step. "
        f"Build the table with sparse=True and step it with torch.optim.SparseAdam (or SGD, "
        "Adagrad), the rest of the model with its own optimizer: only the looked-up rows are "
        "written and updated. SparseAdam is 'lazy' Adam: rows a batch does not use keep "
        "their weights and moments (dense Adam moves every row at every step), and it has "
        "no weight decay; compare the loss curves."
    )
    snippet = "\n".join([
        f"emb = {module}({rows}, {dim}, sparse=True)  # the gradient holds the rows looked up",
        "sparse = [p for m in model.modules()",
        "          if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse",
        "          for p in m.parameters()]",
        "dense = [p for p in model.parameters() if all(p is not q for q in sparse)]",
        "opts = [torch.optim.SparseAdam(sparse, lr=lr), torch.optim.AdamW(dense, lr=lr)]",
        "# each step: for opt in opts: opt.zero_grad(); loss.backward(); for opt in opts: "
        "opt.step()",
    ])
    evidence = {
        "tables": [{k: v for k, v in e.items() if k in (
            "function", "rows", "dim", "device", "distinct_rows_per_step", "indices_per_step")}
            for e in tables],
        "table_share_of_stepped_params": table_share,
        "untouched_share": untouched,
        "backward_optimizer_share": phases,
        "step_median_s": ctx.median_step_s,
    }
    return Finding(
        category="compute", cause="dense_embedding_gradient", title=title, severity=severity,
        evidence=evidence, estimated_gain=gain, fix=Fix(text=text, snippet=snippet),
        verify=(f"trainprof run {ctx.script}  # after the change; then trainprof compare "
                "RUN_BEFORE RUN_AFTER (backward and optimizer should fall)"),
        # a faster implementation of the same dense update is moot where the tables are most
        # of what the optimizer steps
        supersedes=((("host_launch", "for_loop_optimizer"), ("host_launch", "foreach_optimizer"))
                    if table_share >= 0.5 else ()),
    )
