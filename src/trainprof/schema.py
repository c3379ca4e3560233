"""Names shared by the writer (capture) and the readers (store, analysis).

A step record is ``(step, t_start_ns, dur_ns, *phases_ns, *counters, flags)``;
phases are exclusive times that add up to ``dur_ns`` exactly.
"""

# Phase indices (exclusive time, in nanoseconds). Order matters: it is the
# on-disk column order of STEP_FIELDS.
OTHER, DATA, FORWARD, BACKWARD, OPTIMIZER, ZERO_GRAD, GC, REGION = range(8)
N_PHASES = 8
PHASE_NAMES = (
    "other",
    "data_wait",
    "forward",
    "backward",
    "optimizer",
    "zero_grad",
    "gc",
    "region",
)

# Counters kept per step, after the phases in the same flat accumulator list.
SAMPLES, SYNC_N, SYNC_NS, HOST_READS, GC_N, GC_GEN2_N = range(N_PHASES, N_PHASES + 6)
COUNTER_NAMES = ("samples", "sync_n", "sync_ns", "host_reads", "gc_n", "gc_gen2_n")
N_ACC = N_PHASES + len(COUNTER_NAMES)

# Step flags.
FLAG_PARTIAL = 1  # the step was cut short by the end of the run
FLAG_BACKWARD = 2  # delimited by backward() calls, not an optimizer step
FLAG_MANUAL = 4  # delimited by an explicit prof.step()
FLAG_PROFILED = 8  # recorded while a heavy tool (torch.profiler, cProfile...) was on
FLAG_SKIPPED = 16  # a GradScaler skipped its optimizer step (inf/NaN gradients)

# Column order of one step record: (step, t_start_ns, dur_ns, *phases, *counters, flags).
STEP_FIELDS = (
    ("step", "t_start_ns", "dur_ns")
    + tuple(f"{name}_ns" for name in PHASE_NAMES)
    + COUNTER_NAMES
    + ("flags",)
)


# Device (CUDA event) time per step: see trainprof.capture.device_timer for the definitions.
DEVICE_FIELDS = (
    "step",
    "dev_step_ns",
    "dev_forward_ns",
    "dev_backward_ns",
    "dev_optimizer_ns",
    "dev_gap_ns",
)

#: int64 values per step record (every field is stored as int64).
RECORD_WIDTH = len(STEP_FIELDS)

# The implementations an optimizer's step can run, as run.json's ``optimizers`` records
# them (trainprof.capture.optimizer_impl) and the diagnosis reads them.
IMPL_FOR_LOOP, IMPL_FOREACH, IMPL_FUSED = "for-loop", "foreach", "fused"


# What the op count (trainprof.capture.opcount) records and the diagnosis reads.
#: A matrix product of at least this many FLOPs (forward) is large enough for bfloat16 to
#: beat float32 on a CPU with AVX-512 BF16. ``benchmarks/cpu_bf16.py`` on this project's
#: VM (3 Linear layers, a training step under autocast against float32, arms side by
#: side, 12 rounds): 0.3 MFLOP products x1.81, 4.2 MFLOP x1.28 (the casts cost more than
#: the math saves), 34 MFLOP x0.77-x0.92, 134 MFLOP x0.93, 537 MFLOP x0.57, 1,074 MFLOP
#: x0.81; and examples/eval_every.py, a tiny GPT whose largest products are 34 MFLOP,
#: amid layer norms and softmaxes that autocast casts back and forth, ran 1.56x *slower*
#: (``trainprof tune --knob autocast=off,bf16``, 3 trials each, 95% CI x1.17-x2.06):
#: products of that size count for nothing.
BIG_MATMUL_FLOPS = 128e6

#: Tensors of a batch described in run.json's ``batch_tensors`` (its first ones, depth-first;
#: trainprof.capture.padding): a batch with this many may have more.
MAX_DESCRIBED = 8
