"""``trainprof tune --slurm``: a sweep's rounds run as cluster jobs, through submitit.

Why: a grid of arms × trials takes hours on one machine; a SLURM cluster runs its rounds at
once (DESIGN.md: large sweeps run on SLURM through submitit, nothing home-made). The unit of
work keeps tune's noise control: **one round is one job** - every arm once, in the round's
shuffled order, back to back on one node. A node that is slower than another (its GPU's
clocks, a neighbour's traffic, a colder page cache) then slows every arm of its round alike:
tune's interval, paired by round (:func:`trainprof.experiments.stats.ratio_ci`), compares the
arms within each node, so node-to-node differences cancel instead of favouring one arm.

Inside the job each trial is the very ``trainprof run --max-steps N`` child a local tune
starts (:func:`trainprof.experiments.tune.run_trial`), writing its Run folder into the tune
folder; submitit keeps its own files (pickled calls, each job's stdout/stderr) in
``OUT/submitit/``. Both must be on a filesystem the nodes share, and the nodes must see the
same Python environment - submitit's own requirements.

``--slurm KEY=VALUE,...`` hands its pairs to submitit's ``update_parameters``
(``timeout_min``, ``slurm_partition``, ``gpus_per_node``, ``cpus_per_task``, ``mem_gb``,
``slurm_account``, ``slurm_constraint``, ...: submitit checks the names). ``cluster=local``
runs the jobs on this machine instead (submitit's local executor), one round after another
so that they do not compete for it: the same code path, to try a sweep before sending it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainprof.errors import UsageError, missing_package

#: A job's time limit unless ``timeout_min`` is given (submitit's own default is 5 minutes).
DEFAULT_TIMEOUT_MIN = 60
#: Where submitit keeps its files, inside the tune folder.
SUBMITIT_DIR = "submitit"
CLUSTERS = ("slurm", "local")


def parse_params(text: str) -> dict[str, Any]:
    """``KEY=VALUE,KEY=VALUE`` → a dict of ints, floats, booleans and strings."""
    params: dict[str, Any] = {}
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(f"--slurm takes KEY=VALUE pairs, not {item!r}")
        params[key] = _typed(value.strip())
    cluster = params.get("cluster", "slurm")
    if cluster not in CLUSTERS:
        raise UsageError(f"--slurm cluster={cluster}: use one of {', '.join(CLUSTERS)}")
    return params


def _typed(value: str) -> Any:
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


@dataclass
class JobRunner:
    """A submitit executor set up for one tune's rounds."""

    executor: Any
    cluster: str
    parameters: dict[str, Any]

    @property
    def one_at_a_time(self) -> bool:
        """Local jobs share this machine: run them one after another, never at once."""
        return self.cluster == "local"


def make_runner(tune_dir: Path, params: dict[str, Any], name: str) -> JobRunner:
    """The executor (``UsageError`` for a missing submitit or SLURM, or a bad parameter)."""
    try:
        import submitit
    except ImportError:
        raise missing_package("--slurm", "submitit", "slurm") from None
    params = dict(params)
    cluster = params.pop("cluster", "slurm")
    if cluster == "slurm" and shutil.which("sbatch") is None:
        raise UsageError("--slurm: no `sbatch` here (not a SLURM login node?); "
                         "`--slurm cluster=local` runs the jobs on this machine")
    params.setdefault("timeout_min", DEFAULT_TIMEOUT_MIN)
    executor = submitit.AutoExecutor(folder=tune_dir / SUBMITIT_DIR, cluster=cluster)
    try:
        executor.update_parameters(name=f"trainprof-tune-{name}", **params)
    except (NameError, AssertionError, ValueError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"--slurm: {first}") from None
    return JobRunner(executor, cluster, {"cluster": cluster, **params})


def check_runner(params: dict[str, Any], name: str) -> None:
    """Raise the UsageError :func:`make_runner` would (no submitit, no ``sbatch``, a
    parameter submitit refuses) before the tune folder exists, so that a bad ``--slurm``
    leaves no empty folder: submitit creates its folder as its executor is made, so the
    executor is tried in a temporary one, removed after."""
    with tempfile.TemporaryDirectory(prefix="trainprof-slurm-check-") as tmp:
        make_runner(Path(tmp), params, name)


def run_round(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The job: run one round's trials in order on this node (what tune runs locally).

    ``specs``: per trial its ``arm``, ``trial``, ``run_dir``, ``command``, ``overrides``
    and ``env_changes`` (variables set or unset over the job's environment: verify's).
    Returns per trial its exit code, wall time, this host and the job's id; the
    measurements themselves are in the Run folders, read by the submitting process.
    """
    from trainprof.experiments.tune import Trial, run_trial

    # Cancelling stops the trial in flight cleanly (run_trial's SIGINT to the child, whose
    # record then says interrupted): submitit's local cancel sends SIGINT, which a job
    # started from a background shell inherits ignored; SLURM's scancel sends SIGTERM,
    # which submitit's job environment would ignore until the SIGKILL.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupted)
    host = socket.gethostname()
    job_id = os.environ.get("SLURM_JOB_ID") or os.environ.get("SUBMITIT_LOCAL_JOB_ID")
    done = []
    for spec in specs:
        trial = Trial(spec["arm"], spec["trial"], Path(spec["run_dir"]))
        run_trial(trial, list(spec["command"]), dict(spec["overrides"]),
                  dict(spec.get("env_changes") or {}))
        done.append({"arm": spec["arm"], "trial": spec["trial"], "exit_code": trial.exit_code,
                     "wall_s": trial.wall_s, "host": host, "job_id": job_id})
    return done


def cancel(job: Any, cluster: str) -> None:
    """Stop a job so that its trial in flight closes its record.

    SLURM: ``scancel`` (SIGTERM to the job's processes). Local: SIGTERM to the job's
    controller, whose id is its pid, which forwards it to the function's process - not
    submitit's ``cancel()``, whose SIGINT makes the controller SIGKILL that process a
    second later, possibly before the trial has stopped.
    """
    try:
        if cluster == "local":
            os.kill(int(job.job_id), signal.SIGTERM)
        else:
            job.cancel(check=False)
    except (OSError, ValueError, RuntimeError):
        pass  # already gone


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def job_error(job: Any) -> str:
    """One line on why a job gave no result (its exception, or the end of its log)."""
    try:
        exc = job.exception()
    except Exception as err:  # noqa: BLE001 - submitit could not read the job's state
        return f"{type(err).__name__}: {err}"
    text = str(exc or "").strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    # submitit's FailedJobError quotes the traceback: its last line says what was raised
    return lines[-1] if lines else f"job {getattr(job, 'job_id', '?')} ended without a result"
