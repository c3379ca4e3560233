"""Padding: the model computes on positions of the batch that hold no token.

Measured, not inferred: :mod:`trainprof.capture.padding` reads the first batches of
each DataLoader and counts, in its padded sequence tensor (attention mask, token
ids), the real positions, the padding, and the columns that are padding in every row.
Every layer of a sequence model (embedding, projections, MLPs, the attention, the loss)
runs on every position, the padding included, and so do their backward passes.

The estimate is linear in the positions: the model's share of the step (forward and
backward) times the share of positions that are padding, the most that batching
sequences of similar length and padding each batch to its longest can remove
(:class:`trainprof.fixes.LengthGroupedBatchSampler` with
:class:`trainprof.fixes.TrimPadding`). Attention, quadratic in the length, saves more
than that; a step too short for the device's work to matter (launch-bound) saves less.
``trainprof tune --knob trim_padding=false,true`` measures the trimming alone. Seen
here: a 2-layer Transformer encoder classifying sequences of 8-40 tokens padded to 128
(81% padding, 70% of the positions in columns of padding only, forward and backward 93%
of the step, CPU): the finding estimated up to 76%, trimming alone 65%;
``trainprof tune --knob trim_padding=false,true`` measured x0.33 of the step (3 trials
each, 95% CI x0.30-x0.37).

A model that packs its sequences (``torch.nn.utils.rnn.pack_padded_sequence``, seen by
the op count's window) is left alone: its RNN skips the padding already. An LSTM
classifier on the same sequences, packed, read 82% padding and was the case that taught
this.

Bands: >= 20% high, >= 5% medium, >= 2% low, as the other compute rules'. Below
:data:`MIN_PAD_SHARE` of the positions nothing is reported: a few pad positions a
batch are the edges of sequences that happen to end alike.
"""

from __future__ import annotations

from typing import Any

from trainprof.diagnosis.context import Context
from trainprof.diagnosis.finding import Finding, Fix, band
from trainprof.diagnosis.registry import rule

HIGH, MEDIUM, LOW = 0.20, 0.05, 0.02
#: Padding below this share of the positions is not reported.
MIN_PAD_SHARE = 0.10
#: Trimming that removes at least this share of positions is the fix to give first.
MIN_TRIM_SHARE = 0.05
#: Padding left after trimming, from which grouping by length is worth its change.
MIN_GROUPING_SHARE = 0.10


def _entry(ctx: Context) -> dict[str, Any] | None:
    """The padding read from the training loader's batches (the only loader read, else)."""
    entries = [e for e in ctx.summary.get("padding") or [] if isinstance(e, dict)]
    if not entries:
        return None
    loader = ctx.train_loader
    index = (loader or {}).get("index")
    found = next((e for e in entries if e.get("loader_index") == index), None)
    if found is None and len(entries) == 1 and (loader is None or len(ctx.loaders) == 1):
        found = entries[0]
    return found


def _packs_sequences(ctx: Context) -> bool:
    """The op count's window saw the model pack its sequences (``pack_padded_sequence``):
    its RNN runs on the real positions only, and trimming the batch saves little more."""
    ops = ctx.summary.get("ops")
    return isinstance(ops, dict) and float(ops.get("packed_sequences_per_step") or 0) > 0


def _attends(ctx: Context) -> bool:
    """The op count's window saw attention ops: the fused kernels' time, or attention
    computed op by op (``op_time``'s ``fused_attention`` / ``attention``,
    ``ops.eager_attention``). Not seen, or not counted: the text names no attention (an
    LSTM's padding was said to cost attention)."""
    op_time = ctx.summary.get("op_time")
    kinds = (op_time or {}).get("s_per_step") if isinstance(op_time, dict) else None
    if isinstance(kinds, dict) and any(float(kinds.get(k) or 0) > 0
                                       for k in ("fused_attention", "attention")):
        return True
    ops = ctx.summary.get("ops")
    return isinstance(ops, dict) and bool(ops.get("eager_attention"))


@rule("padding.padded_sequences")
def padded_sequences(ctx: Context) -> Finding | None:
    entry = _entry(ctx)
    if entry is None or _packs_sequences(ctx):
        return None
    pad = float(entry.get("pad_share") or 0.0)
    trim = float(entry.get("trim_share") or 0.0)
    if pad < MIN_PAD_SHARE:
        return None
    shares = ctx.breakdown
    model = float(shares.get("forward") or 0.0) + float(shares.get("backward") or 0.0)
    gain = model * pad
    attends = _attends(ctx)
    severity = band(gain, HIGH, MEDIUM, LOW)
    if severity is None:
        return None
    length_min, length_max = entry.get("length_min"), entry.get("length_max")
    fixed = bool(entry.get("fixed_length"))
    tensor = str(entry.get("tensor") or "the batch")
    mean_real = float(entry.get("mean_real") or 0.0)
    mean_longest = float(entry.get("mean_longest") or 0.0)
    trims = trim >= MIN_TRIM_SHARE
    group = pad - trim >= MIN_GROUPING_SHARE or not trims
    loader = ctx.train_loader or {}
    evidence = {
        "pad_share": pad, "trim_share": trim, "model_share": model,
        "padded_length": length_max if fixed else [length_min, length_max],
        "mean_real_tokens": mean_real, "mean_longest_in_batch": mean_longest,
        "tensor": tensor, "side": entry.get("side"), "pad_value": entry.get("pad_value"),
        "batches_read": entry.get("batches"), "step_median_s": ctx.median_step_s,
        "loader": {k: loader.get(k) for k in ("index", "dataset", "batch_size", "collate_fn")
                   if k in loader},
    }
    length_text = (f"padded to {length_max} positions" if fixed
                   else f"padded to {length_min}-{length_max} positions")
    title = (f"{pad * 100:.0f}% of the token positions the model computes on are padding "
             f"({tensor} {length_text}; {mean_real:.0f} real tokens a row on average)")
    text = (
        f"The batches' sequences ({tensor}, read in {entry.get('batches')} batches) are "
        f"{length_text}, but a row holds {mean_real:.0f} real tokens on average and the "
        f"longest row of a batch {mean_longest:.0f}: {pad * 100:.0f}% of the positions are "
        "padding, and the model computes on every one of them (embedding, "
        f"{'attention, ' if attends else ''}projections, the loss, and all of their "
        "backward passes) for nothing: the "
        f"forward and backward passes are {model * 100:.0f}% of the step."
    )
    lines: list[str] = []
    collate = str(loader.get("collate_fn") or "")
    inner = ("" if not collate or collate.endswith("default_collate")
             else collate.rsplit(".", 1)[-1])
    batch_size = loader.get("batch_size") or loader.get("batch_sampler_batch_size")
    # automatic batching off (batch_size=None and no batch sampler): the dataset batches
    unbatched = bool(loader) and batch_size is None
    batch_size = batch_size or 32
    if trims:
        text += (
            f" Padding each batch only to its longest sequence removes {trim * 100:.0f}% of "
            "the positions: `trainprof.fixes.TrimPadding` wraps the collate_fn and cuts the "
            f"columns that are padding in every row from each ({length_max}-position) tensor "
            "of the batch (ids, mask, labels) - or, with a Hugging Face tokenizer, tokenize "
            "with padding=\"longest\" per batch (DataCollatorWithPadding) instead of "
            "padding=\"max_length\". A model that reshapes to the fixed length must accept a "
            "variable one first; under torch.compile or CUDA graphs, each new length compiles "
            "again: TrimPadding(multiple_of=64) keeps the lengths to a few (multiple_of=8 "
            "suits tensor cores)."
        )
        if unbatched:
            # batch_size=None: the dataset yields whole batches, and collate_fn sees one
            # batch at a time as a sample; the batch is cut where the loop receives it
            lines += [
                "from trainprof.fixes import trim_padding",
                "",
                "for batch in loader:",
                "    batch = trim_padding(batch)  # only as long as its longest sequence",
            ]
        else:
            lines += [
                "from trainprof.fixes import TrimPadding",
                "",
                f"loader = DataLoader(..., collate_fn=TrimPadding({inner}))  # each batch only "
                "as long as its longest sequence",
            ]
    if group:
        text += (
            (" Batching sequences of similar length as well" if trims else
             " Each batch is already padded to its longest sequence, so the padding is "
             "sequences of very different lengths sharing a batch. Batching sequences of "
             "similar length")
            + f" leaves at most the rest of the {pad * 100:.0f}%: "
            "`trainprof.fixes.LengthGroupedBatchSampler` sorts pools of 50 batches by length "
            "and shuffles the batches (Hugging Face Trainer's group_by_length=True does the "
            "same)."
        )
        collate_arg = (f", collate_fn=TrimPadding({inner})" if trims and not unbatched
                       else ", ...")
        lines += [
            *(["", "# and, to batch sequences of similar length:"] if lines else []),
            "from trainprof.fixes import LengthGroupedBatchSampler",
            "",
            "lengths = [...]  # each sample's number of real tokens, before padding",
            f"sampler = LengthGroupedBatchSampler(lengths, batch_size={batch_size})",
            f"loader = DataLoader(dataset, batch_sampler=sampler{collate_arg})  # no "
            "batch_size, shuffle or sampler",
        ]
    text += (" The estimate is linear in the positions: "
             + ("the attention, quadratic, saves more; " if attends else "")
             + "a step too short for its math to matter saves less.")
    command = (f"trainprof tune --knob trim_padding=false,true {ctx.script}" if trims else
               f"trainprof compare {ctx.summary.get('run_dir') or 'RUN_DIR'} NEW_RUN")
    verify = (f"{command}  (trims every batch as TrimPadding would: the step should fall by "
              f"up to {model * trim * 100:.0f}%)" if trims else
              f"after the change, {command} (padding now {pad * 100:.0f}% of the positions)")
    return Finding(
        category="compute", cause="padding", title=title, severity=severity,
        evidence=evidence, estimated_gain=gain, fix=Fix(text=text, snippet="\n".join(lines)),
        verify=verify, verify_commands=(command,),
    )
