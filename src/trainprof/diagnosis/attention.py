"""Attention computed op by op: use the fused kernel, ``F.scaled_dot_product_attention``.

Sources: expert-rules.md C7 ("unfused ops → fused layers"), made specific for the op
sequence that costs most in transformer training: the score matrix of eager attention is
(batch x heads x query length x key length), written and read again by the scaling, mask,
softmax, dropout and second product, forward and backward. FlashAttention (Dao et al.
2022) and memory-efficient attention (Rabe & Staats 2021), which
``torch.nn.functional.scaled_dot_product_attention`` dispatches to (and the CPU's flash
kernel), never store it. Hugging Face's performance guide names the switch
(``attn_implementation="sdpa"``); ``nn.MultiheadAttention`` takes the fused path only with
``need_weights=False``.

Evidence (:mod:`trainprof.analysis.attention`): the time of the ops on the score matrices
in the op count's window, and the fused kernel timed forward and backward at the same
shapes on the same machine at the end of the run. The gain is that measured saving: it
fires from :data:`MIN_SAVING` of the step. A run where the fused kernel could not be timed
(stopped early, a CPU rank of a launch) is judged on the bound (the ops' time beyond their
FLOPs' time at the matmul peak), from :data:`MIN_BOUND`, and says it is a bound.

On this project's 2-core VM, a two-block transformer in float32 (4 heads of 32, 1,024
tokens, batch 2): the attention's ops 78% of the step, the fused kernel measured at 0.30 of
their time, so "saves 54%"; the script changed to ``F.scaled_dot_product_attention`` ran
×0.43 (``trainprof compare``, 95% CI ×0.42–×0.43): the estimate is conservative, as
:mod:`trainprof.analysis.attention` says. With 2 heads of 64 the pair measured 0.93–1.03 (a
small finding or none) and the whole step ran ×0.92. In bfloat16 at 512 tokens and heads of
64 the CPU's fused kernel took 2.9 times the plain ops' time: the measurement says so, and
nothing fires.

Verify: for ``nn.MultiheadAttention`` the ``mha_need_weights`` knob (the script unchanged);
the same model on ``nn.MultiheadAttention`` "saves 53%", and ``trainprof verify`` said
"confirmed", ×0.50 (95% CI ×0.48–×0.51). Otherwise the code changes, and ``trainprof
compare`` measures it.
"""

from __future__ import annotations

from typing import Any

from trainprof.diagnosis.context import Context, number
from trainprof.diagnosis.finding import Finding, Fix
from trainprof.diagnosis.registry import rule

#: The least measured saving, as a share of the step, that makes a finding ...
MIN_SAVING = 0.03
#: ... and the least bound where the fused kernel was not timed.
MIN_BOUND = 0.1


def _where(shape: dict[str, Any]) -> str:
    file, line = shape.get("file"), shape.get("line")
    return f"{file}:{line}" if file else "the model"


def _fix(shape: dict[str, Any]) -> tuple[str, str]:
    """The fix's text and snippet for how the attention is written."""
    fused = ("torch.nn.functional.scaled_dot_product_attention computes the same in fused "
             "kernels (FlashAttention or memory-efficient attention on a GPU, a flash kernel "
             "on the CPU) that never store the score matrix; with is_causal=True for a causal "
             "mask it also skips the masked half.")
    if shape.get("multihead_attention"):
        return (
            "nn.MultiheadAttention computes its attention op by op when called with "
            "need_weights=True, its default, to return the averaged attention weights. "
            "Pass need_weights=False when the weights are not used (nn.TransformerEncoderLayer "
            "does): it then calls scaled_dot_product_attention. " + fused,
            "out, _ = self.attn(query, key, value, need_weights=False)  # fused attention",
        )
    if "transformers" in str(shape.get("file") or "").replace("\\", "/").split("/"):
        return (
            "This Hugging Face model runs its \"eager\" attention implementation. Load it with "
            "attn_implementation=\"sdpa\" (or \"flash_attention_2\" where installed). " + fused,
            'model = AutoModel.from_pretrained(name, attn_implementation="sdpa")',
        )
    return (
        f"The attention at {_where(shape)} is written out: the scores, their scaling, mask "
        "and softmax, and the product with the values, each an op reading and writing the "
        "whole score matrix, forward and backward. " + fused,
        "\n".join([
            "# before: att = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))",
            "#         y = att.masked_fill(mask, float(\"-inf\")).softmax(-1) @ v",
            "y = F.scaled_dot_product_attention(",
            "    q, k, v, dropout_p=p if self.training else 0.0, is_causal=True)  "
            "# or attn_mask=",
        ]),
    )


@rule("attention.eager")
def eager_attention(ctx: Context) -> Finding | None:
    att = ctx.summary.get("attention")
    if not isinstance(att, dict) or not att.get("shapes"):
        return None
    saving = number(att.get("saving_share"))
    bound = number(att.get("bound_share"))
    if saving is not None:
        if saving < MIN_SAVING:
            return None
        gain, measured = saving, True
    elif bound is not None and bound >= MIN_BOUND:
        gain, measured = bound, False
    else:
        return None
    top = att["shapes"][0]
    share = float(att["share"])
    text, snippet = _fix(top)
    device = "GPU" if top.get("device") == "cuda" else "CPU"
    shape = (f"{top['batch']} x {top['query_len']} x {top['key_len']} scores "
             f"(batch x heads, queries, keys; heads of {top['head_dim']}) in {top['dtype']}")
    how = (f"scaled_dot_product_attention, timed forward and backward against the plain ops "
           f"at the same shape on this {device} at the end of the run, took "
           f"{float(top.get('fused_ratio') or 0):.2f}x their time: about "
           f"{(att['s_per_step'] - att['saving_s_per_step']) * 1e3:.1f} ms a step"
           if measured else
           f"the fused kernel could not be timed here (the run did not finish, or a CPU rank "
           f"of a launch): the bound is the ops' time beyond the time their "
           f"{float(top.get('flops_per_step') or 0) / 1e9:.2f} GFLOP take at this {device}'s "
           "matmul peak")
    text = (f"The attention's ops on {shape} take {att['s_per_step'] * 1e3:.1f} ms a step, "
            f"{share * 100:.0f}% of it ({float(top.get('ops_per_step') or 0):.0f} ops a "
            f"step around {float(top.get('calls_per_step') or 0):.0f} attention calls); "
            f"{how}. " + text)
    command = (f"trainprof tune --knob mha_need_weights=true,false {ctx.script}"
               if top.get("multihead_attention") else f"trainprof run {ctx.script}")
    return Finding(
        category="compute", cause="eager_attention",
        title=(f"Attention is computed op by op ({share * 100:.0f}% of step time): "
               "F.scaled_dot_product_attention "
               f"{'measured here saves' if measured else 'could save up to'} {gain * 100:.0f}%"),
        severity="high" if gain >= 0.25 else "medium" if gain >= 0.08 else "low",
        evidence={
            "attention_share": share, "attention_s_per_step": att["s_per_step"],
            "where": _where(top), "scores": [top["batch"], top["query_len"], top["key_len"]],
            "head_dim": top["head_dim"], "dtype": top["dtype"],
            "calls_per_step": top.get("calls_per_step"), "ops_per_step": top.get("ops_per_step"),
            "fused_measured": measured,
            **({"fused_s_per_step": att["s_per_step"] - att["saving_s_per_step"]}
               if measured else {"bound_share": bound}),
            "multihead_attention": bool(top.get("multihead_attention")),
            "shapes": len(att["shapes"]),
        },
        estimated_gain=gain,
        fix=Fix(text=text, snippet=snippet),
        verify=(f"{command}  (nn.MultiheadAttention's calls on the fused path, the script "
                f"unchanged; {att['s_per_step'] * 1e3:.1f} ms a step of attention ops now)"
                if top.get("multihead_attention") else
                f"re-run `{command}` after the change and `trainprof compare` the two runs: "
                f"the step should lose about {gain * 100:.0f}% "
                f"({att['s_per_step'] * 1e3:.1f} ms a step of attention ops now)"),
        verify_commands=(command,),
    )
