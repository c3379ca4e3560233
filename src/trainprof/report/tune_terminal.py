"""The terminal view of ``trainprof tune`` (rich). It renders a tune result; it computes nothing.

The answer comes first, on one line: the best arm and its speed-up over the baseline with the
interval, or that no arm was significantly faster (settled as faster, where an unsettled arm's
interval clears ×1; settled as the fastest, where an unsettled arm ran faster than the fastest
significantly faster one), and how many trials ran under outside load. Below it one row per arm: the
setting asked for and the setting the runs recorded, trials used, mean time per step (or per
sample: what is compared) and the median step, samples/s, the ratio to the baseline with its
interval, and the verdict.
"""

from __future__ import annotations

import sys
from typing import IO, Any

from rich.table import Table
from rich.text import Text

from trainprof.report.console import fmt_ratio, keep_numbers_whole, make_console
from trainprof.report.terminal import fmt_time, utilization_text

_VERDICT = {
    "faster": ("faster", "bold green"),
    "slower": ("slower", "bold red"),
    "no_difference": ("not significant", "yellow"),
    "unsettled": ("unsettled", "yellow"),
    "no_effect": ("knob did nothing", "dim"),
    "baseline": ("baseline", "dim"),
    None: ("no data", "dim"),
}




def _rate(x: float | None) -> str:
    return "—" if x is None else f"{x:,.0f}" if x >= 10 else f"{x:.2f}"


def headline(doc: dict[str, Any]) -> Text:
    """The one-line answer: the best arm and its speed-up, or that none beat the baseline."""
    best = doc.get("best")
    conf = round(float(doc.get("confidence") or 0.95) * 100)
    per = "sample" if doc.get("metric") == "time_per_sample" else "step"
    line = Text()
    base = doc.get("baseline")
    if best:
        line.append(f"Best: {best['name']}", style="bold green")
        ci = best.get("ci") or [None, None]
        line.append(
            f" is {best['speedup']:.2f}× as fast as {base} (mean time per {per} "
            f"{fmt_ratio(best['ratio'])}, {conf}% CI {fmt_ratio(ci[0])}–{fmt_ratio(ci[1])})"
        )
        return line
    rows = doc.get("arms") or []
    if not any(r.get("baseline") and r.get("mean_s") is not None for r in rows):
        line.append("No verdict", style="bold yellow")
        line.append(f": the baseline {base} has no usable trial")
        return line
    unsettled = [r for r in rows if r.get("verdict") == "unsettled"
                 and r.get("ratio") is not None]
    faster = [r for r in rows if r.get("verdict") == "faster"]
    # an unsettled arm's interval may clear ×1: "significantly faster" would contradict it
    cleared = [r for r in unsettled
               if (r.get("ci") or [None, None])[1] is not None and r["ci"][1] < 1]
    if faster and unsettled:  # no best: an unsettled arm ran faster than the fastest settled
        r, f = (min(x, key=lambda r: r["ratio"]) for x in (unsettled, faster))
        fci = f.get("ci") or [None, None]
        line.append("No arm is settled as the fastest", style="bold yellow")
        line.append(f": {r['name']} ran at {fmt_ratio(r['ratio'])} of the baseline {base} "
                    f"({_unsettled_ci(r, conf)}), but {_unsettled_why(r)}; {f['name']} is "
                    f"settled as faster: {f['speedup']:.2f}× as fast (mean time per {per} "
                    f"{fmt_ratio(f['ratio'])}, {conf}% CI {fmt_ratio(fci[0])}–"
                    f"{fmt_ratio(fci[1])})")
    elif cleared:
        r = min(cleared, key=lambda r: r.get("ratio") or 1.0)
        line.append("No arm is settled as faster", style="bold yellow")
        line.append(f" than the baseline {base}: {r['name']} ran at {fmt_ratio(r.get('ratio'))} "
                    f"({_unsettled_ci(r, conf)}), but {_unsettled_why(r)}")
    else:
        line.append("No arm is significantly faster", style="bold yellow")
        line.append(f" than the baseline {base}")
        if any(r.get("unsettled_by") == "one_trial" for r in unsettled):
            line.append(" (one trial a side: too few to tell a change from the noise between "
                        "trials; run --trials 2 or more)")
    load = load_text(rows)
    if load:
        line.append(f"; {load}")
    return line


def _unsettled_ci(row: dict[str, Any], conf: int) -> str:
    """An unsettled arm's interval, said as within one trial where it is."""
    lo, hi = row.get("ci") or [None, None]
    within = " within one trial" if row.get("unsettled_by") == "one_trial" else ""
    return f"{conf}% CI{within} {fmt_ratio(lo)}–{fmt_ratio(hi)}"


def _unsettled_why(row: dict[str, Any]) -> str:
    """Why an arm is unsettled, in a few words (tune's notes say more)."""
    if row.get("unsettled_by") == "one_trial":
        return "one trial a side cannot tell a change from the noise between trials"
    return "its trials disagree too much to size the change"


def _ended_text(ended: list[int] | None) -> str:
    """Where the script's own loop ended trials before ``--steps`` (tune's
    ``script_ended_after``), in the header's words."""
    if not ended:
        return ""
    low, high = ended
    return (f" (the script ended them after {low} steps)" if low == high
            else f" (the script ended them after {low}–{high} steps)")


def load_text(rows: list[dict[str, Any]]) -> str:
    """Trials that ran while other processes kept cores busy (tune's ``outside_load``), in
    a few words for a verdict: "" where none did."""
    loaded = [r["outside_load"] for r in rows if isinstance(r.get("outside_load"), dict)]
    if not loaded:
        return ""
    n = sum(int(x.get("trials") or 0) for x in loaded)
    cores = max(float(x.get("max_cores") or 0.0) for x in loaded)
    return (f"{n} trial{'s' if n != 1 else ''} ran while other processes kept up to "
            f"~{cores:.1f} cores busy")


def _longest_word(texts: Any) -> int:
    """The longest run of the ``texts`` without a space (a knob's setting): what a column
    must hold so that rich wraps between settings, not inside one."""
    return max((len(word) for text in texts for word in str(text).split()), default=1)


def _arms_table(doc: dict[str, Any]) -> Table:
    per_sample = doc.get("metric") == "time_per_sample"
    conf = round(float(doc.get("confidence") or 0.95) * 100)
    table = Table(box=None, padding=(0, 1), show_edge=False, header_style="bold")
    rows = doc.get("arms") or []
    # an arm breaks between its knobs, never inside one ("autocast=bf1" / "6"): each column
    # is at least as wide as its longest setting
    table.add_column("arm", style="bold cyan", overflow="fold",
                     min_width=_longest_word(str(r.get("name")) + " (base)" for r in rows))
    table.add_column("recorded", overflow="fold", min_width=_longest_word(
        [*(str(v) for r in rows for v in (r.get("actual") or {}).values()), "recorded"]))
    table.add_column("trials", justify="right", no_wrap=True)
    table.add_column("steps", justify="right", no_wrap=True)
    table.add_column("time/sample" if per_sample else "time/step", justify="right",
                     no_wrap=True)
    table.add_column("median step", justify="right", no_wrap=True)
    table.add_column("samples/s", justify="right", no_wrap=True)
    table.add_column("vs base", justify="right", no_wrap=True)
    table.add_column(f"{conf}% CI", justify="right", no_wrap=True)
    table.add_column("verdict", no_wrap=True)
    # how near the machine's matmul peak each arm's steps ran (a run without FLOPs: none)
    peak = any(r.get("flops_utilization") is not None for r in doc.get("arms") or [])
    if peak:
        table.add_column("of peak", justify="right", no_wrap=True)
    for row in doc.get("arms") or []:
        # the values the runs recorded, in the order of the arm's knobs
        recorded = " ".join(str(v) for v in (row.get("actual") or {}).values())
        label, style = _VERDICT.get(row.get("verdict"), (str(row.get("verdict")), ""))
        ratio = row.get("ratio")
        if row.get("verdict") in ("faster", "slower") and ratio:
            label += f" {1 / ratio:.2f}×" if ratio < 1 else f" {ratio:.2f}×"
        ci = row.get("ci")
        mean = row.get("mean_per_sample_s") if per_sample else row.get("mean_s")
        base = row.get("baseline")
        cells: list[Any] = [
            row["name"] + (" (base)" if base else ""),
            recorded,
            f"{row.get('trials_usable', 0)}/{row.get('trials_run', 0)}",
            str(row.get("steady_steps", 0)),
            fmt_time(mean),
            fmt_time(row.get("median_s")),
            _rate(row.get("samples_per_s")),
            "—" if base else fmt_ratio(ratio),
            "—" if base or not ci else f"{fmt_ratio(ci[0])}–{fmt_ratio(ci[1])}",
            Text(label, style=style),
        ]
        if peak:
            util = row.get("flops_utilization")
            cells.append("—" if util is None else utilization_text(util))
        table.add_row(*cells)
    # the arm wraps between its knobs (its min_width: the longest of them), so the table
    # keeps to the console's width; the verdict stays whole
    return keep_numbers_whole(table, cut="recorded", keep=("verdict",))


def render_tune(doc: dict[str, Any], file: IO[str] | None = None) -> None:
    """Print a tune result (the document of :func:`trainprof.experiments.tune.tune_command`)."""
    out = file if file is not None else sys.stdout
    console = make_console(out)
    # prose wraps at the console width (120 off a terminal); the path below does not
    console.print(headline(doc), soft_wrap=False)
    status = doc.get("status")
    done, planned = doc.get("trials_done"), doc.get("trials_planned")
    per_arm = doc.get("trials_per_arm")
    metric = "time per sample" if doc.get("metric") == "time_per_sample" else "time per step"
    console.print(Text(
        f"{doc.get('target')}: {len(doc.get('arms') or [])} arms ({doc.get('design')}), "
        f"{per_arm} trial{'s' if per_arm != 1 else ''} each of up to {doc.get('steps')} steps"
        + _ended_text(doc.get("script_ended_after")) + "; "
        f"{done}/{planned} trials run"
        + (f" ({status})" if status != "finished" else "")
        + f"; mean steady-state {metric} compared",
        style="dim",
    ), soft_wrap=False)
    console.print()
    console.print(_arms_table(doc))
    best = doc.get("best")
    rows = {r["name"]: r for r in doc.get("arms") or []}
    if best:
        nxt = (rows.get(best["name"]) or {}).get("top_finding")
        if nxt:
            console.print()
            console.print(Text.assemble(
                ("Next, with " + best["name"] + ": ", "bold"),
                f"[{nxt.get('category')}] {nxt.get('title')}",
            ), soft_wrap=False)
    notes = doc.get("notes") or []
    if notes:
        console.print()
        for note in notes:
            console.print(Text(f"• {note}", style="yellow"), soft_wrap=False)
    console.print()
    threshold = doc.get("practical_threshold_pct")
    paired = any(a.get("paired") for a in doc.get("arms") or [])
    console.print(Text(
        "recorded: the setting the runs really had; trials: usable/run; steps: steady steps "
        f"pooled; time/{'sample' if doc.get('metric') == 'time_per_sample' else 'step'}: "
        "their mean (what is compared); vs base: its ratio to the baseline's, <1 is faster; "
        "significant: the "
        f"{round(float(doc.get('confidence') or .95) * 100)}% interval (bootstrap over trials "
        f"and steps{', paired by round' if paired else ''}) excludes ×1 and the change is at "
        f"least {threshold:g}%.",
        style="dim",
    ), soft_wrap=False)
    console.print(Text(f"Runs and tune.json: {doc.get('tune_dir')}", style="dim"))
    executor = doc.get("executor")
    if isinstance(executor, dict):
        jobs = [str(j.get("job_id")) for j in executor.get("jobs") or []]
        hosts = sorted({str(t["host"]) for a in doc.get("arms") or []
                        for t in a.get("trials") or [] if t.get("host")})
        cluster = (executor.get("parameters") or {}).get("cluster", "?")
        console.print(Text(
            f"Rounds as jobs ({cluster}, submitit; one round's arms on one node): "
            + (", ".join(jobs) or "none submitted")
            + (f"; nodes {', '.join(hosts)}" if hosts else "")
            + f"; logs in {doc.get('tune_dir')}/submitit", style="dim"))
