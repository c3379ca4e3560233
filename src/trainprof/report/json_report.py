"""The ``--json`` output: one JSON document on stdout, nothing else."""

from __future__ import annotations

import math
import sys
from typing import IO, Any

import orjson


def _clean(value: Any) -> Any:
    """NaN/inf are not JSON; they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def render_json(document: dict[str, Any], file: IO[str] | None = None) -> None:
    out = file if file is not None else sys.stdout
    out.write(orjson.dumps(_clean(document), option=orjson.OPT_INDENT_2).decode())
    out.write("\n")
    out.flush()
