"""``trainprof trace`` against HolisticTraceAnalysis on the same trace files, in one run.

Each measurement runs in a fresh Python process, so that peak memory is each tool's
own: the process imports its tool first (not timed), records its peak RSS, then times
the analysis and records the peak RSS again. Reported per file: wall time (best of
``--repeat`` runs), peak RSS growth during the analysis, and the ratios. The
temporal breakdowns of both tools are printed side by side, as a check that the
numbers agree.

* trainprof: :func:`trainprof.analysis.trace.analyse_trace` — the full analysis
  (breakdown, GPU summary, HTA's temporal and idle-time breakdowns, operators, kernels,
  launches, memcpy, syncs, findings).
* HTA: ``TraceAnalysis(trace_dir=...)`` (parsing, which is most of its time) followed by
  ``get_temporal_breakdown()`` and ``get_idle_time_breakdown()`` — less work than
  trainprof's full analysis.

HTA lives in its own virtual environment (it pins pandas/plotly/jupyter versions):

    python3 -m venv /tmp/hta-venv && /tmp/hta-venv/bin/pip install HolisticTraceAnalysis==0.5.0
    python benchmarks/trace_analysis.py                      # the shared ResNet-50 traces
    python benchmarks/trace_analysis.py --large 300 FILE...  # plus a generated large trace

``--hta-python`` (or ``TRAINPROF_HTA_PYTHON``) names HTA's interpreter; without one, only
trainprof is measured.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "traces"
DEFAULT_FILES = [
    SHARED / "tb-resnet50" / "nw0-steps5-10.pt.trace.json.gz",
    SHARED / "tb-resnet50" / "nw4-steps5-10.pt.trace.json.gz",
]

TRAINPROF_PROBE = textwrap.dedent("""
    import json, resource, sys, time
    from pathlib import Path
    from trainprof.analysis.trace import analyse_trace
    import trainprof.analysis.trace.analyse, trainprof.diagnosis.trace_rules  # imports first
    path = Path(sys.argv[1])
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    doc = analyse_trace(path)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = next(iter(doc["temporal"].values()), None) or {}
    print(json.dumps({"wall_s": wall, "rss_growth_mb": (peak - base) / 1024,
                      "peak_rss_mb": peak / 1024, "json_mb": doc["format"]["json_bytes"] / 1e6,
                      "idle_pct": t.get("idle_pct"), "compute_pct": t.get("compute_pct"),
                      "non_compute_pct": t.get("non_compute_pct")}))
""")

HTA_PROBE = textwrap.dedent("""
    import json, logging, os, resource, shutil, sys, tempfile, time, warnings
    warnings.filterwarnings("ignore")
    logging.disable(logging.CRITICAL)
    from hta.trace_analysis import TraceAnalysis
    src = sys.argv[1]
    folder = tempfile.mkdtemp()
    os.symlink(src, os.path.join(folder, os.path.basename(src)))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    ta = TraceAnalysis(trace_dir=folder)
    load = time.perf_counter() - t0
    tb = ta.get_temporal_breakdown(visualize=False)
    ta.get_idle_time_breakdown(visualize=False)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    row = tb.to_dict("records")[0]
    shutil.rmtree(folder)
    print(json.dumps({"wall_s": wall, "load_s": load, "rss_growth_mb": (peak - base) / 1024,
                      "peak_rss_mb": peak / 1024, "idle_pct": row["idle_time_pctg"],
                      "compute_pct": row["compute_time_pctg"],
                      "non_compute_pct": row["non_compute_time_pctg"]}))
""")


def _run(python: str, probe: str, path: Path, timeout: float) -> dict[str, Any] | None:
    proc = subprocess.run([python, "-c", probe, str(path)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if proc.returncode != 0:
        print(f"  failed ({python}): {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    best = min(runs, key=lambda r: r["wall_s"])
    best = dict(best)
    best["rss_growth_mb"] = min(r["rss_growth_mb"] for r in runs)
    return best


def write_large_trace(path: Path, n_steps: int, ops_per_step: int = 400) -> None:
    """A generated modern trace (each op launches one kernel), written incrementally."""
    with gzip.open(path, "wt", compresslevel=1) as f:
        f.write('{"schemaVersion": 1, "distributedInfo": {"rank": 0}, "traceEvents": [\n')
        t, ext = 1_000_000.0, 0
        for k in range(n_steps):
            length = ops_per_step * 30.0 + 100
            rows = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{k}",
                     "pid": 1, "tid": 1, "ts": t, "dur": length}]
            s = t + 50
            for _ in range(ops_per_step):
                ext += 1
                rows += [
                    {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1,
                     "ts": s, "dur": 25.5, "args": {"External id": ext, "Ev Idx": ext,
                                                    "Input Dims": [[256, 1024], [256, 1024]]}},
                    {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1,
                     "tid": 1, "ts": s + 5, "dur": 6.25,
                     "args": {"External id": ext, "cbid": 211, "correlation": ext}},
                    {"ph": "X", "cat": "kernel", "pid": 0, "tid": 7, "ts": s + 12, "dur": 14.0,
                     "name": "void at::native::vectorized_elementwise_kernel<4, "
                             "at::native::CUDAFunctor_add<float>>(int, at::native::Array)",
                     "args": {"External id": ext, "device": 0, "stream": 7, "correlation": ext,
                              "blocks per SM": 4.5, "est. achieved occupancy %": 100}},
                ]
                s += 30
            f.write(("" if k == 0 else ",\n") + ",\n".join(json.dumps(r) for r in rows))
            t += length + 10
        f.write('\n], "traceName": "large"}\n')


def compare_parsers(path: Path, repeat: int) -> list[tuple[str, float]]:
    """Best-of-``repeat`` wall time of gunzip and of JSON parsers on one trace file."""
    import json as std_json
    import time
    import zlib

    import msgspec
    import orjson

    from trainprof.analysis.trace.loader import LoadInfo, iter_event_chunks

    raw = path.read_bytes()
    text = zlib.decompress(raw, 31) if raw[:2] == b"\x1f\x8b" else raw

    def best(fn: Any) -> float:
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    rows = [("gunzip: zlib", best(lambda: zlib.decompress(raw, 31)))]
    try:
        from isal import isal_zlib

        rows.append(("gunzip: isal (ISA-L)", best(lambda: isal_zlib.decompress(raw, 31))))
    except ImportError:
        pass
    rows += [
        ("parse: json.loads (dicts)", best(lambda: std_json.loads(text))),
        ("parse: orjson.loads (dicts)", best(lambda: orjson.loads(text))),
        ("parse: msgspec.json.decode (dicts)", best(lambda: msgspec.json.decode(text))),
        ("read+parse: trainprof loader (msgspec structs, streamed)",
         best(lambda: sum(len(c) for c in iter_event_chunks(path, LoadInfo(path))))),
    ]
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", type=Path, help="trace files (default: shared ResNet-50)")
    ap.add_argument("--repeat", type=int, default=5, help="runs per tool and file (best taken)")
    ap.add_argument("--hta-python", default=os.environ.get("TRAINPROF_HTA_PYTHON",
                                                         "/tmp/hta-venv/bin/python"))
    ap.add_argument("--large", type=int, default=0, metavar="STEPS",
                    help="also a generated trace of STEPS steps (~0.45 MB of JSON per step)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--parsers", action="store_true",
                    help="also time gunzip (zlib, isal) and JSON parsers on the first file")
    args = ap.parse_args()

    files = args.files or [p for p in DEFAULT_FILES if p.exists()]
    tmp = None
    if args.large:
        tmp = tempfile.TemporaryDirectory()
        large = Path(tmp.name) / f"generated-{args.large}-steps.json.gz"
        write_large_trace(large, args.large)
        files.append(large)
    if not files:
        print("no trace files (shared/traces missing?)", file=sys.stderr)
        return 2
    hta = args.hta_python if Path(args.hta_python).exists() else None
    if hta is None:
        print(f"HTA interpreter {args.hta_python} not found: measuring trainprof only",
              file=sys.stderr)

    results = []
    for path in files:
        tp = [_run(sys.executable, TRAINPROF_PROBE, path, args.timeout)
              for _ in range(args.repeat)]
        ht = [_run(hta, HTA_PROBE, path, args.timeout) for _ in range(args.repeat)] if hta else []
        tp_ok = [r for r in tp if r]
        ht_ok = [r for r in ht if r]
        row: dict[str, Any] = {"file": path.name}
        if tp_ok:
            row["trainprof"] = _best(tp_ok)
        if ht_ok:
            row["hta"] = _best(ht_ok)
        if tp_ok and ht_ok:
            row["speedup"] = row["hta"]["wall_s"] / row["trainprof"]["wall_s"]
            row["memory_ratio"] = row["hta"]["rss_growth_mb"] / max(
                row["trainprof"]["rss_growth_mb"], 1e-9)
        results.append(row)

    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"{'file':34s} {'JSON':>7s} {'trainprof':>10s} {'HTA':>9s} {'speed-up':>8s} "
          f"{'RSS +MB tp':>10s} {'HTA':>7s} {'x JSON':>7s}  idle/compute/non-compute % "
          "(trainprof | HTA)")
    for r in results:
        tp, ht = r.get("trainprof"), r.get("hta")
        if not tp:
            print(f"{r['file'][:34]:34s} trainprof failed")
            continue
        json_mb = tp["json_mb"]
        line = (f"{r['file'][:34]:34s} {json_mb:6.1f}M {tp['wall_s']:9.3f}s "
                + (f"{ht['wall_s']:8.2f}s {r['speedup']:7.1f}x " if ht else f"{'—':>9s} {'':>8s} ")
                + f"{tp['rss_growth_mb']:10.0f} "
                + (f"{ht['rss_growth_mb']:7.0f} " if ht else f"{'—':>7s} ")
                + f"{tp['rss_growth_mb'] / json_mb:6.2f}x  "
                + f"{tp['idle_pct']:.2f}/{tp['compute_pct']:.2f}/{tp['non_compute_pct']:.2f}"
                + (f" | {ht['idle_pct']:.2f}/{ht['compute_pct']:.2f}/{ht['non_compute_pct']:.2f}"
                   if ht else ""))
        print(line)
    if args.parsers:
        print(f"\nparsers on {files[0].name} (best of {args.repeat}, wall):")
        for label, secs in compare_parsers(files[0], args.repeat):
            print(f"  {label:58s} {secs * 1000:8.1f} ms")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
