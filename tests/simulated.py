"""Many plans event-simulated side by side, a process per core (:func:`parsim.sim.pool.simulate_each`): for the
tests that hold the search's fast tier to the simulation plan by plan."""

from __future__ import annotations

from parsim.hardware.cluster import ClusterSpec
from parsim.sim.pool import simulate_each
from parsim.sim.step import predict_step
from parsim.workload.plan import Plan


def step_and_memory(plan: Plan, cluster: ClusterSpec) -> tuple[float, float]:
    """A plan's simulated step and its peak memory per GPU: what the fast tier is compared with."""
    prediction = predict_step(plan, cluster)
    return prediction.step_s, max(m.total for m in prediction.memory)


def steps_and_memory(plans: list[Plan], cluster: ClusterSpec) -> list[tuple[float, float]]:
    """:func:`step_and_memory` of every plan, in order."""
    return simulate_each(step_and_memory, plans, cluster)
