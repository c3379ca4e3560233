"""trainprof: is this training run really the fastest it can go, and if not, what do I change?"""

__version__ = "0.1.0"
