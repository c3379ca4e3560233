"""pytest plugin (``-p failure_log``): each failure's report appended to $OUT/failures.txt
as it happens, so that a run cut short by a time limit still says why (tools/gpu_check.sh)."""

import os


def pytest_runtest_logreport(report):
    if report.failed:
        out = os.environ.get("OUT") or "."
        with open(os.path.join(out, "failures.txt"), "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext[-3500:]}\n")
