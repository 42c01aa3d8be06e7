"""Shared by the executor tests: one step of each plan on gloo ranks, checked against the reference."""

from __future__ import annotations


def verify_plans(plans: dict, world: int, timeout_s: float = 120) -> list[list[dict]]:
    """Per rank, per plan: the rank's loss, gradient and weight errors against the single-process model."""
    from executor.launch import launch
    from executor.train.verify import verify_rank

    return launch(verify_rank, world, ([p.to_dict() for p in plans.values()], 0, True), backend="gloo",
                  timeout_s=timeout_s)
