"""line_profiler on named functions over a bounded window of steps (``run --lines``).

kernprof's workflow (``@profile`` on the functions, then ``kernprof -l -v
train.py``) without touching the script: the targets are named on the command
line and resolved when the first window begins (the script has defined its
functions by then), then handed to :class:`line_profiler.LineProfiler`, which
is enabled only inside the windows. Target forms:

* ``pkg.mod:func``, ``pkg.mod:Class.method`` (any dotted path of attributes;
  a class alone means all its methods, as ``LineProfiler.add_class``);
* ``path/to/file.py:func``: the module loaded from that file; the script that
  runs as ``__main__`` counts (``train.py:slow_augment``), and so does
  ``__main__:func``.

Decorated functions (``functools.wraps``, e.g. ``@torch.no_grad()``) are
unwrapped to the user's own function. Targets that do not resolve are
reported in ``lines.json`` and at the end of ``lines.txt``, never raised: the
training run goes on.

How line_profiler records on Python 3.11: ``LineProfiler.enable`` installs a
C-level *trace* function on the calling thread (``PyEval_SetTrace``, the slot
behind :func:`sys.settrace`; 3.12+ uses :mod:`sys.monitoring` instead), and
``add_function`` swaps each target's ``__code__`` for a NOP-padded copy so
its lines can be told apart from identical bytecode. cProfile uses the other
slot (``PyEval_SetProfile``), so on 3.11 ``--py`` and ``--lines`` can share a
window; cProfile's times then include line_profiler's per-line cost in the
targeted functions (and line_profiler's include cProfile's per-call cost), so
for exact numbers run them in separate runs. On 3.12+ both use
``sys.monitoring.PROFILER_ID`` and cannot be on together
(:data:`SHARES_WINDOW_WITH_CPROFILE`): whichever starts second records a
message and sits the window out, so their windows must not overlap. Two
limits:

* a call that was already running when the window began (the function that
  contains the training loop) keeps its old, unpadded code and records nothing; name
  the function it calls each step instead (a message says so);
* only the training thread is traced (other threads and DataLoader worker
  processes are not).

Outputs in ``out_dir``: ``lines.txt`` (exactly ``LineProfiler.print_stats``'s
text, as ``kernprof -l -v`` prints it), ``lines.lprof`` (for ``python -m
line_profiler lines.lprof``) and ``lines.json`` (per function: file, first
line, and per line: hits, time, per hit, % of the function's time, source).
"""

from __future__ import annotations

import importlib
import inspect
import io
import itertools
import json
import keyword
import logging
import os
import sys
import time
import types
from pathlib import Path
from typing import Any

from trainprof.errors import UsageError

log = logging.getLogger(__name__)

LINE_PROFILER_MISSING = (
    "line_profiler is not installed (pip install line_profiler): --lines skipped"
)


#: Whether cProfile and line_profiler can be on at the same time. On 3.11 cProfile uses the
#: thread's profile function and line_profiler its trace function, two separate slots. From
#: 3.12 both use :mod:`sys.monitoring`'s one ``PROFILER_ID``: cProfile refuses to start while
#: line_profiler holds it, and line_profiler, started second, shares cProfile's id and fails
#: when cProfile frees it. So on 3.12+ ``--py`` and ``--lines`` need windows that do not overlap.
SHARES_WINDOW_WITH_CPROFILE = sys.version_info < (3, 12)
SEPARATE_WINDOWS = (
    "on Python 3.12+ cProfile (--py) and line_profiler (--lines) cannot run in the same "
    "window (both need sys.monitoring's PROFILER_ID): give them separate windows or runs"
)


def profiler_slot_holder() -> str | None:
    """The tool holding ``sys.monitoring.PROFILER_ID`` (3.12+), e.g. ``'cProfile'``; else None."""
    mon = getattr(sys, "monitoring", None)
    if mon is None:
        return None
    return mon.get_tool(mon.PROFILER_ID)


def _is_identifier_path(text: str) -> bool:
    parts = text.split(".")
    return all(p.isidentifier() and not keyword.iskeyword(p) for p in parts)


def _is_path(module_part: str) -> bool:
    return module_part.endswith(".py") or "/" in module_part or os.sep in module_part


def parse_targets(text: str) -> list[str]:
    """Split ``a.b:f,path/x.py:C.m`` into checked targets; malformed input is a UsageError."""
    if text is None or not text.strip():
        raise UsageError("--lines needs at least one target: module:function or file.py:function")
    targets: list[str] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        module_part, sep, attr = item.rpartition(":")
        if not sep or not module_part or not attr:
            raise UsageError(
                f"bad --lines target {item!r}: expected module:function, module:Class.method "
                "or path/to/file.py:function"
            )
        if not _is_identifier_path(attr):
            raise UsageError(
                f"bad --lines target {item!r}: {attr!r} is not a function name "
                "(expected function or Class.method)"
            )
        if not _is_path(module_part) and not _is_identifier_path(module_part):
            raise UsageError(
                f"bad --lines target {item!r}: {module_part!r} is neither a module name "
                "(pkg.mod) nor a .py file path"
            )
        if item not in targets:
            targets.append(item)
    if not targets:
        raise UsageError("--lines needs at least one target: module:function or file.py:function")
    return targets


def _main_module() -> types.ModuleType | None:
    return sys.modules.get("__main__")


def _module_for_file(path: str) -> types.ModuleType:
    """The loaded module whose source is ``path`` (the ``__main__`` script first)."""
    want = os.path.realpath(path)
    if not os.path.exists(want):
        raise LookupError(f"no such file {path!r}")
    base = os.path.basename(want)
    main = _main_module()
    for mod in itertools.chain([main], list(sys.modules.values())):
        f = getattr(mod, "__file__", None)
        # basename first: realpath() of every loaded module costs milliseconds
        if f and os.path.basename(f) == base and os.path.realpath(f) == want:
            return mod
    # Loading the file again would make a second copy of its functions that the
    # training code never calls: every line would read 0 hits.
    raise LookupError(f"{path} is not a module this run has imported (nor the script itself)")


def _module_for_name(name: str) -> types.ModuleType:
    main = _main_module()
    if name == "__main__" and main is not None:
        return main
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name == name and main is not None:
        return main  # `trainprof run -m pkg.train`: pkg.train runs as __main__
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise LookupError(f"cannot import module {name!r}: {exc}") from None


def resolve_target(target: str) -> tuple[object, str]:
    """The object named by ``target`` and its qualified name; LookupError with why, if none."""
    module_part, _, attr = target.rpartition(":")
    mod = _module_for_file(module_part) if _is_path(module_part) else _module_for_name(module_part)
    obj: object = mod
    for part in attr.split("."):
        try:
            # static lookup keeps classmethod/staticmethod/property objects as they are
            obj = inspect.getattr_static(obj, part)
        except AttributeError:
            where = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", "?")
            raise LookupError(f"{where} has no attribute {part!r}") from None
    if isinstance(obj, types.FunctionType) and hasattr(obj, "__wrapped__"):
        obj = inspect.unwrap(obj)  # @functools.wraps decorators: profile the user's own lines
    return obj, f"{mod.__name__}:{attr}"


def _running_codes() -> set[types.CodeType]:
    codes: set[types.CodeType] = set()
    frame = sys._getframe(1)
    while frame is not None:
        codes.add(frame.f_code)
        frame = frame.f_back  # type: ignore[assignment]
    return codes


class LineProfileTool:
    """A window tool: :class:`line_profiler.LineProfiler` on the targets, inside windows only.

    Timings accumulate over repeat windows (the profiler keeps its counts
    across ``enable``/``disable``).
    """

    name = "lines"

    def __init__(self, out_dir: Path, targets: list[str]) -> None:
        self.out_dir = Path(out_dir)
        self.targets = list(targets)
        self.profiler: Any = None
        self.windows: list[tuple[int, int]] = []
        self.wall_s = 0.0
        self.messages: list[str] = []
        # target → {"resolved": bool, "error": str | None, "functions": [...]}
        self.status: dict[str, dict[str, Any]] = {
            t: {"target": t, "resolved": False, "error": None, "functions": []} for t in targets
        }
        self._already_running: dict[str, str] = {}  # function label → target
        # (file, first line) → "module:qualname", taken when resolving: at close the
        # launcher may already have put the original __main__ back in sys.modules
        self._labels: dict[tuple[str, int], str] = {}
        self._since: float | None = None
        self._start_step = 0
        self._unavailable = False
        try:  # imported now, not at the window's start, so that a --py window does not see it
            from line_profiler import LineProfiler
        except ImportError:
            self._unavailable = True
            self.messages.append(LINE_PROFILER_MISSING)
        else:
            self.profiler = LineProfiler()

    def prepare(self, step: int) -> None:
        """Resolve the targets during the warm-up, so that a cProfile window does not see it."""
        if self.profiler is not None:
            self._resolve()

    def boundary(self, step: int) -> None:
        """Nothing per step."""

    def _resolve(self) -> None:
        running = _running_codes()
        for target, st in self.status.items():
            if st["resolved"]:
                continue
            try:
                obj, qualname = resolve_target(target)
                funcs = self.profiler.get_underlying_functions(obj)
                if not funcs:
                    raise LookupError(
                        f"{qualname} is not a Python function ({type(obj).__name__}): "
                        "line_profiler times Python source lines only"
                    )
                for f in funcs:
                    label = f"{f.__module__}:{f.__qualname__}"
                    if f.__code__ in running:
                        self._already_running[label] = target
                    self.profiler.add_function(f)
                    self._labels[(f.__code__.co_filename, f.__code__.co_firstlineno)] = label
            except LookupError as exc:
                st["error"] = f"target {target!r} did not resolve: {exc}"
                continue
            except Exception as exc:  # a target must never break the run
                st["error"] = f"target {target!r} could not be profiled: {exc}"
                continue
            st["resolved"], st["error"] = True, None
            st["functions"] = [f"{f.__module__}:{f.__qualname__}" for f in funcs]

    def start(self, step: int) -> None:
        if self._since is not None or self._unavailable:
            return
        self._resolve()  # again at every window: a module may be imported later
        if not any(st["resolved"] for st in self.status.values()):
            return  # nothing to trace: no tracing cost either
        holder = profiler_slot_holder()
        if holder is not None and holder != "line_profiler":
            self._note(f"line_profiler not started at step {step}: {holder} holds Python's "
                       f"profiler slot; {SEPARATE_WINDOWS}")
            return
        try:
            self.profiler.enable_by_count()
        except Exception as exc:
            self._note(f"line_profiler not started at step {step}: {exc}")
            return
        self._start_step = step
        self._since = time.perf_counter()

    def stop(self, step: int) -> None:
        if self._since is None:
            return
        try:
            self.profiler.disable_by_count()
        except Exception as exc:  # 3.12+: another tool freed the shared sys.monitoring id
            self._note(f"line_profiler stopped with an error at step {step}: {exc}")
        self.wall_s += time.perf_counter() - self._since
        self._since = None
        self.windows.append((self._start_step, step))

    def _note(self, message: str) -> None:
        if message not in self.messages:
            self.messages.append(message)

    def close(self) -> None:
        """Write ``lines.txt``, ``lines.lprof`` and ``lines.json``."""
        try:
            self._close()
        except Exception as exc:
            log.warning("trainprof: writing the line profile failed: %s", exc)

    # -- results -----------------------------------------------------------

    def _close(self) -> None:
        if self._since is not None:
            self.stop(self._start_step + 1)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        messages = list(self.messages)
        messages += [st["error"] for st in self.status.values() if st["error"]]
        functions: list[dict[str, Any]] = []
        text = ""
        unit = None
        if self.profiler is not None:
            stats = self.profiler.get_stats()
            unit = stats.unit
            functions = function_rows(stats.timings, stats.unit, self._labels)
            hits = {f["label"]: f["hits"] for f in functions}
            for label, target in self._already_running.items():
                if not hits.get(label):
                    messages.append(
                        f"{label} (--lines {target}) was already running when the window began "
                        "and recorded no line: line_profiler sees only calls that start inside "
                        "the window; name a function it calls every step instead")
            buf = io.StringIO()
            # kernprof -l -v's text; config=False: no line_profiler.toml lookup in the user's cwd
            self.profiler.print_stats(stream=buf, details=True, summarize=True, config=False)
            text = buf.getvalue()
            if self.profiler.functions:
                self.profiler.dump_stats(str(self.out_dir / "lines.lprof"))
        if not self.windows and not self._unavailable and not self.messages:
            messages.append(
                "line_profiler recorded nothing: "
                + ("no --lines target resolved" if any(st["error"] for st in self.status.values())
                   and not any(st["resolved"] for st in self.status.values())
                   else "the run ended before the profiling window began (fewer steps than "
                        "its skip_first)"))
        if messages:
            text += "".join(f"trainprof: {m}\n" for m in messages)
        _write_atomic(self.out_dir / "lines.txt", text)
        doc = {
            "tool": "lines",
            "version": 1,
            "windows": [list(w) for w in self.windows],
            "steps_profiled": sum(b - a for a, b in self.windows),
            "wall_s": self.wall_s,
            "timer_unit_s": unit,
            "targets": list(self.status.values()),
            "functions": functions,
            "messages": messages,
        }
        _write_atomic(self.out_dir / "lines.json", json.dumps(doc, indent=1))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _source_block(filename: str, first_line: int) -> list[str]:
    """The function's source lines as line_profiler shows them (``inspect.getblock``)."""
    import linecache

    lines = linecache.getlines(filename)
    if not lines:
        return []
    try:
        return inspect.getblock(lines[first_line - 1:])
    except Exception:
        return lines[first_line - 1:first_line]


def function_rows(
    timings: dict[tuple[str, int, str], list[tuple[int, int, int]]],
    unit: float,
    labels: dict[tuple[str, int], str] | None = None,
) -> list[dict[str, Any]]:
    """``LineStats.timings`` → one dict per function, every source line with its numbers.

    Columns as line_profiler's ``show_func``: Hits, Time (here seconds), Per
    Hit, % Time (share of the function's total time), Line Contents.
    """
    out = []
    for (filename, first_line, name), entries in timings.items():
        per_line: dict[int, tuple[int, float]] = {}
        for lineno, nhits, t in entries:
            h0, t0 = per_line.get(lineno, (0, 0.0))
            per_line[lineno] = (h0 + nhits, t0 + t * unit)
        total = sum(t for _, t in per_line.values())
        source = _source_block(filename, first_line)
        linenos = sorted(set(range(first_line, first_line + len(source))) | set(per_line))
        rows = []
        for ln in linenos:
            h, t = per_line.get(ln, (0, 0.0))
            idx = ln - first_line
            rows.append({
                "line": ln,
                "hits": h,
                "time_s": t,
                "per_hit_s": t / h if h else None,
                "percent": 100.0 * t / total if total > 0 else 0.0,
                "source": source[idx].rstrip("\n") if 0 <= idx < len(source) else "",
            })
        out.append({
            "label": (labels or {}).get((filename, first_line), name),
            "function": name,
            "file": filename,
            "first_line": first_line,
            "total_time_s": total,
            "hits": sum(h for h, _ in per_line.values()),
            "lines": rows,
        })
    out.sort(key=lambda f: f["total_time_s"], reverse=True)
    return out

