"""What the user typed after ``trainprof run``, when it is not a Python script's path.

Why: people paste the command they already run. ``trainprof run python train.py`` (the
interpreter word kept), ``trainprof run run.sh`` (the shell script that starts training),
``trainprof run bash run.sh`` and ``trainprof run my-train`` (a project's console script)
are what users type first. trainprof runs Python in its own process, so:

* a leading ``python``/``python3``/``python3.11`` word is the interpreter and is dropped:
  unambiguous (no such file here), and the script then runs with trainprof's own Python,
  as ``python`` would run it (``-m MODULE`` after it is a module);
* a console script on ``PATH`` whose shebang is a Python (what ``pip install`` writes for
  ``[project.scripts]``) is a Python file: it runs as that script, with trainprof's
  Python - and is refused when its shebang names another interpreter (its imports are that
  one's), with the command to use;
* a shell script, or any other program (``bash``, a binary), is refused with an ``error:``
  that says what it is and what to run instead: the ``python`` command inside it, quoted
  when the shell script has exactly one.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from pathlib import Path

from trainprof.errors import UsageError

#: ``python``, ``python3``, ``python3.11`` (a path's last part).
PYTHON_WORD = re.compile(r"python(\d+(\.\d+)*)?$")
#: Shells whose scripts ``trainprof run`` is sometimes given.
SHELLS = frozenset({"sh", "bash", "zsh", "dash", "ksh", "fish"})
SHELL_SUFFIXES = frozenset({".sh", ".bash", ".zsh", ".ksh"})
#: A shell line that runs Python: variable assignments, ``exec``, the interpreter, the rest.
_PYTHON_LINE = re.compile(
    r"^(?P<env>(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*)(?:exec\s+)?(?:\S*/)?"
    r"python(?:\d+(?:\.\d+)*)?\s+(?P<rest>\S.*)$")


def is_python_word(word: str) -> bool:
    """``python``/``python3``/``python3.11``, or a path to one, that is not a file here."""
    return bool(PYTHON_WORD.match(os.path.basename(word))) and not (
        Path(word).is_file() and _is_text(Path(word)))


#: ``-X`` options with an environment variable of their own (Python's command-line docs).
_X_ENV = {"dev": ("PYTHONDEVMODE", "1"), "faulthandler": ("PYTHONFAULTHANDLER", "1"),
          "utf8": ("PYTHONUTF8", "1"), "tracemalloc": ("PYTHONTRACEMALLOC", "1"),
          "importtime": ("PYTHONPROFILEIMPORTTIME", "1")}
#: Single-letter options with one (``-OO`` is PYTHONOPTIMIZE=2).
_FLAG_ENV = {"-u": ("PYTHONUNBUFFERED", "1"), "-O": ("PYTHONOPTIMIZE", "1"),
             "-OO": ("PYTHONOPTIMIZE", "2"), "-B": ("PYTHONDONTWRITEBYTECODE", "1"),
             "-v": ("PYTHONVERBOSE", "1")}


def _env_hint(args: list[str]) -> str:
    """The environment variables that do what the interpreter's options before the script
    do (Python's documentation, "Command line and environment"), as a hint: ``python -W
    ignore x.py`` had been refused with none, where ``-u`` named PYTHONUNBUFFERED. Empty
    when an option has no such variable."""
    env: list[tuple[str, str]] = []
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "-m":
        word = args[i]
        if word in _FLAG_ENV:
            env.append(_FLAG_ENV[word])
        elif word in ("-W", "-X") or word.startswith(("-W", "-X")):
            value = word[2:] or (args[i + 1] if i + 1 < len(args) else "")
            i += 0 if word[2:] else 1
            if word.startswith("-W") and value:
                env.append(("PYTHONWARNINGS", value))
            elif value.split("=")[0] in _X_ENV:
                name, _, level = value.partition("=")
                env.append((_X_ENV[name][0], level or _X_ENV[name][1]))
            else:
                return ""
        else:
            return ""
        i += 1
    if not env:
        return ""
    words = args[i:] or ["SCRIPT"]
    # several -W options join with commas in PYTHONWARNINGS
    merged: dict[str, str] = {}
    for name, value in env:
        merged[name] = (f"{merged[name]},{value}" if name == "PYTHONWARNINGS" and name in merged
                        else value)
    assignments = " ".join(f"{name}={shlex.quote(value)}" for name, value in merged.items())
    return (f"; for {shlex.join(args[:i])}, set {assignments}: "
            f"`{assignments} trainprof run {shlex.join(words)}`")


def strip_interpreter(target: str, args: list[str]) -> tuple[str, list[str], bool]:
    """``python train.py ARGS`` → ``train.py``, ``ARGS``; ``python -m pkg ARGS`` → the
    module. Returns (target, args, module); anything else is returned as given."""
    if not is_python_word(target):
        return target, args, False
    if os.sep in target and os.path.abspath(target) != os.path.abspath(sys.executable):
        raise UsageError(f"trainprof runs the script with its own Python, {sys.executable}, "
                         f"not {target}: to use that one, run `{target} -m trainprof run "
                         f"{shlex.join(args) or 'SCRIPT'}`")
    if not args:
        raise UsageError(f"missing SCRIPT (or -m MODULE) after {target} "
                         "(see 'trainprof run --help')")
    if args[0] == "-m":
        if len(args) < 2:
            raise UsageError(f"{target} -m: missing MODULE")
        return args[1], args[2:], True
    if args[0].startswith("-"):
        hint = _env_hint(args)
        raise UsageError(f"trainprof run takes the script without the interpreter's options "
                         f"({target} {args[0]}): trainprof run [OPTIONS] SCRIPT ARGS...{hint}")
    return args[0], args[1:], False


def _is_text(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            head = f.read(512)
    except OSError:
        return False
    return b"\0" not in head


def _shebang(path: Path) -> list[str]:
    """The interpreter words of a ``#!`` line (``["/usr/bin/env", "python3"]``), or []."""
    try:
        with path.open("rb") as f:
            first = f.readline(512)
    except OSError:
        return []
    if not first.startswith(b"#!"):
        return []
    return first[2:].decode(errors="replace").split()


def _interpreter(words: list[str]) -> str | None:
    """The program a shebang runs: ``env``'s argument where it is ``/usr/bin/env X``."""
    if not words:
        return None
    if os.path.basename(words[0]) == "env":
        rest = [w for w in words[1:] if not w.startswith("-")]
        return rest[0] if rest else None
    return words[0]


def python_commands(text: str) -> list[str]:
    """The ``trainprof run ...`` commands for the lines of a shell script that run Python
    (line continuations joined; comments left out)."""
    lines, current = [], ""
    for raw in text.splitlines():
        line = raw.strip() if current else raw.rstrip()
        if line.endswith("\\"):
            current += line[:-1].rstrip() + " "
            continue
        lines.append(current + line)
        current = ""
    out = []
    for line in lines:
        match = _PYTHON_LINE.match(line.strip())
        if match and not line.strip().startswith("#"):
            out.append(f"{match['env']}trainprof run {match['rest'].strip()}")
    return out


def _shell_hint(script: Path) -> str:
    try:
        commands = python_commands(script.read_text(errors="replace"))
    except OSError:
        commands = []
    if len(commands) == 1:
        return f"it runs Python once: use `{commands[0]}`"
    found = f" (it has {len(commands)} python lines)" if commands else ""
    return ("run trainprof on the python command it runs instead"
            f"{found}: trainprof run SCRIPT ARGS, with the variables it sets")


def refuse_non_python(target: str) -> None:
    """An ``error:`` for a shell script or a program given as the script (module doc)."""
    path = Path(target)
    interpreter = _interpreter(_shebang(path))
    shell = interpreter is not None and os.path.basename(interpreter) in SHELLS
    if shell or (path.suffix in SHELL_SUFFIXES and not (
            interpreter and PYTHON_WORD.match(os.path.basename(interpreter)))):
        raise UsageError(f"{target} is a shell script, not Python: trainprof runs Python in "
                         f"its own process; {_shell_hint(path)}")
    if not _is_text(path):
        raise UsageError(f"{target} is a program, not a Python script: trainprof runs "
                         "Python scripts (trainprof run SCRIPT ARGS or -m MODULE ARGS)")


def resolve_program(target: str, args: list[str]) -> str | None:
    """The file a bare command name stands for (no such file here): a console script of
    this Python is returned to run as a script; a shell, another program or another
    Python's console script raises the ``error:`` that says what to run. None: not found."""
    if os.sep in target:
        return None
    found = shutil.which(target)
    if found is None:
        return None
    name = os.path.basename(target)
    if name in SHELLS:
        script = next((a for a in args if not a.startswith("-")), None)
        hint = (f"; {_shell_hint(Path(script))}" if script and Path(script).is_file()
                else ": run trainprof on the python command the shell runs")
        raise UsageError(f"{target} is a shell ({found}), not a Python script: trainprof runs "
                         f"Python in its own process{hint}")
    interpreter = _interpreter(_shebang(Path(found)))
    if interpreter is None or not PYTHON_WORD.match(os.path.basename(interpreter)):
        raise UsageError(f"{target} is a program ({found}), not a Python script: trainprof "
                         "runs Python scripts (trainprof run SCRIPT ARGS or -m MODULE ARGS)")
    if os.sep in interpreter and os.path.abspath(interpreter) != os.path.abspath(sys.executable):
        raise UsageError(f"{target} is a console script of another Python ({interpreter}), "
                         f"not trainprof's ({sys.executable}): run `{interpreter} -m trainprof "
                         f"run {shlex.join([found, *args])}`")
    return found


def resolve_command(target: str, args: list[str], module: bool
                    ) -> tuple[str, list[str], bool]:
    """The script (or module) and its arguments in what was typed: a leading interpreter
    word dropped, a console script's name replaced by its file (module docstring)."""
    if module:
        return target, args, module
    target, args, module = strip_interpreter(target, args)
    if not module and not Path(target).exists():
        found = resolve_program(target, args)
        if found is not None:
            target = found
    return target, args, module
