"""Diagnosis: from the measurements of a run to ranked, actionable, verifiable findings.

One small module per rule family (:data:`registry.FAMILIES`), each rule a pure
function of a :class:`~trainprof.diagnosis.context.Context` (the run summary plus
its per-step records); :func:`diagnose` runs them all and ranks the findings by
estimated gain. See DESIGN.md ("Findings") for the contract of a finding.
"""

from trainprof.diagnosis.finding import CATEGORIES, Finding, Fix
from trainprof.diagnosis.registry import diagnose, rule, rules

__all__ = ["CATEGORIES", "Finding", "Fix", "diagnose", "rule", "rules"]
