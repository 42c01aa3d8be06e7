"""Simulations side by side (:mod:`parsim.sim.pool`): the same predictions as one after another, in order."""

from parsim.hardware.cluster import load_cluster
from parsim.sim.pool import simulate_each
from parsim.sim.step import predict_step
from parsim.workload.plan import resolve_plan


def _step_s(plan, cluster) -> float:
    return predict_step(plan, cluster).step_s


def test_plans_simulated_side_by_side_come_back_in_order_with_the_serial_predictions():
    cluster = load_cluster("dgx-h100")
    plans = [resolve_plan("tiny-dp2"), resolve_plan("tiny-pp2"), resolve_plan("tiny-tp2"), resolve_plan("course-pp")]
    done = []
    steps = simulate_each(_step_s, plans, cluster, lambda finished, total: done.append((finished, total)))
    assert steps == [_step_s(plan, cluster) for plan in plans]
    assert done == [(1, 4), (2, 4), (3, 4), (4, 4)]
