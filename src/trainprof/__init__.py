"""trainprof: is this training run really the fastest it can go, and if not, what do I change?

``trainprof run train.py`` profiles an unmodified script; ``trainprof.profile()``
is the Python API for those who want control.
"""

__version__ = "0.1.0"

from trainprof.api import NullProfile, Profile, profile  # noqa: E402

__all__ = ["NullProfile", "Profile", "__version__", "profile"]
