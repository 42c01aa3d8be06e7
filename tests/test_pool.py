"""Simulations side by side (:mod:`parsim.sim.pool`): the same predictions as one after another, in order."""

from simulated import step_and_memory

from parsim.hardware.cluster import load_cluster
from parsim.sim.pool import simulate_each
from parsim.workload.plan import resolve_plan


def test_plans_simulated_side_by_side_come_back_in_order_with_the_serial_predictions():
    cluster = load_cluster("dgx-h100")
    plans = [resolve_plan("tiny-dp2"), resolve_plan("tiny-pp2"), resolve_plan("tiny-tp2"), resolve_plan("course-pp")]
    done = []
    results = simulate_each(step_and_memory, plans, cluster, lambda finished, total: done.append((finished, total)))
    assert results == [step_and_memory(plan, cluster) for plan in plans]
    assert done == [(1, 4), (2, 4), (3, 4), (4, 4)]
