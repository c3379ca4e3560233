"""Every command a report prints for the user to run is whole on a line of its own.

A user test pasted the first line of a wrapped verify line ("...slow_input.py --steps 60
--data" / "/data/slow_input; the most any input fix can give: ...") and ran
the script with ``--data`` missing its argument; at 80 columns the footer's ``trainprof
verify`` lost its folder the same way. Each test here renders at 80 and at 120 columns (a
terminal, and a log: report/console.py) and looks for each command as a line by itself.
"""

from __future__ import annotations

import io
import sys
from typing import Any

import pytest
from test_diagnosis import MS, loader, make_steps, make_summary

from trainprof.diagnosis import diagnose
from trainprof.report.command_lines import split_commands, verify_parts
from trainprof.report.console import wrap_prose
from trainprof.report.terminal import render_summary

#: A script with arguments long enough to wrap at either width, as the user's was.
COMMAND = [sys.executable, "examples/slow_input.py", "--steps", "60", "--data",
           "/srv/experiments/exp1work/data/slow_input_images_train_split"]
SCRIPT = " ".join(COMMAND[1:])
RUN_DIR = "/srv/experiments/exp1work/trainprof-runs/20261127-170000-slow_input"

#: Verify lines of the shapes the rules write, commands named (diagnosis/*.py).
SHAPES: list[dict[str, Any]] = [
    # a code change: backticked run, a bare compare, an aside knob after a semicolon
    {"verify": (f"`trainprof run {SCRIPT}` after the change (twice: the first run fills the "
                f"cache), then trainprof compare {RUN_DIR} <the new run>: the data wait share "
                f"(now 82%) should fall; a worker for a thread: trainprof tune --knob "
                f"num_workers=0,1 --knob torch_threads=1,2 {SCRIPT}"),
     "verify_commands": [f"trainprof run {SCRIPT}", f"trainprof compare {RUN_DIR} <the new run>",
                         f"trainprof tune --knob num_workers=0,1 --knob torch_threads=1,2 "
                         f"{SCRIPT}"]},
    # an environment variable before the command, a comparison in backticks after it
    {"verify": (f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True trainprof run {SCRIPT}, then "
                f"`trainprof compare {RUN_DIR} NEW_RUN`: the GPU memory peak (now 97%) should "
                "fall with the step time unchanged"),
     "verify_commands": [f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True trainprof run "
                         f"{SCRIPT}", f"trainprof compare {RUN_DIR} NEW_RUN"]},
    # a command in parentheses
    {"verify": (f"re-run with the interval raised to 50 (`trainprof run {SCRIPT} --save_every=50`)"
                " and `trainprof compare` the two runs: the mean step should fall"),
     "verify_commands": [f"trainprof run {SCRIPT} --save_every=50"]},
]


def _finding(**parts: Any) -> dict[str, Any]:
    return {"category": "input_pipeline", "cause": "c", "title": "A finding", "severity": "high",
            "evidence": {"x": 1.0}, "estimated_gain": 0.5,
            "fix": {"text": f"Profile it: `trainprof run --py {SCRIPT}` names the functions.",
                    "snippet": ""}, **parts}


def _render(monkeypatch: pytest.MonkeyPatch, columns: int,
            findings: list[dict[str, Any]] | None = None) -> tuple[dict[str, Any], list[str]]:
    """A run of the slow-input example rendered at ``columns``: its summary and lines."""
    monkeypatch.setenv("COLUMNS", str(columns))
    steps = make_steps(60, data=5 * MS)
    summary = make_summary(steps, dataloaders=[loader()], run_dir=RUN_DIR, status="finished",
                           name="slow_input", missing=[], notes=[],
                           system={"n_samples": 20, "proc_cpu_pct": 70.0})
    summary["command"] = COMMAND
    summary["findings"] = diagnose(summary, steps) if findings is None else findings
    buf = io.StringIO()
    render_summary(summary, file=buf)
    return summary, buf.getvalue().splitlines()


@pytest.mark.parametrize("columns", [80, 120])
def test_verify_commands_and_the_footer_are_whole_lines(monkeypatch, columns):
    summary, lines = _render(monkeypatch, columns)
    stripped = [line.strip() for line in lines]
    (f,) = [f for f in summary["findings"] if f["cause"] == "too_few_workers"]
    # the two commands of the user test, the sweep and the bound, and the footer's: each a
    # line by itself
    expected = [f"trainprof tune --knob num_workers=0,1,2,4 {SCRIPT}",
                f"trainprof tune --knob synthetic_data=false,true {SCRIPT}"]
    for command in [*expected, f"trainprof verify {RUN_DIR}"]:
        assert command in stripped, lines
    assert f["verify_commands"] == expected  # the finding names them, as its line has them
    # the prose before each command on its own line
    at = stripped.index(expected[0])
    assert stripped[at - 1] == "verify:"
    assert stripped[at + 1] == "the most any input fix can give:"
    assert stripped[stripped.index(f"trainprof verify {RUN_DIR}") - 1] == (
        "Measure finding 1's fix (its knob on this script, against its estimate):")
    # prose still wraps to the width; only a command (or a snippet's code) runs past it
    whole = {*f["verify_commands"], f"trainprof verify {RUN_DIR}",
             *(line.strip() for line in f["fix"]["snippet"].splitlines())}
    assert [line for line in lines if len(line) > columns and line.strip() not in whole] == []



@pytest.mark.parametrize("columns", [80, 120])
def test_every_shape_of_verify_line_prints_its_commands_whole(monkeypatch, columns):
    findings = [_finding(**shape) for shape in SHAPES]
    _, lines = _render(monkeypatch, columns, findings)
    stripped = [line.strip() for line in lines]
    for shape in SHAPES:
        for command in shape["verify_commands"]:
            assert command in stripped, (command, lines)
    text = "\n".join(stripped)
    # no joining punctuation or bracket left alone, no backtick around a command's line
    assert "then\n" in text and "a worker for a thread:\n" in text
    assert not [s for s in stripped if s in ("(", ")", ";", ",", ":")]
    assert not [s for s in stripped if any(f"`{c}" in s for sh in SHAPES
                                           for c in sh["verify_commands"])]
    assert "re-run with the interval raised to 50\n" in text
    # a backticked command in the fix's prose is never broken across lines
    assert [s for s in stripped if f"`trainprof run --py {SCRIPT}`" in s]


def test_a_verify_line_splits_at_its_commands():
    line = "`trainprof run t.py` after the change, then trainprof compare A B: it should fall"
    assert split_commands(line, ["trainprof run t.py", "trainprof compare A B"]) == [
        ("trainprof run t.py", True), ("after the change, then", False),
        ("trainprof compare A B", True), ("it should fall", False)]
    assert split_commands("raised to 5 (`trainprof run t.py --every=5`) and compare",
                          ["trainprof run t.py --every=5"]) == [
        ("raised to 5", False), ("trainprof run t.py --every=5", True), ("and compare", False)]
    # a command the line does not hold still comes out, after it
    assert split_commands("measure it", ["trainprof tune x"]) == [
        ("measure it", False), ("trainprof tune x", True)]
    # a record written before findings named their commands: prose, as it was
    assert verify_parts({"verify": "trainprof tune --knob a=1,2 t.py"}) == [
        ("trainprof tune --knob a=1,2 t.py", False)]


def test_prose_wraps_between_words_and_never_inside_a_quote():
    text = "first then `trainprof run --py a/very/long/script.py --data x` shows where, fine"
    lines = wrap_prose(text, 30)
    assert lines == ["first then", "`trainprof run --py a/very/long/script.py --data x`",
                     "shows where, fine"]
    assert wrap_prose("one two\nthree", 80) == ["one two", "three"]  # its own breaks stay


def test_the_html_report_puts_each_command_in_a_code_block():
    from trainprof.report.html import _finding as html_finding

    page = html_finding(1, _finding(**SHAPES[0]), run_dir=RUN_DIR)

    for command in SHAPES[0]["verify_commands"]:
        assert f'<code class="cmd">{command.replace("<", "&lt;").replace(">", "&gt;")}</code>' \
            in page
    assert "after the change (twice: the first run fills the cache)" in page
    assert f'<code class="cmd">trainprof verify {RUN_DIR} --finding 1</code>' in page


def test_the_tensorboard_findings_give_each_command_a_code_block():
    from trainprof.report.tensorboard import findings_markdown

    text = findings_markdown([_finding(**SHAPES[1])])
    for command in SHAPES[1]["verify_commands"]:
        assert f"```sh\n{command}\n```" in text
    assert "**verify**:\n" in text and "\nthen\n" in text


@pytest.mark.parametrize("columns", [80, 120])
def test_the_verify_verdict_wraps_and_its_folder_stays_whole(monkeypatch, columns):
    from trainprof.report.verify_terminal import render_verdict

    monkeypatch.setenv("COLUMNS", str(columns))
    folder = f"{RUN_DIR}/verify-slow_input/20261128-101500-num_workers"
    result = {"verdict": "confirmed", "arm": "num_workers=4", "ratio": 0.21, "ci": [0.20, 0.23],
              "saving": 0.79, "estimated_gain": 0.79, "metric": "step_time",
              "outside_load": [{"trials": 3, "max_cores": 1.4}], "tune_dir": folder}
    buf = io.StringIO()
    render_verdict(result, file=buf)
    lines = buf.getvalue().splitlines()
    assert f"trials and verify.json: {folder}" in lines
    assert [line for line in lines if len(line) > columns and folder not in line] == []
    assert "Verdict: confirmed - num_workers=4 ran at ×0.21" in " ".join(buf.getvalue().split())


@pytest.mark.parametrize("columns", [80, 120])
def test_a_ranks_own_report_is_a_whole_command_under_the_table(monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    steps = make_steps(60)
    summary = make_summary(steps, run_dir=RUN_DIR, status="finished", name="t", missing=[],
                           notes=[], findings=[], main_rank="0")
    rank = {"status": "finished", "exit_code": 0, "steps": 60, "median_s": 0.01,
            "p90_s": 0.012, "data_wait": 0.1, "samples_per_s": 100.0}
    summary["ranks"] = [{**rank, "label": "0"},
                        {**rank, "label": "1", "run_dir": f"{RUN_DIR}/ranks/1",
                         "findings": ["input_pipeline/too_few_workers"]}]
    buf = io.StringIO()
    render_summary(summary, file=buf)
    assert f"   trainprof report {RUN_DIR}/ranks/1" in buf.getvalue().splitlines()


@pytest.mark.parametrize("columns", [80, 120])
def test_packs_usage_line_is_whole(monkeypatch, columns):
    """The Python line ``trainprof pack`` prints to use the pack, split in its table cell,
    was a syntax error pasted line by line."""
    from trainprof.report.pack_terminal import render_pack

    monkeypatch.setenv("COLUMNS", str(columns))
    out = "/srv/experiments/exp1work/data/slow_input_images_train_split.pack"
    usage = (f'from trainprof.fixes import PackedDataset; dataset = PackedDataset("{out}", '
             "transform=...)  # same samples and order as ImageFolder")
    manifest = {"source": {"bytes": 10_000}, "shards": [{}], "count": 20, "write_s": 0.1,
                "classes": ["a", "b"], "default_fields": ["image"],
                "fields": [{"name": "image", "kind": "blob", "codec": "image"}]}
    buf = io.StringIO()
    render_pack({"source": "data/slow_input", "out": out, "pack_bytes": 9_000, "columns": [],
                 "manifest": manifest, "reads": None, "usage": usage}, file=buf)
    assert f"  {usage}" in buf.getvalue().splitlines()
