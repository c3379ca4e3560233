"""Command line: argument parsing and exit codes only; each command calls one library function.

Exit codes (contract): ``run`` returns the script's own code; other commands 0
on success; 2 for bad input, with one ``error: ...`` line on stderr and no
traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn

from trainprof import __version__
from trainprof.errors import UsageError


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad option is a one-line ``error:`` (exit 2), not a usage dump."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


RUN_EPILOG = """\
The script runs exactly as `python SCRIPT ARGS` would (same sys.argv, __main__,
working directory); everything after SCRIPT (or after -m MODULE) goes to it.
Steps are found automatically (optimizer steps, else backward() calls).

examples:
  trainprof run train.py --lr 0.1
  trainprof run --max-steps 200 --json train.py > summary.json
  trainprof run -m mypkg.train --epochs 1
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def build_parser() -> _Parser:
    parser = _Parser(
        prog="trainprof",
        description="Measure a PyTorch training run, find the bottleneck, prove the fix.",
    )
    parser.add_argument("--version", action="version", version=f"trainprof {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    run = sub.add_parser(
        "run",
        help="run a training script unmodified and profile it",
        usage="trainprof run [OPTIONS] (SCRIPT | -m MODULE) [ARGS...]",
        epilog=RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("script", nargs="?", metavar="SCRIPT", help="the training script")
    run.add_argument("-m", dest="module", metavar="MODULE", help="run a module, like python -m")
    run.add_argument("--out", type=Path, metavar="DIR",
                     help="run folder (default: ./trainprof-runs/<timestamp>-<name>/)")
    run.add_argument("--name", help="name of the run (default: the script's name)")
    run.add_argument("--max-steps", type=_positive_int, metavar="N",
                     help="stop the script cleanly after N steps")
    run.add_argument("--json", action="store_true",
                     help="print one JSON document on stdout (the script's stdout goes to stderr)")
    run.add_argument("--sample-interval", type=_positive_float, default=0.2, metavar="SECONDS",
                     help="system sampling period (default: 0.2 s, i.e. 5 Hz)")

    report = sub.add_parser("report", help="summarise an existing run folder, in any status")
    report.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                        help="a run folder written by trainprof run (any status)")
    report.add_argument("--json", action="store_true", help="print one JSON document")
    return parser


def _split_run_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split ``run`` arguments into trainprof's options and the script's own.

    trainprof's options come first; the first bare word is the script and
    ``-m MODULE`` ends the options too. Everything after belongs to the script
    (so ``trainprof run train.py --json`` passes ``--json`` to train.py).
    """
    takes_value = {"--out", "--name", "--max-steps", "--sample-interval"}
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            return argv[:i], argv[i + 1 :]
        if tok == "-m":
            return argv[: i + 2], argv[i + 2 :]
        if tok.startswith("-m") and len(tok) > 2 and not tok.startswith("--"):
            return argv[: i + 1], argv[i + 1 :]
        if not tok.startswith("-"):
            return argv[: i + 1], argv[i + 1 :]
        i += 2 if tok in takes_value else 1
    return argv, []


def _dispatch(argv: list[str]) -> int:
    parser = build_parser()
    if argv and argv[0] == "run":
        own, script_args = _split_run_args(argv[1:])
        ns = parser.parse_args(["run", *own])
        target = ns.module if ns.module is not None else ns.script
        if target is None:
            raise UsageError("missing SCRIPT (or -m MODULE) to run (see 'trainprof run --help')")
        from trainprof.commands import run_command

        return run_command(
            target,
            script_args,
            module=ns.module is not None,
            out=ns.out,
            name=ns.name,
            max_steps=ns.max_steps,
            json_out=ns.json,
            sample_interval_s=ns.sample_interval,
        )
    ns = parser.parse_args(argv)
    if ns.command == "report":
        from trainprof.commands import report_command

        return report_command(ns.run_dir, json_out=ns.json)
    parser.print_help()
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return _dispatch(argv)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
