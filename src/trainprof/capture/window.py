"""Bounded windows of steps for the heavy tools (torch.profiler, cProfile, line_profiler).

The always-on capture must stay nearly free, so anything that costs more than
a few microseconds per step runs only over a window of steps chosen by a
schedule with the same vocabulary as ``torch.profiler.schedule``:

* ``skip_first`` steps are left alone (start-up, warm-up);
* then each cycle has ``wait`` idle steps, ``warmup`` steps where a tool is
  prepared but its results are discarded (torch.profiler's warm-up: the first
  profiled steps carry its own start-up cost), and ``active`` recorded steps;
* cycles repeat ``repeat`` times (0: until the run ends).

A step boundary is where the step clock closes a step (the primary optimizer's
step, backward() calls, or ``prof.step()``). The clock calls
:meth:`WindowRunner.at_boundary` only at the step counts the runner asked for,
so a run without windows pays nothing per step (see ``StepClock.next_watch``).

Steps recorded while a tool is on carry :data:`trainprof.schema.FLAG_PROFILED`
and are left out of the step statistics: their times include the tool's cost.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, fields, replace
from typing import Protocol

from trainprof.errors import UsageError

log = logging.getLogger(__name__)

#: A step count no run reaches: "never call me".
NEVER = 1 << 62


class WindowTool(Protocol):
    """A heavy tool run over windows of steps; every method runs on the training thread."""

    name: str

    def prepare(self, step: int) -> None:
        """Warm-up begins before step ``step`` (tools without a warm-up do nothing)."""

    def start(self, step: int) -> None:
        """Recording begins before step ``step``."""

    def boundary(self, step: int) -> None:
        """A step boundary inside a window: step ``step`` is about to begin."""

    def stop(self, step: int) -> None:
        """The window ends before step ``step`` (or the run ended inside it)."""

    def close(self) -> None:
        """End of the run: write the results into the run folder. Must not raise."""


@dataclass(frozen=True)
class Schedule:
    """Which steps a window covers (``torch.profiler.schedule``'s parameters)."""

    skip_first: int = 10
    wait: int = 0
    warmup: int = 2
    active: int = 5
    repeat: int = 1

    @property
    def cycle(self) -> int:
        return self.wait + self.warmup + self.active

    def phase_starts(self, k: int) -> tuple[int, int, int]:
        """(warm-up start, active start, end) of cycle ``k``, as step indices."""
        base = self.skip_first + k * self.cycle + self.wait
        return base, base + self.warmup, base + self.warmup + self.active

    def describe(self, max_steps: int | None = None) -> str:
        """The steps the window records, as a run's first lines say it; with the run's
        ``max_steps``, a window that run never reaches is said to be one (not "steps 10-29
        recorded" for a run of 3 steps)."""
        _, first_a, first_end = self.phase_starts(0)
        steps = f"steps {first_a}-{first_end - 1}"
        if max_steps is not None and max_steps <= first_a:
            return (f"the window ({steps}) never opens: --max-steps {max_steps} ends the run "
                    f"before step {first_a} (lower its skip_first)")
        if self.repeat == 1:
            times = "once"
        elif self.repeat == 0:
            times = f"then every {self.cycle} steps until the run ends"
        else:
            times = f"{self.repeat} times, every {self.cycle} steps"
        warmup = f" after {self.warmup} warm-up steps" if self.warmup else ""
        return f"{steps} recorded{warmup}, {times}"


#: What each key counts, and the least it takes: a bad value's error says both.
_KEY_RULES = {
    "skip_first": (0, "steps left alone first"),
    "wait": (0, "idle steps a cycle"),
    "warmup": (0, "warm-up steps a cycle"),
    "active": (1, "recorded steps a cycle"),
    "repeat": (0, "cycles; 0: until the run ends"),
}
assert set(_KEY_RULES) == {f.name for f in fields(Schedule)}
_KEYS = ", ".join(_KEY_RULES)
_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_spec(
    text: str | None,
    flags: frozenset[str] = frozenset(),
    default: Schedule | None = None,
    option: str = "window",
) -> tuple[Schedule, frozenset[str]]:
    """Parse ``skip_first=10,warmup=2,active=5,repeat=1,<flag>,...`` into a schedule and flags.

    Every key is optional (defaults: ``default`` or :class:`Schedule`'s);
    ``skip`` is short for ``skip_first``. ``flags`` lists the bare words the
    calling tool accepts (e.g. ``memory`` for torch.profiler). ``option`` begins
    each error (``--deep``), so that the user sees which option and which key to fix.
    """
    schedule = default or Schedule()
    chosen: set[str] = set()
    if not text:
        return schedule, frozenset()
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep:
            if item not in flags:
                allowed = ", ".join(sorted(flags)) or "none"
                raise UsageError(f"{option}: unknown window flag {item!r} (flags: {allowed})")
            chosen.add(item)
            continue
        key = "skip_first" if key == "skip" else key
        if key not in _KEY_RULES:
            raise UsageError(f"{option}: unknown window key {key!r} (keys: {_KEYS})")
        least, meaning = _KEY_RULES[key]
        if not (value.isascii() and value.isdigit()) or int(value) < least:
            raise UsageError(f"{option} {item}: {key} takes a whole number >= {least} "
                             f"({meaning})")
        schedule = replace(schedule, **{key: int(value)})
    return schedule, frozenset(chosen)


def looks_like_spec(token: str) -> bool:
    """Whether a command-line token is a window spec, not the script: ``key=value`` items
    (whatever the values: a bad one is then an error about it, not "no such script") and
    the tools' flags.

    A path that exists, or one ending in ``.py``, is never a spec, so ``--deep train.py``
    and a script called ``memory`` still work; a bare word alone is a spec only when it is
    a flag.
    """
    if not token or token.startswith("-") or token.endswith(".py") or os.path.exists(token):
        return False
    items = [item.strip() for item in token.split(",") if item.strip()]
    keys = [item.partition("=")[0].strip() for item in items]
    if not items or not all(_WORD.match(key) for key in keys):
        return False
    return any("=" in item for item in items) or all(item in BARE_FLAGS for item in items)


#: Bare flags of the window tools (torch.profiler's options); see :func:`parse_spec`.
BARE_FLAGS = frozenset({"shapes", "memory", "stack", "flops", "modules"})


class WindowRunner:
    """Drives tools through a schedule as the step clock passes step counts.

    ``at_boundary(n)`` is called when ``n`` steps are done (step ``n`` is about
    to begin); it returns the next step count at which it wants to be called.
    A tool that raises is dropped (logged), never the training run.
    """

    def __init__(self, schedule: Schedule, tools: list[WindowTool]) -> None:
        self.schedule = schedule
        self.tools = list(tools)
        self.cycle = 0
        self.state = "idle"  # idle | warmup | active | done
        self.windows: list[tuple[int, int]] = []  # recorded (start, end) step ranges

    @property
    def profiling(self) -> bool:
        """True while a tool is on (the steps now carry FLAG_PROFILED)."""
        return self.state in ("warmup", "active")

    def first_watch(self) -> int:
        return self.schedule.phase_starts(0)[0]

    def _call(self, method: str, step: int) -> None:
        for tool in list(self.tools):
            fn = getattr(tool, method, None)  # prepare/boundary are optional
            if fn is None:
                continue
            try:
                fn(step)
            except Exception as exc:  # a broken tool must not break training
                log.warning("trainprof: %s.%s failed: %s; tool disabled", tool.name, method, exc)
                self.tools.remove(tool)

    def at_boundary(self, n: int) -> int:
        s = self.schedule
        while True:
            w_start, a_start, end = s.phase_starts(self.cycle)
            if self.state == "idle":
                if n < w_start:
                    return w_start
                if n < a_start:
                    self.state = "warmup"
                    self._call("prepare", n)
                    return n + 1
                self.state = "active"
                self._call("start", n)
                self._active_start = n
                return n + 1
            if self.state == "warmup":
                if n < a_start:
                    self._call("boundary", n)
                    return n + 1
                self.state = "active"
                self._call("start", n)
                self._active_start = n
                return n + 1
            if self.state == "active":
                if n < end:
                    self._call("boundary", n)
                    return n + 1
                self._call("stop", n)
                self.windows.append((self._active_start, n))
                self.cycle += 1
                if s.repeat and self.cycle >= s.repeat:
                    self.state = "done"
                    return NEVER
                self.state = "idle"
                continue
            return NEVER

    def finish(self, n: int) -> None:
        """The run ended with ``n`` steps done: close an open window, then every tool."""
        if self.state in ("warmup", "active"):
            if self.state == "active":
                self.windows.append((self._active_start, n))
            self._call("stop", n)
            self.state = "done"
        for tool in self.tools:
            try:
                tool.close()
            except Exception as exc:
                log.warning("trainprof: %s.close failed: %s", tool.name, exc)
