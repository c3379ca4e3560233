"""What each CLI command does, as library functions (cli.py only parses arguments).

The pipeline runs one way: capture writes a Run folder; the summary is then
computed from the folder on disk, exactly as ``trainprof report`` would, so a
live run and a later report of it always agree.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from trainprof.analysis.summary import summarize_run
from trainprof.report.json_report import render_json
from trainprof.report.terminal import render_summary
from trainprof.store import Run, default_run_dir, load_run, save_summary


def analyse(run: Run) -> dict[str, Any]:
    """The summary of a Run with its findings: what every output renders."""
    from trainprof.diagnosis import diagnose

    summary = summarize_run(run)
    summary["findings"] = diagnose(summary, run.steps)
    return summary


def finalize_run(run_dir: Path) -> dict[str, Any]:
    """Summarise a closed Run folder, diagnose it, and store both in it (findings.json)."""
    summary = analyse(load_run(run_dir))
    save_summary(run_dir, summary)
    return summary


@contextmanager
def stdout_to_stderr() -> Iterator[int]:
    """Send everything written to fd 1 (the script, its DataLoader workers, C code) to stderr.

    Yields a duplicate of the original stdout, where the JSON document goes.
    """
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield saved
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run_command(
    target: str,
    args: list[str],
    *,
    module: bool = False,
    out: Path | None = None,
    name: str | None = None,
    max_steps: int | None = None,
    json_out: bool = False,
    sample_interval_s: float = 0.2,
) -> int:
    """``trainprof run``: run the script under always-on capture, then summarise it.

    Returns the script's exit code.
    """
    from trainprof.capture.launcher import check_target, run_target
    from trainprof.capture.recorder import Recorder

    check_target(target, module)
    if name is None:
        name = target.rsplit(".", 1)[-1] if module else Path(target).stem
    run_dir = out if out is not None else default_run_dir(name)
    command = [sys.executable, *(["-m", target] if module else [target]), *args]
    recorder = Recorder(
        run_dir,
        name=name,
        command=command,
        script=None if module else str(Path(target).resolve()),
        max_steps=max_steps,
        sample_interval_s=sample_interval_s,
    )
    print(f"trainprof: recording to {run_dir}", file=sys.stderr, flush=True)

    def execute() -> Any:
        recorder.start()
        try:
            outcome = run_target(target, args, module)
        except BaseException:
            recorder.stop("crashed", 1)
            raise
        recorder.stop(outcome.status, outcome.exit_code)
        return outcome

    if json_out:
        with stdout_to_stderr() as real_stdout:
            outcome = execute()
            if outcome.message:
                print(outcome.message, file=sys.stderr)
            summary = finalize_run(run_dir)
            with os.fdopen(os.dup(real_stdout), "w") as f:
                render_json(summary, f)
        return outcome.exit_code
    outcome = execute()
    if outcome.message:
        print(outcome.message, file=sys.stderr)
    summary = finalize_run(run_dir)
    sys.stderr.flush()
    render_summary(summary)
    return outcome.exit_code


def report_command(run_dir: Path, json_out: bool = False) -> int:
    """``trainprof report``: summarise an existing Run folder, whatever its status."""
    # Diagnosed again rather than read from findings.json: a run killed before
    # finalize_run has none stored, and the installed trainprof's rules apply.
    summary = analyse(load_run(run_dir))
    if json_out:
        render_json(summary)
    else:
        render_summary(summary)
    return 0
