"""Shared by the executor tests: one step of each plan on gloo ranks, checked against the reference."""

from __future__ import annotations

BF16_EPS = 2.0 ** -7  # the gap between 1 and the next bf16 value
FP16_EPS = 2.0 ** -10  # the gap between 1 and the next fp16 value
# A first AdamW step moves every weight by ±lr (1e-3) whatever the size of its gradient, so a gradient that
# bf16 or fp16 rounds to the other sign moves its weight 2e-3 the other way: 3% of the tiny model's largest weights.
FIRST_STEP_SIGN_FLIP = 0.05


def verify_plans(plans: dict, world: int, timeout_s: float = 120) -> list[list[dict]]:
    """Per rank, per plan: the rank's loss, gradient and weight errors against the single-process model."""
    from executor.launch import launch
    from executor.train.verify import verify_rank

    return launch(verify_rank, world, ([p.to_dict() for p in plans.values()], 0, True), backend="gloo",
                  timeout_s=timeout_s)


def plan_runs(results: list[list[dict]], plans: dict, name: str) -> list[dict]:
    """Every rank's result for plan ``name`` out of :func:`verify_plans` over ``plans``."""
    index = list(plans).index(name)
    return [per_rank[index] for per_rank in results]


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
        assert r["max_param_error"] < 1e-4, f"rank {rank}: {r['worst_param']}"
    assert losses == plan.dp * plan.cp * plan.tp


def assert_events_as_simulated(plan, runs: list[dict]) -> None:
    """On every simulated rank: the event names of the lowered program, and each communication event as
    many times."""
    from collections import Counter

    from parsim.lowering.lower import lower

    program = lower(plan)
    for rank in program.ranks:
        predicted = program.rank_ops(rank)
        measured = runs[rank]["events"]
        assert set(measured) == {op.name for op in predicted}, f"rank {rank}"
        comm = Counter(op.name for op in predicted if op.kind in ("collective", "send", "recv"))
        assert Counter(n for n in measured if n in comm) == comm, f"rank {rank}"
