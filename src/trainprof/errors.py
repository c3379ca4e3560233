"""Errors the user can fix: the CLI prints them as one ``error: ...`` line and exits 2."""


class UsageError(Exception):
    """Bad input: a missing file, an unreadable record, a bad option."""
