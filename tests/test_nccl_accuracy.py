"""parsim's collectives against published nccl-tests results (parsim/validation/nccl_tests.yaml).

Loose bounds that catch regressions, not a claim of accuracy: docs/nccl-accuracy.md
has the table and why the 16 MiB and 128 MiB rows are too fast (NCCL's own
tuning model, which parsim follows, is optimistic at those sizes).
"""

from __future__ import annotations

import statistics

import pytest

from parsim.cluster import builtin_clusters
from parsim.validation.nccl_tests import compare, sources


@pytest.fixture(scope="module")
def rows():
    return compare()


def test_every_published_figure_names_its_source_and_hardware():
    for src in sources():
        assert src["url"].startswith("https://github.com/") and src["hardware"] and "nccl_version" in src
        assert src["cluster"] in builtin_clusters() and src["rows"]


def test_median_error_stays_within_its_documented_level(rows):
    assert statistics.median(abs(r.error) for r in rows) <= 0.25


def test_large_messages_are_within_fifteen_percent(rows):
    large = [r for r in rows if r.size >= 2**30]
    assert len(large) >= 5 and all(abs(r.error) <= 0.15 for r in large)


def test_no_row_is_predicted_slower_than_published_by_more_than_ten_percent(rows):
    # The known error is one-sided (too fast at medium sizes); a prediction far slower is a regression.
    assert min(r.error for r in rows) >= -0.10
