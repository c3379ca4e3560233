"""The rule registry and :func:`diagnose`: every rule family, run on one run, ranked.

A rule is a pure function ``Context -> Finding | Iterable[Finding] | None``,
registered with :func:`rule`. Each family lives in its own module (listed in
:data:`FAMILIES`) and is imported the first time :func:`diagnose` runs, so the
registry stays importable without torch or any rule's dependencies.

Robustness: a report must never fail because one rule met a run it did not
expect (a crashed run with three steps, a trace with no step records, a field a
newer capture renamed). A rule that raises is skipped and adds nothing; the
exception is logged at debug level for whoever maintains that rule.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from trainprof.diagnosis.context import Context
from trainprof.diagnosis.finding import SEVERITIES, Finding

log = logging.getLogger(__name__)

RuleResult = Finding | Iterable[Finding] | None
RuleFn = Callable[[Context], RuleResult]

#: Rule-family modules under ``trainprof.diagnosis`` (one small module per family).
FAMILIES: tuple[str, ...] = (
    "input_pipeline",
    "loader_thread",
    "iterable_split",
    "loop_code",
    "periodic",
    "gc",
    "optimizer",
    "embedding",
    "recompile",
    "zero_grad",
    "debug_modes",
    "eval_autograd",
    "memory_growth",
    "contention",
    "cpu_threads",
    "padding",
    "checkpointing",
    "precision",
    "channels_last_cpu",
    "float64",
    "small_batch",
    "attention",
    "fusion",
    "sync",
    "noise",
    "python_loop",
    "device",
    "tf32",
    "distributed",
    "ddp",
)

_RULES: dict[str, RuleFn] = {}
_loaded = False


def rule(name: str) -> Callable[[RuleFn], RuleFn]:
    """Register ``fn`` under ``name`` (``family.rule``); names must be unique."""

    def register(fn: RuleFn) -> RuleFn:
        if name in _RULES and _RULES[name] is not fn:
            raise ValueError(f"rule {name!r} registered twice")
        _RULES[name] = fn
        return fn

    return register


def _load_families() -> None:
    global _loaded
    if not _loaded:
        for family in FAMILIES:
            importlib.import_module(f"trainprof.diagnosis.{family}")
        _loaded = True


def rules() -> dict[str, RuleFn]:
    """All registered rules, by name (loads the families on first use)."""
    _load_families()
    return dict(_RULES)


def _as_list(result: RuleResult) -> list[Finding]:
    if result is None:
        return []
    if isinstance(result, Finding):
        return [result]
    return [f for f in result if f is not None]


def merge(findings: list[Finding]) -> list[Finding]:
    """One finding per (category, cause): the largest gain wins, the others' evidence joins it.

    Families are written so that one bottleneck produces one finding; this is the
    safety net when two rules reach the same conclusion from different numbers.
    """
    by_key: dict[tuple[str, str], Finding] = {}
    for f in findings:
        key = (f.category, f.cause)
        kept = by_key.get(key)
        if kept is None:
            by_key[key] = f
            continue
        winner, other = (f, kept) if f.estimated_gain > kept.estimated_gain else (kept, f)
        for k, v in other.evidence.items():
            winner.evidence.setdefault(k, v)
        by_key[key] = winner
    return list(by_key.values())


def drop_superseded(findings: list[Finding]) -> list[Finding]:
    """Findings whose advice another finding's fix makes moot are dropped, and named in
    that finding's evidence (``supersedes``): two snippets that contradict each other
    ("num_workers=0" and "keep the 2 workers") leave a reader with neither."""
    present = {(f.category, f.cause) for f in findings}
    dropped: set[tuple[str, str]] = set()
    for f in findings:
        moot = [key for key in f.supersedes if key in present and key != (f.category, f.cause)]
        if moot:
            f.evidence["supersedes"] = [f"{c}/{cause}" for c, cause in moot]
            dropped.update(moot)
    return [f for f in findings if (f.category, f.cause) not in dropped]


def rank(findings: list[Finding]) -> list[Finding]:
    """Highest estimated gain first; ties by severity, then by name for a stable order."""
    return sorted(
        findings,
        key=lambda f: (-f.estimated_gain, SEVERITIES.index(f.severity), f.category, f.cause),
    )


def diagnose(
    summary: dict[str, Any], steps: np.ndarray | None = None, *, only: Iterable[str] | None = None,
    device: np.ndarray | None = None,
) -> list[dict[str, Any]]:
    """Run every rule (or those named in ``only``) on a run summary and its step records.

    ``steps`` is the run's per-step record array (:data:`trainprof.store.STEP_DTYPE`);
    rules that need it report nothing without it (e.g. for a trace). ``device``: its
    CUDA-event time per step (:data:`trainprof.store.DEVICE_DTYPE`), where it has any.
    Returns the findings as JSON documents, highest estimated gain first.
    """
    try:
        ctx = Context(summary, steps, device)
    except Exception:  # a summary we cannot read at all: no findings, never a crash
        log.debug("diagnosis context failed", exc_info=True)
        return []
    wanted = set(only) if only is not None else None
    found: list[Finding] = []
    for name, fn in rules().items():
        if wanted is not None and name not in wanted:
            continue
        try:
            produced = _as_list(fn(ctx))
        except Exception:
            log.debug("diagnosis rule %s failed; skipped", name, exc_info=True)
            continue
        for f in produced:
            f.rule = name
        found.extend(produced)
    return [f.to_dict() for f in rank(drop_superseded(merge(found)))]
