"""Experiments: run an unmodified script with knobs changed, compare the runs with statistics.

:mod:`trainprof.experiments.tune` runs the trials (``trainprof tune``);
:mod:`trainprof.experiments.stats` holds the two-level bootstrap that compares them.
"""
