"""The setting ``trainprof verify``'s trials run in: the run's own interpreter, folder and
environment, not the caller's.

Why: verify compares a fix against the run's recorded step time and its finding's estimate.
A trial started from another virtual environment, or with ``OMP_NUM_THREADS=2`` where the run
had 1, measures another program: another torch, another thread count, and the verdict would
be set against numbers it does not share. So the trials reproduce what the run's record says
(``run.json``'s ``launch``, written as the command started, before the script could change
anything: :func:`trainprof.capture.fingerprint.launch_environment`):

* **interpreter**: the run's own (``command[0]``) while it exists and runs trainprof; else
  this one, said in the setting line - unless this one's torch is not the run's version,
  which is refused (``error:``): a trial on another torch measures nothing about the run;
* **folder**: the one the command started in (verify enters it);
* **environment**: every threading, device, allocator and collective variable
  (:data:`~trainprof.capture.fingerprint.TRACKED_ENV_VARS`) and the launch ones
  (``PYTHONPATH``, ``LD_LIBRARY_PATH``, ...: :data:`~trainprof.capture.fingerprint.
  LAUNCH_ENV_VARS`) set, or unset, as they were. A record from before ``launch`` existed
  gives the tracked variables only (its fingerprint's ``threads.env``; one it does not name
  was unset).

The script or module is looked up the way the trial will: by a probe run with the trial's
interpreter, in its folder, with its environment (a relative ``PYTHONPATH`` is read from
there), so ``-m pkg.train`` is found where the trial finds it - and refused where the trial
would fail. Every difference from the caller's setting is named on one line (corrected, or
not: a gone interpreter, a torch upgraded in place).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainprof.errors import UsageError

#: Seconds the probe may take (an interpreter's start, trainprof's launcher imported: no torch).
PROBE_TIMEOUT_S = 30.0

#: Run by the trial's interpreter in the trial's folder and environment: the versions that
#: matter, and the target looked up by that interpreter's own trainprof (the one the trial
#: runs), as ``trainprof run`` will look it up. Prints one JSON object.
_PROBE = """
import json, sys
from importlib import metadata
out = {"executable": sys.executable}
try:
    out["torch"] = metadata.version("torch")
except Exception:
    out["torch"] = None
try:
    import trainprof
    from trainprof.capture.launcher import check_target
    from trainprof.errors import UsageError
except Exception as exc:
    out["trainprof"] = None
    out["error"] = f"{type(exc).__name__}: {exc}"
else:
    out["trainprof"] = trainprof.__version__
    try:
        check_target(sys.argv[1], sys.argv[2] == "module")
    except UsageError as exc:
        out["target_error"] = str(exc)
print(json.dumps(out))
"""


@dataclass
class TrialSetting:
    """The interpreter trials run with, and how their environment differs from this one's."""

    python: str = field(default_factory=lambda: sys.executable)
    #: variables to set (a value) or unset (None) over this process's environment
    env: dict[str, str | None] = field(default_factory=dict)
    #: the differences from the caller's setting the trials undo, in words
    corrected: list[str] = field(default_factory=list)
    #: the differences they keep (nothing to restore them from), in words
    not_corrected: list[str] = field(default_factory=list)

    def environ(self) -> dict[str, str]:
        """This process's environment with the changes made: the trials' own."""
        out = dict(os.environ)
        for name, value in self.env.items():
            if value is None:
                out.pop(name, None)
            else:
                out[name] = value
        return out

    def line(self) -> str | None:
        """One line naming every difference (None: the caller's setting is the run's)."""
        parts = []
        if self.corrected:
            parts.append("trials run as the run did: " + ", ".join(self.corrected))
        if self.not_corrected:
            parts.append("not as the run did: " + "; ".join(self.not_corrected))
        return "; ".join(parts) if parts else None

    def to_json(self) -> dict[str, Any]:
        return {"python": self.python, "env": self.env, "corrected": self.corrected,
                "not_corrected": self.not_corrected}


def recorded_environment(meta: dict[str, Any]) -> dict[str, str | None]:
    """The variables the run's command started with (None: unset), as its record tells."""
    from trainprof.capture.fingerprint import TRACKED_ENV_VARS

    env = (meta.get("launch") or {}).get("env")
    if isinstance(env, dict):
        return {str(k): None if v is None else str(v) for k, v in env.items()}
    # older records: the fingerprint's variables that were set, read at the first step
    threads = ((meta.get("fingerprint") or {}).get("threads") or {}).get("env")
    if not isinstance(threads, dict):
        return {}
    return {name: None if threads.get(name) is None else str(threads[name])
            for name in TRACKED_ENV_VARS}


def _env_words(name: str, recorded: str | None, here: str | None) -> str:
    if recorded is None:
        return f"{name} unset (here {here})"
    return f"{name}={recorded} (here {here if here is not None else 'unset'})"


def probe(python: str, env: dict[str, str], cwd: Path | None, target: str,
          module: bool) -> dict[str, Any]:
    """What ``python`` finds in the trial's setting (the :data:`_PROBE`'s object); an
    ``error`` key where it could not run or could not import trainprof."""
    try:
        proc = subprocess.run([python, "-c", _PROBE, target, "module" if module else "script"],
                              cwd=cwd, env=env, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=PROBE_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    lines = proc.stdout.strip().splitlines()
    try:
        found = json.loads(lines[-1]) if lines else None
    except ValueError:
        found = None
    if not isinstance(found, dict):
        err = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        return {"error": err[-1] if err else f"exit code {proc.returncode}"}
    return found


def run_setting(meta: dict[str, Any], target: str, module: bool,
                cwd: Path | None) -> TrialSetting:
    """The trials' setting for a recorded run (module docstring), its target looked up as
    the trial will look it up. UsageError: the target is not found there, or no interpreter
    with the run's torch can run the trials."""
    from trainprof import __version__

    setting = TrialSetting()
    for name, recorded in sorted(recorded_environment(meta).items()):
        here = os.environ.get(name)
        if here != recorded:
            setting.env[name] = recorded
            setting.corrected.append(_env_words(name, recorded, here))
    command = meta.get("command") or []
    theirs = str(command[0]) if command else None
    torch_then = ((meta.get("fingerprint") or {}).get("torch") or {}).get("version")
    environ = setting.environ()
    found: dict[str, Any] | None = None
    if theirs and os.path.abspath(theirs) != os.path.abspath(sys.executable):
        if not (os.path.isfile(theirs) and os.access(theirs, os.X_OK)):
            setting.not_corrected.append(f"the run's interpreter {theirs} is gone: trials use "
                                         f"{sys.executable}")
        else:
            found = probe(theirs, environ, cwd, target, module)
            if found.get("trainprof") is None:
                setting.not_corrected.append(
                    f"the run's interpreter {theirs} cannot run trainprof "
                    f"({found.get('error')}): trials use {sys.executable}")
                found = None
            else:
                setting.python = theirs
                setting.corrected.append(f"interpreter {theirs} (here {sys.executable})")
    if found is None:
        found = probe(sys.executable, environ, cwd, target, module)
        if found.get("trainprof") is None:
            raise UsageError(f"{sys.executable} cannot run trainprof with the run's "
                             f"environment: {found.get('error')}")
    if torch_then and found.get("torch") != torch_then:
        if theirs and os.path.abspath(setting.python) != os.path.abspath(theirs):
            raise UsageError(
                f"the run's interpreter {theirs} cannot run the trials, and this one has "
                f"torch {found.get('torch')} where the run had torch {torch_then}: trials here "
                f"would measure another torch (run verify with a Python that has torch "
                f"{torch_then}, e.g. `/path/to/python -m trainprof verify ...`)")
        # the run's own interpreter, its torch changed since: still the run's setting
        setting.not_corrected.append(f"torch {found.get('torch')} in {setting.python} (the "
                                     f"run had {torch_then})")
    if found.get("trainprof") != __version__:
        setting.not_corrected.append(f"trainprof {found.get('trainprof')} in "
                                     f"{setting.python} (this is {__version__})")
    if found.get("target_error"):
        where = f" (looked up in {cwd}" if cwd else " (looked up"
        pythonpath = environ.get("PYTHONPATH")
        where += f" with PYTHONPATH={pythonpath})" if pythonpath else ")"
        raise UsageError(f"{found['target_error']}{where if module else ''}")
    return setting
