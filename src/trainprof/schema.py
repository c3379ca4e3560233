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
