"""DESIGN.md's pipeline: each stage depends only on the stages to its left.

``analysis`` reads a Run folder (or someone else's trace) and never imports ``capture``; the
``diagnosis`` is pure functions of its metrics; a
``report`` renders metrics and never computes them from the capture either. A constant both
sides need (what a record's field means) lives in :mod:`trainprof.schema`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import trainprof

PACKAGE = Path(trainprof.__file__).parent


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_analysis_diagnosis_and_report_never_import_capture():
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(m for m in _imports(path)
                                               if m.startswith("trainprof.capture"))
        for stage in ("analysis", "diagnosis", "report")
        for path in sorted((PACKAGE / stage).rglob("*.py"))
    }
    assert {k: v for k, v in offenders.items() if v} == {}
