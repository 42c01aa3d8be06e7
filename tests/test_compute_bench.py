"""The CPU compute microbenchmarks run on gloo ranks as ``parsim calibrate`` runs them, and their fits read them."""

from __future__ import annotations

import pytest

from parsim.calibrate import fit_alone_memory, fit_optimizer
from parsim.lower import ADAMW_ACCESSES

pytest.importorskip("torch")

RUNS, ALONE = ((16, 256), (2, 1 << 16)), (2, 1 << 16)


def host_optimizer(rank: int, world: int) -> dict:
    from executor.compute_bench import measure_host_optimizer

    return measure_host_optimizer(RUNS, ALONE)


@pytest.mark.multiproc
def test_adamw_is_timed_on_every_rank_at_once_and_on_each_rank_alone():
    from executor.launch import launch

    per_rank = launch(host_optimizer, 2, backend="gloo", timeout_s=120)
    for rows in per_rank:
        assert [row[:2] for row in rows["together"]] == list(RUNS)
        assert [row[:2] for row in rows["alone"]] == [ALONE]  # each rank times its own turn
        assert all(row[2] > 0 for row in rows["together"] + rows["alone"])
    fit = fit_optimizer([row for rows in per_rank for row in rows["together"]], ADAMW_ACCESSES)
    assert fit_alone_memory([row for rows in per_rank for row in rows["alone"]], fit.tensor_s, ADAMW_ACCESSES) > 0


@pytest.mark.multiproc
def test_the_pipeline_s_host_costs_are_timed_with_two_ranks_on_each_core():
    from executor.compute_bench import measure_on_shared_cores

    rows = measure_on_shared_cores(timeout_s=120)
    assert len(rows) in (2, 4)  # 2 cores (or 1) shared by twice as many ranks
    for row in rows:
        assert set(row["p2p"]) == {"rendezvous", "latency"} and min(row["p2p"].values()) > 0
        assert row["actions"] > 0
