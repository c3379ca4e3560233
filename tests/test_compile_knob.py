"""The ``compile`` knob: the model's outermost calls go through ``torch.compile``."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from trainprof.capture.knobs import ENV_VAR, Knobs, parse_value
from trainprof.errors import UsageError
from trainprof.experiments import tune as tune_mod
from trainprof.store import load_run

# (the word "compile" keeps this script off the test server that has Dynamo imported)
TRAIN = """
# trained under the compile knob
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
loss_fn = nn.CrossEntropyLoss()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
for step in range(20):
    loss = loss_fn(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
"""
SCRIPT = TRAIN + """print("LOSS", f"{loss.item():.4f}", flush=True)\n"""


def _eager_loss() -> str:
    """The same training, eager, in this process."""
    scope: dict = {}
    exec(TRAIN, scope)  # noqa: S102 - the test's own script
    return f"{scope['loss'].item():.4f}"


def test_the_compile_knob_trains_the_same_model_compiled(tp):
    res = tp(SCRIPT, "--json", env={ENV_VAR: json.dumps({"compile": "true"})}, timeout=240)
    assert res.returncode == 0, res.stderr
    loss = next(x for x in res.stdout.splitlines() + res.stderr.splitlines()
                if x.startswith("LOSS"))
    assert loss == f"LOSS {_eager_loss()}"  # the same training, to 4 digits
    meta = load_run(res.run_dir).meta
    # the model compiled once; the loss module (no parameters) left alone
    assert meta["knobs"]["process"]["compile"] == {
        "value": "true", "modules": 1, "calls": 20, "skipped": {}, "errors": {}}
    assert tune_mod._actual("compile", meta) == "true (1 module compiled)"
    assert meta["compiled_frames"], "Dynamo compiled nothing"
    # the compiling first step is warm-up, not steady state
    assert res.json()["steps"]["warmup"] >= 1
    # the FLOPs of the compiled model (inductor's code calls the products): forward
    # 2*8*(16*32 + 32*4), backward twice that but the first layer's input gradient
    compute = res.json()["compute"]
    assert compute["compiled"] is True
    assert compute["flops_per_step"] == 3 * 10240 - 2 * 8 * 16 * 32
    assert 0 < compute["utilization"] < 1
    assert not any(n.startswith("no FLOPs counted") for n in res.json()["notes"])


def test_a_compilation_that_fails_runs_eager_and_says_so(monkeypatch):
    class Broken:
        def __init__(self, module, mode=None):
            self.mode = mode

        def __call__(self, *args, **kwargs):
            raise RuntimeError("backend compiler failed\nmore lines")

    monkeypatch.setattr(torch, "compile", Broken)
    layer = nn.Linear(4, 2)
    knobs = Knobs({"compile": "max-autotune"}).install()
    try:
        outs = [layer(torch.ones(1, 4)) for _ in range(3)]
    finally:
        record = knobs.uninstall()
    assert all(o.shape == (1, 2) for o in outs)  # eager, every call
    rec = record["process"]["compile"]
    assert rec["errors"] == {"Linear": "RuntimeError: backend compiler failed"}
    assert (rec["modules"], rec["calls"]) == (0, 0)
    meta = {"knobs": record}
    assert tune_mod._actual("compile", meta) == (
        "max-autotune (failed, eager: RuntimeError: backend compiler failed)")
    assert parse_value("compile", "on") == "true"
    assert parse_value("compile", "default") == "true"
    assert parse_value("compile", "REDUCE-OVERHEAD") == "reduce-overhead"
    with pytest.raises(UsageError, match="compile"):
        parse_value("compile", "fast")
