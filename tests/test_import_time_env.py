"""Environment variables a script sets before its own ``import torch`` act as under python
(capture/import_time_env.py): trainprof loads torch before the script's first line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import trainprof, write_script

SETS_THREADS = """
import os
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["OPENBLAS_NUM_THREADS"] = "1"
import numpy
import torch
print("threads", torch.get_num_threads())
w = torch.nn.Parameter(torch.ones(64))
opt = torch.optim.SGD([w], lr=0.1)
for _ in range(5):
    (w * 2).sum().backward(); opt.step(); opt.zero_grad()
os.environ["OMP_NUM_THREADS"] = "2"  # after its import of torch: no effect under python
print("threads after", torch.get_num_threads())
"""


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}


def test_threads_set_before_the_scripts_import_of_torch_are_torchs_as_under_python(tmp_path):
    """An explorer's script pinned to one thread this way ran at 2 threads under trainprof
    (4.7 ms a step against python's 8.85 ms). (Torch takes no more threads than cores: the
    machine's two, whatever a larger count says; one is below both.)"""
    script = write_script(tmp_path, "train.py", SETS_THREADS)
    plain = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                           text=True, env=_clean_env(), timeout=120)
    assert plain.stdout.splitlines() == ["threads 1", "threads after 1"], plain.stderr
    res = trainprof("run", "--json", "--no-html", "train.py", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    # under --json the script's stdout goes to stderr
    printed = [ln for ln in res.stderr.splitlines() if ln.startswith("threads")]
    assert printed == ["threads 1", "threads after 1"], res.stderr[-2000:]
    doc = res.json()
    assert doc["environment"]["torch_num_threads"] == 1
    # numpy's BLAS read its variable when trainprof loaded it: said, not hidden
    assert any("OPENBLAS_NUM_THREADS=1 before its import of numpy" in n
               for n in doc["notes"]), doc["notes"]
    meta = json.loads((res.run_dir / "run.json").read_text())
    assert meta["launch"]["env"]["OMP_NUM_THREADS"] in (None, os.environ.get("OMP_NUM_THREADS"))


def test_a_thread_count_the_script_sets_is_named_as_the_scripts_in_the_threads_finding():
    from test_diagnosis import make_steps, make_summary

    from trainprof.diagnosis import diagnose

    steps = make_steps(60)
    env = {"usable_cores": 4, "torch_num_threads": 1, "cuda": None, "gpu_count": 0,
           "thread_env": {"OMP_NUM_THREADS": "1"}}
    system = {"n_samples": 20, "proc_cpu_pct": 100.0, "workers_cpu_pct": 0.0,
              "sys_cpu_pct": 25.0, "iowait_pct": 0.0}
    found = {}
    for by_script in (None, ["OMP_NUM_THREADS"]):
        summary = make_summary(steps, environment={**env, "thread_env_by_script": by_script},
                               system=system)
        (f,) = [f for f in diagnose(summary, steps) if f["cause"] == "too_few_threads"]
        found[bool(by_script)] = f["fix"]["text"]
    assert "a launcher or job script exported it" in found[False]
    assert "The script sets OMP_NUM_THREADS=1 itself" in found[True]
