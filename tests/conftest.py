"""Hypothesis draws the same examples on every run (derandomized), so a test run, CI's included, passes or fails
on the code alone; a failure is reproduced by running the suite again. ``HYPOTHESIS_PROFILE=explore`` draws fresh
random examples (500 where a test sets no count of its own) to look for new failures: random draws found the
instant join pinned in ``tests/test_engine_properties.py``."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False, max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))
