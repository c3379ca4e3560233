"""The HTML report: one self-contained file that shows a Run, verdict first.

What it shows, top to bottom: the verdict (top findings with evidence, estimated gain, fix and
snippet, how to verify), the step-time chart (stacked phases per step, warm-up shaded, steady
median marked), utilization over time on the same x axis (CPU of the process, the DataLoader
workers and the whole machine, iowait, disk reads, memory, GPU), the DataLoader configuration,
and, when the run has them, the deep-window trace analysis, the Python call graph and profiles,
training telemetry, any other analysis in the summary, and the environment fingerprint. Every
section is driven by the data: a summary key or file that is absent draws nothing, so the work
of other modules shows up as soon as it lands in the summary.

Design choices, and why:

* **Hand-drawn SVG, no chart library.** The charts are a stacked bar chart and line charts with
  a shared x axis, drag-to-zoom, a linked hover cursor and a step/time toggle. That is ~640
  lines of plain, unminified JavaScript (:mod:`trainprof.report.html_assets`, ~27 KB), about
  the size of the smallest library that does it minified (uPlot ~50 KB; Chart.js ~200 KB,
  Plotly ~3.5 MB), with no vendored build to keep up to date or licence to ship, nothing to
  configure as package data, and full control over how text enters the page.
  SVG rather than canvas because the charts stay crisp when zoomed or printed, and because the
  tests can count what was drawn. Drawing is fast because each phase is one ``<path>`` (not one
  element per bar) and series are downsampled to at most 5000 points (see
  :mod:`trainprof.analysis.series`: bucket means with min/max envelopes, so a spike is never
  averaged away), which also keeps a million-step report far below 5 MB.
* **Nothing is computed here.** Numbers come from the summary (``summarize_run`` +
  diagnosis) and the plotted series from :mod:`trainprof.analysis.series` (DESIGN.md: the report
  never computes a metric); this module only formats and lays out.
* **Safe by construction.** Every string from the run (script arguments, dataset class names,
  op and function names, finding text) is HTML-escaped; the chart data is embedded as JSON in a
  ``<script type="application/json">`` block with ``<``, ``>``, ``&``, U+2028 and U+2029 escaped
  (:func:`json_for_script`), so no string can close the block or start a comment, and the script
  writes text only with ``textContent``. A Content-Security-Policy allows the one inline script
  by its SHA-256 hash and forbids every network request (``default-src 'none'``; images only
  from ``data:`` URIs): even an escaping bug could neither run injected code nor phone home. The
  call graph (an SVG made by graphviz from function names) is embedded as an
  ``<img src="data:image/svg+xml;base64,...">``, and an SVG loaded as an image never runs
  scripts.
"""

from __future__ import annotations

import base64
import hashlib
import html
import math
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from trainprof.analysis.compare import per_unit
from trainprof.analysis.series import MAX_POINTS, sample_series, step_series, telemetry_series
from trainprof.errors import UsageError
from trainprof.experiments.verify import MIN_CRASH_STEPS, crashed_after
from trainprof.report.command_lines import verify_parts
from trainprof.report.html_assets import CSS, JS
from trainprof.report.impact import impact_text
from trainprof.report.terminal import (
    attention_text,
    compiles_text,
    compute_text,
    crash_text,
    first_steps_row,
    fmt_bytes,
    fmt_pct,
    fmt_time,
    op_time_text,
    regions_in_other,
    utilization_text,
    worker_rows,
)
from trainprof.store import Run

__all__ = ["json_for_script", "render_compare_html", "render_html"]

#: (summary key, label, colour) of the phases, in stacking order (bottom first).
PHASES: tuple[tuple[str, str, str], ...] = (
    ("data_wait", "data wait", "#d62728"),
    ("forward", "forward", "#2ca02c"),
    ("backward", "backward", "#1f77b4"),
    ("optimizer", "optimizer", "#9467bd"),
    ("gc", "GC", "#e6b000"),
    ("other", "other", "#9aa3b0"),
)

#: A call graph larger than this is linked as a note rather than inlined (keeps the report small).
CALLGRAPH_MAX_BYTES = 3 * 1024 * 1024

#: Generic tables show at most this many rows (the rest is counted in a note).
MAX_ROWS = 100
MAX_COLUMNS = 16
MAX_DEPTH = 4

#: Summary keys with a section of their own; any other key is shown under "More analysis".
_KNOWN_KEYS = frozenset(
    {
        "run_dir", "name", "status", "exit_code", "command", "started_at", "ended_at",
        "duration_s", "steps", "breakdown", "breakdown_detail", "samples_per_s", "steps_per_s",
        "syncs", "gc", "regions", "dataloaders", "system", "device", "environment", "missing",
        "notes", "findings", "recorded_status", "deep", "python_profile", "line_profile",
        "telemetry", "workers", "ranks", "rank_spread", "samples_per_s_all_ranks", "main_rank",
        "ddp", "batch_handoff", "padding", "compute",
    }
)


def esc(value: Any) -> str:
    """HTML-escape any value's text (quotes included, so it is safe in attributes too)."""
    return html.escape(str(value), quote=True)


def json_for_script(data: Any) -> str:
    """JSON that can sit inside ``<script type="application/json">`` whatever its strings hold.

    ``<`` and ``>`` (so neither ``</script>`` nor ``<!--`` can appear), ``&``, and the line
    separators U+2028/U+2029 (not allowed raw in older JavaScript parsers) become ``\\uXXXX``
    escapes, which ``JSON.parse`` turns back into the same characters. Outside strings JSON
    never contains these characters, so the replacement only ever touches string contents.
    NaN and infinities become ``null``.
    """
    text = orjson.dumps(
        data,
        option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS,
        default=str,
    ).decode()
    return (
        text.replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )


# -- formatting ------------------------------------------------------------------------------


def _fmt_number(key: str, value: float | int) -> str:
    """A number, formatted by what its key says it is (``_s``, ``_bytes``, ``_pct``, ...)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and not math.isfinite(value):
        return "—"
    k = key.lower()
    if k.endswith(("_per_s", "_ps")):  # a rate, not a time
        return f"{value:,.1f}/s" if abs(value) < 100 else f"{value:,.0f}/s"
    if k.endswith(("_s", "_sec", "_seconds")):
        return ("−" if value < 0 else "") + fmt_time(abs(float(value)))
    if k.endswith("_ms"):
        return fmt_time(float(value) / 1e3)
    if k.endswith("_us"):
        return ("−" if value < 0 else "") + fmt_time(abs(float(value)) / 1e6)
    if k.endswith("_ns"):
        return fmt_time(float(value) / 1e9)
    if k.endswith(("_bytes", "bytes")):
        return fmt_bytes(float(value))
    if k.endswith("_bps"):
        return fmt_bytes(float(value)) + "/s"
    if k.endswith(("_pct", "pct", "percent")):
        return f"{float(value):.1f}%"
    if k.endswith(("share", "_frac", "_fraction", "gain")) and isinstance(value, float):
        return f"{value * 100:.1f}%"
    if isinstance(value, int):
        return str(value) if k in ("step", "index", "pid", "line", "lineno") else f"{value:,}"
    if value == 0:
        return "0"
    if abs(value) >= 1e6 or abs(value) < 1e-3:
        return f"{value:.3g}"
    return f"{value:.4g}"


_UNIT_SUFFIXES = ("_us", "_ms", "_ns", "_s", "_bytes", "_pct")


#: Key endings whose unit :func:`_fmt_number` writes into the value ("19.2 ms", "337 MiB").
_SAID_UNITS = ("_seconds", "_sec", "_s", "_ms", "_us", "_ns", "_bytes", "_bps", "_pct")


def _label(key: str) -> str:
    """A column or row header for ``key``: its words, without a unit suffix the value
    carries itself ("median_s" over "19.2 ms" read as seconds shown in ms; "rss_peak_bytes"
    over "337.2 MiB")."""
    k = str(key)
    lower = k.lower()
    if not lower.endswith(("_per_s", "_ps")):
        for unit in _SAID_UNITS:
            if lower.endswith(unit) and len(k) > len(unit):
                k = k[: -len(unit)]
                break
    return k.replace("_", " ")


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def _cell(key: str, value: Any, depth: int = 0) -> str:
    """One value as HTML: numbers formatted, strings escaped, containers rendered generically."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int | float):
        return esc(_fmt_number(key, value))
    if isinstance(value, str):
        if "\n" in value:
            return f"<pre>{esc(value)}</pre>"
        return esc(value)
    return render_generic(value, key, depth + 1)


def _table(rows: list[dict[str, Any]], depth: int = 0, mono: Iterable[str] = ()) -> str:
    """A list of dicts as a table: columns in order of first appearance, rows capped."""
    columns: list[str] = []
    for row in rows:
        for key in row:
            if key not in columns:
                columns.append(str(key))
    columns = columns[:MAX_COLUMNS]
    mono_cols = {c for c in columns if c.lower() in _MONO_COLUMNS} | set(mono)
    head = "".join(f"<th>{esc(_label(c))}</th>" for c in columns)
    body = []
    for row in rows[:MAX_ROWS]:
        cells = []
        for c in columns:
            value = row.get(c)
            cls = []
            if isinstance(value, int | float) and not isinstance(value, bool):
                cls.append("num")
            if c in mono_cols:
                cls.append("mono")
            attr = f' class="{" ".join(cls)}"' if cls else ""
            cells.append(f"<td{attr}>{_cell(c, value, depth)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    note = (
        f'<p class="note">showing the first {MAX_ROWS} of {len(rows)} rows</p>'
        if len(rows) > MAX_ROWS
        else ""
    )
    return (
        f'<div class="scroll"><table><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table></div>{note}"
    )


_MONO_COLUMNS = frozenset(
    {"name", "function", "func", "file", "filename", "code", "source", "line_text", "op",
     "kernel", "location", "module", "path", "contents"}
)


def render_generic(value: Any, key: str = "", depth: int = 0) -> str:
    """Any JSON-like value as HTML: dicts as key/value tables, lists of dicts as tables.

    Used for the parts of the summary whose shape belongs to another module (trace analysis,
    Python profiles, compare results), so a new field shows up without a change here.
    """
    if _is_scalar(value):
        return _cell(key, value, depth)
    if depth > MAX_DEPTH:
        text = orjson.dumps(value, default=str).decode()
        return f"<code>{esc(text[:500])}{'…' if len(text) > 500 else ''}</code>"
    if isinstance(value, dict):
        if not value:
            return "—"
        # The values of a "breakdown" or "shares" mapping are fractions of a whole; those of
        # a mapping named with a unit ("breakdown_us", "per_rank_bytes") are in that unit.
        lower = key.lower()
        if lower.endswith(("breakdown", "breakdown_detail", "shares")):
            suffix = "_share"
        else:
            suffix = next((u for u in _UNIT_SUFFIXES if lower.endswith(u)), "")
        rows = "".join(
            f"<tr><th>{esc(_label(k))}</th><td>{_cell(f'{k}{suffix}', v, depth)}</td></tr>"
            for k, v in list(value.items())[:MAX_ROWS]
        )
        more = (
            f'<p class="note">showing {MAX_ROWS} of {len(value)} entries</p>'
            if len(value) > MAX_ROWS
            else ""
        )
        return f'<table class="kv"><tbody>{rows}</tbody></table>{more}'
    if isinstance(value, list | tuple):
        items = list(value)
        if not items:
            return "—"
        if all(isinstance(v, dict) for v in items):
            return _table(items, depth)
        if all(_is_scalar(v) for v in items):
            shown = ", ".join(_cell(key, v, depth) for v in items[:MAX_ROWS])
            return shown + (f" … ({len(items)} in all)" if len(items) > MAX_ROWS else "")
        lis = "".join(f"<li>{render_generic(v, key, depth + 1)}</li>" for v in items[:MAX_ROWS])
        return f"<ul>{lis}</ul>"
    return esc(value)


# -- sections ----------------------------------------------------------------------------------


def _section(anchor: str, title: str, body: str) -> tuple[str, str, str]:
    return anchor, title, f'<section id="{anchor}"><h2>{esc(title)}</h2>{body}</section>'


def _command_text(command: Any) -> str:
    if isinstance(command, list):
        return " ".join(str(c) for c in command)
    return str(command or "")


def _header(s: dict[str, Any]) -> str:
    status = str(s.get("status") or "")
    parts = []
    if s.get("exit_code") is not None:
        parts.append(f"exit {s['exit_code']}")
    if s.get("duration_s") is not None:
        parts.append(f"{s['duration_s']:.1f} s wall")
    if s.get("started_at"):
        parts.append(f"started {s['started_at']}")
    sub = " · ".join(esc(p) for p in parts)
    return (
        '<header class="top"><div class="inner">'
        f"<h1>trainprof · {esc(s.get('name') or 'run')}"
        f'<span class="status {esc(status)}">{esc(status)}</span></h1>'
        f'<div class="sub">{sub}</div>'
        f'<div class="sub mono" id="tp-command">{esc(_command_text(s.get("command")))}</div>'
        "</div></header>"
    )


def _breakdown_bar(breakdown: dict[str, float] | None, regions: str = "") -> str:
    """The phases' bar and legend; ``regions``: the named regions' part of "other"
    (:func:`~trainprof.report.terminal.regions_in_other`), said beside it."""
    if not breakdown:
        return ""
    spans, legend = [], []
    for key, label, color in PHASES:
        share = float(breakdown.get(key) or 0.0)
        part = f" ({regions})" if key == "other" and regions else ""
        if share > 0:
            spans.append(
                f'<span style="width:{share * 100:.3f}%;background:{color}" '
                f'title="{esc(label)} {share * 100:.1f}%{esc(part)}"></span>'
            )
        legend.append(
            f'<span><i style="background:{color}"></i>{esc(label)} {share * 100:.1f}%'
            f'{esc(part)}</span>'
        )
    return (
        '<div class="bar" id="tp-breakdown">' + "".join(spans) + "</div>"
        '<div class="legend">' + "".join(legend) + "</div>"
    )


def _tile(label: str, value: str, detail: str = "") -> str:
    d = f'<div class="d">{esc(detail)}</div>' if detail else ""
    return (
        f'<div class="tile"><div class="k">{esc(label)}</div>'
        f'<div class="v">{esc(value)}</div>{d}</div>'
    )


def _finding(i: int, f: dict[str, Any], run_dir: str | None = None,
             crashed_after: int | None = None) -> str:
    """One finding's card; ``crashed_after``: the steps a crashed run made, said in its
    "Measure it" line as the terminal's verify hint says it (its trials stop before)."""
    severity = str(f.get("severity") or "")
    gain = float(f.get("estimated_gain") or 0.0)
    impact = esc(impact_text(f)) + (
        f'<span class="gain"><span style="width:{min(100.0, gain * 100):.1f}%"></span></span>'
        if gain > 0 else "")
    kind = esc(f.get("category") or "") + (f" / {esc(f['cause'])}" if f.get("cause") else "")
    parts = [
        f'<article class="finding {esc(severity)}" id="finding-{i}">',
        f'<h3><span class="sev {esc(severity)}">{esc(severity)}</span>{i}. '
        f"{esc(f.get('title') or '')}</h3>",
        f'<p class="meta">{kind} · {impact}</p>',
    ]
    fix = f.get("fix") or {}
    if isinstance(fix, dict):
        if fix.get("text"):
            parts.append(f"<p><b>Fix.</b> {esc(fix['text'])}</p>")
        if fix.get("snippet"):
            parts.append(f"<pre><code>{esc(fix['snippet'])}</code></pre>")
    elif fix:
        parts.append(f"<p><b>Fix.</b> {esc(fix)}</p>")
    if f.get("verify"):
        # prose as prose, each command in a block of its own, unwrapped (command_lines.py)
        verify = "".join(f'<code class="cmd">{esc(part)}</code>' if is_command else
                         f" {esc(part)} " for part, is_command in verify_parts(f))
        parts.append(f"<p><b>Verify.</b> {verify.strip()}</p>")
        if run_dir and "trainprof tune --knob" in str(f["verify"]):
            # the same measurement on the run's own command, set against the estimate
            crash = ("" if crashed_after is None else f"; the run crashed after "
                     f"{crashed_after} steps: its trials stop before that")
            parts.append(f"<p><b>Measure it</b> (its knob on this script, against its "
                         f'estimate{esc(crash)}): <code class="cmd">trainprof verify '
                         f"{esc(run_dir)} --finding {i}</code></p>")
    if f.get("evidence"):
        parts.append(
            "<details><summary>Evidence: the numbers that fired it</summary>"
            + render_generic(f["evidence"])
            + "</details>"
        )
    parts.append("</article>")
    return "".join(parts)


def _verdict(s: dict[str, Any]) -> str:
    findings = [f for f in s.get("findings") or [] if isinstance(f, dict)]
    steps = s.get("steps") or {}
    gainers = [f for f in findings if (f.get("estimated_gain") or 0) > 0]
    if not steps.get("count") and steps.get("recorded"):
        head = (f'<p class="headline">No step is readable: the run recorded '
                f"{int(steps['recorded']):,} steps, but its steps.bin holds no whole step "
                "record (see the notes).</p>")
    elif not steps.get("count"):
        head = (
            '<p class="headline">No training steps were seen: no optimizer step or backward() '
            "ran (use <code>prof.step()</code> to mark steps by hand).</p>"
        )
    elif gainers:
        top = gainers[0]
        head = (
            f'<p class="headline">Main bottleneck: {esc(top.get("title") or "")}</p>'
            f'<p class="meta">Fix it first: it could save up to '
            f"{float(top['estimated_gain']) * 100:.0f}% of step time. "
            f"{len(findings)} finding{'s' if len(findings) != 1 else ''} below, highest "
            "estimated gain first.</p>"
        )
    elif (serious := [f for f in findings if f.get("severity") in ("high", "medium")]):
        # no speed-up to claim, but something to read first: too few steps to judge, data
        # every worker duplicates (a finding without a gain is no "no bottleneck")
        head = (
            f'<p class="headline">Read this first: {esc(serious[0].get("title") or "")}</p>'
            f'<p class="meta">No finding claims a speed-up; {len(findings)} '
            f"finding{'s' if len(findings) != 1 else ''} below.</p>"
        )
    else:
        head = (
            '<p class="headline ok">No bottleneck found: no rule fired above its reporting '
            "threshold.</p>"
        )
    tiles = []
    if steps.get("count"):
        tiles.append(
            _tile(
                "median step time",
                fmt_time(steps.get("median_s")),
                f"p10 {fmt_time(steps.get('p10_s'))} · p90 {fmt_time(steps.get('p90_s'))}",
            )
        )
        thr = []
        if s.get("samples_per_s"):
            thr.append(f"{s['samples_per_s']:,.0f} samples/s")
        if s.get("steps_per_s"):
            thr.append(f"{s['steps_per_s']:,.1f} steps/s")
        if thr and s.get("samples_other_loaders"):
            # an evaluation loader iterated inside the loop: not trained on (analysis/steps.py)
            thr.append(f"training loader's; {s['samples_other_loaders']:,} samples of other "
                       "loaders left out")
        if thr:
            tiles.append(_tile("throughput", thr[0], " · ".join(thr[1:])))
        compute_row = compute_text(s.get("compute"))
        compute = s.get("compute") or {}
        if compute_row and (compute.get("utilization") is not None
                            or compute.get("datasheet_utilization") is not None):
            value = compute.get("utilization")
            if value is None:
                value = compute["datasheet_utilization"]
            # as the terminal writes it: 0.4%, not 0%
            tiles.append(_tile("FLOPs utilization", utilization_text(value), compute_row))
        attention = s.get("attention") or {}
        if attention.get("share") is not None:
            tiles.append(_tile("attention op by op", f"{attention['share'] * 100:.0f}%",
                               attention_text(attention) or ""))
        # of forward+backward, as the row beside it: the share of the ops' own time read
        # 48% for 350 µs of a DDP run's 19.4 ms
        fusable = ((s.get("op_time") or {}).get("share_of_forward_backward") or {}).get(
            "fusable")
        if fusable is not None:
            tiles.append(_tile("fusable ops, share of forward+backward",
                               utilization_text(fusable), op_time_text(s.get("op_time")) or ""))
        compiles = s.get("compiles") or {}
        if compiles.get("count"):
            tiles.append(_tile("torch.compile recompilations",
                               f"{int(compiles.get('after_warmup') or 0)}",
                               compiles_text(compiles) or ""))
        warm = f"warm-up {steps.get('warmup')}, steady {steps.get('steady_count')}"
        if steps.get("warmup_median_s") is not None:
            warm += f" (warm-up median {fmt_time(steps['warmup_median_s'])})"
        if steps.get("profiled"):
            warm += f", {steps['profiled']} profiled (left out)"
        if steps.get("skipped"):
            warm += f", {steps['skipped']} skipped by GradScaler (inf/NaN gradients)"
        tiles.append(_tile("steps", f"{steps['count']:,}", warm))
    system = s.get("system") or {}
    if system.get("n_samples"):
        tiles.append(
            _tile(
                "CPU of the training process",
                f"{fmt_pct(system.get('proc_cpu_pct'))} of a core",
                f"workers {fmt_pct(system.get('workers_cpu_pct'))} of a core · whole system "
                f"{fmt_pct(system.get('sys_cpu_pct'))} of all cores · iowait "
                f"{fmt_pct(system.get('iowait_pct'))}",
            )
        )
    crash = crash_text(s.get("crash"))
    if crash:  # an exception or a fatal signal: what and where, before anything measured
        how = "The script raised " if (s.get("crash") or {}).get("exception") else \
            "The process died of "
        head = (f'<div class="crash" id="tp-crash"><p class="headline">{how}'
                f'{esc(crash.splitlines()[0])}</p>'
                + (f'<pre class="mono">{esc(chr(10).join(crash.splitlines()[1:]))}</pre>'
                   if len(crash.splitlines()) > 1 else "")
                + "</div>" + head)
    body = head + f'<div class="tiles">{"".join(tiles)}</div>'
    # Where a run without a steady state (or a long warm-up) spent its time: with no
    # steady steps there is no "other" to break down, and this row is the only answer
    # the stacks give; the terminal's row, word for word.
    first = first_steps_row(s)
    if first:
        body += (f'<p class="first-steps" id="tp-first-steps"><b>{esc(first[0])}:</b> '
                 f'<span class="mono">{esc(first[1])}</span></p>')
    if s.get("breakdown"):
        steady = int(steps.get("steady_count") or 0)
        where = ("Where a steady-state step goes" if steady > 2
                 else "Where its step goes" if int(steps.get("count") or 0) == 1
                 else "Where its steps go (no steady state)")
        body += (f"<h3>{where}</h3>"
                 + _breakdown_bar(s["breakdown"], regions_in_other(s)))
    # (a launch's command is one rank's: trainprof verify refuses it, as it does a run that
    # crashed too soon for trials that stop before the crash)
    done = crashed_after(s)
    run_dir = (None if s.get("ranks") or (done is not None and done < MIN_CRASH_STEPS)
               else s.get("run_dir"))
    body += "".join(_finding(i, f, run_dir, done) for i, f in enumerate(findings, 1))
    return body


def _steps_section(s: dict[str, Any], series: dict[str, Any]) -> str:
    if not series.get("count"):
        return ""
    k = series.get("bucket", 1)
    note = (
        "Each bar is one step; its height is the step time, split into phases."
        if k == 1
        else f"{series['count']:,} steps are drawn as buckets of {k} consecutive steps (mean "
        "per bucket; a black whisker reaches up to the slowest step of its bucket, so no spike "
        "is averaged away)."
    )
    extra = []
    if series.get("warmup"):
        w = series["warmup"]
        extra.append(f"The shaded start is warm-up ({w} step{'s' if w != 1 else ''}), not "
                     "counted in the statistics.")
    if series.get("profiled"):
        extra.append("Gaps marked \u201cprofiled\u201d are steps recorded while a heavy tool "
                     "(torch.profiler, cProfile) ran: left out of the statistics.")
    extra.append("The dashed line is the steady-state median. Steps taller than the scale "
                 "(usually warm-up) are clipped and labelled with their time.")
    return (
        '<div class="controls" id="tp-controls"></div>'
        '<div id="tp-steps-chart"></div>'
        f'<p class="note">{esc(note)} {esc(" ".join(extra))}</p>'
        "<noscript><p>The charts need JavaScript.</p></noscript>"
    )


def _util_section(s: dict[str, Any], series: dict[str, Any]) -> str:
    if not series.get("series"):
        return ""
    k = series.get("bucket", 1)
    note = (
        "Sampled by the system sampler on the step clock, so these charts share the step "
        "chart's x axis, zoom and cursor. CPU is in cores busy (1 = one core fully used)."
    )
    if k > 1:
        note += (
            f" {series['count']:,} samples are drawn as buckets of {k} (mean line; the shaded "
            "band spans the bucket's minimum and maximum)."
        )
    return f'<div id="tp-util-charts"></div><p class="note">{esc(note)}</p>'


def _dataloader_section(s: dict[str, Any]) -> str:
    loaders = [d for d in s.get("dataloaders") or [] if isinstance(d, dict)]
    system = s.get("system") or {}
    parts = []
    if loaders:
        fields: list[str] = []
        for d in loaders:
            for key in d:
                if key not in fields and key != "kind":
                    fields.append(key)
        head = "".join(
            f"<th>DataLoader #{esc(d.get('index', i))}</th>" for i, d in enumerate(loaders)
        )
        rows = "".join(
            f"<tr><th>{esc(f)}</th>"
            + "".join(f'<td class="mono">{_cell(f, d.get(f))}</td>' for d in loaders)
            + "</tr>"
            for f in fields
        )
        parts.append(
            f'<div class="scroll"><table class="kv" id="tp-dataloaders"><thead><tr><th></th>'
            f"{head}</tr></thead><tbody>{rows}</tbody></table></div>"
        )
    if system.get("n_samples"):
        stats = {
            "workers_seen": system.get("n_workers_seen"),
            "workers_cpu_pct (mean, 100% = one core)": system.get("workers_cpu_pct"),
            "main_process_cpu_pct (mean)": system.get("proc_cpu_pct"),
            "iowait_pct (mean)": system.get("iowait_pct"),
            "disk_read_bps (mean)": system.get("disk_read_bps"),
            "rss_peak_bytes": system.get("rss_peak_bytes"),
            "samples": system.get("n_samples"),
        }
        rows = "".join(
            f"<tr><th>{esc(k)}</th><td>{_cell(k.split(' ')[0], v)}</td></tr>"
            for k, v in stats.items()
        )
        parts.append(
            "<h3>Workers and input (steady-state means)</h3>"
            f'<table class="kv"><tbody>{rows}</tbody></table>'
        )
    workers = s.get("workers")
    if workers:
        # the terminal's rows (what loading cost, per loader, in words), then every number
        rows = "".join(f"<tr><th>{esc(label)}</th><td>{esc(line)}</td></tr>"
                       for label, line in worker_rows(workers, s.get("dataloaders"),
                                                       s.get("batch_handoff")))
        parts.append("<h3>Worker analysis</h3>"
                     + (f'<table class="kv" id="tp-workers"><tbody>{rows}</tbody></table>'
                        if rows else "")
                     + "<details><summary>Every number the workers recorded</summary>"
                     + render_generic(workers) + "</details>")
    handoff = s.get("batch_handoff")
    if handoff:  # receiving the workers' batches in the training process (capture/handoff.py)
        parts.append("<h3>Hand-over of the workers' batches</h3>" + render_generic(
            {k: v for k, v in handoff.items() if k != "hist"}))
    for entry in s.get("padding") or []:  # the batches' padded sequences (capture/padding.py)
        parts.append(f"<h3>Padding of loader #{esc(entry.get('loader_index'))}'s sequences</h3>"
                     + render_generic(entry))
    return "".join(parts)


def _gpu_section(s: dict[str, Any]) -> str:
    parts = []
    device = s.get("device")
    if isinstance(device, dict):
        parts.append("<h3>Device time per step (CUDA events)</h3>" + render_generic(device))
    gpus = (s.get("system") or {}).get("gpu") or []
    if gpus:
        parts.append("<h3>GPU utilization (sampled, steady state)</h3>" + render_generic(gpus))
    return "".join(parts)


#: Colours of the step-time categories of the PyTorch-profiler TensorBoard plugin.
_TRACE_CATEGORIES: tuple[tuple[str, str], ...] = (
    ("Kernel", "#1f77b4"),
    ("Memcpy", "#ff7f0e"),
    ("Memset", "#8c564b"),
    ("Communication", "#9467bd"),
    ("Runtime", "#e377c2"),
    ("DataLoader", "#d62728"),
    ("CpuOp", "#2ca02c"),
    ("Other", "#9aa3b0"),
)

#: Keys of the trace analysis shown first, in this order; bookkeeping keys are not shown.
_DEEP_FIRST = ("step_time_us", "breakdown_us", "gpu", "temporal", "dataloader", "operators",
               "kernels", "flops", "launch", "memcpy", "sync", "communication")
_DEEP_HIDDEN = frozenset({"kind", "schema_version", "findings", "breakdown_pct", "format",
                          "source"})
#: Rows shown of the long tables (operators, kernels).
_DEEP_ROWS = 20


def _ranks_section(s: dict[str, Any]) -> str:
    """A line per rank of a merged run (analysis.ranks), then how far apart they are."""
    ranks = s.get("ranks") or []
    ddp = any(r.get("ddp_exposed_comm_s") is not None for r in ranks)
    rows = [
        {
            "rank": r.get("label"),
            "status": r.get("status"),
            "exit_code": r.get("exit_code"),
            "steps": r.get("steps"),
            "median_s": r.get("median_s"),
            "p90_s": r.get("p90_s"),
            "data_wait_share": r.get("data_wait"),
            "data_wait_s": r.get("data_wait_s"),
            "samples_per_s": r.get("samples_per_s"),
            **({"ddp_exposed_comm_s": r.get("ddp_exposed_comm_s")} if ddp else {}),
            "run_dir": r.get("run_dir"),
        }
        for r in ranks
    ]
    main = s.get("main_rank")
    note = (f'<p class="note">The figures in the other sections are rank {esc(main)}\'s; '
            "each rank's own report: <code>trainprof report RUN/ranks/&lt;k&gt; --html</code>."
            "</p>" if main is not None else "")
    spread = s.get("rank_spread")
    extra = render_generic({"rank_spread": spread}) if spread else ""
    return _table(rows, mono=("run_dir",)) + note + extra


def _ddp_section(s: dict[str, Any]) -> str:
    """Each DistributedDataParallel model's gradient all-reduce as DDP's reducer timed it
    (``analysis.ddp``): how much of it the backward pass hides and how much the step waits
    for, with the settings that decide it. Empty for a run without DDP."""
    models = [m for m in s.get("ddp") or [] if isinstance(m, dict)]
    if not models:
        return ""
    rows = []
    for m in models:
        its = [str(i) for i in m.get("iterations") or []]
        rows.append({
            "module": m.get("module"),
            "backend": m.get("backend"),
            "world_size": m.get("world_size"),
            "buckets": m.get("buckets"),
            "gradient_bytes": m.get("gradient_bytes"),
            "bucket_cap_bytes": m.get("bucket_cap_bytes"),
            "comm_hook": m.get("comm_hook") or "—",
            "find_unused_parameters": m.get("find_unused_parameters"),
            "forward_ms": m.get("forward_ms"),
            "backward_compute_ms": m.get("backward_compute_ms"),
            "all_reduce_ms": m.get("comm_ms"),
            "overlap_ms": m.get("overlap_ms"),
            "exposed_ms": m.get("exposed_ms"),
            "exposed_share": m.get("exposed_share"),
            "iterations": ", ".join(its[:6]) + (f" … ({len(its)})" if len(its) > 6 else ""),
        })
    timed = any(isinstance(m.get("comm_ms"), int | float) for m in models)
    note = (
        '<p class="note">DDP\'s own timing (its reducer times iterations 1–10 and every '
        "100th; the medians are over those after the tenth where there are any, else "
        "iterations 3–10, and over the iterations that all-reduced). <b>all_reduce</b>: "
        "from the first bucket's launch to the last one's completion; <b>overlap</b>: the "
        "part of it while the backward still computed; <b>exposed</b>: the rest, which the "
        "step waits for after its backward (share: of the median step time, or of the "
        "sampled iteration's own forward-to-all-reduce span where that is longer; an "
        "iteration that ran over 1.5x the median step is no steady one and gives no "
        "share). On a merged run these are the main rank's; each rank's exposed time is "
        "in the Ranks table.</p>"
        + "".join(f'<p class="note">{esc(m["share_withheld"])}.</p>' for m in models
                  if m.get("share_withheld"))
        if timed else
        '<p class="note">DDP sampled no iteration that all-reduced (it times iterations '
        "1–10 and every 100th): the settings only.</p>")
    return _table(rows) + note


def _deep_section(deep: Any) -> str:
    """The deep-window trace analysis (``trainprof.analysis.trace``), shown generically.

    The step-time breakdown (``breakdown_pct``, the TensorBoard plugin's categories) is drawn
    as a bar; every other key is a table, the known ones first, long lists cut to 20 rows.
    """
    if not deep:
        return ""
    if isinstance(deep, list):  # one analysis per window (trainprof.analysis.deep)
        return "".join(
            f"<h3>{esc(Path(str(d.get('source', ''))).name)}</h3>"
            + (f'<p class="note">{esc(d["error"])}</p>' if "error" in d else _deep_section(d))
            for d in deep if isinstance(d, dict)
        )
    if not isinstance(deep, dict):
        return render_generic(deep, "deep")
    parts = []
    pct = deep.get("breakdown_pct")
    if isinstance(pct, dict) and any(_number(v) for v in pct.values()):
        spans, legend = [], []
        for name, color in _TRACE_CATEGORIES:
            v = _number(pct.get(name)) or 0.0
            if v > 0:
                spans.append(f'<span style="width:{v:.3f}%;background:{color}" '
                             f'title="{esc(name)} {v:.1f}%"></span>')
                legend.append(f'<span><i style="background:{color}"></i>{esc(name)} '
                              f"{v:.1f}%</span>")
        parts.append('<h3>Step time in the trace (TensorBoard plugin categories)</h3>'
                     f'<div class="bar" id="tp-deep-bar">{"".join(spans)}</div>'
                     f'<div class="legend">{"".join(legend)}</div>')
    order = [k for k in _DEEP_FIRST if k in deep] + [
        k for k in deep if k not in _DEEP_FIRST and k not in _DEEP_HIDDEN
    ]
    about: dict[str, Any] = {}
    for key in order:
        value = deep[key]
        if value in (None, [], {}, ""):
            continue
        if _is_scalar(value) or (isinstance(value, list) and all(map(_is_scalar, value))):
            about[key] = value
            continue
        note = ""
        if isinstance(value, list) and len(value) > _DEEP_ROWS:
            note = f'<p class="note">top {_DEEP_ROWS} of {len(value)}</p>'
            value = value[:_DEEP_ROWS]
        parts.append(f"<h3>{esc(key)}</h3>" + render_generic(value, key) + note)
    if about:
        parts.append("<h3>About the trace</h3>" + render_generic(about))
    findings = [f for f in deep.get("findings") or [] if isinstance(f, dict)]
    if findings:
        parts.append("<h3>What the trace says</h3><ul>" + "".join(
            f"<li>{esc(f.get('title'))}</li>" for f in findings) + "</ul>")
    return "".join(parts)


def _callgraph(run: Run, svg: Any = None) -> str:
    """The call graph SVG of the run folder (``svg``: the name the profile recorded)."""
    name = Path(str(svg)).name if svg else "callgraph.svg"
    path = Path(run.path) / "python" / name
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    if not data:
        return ""
    if len(data) > CALLGRAPH_MAX_BYTES:
        return (
            f'<p class="note">The call graph ({fmt_bytes(len(data))}) is too large to inline; '
            f"open <code>{esc(path)}</code>.</p>"
        )
    uri = "data:image/svg+xml;base64," + base64.b64encode(data).decode("ascii")
    return (
        "<h3>Call graph</h3>"
        '<p class="note">cProfile over the profiled steps, drawn by gprof2dot and graphviz: '
        'hot paths in red, then orange and yellow. <button type="button" '
        'id="tp-callgraph-toggle">actual size</button></p>'
        f'<div class="callgraph" id="tp-callgraph"><img alt="Python call graph" src="{uri}"></div>'
    )


def _windows_text(windows: Any) -> str:
    """``[[10, 30], ...]`` (first step, end) as "10–30, ..."."""
    out = []
    for w in windows or []:
        if isinstance(w, list | tuple) and len(w) == 2:
            out.append(f"{w[0]}–{w[1]}")
        else:
            out.append(str(w))
    return ", ".join(out)


def _top_functions(rows: list[Any], key: str, n: int = 15) -> str:
    """A cProfile top table like pstats prints it; the user's own functions in bold."""
    body = []
    for r in rows[:n]:
        if not isinstance(r, dict):
            continue
        where = f"{r.get('file')}:{r.get('line')}" if r.get("line") else str(r.get("file") or "")
        share = _number(r.get(f"{key}_share"))
        calls = r.get("ncalls")
        prim = r.get("primitive_calls")
        calls_text = f"{calls}/{prim}" if prim is not None and prim != calls else str(calls)
        cls = ' class="user"' if r.get("user") else ""
        body.append(
            f"<tr{cls}><td class=\"mono\">{esc(r.get('function'))}</td>"
            f'<td class="mono">{esc(where)}</td><td class="num">{esc(calls_text)}</td>'
            f'<td class="num">{esc(fmt_time(_number(r.get("tottime"))))}</td>'
            f'<td class="num">{esc(fmt_time(_number(r.get("cumtime"))))}</td>'
            f'<td class="num">{"—" if share is None else f"{share * 100:.1f}%"}</td></tr>'
        )
    return (
        '<div class="scroll"><table class="top"><thead><tr><th>function</th><th>where</th>'
        "<th>calls</th><th>own time (tottime)</th><th>with callees (cumtime)</th>"
        f"<th>% of profiled wall time</th></tr></thead><tbody>{''.join(body)}</tbody></table>"
        "</div>"
    )


def _line_listing(func: dict[str, Any]) -> str:
    """One function's line profile, laid out as kernprof prints it, hot lines shaded."""
    title = (
        f"<h4>{esc(func.get('label') or func.get('function'))} "
        f"<span class=\"note\">{esc(func.get('file'))}:{esc(func.get('first_line'))} · total "
        f"{esc(fmt_time(_number(func.get('total_time_s'))))}</span></h4>"
    )
    if not func.get("hits"):
        return title + '<p class="note">not called inside the window</p>'
    rows = []
    for r in func.get("lines") or []:
        if not isinstance(r, dict):
            continue
        hits = r.get("hits")
        pct = _number(r.get("percent")) or 0.0
        alpha = min(0.45, pct / 100 * 0.6)  # hot lines shaded red, like a heat map
        shade = f' style="background:rgba(214,39,40,{alpha:.3f})"' if pct else ""
        rows.append(
            f'<tr{shade}><td class="num">{esc(r.get("line"))}</td>'
            f'<td class="num">{esc(hits) if hits else ""}</td>'
            f'<td class="num">{esc(fmt_time(_number(r.get("time_s")))) if hits else ""}</td>'
            f'<td class="num">{esc(fmt_time(_number(r.get("per_hit_s")))) if hits else ""}</td>'
            f'<td class="num">{f"{pct:.1f}" if hits else ""}</td>'
            f'<td class="src">{esc(str(r.get("source") or "").rstrip())}</td></tr>'
        )
    return (
        title + '<div class="scroll"><table class="lines"><thead><tr><th>line</th><th>hits</th>'
        "<th>time</th><th>per hit</th><th>% time</th><th>line contents</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table></div>"
    )


def _python_profile_html(section: Any, run: Run) -> str:
    """The ``python_profile`` summary (cProfile tops, call graph, line profile), or generic."""
    if not isinstance(section, dict) or not ({"cprofile", "lines"} & set(section)):
        return render_generic(section, "python_profile")
    parts = []
    cp = section.get("cprofile")
    if isinstance(cp, dict):
        parts.append(
            "<h3>cProfile</h3>"
            f'<p class="meta">steps {esc(_windows_text(cp.get("windows")))} · '
            f"{esc(cp.get('steps_profiled', 0))} steps · {esc(fmt_time(_number(cp.get('wall_s'))))}"
            f" wall · {esc(fmt_time(_number(cp.get('profiled_s'))))} inside profiled calls · "
            f"{esc(cp.get('n_functions', '—'))} functions</p>"
        )
        hu = section.get("hottest_user")
        if isinstance(hu, dict):
            share = _number(hu.get("share"))
            parts.append(
                f"<p><b>Hottest function of yours:</b> <code>{esc(hu.get('function'))}</code> "
                f"({esc(hu.get('file'))}:{esc(hu.get('line'))}) · "
                f"{esc(fmt_time(_number(hu.get('tottime'))))} own time"
                + (f", {share * 100:.0f}% of the profiled wall time" if share is not None else "")
                + "</p>"
            )
        parts.append(_callgraph(run, cp.get("svg")))
        for key, label in (("tottime", "by own time"), ("cumtime", "with callees")):
            rows = cp.get(f"top_{key}")
            if isinstance(rows, list) and rows:
                parts.append(f"<h4>Top functions {label}</h4>" + _top_functions(rows, key))
        if cp.get("top_tottime"):
            parts.append('<p class="note">Bold rows are your code.</p>')
    else:
        parts.append(_callgraph(run))
    lp = section.get("lines")
    if isinstance(lp, dict):
        parts.append(
            "<h3>Line profile (line_profiler)</h3>"
            f'<p class="meta">steps {esc(_windows_text(lp.get("windows")))} · '
            f"{esc(lp.get('steps_profiled', 0))} steps</p>"
        )
        for func in lp.get("functions") or []:
            if isinstance(func, dict):
                parts.append(_line_listing(func))
    messages = section.get("messages") or []
    if messages:
        parts.append("<ul>" + "".join(f"<li>{esc(m)}</li>" for m in messages) + "</ul>")
    return "".join(parts)


def _python_section(s: dict[str, Any], run: Run) -> str:
    pp = s.get("python_profile")
    parts = [_python_profile_html(pp, run) if pp else _callgraph(run)]
    if s.get("line_profile"):
        parts.append("<h3>Line profile</h3>" + render_generic(s["line_profile"]))
    return "".join(parts)


def _environment_section(s: dict[str, Any], run: Run) -> str:
    parts = []
    if s.get("environment"):
        parts.append(render_generic(s["environment"]))
    fp = run.meta.get("fingerprint")
    if fp:
        parts.append(
            "<details><summary>Full environment fingerprint (run.json)</summary>"
            + render_generic(fp)
            + "</details>"
        )
    return "".join(parts)


def _notes(s: dict[str, Any]) -> str:
    notes = [str(n) for n in list(s.get("missing") or []) + list(s.get("notes") or [])]
    if s.get("recorded_status"):
        notes.append(f"run.json says {s['recorded_status']}; reported as {s.get('status')}")
    if not notes:
        return ""
    return "<ul>" + "".join(f"<li>{esc(n)}</li>" for n in notes) + "</ul>"


def _page(title: str, nav: list[tuple[str, str]], header: str, body: str, data: Any) -> str:
    """The whole document: CSP first, styles, content, the data block, the hashed script."""
    script_hash = base64.b64encode(hashlib.sha256(JS.encode("utf-8")).digest()).decode("ascii")
    csp = (
        "default-src 'none'; img-src data:; style-src 'unsafe-inline'; "
        f"script-src 'sha256-{script_hash}'; base-uri 'none'; form-action 'none'"
    )
    links = "".join(f'<a href="#{esc(a)}">{esc(t)}</a>' for a, t in nav)
    generated = datetime.now(UTC).isoformat(timespec="seconds")
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{esc(csp)}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<meta name="referrer" content="no-referrer">'
        f"<title>{esc(title)}</title><style>{CSS}</style></head><body>"
        f'{header}<nav><div class="inner">{links}</div></nav><main>{body}'
        f'<footer>Generated by trainprof at {esc(generated)}. One self-contained file: '
        "no network access, nothing loaded from elsewhere.</footer></main>"
        f'<script type="application/json" id="tp-data">{json_for_script(data)}</script>'
        f"<script>{JS}</script></body></html>\n"
    )


def _write(path: Path, text: str) -> Path:
    """Write atomically (a browser reloading the page never sees half a file)."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"cannot write the HTML report: {path} is a folder")
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:
        raise UsageError(f"cannot write the HTML report {path}: {exc.strerror or exc}") from exc
    return path


def render_html(summary: dict[str, Any], run: Run, path: Path) -> Path:
    """Write the HTML report of ``run`` (its ``summary`` from ``commands.analyse``) to ``path``.

    Returns the path written. The file is self-contained (see the module docstring).
    """
    return _write(path, html_page(summary, run))


def html_page(summary: dict[str, Any], run: Run) -> str:
    """The HTML report of ``run`` as one self-contained page (what :func:`render_html`
    writes; the W&B export logs it as it is)."""
    s = summary
    steps = step_series(run, MAX_POINTS)
    samples = sample_series(run, MAX_POINTS)
    telemetry = telemetry_series(s["telemetry"], MAX_POINTS) if s.get("telemetry") else []
    median = (s.get("steps") or {}).get("median_s")
    data = {
        "phases": [list(p) for p in PHASES],
        "median_s": median,
        "steps": steps,
        "samples": samples,
        "telemetry": telemetry,
    }
    sections = [_section("verdict", "Verdict", _verdict(s))]
    if steps.get("count"):
        sections.append(_section("steps", "Step time", _steps_section(s, steps)))
    util = _util_section(s, samples)
    if util:
        sections.append(_section("utilization", "Utilization over time", util))
    gpu = _gpu_section(s)
    if gpu:
        sections.append(_section("gpu", "GPU", gpu))
    loader = _dataloader_section(s)
    if loader:
        sections.append(_section("dataloader", "Input pipeline", loader))
    if s.get("ranks"):
        sections.append(_section("ranks", "Ranks", _ranks_section(s)))
    ddp = _ddp_section(s)
    if ddp:
        sections.append(_section("ddp", "Gradient all-reduce (DDP)", ddp))
    if s.get("deep"):
        sections.append(_section("deep", "Deep window (torch.profiler trace)",
                                 _deep_section(s["deep"])))
    python = _python_section(s, run)
    if python:
        sections.append(_section("python", "Python hot spots", python))
    if telemetry:
        sections.append(
            _section(
                "telemetry",
                "Training telemetry",
                '<div id="tp-telemetry-charts"></div>'
                + (
                    '<p class="note">Long series are drawn as bucket means with a min–max '
                    "band.</p>"
                    if any(t["bucket"] > 1 for t in telemetry)
                    else ""
                ),
            )
        )
    more = {k: v for k, v in s.items() if k not in _KNOWN_KEYS and v not in (None, [], {})}
    if more:
        # (wide tables scroll inside the section, not the page)
        sections.append(_section("more", "More analysis",
                                 f'<div class="scroll">{render_generic(more)}</div>'))
    other = {}
    for key in ("syncs", "gc", "regions", "breakdown_detail"):
        if s.get(key):
            other[key] = s[key]
    if other:
        sections.append(_section("counters", "Syncs, GC and regions", render_generic(other)))
    env = _environment_section(s, run)
    if env:
        sections.append(_section("environment", "Environment", env))
    notes = _notes(s)
    if notes:
        sections.append(_section("notes", "Notes", notes))
    run_dir = f'<p class="note">Run folder: <code>{esc(s.get("run_dir") or run.path)}</code></p>'
    body = "".join(sec for _, _, sec in sections) + run_dir
    nav = [(a, t) for a, t, _ in sections]
    title = f"trainprof · {s.get('name') or 'run'}"
    return _page(title, nav, _header(s), body, data)


# -- compare -----------------------------------------------------------------------------------

_COMPARE_KEYS = ("verdict", "ratio", "ci", "phases", "environment_diff", "a", "b", "notes",
                 "explains", "median_a", "median_b", "mean_a", "mean_b", "median_ratio",
                 "statistic", "metric", "unit", "change_pct",
                 "confidence", "significant")


def _compare_headline(result: dict[str, Any]) -> str:
    """The terminal's verdict line (the same words), or what can be said from partial data."""
    from trainprof.report.compare_terminal import verdict_line

    parts = []
    verdict = result.get("verdict")
    line = None
    if isinstance(verdict, dict):
        verdict = verdict.get("text") or verdict.get("label") or verdict.get("verdict")
    else:
        try:
            line = verdict_line(result).plain
        except (KeyError, TypeError, ValueError, AttributeError, IndexError):
            line = None
    cls = {"slower": " slower", "faster": " ok"}.get(str(verdict), "")
    if line:
        parts.append(f'<p class="headline{cls}" id="tp-verdict">{esc(line)}</p>')
    elif verdict is not None:
        parts.append(f'<p class="headline{cls}" id="tp-verdict">{esc(verdict)}</p>')
    ratio, ci = result.get("ratio"), result.get("ci")
    if isinstance(ratio, int | float) and not isinstance(ratio, bool):
        text = f"mean time per {per_unit(result)} B / A = {ratio:.3f}×"
        lo = hi = None
        if isinstance(ci, list | tuple) and len(ci) == 2:
            lo, hi = ci
        elif isinstance(ci, dict):
            lo, hi = ci.get("lo", ci.get("low")), ci.get("hi", ci.get("high"))
        if isinstance(lo, int | float) and isinstance(hi, int | float):
            conf = result.get("confidence")
            conf = float(conf) if isinstance(conf, int | float) else 0.95
            text += f" ({conf * 100:.0f}% CI {lo:.3f}–{hi:.3f})"
        parts.append(f'<p class="meta">{esc(text)}</p>')
    return "".join(parts)


def _signed(seconds: Any) -> str:
    if not isinstance(seconds, int | float) or isinstance(seconds, bool):
        return "—"
    sign = "+" if seconds > 0 else "−" if seconds < 0 else "±"
    return sign + fmt_time(abs(float(seconds)))


def _compare_phases(result: dict[str, Any]) -> str:
    """Per-phase A, B, change, as a table and as two stacked bars on one scale."""
    phases = result.get("phases")
    if not isinstance(phases, dict) or not all(isinstance(v, dict) for v in phases.values()):
        return render_generic(phases, "phases")
    explains = result.get("explains")
    # no difference: phase deltas that nearly cancel make "shares" of thousands of percent
    changed = result.get("verdict") in ("slower", "faster")
    rows = []
    for ph, v in phases.items():
        pct, share = v.get("delta_pct"), v.get("share_of_change") if changed else None
        bold = ' class="explains"' if ph == explains else ""
        rows.append(
            f"<tr{bold}><th>{esc(ph)}</th><td class=\"num\">{esc(fmt_time(_number(v.get('a'))))}"
            f'</td><td class="num">{esc(fmt_time(_number(v.get("b"))))}</td>'
            f'<td class="num">{esc(_signed(v.get("delta")))}</td>'
            f'<td class="num">{"—" if _number(pct) is None else f"{pct:+.0f}%"}</td>'
            f'<td class="num">{"—" if _number(share) is None else f"{share * 100:.0f}%"}</td>'
            "</tr>"
        )
    per = per_unit(result)
    table = (
        f'<p class="note">Mean time per {esc(per)} of each phase over the steady steps.</p>'
        '<table id="tp-phases"><thead><tr><th>phase</th><th>A</th><th>B</th><th>Δ</th>'
        f"<th>Δ%</th><th>share of change</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
    )
    # two bars on one scale: the longer total is full width
    totals = {
        side: sum(_number(v.get(side)) or 0.0 for v in phases.values()) for side in ("a", "b")
    }
    scale = max(totals.values())
    if scale <= 0:
        return table
    colors = {key: color for key, _, color in PHASES}
    bars = []
    for side in ("a", "b"):
        spans = []
        for ph, v in phases.items():
            x = _number(v.get(side)) or 0.0
            if x > 0:
                spans.append(
                    f'<span style="width:{x / scale * 100:.3f}%;background:'
                    f'{colors.get(ph, "#9aa3b0")}" title="{esc(ph)} {esc(fmt_time(x))}"></span>'
                )
        bars.append(
            f'<div class="cmpbar"><b>{side.upper()}</b><div class="bar">{"".join(spans)}</div>'
            f"<span>{esc(fmt_time(totals[side]))}</span></div>"
        )
    legend = "".join(
        f'<span><i style="background:{color}"></i>{esc(label)}</span>'
        for key, label, color in PHASES
        if key in phases
    )
    return "".join(bars) + f'<div class="legend">{legend}</div>' + table


def _number(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _flatten(d: Any, prefix: str = "", depth: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if not isinstance(d, dict):
        return out
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and depth < 1:
            out.update(_flatten(v, key + ".", depth + 1))
        else:
            out[key] = v
    return out


def _side_by_side(a: Any, b: Any) -> str:
    """The two run summaries as one table: a row per fact, A and B next to each other."""
    fa, fb = _flatten(a), _flatten(b)
    keys = list(fa) + [k for k in fb if k not in fa]
    rows = []
    for key in keys[:MAX_ROWS * 2]:
        last = key.rsplit(".", 1)[-1]
        if key.startswith("breakdown."):
            last += "_share"
        cells = [_cell(last, side.get(key)) for side in (fa, fb)]
        if key == "compute.utilization":  # a fraction of the peak, as the summary writes it
            cells = [utilization_text(v) if _number(v) is not None else c
                     for v, c in zip((fa.get(key), fb.get(key)), cells, strict=True)]
        rows.append(f"<tr><th>{esc(key)}</th><td>{cells[0]}</td><td>{cells[1]}</td></tr>")
    return (
        '<div class="scroll"><table class="kv" id="tp-runs"><thead><tr><th></th><th>A</th>'
        f"<th>B</th></tr></thead><tbody>{''.join(rows)}</tbody></table></div>"
    )


def _env_rows(diff: Any) -> Any:
    """The environment diff with its most telling columns first (a command shows its change)."""
    if not isinstance(diff, list) or not all(isinstance(d, dict) for d in diff):
        return diff
    first = ("rank", "key", "setting", "a", "b", "acts_on", "category", "score")
    rows = []
    for d in diff:
        row = dict(d)
        if "change_a" in row or "change_b" in row:
            row["a"], row["b"] = row.pop("change_a", row.get("a")), row.pop("change_b",
                                                                             row.get("b"))
        rows.append({**{k: row[k] for k in first if k in row},
                     **{k: v for k, v in row.items() if k not in first}})
    return rows


def render_compare_html(result: dict[str, Any], path: Path) -> Path:
    """Write the HTML of a ``compare`` result (``trainprof.analysis.compare.compare_runs``).

    Robust to missing and extra keys: the verdict (the terminal's words) with the ratio and
    its confidence interval first, then per-phase changes (table and bars), the environment
    diff (most likely explanation first), the two runs side by side, and anything else.
    """
    result = result if isinstance(result, dict) else {"result": result}
    sections = [_section("verdict", "Verdict", _compare_headline(result) or "<p>—</p>")]
    if result.get("phases"):
        sections.append(_section("phases", "Per-phase change", _compare_phases(result)))
    if result.get("environment_diff"):
        sections.append(
            _section(
                "environment",
                "What changed (most likely explanation first)",
                render_generic(_env_rows(result["environment_diff"])),
            )
        )
    if isinstance(result.get("a"), dict) or isinstance(result.get("b"), dict):
        sections.append(_section("runs", "The two runs", _side_by_side(result.get("a"),
                                                                       result.get("b"))))
    if result.get("notes"):
        sections.append(_section("notes", "Notes", render_generic(result["notes"])))
    rest = {k: v for k, v in result.items() if k not in _COMPARE_KEYS and v is not None}
    if rest:
        sections.append(_section("more", "More", render_generic(rest)))
    header = (
        '<header class="top"><div class="inner"><h1>trainprof compare</h1>'
        f'<div class="sub">A: {esc(_run_name(result.get("a")))}</div>'
        f'<div class="sub">B: {esc(_run_name(result.get("b")))}</div></div></header>'
    )
    body = "".join(sec for _, _, sec in sections)
    nav = [(a, t) for a, t, _ in sections]
    return _write(path, _page("trainprof compare", nav, header, body, {}))


def _run_name(run: Any) -> str:
    if isinstance(run, dict):
        name, where = run.get("name"), run.get("run_dir")
        return " · ".join(str(x) for x in (name, where) if x) or "?"
    return str(run) if run is not None else "?"
