"""Warnings raised in the op count's window are shown as without trainprof's modes: at the
script's line, once per location, through the script's filters (capture/window_warnings.py)."""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from trainprof.capture.flop_count import FlopCount
from trainprof.capture.opcount import OpCountTool

# ----------------------------------------------------------------------- through `trainprof run`

PLACES = """
    import torch

    x = torch.randn(4, 3, requires_grad=True)
    opt = torch.optim.SGD([x], lr=0.1)
    for step in range(14):
        y = torch.nn.functional.softmax(x)  # PY_EVERY
        torch.mul(x.detach(), 2, out=torch.empty(2))  # CPP_EVERY
        if step == 8:
            torch.nn.functional.log_softmax(x)  # PY_WINDOW
        if step == 9:
            torch.mul(x.detach(), 2, out=torch.empty(3))  # CPP_WINDOW
        y.sum().backward()
        opt.step()
        opt.zero_grad()
"""


def _line(script: str, marker: str) -> int:
    (n,) = [i for i, text in enumerate(script.splitlines(), 1) if marker in text]
    return n


def test_a_warning_in_the_window_is_shown_once_at_the_scripts_line(tp):
    res = tp(PLACES, "--no-html")
    assert res.returncode == 0, res.stderr
    record = json.loads((res.run_dir / "ops.json").read_text())
    assert record["window_steps"] == [[8, 10]]  # the warnings of steps 8 and 9 were in it
    script = (res.run_dir.parent / "train.py").read_text()
    for marker, text in (
        # torch's Python, warnings.warn(stacklevel=3): every step, and first in the window
        ("PY_EVERY", "Implicit dimension choice for softmax"),
        ("PY_WINDOW", "Implicit dimension choice for log_softmax"),
        # C++ TORCH_WARN inside an aten op (the innermost Python frame): the same
        ("CPP_EVERY", "was resized since it had shape [2]"),
        ("CPP_WINDOW", "was resized since it had shape [3]"),
    ):
        assert res.stderr.count(text) == 1, (marker, res.stderr)
        (shown,) = [ln for ln in res.stderr.splitlines() if text in ln]
        assert shown.startswith(f"{res.run_dir.parent / 'train.py'}:{_line(script, marker)}: "
                                "UserWarning: "), (marker, shown)
    assert "trainprof/capture" not in res.stderr, res.stderr


ERRORS = """
    import json
    import traceback
    import warnings

    import torch

    # filters for the script's own module: they see the place Python names
    warnings.filterwarnings("error", message="Implicit dimension", module="__main__")
    warnings.filterwarnings("error", message="An output with one", module="__main__")
    x = torch.randn(4, 3, requires_grad=True)
    opt = torch.optim.SGD([x], lr=0.1)
    raised = {"python": [], "cpp": []}
    for step in range(12):
        try:
            y = torch.nn.functional.softmax(x)
        except UserWarning as e:
            frames = [f.name for f in traceback.extract_tb(e.__traceback__)]
            raised["python"].append([step, type(e).__name__, "_get_softmax_dim" in frames])
            y = torch.nn.functional.softmax(x, dim=1)
        try:
            torch.mul(x.detach(), 2, out=torch.empty(2))
        except UserWarning as e:
            raised["cpp"].append([step, type(e).__name__])
        y.sum().backward()
        opt.step()
        opt.zero_grad()
    with open("raised.json", "w") as f:
        json.dump(raised, f)
"""


def test_an_error_filter_of_the_script_still_raises_in_the_window(tp, tmp_path):
    res = tp(ERRORS, "--no-html")
    assert res.returncode == 0, res.stderr
    raised = json.loads((tmp_path / "raised.json").read_text())
    # every step, 8 and 9 included: the same exception type, raised from torch's own
    # warnings.warn (the op did not run on), caught at the script's line
    assert raised["python"] == [[s, "UserWarning", True] for s in range(12)]
    assert raised["cpp"] == [[s, "UserWarning"] for s in range(12)]
    assert json.loads((res.run_dir / "ops.json").read_text())["window_steps"] == [[8, 10]]


# --------------------------------------------------------------------------------- in-process

#: the stacklevel of the kernel below that names ``_calls``'s line without any mode
_LEVEL: list[int] = []


@torch.library.custom_op("trainprof_test::warns", mutates_args=())
def _warns(x: torch.Tensor) -> torch.Tensor:
    """An op whose Python kernel warns at its caller's line, as torch's Python does, through
    the dispatcher's frames: what the FLOP count's dispatch mode sits among."""
    if not _LEVEL:  # first call, no mode on: count the frames up to the caller
        f, k = sys._getframe(0), 1
        while f.f_code is not _calls.__code__:
            f, k = f.f_back, k + 1
        _LEVEL.append(k)
    warnings.warn("the kernel warns", stacklevel=_LEVEL[0])
    return x.clone()


def _calls() -> None:
    x = torch.randn(4, 3)
    for k in range(1, 6):  # from torch's own frame to this function's caller
        torch.nn.functional.softmax(x, _stacklevel=k)
    torch.mul(x, 2, out=torch.empty(2))
    _warns(x)


def _places(start, stop) -> list[tuple[str, str, int]]:  # noqa: ANN001
    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("always")
        start()
        try:
            _calls()
        finally:
            stop()
    return [(str(w.message)[:30], w.filename, w.lineno) for w in log]


def test_each_mode_leaves_every_warnings_place_as_it_was():
    tool = OpCountTool(Path(tempfile.mkdtemp()))
    flops = FlopCount()  # alone: a torch.compile'd model's window
    filters, show = list(warnings.filters), warnings._showwarnmsg  # type: ignore[attr-defined]
    bare, both, dispatch_only = (
        _places(start, stop) for start, stop in (
            (lambda: None, lambda: None),
            (lambda: tool.start(0), lambda: tool.stop(1)),
            (flops.start, flops.stop)))
    assert len(bare) == 7 and [w[0] for w in bare][-1] == "the kernel warns"
    assert bare[-1][1] == __file__  # the kernel's stacklevel names _calls's line
    assert both == bare
    assert dispatch_only == bare
    assert tool.total > 0 and flops.op_clock.ns  # the modes were on
    # nothing left behind
    assert warnings.filters == filters
    assert warnings._showwarnmsg is show  # type: ignore[attr-defined]


def test_filters_added_in_the_window_see_the_place_python_names():
    tool = OpCountTool(Path(tempfile.mkdtemp()))
    x = torch.randn(4, 3)
    tool.start(0)
    try:
        # as a script (or a library) records warnings around a call, inside the window
        with warnings.catch_warnings(record=True) as log:
            warnings.simplefilter("always")
            torch.nn.functional.softmax(x)
            line = sys._getframe().f_lineno - 1
        with warnings.catch_warnings():
            warnings.filterwarnings("error", module=__name__)  # this module's place
            try:
                torch.nn.functional.softmax(x)
                raised = None
            except UserWarning as e:
                raised = e
    finally:
        tool.stop(1)
    assert [(w.filename, w.lineno) for w in log] == [(__file__, line)]
    assert type(raised) is UserWarning
