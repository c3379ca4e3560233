"""Build of the optional C fast path of the step clock (everything else is in pyproject.toml).

``optional=True``: where the extension cannot be compiled (no compiler, no Python
headers), the install still succeeds and trainprof runs its pure-Python path
(see :mod:`trainprof.capture.clock`).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "trainprof.capture._fastclock",
            sources=["src/trainprof/capture/_fastclock.c"],
            optional=True,
        )
    ]
)
