"""The HTML report, tested as a person would see it.

The pure parts (downsampled series, the JSON-in-<script> encoder, the file size of a long run)
are tested directly. The page itself is opened in headless Chromium, driven over the DevTools
protocol on a pipe (``--remote-debugging-pipe``: no websocket, no extra dependency), to check
that it loads with no console error and no network request, that the charts draw, that hover
and zoom work, and that strings from the run that try to inject markup stay text.

Chromium is Debian's ``chromium`` package (``apt-get install -y chromium``); the browser tests
skip, saying so, only where it is not installed.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import io
import json
import os
import re
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from conftest import trainprof, write_script
from PIL import Image

from trainprof.analysis.series import bucket_reduce, sample_series, step_series, telemetry_series
from trainprof.commands import analyse
from trainprof.report.html import json_for_script, render_compare_html, render_html
from trainprof.report.terminal import fmt_time
from trainprof.schema import FLAG_PROFILED
from trainprof.store import STEP_DTYPE, Run, RunWriter, load_run

#: A string that tries every way into the page: closing tags, quotes, comments, handlers.
INJECT = "<script>window.__pwned=1</script>\"'&<!--<img src=x onerror=\"window.__pwned=2\">"


# -- pure parts --------------------------------------------------------------------------------


def test_json_for_script_cannot_break_out_and_round_trips() -> None:
    data = {"a": INJECT, "b": "</SCRIPT><!-- \u2028\u2029 --> &amp;", INJECT: [1.5, None]}
    text = json_for_script(data)
    for bad in ("<", ">", "\u2028", "\u2029", "&"):
        assert bad not in text
    assert json.loads(text) == data  # what JSON.parse will read back
    assert json_for_script({"x": float("nan")}) == '{"x":null}'


def _write_run(run_dir: Path, n: int, n_samples: int, spike: int | None = None,
               profiled: tuple[int, int] | None = None, workers_rss: int = 5 * 10**8) -> Run:
    """A finished Run folder of ``n`` synthetic steps (~10 ms) and ``n_samples`` samples.

    Steps have 3 ms data wait (+50 ms on every 1000th, +500 ms on ``spike``), 3 ms forward,
    3 ms backward, 0.5 ms optimizer, 0.1 ms other; the first five take 2 s more (warm-up).
    Steps in ``profiled`` (first, end) are flagged as recorded under a heavy tool.
    """
    rng = np.random.default_rng(0)
    steps = np.zeros(n, STEP_DTYPE)
    steps["step"] = np.arange(n)
    data = 3_000_000 + rng.integers(0, 500_000, n)
    data[::1000] += 50_000_000
    if spike is not None:
        data[spike] += 500_000_000
    data[:5] += 2_000_000_000
    steps["data_wait_ns"] = data
    steps["forward_ns"] = 3_000_000
    steps["backward_ns"] = 3_000_000
    steps["optimizer_ns"] = 500_000
    steps["other_ns"] = 100_000
    steps["samples"] = 32
    if profiled:
        steps["flags"][profiled[0] : profiled[1]] = FLAG_PROFILED
    dur = data + 6_600_000
    steps["dur_ns"] = dur
    steps["t_start_ns"] = 1_000_000_000 + np.concatenate([[0], np.cumsum(dur)[:-1]])
    writer = RunWriter(
        run_dir,
        {
            "name": "synthetic",
            "command": ["python", "train.py"],
            "clock_origin_s": 100.0,
            "fingerprint": {"cpu": {"usable_cores": 4}},
        },
    )
    writer.append_step_bytes(steps.tobytes())
    end = float(steps["t_start_ns"][-1] + dur[-1]) / 1e9 if n else 1.0
    lines = []
    for i, t in enumerate(np.linspace(100.0, 100.0 + end, n_samples).tolist()):
        lines.append(orjson.dumps({
            "t": t, "proc_cpu_pct": 90.0, "rss_bytes": 10**9 + i, "workers": {"7": 50.0},
            "workers_rss_bytes": workers_rss, "sys_cpu_pct": [80.0, 70.0, 60.0, None],
            "iowait_pct": None if i == 3 else 2.0,
            "disk_read_bps": 9e9 if i == n_samples // 2 else 1e7,
            "gpu": [{"index": 0, "util_pct": 40.0, "mem_used_bytes": 4e9,
                     "mem_total_bytes": 8e10}],
        }))
    (run_dir / "samples.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    writer.close("finished", 0)
    return load_run(run_dir)


def test_bucket_reduce_keeps_means_and_extremes() -> None:
    values = np.array([1.0, 2.0, np.nan, 4.0, 10.0, np.nan, np.nan])
    r = bucket_reduce(values, 3)
    assert r["mean"].tolist()[:2] == [1.5, 7.0]
    assert r["min"].tolist()[:2] == [1.0, 4.0]
    assert r["max"].tolist()[:2] == [2.0, 10.0]
    assert np.isnan(r["mean"][2]) and np.isnan(r["max"][2])  # an all-missing bucket is a gap


def test_step_series_buckets_long_runs_without_hiding_spikes(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "run", n=120_024, n_samples=12_000, spike=77_777,
                     profiled=(200, 224))
    s = step_series(run, max_points=5000)
    assert s["count"] == 120_000 and s["bucket"] == 24 and len(s["dur"]) == 5000
    assert s["warmup"] == 5 and s["steady_step"] == 5
    assert s["steady_t"] == pytest.approx(float(run.steps["t_start_ns"][5]) / 1e9, abs=1e-6)
    # the profiled steps are left out, and said where: bucket 8 jumps over them
    assert [(w["first"], w["last"]) for w in s["profiled"]] == [(200, 223)]
    assert s["profiled"][0]["t1"] == pytest.approx(
        float(run.steps["t_start_ns"][224]) / 1e9, abs=1e-6)
    assert s["step"][8:10] == [192, 240] and s["step_last"][8] == 223 + 24 - 8
    keep = (run.steps["flags"] & FLAG_PROFILED) == 0
    dur = run.steps["dur_ns"][keep] / 1e9
    b = (77_777 - 24) // 24
    # the 500 ms spike is averaged into its bucket's mean but kept whole in the envelope
    assert dur[77_777 - 24] > 0.5
    assert s["dur_hi"][b] == pytest.approx(dur[77_777 - 24], abs=1e-6)
    assert s["dur"][b] == pytest.approx(dur[b * 24 : b * 24 + 24].mean(), abs=1e-6)
    assert max(s["dur_hi"][6:]) == s["dur_hi"][b]
    # phases stack to the step time, bucket by bucket
    stacked = np.sum([s["phases"][k] for k in s["phases"]], axis=0)
    np.testing.assert_allclose(stacked, s["dur"], atol=1e-6)
    assert s["phases"]["optimizer"][100] == pytest.approx(0.0005)
    # times are on the clock origin: the first step starts 1 s after it
    assert s["t0"][0] == pytest.approx(1.0) and s["step"][1] == 24
    assert s["t1"][-1] == pytest.approx((run.steps["t_start_ns"][-1] + run.steps["dur_ns"][-1])
                                        / 1e9, abs=1e-6)
    small = step_series(run, max_points=10**6)
    assert small["bucket"] == 1 and len(small["dur"]) == 120_000
    assert small["step"] == small["step_last"]


def test_sample_series_units_gaps_and_envelopes(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "run", n=100, n_samples=12_001)
    s = sample_series(run, max_points=5000)
    assert s["count"] == 12_001 and s["bucket"] == 3 and len(s["t"]) == 4001
    assert s["n_cores"] == 4
    series = s["series"]
    assert series["proc_cores"]["y"][0] == pytest.approx(0.9)
    assert series["workers_cores"]["y"][0] == pytest.approx(0.5)
    assert series["sys_cores"]["y"][0] == pytest.approx(2.1)  # null core skipped, in cores
    assert series["iowait_pct"]["y"][1] == pytest.approx(2.0)  # one null in the bucket
    disk = series["disk_read_bps"]
    b = 6000 // 3
    assert disk["hi"][b] == 9e9 and disk["lo"][b] == 1e7  # the burst stays in the envelope
    assert series["gpu0_util_pct"]["y"][0] == 40.0 and s["gpu_mem_total"] == {"0": 8e10}
    assert "ctx_switches_ps" not in series  # never measured: no chart
    assert s["t"][0] == pytest.approx(0.0, abs=1e-3)


def test_telemetry_series_accepts_the_usual_shapes() -> None:
    got = telemetry_series(
        {"loss": [3.0, 2.0, None, 1.0], "lr": [[0, 1e-4], [10, 3e-5]],
         "acc": {"step": [5, 6], "value": [0.5, 0.75]}, "junk": "text"}
    )
    by = {t["name"]: t for t in got}
    assert by["loss"]["x"] == [0, 1, 2, 3] and by["loss"]["y"] == [3.0, 2.0, None, 1.0]
    assert by["lr"]["x"] == [0, 10] and by["lr"]["y"] == [1e-4, 3e-5]
    assert by["acc"]["y"] == [0.5, 0.75] and "junk" not in by
    records = telemetry_series([{"step": s, "loss": 1.0 / (s + 1), "tag": "x"}
                                for s in range(20_000)], max_points=1000)
    assert [t["name"] for t in records] == ["loss"]
    assert records[0]["bucket"] == 20 and len(records[0]["y"]) == 1000
    assert records[0]["hi"][0] == 1.0 and records[0]["x"][1] == 20


def test_report_of_a_long_run_stays_small(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "run", n=200_000, n_samples=30_000, spike=123_457)
    t0 = time.perf_counter()
    path = render_html(analyse(run), run, tmp_path / "report.html")
    took = time.perf_counter() - t0
    size = path.stat().st_size
    print(f"200k steps, 30k samples: {size / 1e6:.2f} MB in {took:.2f} s")
    assert size < 5 * 1024 * 1024
    text = path.read_text()
    data = json.loads(re.search(r'id="tp-data">(.*?)</script>', text, re.S).group(1))
    assert len(data["steps"]["dur"]) <= 5000 and len(data["samples"]["t"]) <= 5000
    assert "http://" not in text.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in text


# -- the browser -------------------------------------------------------------------------------


def _chromium() -> str | None:
    for name in (os.environ.get("TRAINPROF_CHROMIUM"), "chromium", "chromium-browser",
                 "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


class Browser:
    """Headless Chromium driven with the DevTools protocol over ``--remote-debugging-pipe``.

    The protocol is JSON messages separated by NUL bytes; the browser reads fd 3, writes fd 4.
    """

    def __init__(self, exe: str) -> None:
        self.profile = tempfile.mkdtemp(prefix="trainprof-chromium-")
        child_in, self._w = os.pipe()
        self._r, child_out = os.pipe()
        # Move the child's ends above 4 first, so placing them on 3 and 4 cannot clobber one.
        a = fcntl.fcntl(child_in, fcntl.F_DUPFD, 10)
        b = fcntl.fcntl(child_out, fcntl.F_DUPFD, 10)
        os.close(child_in)
        os.close(child_out)

        def onto_3_and_4() -> None:
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen(
            [exe, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
             "--no-first-run", "--no-default-browser-check", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--disable-extensions",
             "--disable-quic", "--mute-audio", "--hide-scrollbars",
             f"--user-data-dir={self.profile}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=(3, 4), preexec_fn=onto_3_and_4,  # noqa: PLW1509 - single-threaded here
        )
        os.close(a)
        os.close(b)
        self._buf = b""
        self._id = 0
        self.events: list[dict[str, Any]] = []

    def _read(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._r], [], [], left)[0]:
                raise TimeoutError("no message from chromium")
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                raise EOFError("chromium closed the pipe")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = 30) -> dict[str, Any]:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        while True:
            m = self._read(timeout)
            if m.get("id") == self._id:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            self.events.append(m)

    def wait_for(self, method: str, session: str, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            for i, e in enumerate(self.events):
                if e.get("method") == method and e.get("sessionId") == session:
                    return self.events.pop(i)
            self.events.append(self._read(max(0.01, deadline - time.monotonic())))

    def open(self, path: Path, width: int = 1280, height: int = 900) -> Page:
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        sid = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})[
            "sessionId"]
        for domain in ("Page", "Runtime", "Network", "Log"):
            self.send(f"{domain}.enable", session=sid)
        page = Page(self, sid, target)
        page.resize(width, height)
        self.send("Page.navigate", {"url": path.resolve().as_uri()}, session=sid)
        self.wait_for("Page.loadEventFired", sid)
        return page

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.send("Browser.close", timeout=5)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._r)
        os.close(self._w)
        shutil.rmtree(self.profile, ignore_errors=True)


class Page:
    def __init__(self, browser: Browser, sid: str, target: str) -> None:
        self.b, self.sid, self.target = browser, sid, target

    def js(self, expression: str) -> Any:
        r = self.b.send("Runtime.evaluate", {"expression": expression, "returnByValue": True},
                        session=self.sid)
        if "exceptionDetails" in r:
            raise RuntimeError(r["exceptionDetails"])
        return r["result"].get("value")

    def resize(self, width: int, height: int) -> None:
        self.b.send("Emulation.setDeviceMetricsOverride",
                    {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
                    session=self.sid)

    def mouse(self, kind: str, x: float, y: float, clicks: int = 1) -> None:
        self.b.send("Input.dispatchMouseEvent",
                    {"type": kind, "x": x, "y": y, "button": "left", "clickCount": clicks,
                     "buttons": 1 if kind == "mousePressed" else 0}, session=self.sid)

    def screenshot(self, clip: dict[str, float] | None = None) -> Image.Image:
        params: dict[str, Any] = {"format": "png"}
        if clip:
            params["clip"] = {**clip, "scale": 1}
        data = self.b.send("Page.captureScreenshot", params, session=self.sid)["data"]
        return Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB")

    def problems(self) -> list[str]:
        """Console errors/warnings, uncaught exceptions and log errors (CSP violations) so far."""
        out = []
        for e in self.b.events:
            if e.get("sessionId") != self.sid:
                continue
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.exceptionThrown":
                out.append(json.dumps(p["exceptionDetails"])[:500])
            elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "warning",
                                                                        "assert"):
                out.append(json.dumps(p.get("args"))[:500])
            elif m == "Log.entryAdded" and p["entry"].get("level") in ("error", "warning"):
                out.append(p["entry"].get("text", "")[:500])
        return out

    def requests(self) -> list[str]:
        return [e["params"]["request"]["url"] for e in self.b.events
                if e.get("sessionId") == self.sid and e.get("method") ==
                "Network.requestWillBeSent"]

    def rect(self, selector: str) -> dict[str, float]:
        r = self.js(f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
                    "e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect();"
                    "return {x: r.x, y: r.y, width: r.width, height: r.height,"
                    " pageX: r.x + window.scrollX, pageY: r.y + window.scrollY}; })()")
        assert r is not None, selector
        return r

    def close(self) -> None:
        self.b.send("Target.closeTarget", {"targetId": self.target})


CHROMIUM = _chromium()
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="chromium is not installed (Debian: apt-get install -y chromium); "
    "the HTML report is not checked in a browser",
)


@pytest.fixture(scope="module")
def browser():
    assert CHROMIUM is not None
    b = Browser(CHROMIUM)
    yield b
    b.close()


def _assert_clean(page: Page) -> None:
    assert page.problems() == []
    urls = page.requests()
    assert urls and all(u.startswith(("file:", "data:")) for u in urls), urls
    assert page.js("document.documentElement.getAttribute('data-charts-ready')") == "1"


INJECTING_SCRIPT = """
import os, sys, time
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

class Images(Dataset):
    def __len__(self):
        return 4096
    def __getitem__(self, i):
        time.sleep(float(os.environ.get("SLEEP_MS", "3")) / 1000)  # x4 per batch
        return torch.randn(16), i % 2

Images.__qualname__ = sys.argv[1]   # a dataset class name that tries to inject markup
model = nn.Linear(16, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loss_fn = nn.CrossEntropyLoss()
for step, (x, y) in enumerate(DataLoader(Images(), batch_size=4)):
    if step == 40:
        break
    loss = loss_fn(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.fixture(scope="module")
def injected_report(tmp_path_factory) -> tuple[Path, dict[str, Any], Run]:
    """A real run whose script arguments and dataset class name try to inject markup, with
    every optional section filled with injecting strings too."""
    cwd = tmp_path_factory.mktemp("inject")
    write_script(cwd, "train.py", INJECTING_SCRIPT)
    res = trainprof("run", "train.py", INJECT, f"--tag={INJECT}", cwd=cwd)
    assert res.returncode == 0, res.stderr
    # every run writes its report; the tests below re-render it with injected findings
    assert (res.run_dir / "report.html").stat().st_size > 10_000
    run = load_run(res.run_dir)
    summary = analyse(run)
    assert INJECT in summary["dataloaders"][0]["dataset"]
    summary["findings"].append({
        "category": "python_loop", "cause": INJECT, "title": f"slow {INJECT}", "severity": "low",
        "evidence": {"function": INJECT, "share": 0.1}, "estimated_gain": 0.05,
        "fix": {"text": f"rewrite {INJECT}", "snippet": f"def f():\n    return '{INJECT}'"},
        "verify": f"trainprof tune {INJECT}",
    })
    summary["deep"] = {  # the shape of analysis.trace.analyse_trace
        "kind": "trace", "rank": 0, "steps": ["12", "13"],
        "breakdown_us": {"Kernel": 1200.0, "Memcpy": 30.0, "Other": 270.0, "Total": 1500.0},
        "breakdown_pct": {"Kernel": 80.0, "Memcpy": 2.0, "Other": 18.0},
        "gpu": {"0": {"utilization": 81.5, "sm_efficiency": 60.1}},
        "operators": [{"name": INJECT, "calls": 3, "host_self_us": 120.0}] * 25,
        "kernels": [{"name": INJECT, "calls": 3, "device_us": 1200.0}],
        "findings": [{"title": f"trace says {INJECT}"}],
    }
    row = {"function": INJECT, "file": "train.py", "line": 9, "ncalls": 160, "tottime": 0.25,
           "cumtime": 0.5, "tottime_share": 0.25, "cumtime_share": 0.5, "user": True}
    summary["python_profile"] = {  # the shape of analysis.python_profile
        "cprofile": {"windows": [[10, 30]], "steps_profiled": 20, "wall_s": 1.0,
                     "profiled_s": 0.9, "n_functions": 10, "top_tottime": [row],
                     "top_cumtime": [row, {**row, "user": False, "function": "other"}],
                     "svg": "/elsewhere/callgraph.svg"},
        "lines": {"windows": [[10, 30]], "steps_profiled": 20, "functions": [
            {"label": INJECT, "file": "train.py", "first_line": 8, "total_time_s": 0.1,
             "hits": 10, "lines": [
                 {"line": 8, "hits": 0, "time_s": 0.0, "per_hit_s": None, "percent": 0.0,
                  "source": "    def __getitem__(self, i):"},
                 {"line": 9, "hits": 10, "time_s": 0.09, "per_hit_s": 0.009, "percent": 90.0,
                  "source": f"        x = '{INJECT}'"}]}]},
        "hottest_user": {"function": INJECT, "file": "train.py", "line": 9, "tottime": 0.25,
                         "share": 0.25},
        "messages": [f"note {INJECT}"],
    }
    summary["line_profile"] = {"functions": [{"name": INJECT, "lines": [
        {"line": 3, "hits": 10, "time_s": 0.01, "code": f"x = '{INJECT}'"}]}]}
    summary["telemetry"] = {INJECT: [3.0, 2.5, 2.0, 1.8], "lr": [[0, 0.1], [2, 0.05]]}
    summary["future_analysis"] = {"note": INJECT}
    graph = run.path / "python"
    graph.mkdir(exist_ok=True)
    (graph / "callgraph.svg").write_text(
        '<svg xmlns="http://www.w3.org/2000/svg" width="200" height="60" '
        'onload="window.__pwned=3"><script>window.__pwned=4</script>'
        '<rect width="200" height="60" fill="#ff0000"/><text x="5" y="30">'
        f'{INJECT.replace("&", "&amp;").replace("<", "&lt;")}</text></svg>'
    )
    path = render_html(summary, run, run.path / "report.html")
    return path, summary, run


@needs_chromium
def test_injected_strings_stay_text(browser: Browser, injected_report) -> None:
    path, summary, _ = injected_report
    page = browser.open(path)
    try:
        _assert_clean(page)
        assert page.js("window.__pwned === undefined")
        assert page.js("document.scripts.length") == 2  # the data block and ours
        assert page.js("document.querySelectorAll('img[src=x], [onerror], [onload]').length") == 0
        # every place a run string lands shows it literally
        last_finding = f"#finding-{len(summary['findings'])}"
        for selector in ("#tp-command", "#tp-dataloaders", last_finding, "#deep", "#python",
                         "#more", "#telemetry"):
            text = page.js(f"document.querySelector({json.dumps(selector)}).textContent")
            assert INJECT in text, selector
        # the trace breakdown is a bar of its categories; long operator lists are cut
        assert page.js("document.querySelectorAll('#tp-deep-bar span').length") == 3
        assert "top 20 of 25" in page.js("document.getElementById('deep').textContent")
        # the call graph is an image: shown, its script never run
        assert page.js("document.querySelector('#tp-callgraph img').naturalWidth") == 200
        # cProfile: the user's function in bold; line profile: the 90% line shaded, verbatim
        assert page.js("document.querySelectorAll('#python tr.user').length") == 2
        line9 = page.js("Array.from(document.querySelectorAll('#python table.lines tr'))"
                        ".map(r => [r.cells[0].textContent, r.cells[4].textContent, "
                        "r.cells[5].textContent, getComputedStyle(r).backgroundColor])"
                        ".find(r => r[0] === '9')")
        assert line9[1] == "90.0" and line9[2] == f"        x = '{INJECT}'"
        assert line9[3].startswith("rgba(214, 39, 40")
        # a telemetry chart titled with the injecting name was drawn from the JSON block
        assert page.js("document.querySelector('[data-chart=telemetry-0] .title').textContent"
                       ) == INJECT
        assert page.js("document.querySelectorAll('[data-chart=telemetry-0] path.series')"
                       ".length") == 1
    finally:
        page.close()


@needs_chromium
def test_charts_draw_hover_and_zoom(browser: Browser, injected_report) -> None:
    path, summary, run = injected_report
    series = step_series(run)
    page = browser.open(path)
    try:
        _assert_clean(page)
        charts = page.js("Array.from(document.querySelectorAll('.chart'))"
                         ".map(c => c.getAttribute('data-chart'))")
        assert charts[:5] == ["steps", "cpu", "iowait", "disk", "memory"]
        # one path per phase with time in it; data wait (12 ms of ~13 ms) has one bar per step
        bars = page.js("Array.from(document.querySelectorAll('[data-chart=steps] path.bars'))"
                       ".map(p => [p.getAttribute('data-phase'), "
                       "(p.getAttribute('d').match(/M/g) || []).length])")
        profiled = summary["steps"].get("profiled", 0)
        assert dict(bars)["data_wait"] == series["count"] == summary["steps"]["count"] - profiled
        assert series["count"] >= 30
        # the screenshot shows it: the red (data wait) area is what the numbers say it is
        box = page.rect("[data-chart=steps] svg")
        lo, hi = map(float, page.js("document.querySelector('[data-chart=steps]')"
                                    ".getAttribute('data-domain')").split(","))
        ymax = float(page.js("document.querySelector('[data-chart=steps]')"
                             ".getAttribute('data-ymax')"))
        wait = np.minimum(np.array(series["phases"]["data_wait"]), ymax)  # bottom of the stack
        expected = wait.sum() / (ymax * (hi - lo))  # each bar is one step wide
        img = page.screenshot({"x": box["pageX"] + 70, "y": box["pageY"] + 10,
                               "width": box["width"] - 84, "height": box["height"] - 40})
        px = np.asarray(img).reshape(-1, 3).astype(int)
        # red, and red under the warm-up band's 14% grey (#8c96a6): a busy machine settles
        # later, and a warm-up band over 8 of 40 steps hid a fifth of the red from a count
        # of pure red alone
        shaded = 0.86 * np.array([214, 39, 40]) + 0.14 * np.array([0x8C, 0x96, 0xA6])
        red = (np.all(np.abs(px - [214, 39, 40]) < 12, axis=1)
               | np.all(np.abs(px - shaded) < 12, axis=1)).mean()
        print(f"data-wait red covers {red:.1%} of the plot area; the data say {expected:.1%}"
              f" (warm-up {summary['steps'].get('warmup')} steps)")
        # The screenshot reads low: each bar's anti-aliased edges are not pure red, a loss in
        # proportion to the red area (25.5% drawn as 23.7% here, 59.9% as 55.9% once on CI).
        # Hence 10% of the value (at least 0.02); a drawing bug - bars of half width, a
        # missing phase - is off by far more.
        assert red == pytest.approx(expected, rel=0.10, abs=0.02) and red > 0.05

        # hover the middle of the plot: the tooltip names the step under the cursor
        box = page.rect("[data-chart=steps] svg")
        x = box["x"] + 70 + (box["width"] - 84) * 0.5
        page.mouse("mouseMoved", x, box["y"] + box["height"] / 2)
        tip = page.js("[document.getElementById('tp-tip').style.display,"
                      " document.getElementById('tp-tip').innerText]")
        assert tip[0] == "block"
        step = int(re.search(r"step (\d+)", tip[1]).group(1))
        i = series["step"].index(step)
        assert abs(step - (lo + hi) / 2) <= 1
        assert f"step time {fmt_time(series['dur'][i])}" in tip[1]
        assert "data wait" in tip[1]
        # the cursor line shows on every aligned chart
        assert page.js("Array.from(document.querySelectorAll('.chart svg > line[stroke-dasharray"
                       "=\"3,3\"]')).filter(l => l.getAttribute('visibility') === 'visible')"
                       ".length") >= 5

        # drag from 25% to 50% of the width: every aligned chart zooms to that range
        x0, x1 = box["x"] + 70 + (box["width"] - 84) * 0.25, x
        y = box["y"] + box["height"] / 2
        page.mouse("mousePressed", x0, y)
        page.mouse("mouseMoved", (x0 + x1) / 2, y)
        page.mouse("mouseMoved", x1, y)
        page.mouse("mouseReleased", x1, y)
        domains = page.js("Array.from(document.querySelectorAll('.chart')).slice(0, 5)"
                          ".map(c => c.getAttribute('data-domain'))")
        assert len(set(domains)) == 1
        zlo, zhi = map(float, domains[0].split(","))
        span = hi - lo
        assert zlo == pytest.approx(lo + 0.25 * span, abs=0.02 * span)
        assert zhi == pytest.approx(lo + 0.5 * span, abs=0.02 * span)
        # double-click resets; the time axis spans the steps and samples, in seconds
        for clicks in (1, 2):
            page.mouse("mousePressed", x, y, clicks=clicks)
            page.mouse("mouseReleased", x, y, clicks=clicks)
        assert page.js("document.querySelector('[data-chart=cpu]').getAttribute('data-domain')"
                       ) == f"{lo:g},{hi:g}"
        page.js("Array.from(document.querySelectorAll('#tp-controls button'))"
                ".find(b => b.textContent.includes('time')).click()")
        tlo, thi = map(float, page.js("document.querySelector('[data-chart=steps]')"
                                      ".getAttribute('data-domain')").split(","))
        assert tlo <= series["t0"][0] and thi >= series["t1"][-1]
        assert thi - tlo < (run.steps["dur_ns"].sum() / 1e9) * 3 + 5
        assert page.problems() == []
    finally:
        page.close()


def test_cli_report_html_writes_the_page(injected_report, tmp_path: Path) -> None:
    _, _, run = injected_report
    out = tmp_path / "sub" / "page.html"
    res = trainprof("report", str(run.path), "--html", str(out), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert f"HTML report written to {out}" in res.stderr
    text = out.read_text()
    assert text.startswith("<!DOCTYPE html>") and "Content-Security-Policy" in text
    # the run's strings arrive escaped, never as markup
    assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in text
    assert "<script>window.__pwned" not in text
    copy = shutil.copytree(run.path, tmp_path / "copy")  # the fixture's page stays as it is
    (copy / "report.html").unlink()
    default = trainprof("report", str(copy), "--html", cwd=tmp_path)
    assert default.returncode == 0 and (copy / "report.html").stat().st_size > 10_000
    (copy / "report.html").unlink()  # --html before the run folder: it is the run folder
    swallowed = trainprof("report", "--html", str(copy), cwd=tmp_path)
    assert swallowed.returncode == 0, swallowed.stderr
    assert f"HTML report written to {copy / 'report.html'}" in swallowed.stderr
    folder = trainprof("report", str(run.path), "--html", str(tmp_path), cwd=tmp_path)
    assert folder.returncode == 2 and folder.stderr.startswith("error: ")
    assert "Traceback" not in folder.stderr


@needs_chromium
def test_long_run_shows_spikes_and_envelopes(browser: Browser, tmp_path: Path) -> None:
    run = _write_run(tmp_path / "run", n=100_000, n_samples=8000, spike=54_321)
    path = render_html(analyse(run), run, tmp_path / "report.html")
    page = browser.open(path)
    try:
        _assert_clean(page)
        # the clipped 500 ms spike is labelled with its time; the 2 s warm-up too
        labels = page.js("Array.from(document.querySelectorAll('[data-chart=steps] text'))"
                         ".map(t => t.textContent).filter(t => t.startsWith('\u25b2'))")
        spike_s = float(run.steps["dur_ns"][54_321]) / 1e9
        assert f"\u25b2 {fmt_time(spike_s)}" in labels
        assert any(t.endswith(" s") and t.startswith("\u25b2 2.") for t in labels)
        # whiskers for the periodic (every 1000th step) slow steps, about one per 1000 steps
        whiskers = page.js("(document.querySelector('[data-chart=steps] path.envelope')"
                           ".getAttribute('d').match(/V/g) || []).length")
        assert 95 <= whiskers <= 110
        # sample charts draw their min/max band, and the GPU charts appear
        assert page.js("document.querySelectorAll('[data-chart=disk] path[fill-opacity]')"
                       ".length") >= 1
        charts = page.js("Array.from(document.querySelectorAll('.chart'))"
                         ".map(c => c.getAttribute('data-chart'))")
        assert {"gpu_util", "gpu_mem"} <= set(charts)
    finally:
        page.close()


@needs_chromium
@pytest.mark.parametrize("workers_rss", [0, 5 * 10**8])
def test_the_memory_chart_shows_workers_only_where_they_ran(browser: Browser, tmp_path: Path,
                                                           workers_rss: int) -> None:
    """Samples with no private reading of the workers: their RSS stands in, labelled as
    counting shared pages - unless no worker ran (RSS 0 throughout): no series, no legend."""
    run = _write_run(tmp_path / "run", n=50, n_samples=40, workers_rss=workers_rss)
    page = browser.open(render_html(analyse(run), run, tmp_path / "report.html"))
    try:
        _assert_clean(page)
        legend = page.js("document.querySelector('[data-chart=memory]').textContent")
        paths = page.js("document.querySelectorAll('[data-chart=memory] path.series').length")
        assert ("DataLoader workers (RSS, shared pages counted in each)" in legend) == bool(
            workers_rss)
        assert paths == (2 if workers_rss else 1)
    finally:
        page.close()


@needs_chromium
@pytest.mark.parametrize(("n_steps", "n_samples", "charts"), [
    (0, 0, []),  # died before anything was recorded
    (0, 50, ["cpu", "iowait", "disk", "memory", "gpu_util", "gpu_mem"]),  # no step finished
    (1, 1, ["steps", "cpu", "iowait", "disk", "memory", "gpu_util", "gpu_mem"]),  # one of each
])
def test_nearly_empty_runs_render(browser: Browser, tmp_path: Path, n_steps: int,
                                  n_samples: int, charts: list[str]) -> None:
    run = _write_run(tmp_path / "run", n=n_steps, n_samples=n_samples)
    page = browser.open(render_html(analyse(run), run, tmp_path / "report.html"))
    try:
        _assert_clean(page)
        assert page.js("Array.from(document.querySelectorAll('.chart'))"
                       ".map(c => c.getAttribute('data-chart'))") == charts
        if not n_steps:
            assert "No training steps were seen" in page.js("document.body.innerText")
        if n_samples == 1:  # a lone sample is drawn as a dot
            assert page.js("document.querySelectorAll('[data-chart=cpu] circle').length") == 3
    finally:
        page.close()


@needs_chromium
def test_compare_page_of_a_slowed_run(browser: Browser, injected_report, tmp_path: Path) -> None:
    """B is the same script with 5x slower samples: the page says what the terminal says."""
    from trainprof.analysis.compare import compare_runs
    from trainprof.report.compare_terminal import verdict_line

    _, _, run_a = injected_report
    write_script(tmp_path, "train.py", INJECTING_SCRIPT)
    res = trainprof("run", "train.py", INJECT, cwd=tmp_path, env={"SLEEP_MS": "15"})
    assert res.returncode == 0, res.stderr
    result = compare_runs(run_a, load_run(res.run_dir))
    page = browser.open(render_compare_html(result, tmp_path / "compare.html"))
    try:
        _assert_clean(page)
        verdict = page.js("document.getElementById('tp-verdict').textContent")
        assert verdict == verdict_line(result).plain
        # 60 ms instead of 12 ms of data wait per step: a clear slowdown on a quiet machine
        print(verdict)
        if result["verdict"] == "slower":
            assert f"{(result['ratio'] - 1) * 100:.1f}%" in verdict
        assert result["explains"] == "data_wait"
        # the explaining phase is the highlighted row, its change signed
        row = page.js("document.querySelector('#tp-phases tr.explains').innerText")
        assert row.startswith("data_wait") and "+" in row
        # the command lines differ (the injecting argument): escaped, shown, never run
        env = page.js("document.getElementById('environment').textContent")
        assert "--tag=<script>window.__pwned=1</script>" in env
        assert page.js("window.__pwned === undefined")
        assert page.js("document.querySelectorAll('.cmpbar .bar span').length") >= 6
    finally:
        page.close()


@needs_chromium
def test_compare_page_renders_whatever_it_gets(browser: Browser, tmp_path: Path) -> None:
    result = {
        "verdict": "slower",
        "ratio": 1.12,
        "ci": [1.08, 1.17],
        "phases": {"data_wait": {"a": 0.010, "b": 0.021, "delta": 0.011},
                   "forward": "not a dict"},
        "environment_diff": [{"key": "num_workers", "a": 4, "b": 0, "rank": 1},
                             {"key": "packages.torch", "a": "2.3", "b": INJECT, "rank": 2}],
        "a": {"name": "before", "steps": {"median_s": 0.1}},
        "b": {"name": INJECT, "steps": {"median_s": 0.112}},
        "something_new": [{"x": INJECT}],
    }
    pages = [render_compare_html(result, tmp_path / "partial.html"),
             render_compare_html({}, tmp_path / "empty.html"),
             render_compare_html({"verdict": {"text": INJECT}, "ci": "?"}, tmp_path / "odd.html")]
    for path in pages:
        page = browser.open(path)
        try:
            _assert_clean(page)
            assert page.js("window.__pwned === undefined")
            if path.name == "partial.html":
                body = page.js("document.body.innerText")
                assert "mean time per step B / A = 1.120× (95% CI 1.080–1.170)" in body
                assert INJECT in page.js("document.getElementById('more').textContent")
                assert INJECT in page.js("document.getElementById('tp-runs').textContent")
            if path.name == "odd.html":
                assert page.js("document.getElementById('tp-verdict').textContent") == INJECT
        finally:
            page.close()


def test_numbers_are_formatted_by_what_their_key_says() -> None:
    from trainprof.report.html import render_generic

    page = render_generic({"median_s": 0.1009, "samples_per_s": 245.3, "ctx_switches_ps": 562.6,
                           "rss_peak_bytes": 344633344, "iowait_pct": 0.83, "delta_s": -0.011,
                           "breakdown": {"data_wait": 0.481}, "self_cpu_us": 1200.5,
                           "count": 12345, "ok": True, "name": INJECT,
                           "breakdown_us": {"Kernel": 1200.5}})
    for shown in ("100.9 ms", "245/s", "563/s", "328.7 MiB", "0.8%", "−11.0 ms", "48.1%",
                  "1.2 ms", "12,345", "<th>Kernel</th><td>1.2 ms", "yes", "&lt;script&gt;"):
        assert shown in page, shown
    assert "<script>" not in page


def test_a_utilization_under_ten_percent_keeps_a_decimal_as_the_terminal_does() -> None:
    """An input-bound step at 0.4% of the peak had read "0%" in the HTML's tile."""
    from trainprof.report.html import _verdict

    compute = {"flops_per_step": 58.6e6, "flops_per_s": 831e6, "utilization": 0.0038,
               "peak_flops": {"cpu float32": 217e9}}
    page = _verdict({"steps": {"count": 60, "median_s": 0.07}, "compute": compute,
                     "findings": []})
    assert '<div class="k">FLOPs utilization</div><div class="v">0.4%</div>' in page, page



def test_a_run_of_one_step_says_to_read_its_finding_not_that_nothing_was_found(
        tmp_path: Path) -> None:
    """One step, so no steady state: the only finding (too few steps) claims no speed-up, and
    the page had said "No bottleneck found" above it, and "Where a steady-state step goes"."""
    run = _write_run(tmp_path / "run", n=1, n_samples=5)
    summary = analyse(run)
    # (the synthetic steps wait on data too: only the finding this page is about is kept)
    summary["findings"] = [f for f in summary["findings"] if f["cause"] == "too_few_steps"]
    assert summary["findings"]
    page = render_html(summary, run, tmp_path / "report.html").read_text()
    assert '<p class="headline">Read this first: 1 step in all: no steady state' in page
    assert "No bottleneck found" not in page
    assert "<h3>Where its step goes</h3>" in page


def test_generic_tables_head_their_columns_without_the_unit_their_values_carry():
    """"median_s 19.2 ms", "rss_peak_bytes 337.2 MiB": a header named a unit the value was
    not shown in."""
    from trainprof.report.html import render_generic

    page = render_generic([{"label": "0", "median_s": 0.0192, "rss_peak_bytes": 353_566_720,
                            "samples_per_s": 1234.5}])
    assert "<th>median</th>" in page and "<th>rss peak</th>" in page
    assert "<th>samples per s</th>" in page  # a rate keeps its words
    assert "19.2 ms" in page and "337.2 MiB" in page
