"""Bad command lines: one ``error:`` line on stderr, exit 2, and nothing left behind.

These run the CLI's entry point in this process (``trainprof.cli.main``): a refusal comes
before any script runs, so no subprocess is needed to see what the user sees.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from trainprof.cli import build_parser, main


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of ``trainprof ARGV``."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A script that would train if it ran, in a fresh working directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("raise SystemExit('the script ran')\n")
    return "train.py"


@pytest.mark.parametrize(
    ("option", "spec", "message"),
    [
        ("--deep", "active=-1",
         "--deep active=-1: active takes a whole number >= 1 (recorded steps a cycle)"),
        ("--deep", "repeat=-1",
         "--deep repeat=-1: repeat takes a whole number >= 0 (cycles; 0: until the run ends)"),
        ("--deep", "skip_first=1e3", "--deep skip_first=1e3: skip_first takes a whole number "
         ">= 0 (steps left alone first)"),
        ("--deep", "skip_first=1,active=2,bogusflag",
         "--deep: unknown window flag 'bogusflag' (flags: flops, memory, modules, shapes, "
         "stack)"),
        ("--py", "skip_first=x",
         "--py skip_first=x: skip_first takes a whole number >= 0 (steps left alone first)"),
        ("--py", "memory", "--py: unknown window flag 'memory' (flags: none)"),
        ("--deep", "foo=1",
         "--deep: unknown window key 'foo' (keys: skip_first, wait, warmup, active, repeat)"),
    ],
)
def test_a_malformed_window_spec_is_parsed_as_one_not_taken_for_the_script(
    capsys: pytest.CaptureFixture[str], script: str, option: str, spec: str, message: str,
) -> None:
    code, out, err = cli(capsys, "run", option, spec, script)
    assert (code, out, err) == (2, "", f"error: {message}\n")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--deep", "foo=1"],
         "--deep: unknown window key 'foo' (keys: skip_first, wait, warmup, active, repeat)"),
        (["run", "--deep", "active=0"],
         "--deep active=0: active takes a whole number >= 1 (recorded steps a cycle)"),
        (["run", "--lines", "nosuch"], "bad --lines target 'nosuch': expected module:function, "
         "module:Class.method or path/to/file.py:function"),
        (["tune", "--knob", "gc_threshold=700,0", "--slurm", "cluster=kube"],
         "--slurm cluster=kube: use one of slurm, local"),
    ],
)
def test_a_bad_option_leaves_no_run_folder(
    capsys: pytest.CaptureFixture[str], script: str, tmp_path: Path,
    argv: list[str], message: str,
) -> None:
    code, _, err = cli(capsys, *argv, script)
    assert (code, err) == (2, f"error: {message}\n")
    assert not (tmp_path / "trainprof-runs").exists()


def test_a_slurm_parameter_submitit_refuses_leaves_no_tune_folder(
    capsys: pytest.CaptureFixture[str], script: str, tmp_path: Path,
) -> None:
    pytest.importorskip("submitit")
    for slurm in ("foo=bar", "cluster=local,foo=bar"):
        code, _, err = cli(capsys, "tune", "--knob", "gc_threshold=700,0", "--slurm", slurm,
                           script)
        assert code == 2 and err.startswith("error: --slurm: ") and err.count("\n") == 1, err
        assert not (tmp_path / "trainprof-runs").exists(), slurm


def test_the_sampling_period_has_a_floor_that_help_states(
    capsys: pytest.CaptureFixture[str], script: str, tmp_path: Path,
) -> None:
    code, _, err = cli(capsys, "run", "--sample-interval", "0.0001", script)
    assert (code, err) == (2, "error: argument --sample-interval: expected at least 0.05 s, got "
                              "'0.0001': CPU time is counted in 10 ms ticks, so a shorter period "
                              "gives wrong CPU figures (see 'trainprof run --help')\n")
    assert not (tmp_path / "trainprof-runs").exists()
    assert build_parser().parse_args(["run", "--sample-interval", "0.05"]).sample_interval == 0.05
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "(default: 0.2 s, i.e. 5 Hz; at least 0.05 s: CPU time is counted in 10 ms ticks)" \
        in shown


@pytest.fixture
def runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Two run folders with a record (its files' contents do not matter here: the output
    path is refused before the record is read), in a fresh working directory."""
    monkeypatch.chdir(tmp_path)
    for name in ("a", "b"):
        (tmp_path / name / "deep").mkdir(parents=True)
        for record_file in ("run.json", "steps.bin", "samples.jsonl", "ops.json"):
            (tmp_path / name / record_file).write_text(f"{name}'s {record_file}")
        (tmp_path / name / "deep" / "w.pt.trace.json.gz").write_text("trace")
    return tmp_path


def _record(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_text() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("target", ["run.json", "steps.bin", "samples.jsonl", "ops.json",
                                    "findings.json", "deep/w.pt.trace.json.gz"])
@pytest.mark.parametrize("argv", [
    ["export", "a", "--perfetto"],
    ["report", "a", "--html"],
    ["compare", "a", "b", "--html"],
])
def test_no_output_overwrites_a_file_of_a_runs_record(
    capsys: pytest.CaptureFixture[str], runs: Path, argv: list[str], target: str,
) -> None:
    before = _record(runs / "b")
    option = argv[-1]
    code, out, err = cli(capsys, *argv, f"b/{target}")
    assert (code, out) == (2, "")
    assert err == (f"error: {option} b/{target}: part of the record of the run in "
                   f"{runs / 'b'}; writing it would destroy the run\n")
    assert _record(runs / "b") == before


def test_the_record_is_found_through_a_link_and_a_roundabout_path(
    capsys: pytest.CaptureFixture[str], runs: Path,
) -> None:
    (runs / "link.json").symlink_to(runs / "a" / "run.json")
    for path in ("link.json", "b/../a/./run.json"):
        code, _, err = cli(capsys, "export", "a", "--perfetto", path)
        assert code == 2 and "part of the record of the run in" in err, path
    code, _, err = cli(capsys, "export", "a", "--tensorboard", "a/deep")  # a folder of it
    assert (code, err) == (2, f"error: --tensorboard a/deep: part of the record of the run in "
                              f"{runs / 'a'}; writing it would destroy the run\n")


@pytest.mark.parametrize("argv", [
    ["export", "a", "--perfetto"],
    ["report", "a", "--html"],
    ["compare", "a", "b", "--html"],
])
def test_an_output_path_is_checked_by_one_rule_before_any_work(
    capsys: pytest.CaptureFixture[str], runs: Path, argv: list[str],
) -> None:
    option = argv[-1]
    # more than the output's own folder missing: refused, nothing created
    code, out, err = cli(capsys, *argv, "x/y/out.html")
    assert (code, out, err) == (2, "", f"error: {option} x/y/out.html: no folder x (only the "
                                       "output's own folder, y/, is created when missing)\n")
    assert not (runs / "x").exists()
    # a folder where the file goes (compare: before the comparison is printed)
    code, out, err = cli(capsys, *argv, "b")
    assert (code, out, err) == (
        2, "", f"error: {option} b: a folder, not a file (name the file to write)\n")
    (runs / "afile").write_text("x")
    code, out, err = cli(capsys, *argv, "afile/out.html")
    assert (code, out, err) == (2, "", f"error: {option} afile/out.html: afile is a file, "
                                       "not a folder\n")


def test_a_log_folder_follows_the_same_rule(capsys: pytest.CaptureFixture[str], runs: Path) -> None:
    code, _, err = cli(capsys, "export", "a", "--tensorboard", "tb/logs")
    assert (code, err) == (2, "error: --tensorboard tb/logs: no folder tb (only the output's "
                              "own folder, logs/, is created when missing)\n")
    assert not (runs / "tb").exists()


def test_no_command_is_bad_input_the_usage_and_one_error_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = cli(capsys)
    assert (code, out) == (2, "")
    assert err == ("usage: trainprof [-h] [--version] COMMAND ...\n"
                   "error: give a command: run, report, trace, compare, tune, verify, export, "
                   "pack, stage (see 'trainprof --help')\n")


@pytest.mark.parametrize(("argv", "command"), [
    (["report", "a", "b"], "report"),
    (["compare", "a", "b", "c"], "compare"),
    (["run", "--bogus", "train.py"], "run"),
])
def test_words_left_over_point_at_the_commands_own_help(
    capsys: pytest.CaptureFixture[str], argv: list[str], command: str,
) -> None:
    code, _, err = cli(capsys, *argv)
    left = argv[-1] if command != "run" else "--bogus"
    assert (code, err) == (2, f"error: unrecognized arguments: {left} "
                              f"(see 'trainprof {command} --help')\n")


def test_report_html_before_the_run_folder_takes_it_as_the_run_folder(
    capsys: pytest.CaptureFixture[str], runs: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    import trainprof.commands

    calls = []
    monkeypatch.setattr(trainprof.commands, "report_command",
                        lambda run_dir, json_out, html: calls.append((run_dir, html)) or 0)
    assert cli(capsys, "report", "--html", "a")[0] == 0
    assert cli(capsys, "report", "--html", "out.html", "a")[0] == 0
    assert cli(capsys, "report", "a", "--html")[0] == 0
    assert calls == [(Path("a"), True), (Path("a"), "out.html"), (Path("a"), True)]
    # a path that is no folder stays the page's, and the run folder is still missing
    code, _, err = cli(capsys, "report", "--html", "out.html")
    assert (code, err) == (2, "error: the following arguments are required: RUN_DIR "
                              "(see 'trainprof report --help')\n")


def test_a_value_that_begins_with_a_dash_gets_the_options_own_error(
    capsys: pytest.CaptureFixture[str], script: str,
) -> None:
    code, _, err = cli(capsys, "run", "--max-steps", "-5x", script)
    assert (code, err) == (2, "error: argument --max-steps: expected a positive integer, got "
                              "'-5x' (see 'trainprof run --help')\n")
    # the script's own arguments are the script's, dashes and all
    assert cli_split(["--max-steps", "3", script, "--steps", "-5M"]) == (
        ["--max-steps", "3", script], ["--steps", "-5M"])


def cli_split(argv: list[str]) -> tuple[list[str], list[str]]:
    from trainprof.cli import _split_run_args

    return _split_run_args(argv)


@pytest.mark.parametrize("command", [["report"], ["verify"], ["export", "--perfetto", "t.json"],
                                     ["compare"]])
def test_every_command_names_a_folder_that_holds_no_run_alike(
    capsys: pytest.CaptureFixture[str], runs: Path, command: list[str],
) -> None:
    (runs / "empty").mkdir()
    (runs / "file.py").write_text("")
    (runs / "bytes").mkdir()
    (runs / "bytes" / "run.json").write_bytes(b'\xff\xfe{"schema_version": 1}')
    for folder, message in [
        ("missing", "no such run folder: missing"),
        ("empty", "empty is not a run folder (no run.json)"),
        ("file.py", "file.py is a file, not a run folder"),
        ("bytes", "bytes/run.json: not a trainprof run record (not UTF-8 JSON)"),
    ]:
        argv = [command[0], folder, *command[1:]] if command[0] != "compare" else [
            "compare", folder, "a"]
        code, _, err = cli(capsys, *argv)
        assert (code, err) == (2, f"error: {message}\n"), argv


@pytest.mark.parametrize("kind", ["tune", "verify"])
def test_a_tune_or_verify_folder_is_named_with_its_trials_run_folders(
    capsys: pytest.CaptureFixture[str], runs: Path, kind: str,
) -> None:
    """compare given a verify folder said only "not a run folder (no run.json)"."""
    folder = runs / f"20261128-055608-{kind}-zipdl"
    folder.mkdir()
    (folder / "tune.json").write_text("{}")
    if kind == "verify":
        (folder / "verify.json").write_text("{}")
    for trial in ("synthetic_data-false-1", "synthetic_data-true-1"):
        (folder / trial).mkdir()
        (folder / trial / "run.json").write_text("{}")
    code, _, err = cli(capsys, "compare", str(folder.name), "a")
    a, b = (f"{folder.name}/synthetic_data-{v}-1" for v in ("false", "true"))
    assert (code, err) == (2, f"error: {folder.name} is a trainprof {kind} folder, not a run "
                              f"folder: its trials' run folders are {a}, {b} "
                              f"(e.g. trainprof compare {a} {b})\n")
    (folder / "synthetic_data-true-1" / "run.json").unlink()
    (folder / "synthetic_data-false-1" / "run.json").unlink()
    code, _, err = cli(capsys, "compare", str(folder.name), str(folder.name))
    assert (code, err) == (2, f"error: {folder.name} is a trainprof {kind} folder, not a run "
                              "folder, and holds no trial's run folder\n")


@pytest.mark.parametrize(("words", "hint"), [
    (["-W", "ignore", "x.py"], "for -W ignore, set PYTHONWARNINGS=ignore: "
                               "`PYTHONWARNINGS=ignore trainprof run x.py`"),
    (["-u", "x.py", "--a", "1"], "for -u, set PYTHONUNBUFFERED=1: "
                                 "`PYTHONUNBUFFERED=1 trainprof run x.py --a 1`"),
    (["-OO", "-Werror", "x.py"], "for -OO -Werror, set PYTHONOPTIMIZE=2 PYTHONWARNINGS=error: "
                                 "`PYTHONOPTIMIZE=2 PYTHONWARNINGS=error trainprof run x.py`"),
    (["-X", "dev", "x.py"], "for -X dev, set PYTHONDEVMODE=1: "
                            "`PYTHONDEVMODE=1 trainprof run x.py`"),
    (["-c", "pass"], None),  # no variable does what -c does
])
def test_the_interpreters_options_are_refused_with_their_environment_variables(
    capsys: pytest.CaptureFixture[str], words: list[str], hint: str | None,
) -> None:
    """`trainprof run python -W ignore x.py` was refused without a hint (-u had one)."""
    code, _, err = cli(capsys, "run", "python", *words)
    assert code == 2 and err.startswith("error: trainprof run takes the script without")
    assert err.count("\n") == 1
    if hint is None:
        assert err.endswith("SCRIPT ARGS...\n")
    else:
        assert err.endswith(f"SCRIPT ARGS...; {hint}\n")
