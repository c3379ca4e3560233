"""What each CLI command does, as library functions (cli.py only parses arguments).

The pipeline runs one way: capture writes a Run folder; the summary is then
computed from the folder on disk, exactly as ``trainprof report`` would, so a
live run and a later report of it always agree.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shlex
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from trainprof.analysis.deep import trace_findings
from trainprof.analysis.ranks import load_main_run, load_ranks, merge_ranks, rank_dirs
from trainprof.analysis.steps import complete_steps
from trainprof.analysis.summary import summarize_run
from trainprof.capture.tools import build_windows, parse_tools
from trainprof.errors import UsageError
from trainprof.held_signals import deferred_sigint, die_of, finish_despite_sigterm
from trainprof.output_paths import check_output
from trainprof.report.json_report import render_json
from trainprof.report.terminal import render_summary
from trainprof.store import (
    RANKS_DIR,
    RUN_JSON,
    SAMPLES_JSONL,
    TUNE_JSON,
    VERIFY_JSON,
    Run,
    default_run_dir,
    load_run,
    save_summary,
)


def _diagnosed(summary: dict[str, Any], run: Run) -> dict[str, Any]:
    """``summary`` with its findings, from the summary and ``run``'s step records."""
    from trainprof.diagnosis import diagnose

    findings = diagnose(summary, run.steps, device=run.device)
    # what only a deep window's trace can show (tensor cores, launches, copies), ranked in
    deep_only = trace_findings(summary.get("deep"), findings)
    summary["findings"] = sorted(findings + deep_only, key=lambda f: -f["estimated_gain"])
    return summary


def analyse(run: Run) -> dict[str, Any]:
    """The summary of a Run with its findings: what every output renders."""
    return _diagnosed(summarize_run(run), run)


def analyse_folder(run_dir: Path) -> tuple[dict[str, Any], Run]:
    """The summary of a run folder, its ranks merged, and the Run its figures come from.

    A folder with ranks (``ranks/<k>/``: processes the script started, or a torchrun / srun
    launch, which has no record of its own) is summarised rank by rank and merged
    (:mod:`trainprof.analysis.ranks`); any other folder is one Run.
    """
    summary, main, _, _ = analyse_folder_records(run_dir)
    return summary, main


def analyse_folder_records(
    run_dir: Path,
) -> tuple[dict[str, Any], Run, Run | None, dict[str, Run]]:
    """:func:`analyse_folder`, with the records it read: the folder's own (None for a launch
    folder) and each rank's, by label - for what writes every record (the TensorBoard
    export) without reading them again."""
    run_dir = Path(run_dir)
    ranks = rank_dirs(run_dir)
    if not ranks or (run_dir / RUN_JSON).exists():
        own_run = load_run(run_dir)
        if not ranks:
            return analyse(own_run), own_run, own_run, {}
    else:
        own_run = None
    rank_runs = {label: load_run(path) for label, path in ranks}
    summaries = {label: analyse(run) for label, run in rank_runs.items()}
    steps = {label: (complete_steps(run.steps), int(summaries[label]["steps"]["warmup"]))
             for label, run in rank_runs.items()}
    own = analyse(own_run) if own_run is not None else None
    # a process that trained as a rank itself (it ran the script again for the others);
    # its label is claimed apart from the ranks' folders, so a clash is none of ours
    label = own_run.meta.get("rank_label") if own_run is not None else None
    own_label = str(label) if label is not None and str(label) not in rank_runs else None
    if own_run is not None and own is not None and own_label is not None:
        steps[own_label] = (complete_steps(own_run.steps), int(own["steps"]["warmup"]))
    merged = merge_ranks(
        run_dir, own,
        [(label, summaries[label], run.meta) for label, run in rank_runs.items()],
        steps,
        own_label=own_label,
        own_meta=None if own_run is None else own_run.meta,
    )
    main_run = rank_runs.get(merged["main_rank"] or "", own_run)
    assert main_run is not None
    return _diagnosed(merged, main_run), main_run, own_run, rank_runs


def finalize_run(run_dir: Path, html: bool = False, quiet: bool = False) -> dict[str, Any]:
    """Summarise a closed Run folder, diagnose it, and store both in it (findings.json).

    ``html``: also write ``RUN_DIR/report.html``. A report that cannot be
    written is a note on stderr, never a lost run: the record is already safe.
    ``quiet``: no line saying where the report went (``profile(report=False)``
    prints nothing of its own).
    """
    summary, run = analyse_folder(run_dir)
    save_summary(run_dir, summary)
    if html:
        _write_html_noted(summary, run, Path(run_dir) / "report.html", quiet=quiet)
    return summary


def _write_html_noted(summary: dict[str, Any], run: Run, path: Path, quiet: bool = False) -> None:
    """Write the HTML report; one that cannot be written is a line on stderr, even ``quiet``."""
    try:
        written = write_html(summary, run, path)
    except Exception as exc:  # noqa: BLE001 - the run's record matters more than its page
        print(f"trainprof: HTML report not written: {exc}", file=sys.stderr)
    else:
        if not quiet:
            print(f"trainprof: HTML report {written}", file=sys.stderr)


@contextmanager
def stdout_to_stderr() -> Iterator[int]:
    """Send everything written to fd 1 (the script, its DataLoader workers, C code) to stderr,
    for the rest of the process.

    Yields a duplicate of the original stdout, where the JSON document goes; it is closed
    when the block ends, so a reader of the document sees its end then. fd 1 is not given
    back: what the script leaves to run after its last line - ``atexit`` handlers, a
    ``__del__`` at shutdown, a thread still printing - would otherwise land after the
    document and make stdout more than one JSON document.
    """
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield saved
    finally:
        sys.stdout.flush()
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
    deep: str | None = None,
    py: str | None = None,
    lines: str | None = None,
    html: bool = True,
    rank_of: Path | None = None,
) -> int:
    """``trainprof run``: run the script under always-on capture, then summarise it.

    ``deep``/``py``: window specs (``""`` for the defaults) of torch.profiler
    and cProfile; ``lines``: line_profiler targets. ``rank_of``: the run folder of
    the process that started this one as a further rank (a script that runs itself
    again, :meth:`~trainprof.capture.ranks.ChildRuns.rerun`): that process prints
    the summary, this one a line. Returns the script's exit code.
    """
    from trainprof.capture.launcher import (
        Outcome,
        check_target,
        finish_before_os_exit,
        run_target,
        settle_daemon_threads,
    )

    check_target(target, module)  # before the capture imports torch: refused at once
    parse_tools(deep, py, lines)  # a bad option before the run folder exists: none left empty
    from trainprof.capture.ranks import default_launch_dir, launcher_rank, wait_for_ranks
    from trainprof.capture.recorder import Recorder

    if out is not None:
        # absolute now: the script may change directory (Hydra does, by default in
        # older versions), and the record is written relative to where trainprof started
        out = Path(os.path.abspath(out))
    if name is None:
        name = target.rsplit(".", 1)[-1] if module else Path(target).stem
    # under torchrun or srun: one record per rank, under ranks/ of one folder for the launch
    launch = launcher_rank()
    if launch is not None:
        launch_dir = out if out is not None else default_launch_dir(
            name, launch.rank, launch=launch)
        run_dir = launch_dir / RANKS_DIR / str(launch.rank)
    else:
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
    if rank_of is not None:  # as a process the script started records itself
        recorder.writer.update_meta(rank_label=run_dir.name, parent_pid=os.getppid())
    recorder.child_runs.tools = {"deep": deep, "py": py, "lines": lines}  # ranks run them too
    print(f"trainprof: recording to {run_dir}", file=sys.stderr, flush=True)
    for runner in recorder.windows[1:]:  # the first is the op-count sample, always on
        names = ", ".join(t.name for t in runner.tools)
        print(f"trainprof: {names}: {runner.schedule.describe(max_steps)}", file=sys.stderr,
              flush=True)

    real_stdout: int | None = None  # with --json: where the document goes

    def finish_at_os_exit(code: int) -> None:
        """The script called ``os._exit(code)``: close the record and report, then it exits."""
        with deferred_sigint():
            recorder.stop("finished", code)
        conclude(Outcome("finished", code, f"trainprof: the script called os._exit({code})"))
        sys.stdout.flush()
        sys.stderr.flush()

    def finish_at_exec(path: str) -> None:
        """The script replaces itself (``os.execv``): close the record and report first;
        what the new program does is not measured."""
        with deferred_sigint():
            recorder.stop("finished", 0)
        conclude(Outcome("finished", 0, f"trainprof: the script replaced itself with {path} "
                                        "(os.exec*): the record ends here; what runs next is "
                                        "not measured"))
        sys.stdout.flush()
        sys.stderr.flush()

    terminated: list[int] = []  # SIGTERMs held while trainprof wrapped up

    def terminate_now() -> None:
        """SIGTERM's exception was swallowed and the script stepped again (a bare
        ``except:`` around its step): end it here, at the step boundary, as the signal
        would have - the record closed as interrupted, the summary, death by SIGTERM."""
        outcome = Outcome("interrupted", 143, "trainprof: terminated by SIGTERM (the script "
                          "caught the exception it raised and trained on)", terminated=True)
        with suppress(BaseException):  # end as the signal would, whatever happens
            close(outcome.status, outcome.exit_code)
            conclude(outcome)
        die_of(signal.SIGTERM)

    recorder.clock.on_terminated = terminate_now

    def close(status: str, exit_code: int, crash: dict[str, Any] | None = None) -> None:
        """Close the record, whatever signal arrives meanwhile."""
        with deferred_sigint(), finish_despite_sigterm() as held:
            recorder.stop(status, exit_code, crash)
        terminated.extend(held)

    # registered before the script's own: atexit runs last what came first (_end_by_sigint)
    atexit.register(_end_by_sigint)

    def execute() -> Outcome:
        try:
            recorder.start()
        except KeyboardInterrupt:  # Ctrl-C before the script ran: still a closed record
            close("interrupted", 130)
            return Outcome("interrupted", 130, "trainprof: interrupted before the script started")
        try:
            with finish_before_os_exit(finish_at_os_exit, finish_at_exec):
                outcome = run_target(target, args, module)
        except BaseException:
            close("crashed", 1)
            raise
        if recorder.clock.terminated and not outcome.terminated:
            # SIGTERM's exception was caught by the script, which ended its own way:
            # under python the signal would have ended it, with 143
            outcome = Outcome("interrupted", 143, "trainprof: terminated by SIGTERM (the "
                              "script caught the exception it raised)", terminated=True)
        close(outcome.status, outcome.exit_code, outcome.crash)
        return outcome

    def nothing_ran() -> bool:
        """The script ended before anything trainprof times happened: no DataLoader batch,
        module call, backward or optimizer step (its --help, a bad argument, a config
        error). A summary of nothing would only bury what the script printed."""
        return (launch is None and not recorder.clock.started
                and not recorder.child_runs.recorded and not recorder.child_runs.launched)

    def summarize() -> dict[str, Any] | None:
        """The summary to print: this run's, or under a launcher the launch's, ranks merged,
        from its local rank 0 only (None: this rank prints none)."""
        children = (len(recorder.child_runs.recorded) + len(recorder.child_runs.reruns)
                    + len(recorder.child_runs.launched))
        if children:
            # processes the script started may still be closing their records (Ctrl-C
            # reaches the whole process group; spawn has not joined them then)
            wait_for_ranks(run_dir, children, timeout_s=10.0)
        alone = launch is None and rank_of is None
        summary = finalize_run(run_dir, html=html and alone and not nothing_ran())
        if rank_of is not None:
            print(f"trainprof: rank {run_dir.name} of {rank_of} recorded to {run_dir}",
                  file=sys.stderr)
            return None
        if launch is None:
            return summary
        if launch.local_rank != 0:
            print(f"trainprof: rank {launch.rank} recorded to {run_dir}", file=sys.stderr)
            return None
        return _merge_launch(launch_dir, launch.local_world_size, html)

    def conclude(outcome: Outcome) -> None:
        """How the script ended, then the summary (or the --json document)."""
        if outcome.message:
            print(outcome.message, file=sys.stderr)
        if outcome.terminated:  # the ranks the script started stop too, not train on
            recorder.child_runs.terminate_recorded()
        summary = summarize()
        if real_stdout is not None:
            if summary is not None:
                with os.fdopen(os.dup(real_stdout), "w") as f:
                    render_json(summary, f)
            return
        sys.stderr.flush()
        if summary is not None and nothing_ran():
            from trainprof.capture.child_training import child_training_hint

            inst = recorder.instrumentation
            child = child_training_hint([] if inst is None else inst.subprocesses,
                                        run_dir / SAMPLES_JSONL)
            print(f"trainprof: nothing to measure: the script ended ({outcome.status}, exit "
                  f"{outcome.exit_code}) before any DataLoader batch, module call, backward or "
                  f"optimizer step{'; ' + child if child else ''}; record in {run_dir}",
                  file=sys.stderr)
        elif summary is not None:
            render_summary(summary)

    # (waiting for other ranks may take a while; a hang there is no bug of the record's)
    summary_stage = f"the summary (the record is closed: `trainprof report {run_dir}`)"
    if json_out:
        with stdout_to_stderr() as real_stdout:
            outcome = execute()
            with finish_despite_sigterm(summary_stage, stacks=False) as held:
                conclude(outcome)
    else:
        outcome = execute()
        with finish_despite_sigterm(summary_stage, stacks=False) as held:
            conclude(outcome)
    if terminated or held:
        print("trainprof: SIGTERM arrived after the script ended: the record and the summary "
              "were finished first", file=sys.stderr)
    if outcome.terminated:
        # as SIGTERM ends a plain python, by the signal: no thread waited for (a training
        # thread still running would keep the process alive, or abort it mid-op at
        # finalization), no atexit handler; the record is closed and the DataLoader workers
        # are stopped
        die_of(signal.SIGTERM)
    settle_daemon_threads()  # the interpreter finalizes next (see there)
    if outcome.status == "interrupted" and outcome.exit_code == 130:
        _ENDED_BY_CTRL_C[0] = True
    return outcome.exit_code


#: Set when a run ended by Ctrl-C: the process then ends by SIGINT (_end_by_sigint).
_ENDED_BY_CTRL_C = [False]


def _end_by_sigint() -> None:
    """End the process by SIGINT, after the script's atexit handlers, as python does for a
    KeyboardInterrupt it did not catch: a shell's ``$?`` is 130 either way, but a shell
    loop (``for lr in ...; do trainprof run train.py --lr $lr; done``) stops on Ctrl-C only
    when its child died of the signal; an exit with 130 let it start the next run."""
    if not _ENDED_BY_CTRL_C[0]:
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)


def _merge_launch(launch_dir: Path, local_ranks: int, html: bool) -> dict[str, Any]:
    """Local rank 0 of a launch (torchrun, srun): wait for its host's ranks, then merge all."""
    from trainprof.capture.ranks import wait_for_ranks

    missing = wait_for_ranks(launch_dir, local_ranks)
    summary, main_run = analyse_folder(launch_dir)
    if missing:
        summary["notes"] = [*summary.get("notes", []), "ranks not closed when this summary "
                            f"was printed: {', '.join(missing)} (`trainprof report "
                            f"{launch_dir}` merges them later)"]
    if html:
        _write_html_noted(summary, main_run, launch_dir / "report.html")
    return summary


def write_html(summary: dict[str, Any], run: Run, path: Path | None = None) -> Path:
    """The self-contained HTML report of a run (default: ``RUN_DIR/report.html``)."""
    from trainprof.report.html import render_html

    return render_html(summary, run, path if path is not None else run.path / "report.html")


def report_command(run_dir: Path, json_out: bool = False, html: Path | bool | None = None) -> int:
    """``trainprof report``: summarise an existing Run folder, whatever its status.

    ``html``: True for ``RUN_DIR/report.html``, a path for elsewhere, None for none.
    """
    if html is not None and html is not True:
        html = check_output(Path(html), "--html")
    run_dir = Path(run_dir)
    if (run_dir / TUNE_JSON).is_file() and not (run_dir / RUN_JSON).is_file():
        return _report_tune(run_dir, json_out=json_out, html=html is not None)
    # Diagnosed again rather than read from findings.json: a run killed before
    # finalize_run has none stored, and the installed trainprof's rules apply.
    summary, run = analyse_folder(run_dir)
    if json_out:
        render_json(summary)
    else:
        render_summary(summary)
    if html is not None:
        path = write_html(summary, run, Path(run_dir) / "report.html" if html is True
                           else Path(html))
        print(f"trainprof: HTML report written to {path}", file=sys.stderr)
    return 0


def _report_tune(tune_dir: Path, *, json_out: bool, html: bool) -> int:
    """``trainprof report`` of a tune (or verify) folder: its table again, as tune printed
    it (and verify's verdict), from tune.json (verify.json); its trials are run folders."""
    from trainprof.report.tune_terminal import render_tune

    if html:
        raise UsageError(f"{tune_dir} is a trainprof tune folder: an HTML report is a run's; "
                         f"give one of its trials (trainprof report {tune_dir}/<trial> --html)")
    docs = {}
    for name in (TUNE_JSON, VERIFY_JSON):
        path = tune_dir / name
        if path.is_file():
            try:
                docs[name] = orjson.loads(path.read_bytes())
            except (OSError, orjson.JSONDecodeError) as exc:
                raise UsageError(f"unreadable {path}: {exc}") from None
    if not isinstance(docs.get(TUNE_JSON), dict):
        raise UsageError(f"not a trainprof tune record: {tune_dir / TUNE_JSON}")
    if json_out:
        render_json(docs[VERIFY_JSON] if isinstance(docs.get(VERIFY_JSON), dict)
                    else docs[TUNE_JSON])
        return 0
    render_tune(docs[TUNE_JSON])
    if isinstance(docs.get(VERIFY_JSON), dict):
        from trainprof.report.verify_terminal import render_verdict

        render_verdict(docs[VERIFY_JSON])
    print(f"trainprof: the trials are run folders: trainprof report {tune_dir}/<trial>",
          file=sys.stderr)
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
    from trainprof.analysis.compare import MIN_STEADY_STEPS, compare_runs, exceeds_slowdown

    if html is not None:  # before the comparison is printed: a bad path, a short refusal
        check_output(html, "--html")
    result = compare_runs(load_main_run(run_a), load_main_run(run_b))
    if json_out:
        render_json(result)
    else:
        from trainprof.report.compare_terminal import render_compare

        render_compare(result)
    if html is not None:
        from trainprof.report.html import render_compare_html

        written = render_compare_html(result, html)
        print(f"trainprof: HTML comparison written to {written}", file=sys.stderr)
    if fail_if_slower is not None and result.get("verdict") == "insufficient_data":
        # a gate that compared nothing must not pass: the same exit as bad input
        print(f"error: --fail-if-slower: nothing compared, too few steady steps (at least "
              f"{MIN_STEADY_STEPS} in each run)", file=sys.stderr)
        return 2
    if fail_if_slower is not None and exceeds_slowdown(result, fail_if_slower):
        print(f"trainprof: B is significantly slower than A by more than {fail_if_slower:g}%",
              file=sys.stderr)
        return 1
    return 0


def export_command(
    run_dir: Path,
    *,
    perfetto: Path | None = None,
    tensorboard: Path | None = None,
    wandb: str | None = None,
    steps: tuple[int | None, int | None] | None = None,
) -> int:
    """``trainprof export``: the run for other tools (Perfetto's timeline, TensorBoard, W&B)."""
    if perfetto is not None:
        check_output(perfetto, "--perfetto")
    if tensorboard is not None:
        check_output(tensorboard, "--tensorboard", folder=True)
    if perfetto is None and tensorboard is None and wandb is None:
        raise UsageError("say what to export: --perfetto PATH, --tensorboard LOGDIR and/or "
                         "--wandb PROJECT")
    if steps is not None and perfetto is None:
        raise UsageError("--steps chooses the steps of the --perfetto timeline: give "
                         "--perfetto PATH")
    run_dir = Path(run_dir)
    if perfetto is not None:
        if (run_dir / TUNE_JSON).is_file() and not (run_dir / RUN_JSON).is_file():
            raise UsageError(f"{run_dir} is a trainprof tune folder: export one of its trials "
                             "with --perfetto (or the whole sweep with --tensorboard or "
                             "--wandb)")
        _export_perfetto(run_dir, perfetto, steps)
    if tensorboard is not None or wandb is not None:
        if wandb is not None:
            from trainprof.report import wandb_export

            destination = wandb_export.parse_project(wandb)  # a bad name before any work
        name, records, knobs = _export_records(run_dir)
        if tensorboard is not None:
            _export_tensorboard(name, records, knobs, tensorboard)
        if wandb is not None:
            _export_wandb(name, records, destination)
    return 0


def _export_perfetto(run_dir: Path, perfetto: Path,
                     steps: tuple[int | None, int | None] | None = None) -> None:
    from trainprof.report.perfetto import export_perfetto

    main, ranks = load_ranks(run_dir)  # a run of several ranks: every rank on one timeline
    first, last = steps or (None, None)
    stats = export_perfetto(main, perfetto, ranks=ranks, first_step=first, last_step=last)
    print(f"trainprof: wrote {perfetto} ({stats.get('events', 0)} events); "
          "open it in https://ui.perfetto.dev or chrome://tracing", file=sys.stderr)
    for trace in stats.get("deep_traces", []):
        how = {"wall_clock": "by wall clock", "profiler_steps": "by ProfilerStep#N"}.get(
            trace["alignment"], trace["alignment"])
        residual = trace.get("residual_ms")
        after = "" if residual is None else f", ProfilerStep#N {residual:+.2f} ms from step N"
        print(f"  merged {trace['file']}: {trace['events']} events, aligned {how}{after}",
              file=sys.stderr)
    for note in stats.get("notes", []):
        print(f"  note: {note}", file=sys.stderr)


@dataclass
class _ExportRecord:
    """One record an export writes: a run, one of its ranks, or one trial of a sweep."""

    run: Run
    sub: str  #: its place below the folder's name: "" (the run itself), "rank1", a trial folder
    kind: str  #: "run", "rank" or "trial"
    summary: dict[str, Any] | None = None  #: the report that goes with it, if one does
    settings: dict[str, Any] = field(default_factory=dict)  #: a trial's knob settings
    metrics: dict[str, float] = field(default_factory=dict)  #: a trial's results


def _export_records(
    run_dir: Path,
) -> tuple[str, list[_ExportRecord], dict[str, list[str]] | None]:
    """The folder's name, every record of it an export writes, and a sweep's knobs (None for
    a run): a run's own record, each rank of a run of several (the merged report with the
    main rank's, or with the launching process's own steps when it trained too, as PyTorch
    Lightning's DDP launcher does), or each trial of a ``trainprof tune`` folder."""
    name = run_dir.resolve().name
    if (run_dir / TUNE_JSON).is_file() and not (run_dir / RUN_JSON).is_file():
        knobs, records = _tune_records(run_dir)
        return name, records, knobs
    summary, main, own, ranks = analyse_folder_records(run_dir)
    if not ranks:
        return name, [_ExportRecord(main, "", "run", summary)], None
    records = []
    if own is not None and len(complete_steps(own.steps)):
        records.append(_ExportRecord(own, "", "run", summary if own.path == main.path else None))
    for label, rank in ranks.items():
        records.append(_ExportRecord(rank, f"rank{label}", "rank",
                                     summary if rank.path == main.path else None))
    return name, records, None


def _tune_records(tune_dir: Path) -> tuple[dict[str, list[str]], list[_ExportRecord]]:
    """A sweep's knobs and its trials, each with its settings, results and report."""
    from trainprof.analysis.scalars import tune_metrics

    try:
        doc = orjson.loads((tune_dir / TUNE_JSON).read_bytes())
        knobs = {str(k["name"]): [str(v) for v in k["values"]] for k in doc["knobs"]}
        arms = list(doc["arms"])
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise UsageError(f"unreadable {tune_dir / TUNE_JSON}: {exc}") from exc
    found = []
    for arm in arms:
        for trial in arm.get("trials") or []:
            recorded = Path(str(trial.get("run_dir", "")))
            # the folder as recorded, or beside tune.json (the sweep was moved or copied)
            path = recorded if (recorded / RUN_JSON).is_file() else tune_dir / recorded.name
            if (path / RUN_JSON).is_file():
                found.append((arm, trial, path))
            else:
                print(f"trainprof: left out trial {trial.get('trial')} of {arm.get('name')}: "
                      f"no run folder at {recorded}", file=sys.stderr)
    if not found:
        raise UsageError(f"{tune_dir}: no trial of this sweep has a run folder to export")
    records = []
    for arm, trial, path in found:
        summary, run = analyse_folder(path)
        records.append(_ExportRecord(
            run, path.name, "trial", summary,
            settings={k: str(v) for k, v in (arm.get("settings") or {}).items()},
            metrics=tune_metrics(trial, summary)))
    return knobs, records


def _export_tensorboard(name: str, records: list[_ExportRecord],
                        knobs: dict[str, list[str]] | None, logdir: Path) -> None:
    """Each record a TensorBoard run in ``logdir/name[/sub]``; a sweep's hparams config."""
    from trainprof.report import tensorboard as tb

    written = []
    for rec in records:
        label = f"{name}/{rec.sub}" if rec.sub else name
        trial = rec.kind == "trial"
        written.append(tb.write_run(
            rec.run, logdir / name / rec.sub if rec.sub else logdir / name,
            label=rec.sub if trial else label, summary=rec.summary,
            hparams=rec.settings if trial else None, metrics=rec.metrics or None))
    if knobs is not None:
        starts = [r.run.meta.get("wall_origin_s") for r in records]
        first = min((float(t) for t in starts if isinstance(t, int | float)),
                    default=time.time())
        tb.write_tune_config(logdir / name, knobs, first)
    for result in written:
        every = f", means of {result.bucket} steps a point" if result.bucket > 1 else ""
        texts = f", text: {', '.join(result.texts)}" if result.texts else ""
        print(f"trainprof: wrote {result.logdir}: {result.steps:,} steps{every}, "
              f"{result.samples:,} system samples, {result.scalars:,} scalars{texts}",
              file=sys.stderr)
    print(f"trainprof: open it with: tensorboard --logdir {logdir}", file=sys.stderr)


def _export_wandb(name: str, records: list[_ExportRecord], destination: Any) -> None:
    """Each record a W&B run; several (ranks, trials) grouped under the folder's name."""
    from trainprof.report import wandb_export

    group = name if len(records) > 1 or records[0].kind != "run" else None
    offline = []
    for i, rec in enumerate(records, 1):
        label = f"{name}/{rec.sub}" if rec.sub else name
        result = wandb_export.write_run(
            rec.run, destination, name=label, group=group, job_type=rec.kind,
            summary=rec.summary, settings=rec.settings, metrics=rec.metrics)
        count = f"[{i}/{len(records)}] " if len(records) > 1 else ""
        every = f", means of {result.bucket} steps a row" if result.bucket > 1 else ""
        where = result.url or (f"offline, in {result.sync_dir}" if result.sync_dir else
                               "W&B is disabled (WANDB_MODE=disabled): nothing kept")
        print(f"trainprof: {count}W&B run {label}: {result.steps:,} steps{every}, "
              f"{result.samples:,} system samples, {result.rows:,} rows; {where}",
              file=sys.stderr)
        if result.url is None and result.sync_dir is not None:
            offline.append(str(result.sync_dir))
    if offline:
        print(f"trainprof: upload with: wandb sync {' '.join(offline)}", file=sys.stderr)


def stage_command(source: Path, *, to: Path | None, threads: int, json_out: bool) -> int:
    """``trainprof stage``: the local copy's path on stdout; what it cost on stderr."""
    from trainprof.fixes.staging import stage
    from trainprof.report.pack_progress import progress_reporter

    start = time.perf_counter()
    with progress_reporter("staging (bytes)", sys.stderr) as progress:
        # a copy that takes under a second is not worth progress lines
        staged = stage(source, to, threads=threads, progress=lambda done, total: (
            progress(done, total) if time.perf_counter() - start > 1.0 else None))
    seconds = time.perf_counter() - start
    doc = {"source": str(source), "path": str(staged.path), "copied": staged.copied,
           "files": staged.files, "bytes": staged.bytes, "seconds": seconds,
           "older_copies": [str(p) for p in staged.older], "older_bytes": staged.older_bytes}
    if json_out:
        render_json(doc)
        return 0
    files = f"{staged.files:,} file{'' if staged.files == 1 else 's'}"
    if staged.copied:
        rate = staged.bytes / seconds / 2**20 if seconds > 0 else 0.0
        print(f"trainprof: staged {files}, {staged.bytes / 2**20:,.1f} MiB, in "
              f"{seconds:.1f} s ({rate:,.0f} MiB/s)", file=sys.stderr)
    else:
        print(f"trainprof: reusing the copy made earlier ({files}, "
              f"{staged.bytes / 2**20:,.1f} MiB)", file=sys.stderr)
    if staged.older:
        what = ("1 copy of an earlier version of {} stays" if len(staged.older) == 1 else
                f"{len(staged.older)} copies of earlier versions of {{}} stay").format(source)
        print(f"trainprof: {what} beside it ({staged.older_bytes / 2**20:,.1f} MiB); "
              f"once no job reads {'it' if len(staged.older) == 1 else 'them'}: "
              f"rm -rf {' '.join(shlex.quote(str(p)) for p in staged.older)}",
              file=sys.stderr)
    if not staged.files:
        # a job script reads the path that follows: say so before it trains on nothing
        print(f"trainprof: warning: {source} holds no files: the copy is empty",
              file=sys.stderr)
    print(staged.path)
    return 0


def pack_command(
    source: Path,
    out: Path,
    *,
    decode: bool = False,
    extensions: tuple[str, ...] | None = None,
    shard_bytes: int | None = None,
    threads: int | None = None,
    force: bool = False,
    check: bool = True,
    json_out: bool = False,
) -> int:
    """``trainprof pack``: a folder of sample files into a pack, then proof that it reads faster.

    Exit 1 when the check finds a sampled row that differs from its file.
    """
    from trainprof.fixes.folder import list_folder, pack_folder
    from trainprof.fixes.pack_writer import DEFAULT_SHARD_BYTES, check_target
    from trainprof.report.pack_progress import progress_reporter

    listing = list_folder(source, extensions)
    if Path(out).resolve().is_relative_to(Path(source).resolve()):
        # the pack would be packed with the samples next time, as a class of its own
        raise UsageError(f"cannot pack {source} into {out}, a folder inside it")
    check_target(Path(out), force)
    print(f"trainprof: packing {len(listing.files):,} files from {source} into {out}",
          file=sys.stderr)
    with progress_reporter("packing", sys.stderr) as progress:
        manifest = pack_folder(source, out, decode=decode, listing=listing,
                               shard_bytes=shard_bytes or DEFAULT_SHARD_BYTES,
                               overwrite=force, threads=threads, progress=progress)
    files = [p for p in Path(out).iterdir() if p.is_file()]
    doc: dict[str, Any] = {
        "source": str(source),
        "out": str(out),
        "pack_bytes": sum(p.stat().st_size for p in files),
        "columns": [f["file"] for f in manifest["fields"] if f["kind"] != "blob"],
        "manifest": manifest,
        "reads": None,
        "usage": (f'from trainprof.fixes import PackedDataset; dataset = PackedDataset("{out}"'
                  ", transform=...)"
                  + ("  # same samples and order as ImageFolder" if manifest.get("classes")
                     else "")),
    }
    if check:
        from trainprof.experiments.read_rate import compare_reads

        print("trainprof: checking the pack against the files (random reads)", file=sys.stderr)
        doc["reads"] = compare_reads(listing, Path(out), decode=decode).as_dict()
    if json_out:
        render_json(doc)
    else:
        from trainprof.report.pack_terminal import render_pack

        render_pack(doc)
    return 0 if doc["reads"] is None or doc["reads"]["identical"] else 1
