"""Shared by the executor tests: one step of each plan on gloo ranks, checked against the reference."""

from __future__ import annotations


def verify_plans(plans: dict, world: int, timeout_s: float = 120) -> list[list[dict]]:
    """Per rank, per plan: the rank's loss, gradient and weight errors against the single-process model."""
    from executor.launch import launch
    from executor.train.verify import verify_rank

    return launch(verify_rank, world, ([p.to_dict() for p in plans.values()], 0, True), backend="gloo",
                  timeout_s=timeout_s)


def assert_step_equals_reference(plan, runs: list[dict]) -> None:
    """Every rank's gradients and updated weights equal the reference's; each replica's loss is reported by
    all of its last-stage ranks (one per tp and cp coordinate) and equals the reference loss on its rows."""
    import pytest

    losses = 0
    for rank, r in enumerate(runs):
        if r["loss"] is not None:
            losses += 1
            assert r["loss"] == pytest.approx(r["reference_loss"], rel=1e-5), f"rank {rank}"
        assert r["max_grad_error"] < 1e-5, f"rank {rank}: {r['worst_grad']}"
        assert r["max_param_error"] < 1e-4, f"rank {rank}"
    assert losses == plan.dp * plan.cp * plan.tp


def assert_events_as_simulated(plan, runs: list[dict]) -> None:
    """On every simulated rank: the event names of the lowered program, and each communication event as
    many times."""
    from collections import Counter

    from parsim.lower import lower

    program = lower(plan)
    for rank in program.ranks:
        predicted = program.rank_ops(rank)
        measured = runs[rank]["events"]
        assert set(measured) == {op.name for op in predicted}, f"rank {rank}"
        comm = Counter(op.name for op in predicted if op.kind in ("collective", "send", "recv"))
        assert Counter(n for n in measured if n in comm) == comm, f"rank {rank}"
