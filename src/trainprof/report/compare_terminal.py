"""The terminal view of ``trainprof compare`` (rich). It renders a comparison; it computes nothing.

The verdict comes first, on one line, because that is what a person (or a CI log) reads:
faster, slower or no significant difference in the time per unit of work (step, sample or
GFLOP: the unit is named), by how much, with the interval, and the phase that explains it.
Below it: step-time distributions side by side, the per-phase deltas and the environment
diff, most likely explanation first.
"""

from __future__ import annotations

import sys
from typing import IO, Any

from rich.table import Table
from rich.text import Text

from trainprof.analysis.compare import per_unit
from trainprof.report.console import fmt_ratio, keep_numbers_whole, make_console
from trainprof.report.terminal import (
    fmt_bytes,
    fmt_flops,
    fmt_pct,
    fmt_time,
    utilization_text,
)

#: Environment-diff rows shown; the rest is in --json.
MAX_ENV_ROWS = 15
#: The median's ratio joins the headline when it is this far from the compared mean's (either
#: way): typical steps then tell another story than the run's total (an evaluation gone).
MEDIAN_APART = 1.1

_PHASE_LABEL = {
    "data_wait": "data wait",
    "forward": "forward",
    "backward": "backward",
    "optimizer": "optimizer",
    "gc": "gc",
    "other": "other",
}




def _signed_time(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    sign = "+" if seconds > 0 else "−" if seconds < 0 else "±"
    return sign + fmt_time(abs(seconds))


def verdict_line(result: dict[str, Any]) -> Text:
    """The one-line answer: verdict, size, interval, and the phase that explains it."""
    verdict = result.get("verdict")
    per = per_unit(result)
    ratio, ci = result.get("ratio"), result.get("ci")
    conf = round(float(result.get("confidence") or 0.95) * 100)
    line = Text()
    if ratio is None:
        line.append("No verdict", style="bold yellow")
        line.append(": too few steady steps to compare")
        return line
    # "+121% time per step" rather than "121% slower": unambiguous for any size of change
    change = f"{(ratio - 1) * 100:+.1f}% time per {per}"
    if verdict == "slower":
        line.append(f"B is slower than A: {change}", style="bold red")
    elif verdict == "faster":
        line.append(f"B is faster than A: {change}", style="bold green")
    else:
        line.append("No significant difference between A and B", style="bold yellow")
        line.append(f": {change}")
    # the compared figure: the runs' time per unit of work (the median ignores the rare
    # long steps a run pays for, and read +11% on a 25% speed-up)
    line.append(
        f" (mean {fmt_time(result.get('mean_a'))} → "
        f"{fmt_time(result.get('mean_b'))}, {fmt_ratio(ratio)}"
    )
    if ci and ci[0] is not None:
        line.append(f", {conf}% CI {fmt_ratio(ci[0])}–{fmt_ratio(ci[1])}")
    median = result.get("median_ratio")
    if isinstance(median, int | float) and median > 0 and ratio > 0 and (
            max(median / ratio, ratio / median) > MEDIAN_APART):
        what = per if per in ("step", "iteration") else f"time per {per}"
        line.append(f"; median {what} {fmt_ratio(median)}")
    line.append(")")
    explains = result.get("explains")
    if verdict == "no_difference":
        return line
    if explains:
        share = (result.get("phases") or {}).get(explains, {}).get("share_of_change")
        line.append(f"; {_PHASE_LABEL.get(explains, explains)}")
        if share is not None:
            line.append(f" accounts for {share * 100:.0f}% of the change")
    cause = result.get("likely_cause")
    if cause and cause.get("kind") == "load":  # the slower run shared its machine
        line.append(f"; most likely cause: other processes' load on the machine (A ~"
                    f"{cause['a_cores']:.1f} cores, B ~{cause['b_cores']:.1f})")
    elif cause:
        width = 80 if cause["key"] == "command" else 40  # the changed words, as written
        line.append(f"; most likely cause: {cause['key']} {_short(cause.get('a'), width)} → "
                    f"{_short(cause.get('b'), width)}")
        load = cause.get("also_load")
        if load:
            line.append(f" (other processes' load changed too: A ~{load['a_cores']:.1f} "
                        f"cores, B ~{load['b_cores']:.1f})")
        busy = cause.get("both_loaded")
        if busy and not load:
            line.append(f" - but both runs shared a busy machine (other processes ~"
                        f"{busy['a_cores']:.1f} and ~{busy['b_cores']:.1f} cores): the "
                        "difference may be the machine's; compare runs on a quiet one")
    return line


def _share(value: float | None) -> str:
    """A share of the token positions (— where the run's batches held no padding)."""
    return "—" if value is None else f"{value * 100:.0f}% of positions"


def _recompilations(rec: dict[str, Any] | None) -> str:
    """torch.compile's recompilations in the steady steps (— where nothing compiled)."""
    if not rec:
        return "—"
    n = int(rec.get("after_warmup") or 0)
    text = f"{n} ({fmt_time(rec.get('after_warmup_s'))})" if n else "0"
    return text + (", limit hit" if rec.get("limit_hit") else "")


def _short(value: Any, width: int = 40) -> str:
    text = "—" if value is None else str(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def _steps_table(result: dict[str, Any]) -> Table:
    a, b = result["a"], result["b"]
    table = Table(box=None, padding=(0, 2), show_edge=False)
    table.add_column("", style="bold cyan", no_wrap=True)
    table.add_column("A", justify="right")
    table.add_column("B", justify="right")
    table.add_column("B/A", justify="right")
    sa, sb = a["steps"], b["steps"]
    table.add_row(
        "steps",
        f"{sa['count']} ({sa['warmup']} warm-up)",
        f"{sb['count']} ({sb['warmup']} warm-up)",
        "",
    )
    for key, label in (("median_s", "median"), ("p10_s", "p10"), ("p90_s", "p90"),
                       ("mean_s", "mean")):
        x, y = sa.get(key), sb.get(key)
        table.add_row(f"step {label}", fmt_time(x), fmt_time(y),
                      fmt_ratio(y / x) if x and y is not None else "—")
    for key, label, fmt in (
        ("samples_per_s", "samples/s", "{:,.0f}"),
        ("steps_per_s", "steps/s", "{:,.2f}"),
    ):
        x, y = a.get(key), b.get(key)
        table.add_row(
            label,
            "—" if x is None else fmt.format(x),
            "—" if y is None else fmt.format(y),
            fmt_ratio(y / x) if x and y is not None else "—",
        )
    per = per_unit(result)
    if per in ("sample", "GFLOP"):  # the headline's figure, beside the steps it comes from
        x, y = result.get("mean_a"), result.get("mean_b")
        table.add_row(f"time per {per}", fmt_time(x), fmt_time(y),
                      fmt_ratio(y / x) if x and y is not None else "—")
    if a.get("samples_per_step") is not None or b.get("samples_per_step") is not None:
        table.add_row("samples/step", _short(a.get("samples_per_step")),
                      _short(b.get("samples_per_step")), "")
    comp_a, comp_b = a.get("compute") or {}, b.get("compute") or {}
    if comp_a.get("flops_per_step") or comp_b.get("flops_per_step"):
        x, y = comp_a.get("flops_per_step"), comp_b.get("flops_per_step")
        table.add_row("FLOPs/step", fmt_flops(x), fmt_flops(y),
                      fmt_ratio(y / x) if x and y is not None else "—")
        x, y = comp_a.get("utilization"), comp_b.get("utilization")
        # the summary's own rounding: one decimal below 10% (0.3%, not 0%)
        table.add_row("FLOPs utilization", "—" if x is None else utilization_text(x),
                      "—" if y is None else utilization_text(y), "")
    x, y = a.get("attention_s_per_step"), b.get("attention_s_per_step")
    if x or y:
        # a ratio only where the ops or a setting of the model's math changed: the same ops
        # timed in two other steps differ by the window's noise (analysis/compare._attention)
        att = result.get("attention") or {}
        ratio = att.get("ratio")
        table.add_row("attention op by op", _attention(x), _attention(y),
                      fmt_ratio(ratio) if ratio else "same ops" if att.get("same_ops") and (
                          x and y) else "—")
    pad_a, pad_b = a.get("padding") or {}, b.get("padding") or {}
    for index in sorted(set(pad_a) | set(pad_b)):
        x, y = pad_a.get(index), pad_b.get(index)
        table.add_row(f"padding (loader {index})" if len(set(pad_a) | set(pad_b)) > 1
                      else "padding", _share(x), _share(y), "")
    rec_a, rec_b = a.get("recompilations"), b.get("recompilations")
    if rec_a or rec_b:
        table.add_row("recompilations", _recompilations(rec_a), _recompilations(rec_b), "")
    sys_a, sys_b = a.get("system") or {}, b.get("system") or {}
    for key, label in (("proc_cpu_pct", "process CPU"), ("workers_cpu_pct", "workers CPU"),
                       ("sys_cpu_pct", "system CPU"), ("iowait_pct", "iowait")):
        if sys_a.get(key) is not None or sys_b.get(key) is not None:
            table.add_row(label, fmt_pct(sys_a.get(key)), fmt_pct(sys_b.get(key)), "")
    if sys_a.get("rss_peak_bytes") or sys_b.get("rss_peak_bytes"):
        table.add_row("RSS peak", fmt_bytes(sys_a.get("rss_peak_bytes")),
                      fmt_bytes(sys_b.get("rss_peak_bytes")), "")
    return keep_numbers_whole(table)


def _attention(seconds: float | None) -> str:
    """Attention computed op by op a step: none found, or not looked for (no window)."""
    return "—" if seconds is None else "none" if seconds == 0 else fmt_time(seconds)


def _phases_table(result: dict[str, Any]) -> Table:
    per = per_unit(result)
    table = Table(box=None, padding=(0, 2), show_edge=False,
                  title=f"Phases (mean per {per}, steady steps)", title_justify="left",
                  title_style="bold")
    table.add_column("phase", style="bold cyan", no_wrap=True)
    table.add_column("A", justify="right")
    table.add_column("B", justify="right")
    table.add_column("Δ", justify="right")
    table.add_column("Δ%", justify="right")
    table.add_column("share of change", justify="right")
    explains = result.get("explains")
    # no difference: phase deltas that nearly cancel make "shares" of thousands of percent
    changed = result.get("verdict") in ("slower", "faster")
    for ph, v in (result.get("phases") or {}).items():
        style = "bold" if ph == explains and changed else None
        pct = v.get("delta_pct")
        share = v.get("share_of_change") if changed else None
        table.add_row(
            _PHASE_LABEL.get(ph, ph),
            fmt_time(v.get("a")),
            fmt_time(v.get("b")),
            _signed_time(v.get("delta")),
            "—" if pct is None else f"{pct:+.0f}%",
            "—" if share is None else f"{share * 100:.0f}%",
            style=style,
        )
    return keep_numbers_whole(table)


def _env_table(result: dict[str, Any]) -> Table | None:
    diff = result.get("environment_diff") or []
    if not diff:
        return None
    table = Table(box=None, padding=(0, 2), show_edge=False,
                  title="What changed (most likely explanation first)", title_justify="left",
                  title_style="bold")
    table.add_column("#", justify="right")
    table.add_column("setting", style="bold cyan", overflow="fold")
    table.add_column("A", overflow="fold")
    table.add_column("B", overflow="fold")
    table.add_column("acts on", no_wrap=True)
    for item in diff[:MAX_ENV_ROWS]:
        # a command line shows only what differs in it
        a = item.get("change_a", item.get("a"))
        b = item.get("change_b", item.get("b"))
        acts = item.get("acts_on")
        table.add_row(str(item.get("rank")), str(item["key"]), _short(a, 48), _short(b, 48),
                      _PHASE_LABEL.get(acts, "—") if acts else "—")
    return keep_numbers_whole(table)


def render_compare(result: dict[str, Any], file: IO[str] | None = None) -> None:
    """Print a comparison (the document of :func:`trainprof.analysis.compare.compare_runs`)."""
    out = file if file is not None else sys.stdout
    console = make_console(out)
    console.print(verdict_line(result))
    a, b = result["a"], result["b"]
    console.print(Text(f"A: {a.get('name')}  {a.get('run_dir')}", style="dim"))
    console.print(Text(f"B: {b.get('name')}  {b.get('run_dir')}", style="dim"))
    console.print()
    console.print(_steps_table(result))
    console.print()
    console.print(_phases_table(result))
    env = _env_table(result)
    console.print()
    if env is None:
        console.print("No difference in the recorded environment, settings or command line.")
    else:
        console.print(env)
        rest = len(result.get("environment_diff") or []) - MAX_ENV_ROWS
        if rest > 0:
            console.print(Text(f"... and {rest} more (--json lists all)", style="dim"))
    threshold = result.get("practical_threshold_pct")
    if result.get("verdict") == "no_difference" and result.get("ratio") is not None:
        console.print(Text(
            f"Significant means: the {round(float(result.get('confidence') or .95) * 100)}% "
            f"interval excludes ×1 and the change is at least {threshold:g}%.", style="dim"))
    for note in result.get("notes") or []:
        console.print(Text(f"note: {note}", style="yellow"))
