"""Float32 math on a CPU that computes bfloat16 natively: mixed precision left unused.

A CPU with AVX-512 BF16 (Intel Cooper Lake, AMD Zen 4 and later) multiplies bfloat16
pairs at twice its float32 rate ("Bfloat16 theoretical compute throughput is doubled
over float32", PyTorch's blog "Empowering PyTorch on Intel Xeon Scalable processors
with Bfloat16", which measured 1.4-1.6x on DLRM and ResNets); one with AMX (Sapphire
Rapids on) runs 1,024 bfloat16 operations a cycle a core in its matrix tiles, against
AVX-512's 64 float32 (two 16-wide FMAs): 16x. ``torch.autocast("cpu",
dtype=torch.bfloat16)`` runs a model's matrix products and convolutions in bfloat16 and
keeps float32 where precision matters, with no loss scaling (bfloat16 has float32's
exponent range); the parameters and the optimizer stay float32.

Evidence: the CPU's flags (the fingerprint's ``cpu.bf16``: ``amx_bf16`` or
``avx512_bf16``), and the op count's window, which counts matrix products called from
Python in float32 on the CPU outside CPU autocast, with their FLOPs. Small products lose:
the casts cost more than the math saves (``benchmarks/cpu_bf16.py`` on this project's
VM: 0.3-4 MFLOP products x1.28-x1.81 in bfloat16; a tiny GPT of 34 MFLOP products ran
1.56x slower); only products of 128 MFLOP or more count:
:data:`trainprof.schema.BIG_MATMUL_FLOPS`). The gain bound is the model's share
of the step (forward and backward) times ``1 - 1/16`` with AMX, ``1 - 1/2`` with
AVX-512 BF16, times the large products' share of the FLOPs; without a large product
nothing is said. Element-wise ops and the Python between them gain less, which the
verify line measures. Seen here (AVX-512 BF16, 2 cores; ``trainprof tune --knob
autocast=off,bf16``, 3 trials each): a 3-layer MLP of 2048-wide layers, "up to 43%",
x0.58 of the step (95% CI x0.53-x0.62); a 2-layer Transformer encoder 128 wide, its
products 537 MFLOP, "up to 48%", x0.86 (x0.82-x0.92): its layer norms, softmaxes and
casts gain nothing.

Not on CUDA runs (the TF32 and device rules speak for GPUs), nor where the matrix
products are not mostly float32 outside autocast.

The converse, :func:`cpu_autocast_small` (``autocast_loses_on_cpu``): a script that runs
its model under CPU autocast whose products are too small for 16 bits to gain, or on a
CPU with neither flag, where torch emulates bfloat16 (``benchmarks/cpu_bf16.py``: every
size loses there). Its bound takes the slowest of the benchmark's small products,
x1.81 (0.3 MFLOP): turning autocast off saves at most ``1 - 1/1.81`` of the model's
share of the step, times the small products' share of the FLOPs (all of them when
emulated); the verify line measures the script's own ratio.
"""

from __future__ import annotations

from trainprof.diagnosis.context import Context, number
from trainprof.diagnosis.finding import Finding, Fix, band
from trainprof.diagnosis.registry import rule
from trainprof.schema import BIG_MATMUL_FLOPS

HIGH, MEDIUM, LOW = 0.20, 0.05, 0.02
#: Peak bfloat16 throughput over float32's, by the CPU's best bfloat16 instructions.
SPEEDUP = {"amx_bf16": 16.0, "avx512_bf16": 2.0}
#: Float32 matrix products outside autocast, as a share of all, from which the rule speaks.
MOSTLY_FP32 = 0.5
BIG_MATMUL_MFLOP = BIG_MATMUL_FLOPS / 1e6


#: The most a step's model time grew under CPU bfloat16 autocast in the benchmark's cases of
#: small products (``benchmarks/cpu_bf16.py``: 0.3 MFLOP products x1.81, 4.2 MFLOP x1.28).
SMALL_PRODUCT_SLOWDOWN = 1.81
#: Autocast dtypes of 16 bits (the rule's subject); the names opcount records.
_HALF_DTYPES = {"bfloat16": "bfloat16", "float16": "float16"}


@rule("precision.cpu_float32")
def cpu_float32(ctx: Context) -> Finding | None:
    flag = ctx.environment.get("cpu_bf16")
    if ctx.on_cuda or flag not in SPEEDUP:
        return None
    ops = ctx.summary.get("ops")
    if not isinstance(ops, dict):
        return None
    matmuls, fp32 = number(ops.get("matmul_per_step")), number(ops.get("cpu_fp32_matmul_per_step"))
    if not matmuls or fp32 is None or fp32 < MOSTLY_FP32 * matmuls:
        return None
    flops = number(ops.get("cpu_fp32_matmul_flops_per_step"))
    big = number(ops.get("cpu_fp32_big_matmul_flops_per_step"))
    if not flops or not big:
        return None  # no product large enough to gain (or their sizes unknown)
    big_share = big / flops
    shares = ctx.breakdown
    model = float(shares.get("forward") or 0.0) + float(shares.get("backward") or 0.0)
    gain = model * (1.0 - 1.0 / SPEEDUP[flag]) * big_share
    severity = band(gain, HIGH, MEDIUM, LOW)
    if severity is None:
        return None
    unit = "AMX tiles" if flag == "amx_bf16" else "AVX-512 BF16 instructions"
    title = (f"The model computes in float32 on a CPU with {unit}: bfloat16 autocast could "
             f"save up to {gain * 100:.0f}% of step time")
    text = (
        f"This CPU has {unit} ({flag}): it computes bfloat16 matrix products "
        f"{SPEEDUP[flag]:.0f}x as fast as float32 at its peak. The model's "
        f"{fp32:.0f} matrix products a step (of {matmuls:.0f}) run in float32, "
        f"{flops / fp32 / 1e6:.0f} MFLOP each on average, {big_share * 100:.0f}% of their "
        "FLOPs in products large enough for bfloat16 to gain (smaller ones lose to the "
        f"casts), and its forward and backward passes are {model * 100:.0f}% of the step. "
        "Run the forward "
        "(model and loss) under torch.autocast(\"cpu\", dtype=torch.bfloat16): matrix "
        "products and convolutions in bfloat16, reductions and losses kept in float32, the "
        "parameters and the optimizer unchanged, and no loss scaling (bfloat16 has "
        "float32's range). Check that the loss curve follows the float32 one."
    )
    snippet = "\n".join([
        'with torch.autocast("cpu", dtype=torch.bfloat16):',
        "    loss = loss_fn(model(x), y)",
        "loss.backward()  # outside: each op's backward runs in its forward's dtype",
        "opt.step()",
    ])
    evidence = {"cpu_bf16": flag, "peak_speedup": SPEEDUP[flag], "model_share": model,
                "matmul_per_step": matmuls, "cpu_fp32_matmul_per_step": fp32,
                "mflop_per_product": flops / fp32 / 1e6, "large_product_flop_share": big_share,
                "step_median_s": ctx.median_step_s}
    return Finding(
        category="compute", cause="float32_on_bf16_cpu", title=title, severity=severity,
        evidence=evidence, estimated_gain=gain, fix=Fix(text=text, snippet=snippet),
        verify=(f"trainprof tune --knob autocast=off,bf16 {ctx.script}  (the model's calls "
                "under bfloat16 autocast, the script unchanged)"),
        verify_commands=(f"trainprof tune --knob autocast=off,bf16 {ctx.script}",),
    )


@rule("precision.cpu_autocast_small")
def cpu_autocast_small(ctx: Context) -> Finding | None:
    """CPU autocast where 16 bits cannot gain: products too small, or no native bfloat16."""
    if ctx.on_cuda:
        return None
    ops = ctx.summary.get("ops")
    if not isinstance(ops, dict):
        return None
    dtype = _HALF_DTYPES.get(str(ops.get("cpu_autocast_dtype")))
    matmuls = number(ops.get("matmul_per_step"))
    under = number(ops.get("cpu_autocast_matmul_per_step"))
    if dtype is None or not matmuls or under is None or under < MOSTLY_FP32 * matmuls:
        return None
    flops = number(ops.get("cpu_autocast_matmul_flops_per_step"))
    big = number(ops.get("cpu_autocast_big_matmul_flops_per_step")) or 0.0
    if not flops:
        return None  # the products' sizes unknown
    flag = ctx.environment.get("cpu_bf16")
    native = dtype == "bfloat16" and flag in SPEEDUP
    small_share = 1.0 - big / flops if native else 1.0
    if small_share < 0.5:
        return None  # mostly large products on a CPU that computes them in 16 bits
    shares = ctx.breakdown
    model = float(shares.get("forward") or 0.0) + float(shares.get("backward") or 0.0)
    gain = model * (1.0 - 1.0 / SMALL_PRODUCT_SLOWDOWN) * small_share
    severity = band(gain, HIGH, MEDIUM, LOW)
    if severity is None:
        return None
    mflop = flops / under / 1e6
    if native:
        why = (f"its {under:.0f} matrix products a step are small ({mflop:.1f} MFLOP each on "
               f"average; {small_share * 100:.0f}% of their FLOPs in products under "
               f"{BIG_MATMUL_MFLOP:.0f} MFLOP), and on a CPU the casts autocast adds around "
               "each one cost more than bfloat16 saves on products that size")
        title = (f"CPU autocast on small matrix products slows the model: turning it off "
                 f"could save up to {gain * 100:.0f}% of step time")
    else:
        unit = "bfloat16" if dtype == "bfloat16" else "float16"
        why = (f"this CPU has no native {unit} arithmetic ("
               + ("neither avx512_bf16 nor amx_bf16 in its flags"
                  if dtype == "bfloat16" else "torch computes float16 on it through float32")
               + f"): torch emulates it, and every one of the model's {under:.0f} matrix "
               "products a step pays for the casts with no faster math")
        title = (f"CPU autocast to {unit} on a CPU without native {unit}: turning it off "
                 f"could save up to {gain * 100:.0f}% of step time")
    text = (
        f"The model runs under torch.autocast(\"cpu\", dtype=torch.{dtype}), but {why}. "
        f"Its forward and backward passes are {model * 100:.0f}% of the step; in "
        f"benchmarks/cpu_bf16.py small products ran up to {SMALL_PRODUCT_SLOWDOWN:.2f}x "
        "slower under autocast than in float32. Train in float32 on this CPU (remove the "
        "autocast context or pass enabled=False); keep autocast only around parts whose "
        f"products are large ({BIG_MATMUL_MFLOP:.0f} MFLOP or more) on a CPU with "
        "avx512_bf16 or amx_bf16."
    )
    snippet = "\n".join([
        f'use_autocast = False  # {dtype} loses on this CPU at these sizes',
        f'with torch.autocast("cpu", dtype=torch.{dtype}, enabled=use_autocast):',
        "    loss = loss_fn(model(x), y)",
    ])
    evidence = {"cpu_bf16": flag, "autocast_dtype": dtype, "model_share": model,
                "matmul_per_step": matmuls, "cpu_autocast_matmul_per_step": under,
                "mflop_per_product": mflop, "small_product_flop_share": small_share,
                "assumed_slowdown": SMALL_PRODUCT_SLOWDOWN, "step_median_s": ctx.median_step_s}
    return Finding(
        category="compute", cause="autocast_loses_on_cpu", title=title, severity=severity,
        evidence=evidence, estimated_gain=gain, fix=Fix(text=text, snippet=snippet),
        # the baseline is the script's own autocast (its dtype, float16 or bfloat16), not
        # the knob's bf16: from a float16 script a bf16 arm measured 29% saved where turning
        # the script's own float16 off saved ~77%
        verify=(f"trainprof tune --knob autocast=script,off {ctx.script}  (script: the "
                f"script's own {dtype} autocast, untouched; off: the model's calls with "
                "autocast disabled, the script unchanged)"),
        verify_commands=(f"trainprof tune --knob autocast=script,off {ctx.script}",),
    )
