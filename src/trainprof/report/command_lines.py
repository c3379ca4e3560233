"""The commands a report prints for the user to run, set apart from the prose around them.

A finding's verify line mixes prose and commands ("`trainprof run train.py` after the
change, then trainprof compare RUN NEW_RUN: the data wait should fall"). Wrapped as one
paragraph, a command broke where the line did, and its first line pasted alone ran without
its last arguments. The finding names its commands (``verify_commands``, exactly as the line
has them), so every report splits the line at them: the terminal prints each command whole
on a line of its own, the HTML report each in a code block, and the prose between them
stays prose. The same words, in the same order, reach the reader in every report.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["split_commands", "verify_parts"]

#: What joins a command to the prose after it, dropped once the command has a line of its
#: own ("...train.py; the most any input fix can give: ..." reads "the most any ...").
_JOINERS = ";:,"


def split_commands(text: str, commands: Sequence[str]) -> list[tuple[str, bool]]:
    """``text`` as ``(part, is_command)`` pairs, in order: the ``commands`` (each found from
    where the last one ended) and the prose between them, stripped, empty prose left out.

    A command the line quotes in backticks loses them (its line is the quote), and one in
    parentheses loses those ("raised to 10 (`trainprof run ...`)": the prose ends, the
    command follows). A command not found in ``text`` (a record written otherwise) comes
    after it rather than not at all.
    """
    parts: list[tuple[str, bool]] = []
    missing: list[str] = []
    at = 0
    for command in commands:
        start = text.find(command, at) if command else -1
        if start < 0:
            missing.append(command)
            continue
        end = start + len(command)
        before = text[at:start]
        if before.endswith("`") and text.startswith("`", end):
            before, end = before[:-1], end + 1
        if before.rstrip().endswith("(") and text[end:].lstrip().startswith(")"):
            before = before.rstrip()[:-1]
            end = text.index(")", end) + 1
        _add_prose(parts, before)
        parts.append((command, True))
        at = end
    _add_prose(parts, text[at:])
    parts += [(command, True) for command in missing if command]
    return parts


def _add_prose(parts: list[tuple[str, bool]], prose: str) -> None:
    """Append ``prose``, less what joined it to a command just before; nothing if empty."""
    if parts and parts[-1][1]:
        prose = prose.lstrip().lstrip(_JOINERS)
    prose = " ".join(prose.split())
    if prose:
        parts.append((prose, False))


def verify_parts(finding: dict[str, Any]) -> list[tuple[str, bool]]:
    """A finding's verify line split at its commands (:func:`split_commands`); a finding
    recorded before it named them is one part of prose."""
    commands = [str(c) for c in finding.get("verify_commands") or []]
    return split_commands(str(finding.get("verify") or ""), commands)
