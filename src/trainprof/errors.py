"""Errors the user can fix: the CLI prints them as one ``error: ...`` line and exits 2."""


class UsageError(Exception):
    """Bad input: a missing file, an unreadable record, a bad option."""


def missing_package(option: str, package: str, extra: str,
                    exc: ImportError | None = None) -> UsageError:
    """The error for an option whose optional package (a ``trainprof[extra]``) is missing:
    what to install, and Python's own reason when it is more than "not installed"."""
    why = f" ({exc})" if exc is not None else ""
    return UsageError(f"{option} needs the {package} package: "
                      f"pip install 'trainprof[{extra}]'{why}")
