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

from trainprof.analysis.deep import trace_findings
from trainprof.analysis.summary import summarize_run
from trainprof.capture.window import Schedule, WindowRunner, parse_spec
from trainprof.report.json_report import render_json
from trainprof.report.terminal import render_summary
from trainprof.store import Run, default_run_dir, load_run, save_summary


def analyse(run: Run) -> dict[str, Any]:
    """The summary of a Run with its findings: what every output renders."""
    from trainprof.diagnosis import diagnose

    summary = summarize_run(run)
    findings = diagnose(summary, run.steps)
    # what only a deep window's trace can show (tensor cores, launches, copies), ranked in
    deep_only = trace_findings(summary.get("deep"), {f["category"] for f in findings})
    summary["findings"] = sorted(findings + deep_only, key=lambda f: -f["estimated_gain"])
    return summary


#: Default window of cProfile / line_profiler: no warm-up needed, more steps than torch.profiler
#: (a sampled call graph needs many calls; cProfile's own cost is per call, not per window).
PY_DEFAULT_SCHEDULE = Schedule(skip_first=10, wait=0, warmup=0, active=20, repeat=1)


def build_windows(
    run_dir: Path,
    *,
    deep: str | None = None,
    py: str | None = None,
    lines: str | None = None,
    op_count: bool = True,
) -> list[WindowRunner]:
    """The heavy tools asked for on the command line, each over its window of steps.

    ``op_count``: the always-on sample of torch calls per step (two steps; see
    :mod:`trainprof.capture.opcount`). Option errors (a bad SPEC, a malformed
    target) are raised here as UsageError, before the script starts.
    """
    runners: list[WindowRunner] = []
    if op_count:
        from trainprof.capture.opcount import OPCOUNT_SCHEDULE, OpCountTool

        runners.append(WindowRunner(OPCOUNT_SCHEDULE, [OpCountTool(run_dir)]))
    if deep is not None:
        from trainprof.capture.deep import DEEP_FLAGS, TorchProfilerTool

        schedule, flags = parse_spec(deep, frozenset(DEEP_FLAGS))
        runners.append(WindowRunner(schedule, [TorchProfilerTool(run_dir, schedule, flags)]))
    if py is not None or lines is not None:
        schedule, _ = parse_spec(py, default=PY_DEFAULT_SCHEDULE)
        tools: list[Any] = []
        if lines is not None:
            # first: resolving its targets must not land inside cProfile's window
            from trainprof.capture.lineprof import (
                SHARES_WINDOW_WITH_CPROFILE,
                LineProfileTool,
                parse_targets,
            )

            line_tool = LineProfileTool(run_dir / "python", parse_targets(lines))
            if py is not None and not SHARES_WINDOW_WITH_CPROFILE:
                # Python 3.12+: both need sys.monitoring's profiler slot; lines go
                # in a window of their own, right after cProfile's
                first = schedule.phase_starts(0)
                later = Schedule(skip_first=first[2] + 1, wait=0, warmup=0,
                                 active=schedule.active, repeat=1)
                runners.append(WindowRunner(later, [line_tool]))
            else:
                tools.append(line_tool)
        if py is not None:
            from trainprof.capture.pyprof import CProfileTool

            tools.append(CProfileTool(run_dir / "python"))
        runners.append(WindowRunner(schedule, tools))
    return runners


def finalize_run(run_dir: Path, html: bool = False) -> dict[str, Any]:
    """Summarise a closed Run folder, diagnose it, and store both in it (findings.json).

    ``html``: also write ``RUN_DIR/report.html``. A report that cannot be
    written is a note on stderr, never a lost run: the record is already safe.
    """
    run = load_run(run_dir)
    summary = analyse(run)
    save_summary(run_dir, summary)
    if html:
        try:
            path = write_html(summary, run)
        except Exception as exc:  # noqa: BLE001 - the run's record matters more than its page
            print(f"trainprof: HTML report not written: {exc}", file=sys.stderr)
        else:
            print(f"trainprof: HTML report {path}", file=sys.stderr)
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


@contextmanager
def deferred_sigint() -> Iterator[None]:
    """Hold Ctrl-C while the record is closed, then deliver it.

    A second Ctrl-C (people press it twice) must not leave ``run.json`` half
    written with status ``running``: closing takes well under a second, so the
    interrupt waits for it and is raised right after, where the run's record is
    complete and ``trainprof report`` can read it.
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:  # None: a handler not set from Python; the default is what it did
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
    if pending:
        raise KeyboardInterrupt


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
    deep: str | None = None,
    py: str | None = None,
    lines: str | None = None,
    html: bool = True,
) -> int:
    """``trainprof run``: run the script under always-on capture, then summarise it.

    ``deep``/``py``: window specs (``""`` for the defaults) of torch.profiler
    and cProfile; ``lines``: line_profiler targets. Returns the script's exit code.
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
        windows=build_windows(run_dir, deep=deep, py=py, lines=lines),
    )
    recorder.worker_sampling = py is not None
    print(f"trainprof: recording to {run_dir}", file=sys.stderr, flush=True)
    for runner in recorder.windows[1:]:  # the first is the op-count sample, always on
        names = ", ".join(t.name for t in runner.tools)
        print(f"trainprof: {names}: {runner.schedule.describe()}", file=sys.stderr, flush=True)

    def execute() -> Any:
        from trainprof.capture.launcher import Outcome

        try:
            recorder.start()
        except KeyboardInterrupt:  # Ctrl-C before the script ran: still a closed record
            with deferred_sigint():
                recorder.stop("interrupted", 130)
            return Outcome("interrupted", 130, "trainprof: interrupted before the script started")
        try:
            outcome = run_target(target, args, module)
        except BaseException:
            with deferred_sigint():
                recorder.stop("crashed", 1)
            raise
        with deferred_sigint():
            recorder.stop(outcome.status, outcome.exit_code)
        return outcome

    if json_out:
        with stdout_to_stderr() as real_stdout:
            outcome = execute()
            if outcome.message:
                print(outcome.message, file=sys.stderr)
            summary = finalize_run(run_dir, html=html)
            with os.fdopen(os.dup(real_stdout), "w") as f:
                render_json(summary, f)
        return outcome.exit_code
    outcome = execute()
    if outcome.message:
        print(outcome.message, file=sys.stderr)
    summary = finalize_run(run_dir, html=html)
    sys.stderr.flush()
    render_summary(summary)
    return outcome.exit_code


def write_html(summary: dict[str, Any], run: Run, path: Path | None = None) -> Path:
    """The self-contained HTML report of a run (default: ``RUN_DIR/report.html``)."""
    from trainprof.report.html import render_html

    return render_html(summary, run, path if path is not None else run.path / "report.html")


def report_command(run_dir: Path, json_out: bool = False, html: Path | bool | None = None) -> int:
    """``trainprof report``: summarise an existing Run folder, whatever its status.

    ``html``: True for ``RUN_DIR/report.html``, a path for elsewhere, None for none.
    """
    # Diagnosed again rather than read from findings.json: a run killed before
    # finalize_run has none stored, and the installed trainprof's rules apply.
    run = load_run(run_dir)
    summary = analyse(run)
    if json_out:
        render_json(summary)
    else:
        render_summary(summary)
    if html is not None:
        path = write_html(summary, run, None if html is True else Path(html))
        print(f"trainprof: HTML report written to {path}", file=sys.stderr)
    return 0


def trace_command(path: Path, json_out: bool = False) -> int:
    """``trainprof trace``: analyse a torch.profiler trace file or a folder of per-rank traces."""
    from trainprof.analysis.trace import analyse_trace

    result = analyse_trace(path)
    if json_out:
        render_json(result)
    else:
        from trainprof.report.trace_terminal import render_trace

        render_trace(result)
    return 0


def compare_command(
    run_a: Path,
    run_b: Path,
    *,
    json_out: bool = False,
    html: Path | None = None,
    fail_if_slower: float | None = None,
) -> int:
    """``trainprof compare``: B against A; exit 1 on a significant slowdown (``fail_if_slower``)."""
    from trainprof.analysis.compare import compare_runs, exceeds_slowdown

    result = compare_runs(load_run(run_a), load_run(run_b))
    if json_out:
        render_json(result)
    else:
        from trainprof.report.compare_terminal import render_compare

        render_compare(result)
    if html is not None:
        from trainprof.report.html import render_compare_html

        written = render_compare_html(result, html)
        print(f"trainprof: HTML comparison written to {written}", file=sys.stderr)
    if fail_if_slower is not None and exceeds_slowdown(result, fail_if_slower):
        print(f"trainprof: B is significantly slower than A by more than {fail_if_slower:g}%",
              file=sys.stderr)
        return 1
    return 0


def export_command(run_dir: Path, *, perfetto: Path) -> int:
    """``trainprof export --perfetto``: one Chrome-trace JSON of the run for Perfetto."""
    from trainprof.report.perfetto import export_perfetto

    stats = export_perfetto(load_run(run_dir), perfetto)
    print(f"trainprof: wrote {perfetto} ({stats.get('events', 0)} events); "
          "open it in https://ui.perfetto.dev or chrome://tracing", file=sys.stderr)
    return 0
