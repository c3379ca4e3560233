"""Why a run measured nothing: a script that trains in a child process.

Wrappers do this: a launcher script that ``subprocess.run``s ``python train.py``, a CLI that
starts its trainer with ``os.system``. trainprof follows the processes it can record as ranks
(``mp.spawn``, a script that runs itself again, torchrun's ranks: :mod:`~trainprof.capture.
ranks`), not arbitrary children; from the parent alone the run then reads "nothing to
measure", which says nothing of where the training went. The evidence that it went to a
child: a Python command among the subprocesses the script started (the ``subprocess.Popen``
hook keeps them), or child processes that used the CPU (the sampler's ``children_cpu_pct``
of descendants other than DataLoader workers: ``os.system`` too).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import orjson

from trainprof.capture.targets import PYTHON_WORD

#: CPU-seconds of child processes that count as "work went to a child" (a ``git`` call or a
#: shell's ``mkdir`` take a few milliseconds; importing torch alone takes about one second).
CHILD_CPU_S = 1.0


def children_cpu_s(samples_path: Path) -> float:
    """CPU-seconds the script's non-worker child processes used, from the system samples:
    each sample's ``children_cpu_pct`` (percent of a core since the previous sample) times
    the time since the previous sample."""
    total, last_t = 0.0, None
    try:
        lines = samples_path.read_bytes().splitlines()
    except OSError:
        return 0.0
    for line in lines:
        try:
            sample: dict[str, Any] = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue  # a torn last line
        t, pct = sample.get("t"), sample.get("children_cpu_pct")
        if isinstance(t, (int, float)):
            if last_t is not None and isinstance(pct, (int, float)):
                total += pct / 100.0 * (t - last_t)
            last_t = t
    return total


def _python_command(words: list[str]) -> list[str] | None:
    """The arguments after the interpreter, where a command runs Python."""
    if len(words) == 1:  # a shell string
        try:
            words = shlex.split(words[0])
        except ValueError:
            return None
    if len(words) >= 2 and PYTHON_WORD.match(Path(words[0]).name):
        return words[1:]
    return None


def child_training_hint(started: list[list[str]], samples_path: Path) -> str | None:
    """The words that end "nothing to measure" when the training seems to have run in a
    child process (module docstring), else None."""
    python = next((c for c in map(_python_command, started) if c), None)
    cpu_s = children_cpu_s(samples_path)
    if python is None and cpu_s < CHILD_CPU_S:
        return None
    seen = []
    if python is not None:
        seen.append(f"it started `python {shlex.join(python)}`")
    if cpu_s >= CHILD_CPU_S:
        seen.append(f"its child processes used {cpu_s:.1f} CPU-seconds")
    rerun = (f"`trainprof run {shlex.join(python)}`" if python is not None
             else "trainprof run on the child's command")
    return (f"{' and '.join(seen)}: the training seems to run in a child process, which "
            f"trainprof does not follow; measure the child: {rerun}, or "
            "`with trainprof.profile():` around its training loop")
