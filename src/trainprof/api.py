"""The Python API: ``with trainprof.profile() as prof: ... prof.step()``.

For users who want control: explicit step boundaries and named regions, in a
script they run with plain ``python``. Automatic instrumentation stays on
(phases, data wait, syncs, GC); the first ``prof.step()`` turns automatic
step boundaries off. ``profile(enabled=False)`` returns a :class:`NullProfile`
whose methods do nothing, so the calls can stay in production code.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

from trainprof.store import RANKS_DIR, default_run_dir

_NULL_CONTEXT = contextlib.nullcontext()


class NullProfile:
    """What ``profile(enabled=False)`` returns: every method is a no-op."""

    run_dir: Path | None = None
    summary: dict[str, Any] | None = None

    def __enter__(self) -> NullProfile:
        return self

    def __exit__(self, *exc: object) -> bool:
        return False

    def step(self) -> None:
        pass

    def region(self, name: str) -> contextlib.nullcontext[None]:
        return _NULL_CONTEXT


class AttachedProfile(NullProfile):
    """``profile()`` inside a script already run by ``trainprof run``.

    The patches are process-wide, so a second capture would measure
    everything twice. Instead, ``step()`` and ``region()`` go to the running
    capture, and no second run folder is made.
    """

    def __init__(self, recorder: Any, ignored: dict[str, Any] | None = None) -> None:
        self._recorder = recorder
        self.run_dir = recorder.run_dir
        if ignored:
            # the CLI's record is in charge: say so, or max_steps=15 would silently not stop
            given = ", ".join(f"{k}={v!r}" for k, v in ignored.items())
            flags = ", ".join(dict.fromkeys(f for k in ignored if (f := _RUN_FLAGS.get(k))))
            where = f"; give them to `trainprof run` ({flags}) or the outer profile()" \
                if flags else ""
            print(f"trainprof: profile({given}) ignored: a record is open already (trainprof "
                  f"run's, or an outer profile()'s), and this one records into it{where}",
                  file=sys.stderr)

    def step(self) -> None:
        self._recorder.step()

    def region(self, name: str) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        return self._recorder.region(name)


#: profile()'s options that the record sets, and the ``trainprof run`` option for each (None:
#: none): under ``trainprof run`` they are the CLI's to give (see :class:`AttachedProfile`)
_RUN_FLAGS: dict[str, str | None] = {
    "out": "--out", "name": "--name", "max_steps": "--max-steps",
    "sample_interval_s": "--sample-interval", "deep": "--deep", "py": "--py",
    "lines": "--lines", "html": "--no-html", "report": None,
}


class Profile:
    """An always-on capture of the code inside the ``with`` block.

    One record per object: a second ``with`` on it would write over the first record in
    the same folder, so it is refused (make a new ``trainprof.profile()``).
    """

    def __init__(
        self,
        out: str | Path | None = None,
        name: str | None = None,
        *,
        max_steps: int | None = None,
        sample_interval_s: float = 0.2,
        report: bool = True,
        deep: str | None = None,
        py: str | None = None,
        lines: str | None = None,
        html: bool = True,
    ) -> None:
        from trainprof.capture.ranks import default_launch_dir, launcher_rank
        from trainprof.capture.recorder import Recorder
        from trainprof.capture.tools import build_windows

        main = sys.modules.get("__main__")
        script = getattr(main, "__file__", None)
        self.name = name or (Path(script).stem if script else "profile")
        # under torchrun or srun, every rank runs this: a record each, under ranks/ of one folder
        # per launch, as with `trainprof run` (trainprof.capture.ranks)
        self._launch = launcher_rank()
        # absolute: the script may change directory before the record is closed
        out = os.path.abspath(out) if out is not None else None
        if self._launch is not None:
            base = Path(out) if out is not None else default_launch_dir(
                self.name, self._launch.rank, launch=self._launch)
            self.run_dir = base / RANKS_DIR / str(self._launch.rank)
        else:
            self.run_dir = Path(out) if out is not None else default_run_dir(self.name)
        self.report = report
        self.html = html
        self.summary: dict[str, Any] | None = None
        self._recorder = Recorder(
            self.run_dir,
            name=self.name,
            command=_own_command(),
            script=script,
            max_steps=max_steps,
            sample_interval_s=sample_interval_s,
            windows=build_windows(self.run_dir, deep=deep, py=py, lines=lines),
        )
        self._recorder.worker_sampling = py is not None
        self._os_exit: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        self._entered = False

    def __enter__(self) -> Profile:
        from trainprof.capture.launcher import finish_before_os_exit
        from trainprof.errors import UsageError

        if self._entered:
            raise UsageError(f"this trainprof.profile() has recorded already (to {self.run_dir}): "
                             "make a new one for another record")
        self._entered = True
        self._recorder.start()
        # os._exit(n) inside the block skips __exit__: close the record before it exits
        self._os_exit = finish_before_os_exit(lambda code: self._finish("finished", code))
        self._os_exit.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        from trainprof.capture.clock import StopTraining
        from trainprof.capture.launcher import describe_exception, exit_code_of

        self._os_exit.__exit__(None, None, None)
        crash = None
        if exc_type is None or issubclass(exc_type, StopTraining):
            status, code = "finished", 0
        elif issubclass(exc_type, KeyboardInterrupt):
            status, code = "interrupted", 130
        elif issubclass(exc_type, SystemExit):  # sys.exit(n) in the block: as `trainprof run`
            status, code = "finished", exit_code_of(getattr(exc, "code", None))[0]
        else:
            status, code = "crashed", 1
            # what the block raised, kept in the record: the traceback is the caller's
            # to print (or catch), and gone by the time the record is read
            crash = describe_exception(exc) if exc is not None else None
        self._finish(status, code, crash)
        return exc_type is not None and issubclass(exc_type, StopTraining)

    def _finish(self, status: str, code: int, crash: dict[str, Any] | None = None) -> None:
        """Close the record, wait for the ranks it started, summarise and report."""
        self._recorder.stop(status, code, crash)
        from trainprof.commands import finalize_run

        children = self._recorder.child_runs
        if children.recorded or children.reruns:
            # ranks the script started (spawn, Lightning's launcher) close their own records
            from trainprof.capture.ranks import wait_for_ranks

            wait_for_ranks(self.run_dir, len(children.recorded) + len(children.reruns),
                           timeout_s=10.0)
        self.summary = finalize_run(self.run_dir, html=self.html, quiet=not self.report)
        if self.report and self._launch is not None and self._launch.local_rank != 0:
            print(f"trainprof: rank {self._launch.rank} recorded to {self.run_dir}",
                  file=sys.stderr)
        elif self.report:
            from trainprof.report.terminal import render_summary

            render_summary(self.summary, file=sys.stderr)
            if self._launch is not None:
                print(f"trainprof: this is rank {self._launch.rank}'s summary; all ranks "
                      f"merged: trainprof report {self.run_dir.parent.parent}", file=sys.stderr)

    def step(self) -> None:
        """Mark the end of a training step."""
        self._recorder.step()

    def region(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Time a named stretch (``with prof.region("eval"): ...``) apart from the phases."""
        return self._recorder.region(name)


def profile(
    out: str | Path | None = None,
    name: str | None = None,
    *,
    enabled: bool = True,
    max_steps: int | None = None,
    sample_interval_s: float = 0.2,
    report: bool = True,
    deep: str | None = None,
    py: str | None = None,
    lines: str | None = None,
    html: bool = True,
) -> Profile | NullProfile:
    """Profile the training loop inside a ``with`` block.

    Under ``trainprof run``, this attaches to that run instead of starting a
    second one (see :class:`AttachedProfile`); the options that shape a record
    are then the CLI's, and those given here are named on stderr as ignored.
    A profile records once: a second ``with`` on the same object is refused.

    ``out``: the run folder (default ``./trainprof-runs/<timestamp>-<script>``);
    ``max_steps``: stop the loop (by raising out of the step boundary, caught
    by this block) after that many steps; ``report``: print the summary to
    stderr at the end. ``enabled=False`` returns a null object with no cost.
    ``deep``, ``py``, ``lines``: as ``trainprof run --deep/--py/--lines``
    (a window spec, ``""`` for the default window; line_profiler targets);
    ``html``: write ``report.html`` into the run folder at the end.
    """
    if not enabled:
        return NullProfile()
    from trainprof.capture.recorder import active_recorder

    running = active_recorder()
    if running is not None:
        given = {"out": out, "name": name, "max_steps": max_steps,
                 "sample_interval_s": sample_interval_s, "report": report, "deep": deep,
                 "py": py, "lines": lines, "html": html}
        defaults = {"sample_interval_s": 0.2, "report": True, "html": True}
        return AttachedProfile(running, {k: v for k, v in given.items()
                                         if v != defaults.get(k)})
    return Profile(
        out, name, max_steps=max_steps, sample_interval_s=sample_interval_s, report=report,
        deep=deep, py=py, lines=lines, html=html,
    )


def _own_command() -> list[str]:
    """This process's command as the user typed it, for verify and tune to run again:
    under ``python -m pkg.train`` ``sys.argv[0]`` is the module's file, which run as a
    script loses its package (relative imports fail: every verify trial crashed), so the
    module is named from ``__main__.__spec__``, as python records it."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", None)
    if isinstance(name, str) and name and name != "__main__":
        module = name.removesuffix(".__main__")  # python -m pkg runs pkg.__main__
        return [sys.executable, "-m", module, *sys.argv[1:]]
    return [sys.executable, *sys.argv]

