"""The one-line impact of a finding, as every renderer states it.

A finding's ``estimated_gain`` is the share of step time its fix could remove, a bound,
except where the finding's evidence says it is an estimate (``gain_is_estimate``: counted,
not timed); some findings remove none and matter for another reason, which the line then
says.
"""

from __future__ import annotations

from typing import Any

#: what a finding with no estimated gain is for, by category
NO_GAIN = {
    "memory": "no speed-up: it is about memory, not time",
}
NO_GAIN_DEFAULT = "no speed-up: it qualifies the numbers above"
#: ... and by cause, where the category's line would be wrong
_REPEATED_DATA = "no faster step: fewer of them (each epoch repeats its data)"
NO_GAIN_CAUSE = {"iterable_not_split": _REPEATED_DATA, "every_rank_reads_all_data": _REPEATED_DATA}


#: a finding whose speed-up no measurement bounds (evidence ``gain_unknown``)
GAIN_UNKNOWN = "speed-up not estimated: its verify line measures it"


def impact_text(finding: dict[str, Any]) -> str:
    gain = float(finding.get("estimated_gain") or 0.0)
    if gain > 0 and (finding.get("evidence") or {}).get("gain_is_estimate"):
        # an estimate, not a bound (a Python loop's share of torch calls: its measured fix
        # saved 41% where the line had said "up to 33%")
        return f"could save about {gain * 100:.0f}% of step time (an estimate: often more)"
    if gain > 0:
        return f"could save up to {gain * 100:.0f}% of step time"
    if (finding.get("evidence") or {}).get("gain_unknown"):
        return GAIN_UNKNOWN
    cause = NO_GAIN_CAUSE.get(str(finding.get("cause")))
    return cause or NO_GAIN.get(str(finding.get("category")), NO_GAIN_DEFAULT)
