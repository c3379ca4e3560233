"""``trainprof tune``: prove a fix by measuring it - the script, unmodified, once per knob value.

A finding says "try ``num_workers=4``"; this module is how that advice is proved or refuted on
the user's own machine. Each **arm** is one setting of the knobs (one value of one knob, or
with several ``--knob`` options one combination of the grid of their values). Each arm runs
the unmodified script ``--trials`` times under ``trainprof run --max-steps N`` in a child
process, the setting passed through :data:`trainprof.capture.knobs.ENV_VAR` and applied by
the child's capture (:mod:`trainprof.capture.knobs`), each trial into its own Run folder::

    ./trainprof-runs/<timestamp>-tune-<name>/
        tune.json                         this module's result (rewritten after every trial)
        num_workers-0-1/  run.json ...    arm "num_workers=0", trial 1 (a normal Run folder)
        num_workers-0-1/stderr.log        what the script and the child printed
        ...

**Order of trials.** Trials run in rounds; each round runs every arm once, in an order
shuffled from a fixed seed (:data:`SCHEDULE_SEED`). A machine that drifts (thermal limits,
another job starting, the page cache warming up) then hits every arm alike instead of
favouring the arms that happened to run last - the randomised block design of any A/B test.

**What is compared.** Per trial, the steady-state steps (complete steps after the warm-up,
:func:`trainprof.analysis.steps.detect_warmup`: the definition every trainprof report uses).
Per arm, the steps of all its usable trials (finished, exit code 0) are pooled, and the
compared statistic is their **mean** step time - seconds per steady step, i.e. 1 / steps/s,
the same quantity as samples/s (samples / seconds over the pooled steady steps, the
summary's definition), and what ``trainprof compare`` compares for one run against another.
Not the median: with DataLoader workers, step times often alternate (a step that finds its
batch ready, one that waits for the next worker: 7, 20, 6, 19 ms ...), and the median of
such a series lands on either mode by chance - measured here, two trials of one setting had
medians of 17 and 7 ms and means of 13.4 and 13.2 ms. The mean is what a training run pays;
rare hiccups widen its interval (the bootstrap sees them) rather than bias the comparison,
and a knob that removes rare costs (``gc_freeze``) is credited for it. The median and
p10/p90 are still reported. When the arms put different numbers of samples in a step (a
``batch_size`` knob), a step is not comparable across arms and **time per sample** is
compared instead, as ``trainprof compare`` does.

**Ratio, interval, verdict.** ``ratio`` = mean(arm) / mean(baseline); its 95% interval is
the two-level bootstrap of :mod:`trainprof.experiments.stats` (trials, then blocks of steps):
unlike a bootstrap of pooled steps it includes the run-to-run variation that repeated trials
exist to measure. It is **paired by round** (``paired`` in the arm's row) when the arm and the
baseline have a usable trial in the same rounds: each resample draws the same rounds for both,
so a round that ran slower for every arm cancels in the ratio - the analysis of the rounds'
block design (with ``--slurm``, a comparison within each node). ``faster`` / ``slower`` when
the interval excludes 1 and the change is at least ``compare``'s practical threshold (2%),
else ``no_difference``; ``unsettled`` where the arm or the baseline has fewer than
:data:`MIN_TRIALS` usable trials (the interval is then within one trial) or its rounds
disagree by far (:data:`UNSETTLED_SPREAD`). The **best arm** is the significantly faster
arm with the lowest ratio, its speed-up ``1 / ratio``; none when no arm beats the baseline,
or when an unsettled arm was measured faster still (its size unknown, it may be the fastest).

The **baseline** is the first arm (the first value of every knob - list the script's own
setting first, or write ``script`` for "leave it as the script has it"), or ``--baseline``.
The setting each arm really ran with is read back from its runs (the DataLoaders' recorded
settings, the training thread's torch thread count, the knob record) and shown beside it, so a
knob that did not apply (no DataLoader, ``prefetch_factor`` without workers) cannot pass
unnoticed.

Ctrl-C (or SIGTERM) stops the trial in flight (the child records it as interrupted), leaves
it out, and reports the trials finished so far; the exit code is then 130.

With ``--slurm`` each round runs as one job through submitit, on a cluster's nodes
(:mod:`trainprof.experiments.jobs`); the trials and their analysis are the same.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import orjson

from trainprof.errors import UsageError
from trainprof.experiments.trial_setting import TrialSetting
from trainprof.store import TUNE_JSON

#: Seed of the shuffled order of arms within each round.
SCHEDULE_SEED = 1729
#: More arms than this: too long to be what the user meant (each arm runs --trials times).
MAX_ARMS = 16
#: Samples per step differing by more than this fraction: compare time per sample.
BATCH_TOLERANCE = 0.01
#: Trial means of one arm spreading more than this (relative): the machine's speed varied.
TRIAL_SPREAD_NOTE = 0.10
#: With fewer rounds than this, an arm whose rounds' ratios to the baseline (or, unpaired,
#: whose or the baseline's trial means) differ by more than :data:`UNSETTLED_SPREAD` times
#: gets no verdict: "unsettled", significant or not (rounds at ×2.46, ×0.69 and ×0.53 made
#: "×2.00, not significant" of a fix that was faster in two rounds of three). A percentile
#: bootstrap over 2-4 clusters cannot see how far their spread is from the truth
#: (experiments/stats.py), and one trial that a burst of outside load slowed 6 times gave
#: a 2-round sweep "×0.20, 95% CI ×0.10-×0.81" where its steps' medians said ×0.86.
UNSETTLED_ROUNDS = 5
UNSETTLED_SPREAD = 1.5
#: Fewer usable trials than this on either side (``--trials 1``, or Ctrl-C after the first
#: round): "unsettled" too. The interval then resamples the steps of one trial, blind to the
#: noise between trials - one setting's trial means differed by 43-52% on a shared 2-core
#: machine, where one trial a side read "×0.73 (95% CI ×0.72-×0.74)".
MIN_TRIALS = 2
#: How long a child gets to close its record after Ctrl-C before it is killed.
STOP_GRACE_S = 20.0
#: How often the state of submitted jobs is looked at (``--slurm``).
JOB_POLL_S = 1.0


class _Stop(Exception):  # noqa: N818 - a request, like KeyboardInterrupt
    """SIGTERM arrived while tuning: stop like Ctrl-C."""


# --------------------------------------------------------------------------- arguments


@dataclass(frozen=True)
class Knob:
    """One ``--knob NAME=V1,V2``: the values as typed and as parsed (None: the script's)."""

    name: str
    texts: tuple[str, ...]
    values: tuple[Any, ...]


@dataclass
class Arm:
    """One setting of the knobs."""

    index: int
    settings: dict[str, str]  # knob -> value as typed
    overrides: dict[str, Any]  # knob -> parsed value (None: the script's own)

    @property
    def name(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.settings.items())

    @property
    def slug(self) -> str:
        raw = "_".join(f"{k}-{v}" for k, v in self.settings.items())
        return "".join(c if c.isalnum() or c in "-_." else "_" for c in raw)


def parse_knobs(specs: list[str]) -> list[Knob]:
    """``--knob NAME=V1,V2,...`` options, checked (UsageError, one line, on any mistake)."""
    from trainprof.capture.knobs import parse_value

    knobs: list[Knob] = []
    for spec in specs:
        name, sep, rest = spec.partition("=")
        name = name.strip()
        if not sep or not name:
            raise UsageError(f"--knob expects NAME=V1,V2,..., got {spec!r}")
        texts = tuple(v.strip() for v in rest.split(","))
        if any(not t for t in texts):
            raise UsageError(f"--knob {name}: empty value in {rest!r}")
        values = tuple(parse_value(name, t) for t in texts)
        if len(set(map(repr, values))) != len(values):
            raise UsageError(f"--knob {name}: a value is repeated in {rest!r}")
        if any(k.name == name for k in knobs):
            raise UsageError(f"--knob {name} given twice: list all its values in one option")
        knobs.append(Knob(name, texts, values))
    if not knobs:
        raise UsageError("give at least one --knob NAME=V1,V2 (see 'trainprof tune --help')")
    return knobs


def build_arms(knobs: list[Knob]) -> list[Arm]:
    """Every combination of the knobs' values (one knob: its values), first values first."""
    arms = []
    for i, combo in enumerate(itertools.product(*(range(len(k.values)) for k in knobs))):
        arms.append(Arm(
            index=i,
            settings={k.name: k.texts[j] for k, j in zip(knobs, combo, strict=True)},
            overrides={k.name: k.values[j] for k, j in zip(knobs, combo, strict=True)},
        ))
    if len(arms) < 2:
        raise UsageError("nothing to compare: give a knob at least two values, e.g. "
                         "--knob num_workers=0,2")
    if len(arms) > MAX_ARMS:
        raise UsageError(
            f"{len(arms)} combinations of knob values (at most {MAX_ARMS}): "
            "tune fewer knobs at a time"
        )
    return arms


def find_baseline(text: str | None, knobs: list[Knob], arms: list[Arm]) -> Arm:
    """The arm ``--baseline NAME=VALUE[,NAME=VALUE]`` names; knobs it leaves out: first value."""
    if text is None:
        return arms[0]
    from trainprof.capture.knobs import parse_value

    wanted = {k.name: k.values[0] for k in knobs}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        name = name.strip()
        knob = next((k for k in knobs if k.name == name), None)
        if not sep or knob is None:
            raise UsageError(
                f"--baseline expects NAME=VALUE of a tuned knob "
                f"({', '.join(k.name for k in knobs)}), got {part.strip()!r}"
            )
        parsed = parse_value(name, value.strip())
        if parsed not in knob.values:
            raise UsageError(f"--baseline {name}={value.strip()} is not one of the values tried "
                             f"({','.join(knob.texts)})")
        wanted[name] = parsed
    for arm in arms:
        if arm.overrides == wanted:
            return arm
    raise UsageError(f"--baseline {text!r} matches no arm")  # pragma: no cover - grid is full


def schedule(n_arms: int, trials: int, seed: int = SCHEDULE_SEED) -> list[tuple[int, int]]:
    """(arm, trial) pairs: ``trials`` rounds, each arm once per round in a shuffled order."""
    rng = random.Random(seed)
    order: list[tuple[int, int]] = []
    for trial in range(trials):
        arms = list(range(n_arms))
        rng.shuffle(arms)
        order.extend((a, trial) for a in arms)
    return order


# --------------------------------------------------------------------------- one trial


@dataclass
class Trial:
    """One child ``trainprof run`` of one arm, and what it measured."""

    arm: int
    trial: int
    run_dir: Path
    status: str = "not_run"
    exit_code: int | None = None
    wall_s: float = 0.0
    count: int = 0
    warmup: int = 0
    dur_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    samples: np.ndarray = field(default_factory=lambda: np.zeros(0))
    meta: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] | None = None
    #: cut short by Ctrl-C/SIGTERM while it ran: left out, even if the child finished
    stopped: bool = False
    #: where it ran, when its round ran as a job (experiments/jobs.py)
    host: str | None = None
    job_id: str | None = None

    @property
    def usable(self) -> bool:
        return (not self.stopped and self.status == "finished" and self.exit_code == 0
                and len(self.dur_s) > 0)

    @property
    def log(self) -> Path:
        return self.run_dir / "stderr.log"

    def to_json(self) -> dict[str, Any]:
        return {
            "trial": self.trial + 1,
            "run_dir": str(self.run_dir),
            "status": self.status,
            "exit_code": self.exit_code,
            "usable": self.usable,
            "stopped": self.stopped,
            "wall_s": self.wall_s,
            "steps": self.count,
            "warmup": self.warmup,
            "steady_steps": len(self.dur_s),
            "mean_s": float(self.dur_s.mean()) if len(self.dur_s) else None,
            "median_s": float(np.median(self.dur_s)) if len(self.dur_s) else None,
            **({"host": self.host, "job_id": self.job_id} if self.job_id is not None else {}),
        }


def child_command(
    target: str, args: list[str], *, module: bool, steps: int, run_dir: Path, name: str,
    python: str | None = None,
) -> list[str]:
    """The ``trainprof run`` of one trial, by ``python`` (default: this interpreter)."""
    return [
        python or sys.executable, "-m", "trainprof", "run",
        "--max-steps", str(steps), "--no-html", "--json",
        "--out", str(run_dir), "--name", name,
        *(["-m", target] if module else [target]), *args,
    ]


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def stop_child(proc: subprocess.Popen[bytes], steps_file: Path) -> None:
    """Stop a child ``trainprof run`` cleanly: SIGINT, so that it closes its record.

    One SIGINT is enough almost always, and a second one while the child is closing its
    record would cut that short; but a signal that lands while CPython runs a gc callback
    (trainprof's GC timing is one) is printed as "Exception ignored" and lost. So SIGINT is
    sent again (up to twice) only while the script is visibly still training - its
    ``steps.bin`` grew since the last one - and the child is killed after
    :data:`STOP_GRACE_S`.
    """
    deadline = time.monotonic() + STOP_GRACE_S
    sent_at, size_at, sends = 0.0, 0, 0
    while proc.poll() is None and time.monotonic() < deadline:
        now = time.monotonic()
        if sends == 0 or (sends < 3 and now - sent_at >= 2.0 and _size(steps_file) > size_at):
            with contextlib.suppress(OSError):
                proc.send_signal(signal.SIGINT)
            sent_at, size_at, sends = now, _size(steps_file), sends + 1
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.1)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


#: Seconds between the marks a trial still running leaves on its progress line.
TICK_S = 15.0


def run_trial(trial: Trial, command: list[str], overrides: dict[str, Any],
              env_changes: dict[str, str | None] | None = None,
              tick: Callable[[float], None] | None = None) -> Trial:
    """Run one trial and read back its Run folder (steady steps, run.json, findings).

    ``env_changes``: variables set (a value) or unset (None) over this process's environment
    (verify's: the run's own setting, :mod:`trainprof.experiments.trial_setting`); the
    knobs' variables come after them. The child's JSON summary is not read from its stdout:
    ``trainprof run`` also stores it in the Run folder, and a pipe nobody reads while the
    child is being stopped could block it. ``tick`` is called with the seconds the trial has
    run every :data:`TICK_S` while it runs: a trial slowed 80-fold by another process's load
    ran 84 s with nothing printed after its "trial 1/3 …".
    """
    from trainprof.capture.knobs import ENV_VAR, encode, knob_environment
    from trainprof.store import STEPS_BIN

    trial.run_dir.mkdir(parents=True, exist_ok=True)
    base = TrialSetting(env=dict(env_changes or {})).environ()
    env = {**base, ENV_VAR: encode(overrides) if any(
        v is not None for v in overrides.values()) else "", **knob_environment(overrides)}
    t0 = time.perf_counter()
    with open(trial.log, "wb") as log:
        # its own session: a Ctrl-C at the terminal reaches tune only, which then stops the
        # child itself (stop_child), once
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        try:
            while True:
                try:
                    proc.wait(timeout=TICK_S if tick is not None else None)
                    break
                except subprocess.TimeoutExpired:
                    tick(time.perf_counter() - t0)  # type: ignore[misc]  # set when timed
        except BaseException:
            stop_child(proc, trial.run_dir / STEPS_BIN)
            raise
        finally:
            trial.wall_s = time.perf_counter() - t0
            trial.exit_code = proc.returncode
    read_trial(trial)
    return trial


def read_trial(trial: Trial) -> Trial:
    """Fill a trial's measurements from its Run folder (status 'failed' when there is none)."""
    from trainprof.analysis.ranks import load_main_run
    from trainprof.analysis.steps import complete_steps, detect_warmup
    from trainprof.store import FINDINGS_JSON

    try:
        # a script that spawns its ranks: the main rank's steps (the ranks run in lock-step)
        run = load_main_run(trial.run_dir)
    except UsageError:
        trial.status = "failed"
        return trial
    trial.meta = run.meta
    trial.status = run.status
    with contextlib.suppress(OSError, orjson.JSONDecodeError):
        findings = orjson.loads((trial.run_dir / FINDINGS_JSON).read_bytes())
        trial.summary = {**(run.meta.get("summary") or {}), "findings": findings}
    done = complete_steps(run.steps)
    recorded = run.meta.get("steps_recorded")
    trial.count = int(recorded) if isinstance(recorded, int) else len(done)
    if len(done):
        dur = done["dur_ns"].astype(np.float64) / 1e9
        trial.warmup = detect_warmup(dur)
        trial.dur_s = dur[trial.warmup:]
        trial.samples = done["samples"][trial.warmup:].astype(np.float64)
    return trial


# --------------------------------------------------------------------------- statistics


def _samples_per_step(trials: list[Trial]) -> float | None:
    """Median samples per steady step over the trials; None when any step counted none."""
    if not trials:
        return None
    samples = np.concatenate([t.samples for t in trials])
    if len(samples) == 0 or (samples <= 0).any():
        return None
    return float(np.median(samples))


def _text(value: Any) -> str:
    """A recorded value as a knob value is written (true/false, not True/False)."""
    return str(value).lower() if isinstance(value, bool) or value is None else str(value)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _actual(knob: str, meta: dict[str, Any]) -> str:
    """The setting a run really had for ``knob``, as recorded (see trainprof.capture.knobs)."""
    from trainprof.capture.knobs import DATALOADER_KNOBS

    if not meta:
        return "—"
    if knob in DATALOADER_KNOBS:
        values = [_text(_loader_setting(dl, knob)) for dl in meta.get("dataloaders") or []
                  if isinstance(dl, dict) and knob in dl]
        return "/".join(dict.fromkeys(values)) or "no DataLoader"
    thread = meta.get("training_thread") or {}
    process = (meta.get("knobs") or {}).get("process") or {}
    if knob == "torch_threads":
        return str(thread.get("torch_num_threads", "—"))
    if knob == "interop_threads":
        return str(thread.get("torch_num_interop_threads", "—"))
    if knob == "gc_threshold":
        value = process.get("gc_threshold")
        return str(value[0]) if isinstance(value, list) and value else "script's"
    if knob == "gc_freeze":
        value = process.get("gc_freeze")
        if isinstance(value, dict):
            return f"true ({value.get('frozen_objects')} objects)"
        return "false" if value in (None, False) else str(value)
    if knob == "synthetic_data":
        value = process.get("synthetic_data")
        if isinstance(value, dict):
            n = int(value.get("batches_cached") or 0)
            return f"true ({_plural(n, 'loader')})" if n else "true (no batch read)"
        return "false"
    if knob == "omp_wait_policy":
        # as the fingerprint read the environment (unset: the OpenMP runtime's default)
        env = ((meta.get("fingerprint") or {}).get("threads") or {}).get("env") or {}
        value = env.get("OMP_WAIT_POLICY")
        return str(value).lower() if value else "unset (spin, then sleep)"
    if knob == "explicit_gc":
        return _calls_knob(knob, meta, "skipped", "skipped")
    if knob == "sharing_strategy":
        # how the workers' batches really came over (trainprof.capture.handoff)
        strategies = (meta.get("batch_handoff") or {}).get("strategies") or []
        return "/".join(strategies) or "no worker batch"
    if knob == "autocast":
        # the knob's own count of the model calls it ran (trainprof.capture.autocast_knob)
        rec = process.get("autocast")
        if not isinstance(rec, dict):
            return "script's"
        n, where = int(rec.get("calls") or 0), "/".join(rec.get("device_types") or {})
        return (f"{rec.get('value')} ({_plural(n, 'model call')}{', ' + where if where else ''})"
                if n else f"{rec.get('value')} (no model call)")
    if knob in ("channels_last", "float32"):
        # the knob's own count (trainprof.capture.channels_last_knob, float32_knob)
        rec = process.get(knob)
        if not isinstance(rec, dict):
            return "script's"
        value = _text(rec.get("value"))
        if not rec.get("modules"):
            skipped = ", ".join(rec.get("skipped") or {})
            if skipped:
                return f"{value} (not applied: {skipped})"
            if knob == "float32" and rec.get("calls"):
                return f"{value} (no float64 model)" if rec.get("value") else value
            return f"{value} (no model call)"
        return (f"{value} ({_plural(int(rec['modules']), 'module')} converted, "
                f"{_plural(int(rec.get('inputs') or 0), 'input')})")
    if knob == "compile":
        # the knob's own count (trainprof.capture.compile_knob)
        rec = process.get("compile")
        if not isinstance(rec, dict):
            return "script's"
        value = str(rec.get("value"))
        errors = rec.get("errors") or {}
        if errors:
            return f"{value} (failed, eager: {'; '.join(errors.values())})"
        if value == "false":
            return "false (eager)"
        n = int(rec.get("modules") or 0)
        return f"{value} ({_plural(n, 'module')} compiled)" if n else f"{value} (nothing compiled)"
    if knob == "activation_checkpointing":
        return _calls_knob(knob, meta, "calls", "run directly")
    if knob == "trim_padding":
        # the knob's count of what it cut, else the padding the probe read
        # (trainprof.capture.padding), all loaders together
        rec = process.get("trim_padding")
        if isinstance(rec, dict):
            before = int(rec.get("positions_before") or 0)
            after = int(rec.get("positions_after") or 0)
            n = int(rec.get("trimmed") or 0)
            if not before:
                return "true (no padded batch)"
            return (f"true ({n} {'batch' if n == 1 else 'batches'} cut to "
                    f"×{after / before:.2f} of the positions)")
        loaders = (meta.get("padding") or {}).get("loaders") or []
        positions = sum(int(ld.get("positions") or 0) for ld in loaders)
        real = sum(int(ld.get("real") or 0) for ld in loaders)
        if not positions:
            return "false (no padded batch)"
        return f"false ({(1 - real / positions) * 100:.0f}% padding)"
    if knob == "cudnn_benchmark":
        # as the fingerprint read it, after the script's own setting (its first step)
        value = ((meta.get("fingerprint") or {}).get("torch") or {}).get("cudnn_benchmark")
        return "—" if value is None else str(bool(value)).lower()
    if knob == "tf32":
        # the knob's value, over what the script had set by its first step (capture/knobs.py)
        rec = process.get("tf32")
        if not isinstance(rec, dict):
            return "script's"
        script = rec.get("script")
        if isinstance(script, dict):
            return (f"{_text(rec.get('value'))} (script: matmul "
                    f"{script.get('float32_matmul_precision')}, cuDNN "
                    f"{'tf32' if script.get('cudnn_allow_tf32') else 'fp32'})")
        return f"{_text(rec.get('value'))} (no optimizer step)"
    if knob in ("zero_grad_set_to_none", "mha_need_weights"):
        # the knob's own count of the calls it set (trainprof.capture.knobs)
        rec = process.get(knob)
        if not isinstance(rec, dict):
            return "script's"
        n = int(rec.get("calls") or 0)
        return (f"{_text(rec.get('value'))} ({_plural(n, 'call')})" if n
                else "no zero_grad call" if knob == "zero_grad_set_to_none"
                else "no nn.MultiheadAttention call")
    if knob == "eval_no_grad":
        # how the script's eval-mode model calls ran (trainprof.capture.eval_autograd)
        rec = meta.get("eval_autograd") or {}
        n = int(rec.get("grad_calls") or 0)
        if not n:
            return "no eval-mode call with autograd on"
        state = "off" if rec.get("no_grad_knob") else "on"
        return f"autograd {state} in {_plural(n, 'eval call')}"
    if knob == "anomaly_detection":
        # what the capture saw while steps ran (trainprof.capture.debug_modes)
        modes = meta.get("debug_modes") or {}
        n, on = int(modes.get("samples") or 0), int((modes.get("on") or {}).get(knob) or 0)
        if not n:
            return "—"
        return "off" if not on else f"on ({on} of {n} samples)"
    if knob in ("ddp_bucket_cap_mb", "ddp_comm_hook", "ddp_find_unused_parameters"):
        # as DDP itself reports its models' settings (trainprof.capture.ddp_stats)
        models = [m.get("settings") or {} for m in meta.get("ddp") or [] if isinstance(m, dict)]
        if not models:
            return "no DDP model"
        if knob == "ddp_comm_hook":
            return "/".join(dict.fromkeys(str(m.get("comm_hook") or "none") for m in models))
        if knob == "ddp_find_unused_parameters":
            return "/".join(dict.fromkeys(
                str(bool(m.get("find_unused_parameters"))).lower() for m in models))
        return "/".join(dict.fromkeys(
            f"{int(m['bucket_cap_bytes']) / 2**20:g} MiB" if isinstance(
                m.get("bucket_cap_bytes"), int) else "—" for m in models))
    if knob == "optimizer":
        # what the optimizer that delimits steps really ran (recorded at its first step)
        opts = [o for o in meta.get("optimizers") or [] if isinstance(o, dict)]
        opts.sort(key=lambda o: not o.get("primary"))
        if not opts:
            return "no optimizer"
        impl = opts[0].get("implementation")
        return str(impl) if isinstance(impl, str) else "custom step"
    return "—"


def _calls_knob(knob: str, meta: dict[str, Any], count: str, done: str) -> str:
    """A knob whose ``false`` stops calls the capture times (explicit_gc,
    activation_checkpointing): with it, the calls it stopped (its record's ``count``);
    without, the calls the capture timed (run.json's entry of the knob's name)."""
    rec = ((meta.get("knobs") or {}).get("process") or {}).get(knob)
    if isinstance(rec, dict) and rec.get("value") is False:
        return f"false ({_plural(int(rec.get(count) or 0), 'call')} {done})"
    calls = int((meta.get(knob) or {}).get("calls") or 0)
    return f"true ({_plural(calls, 'call')})"


def _loader_setting(loader: dict[str, Any], knob: str) -> Any:
    """A recorded DataLoader setting; a loader given a batch_sampler batches by its size."""
    if knob == "batch_size" and loader.get("batch_size") is None:
        return loader.get("batch_sampler_batch_size")
    return loader.get(knob)


def _inert(arm: Arm, baseline: Arm, meta: dict[str, Any]) -> bool:
    """The arm differs from the baseline only in DataLoader knobs, and the script made no
    DataLoader: its runs are the baseline's, whatever their times say (a 1-trial sweep of
    prefetch_factor without a DataLoader said "×1.17 as fast")."""
    from trainprof.capture.knobs import DATALOADER_KNOBS

    record = meta.get("knobs") or {}
    if not meta or record.get("dataloaders"):
        return False
    differ = [k for k in arm.settings if arm.settings[k] != baseline.settings.get(k)]
    return bool(differ) and all(k in DATALOADER_KNOBS for k in differ)


def _knob_notes(arm: Arm, meta: dict[str, Any]) -> list[str]:
    """What a run's knob record says did not apply as asked."""
    from trainprof.capture.knobs import DATALOADER_KNOBS

    record = meta.get("knobs") or {}
    notes: list[str] = []
    asked_dl = [k for k, v in arm.overrides.items() if v is not None and k in DATALOADER_KNOBS]
    if arm.overrides.get("synthetic_data"):
        if arm.overrides.get("num_workers"):
            notes.append(f"{arm.name}: synthetic_data=true loads in the training process, so "
                         "num_workers is 0 there")
        asked_dl.append("synthetic_data")
    loaders = record.get("dataloaders") or []
    if asked_dl and meta and not loaders:
        notes.append(f"{arm.name}: the script created no DataLoader, so "
                     f"{', '.join(asked_dl)} changed nothing")
    for entry in loaders:
        for name, why in (entry.get("dropped") or {}).items():
            notes.append(f"{arm.name}: {name} not applied to {entry.get('dataset')} ({why})")
        for name, value in (entry.get("reset") or {}).items():
            before = (entry.get("script") or {}).get(name)
            notes.append(f"{arm.name}: the script's {name}={before} was reset to {value} "
                         f"for {entry.get('dataset')} (needs num_workers > 0)")
    for entry in (record.get("process") or {}).get("optimizer") or []:
        if isinstance(entry, dict) and entry.get("dropped"):
            cls = str(entry.get("class") or "optimizer").rsplit(".", 1)[-1]
            notes.append(f"{arm.name}: {entry.get('asked')} not applied to {cls} "
                         f"({entry['dropped']})")
    for call in record.get("script_calls_ignored") or []:
        notes.append(f"{arm.name}: the script's {call} was ignored to keep the knob's value")
    notes.extend(f"{arm.name}: {err}" for err in record.get("errors") or [])
    return notes


def _outside_load(trial: Trial) -> float | None:
    """Cores other processes kept busy while the trial's steady steps ran (its summary's
    system samples; analysis/system.outside_cores), None where unknown."""
    from trainprof.analysis.system import outside_cores

    summary = trial.summary or {}
    return outside_cores(summary.get("system") or {},
                         (summary.get("environment") or {}).get("usable_cores"))


def _flops_utilization(trials: list[Trial]) -> float | None:
    """The median over the trials of their FLOPs utilization (analysis/compute_efficiency.py):
    how near the machine's matmul peak an arm's steps ran; None where no trial has one."""
    values = [u for t in trials
              if isinstance(u := ((t.summary or {}).get("compute") or {}).get("utilization"),
                            int | float)]
    return float(np.median(values)) if values else None


def _top_finding(trials: list[Trial]) -> dict[str, Any] | None:
    for t in trials:
        findings = (t.summary or {}).get("findings") or []
        if findings:
            f = findings[0]
            return {k: f.get(k) for k in ("category", "cause", "title", "severity",
                                          "estimated_gain")}
    return None


def analyse_tune(
    arms: list[Arm], trials: list[Trial], baseline: Arm, steps: int | None = None
) -> dict[str, Any]:
    """Per-arm statistics, ratios to the baseline, verdicts and the best arm (module docstring)."""
    from trainprof.analysis.compare import CONFIDENCE, N_BOOT, PRACTICAL_THRESHOLD, SEED
    from trainprof.analysis.system import OUTSIDE_LOAD_CORES
    from trainprof.experiments.stats import ratio_ci

    by_arm: dict[int, list[Trial]] = {a.index: [] for a in arms}
    for t in trials:
        by_arm[t.arm].append(t)
    usable = {i: [t for t in ts if t.usable] for i, ts in by_arm.items()}
    notes: list[str] = []

    per_step = {i: _samples_per_step(ts) for i, ts in usable.items() if ts}
    known = [v for v in per_step.values() if v is not None]
    per_sample = bool(known) and len(known) == len(per_step) and (
        max(known) - min(known) > BATCH_TOLERANCE * min(known)
    )
    if per_sample:
        notes.append("the arms put different numbers of samples in a step: time per sample "
                     "is compared, not step time")
    elif known and len(known) < len(per_step):
        notes.append("some arms counted no samples per step: step times are compared")

    def values(ts: list[Trial]) -> list[np.ndarray]:
        return [t.dur_s / t.samples if per_sample else t.dur_s for t in ts]

    base_values = values(usable[baseline.index])
    base_mean = float(np.concatenate(base_values).mean()) if base_values else None
    base_sps = None
    rows: list[dict[str, Any]] = []
    for arm in arms:
        ts = usable[arm.index]
        vals = values(ts)
        row: dict[str, Any] = {
            "name": arm.name,
            "settings": dict(arm.settings),
            "overrides": dict(arm.overrides),
            "baseline": arm is baseline,
            "trials_run": len(by_arm[arm.index]),
            "trials_usable": len(ts),
            "trials": [t.to_json() for t in by_arm[arm.index]],
            "steady_steps": int(sum(len(t.dur_s) for t in ts)),
            # compared: mean_s (or mean_per_sample_s); the median and percentiles describe
            "mean_s": None, "median_s": None, "p10_s": None, "p90_s": None,
            "mean_per_sample_s": None,
            "samples_per_step": per_step.get(arm.index),
            "samples_per_s": None, "steps_per_s": None,
            "trial_means_s": [float(t.dur_s.mean()) for t in ts],
            "ratio": None, "ci": None, "paired": None, "change_pct": None, "speedup": None,
            # each round's ratio to the baseline, where paired by round
            "round_ratios": None,
            # why an "unsettled" arm is: "spread" (its rounds disagree) or "one_trial"
            "unsettled_by": None,
            "samples_per_s_ratio": None,
            "verdict": None,
            "actual": {},
            "top_finding": _top_finding(ts),
            "flops_utilization": _flops_utilization(ts),
        }
        meta = next((t.meta for t in ts if t.meta),
                    next((t.meta for t in by_arm[arm.index] if t.meta), {}))
        row["actual"] = {k: _actual(k, meta) for k in arm.settings}
        notes.extend(_knob_notes(arm, meta))
        loaded = []
        for t in ts:  # a trial that shared its machine: its time is partly the machine's
            load = _outside_load(t)
            if load is not None and load >= OUTSIDE_LOAD_CORES:
                loaded.append(load)
                notes.append(f"{arm.name} trial {t.trial + 1}: other processes kept ~{load:.1f} "
                             "cores busy while it ran")
        # for the verdicts (tune's headline, verify's line): how many, how loaded at most
        row["outside_load"] = ({"trials": len(loaded), "max_cores": max(loaded)}
                               if loaded else None)
        for t in by_arm[arm.index]:
            if not t.stopped and (t.status != "finished" or t.exit_code not in (0, None)):
                notes.append(f"{arm.name} trial {t.trial + 1}: {t.status}, exit code "
                             f"{t.exit_code} (see {t.log})")
        if ts:
            dur = np.concatenate([t.dur_s for t in ts])
            samples = np.concatenate([t.samples for t in ts])
            total = float(dur.sum())
            p10, p50, p90 = np.percentile(dur, [10, 50, 90])
            row.update(mean_s=float(dur.mean()), median_s=float(p50), p10_s=float(p10),
                       p90_s=float(p90), steps_per_s=len(dur) / total if total > 0 else None)
            if samples.sum() > 0 and total > 0:
                row["samples_per_s"] = float(samples.sum()) / total
            if per_sample:
                row["mean_per_sample_s"] = float(np.concatenate(vals).mean())
            tm = row["trial_means_s"]
            if len(tm) >= 2 and np.median(tm) > 0:
                spread = (max(tm) - min(tm)) / float(np.median(tm))
                if spread > TRIAL_SPREAD_NOTE:
                    notes.append(
                        f"{arm.name}: its trials' mean step times differ by "
                        f"{spread * 100:.0f}%: the machine's speed varied (other load?); "
                        "the interval allows for it, but with few trials only in part: "
                        "more --trials make a verdict surer"
                    )
            short = [t for t in ts if steps is not None and t.count < steps]
            if short:
                notes.append(
                    f"{arm.name}: the script ended after {short[0].count} steps, before "
                    f"--steps {steps}"
                )
        if arm is baseline:
            base_sps = row["samples_per_s"]
        rows.append(row)

    for arm, row in zip(arms, rows, strict=True):
        ts = usable[arm.index]
        if not ts or base_mean is None or base_mean <= 0:
            continue
        if arm is baseline:
            row.update(ratio=1.0, ci=[1.0, 1.0], change_pct=0.0, speedup=1.0,
                       verdict="baseline", samples_per_s_ratio=1.0 if base_sps else None)
            continue
        ratio = float(np.concatenate(values(ts)).mean()) / base_mean
        # paired by round when both sides have a usable trial in the same rounds (2 or more)
        base_rounds = {t.trial: t for t in usable[baseline.index]}
        arm_rounds = {t.trial: t for t in ts}
        paired = len(arm_rounds) >= 2 and set(arm_rounds) == set(base_rounds)
        if paired:
            order = sorted(arm_rounds)
            lo, hi = ratio_ci(values([base_rounds[r] for r in order]),
                              values([arm_rounds[r] for r in order]), stat="mean",
                              paired=True)
        else:
            lo, hi = ratio_ci(base_values, values(ts), stat="mean")
            if len(ts) >= 2 and len(base_values) >= 2:
                notes.append(f"{arm.name}: its usable trials and the baseline's ran in "
                             "different rounds (a trial failed): its interval is not paired "
                             "by round")
        significant = (lo > 1 or hi < 1) and abs(ratio - 1) >= PRACTICAL_THRESHOLD
        if paired:  # each round's own ratio: what pairing cancels stays out of the spread
            spread = [float(values([arm_rounds[r]])[0].mean())
                      / float(values([base_rounds[r]])[0].mean()) for r in order]
        else:
            spread = []
        row["round_ratios"] = spread or None
        sides = [spread] if paired else [[float(v.mean()) for v in values(ts)],
                                         [float(v.mean()) for v in base_values]]
        unsettled = next((side for side in sides
                          if 2 <= len(side) < UNSETTLED_ROUNDS and min(side) > 0
                          and max(side) / min(side) > UNSETTLED_SPREAD), None)
        verdict = ("faster" if ratio < 1 else "slower") if significant else "no_difference"
        meta = next((t.meta for t in ts if t.meta), {})
        few = [who for who, n in ((arm.name, len(ts)), (f"the baseline {baseline.name}",
                                                        len(base_values)))
               if n < MIN_TRIALS]
        if _inert(arm, baseline, meta):
            verdict = "no_effect"  # the knob changed nothing: the runs are the baseline's
        elif few:  # an interval within one trial: no verdict, whatever it says
            verdict = "unsettled"
            row["unsettled_by"] = "one_trial"
            notes.append(
                f"{arm.name}: {' and '.join(few)} "
                f"{'have' if len(few) > 1 else 'has'} one usable trial, so its interval "
                "covers the steps within a trial only, not the noise between trials (trials "
                "of one setting can differ by tens of percent): it gets no verdict; run "
                f"--trials {MIN_TRIALS} or more")
        elif unsettled is not None:  # whether or not the interval clears 1: its size is moot
            verdict = "unsettled"
            row["unsettled_by"] = "spread"
            what = ("its rounds' ratios to the baseline" if paired
                    else "its trials' or the baseline's mean step times")
            low, high = min(unsettled), max(unsettled)
            notes.append(
                f"{arm.name}: {what} range from "
                + (f"×{low:.2f} to ×{high:.2f}" if paired
                   else f"{low * 1e3:.3g} to {high * 1e3:.3g} ms")
                + f" ({high / low:.1f}×): a trial ran far slower than the others (outside "
                "load?), so the size of the change is unsettled and it gets no verdict; run "
                f"more --trials (at least {UNSETTLED_ROUNDS}) on a quieter machine")
        row.update(
            ratio=ratio,
            ci=[lo, hi],
            paired=paired,
            change_pct=(ratio - 1) * 100,
            speedup=1 / ratio if ratio > 0 else None,
            verdict=verdict,
            samples_per_s_ratio=(row["samples_per_s"] / base_sps
                                 if row["samples_per_s"] and base_sps else None),
        )

    # the steps of the trials the script's own loop ended before --steps (for the header)
    ended = sorted({t.count for t in trials
                    if not t.stopped and steps is not None and 0 < t.count < steps})
    faster = [r for r in rows if r["verdict"] == "faster"]
    best = min(faster, key=lambda r: r["ratio"]) if faster else None
    if best is not None and any(r["verdict"] == "unsettled" and r["ratio"] < best["ratio"]
                                for r in rows):
        # an arm measured faster still, of unsettled size, may be the fastest: no arm is
        # settled as the best ("Best: num_workers=1 ... 1.90× as fast" beside num_workers=4
        # at ×0.30, unsettled)
        best = None
    if not usable[baseline.index]:
        notes.insert(0, f"the baseline {baseline.name} has no usable trial: nothing to compare")
    return {
        "metric": "time_per_sample" if per_sample else "step_time",
        "unit": "s/sample" if per_sample else "s/step",
        "baseline": baseline.name,
        "script_ended_after": [ended[0], ended[-1]] if ended else None,
        "arms": rows,
        "best": None if best is None else {
            "name": best["name"],
            "ratio": best["ratio"],
            "ci": best["ci"],
            "speedup": best["speedup"],
            "samples_per_s_ratio": best["samples_per_s_ratio"],
        },
        "confidence": CONFIDENCE,
        "bootstrap": {"resamples": N_BOOT, "seed": SEED, "statistic": "mean",
                      "method": "two-level percentile: trials (the same rounds for both "
                                "sides where an arm is paired by round), then moving blocks "
                                "of steps"},
        "practical_threshold_pct": PRACTICAL_THRESHOLD * 100,
        "notes": list(dict.fromkeys(notes)),
    }


# --------------------------------------------------------------------------- the command


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}" if seconds < 3600 else (
        f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}")


def plan_text(n_arms: int, trials: int, steps: int) -> str:
    """The first progress line: what will run. ``--steps`` is a cap (``trainprof run
    --max-steps``): a script whose own loop is shorter ends its trials sooner, which only
    the trials tell ("3 trials of 60 steps" over a script of 40 steps read as a promise)."""
    return (f"trainprof tune: {n_arms} arms × {_plural(trials, 'trial')} of up to "
            f"{_plural(steps, 'step')}, in shuffled rounds")


def _result_text(trial: Trial, steps: int | None = None) -> str:
    """A trial's progress line: its mean step and steady steps, and where the script ended
    it before ``steps`` (the cap) - or how it failed."""
    if trial.usable:
        short = (f"; the script ended after {_plural(trial.count, 'step')}"
                 if steps is not None and 0 < trial.count < steps else "")
        return (f"{float(trial.dur_s.mean()) * 1e3:.1f} ms/step "
                f"({len(trial.dur_s)} steady steps{short})")
    return f"{trial.status}, exit code {trial.exit_code}"


def _tail(path: Path, n: int = 3) -> list[str]:
    with contextlib.suppress(OSError):
        lines = path.read_text(errors="replace").splitlines()
        return [ln for ln in lines if ln.strip()][-n:]
    return []


@contextlib.contextmanager
def _sigterm_stops() -> Iterator[None]:
    """SIGTERM (a scheduler, ``kill``) stops tuning like Ctrl-C, so what was measured is kept."""

    def handler(signum: int, frame: Any) -> None:
        raise _Stop()

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave SIGTERM alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _write_doc(path: Path, doc: dict[str, Any]) -> None:
    from trainprof.report.json_report import render_json

    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        render_json(doc, f)
    os.replace(tmp, path)


class _Session:
    """The trials of one ``trainprof tune``, run in order, with progress lines on ``log``."""

    def __init__(self, target: str, args: list[str], module: bool, steps: int, trials: int,
                 tune_dir: Path, arms: list[Arm], baseline: Arm, header: dict[str, Any],
                 log: IO[str], setting: TrialSetting | None = None) -> None:
        self.target, self.args, self.module = target, args, module
        #: the interpreter and environment changes of the trials (None: this process's)
        self.setting = setting
        self.steps, self.trials, self.tune_dir = steps, trials, tune_dir
        self.arms, self.baseline, self.header, self.log = arms, baseline, header, log
        self.name = target.rsplit(".", 1)[-1] if module else Path(target).stem
        self.done: list[Trial] = []
        #: the jobs of ``run_jobs``: round and job id
        self.jobs: list[dict[str, Any]] = []
        self.t_start = time.perf_counter()

    def say(self, text: str, end: str = "\n") -> None:
        print(text, end=end, file=self.log, flush=True)

    def run(self, order: list[tuple[int, int]]) -> str:
        """Run the trials; returns ``finished``, ``interrupted`` or ``aborted``."""
        with _sigterm_stops():
            try:
                for n, (a, t) in enumerate(order, 1):
                    self.trial(n, len(order), self.arms[a], t)
                    if n == len(self.arms) and not any(x.usable for x in self.done):
                        self.say("trainprof tune: every arm failed in the first round; stopping "
                                 "(does the script run under `trainprof run`?)")
                        return "aborted"
            except (KeyboardInterrupt, _Stop):
                self.say("stopped")
                return "interrupted"
        return "finished"

    def _plan(self, arm: Arm, t: int) -> tuple[Trial, list[str]]:
        """Trial ``t`` of ``arm`` (counted as done, stopped until it ends) and its command."""
        trial = Trial(arm.index, t, self.tune_dir / f"{arm.slug}-{t + 1}", stopped=True)
        self.done.append(trial)
        return trial, child_command(self.target, self.args, module=self.module,
                                    steps=self.steps, run_dir=trial.run_dir,
                                    name=f"{self.name} {arm.name} #{t + 1}",
                                    python=self.setting.python if self.setting else None)

    def trial(self, n: int, total: int, arm: Arm, t: int) -> None:
        self.say(f"[{n}/{total}] {arm.name}, trial {t + 1}/{self.trials} … ", end="")
        trial, command = self._plan(arm, t)  # stopped until the child has ended on its own
        try:
            run_trial(trial, command, arm.overrides,
                      self.setting.env if self.setting else None,
                      tick=lambda s: self.say(f"{s:.0f} s … ", end=""))
        except BaseException:
            read_trial(trial)
            raise
        trial.stopped = False
        elapsed = time.perf_counter() - self.t_start
        left = elapsed / n * (total - n)
        self.say(f"{_result_text(trial, self.steps)}, {trial.wall_s:.1f} s · elapsed "
                 f"{_clock(elapsed)}"
                 + (f", about {_clock(left)} left" if n < total else ""))
        self._explain_failure(trial)
        self._save_progress()

    def _explain_failure(self, trial: Trial) -> None:
        if not trial.usable:
            for line in _tail(trial.log):
                self.say(f"    {line}")
            self.say(f"    (log: {trial.log})")

    def _save_progress(self) -> None:
        with contextlib.suppress(OSError):
            _write_doc(self.tune_dir / TUNE_JSON,
                       {**self.header, "status": "running", **self.analyse()})

    # -- rounds as jobs (experiments/jobs.py) ---------------------------------
    def run_jobs(self, order: list[tuple[int, int]], runner: Any) -> str:
        """Each round one job: submitted at once to SLURM, one after another locally.

        Returns ``finished``, ``interrupted`` (Ctrl-C/SIGTERM: the jobs not done are
        cancelled, their trials left out) or ``aborted`` (local: every arm of the first
        round failed).
        """
        from trainprof.experiments.jobs import run_round

        rounds: dict[int, list[Trial]] = {}
        specs: dict[int, list[dict[str, Any]]] = {}
        for a, t in order:
            arm = self.arms[a]
            trial, command = self._plan(arm, t)  # stopped until its job has reported it
            rounds.setdefault(t, []).append(trial)
            specs.setdefault(t, []).append({
                "arm": arm.index, "trial": t, "run_dir": str(trial.run_dir),
                "overrides": arm.overrides, "command": command,
                "env_changes": self.setting.env if self.setting else {}})
        pending: dict[int, Any] = {}
        with _sigterm_stops():
            try:
                if runner.one_at_a_time:
                    for t in sorted(specs):
                        pending = {t: runner.executor.submit(run_round, specs[t])}
                        self._job_submitted(t, pending[t])
                        self._wait(pending, rounds)
                        if t == 0 and not any(x.usable for x in rounds[t]):
                            self.say("trainprof tune: every arm failed in the first round; "
                                     "stopping (does the script run under `trainprof run`?)")
                            return "aborted"
                else:
                    with runner.executor.batch():  # one job array
                        jobs = {t: runner.executor.submit(run_round, specs[t])
                                for t in sorted(specs)}
                    for t, job in jobs.items():
                        self._job_submitted(t, job)
                    pending = dict(jobs)
                    self._wait(pending, rounds)
            except (KeyboardInterrupt, _Stop):
                from trainprof.experiments.jobs import cancel

                for job in pending.values():
                    cancel(job, runner.cluster)
                deadline = time.monotonic() + STOP_GRACE_S
                while runner.one_at_a_time and time.monotonic() < deadline and not all(
                        job.done() for job in pending.values()):
                    time.sleep(0.2)  # the trial in flight closes its record
                for t in pending:  # what the cut-short trials left (left out all the same)
                    for trial in rounds[t]:
                        if trial.run_dir.exists():
                            read_trial(trial)
                self.say(f"stopped; cancelled {_plural(len(pending), 'job')} not done"
                         if pending else "stopped")
                return "interrupted"
        return "finished"

    def _job_submitted(self, t: int, job: Any) -> None:
        self.jobs.append({"round": t + 1, "job_id": str(job.job_id)})
        self.say(f"[round {t + 1}/{self.trials}] job {job.job_id}: "
                 f"{_plural(len(self.arms), 'arm')} one after another")

    def _wait(self, pending: dict[int, Any], rounds: dict[int, list[Trial]]) -> None:
        while pending:
            for t in [t for t, job in pending.items() if job.done()]:
                self._collect(t, pending.pop(t), rounds[t])
            if pending:
                time.sleep(JOB_POLL_S)

    def _collect(self, t: int, job: Any, trials: list[Trial]) -> None:
        """A finished job: its trials read back from their Run folders."""
        from trainprof.experiments.jobs import job_error

        try:
            results = {(r["arm"], r["trial"]): r for r in job.result()}
        except Exception:  # noqa: BLE001 - a failed job: its trials say what they can
            results = {}
            self.say(f"[round {t + 1}/{self.trials}] job {job.job_id} failed: {job_error(job)}")
            with contextlib.suppress(Exception):
                self.say(f"    (job log: {job.paths.stderr})")
        elapsed = time.perf_counter() - self.t_start
        for trial in trials:
            read_trial(trial)
            trial.stopped = False
            got = results.get((trial.arm, trial.trial))
            if got is not None:
                trial.exit_code, trial.wall_s = got["exit_code"], float(got["wall_s"])
                trial.host, trial.job_id = got["host"], str(got["job_id"] or job.job_id)
            self.say(f"[round {t + 1}/{self.trials}] {self.arms[trial.arm].name}: "
                     f"{_result_text(trial, self.steps)}, {trial.wall_s:.1f} s"
                     + (f" on {trial.host}" if trial.host else "")
                     + f" · elapsed {_clock(elapsed)}")
            self._explain_failure(trial)
        self._save_progress()

    def analyse(self) -> dict[str, Any]:
        return analyse_tune(self.arms, self.done, self.baseline, self.steps)


def tune_command(
    target: str,
    args: list[str],
    *,
    module: bool,
    knobs: list[str],
    steps: int,
    trials: int,
    json_out: bool,
    out: Path | None,
    baseline: str | None,
    progress: IO[str] | None = None,
    slurm: str | None = None,
    setting: TrialSetting | None = None,
) -> int:
    """``trainprof tune``: run every arm ``trials`` times, compare them (module docstring).

    ``knobs``: the ``--knob NAME=V1,V2`` options (several: their grid of combinations);
    ``baseline``: ``NAME=VALUE[,NAME=VALUE]`` or None for the first arm; ``progress``: where
    the progress lines go (stderr); ``slurm``: ``--slurm``'s ``KEY=VALUE,...`` (each round a
    job through submitit, :mod:`trainprof.experiments.jobs`), None to run the trials here.
    ``setting``: the interpreter and environment the trials run in, the target already
    looked up there (verify's: the run's own, :mod:`trainprof.experiments.trial_setting`);
    None: this process's, the target looked up here.
    Prints the result (a table, or one JSON document with
    ``json_out``), keeps it in ``OUT/tune.json``, and returns 0; 130 when stopped by
    Ctrl-C/SIGTERM (what was measured is still reported); 1 when the baseline has no usable
    trial. Bad options raise UsageError before anything runs.
    """
    from trainprof.capture.launcher import check_target
    from trainprof.store import default_run_dir

    if steps < 1 or trials < 1:
        raise UsageError("--steps and --trials must be positive")
    parsed = parse_knobs(knobs)
    arms = build_arms(parsed)
    base = find_baseline(baseline, parsed, arms)
    if setting is None:  # looked up here: the trials run in this process's setting
        check_target(target, module)
    job_params = None
    name = target.rsplit(".", 1)[-1] if module else Path(target).stem
    if slurm is not None:
        from trainprof.experiments.jobs import check_runner, parse_params

        job_params = parse_params(slurm)
        check_runner(job_params, name)  # before the tune folder exists: none left empty
    if out is not None and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--out {out} exists and is not an empty folder")
    created = out is None or not out.exists()
    tune_dir = out if out is not None else default_run_dir(f"tune-{name}")
    try:
        tune_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create {tune_dir}: {exc.strerror}") from None
    runner = None
    if job_params is not None:
        from trainprof.experiments.jobs import SUBMITIT_DIR, make_runner

        try:
            runner = make_runner(tune_dir, job_params, name)
        except UsageError:
            import shutil

            # nothing ran: leave no folder behind (an empty one the user made stays)
            shutil.rmtree(tune_dir if created else tune_dir / SUBMITIT_DIR, ignore_errors=True)
            raise

    order = schedule(len(arms), trials)
    header: dict[str, Any] = {
        "tune_dir": str(tune_dir),
        "target": target,
        "module": module,
        "args": list(args),
        "knobs": [{"name": k.name, "values": list(k.texts)} for k in parsed],
        "design": "grid" if len(parsed) > 1 else "one knob",
        "steps": steps,
        "trials_per_arm": trials,
        "schedule_seed": SCHEDULE_SEED,
        "order": [[arms[a].name, t + 1] for a, t in order],
    }
    if runner is not None:
        header["executor"] = {"parameters": runner.parameters, "jobs": []}
    session = _Session(target, args, module, steps, trials, tune_dir, arms, base, header,
                       progress if progress is not None else sys.stderr, setting)
    session.say(plan_text(len(arms), trials, steps)
                + (f", each a job ({runner.cluster}, submitit)" if runner else "")
                + f" → {tune_dir}")
    if runner is not None:
        header["executor"]["jobs"] = session.jobs  # filled in as they are submitted
        status = session.run_jobs(order, runner)
    else:
        status = session.run(order)
    completed = [x for x in session.done if not x.stopped]
    doc = {
        **header,
        "status": status,
        "trials_planned": len(order),
        "trials_done": len(completed),
        "elapsed_s": time.perf_counter() - session.t_start,
        **session.analyse(),
    }
    if status == "interrupted":
        doc["notes"].insert(0, f"stopped after {len(completed)} of {len(order)} trials; "
                               "the trial cut short is left out")
    with contextlib.suppress(OSError):
        _write_doc(tune_dir / TUNE_JSON, doc)
    if json_out:
        from trainprof.report.json_report import render_json

        render_json(doc)
    else:
        from trainprof.report.tune_terminal import render_tune

        render_tune(doc)
    if status == "interrupted":
        return 130
    usable_base = any(x.usable for x in completed if x.arm == base.index)
    return 0 if usable_base and status == "finished" else 1
