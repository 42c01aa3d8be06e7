"""parsim: predict what a distributed-training parallelism plan costs, and why.

The core package (everything under ``parsim``) needs no torch; the paired
executor lives in the top-level ``executor`` package.
"""

__version__ = "0.1.0"
