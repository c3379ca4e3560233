"""What users type after ``trainprof run`` that is not a script's path: the interpreter word,
a console script, a shell script or program; and a script that trains in a child process."""

from __future__ import annotations

import json
import os
import sys

from conftest import trainprof, write_script

FIVE_STEPS = """
import sys
import torch
w = torch.nn.Parameter(torch.ones(4))
opt = torch.optim.SGD([w], lr=0.1)
for _ in range(5):
    (w * 2).sum().backward(); opt.step(); opt.zero_grad()
print("argv", sys.argv[1:])
"""


def test_a_shell_script_or_a_program_is_refused_with_what_to_run(tmp_path):
    write_script(tmp_path, "run.sh", """\
        #!/bin/bash
        set -e
        export DATA=/data
        CUDA_VISIBLE_DEVICES=0 python3 train.py \\
            --lr 0.1
        """)
    res = trainprof("run", "run.sh", cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr == ("error: run.sh is a shell script, not Python: trainprof runs Python "
                          "in its own process; it runs Python once: use `CUDA_VISIBLE_DEVICES=0 "
                          "trainprof run train.py --lr 0.1`\n")
    res = trainprof("run", "bash", "run.sh", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.startswith("error: bash is a shell (")
    assert res.stderr.endswith("use `CUDA_VISIBLE_DEVICES=0 trainprof run train.py --lr 0.1`\n")
    write_script(tmp_path, "two", "#!/bin/sh\npython a.py\npython b.py\n")  # no suffix
    res = trainprof("run", "two", cwd=tmp_path)
    assert res.returncode == 2 and "two is a shell script" in res.stderr
    assert "(it has 2 python lines)" in res.stderr
    res = trainprof("run", "ls", "-l", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.startswith("error: ls is a program (")
    assert not (tmp_path / "run").exists()


def test_a_leading_python_word_is_the_interpreter(tmp_path):
    write_script(tmp_path, "train.py", FIVE_STEPS)
    res = trainprof("run", "--no-html", "python3", "train.py", "--lr", "1", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "argv ['--lr', '1']" in res.stdout
    meta = json.loads((res.run_dir / "run.json").read_text())
    assert meta["command"] == [sys.executable, "train.py", "--lr", "1"]
    assert meta["summary"]["steps"]["count"] == 5
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    write_script(tmp_path / "pkg", "train.py", FIVE_STEPS)
    res = trainprof("run", "--no-html", "python", "-m", "pkg.train", "x", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    meta = json.loads((res.run_dir / "run.json").read_text())
    assert meta["command"] == [sys.executable, "-m", "pkg.train", "x"]
    assert meta["summary"]["steps"]["count"] == 5
    res = trainprof("run", "python", "-u", "train.py", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.startswith("error: trainprof run takes the "
                                                         "script without the interpreter's")


def test_a_console_script_runs_its_file_as_the_script(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = write_script(bin_dir, "my-train", f"#!{sys.executable}\n{FIVE_STEPS}")
    script.chmod(0o755)
    other = write_script(bin_dir, "their-train", f"#!/opt/other/bin/python3\n{FIVE_STEPS}")
    other.chmod(0o755)
    path = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    res = trainprof("run", "--no-html", "my-train", "--lr", "1", cwd=tmp_path,
                    env={"PATH": path})
    assert res.returncode == 0, res.stderr
    assert "argv ['--lr', '1']" in res.stdout
    meta = json.loads((res.run_dir / "run.json").read_text())
    assert meta["command"] == [sys.executable, str(script), "--lr", "1"]
    assert meta["name"] == "my-train" and meta["summary"]["steps"]["count"] == 5
    res = trainprof("run", "their-train", cwd=tmp_path, env={"PATH": path})
    assert res.returncode == 2
    assert res.stderr == (f"error: their-train is a console script of another Python "
                          f"(/opt/other/bin/python3), not trainprof's ({sys.executable}): run "
                          f"`/opt/other/bin/python3 -m trainprof run {bin_dir}/their-train`\n")


def test_nothing_measured_names_the_child_process_that_trained(tmp_path):
    write_script(tmp_path, "child.py", FIVE_STEPS)
    write_script(tmp_path, "wrap.py", """
        import subprocess, sys
        subprocess.run([sys.executable, "child.py", "--lr", "1"], check=True)
        """)
    res = trainprof("run", "--no-html", "wrap.py", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("trainprof: nothing to measure: ")
    assert "; it started `python child.py --lr 1`" in last
    assert "the training seems to run in a child process" in last
    assert "measure the child: `trainprof run child.py --lr 1`, or `with trainprof.profile():`" \
        in last
    # a script that trains nowhere: no child named (trainprof's own processes are not)
    write_script(tmp_path, "idle.py", "import subprocess; subprocess.run(['true'])\n")
    res = trainprof("run", "--no-html", "idle.py", cwd=tmp_path)
    last = res.stderr.strip().splitlines()[-1]
    assert last == f"trainprof: nothing to measure: the script ended (finished, exit 0) " \
        "before any DataLoader batch, module call, backward or optimizer step; record in " \
        f"{res.run_dir}"


def test_child_cpu_seconds_come_from_the_samples(tmp_path):
    from trainprof.capture.child_training import child_training_hint, children_cpu_s

    samples = tmp_path / "samples.jsonl"
    rows = [{"t": 10.0 + 0.5 * i, "children_cpu_pct": pct}
            for i, pct in enumerate([0.0, 100.0, 200.0, 100.0, None])]
    samples.write_text("\n".join(json.dumps(r) for r in rows) + "\n{\"t\": 1")
    assert children_cpu_s(samples) == 0.5 + 1.0 + 0.5  # a torn last line is left out
    assert child_training_hint([], samples) == (
        "its child processes used 2.0 CPU-seconds: the training seems to run in a child "
        "process, which trainprof does not follow; measure the child: trainprof run on the "
        "child's command, or `with trainprof.profile():` around its training loop")
    assert child_training_hint([["git", "rev-parse"]], tmp_path / "none") is None
