"""cProfile and line_profiler window tools (`run --py`, `run --lines`) on real tiny training loops.

The training module has one known hot Python function, ``slow_augment`` (a
pure-Python loop with no calls inside, so cProfile charges its time to the
function itself). The tools are driven at step boundaries the way the window
runner drives them: two windows, steps 2-4 and 7-9.
"""

from __future__ import annotations

import importlib
import io
import json
import pstats
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import trainprof, write_script
from rich.console import Console

from trainprof.analysis.python_profile import (
    hottest_user_function,
    is_user_code,
    summarize_python_profile,
)
from trainprof.capture.lineprof import (
    SHARES_WINDOW_WITH_CPROFILE,
    LineProfileTool,
    parse_targets,
)
from trainprof.capture.pyprof import DOT_MISSING, CProfileTool
from trainprof.errors import UsageError
from trainprof.report.python_profile_terminal import render_python_profile

HOTMOD = '''
import torch
from torch import nn


def slow_augment(x, n=20000):
    scale = 0.0
    for i in range(n):
        scale += (i * 1.0001 + 0.5) * (i - 0.25) / (i + 1.0)  # HOT LINE
    return x * (1.0 + 1e-15 * scale)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, x):
        h = self.lin(x)
        return h * 2.0


def train(steps, on_boundary):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        on_boundary(step)               # step `step` is about to begin
        x, y = torch.randn(8, 16), torch.randn(8, 4)
        x = slow_augment(x)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    on_boundary(steps)                  # the run ends
'''

WINDOWS = [(2, 5), (7, 10)]  # steps 2-4 and 7-9: 6 steps profiled, 6 calls of slow_augment
# 3.11: line_profiler shares cProfile's windows (trace vs profile slot); 3.12+: both need
# sys.monitoring's PROFILER_ID, so its windows come after cProfile's
LINE_WINDOWS = WINDOWS if SHARES_WINDOW_WITH_CPROFILE else [(12, 15), (17, 20)]
STEPS = 12 if SHARES_WINDOW_WITH_CPROFILE else 22


def _hot_line_no(path: Path) -> int:
    return next(i for i, ln in enumerate(path.read_text().splitlines(), 1) if "# HOT LINE" in ln)


def _drive(plan: list[tuple[object, list[tuple[int, int]]]], steps: int):
    """Call each tool's start/stop at the step boundaries of its windows, as the runner does."""

    def on_boundary(step: int) -> None:
        for tool, windows in plan:
            if step in {b for _, b in windows}:
                tool.stop(step)
        for tool, windows in plan:
            if step in {a for a, _ in windows}:
                tool.start(step)
        if step == steps:  # the end: stop a window still open, then close every tool
            for tool, _ in plan:
                tool.stop(step)
            for tool, _ in plan:
                tool.close()

    return on_boundary


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """Both tools over a real training loop in an imported module; on 3.11 in the same windows
    (they coexist: cProfile uses the profile slot, line_profiler the trace slot)."""
    root = tmp_path_factory.mktemp("pyprof")
    src = root / "src"
    src.mkdir()
    (src / "hotmod_pp.py").write_text(HOTMOD)
    sys.path.insert(0, str(src))
    try:
        hotmod = importlib.import_module("hotmod_pp")
        run_dir = root / "run"
        out = run_dir / "python"
        lines = LineProfileTool(out, ["hotmod_pp:slow_augment", "hotmod_pp:Net.forward",
                                      "hotmod_pp:nope", "no_such_module_xyz:f", "torch:cat"])
        hotmod.train(STEPS, _drive([(CProfileTool(out), WINDOWS), (lines, LINE_WINDOWS)], STEPS))
    finally:
        sys.path.remove(str(src))
        sys.modules.pop("hotmod_pp", None)
    return run_dir, src / "hotmod_pp.py"


def test_cprofile_top_table_steps_and_pstats(profiled):
    run_dir, hot_file = profiled
    top = json.loads((run_dir / "python" / "top.json").read_text())
    assert top["windows"] == [list(w) for w in WINDOWS]
    assert top["steps_profiled"] == 6
    first = top["top_tottime"][0]
    assert (first["function"], first["file"], first["ncalls"]) == ("slow_augment", str(hot_file), 6)
    # the loop has no calls inside: its own time is (nearly) all of its time
    assert first["tottime"] >= 0.95 * first["cumtime"] > 0
    assert first["percall_tottime"] == pytest.approx(first["tottime"] / 6)
    assert 0 < top["profiled_s"] <= top["wall_s"] * 1.05
    # slow_augment dominates the profiled window (≈ 20000 iterations vs a 16→4 Linear)
    assert first["tottime"] > 0.5 * top["wall_s"]
    names = [r["function"] for r in top["top_cumtime"]]
    assert "slow_augment" in names and "forward" in names
    # the .prof is a real pstats dump with the same numbers
    stats = pstats.Stats(str(run_dir / "python" / "profile.prof"))
    key = (str(hot_file), 6, "slow_augment")
    assert stats.stats[key][1] == 6  # type: ignore[attr-defined]
    assert stats.stats[key][2] == pytest.approx(first["tottime"])  # type: ignore[attr-defined]


def _node_colour(dot_text: str, name: str) -> tuple[int, int, int]:
    m = re.search(r'color="#([0-9a-f]{6})"[^\]]*label="[^"]*:' + name + r"\\n", dot_text)
    assert m, f"no node for {name}"
    h = m.group(1)
    return int(h[0:2], 16), int(h[2:4], 16), int(h[4:6], 16)


def test_callgraph_svg_has_the_hot_function_in_a_hot_colour(profiled):
    run_dir, _ = profiled
    pdir = run_dir / "python"
    svg = (pdir / "callgraph.svg").read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    assert "hotmod_pp:6:slow_augment" in svg  # gprof2dot's module:line:function label
    dot = (pdir / "callgraph.dot").read_text()
    r, g, b = _node_colour(dot, "slow_augment")
    assert r > 150 and r > b  # red/orange end of the 'color' theme
    # the cheap calls (forward, the loss, the optimizer: a few % of the window at most) sit
    # at the blue end; which of them stay above gprof2dot's 0.5% cut varies with the load
    # (forward alone was pruned once on CI), so any of them will do
    colours = [tuple(int(h[i:i + 2], 16) for i in (0, 2, 4))
               for h in re.findall(r'^\s*\d+ \[color="#([0-9a-f]{6})"', dot, re.M)]  # nodes
    assert any(b2 > r2 for r2, _, b2 in colours), colours


def test_line_profile_hot_line_and_kernprof_text(profiled):
    run_dir, hot_file = profiled
    doc = json.loads((run_dir / "python" / "lines.json").read_text())
    assert doc["steps_profiled"] == 6 and doc["windows"] == [list(w) for w in LINE_WINDOWS]
    funcs = {f["function"]: f for f in doc["functions"]}
    aug = funcs["slow_augment"]
    assert aug["file"] == str(hot_file) and aug["first_line"] == 6
    hot_no = _hot_line_no(hot_file)
    by_line = {r["line"]: r for r in aug["lines"]}
    assert by_line[hot_no]["hits"] == 6 * 20000
    assert by_line[hot_no + 1]["hits"] == 6  # the return line
    hottest = max(aug["lines"], key=lambda r: r["percent"])
    assert hottest["line"] == hot_no and "# HOT LINE" in hottest["source"]
    assert hottest["percent"] > 50
    assert sum(r["percent"] for r in aug["lines"]) == pytest.approx(100)
    assert by_line[6]["source"].startswith("def slow_augment")
    fwd = funcs["Net.forward"]
    assert [r["hits"] for r in fwd["lines"] if r["hits"]] == [6, 6]
    # lines.txt is line_profiler's own text, identical to what it prints from the saved stats
    from line_profiler import load_stats, show_text

    saved = load_stats(str(run_dir / "python" / "lines.lprof"))
    expected = io.StringIO()
    show_text(saved.timings, saved.unit, stream=expected, details=True, summarize=True,
              config=False)
    text = (run_dir / "python" / "lines.txt").read_text()
    assert text.startswith(expected.getvalue())
    assert "Function: slow_augment at line 6" in text and "Line #      Hits" in text


def test_unresolved_targets_are_reported_not_raised(profiled):
    run_dir, _ = profiled
    doc = json.loads((run_dir / "python" / "lines.json").read_text())
    status = {t["target"]: t for t in doc["targets"]}
    assert status["hotmod_pp:slow_augment"]["resolved"]
    assert status["hotmod_pp:slow_augment"]["functions"] == ["hotmod_pp:slow_augment"]
    assert "no attribute 'nope'" in status["hotmod_pp:nope"]["error"]
    assert "cannot import module 'no_such_module_xyz'" in status["no_such_module_xyz:f"]["error"]
    assert "not a Python function" in status["torch:cat"]["error"]
    text = (run_dir / "python" / "lines.txt").read_text()
    assert "trainprof: target 'hotmod_pp:nope' did not resolve" in text
    assert len(doc["messages"]) == 3


def test_summary_and_terminal(profiled):
    run_dir, hot_file = profiled
    section = summarize_python_profile(run_dir)
    assert section is not None
    cp = section["cprofile"]
    assert cp["svg"] == str(run_dir / "python" / "callgraph.svg")
    assert cp["top_tottime"][0]["user"] is True and cp["top_tottime"][0]["tottime_share"] > 0.5
    hu = section["hottest_user"]
    assert (hu["function"], hu["file"], hu["line"]) == ("slow_augment", str(hot_file), 6)
    assert hu["hottest_line"]["line"] == _hot_line_no(hot_file)
    assert hottest_user_function(run_dir)["function"] == "slow_augment"
    assert section["lines"]["hottest_line"]["line"] == _hot_line_no(hot_file)
    assert len(section["messages"]) == 3
    buf = io.StringIO()
    render_python_profile(section, Console(file=buf, width=140, color_system=None))
    out = buf.getvalue()
    assert "Top 10 by own time (tottime)" in out
    assert "slow_augment" in out.split("Top 10 by own time (tottime)")[1].splitlines()[2]
    assert "callgraph.svg" in out and "# HOT LINE" in out
    assert "Hottest function of yours: slow_augment" in out
    assert "did not resolve" in out


def test_user_code_classification():
    lib = ["/usr/lib/python3.11", "/venv/lib/python3.11/site-packages"]
    assert is_user_code("/home/me/train.py", lib)
    assert not is_user_code("/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", lib)
    assert not is_user_code("/usr/lib/python3.11/threading.py", lib)
    assert not is_user_code("~", lib) and not is_user_code("<frozen posixpath>", lib)
    assert not is_user_code("/opt/conda/lib/python3.10/site-packages/x.py", None)


def test_no_graphviz_keeps_prof_and_dot(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no `dot` on PATH

    def busy(n: int) -> float:
        return sum(i * 0.5 for i in range(n))

    tool = CProfileTool(tmp_path / "python")
    for step in range(4):
        if step == 1:
            tool.start(step)
        busy(20000)
    tool.stop(4)
    tool.close()
    top = json.loads((tmp_path / "python" / "top.json").read_text())
    assert top["messages"] == [DOT_MISSING]
    assert (top["prof"], top["dot"], top["svg"]) == ("profile.prof", "callgraph.dot", None)
    assert "digraph" in (tmp_path / "python" / "callgraph.dot").read_text()
    assert not (tmp_path / "python" / "callgraph.svg").exists()
    assert top["steps_profiled"] == 3
    section = summarize_python_profile(tmp_path)
    assert section["messages"] == [DOT_MISSING] and section["cprofile"]["svg"] is None


def test_run_ended_before_the_window(tmp_path):
    cp, lp = CProfileTool(tmp_path / "python"), LineProfileTool(tmp_path / "python", ["json:dumps"])
    for t in (cp, lp):
        t.stop(3)  # the runner may stop a tool that never started (run ended in warm-up)
        t.close()
    top = json.loads((tmp_path / "python" / "top.json").read_text())
    assert top["steps_profiled"] == 0 and top["prof"] is None
    assert "the run ended before the --py window began" in top["messages"][0]
    lines = json.loads((tmp_path / "python" / "lines.json").read_text())
    assert lines["functions"] == [] and "recorded nothing" in lines["messages"][0]
    assert summarize_python_profile(tmp_path / "nothing") is None


@pytest.mark.parametrize("text,expected", [
    ("pkg.mod:func", ["pkg.mod:func"]),
    ("pkg.mod:Class.method, train.py:step ,", ["pkg.mod:Class.method", "train.py:step"]),
    ("src/my_train.py:Trainer.fit,__main__:f,mod:f", ["src/my_train.py:Trainer.fit",
                                                       "__main__:f", "mod:f"]),
])
def test_parse_targets(text, expected):
    assert parse_targets(text) == expected


@pytest.mark.parametrize("text", ["", " , ", "func", "mod:", ":func", "mod:1bad",
                                  "bad-mod:f", "mod:Class..m", "mod:class"])
def test_parse_targets_rejects_malformed(text):
    with pytest.raises(UsageError):
        parse_targets(text)


MAIN_SCRIPT = '''
import sys
from pathlib import Path
import torch
from trainprof.capture.lineprof import LineProfileTool


def slow_augment(x):
    s = 0.0
    # a loaded machine's preemptions land on any line: the hot line does several times the
    # loop's own work, over enough iterations that a stray preemption cannot outweigh it
    for i in range(20000):
        s += (i * 1.5 + 0.5) * (i - 0.25) / (i + 1.0) * (i + 2.5) / (i + 3.0)  # HOT LINE
    return x + s * 0.0


def main():
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = Path(sys.argv[1])
    tool = LineProfileTool(out, ["script_pp.py:slow_augment", "script_pp.py:main"])
    for step in range(6):
        if step == 2:
            tool.start(step)
        x = slow_augment(torch.randn(2, 4))
        model(x).sum().backward()
        opt.step()
    tool.stop(6)
    tool.close()


main()
'''


def test_main_script_path_target_in_a_real_process(tmp_path):
    """``file.py:func`` naming the script itself resolves to ``__main__``; a function that was
    already running when the window opened (the loop's own) gets a clear message."""
    script = tmp_path / "script_pp.py"
    script.write_text(textwrap.dedent(MAIN_SCRIPT))
    out = tmp_path / "python"
    proc = subprocess.run([sys.executable, str(script), str(out)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((out / "lines.json").read_text())
    funcs = {f["label"]: f for f in doc["functions"]}
    aug = funcs["__main__:slow_augment"]
    hot = max(aug["lines"], key=lambda r: r["time_s"])
    assert "# HOT LINE" in hot["source"] and hot["hits"] == 4 * 20000
    assert funcs["__main__:main"]["hits"] == 0
    assert any("__main__:main (--lines script_pp.py:main) was already running" in m
               for m in doc["messages"])


# -- through the command line ------------------------------------------------------------------

CLI_SCRIPT = HOTMOD + '''

if __name__ == "__main__":
    train(14, lambda step: None)
'''


def test_cli_py_and_lines_on_an_unmodified_script(tmp_path):
    """`trainprof run --py SPEC --lines TARGETS script.py`: both tools over steps 3-7 of a
    script that knows nothing of trainprof; the file path of the script names ``__main__``."""
    write_script(tmp_path, "train_pp.py", CLI_SCRIPT)
    res = trainprof("run", "--py", "skip_first=3,active=5", "--lines",
                    "train_pp.py:slow_augment,train_pp.py:Net.forward,train_pp.py:nope",
                    "train_pp.py", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    pdir = res.run_dir / "python"
    top = json.loads((pdir / "top.json").read_text())
    assert top["windows"] == [[3, 8]] and top["steps_profiled"] == 5
    first = top["top_tottime"][0]
    assert (first["function"], first["ncalls"]) == ("slow_augment", 5)
    assert first["file"] == str(tmp_path / "train_pp.py")
    assert "train_pp:6:slow_augment" in (pdir / "callgraph.svg").read_text()
    lines = json.loads((pdir / "lines.json").read_text())
    funcs = {f["label"]: f for f in lines["functions"]}
    hot_no = _hot_line_no(tmp_path / "train_pp.py")
    hottest = max(funcs["__main__:slow_augment"]["lines"], key=lambda r: r["percent"])
    assert (hottest["line"], hottest["hits"]) == (hot_no, 5 * 20000)
    assert funcs["__main__:Net.forward"]["hits"] == 2 * 5
    assert lines["messages"] == [
        "target 'train_pp.py:nope' did not resolve: __main__ has no attribute 'nope'"]
    section = summarize_python_profile(res.run_dir)
    assert section["hottest_user"]["function"] == "slow_augment"
    assert section["hottest_user"]["hottest_line"]["line"] == hot_no


def test_a_deep_window_inside_the_py_window_leaves_its_trace_export_out(tmp_path):
    """--deep (steps 12-16 by default) inside --py's window (10-29): writing the trace had
    been 36% of the cProfile's time, gzip and trainprof's _save on top of the table."""
    write_script(tmp_path, "train_pp.py", CLI_SCRIPT)
    res = trainprof("run", "--deep", "--py", "skip_first=3,active=12", "train_pp.py",
                    cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert list((res.run_dir / "deep").glob("*.pt.trace.json.gz"))  # the trace was written
    top = json.loads((res.run_dir / "python" / "top.json").read_text())
    rows = [row for table in ("top_tottime", "top_cumtime") for row in top.get(table) or []]
    assert not [r for r in rows if r["file"].endswith("gzip.py") or r["function"] == "_save"]
    # starting and stopping torch.profiler stay (the window's own steps): a millisecond
    assert all(r["cumtime"] < 0.1 * top["wall_s"] for r in rows
               if r["file"].endswith("capture/deep.py")), rows


def test_cli_lines_with_dash_m_resolves_the_running_module(tmp_path):
    """`-m pkg.train`: the target `pkg.train:f` is the module running as __main__, not a second
    import of it (whose functions the loop would never call)."""
    pkg = tmp_path / "pkg_pp"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(CLI_SCRIPT)
    res = trainprof("run", "--lines", "pkg_pp.train:slow_augment", "--py", "skip_first=2,active=3",
                    "-m", "pkg_pp.train", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    lines = json.loads((res.run_dir / "python" / "lines.json").read_text())
    assert lines["targets"][0]["functions"] == ["__main__:slow_augment"]
    (func,) = lines["functions"]
    assert func["hits"] > 0 and func["file"] == str(pkg / "train.py")
    assert max(func["lines"], key=lambda r: r["percent"])["hits"] == 3 * 20000


def test_cli_malformed_lines_target_is_a_usage_error(tmp_path):
    """One form through the CLI (each costs a process); test_parse_targets covers the rest."""
    write_script(tmp_path, "train_pp.py", CLI_SCRIPT)
    res = trainprof("run", "--lines", "train_pp.py:1x", "train_pp.py", cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1].startswith("error: bad --lines target")
    assert "Traceback" not in res.stderr
    assert not (res.run_dir / "python").exists()


def test_terminal_shows_only_the_hot_lines_of_a_long_function():
    rows = [{"line": 100 + i, "hits": 0, "time_s": 0.0, "per_hit_s": None, "percent": 0.0,
             "source": f"    x{i} = {i}"} for i in range(40)]
    rows[0]["source"] = "def long_function():"
    rows[30].update(hits=1000, time_s=0.9, per_hit_s=9e-4, percent=90.0, source="    HOT = 1")
    rows[10].update(hits=1000, time_s=0.1, per_hit_s=1e-4, percent=10.0, source="    WARM = 1")
    func = {"label": "m:long_function", "function": "long_function", "file": "/x/m.py",
            "first_line": 100, "total_time_s": 1.0, "hits": 2000, "lines": rows,
            "hot_lines": [rows[30], rows[10]]}
    section = {"cprofile": None, "lines": {"windows": [[2, 5]], "steps_profiled": 3,
                                           "functions": [func]}, "messages": []}
    buf = io.StringIO()
    render_python_profile(section, Console(file=buf, width=120, color_system=None))
    out = buf.getvalue().splitlines()
    shown = [ln.split()[0] for ln in out if ln.strip() and ln.split()[0].isdigit()]
    # the def line, then each hot line with the line before it
    assert shown == ["100", "109", "110", "129", "130"]
    assert sum(1 for ln in out if ln.strip().startswith("...")) == 2
    assert any("HOT = 1" in ln and "90.0" in ln and "900 µs" in ln for ln in out)


def test_the_line_table_cuts_the_source_never_a_number_at_80_columns():
    """Off a wide terminal the numbers came out as ``Lin…  Hits  Time  Per …`` and
    ``5283…  560.5…`` while the source kept its width."""
    long_source = "        loss = criterion(model(inputs.to(device)), targets.to(device)) * scale"
    rows = [{"line": 52831 + i, "hits": 5605123, "time_s": 123.4, "per_hit_s": 2.2e-5,
             "percent": 55.5, "source": long_source} for i in range(3)]
    func = {"label": "m:step", "function": "step", "file": "/x/m.py", "first_line": 52831,
            "total_time_s": 300.0, "hits": 3 * 5605123, "lines": rows, "hot_lines": rows}
    section = {"cprofile": None, "lines": {"windows": [[2, 5]], "steps_profiled": 3,
                                           "functions": [func]}, "messages": []}
    buf = io.StringIO()
    render_python_profile(section, Console(file=buf, width=80, color_system=None))
    out = buf.getvalue().splitlines()
    head = next(ln for ln in out if "Line #" in ln)
    assert head.split()[:8] == ["Line", "#", "Hits", "Time", "Per", "Hit", "%", "Time"]
    body = [ln for ln in out if ln.strip().startswith("5283")]
    assert len(body) == 3 and all(len(ln) <= 80 for ln in body)
    assert body[0].split()[:6] == ["52831", "5605123", "123.40", "s", "22", "µs"]
    assert body[0].rstrip().endswith("…") and "loss = criterion(" in body[0]  # the source cut
