"""The terminal view of ``trainprof verify``'s verdict (rich). It renders; it computes nothing.

Printed after tune's own table: a line that sets the saving measured (with its interval)
against the finding's estimate, and what to do about it, wrapped at the console's width as
tune's prose is.
"""

from __future__ import annotations

import sys
from typing import IO, Any

from rich.text import Text

from trainprof.report.console import fmt_ratio, make_console
from trainprof.report.terminal import utilization_text
from trainprof.report.tune_terminal import load_text

_STYLE = {"confirmed": "bold green", "beyond the bound": "bold green",
          "not confirmed": "bold yellow", "refuted": "bold red", "did not help": "bold yellow",
          "no data": "bold yellow",
          "unsettled": "bold yellow", "not applicable": "bold yellow"}


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x * 100:.0f}%"




def verdict_line(result: dict[str, Any]) -> Text:
    """``Verdict: confirmed - ARM ran at ×0.75 of the baseline's step time (95% CI
    ×0.68–×0.85), 25% saved; the finding said up to 34%: apply the fix`` and the like.

    A knob that is not the finding's fix (``role``, experiments/verify.knob_role) gets a
    second line that says what it measured and how the fix itself is measured: an aside's
    verdict is the knob's, and a bound's (``synthetic_data``) is a ceiling, not a fix to
    apply ("beyond the bound ... apply the fix" once sent a user to apply synthetic data)."""
    verdict = str(result.get("verdict"))
    role = result.get("role") or ("aside" if result.get("aside") else "fix")
    line = Text()
    line.append(f"Verdict: {verdict}", style=_STYLE.get(verdict, "bold"))
    estimate = ("the finding's fix is a code change, not measured here: this is its verify "
                "line's aside" if role == "aside"
                else "its gain was not estimated" if result.get("gain_unknown")
                else f"the finding said up to {_pct(result.get('estimated_gain'))}")
    if result.get("arm") is None:
        line.append(f" - no arm has a usable measurement; {estimate}")
        return line
    lo, hi = result.get("ci") or (None, None)
    # trials flagged under outside load, named in the verdict (tune's notes list each one)
    load = load_text([{"outside_load": x} for x in result.get("outside_load") or []])
    per = "time per sample" if result.get("metric") == "time_per_sample" else "step time"
    one_trial = verdict == "unsettled" and result.get("unsettled_by") == "one_trial"
    measured = (f"{result['arm']} ran at {fmt_ratio(result['ratio'])} of the baseline's {per} "
                + (f"(one trial a side: its 95% CI {fmt_ratio(lo)}–{fmt_ratio(hi)} is within "
                   "that trial only)" if one_trial
                   else f"(95% CI {fmt_ratio(lo)}–{fmt_ratio(hi)})"))
    if verdict in ("confirmed", "beyond the bound"):
        measured += (f", {_pct(result.get('saving'))} off with the input made free"
                     if role == "bound" else f", {_pct(result.get('saving'))} saved")
    advice = {
        "confirmed": "keep that setting" if role == "aside" else "apply the fix",
        "beyond the bound": "apply the fix; the estimate was too low (worth reporting)",
        "not confirmed": "no significant difference: more --trials, or the fix does not "
                         "matter here",
        "refuted": "keep the current setting",
        "did not help": "keep the current setting",
        "not applicable": "the knob changed nothing in this script (see tune's notes)",
        "unsettled": "its trials disagree too much to tell the size (a trial ran far slower "
                     f"than the others: {load or 'outside load?'}); rerun with more --trials "
                     "on a quieter machine",
    }.get(verdict, "")
    if one_trial:  # an interval over one trial's steps says nothing of the next trial
        advice = ("one trial per arm cannot tell the fix from the noise between trials (trials "
                  "of one setting can differ by tens of percent): rerun with --trials 3 or "
                  "more")
    if role == "aside" and verdict == "not confirmed":
        advice = "no significant difference: more --trials, or the knob does not matter here"
    if role == "bound":  # the step with the input free: what it says of the estimate
        advice = {
            "confirmed": "the estimate holds as the ceiling",
            "beyond the bound": "the estimate was too low (worth reporting)",
            "not confirmed": "no significant difference: more --trials, or the input does "
                             "not set the pace here",
            "refuted": "the step was no faster with the input made free: no input fix can "
                       "help here",
        }.get(verdict, advice)
    if load and (verdict != "unsettled" or one_trial):
        advice += f" ({load})" if advice else load
    rounds = result.get("round_ratios")
    if verdict == "unsettled" and rounds:
        measured += " - by round " + ", ".join(fmt_ratio(r) for r in rounds)
    if role == "aside":  # the estimate is not the knob's to meet: the line below says why
        line.append(f" - {measured}" + (f": {advice}" if advice else ""))
    else:
        line.append(f" - {measured}; {estimate}" + (f": {advice}" if advice else ""))
    main = result.get("main_fix")
    if role == "aside":
        line.append(f"\n{result['arm']} measures only an aside of this finding, and the "
                    "verdict is the knob's: the finding's main fix is a code change, not "
                    "measured here"
                    + (f" - measure it as its verify line says: {main}" if main else ""))
    elif role == "bound":
        line.append(f"\n{result['arm']} makes the input free: this is the most any input "
                    "fix can give here, a ceiling, not a fix to apply"
                    + (f". Measure the fix itself next, as its verify line says: {main}"
                       if main and verdict != "refuted" else ""))
    return line


def after_line(result: dict[str, Any]) -> str | None:
    """How near the machine's matmul peak the steps ran with the fix, and before it (tune's
    table has named the next finding already)."""
    if result.get("arm") is None or result.get("verdict") not in ("confirmed",
                                                                   "beyond the bound"):
        return None
    before, after = result.get("flops_utilization") or (None, None)
    if after is None:
        return None
    return (f"With {result['arm']} the steps' FLOPs ran at {utilization_text(after)} of this "
            "machine's matmul peak" + (f" ({utilization_text(before)} before)"
                                       if before is not None else ""))


def render_verdict(result: dict[str, Any], file: IO[str] | None = None) -> None:
    """Print the verdict line and where the trials are."""
    console = make_console(file if file is not None else sys.stdout)
    console.print()
    # prose wraps at the console's width, as tune's headline above it does (unwrapped, the
    # verdict ran 300 columns on); the path stays whole on its line, to be copied
    console.print(verdict_line(result), soft_wrap=False)
    after = after_line(result)
    if after:
        console.print(after, soft_wrap=False)
    console.print(Text(f"trials and verify.json: {result.get('tune_dir')}", style="dim"))
