"""Command line: argument parsing and exit codes only; each command calls one library function.

Exit codes (contract): ``run`` returns the script's own code; other commands 0
on success; 2 for bad input, with one ``error: ...`` line on stderr and no
traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from pathlib import Path
from typing import Any, NoReturn

from trainprof import __version__
from trainprof.capture.knobs import KNOBS
from trainprof.capture.sampler import DEFAULT_INTERVAL_S, MIN_INTERVAL_S
from trainprof.capture.window import looks_like_spec
from trainprof.errors import UsageError
from trainprof.experiments.jobs import DEFAULT_TIMEOUT_MIN
from trainprof.experiments.verify import VERDICTS


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad option is a one-line ``error:`` (exit 2), not a usage dump."""

    #: The commands, in --help's order (set by :func:`build_parser` on the top parser).
    commands: tuple[str, ...] = ()

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:
        """As argparse's, but words left over point at the help of the command that was
        given (argparse's own message names the top parser's, which does not list them)."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            command = getattr(ns, "command", None)
            prog = f"{self.prog} {command}" if command else self.prog
            raise UsageError(f"unrecognized arguments: {' '.join(extras)} "
                             f"(see '{prog} --help')")
        return ns


RUN_EPILOG = """\
The script runs exactly as `python SCRIPT ARGS` would (same sys.argv, __main__,
working directory); everything after SCRIPT (or after -m MODULE) goes to it.
Steps are found automatically (optimizer steps, else backward() calls).
A leading `python`/`python3` word is taken as the interpreter and dropped
(`trainprof run python train.py` runs train.py with trainprof's own Python); a
console script's name on PATH runs its file as the script. Shell scripts and
other programs are refused: run trainprof on the python command they run.

examples:
  trainprof run train.py --lr 0.1
  trainprof run --max-steps 200 --json train.py > summary.json
  trainprof run -m mypkg.train --epochs 1
"""


TUNE_EPILOG = """\
Each value runs the unmodified script under `trainprof run --max-steps N` in
shuffled rounds of trials; the report gives each arm's mean steady-state time
per step (per sample when batch_size changes), its ratio to the baseline with a
bootstrap confidence interval over trials and steps, and a verdict.

knobs:
{knobs}

examples:
  trainprof tune --knob num_workers=0,2,4 train.py --lr 0.1
  trainprof tune --knob torch_threads=1,2 --trials 5 --json train.py > tune.json
  trainprof tune --knob optimizer=script,fused train.py
  trainprof tune --knob synthetic_data=false,true train.py   # the step with input made free
  trainprof tune --slurm slurm_partition=gpu,gpus_per_node=1 --knob tf32=false,true train.py
"""


STAGE_EPILOG = """\
Data on network storage pays a round trip per file, every epoch, on every rank. The
copy on local disk pays it once: the ranks of a node share one copy (the others wait
while one copies), a later job on the node reuses it, and a changed source (a file
added, resized or touched) gets a fresh one. The copy appears only when complete.
Standard output is the path to read from, so that a job script can do:

  DATA=$(trainprof stage /nfs/datasets/train.pack)
  python train.py --data "$DATA"

In Python: trainprof.fixes.stage(path).path
"""


PACK_EPILOG = """\
One file per sample is slow to read: every sample costs an open, a read and a
close, and on network storage a round trip. A pack holds the same samples in a
few large files read by mmap; train from it with

  from trainprof.fixes import PackedDataset
  dataset = PackedDataset("OUT", transform=...)  # (image, label) like ImageFolder

With class sub-folders (DATA_DIR/<class>/<file>) the labels and the order are
ImageFolder's. After packing, the same random samples are read from the files
and from the pack: the rates are compared and the content checked (exit 1 if
it differs).

examples:
  trainprof pack data/train data/train.pack
  trainprof pack --decode --ext png data/cifar data/cifar.pack
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


def _step_range(text: str) -> tuple[int | None, int | None]:
    """``FIRST:LAST`` (either side may be left out), steps counted from 0, inclusive."""
    first, sep, last = text.partition(":")
    try:
        bounds = (int(first) if first.strip() else None, int(last) if last.strip() else None)
    except ValueError:
        bounds = None
    if not sep or bounds is None or any(b is not None and b < 0 for b in bounds) or (
            None not in bounds and bounds[0] > bounds[1]):
        raise argparse.ArgumentTypeError(
            f"expected FIRST:LAST step numbers (e.g. 5000:5999, 5000: or :999), got {text!r}")
    return bounds


def _sample_interval(text: str) -> float:
    """A sampling period no shorter than the CPU counters resolve (see MIN_INTERVAL_S)."""
    value = _positive_float(text)
    if value < MIN_INTERVAL_S:
        raise argparse.ArgumentTypeError(
            f"expected at least {MIN_INTERVAL_S:g} s, got {text!r}: CPU time is counted in "
            "10 ms ticks, so a shorter period gives wrong CPU figures")
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
    run.add_argument("--sample-interval", type=_sample_interval, default=DEFAULT_INTERVAL_S,
                     metavar="SECONDS",
                     help=f"system sampling period (default: {DEFAULT_INTERVAL_S:g} s, i.e. "
                          f"{1 / DEFAULT_INTERVAL_S:g} Hz; at least {MIN_INTERVAL_S:g} s: CPU "
                          "time is counted in 10 ms ticks)")
    heavy = run.add_argument_group(
        "heavy tools over a window of steps",
        "SPEC is a comma list of key=N (skip_first, wait, warmup, active, repeat; repeat=0: until "
        "the end) and, for --deep, the flags shapes, memory, stack, flops, modules. Steps inside "
        "a window are left out of the step statistics.",
    )
    heavy.add_argument("--deep", nargs="?", const="", default=None, metavar="SPEC",
                       help="torch.profiler over a window (default: skip_first=10,warmup=2,"
                            "active=5,repeat=1); traces go to RUN_DIR/deep/*.pt.trace.json.gz")
    heavy.add_argument("--py", nargs="?", const="", default=None, metavar="SPEC",
                       help="cProfile over a window (default: skip_first=10,active=20) -> "
                            "RUN_DIR/python/ (pstats, call graph SVG); also samples the Python "
                            "stacks of DataLoader workers")
    heavy.add_argument("--lines", metavar="TARGETS",
                       help="line-by-line timings of functions, comma separated: pkg.mod:func, "
                            "pkg.mod:Class.method or path/to/file.py:func (window as --py)")
    run.add_argument("--no-html", action="store_true",
                     help="do not write RUN_DIR/report.html at the end")
    # set by trainprof itself for a script's run of itself (PyTorch Lightning's DDP
    # launcher): this run is a rank of that one, which prints the summary
    run.add_argument("--rank-of", type=Path, metavar="RUN_DIR", help=argparse.SUPPRESS)

    report = sub.add_parser("report", help="summarise an existing run folder, in any status",
                            usage="trainprof report [-h] [--json] [--html [PATH]] RUN_DIR")
    # optional to argparse only: `report --html RUN_DIR` gives it to --html (see _report_dirs)
    report.add_argument("run_dir", type=Path, nargs="?", metavar="RUN_DIR",
                        help="a run folder written by trainprof run (any status)")
    report.add_argument("--json", action="store_true", help="print one JSON document")
    report.add_argument("--html", nargs="?", const=True, default=None, metavar="PATH",
                        help="write the self-contained HTML report (default: RUN_DIR/report.html)")

    trace = sub.add_parser(
        "trace",
        help="analyse a torch.profiler / Kineto trace (file, .gz, or a folder of ranks)",
        epilog="examples:\n  trainprof trace rank0.pt.trace.json.gz\n"
               "  trainprof trace ./traces/ --json > analysis.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    trace.add_argument("path", type=Path, metavar="TRACE_FILE_OR_DIR",
                       help="a Chrome-trace JSON file (plain or gzipped) or a folder of them")
    trace.add_argument("--json", action="store_true", help="print one JSON document")

    compare = sub.add_parser(
        "compare",
        help="compare two runs: is B slower than A, which phase, which setting changed",
        epilog="examples:\n  trainprof compare trainprof-runs/before trainprof-runs/after\n"
               "  trainprof compare A B --fail-if-slower 5   # exit 1 on a significant slowdown",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    compare.add_argument("run_a", type=Path, metavar="RUN_A", help="the baseline run folder")
    compare.add_argument("run_b", type=Path, metavar="RUN_B", help="the run to compare with it")
    compare.add_argument("--json", action="store_true", help="print one JSON document")
    compare.add_argument("--html", type=Path, metavar="PATH", help="also write an HTML report")
    compare.add_argument("--fail-if-slower", type=_positive_float, metavar="PCT",
                         help="exit 1 when B is significantly slower than A by more than PCT "
                         "%% (the headline's time per step, sample or GFLOP); exit 2 when too "
                         "few steady steps left nothing to compare")

    tune = sub.add_parser(
        "tune",
        help="run the script with settings changed (knobs) and measure which is faster",
        usage="trainprof tune [OPTIONS] (SCRIPT | -m MODULE) [ARGS...]",
        epilog=TUNE_EPILOG.format(knobs="\n".join(
            # the names' column as wide as the longest name, two spaces after it
            f"  {spec.name:<{max(map(len, KNOBS)) + 2}}{spec.help}" for spec in KNOBS.values())),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tune.add_argument("script", nargs="?", metavar="SCRIPT", help="the training script")
    tune.add_argument("-m", dest="module", metavar="MODULE", help="run a module, like python -m")
    tune.add_argument("--knob", action="append", default=[], metavar="NAME=V1,V2,...",
                      help="a setting and the values to try (knobs below); the value "
                           "'script' keeps the script's own. Several --knob options give the "
                           "grid of combinations (at most 16 arms)")
    tune.add_argument("--steps", type=_positive_int, default=60, metavar="N",
                      help="steps per trial (default: 60)")
    tune.add_argument("--trials", type=_positive_int, default=3, metavar="K",
                      help="trials per value, run in shuffled rounds (default: 3)")
    tune.add_argument("--baseline", metavar="NAME=VALUE[,NAME=VALUE]",
                      help="the arm the others are compared with (default: the first value)")
    tune.add_argument("--out", type=Path, metavar="DIR",
                      help="the trials' runs (default: ./trainprof-runs/<time>-tune-<name>/)")
    tune.add_argument("--json", action="store_true", help="print one JSON document")
    tune.add_argument("--slurm", nargs="?", const="", metavar="KEY=VALUE,...",
                      help="run each round (every arm once, on one node) as a job through "
                           "submitit, the rounds at once: KEY=VALUE are submitit's parameters "
                           f"(slurm_partition, gpus_per_node, timeout_min (default "
                           f"{DEFAULT_TIMEOUT_MIN}), ...); cluster=local runs the jobs on this "
                           "machine, one after another. Needs trainprof[slurm] and a folder "
                           "the nodes share")

    verify = sub.add_parser(
        "verify",
        help="measure a run's finding: its fix's knob under trainprof tune, on the run's "
             "own command, against the finding's estimate",
        epilog="examples:\n  trainprof verify trainprof-runs/20261127-170000-train"
               "          # the first finding with a knob\n"
               "  trainprof verify RUN_DIR --finding 2 --trials 5\n\n" + textwrap.fill(
                   "The verdict: " + ", ".join(f"{v} ({why})" for v, why in VERDICTS.items())
                   + ". The trials and verify.json go to --out (default: "
                   "./trainprof-runs/<time>-verify-<name>/).", width=79) + "\n\n"
               + textwrap.fill(
                   "The trials run as the run did, wherever verify is started: with its "
                   "interpreter while that exists and runs trainprof (else with this one, "
                   "refused with an error if its torch version is not the run's), in the "
                   "folder it started in, with its thread, device, allocator and launch "
                   "variables (OMP_NUM_THREADS, CUDA_VISIBLE_DEVICES, PYTHONPATH, ...) set or "
                   "unset as they were; one line names every difference from here.",
                   width=79),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verify.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run folder")
    verify.add_argument("--finding", type=_positive_int, metavar="N",
                        help="the finding's number as printed (default: the first whose "
                             "verify line has a knob)")
    verify.add_argument("--steps", type=_positive_int, metavar="N",
                        help="steps per trial (default: the verify line's, else 60; for a "
                             "run that crashed, no more than it completed)")
    verify.add_argument("--trials", type=_positive_int, default=3, metavar="K",
                        help="trials per value, run in shuffled rounds (default: 3)")
    verify.add_argument("--out", type=Path, metavar="DIR", help="the trials' runs")
    verify.add_argument("--json", action="store_true", help="print one JSON document")

    export = sub.add_parser("export", help="export a run for other tools")
    export.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run folder")
    export.add_argument("--perfetto", type=Path, metavar="PATH",
                        help="write one Chrome-trace JSON (Perfetto, chrome://tracing): steps, "
                             "phases, system counters and any deep-window trace, aligned")
    export.add_argument("--steps", type=_step_range, metavar="FIRST:LAST",
                        help="with --perfetto: only these steps (e.g. 5000:5999, 5000: or "
                             ":999); a timeline holds at most 100,000 steps, the first ones "
                             "when none are chosen")
    export.add_argument("--tensorboard", type=Path, metavar="LOGDIR",
                        help="write TensorBoard event files into LOGDIR/<run name>/: per-step "
                             "and system scalars, the report and findings as text; a tune "
                             "folder's trials with their knobs as hparams (needs the "
                             "tensorboard package)")
    export.add_argument("--wandb", metavar="[ENTITY/]PROJECT",
                        help="log it to Weights & Biases as a new run in PROJECT: per-step and "
                             "system series against trainprof/step, the report's figures as "
                             "the summary, the findings table and the HTML report; ranks and "
                             "tune trials as runs grouped under the folder's name, a trial's "
                             "knobs as its config. WANDB_MODE=offline writes it here for "
                             "`wandb sync` (needs the wandb package)")
    pack = sub.add_parser(
        "pack",
        help="pack a folder of one-file-per-sample data into a few large files (PackedDataset)",
        epilog=PACK_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    pack.add_argument("source", type=Path, metavar="DATA_DIR",
                      help="the folder of samples: class sub-folders (ImageFolder) or flat")
    pack.add_argument("out", type=Path, metavar="OUT",
                      help="the pack folder to write (replaced only when complete)")
    pack.add_argument("--decode", action="store_true",
                      help="store images (or .npy files) decoded, as uint8 arrays: no decoding "
                           "while training, at the decoded size on disk")
    pack.add_argument("--ext", metavar="EXT[,EXT]",
                      help="pack only files with these extensions (e.g. jpg,png)")
    pack.add_argument("--shard-size", type=_shard_size, metavar="SIZE",
                      help="bytes per shard, e.g. 256M or 1G (default: 512M; at least 1M)")
    pack.add_argument("--threads", type=_positive_int, metavar="N",
                      help="threads reading the files (default: 4 per usable core, at most 32)")
    pack.add_argument("--force", action="store_true", help="replace an existing pack at OUT")
    pack.add_argument("--no-check", action="store_true",
                      help="skip the read check (random reads from the files vs the pack)")
    pack.add_argument("--json", action="store_true", help="print one JSON document")
    stage = sub.add_parser(
        "stage",
        help="copy data from network storage to this node's local disk, once per node and "
             "version; prints the local path",
        epilog=STAGE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    stage.add_argument("source", type=Path, metavar="SOURCE", help="a file or a folder")
    stage.add_argument("--to", type=Path, metavar="DIR",
                       help="where copies go (default: $TRAINPROF_STAGE_DIR, $SLURM_TMPDIR, "
                            "$TMPDIR, else the system's temporary folder)")
    stage.add_argument("--threads", type=_positive_int, default=8, metavar="N",
                       help="files copied at once (default: 8)")
    stage.add_argument("--json", action="store_true", help="print one JSON document")
    parser.commands = tuple(sub.choices)
    return parser


def _byte_size(text: str) -> int:
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    raw = text.strip().upper().removesuffix("B").removesuffix("I")
    number, unit = (raw[:-1], raw[-1]) if raw and raw[-1] in units else (raw, "")
    try:
        value = int(float(number) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 512M or 1G, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {text!r}")
    return value


#: The smallest ``pack --shard-size``: a shard is a file to open and map, and a size of a few
#: bytes made one per sample (2,048 shards of a 2,048-image pack), the very cost packing removes.
MIN_SHARD_BYTES = 2**20


def _shard_size(text: str) -> int:
    value = _byte_size(text)
    if value < MIN_SHARD_BYTES:
        raise argparse.ArgumentTypeError(
            f"expected at least 1M (a shard is a file of its own), got {text!r}")
    return value


#: Options whose value may begin with '-' (``--shard-size -5M``): argparse takes such a word
#: for an option and says only "expected one argument"; given as ``--shard-size=-5M`` the
#: option's own check says what is wrong with the value.
_SIGNED_VALUES = frozenset({"--shard-size", "--max-steps", "--sample-interval", "--steps",
                            "--trials", "--threads", "--finding", "--fail-if-slower"})


def _join_signed_values(args: list[str]) -> list[str]:
    """``--opt -V`` as ``--opt=-V`` for the options in :data:`_SIGNED_VALUES`."""
    joined: list[str] = []
    i = 0
    while i < len(args):
        if (args[i] in _SIGNED_VALUES and i + 1 < len(args) and args[i + 1].startswith("-")
                and args[i + 1] != "--"):
            joined.append(f"{args[i]}={args[i + 1]}")
            i += 2
        else:
            joined.append(args[i])
            i += 1
    return joined


def _looks_like_params(token: str) -> bool:
    """``--slurm KEY=VALUE,...`` rather than ``--slurm train.py``."""
    return "=" in token and not token.startswith("-") and not token.endswith(".py")


def _split_run_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split ``run`` arguments into trainprof's options and the script's own.

    trainprof's options come first; the first bare word is the script and
    ``-m MODULE`` ends the options too, as does ``--`` (the script is the word after it).
    Everything after belongs to the script (so ``trainprof run train.py --json`` passes
    ``--json`` to train.py).
    """
    takes_value = {"--out", "--name", "--max-steps", "--sample-interval", "--lines",
                   "--knob", "--steps", "--trials", "--baseline", "--rank-of"}
    optional_value = {"--deep": looks_like_spec, "--py": looks_like_spec,
                      "--slurm": _looks_like_params}
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":  # the end of trainprof's options: the script is the next word
            return argv[: i + 2], argv[i + 2 :]
        if tok in optional_value:
            # `--deep SPEC script.py` vs `--deep script.py`: SPEC only if it reads as one
            if i + 1 < len(argv) and optional_value[tok](argv[i + 1]):
                i += 2
            else:
                argv = [*argv[:i], f"{tok}=", *argv[i + 1 :]]
                i += 1
            continue
        if tok == "-m":
            return argv[: i + 2], argv[i + 2 :]
        if tok.startswith("-m") and len(tok) > 2 and not tok.startswith("--"):
            return argv[: i + 1], argv[i + 1 :]
        if not tok.startswith("-"):
            return argv[: i + 1], argv[i + 1 :]
        i += 2 if tok in takes_value else 1
    return argv, []


def _report_dirs(run_dir: Path | None, html: str | bool | None) -> tuple[Path, str | bool | None]:
    """``report``'s RUN_DIR and --html: ``report --html RUN_DIR`` gives the run folder to
    ``--html [PATH]`` (argparse fills the option's value first); a folder there with no
    RUN_DIR is the run folder, and the page goes to its default place."""
    if run_dir is None and isinstance(html, str) and Path(html).is_dir():
        return Path(html), True
    if run_dir is None:
        raise UsageError("the following arguments are required: RUN_DIR "
                         "(see 'trainprof report --help')")
    return run_dir, html


def _dispatch(argv: list[str]) -> int:
    parser = build_parser()
    if argv and argv[0] == "run":
        own, script_args = _split_run_args(argv[1:])
        ns = parser.parse_args(["run", *_join_signed_values(own)])
        target = ns.module if ns.module is not None else ns.script
        if target is None:
            raise UsageError("missing SCRIPT (or -m MODULE) to run (see 'trainprof run --help')")
        from trainprof.capture.targets import resolve_command

        # `python train.py`, `python -m pkg`, a console script's name: the script itself
        target, script_args, module = resolve_command(target, script_args,
                                                      ns.module is not None)
        from trainprof.commands import run_command

        return run_command(
            target,
            script_args,
            module=module,
            out=ns.out,
            name=ns.name,
            max_steps=ns.max_steps,
            json_out=ns.json,
            sample_interval_s=ns.sample_interval,
            deep=ns.deep,
            py=ns.py,
            lines=ns.lines,
            html=not ns.no_html,
            rank_of=ns.rank_of,
        )
    if argv and argv[0] == "tune":
        own, script_args = _split_run_args(argv[1:])
        ns = parser.parse_args(["tune", *_join_signed_values(own)])
        target = ns.module if ns.module is not None else ns.script
        if target is None:
            raise UsageError("missing SCRIPT (or -m MODULE) to tune (see 'trainprof tune --help')")
        from trainprof.capture.targets import resolve_command

        # `python train.py`, `python -m pkg`, a console script's name: the script itself
        target, script_args, module = resolve_command(target, script_args,
                                                      ns.module is not None)
        if not ns.knob:
            raise UsageError("give at least one --knob NAME=V1,V2 (see 'trainprof tune --help')")
        from trainprof.experiments.tune import tune_command

        return tune_command(
            target,
            script_args,
            module=module,
            knobs=ns.knob,
            steps=ns.steps,
            trials=ns.trials,
            json_out=ns.json,
            out=ns.out,
            baseline=ns.baseline,
            slurm=ns.slurm,
        )
    ns = parser.parse_args(_join_signed_values(argv))
    if ns.command is None:
        # bad input like any other (DESIGN.md's exit codes): the usage, then one error line
        parser.print_usage(sys.stderr)
        raise UsageError(f"give a command: {', '.join(parser.commands)} "
                         "(see 'trainprof --help')")
    if ns.command == "report":
        from trainprof.commands import report_command

        run_dir, html = _report_dirs(ns.run_dir, ns.html)
        return report_command(run_dir, json_out=ns.json, html=html)
    if ns.command == "trace":
        from trainprof.commands import trace_command

        return trace_command(ns.path, json_out=ns.json)
    if ns.command == "compare":
        from trainprof.commands import compare_command

        return compare_command(ns.run_a, ns.run_b, json_out=ns.json, html=ns.html,
                               fail_if_slower=ns.fail_if_slower)
    if ns.command == "verify":
        from trainprof.experiments.verify import verify_command

        return verify_command(ns.run_dir, finding=ns.finding, steps=ns.steps,
                              trials=ns.trials, out=ns.out, json_out=ns.json)
    if ns.command == "export":
        from trainprof.commands import export_command

        return export_command(ns.run_dir, perfetto=ns.perfetto, tensorboard=ns.tensorboard,
                              wandb=ns.wandb, steps=ns.steps)
    if ns.command == "pack":
        from trainprof.commands import pack_command

        return pack_command(
            ns.source, ns.out, decode=ns.decode,
            extensions=tuple(e for e in ns.ext.split(",") if e) if ns.ext else None,
            shard_bytes=ns.shard_size, threads=ns.threads, force=ns.force,
            check=not ns.no_check, json_out=ns.json,
        )
    if ns.command == "stage":
        from trainprof.commands import stage_command

        return stage_command(ns.source, to=ns.to, threads=ns.threads, json_out=ns.json)
    raise AssertionError(f"command {ns.command!r} has no dispatch")


#: exit status when the reader of stdout left: 128 + SIGPIPE, as the shell reports for
#: ``cat`` or ``grep`` killed by the signal in ``cat big | head``
EXIT_BROKEN_PIPE = 128 + 13


def main(argv: list[str] | None = None) -> int:
    """Every command, its errors turned into exit statuses.

    A reader that leaves early (``trainprof trace BIG --json | head -c 100``, ``report
    --json | head``, ``run --json | head``: all output goes through here) ends the command
    quietly, as C tools do when SIGPIPE kills them: no traceback, nothing on stderr, and
    stdout pointed at /dev/null so that the interpreter's last flush cannot raise again
    (Python's documented way, "Note on SIGPIPE" in the ``signal`` module). The status is
    141 (128 + SIGPIPE), what the shell reports for ``cat`` in the same pipe, not 0: the
    output was not all written, and a ``set -o pipefail`` script should see trainprof
    fail there as it sees any other tool; ``head`` itself still succeeds, so a plain pipe
    is unaffected. stdout is flushed here, inside the handler, since a document shorter
    than the pipe's buffer only meets the closed pipe at that flush.
    """
    argv = sys.argv[1:] if argv is None else argv
    try:
        status = _dispatch(argv)
        sys.stdout.flush()
        return status
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        # Ctrl-C in trainprof's own work (analysing a trace, writing a report): a run's
        # record is closed before any of it starts (see commands.run_command)
        print("trainprof: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
