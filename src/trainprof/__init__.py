"""trainprof: is this training run really the fastest it can go, and if not, what do I change?

``trainprof run train.py`` profiles an unmodified script; ``trainprof.profile()``
is the Python API for those who want control.

The API is imported on first use (PEP 562): the system sampler's child process
imports ``trainprof.capture.sampler_process`` and should not pay for numpy and
the run store it never uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["NullProfile", "Profile", "__version__", "profile"]

if TYPE_CHECKING:
    from trainprof.api import NullProfile, Profile, profile


def __getattr__(name: str) -> Any:
    if name in ("NullProfile", "Profile", "profile"):
        from trainprof import api

        return getattr(api, name)
    raise AttributeError(f"module 'trainprof' has no attribute {name!r}")
