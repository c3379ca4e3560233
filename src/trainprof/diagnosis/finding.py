"""A finding: one bottleneck, the numbers that show it, what to change, how to prove it.

The fields are a **contract** (DESIGN.md, "Findings"): the ``--json`` output of
``run``, ``report`` and ``trace`` is a list of :meth:`Finding.to_dict` documents,
highest ``estimated_gain`` first. Validation happens here, at construction, so a
rule cannot emit a category outside the vocabulary, a finding without evidence
("no finding without evidence", DESIGN.md principles), a gain that is not a
fraction of step time, or a verify command its verify line does not hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

#: The category vocabulary (**contract**, DESIGN.md). Finer causes go in ``cause``.
CATEGORIES: tuple[str, ...] = (
    "input_pipeline",
    "host_to_device",
    "host_launch",
    "synchronization",
    "compute",
    "python_loop",
    "memory",
    "gc",
    "cpu_contention",
    "distributed",
    "periodic_overhead",
    "measurement_noise",
)

SEVERITIES: tuple[str, ...] = ("high", "medium", "low")


def _plain(value: Any) -> Any:
    """Evidence as plain JSON types: numpy scalars become Python numbers, floats are rounded.

    The JSON renderer does not serialise numpy types, and 17 significant digits of a
    time share are noise to a reader; 4 significant digits keep every number checkable.
    """
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and callable(value.item) and not isinstance(value, str):
        try:
            value = value.item()  # numpy scalar
        except (TypeError, ValueError):
            return value
    if isinstance(value, bool) or value is None or isinstance(value, int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or value == 0:
            return value
        return float(f"{value:.4g}")
    return value


@dataclass(frozen=True)
class Fix:
    """What to change: prose for a newcomer, and a snippet fitted to what was measured."""

    text: str
    snippet: str = ""


@dataclass
class Finding:
    """One diagnosed bottleneck (see the module docstring for the contract)."""

    category: str
    cause: str
    title: str
    severity: str
    evidence: dict[str, Any]
    estimated_gain: float
    fix: Fix
    verify: str
    #: The registered rule that produced it (filled in by the registry); not part of the
    #: contract, but it tells a maintainer which module to read.
    rule: str = field(default="")
    #: (category, cause) of findings this one's fix makes moot, whose advice would
    #: contradict it (the registry drops them and names them in this one's evidence):
    #: "num_workers=0" leaves no workers to compete for cores.
    supersedes: tuple[tuple[str, str], ...] = field(default=())
    #: The commands in ``verify`` for the user to run, each exactly as it stands there, in
    #: order: a report prints each whole on a line of its own and wraps only the prose
    #: around it (wrapped with the prose, "... --data" / "/data/train" pasted its first
    #: line without the argument). A field beside ``verify``, whose text stays as it was:
    #: ``trainprof verify`` and JSON readers parse that line.
    verify_commands: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise ValueError(f"unknown finding category {self.category!r}")
        if self.severity not in SEVERITIES:
            raise ValueError(f"unknown severity {self.severity!r}")
        if not self.evidence:
            raise ValueError("a finding needs the evidence that fired it")
        if not self.cause or not self.title or not self.verify or not self.fix.text:
            raise ValueError("a finding needs a cause, a title, a fix and a way to verify it")
        for command in self.verify_commands:
            if not command or command not in self.verify:
                raise ValueError(f"verify command {command!r} is not in the verify line")
        gain = float(self.estimated_gain)
        if not math.isfinite(gain):
            raise ValueError("estimated_gain must be finite")
        # An Amdahl upper bound on the share of step time: clip rounding drift.
        self.estimated_gain = min(1.0, max(0.0, gain))

    def to_dict(self) -> dict[str, Any]:
        """The JSON document of the finding (the contract's fields, plus ``rule``)."""
        return {
            "category": self.category,
            "cause": self.cause,
            "title": self.title,
            "severity": self.severity,
            "evidence": _plain(self.evidence),
            "estimated_gain": round(self.estimated_gain, 4),
            "fix": {"text": self.fix.text, "snippet": self.fix.snippet},
            "verify": self.verify,
            "verify_commands": list(self.verify_commands),
            "rule": self.rule,
        }


def band(value: float, high: float, medium: float, low: float | None = None) -> str | None:
    """Severity band of ``value`` (TF's high/moderate bands, expert-rules.md "Gaps" #2).

    Returns ``None`` below the lowest band: the rule should then report nothing.
    """
    if value >= high:
        return "high"
    if value >= medium:
        return "medium"
    if low is not None and value >= low:
        return "low"
    return None


def sweep(current: int, suggested: int) -> list[int]:
    """Values for a knob sweep in a ``verify`` line: current, powers of two between, suggested."""
    values = {current, suggested}
    p = 1
    while p < suggested:
        if p > current:
            values.add(p)
        p *= 2
    return sorted(values)
