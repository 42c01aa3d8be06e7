"""ZeRO-1/2 and FSDP2 (ZeRO-3), with HSDP, tensor and pipeline parallelism, train exactly like one process.

Each plan of the tiny transformer takes one step on 2 or 4 gloo ranks, AdamW
included: every rank's loss, the gradients it holds (ZeRO-1/2: the reduced
slice it owns; FSDP: its DTensor shards, gathered) and its weights after the
step must equal the single-process reference, and the rank must record
exactly the events the simulator lowers the plan to.
"""

from __future__ import annotations

import importlib.util
from collections import Counter

import pytest
from reference_runs import verify_plans

from parsim.errors import ParsimError
from parsim.lowering.lower import lower
from parsim.workload.plan import load_plan

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
pytestmark = needs_torch

GPT = {"kind": "transformer", "name": "gpt", "num_layers": 4, "hidden": 32, "num_heads": 4, "num_kv_heads": 2,
       "ffn_hidden": 64, "seq_len": 16, "vocab_size": 64}
BATCH = {"microbatch_size": 2, "num_microbatches": 2}


def _plan(parallel: dict, data_parallel: dict, schedule: str = "1f1b", **settings) -> object:
    return load_plan({"model": GPT, "parallel": parallel, "batch": BATCH, "schedule": schedule,
                      "data_parallel": data_parallel, **settings})


ZERO1 = {"grad_sync": "bucketed", "bucket_size": "8KiB", "zero": 1}
FSDP = {"grad_sync": "fsdp"}
PLANS = {
    2: {
        "zero1 dp2, overlapped buckets": _plan({"dp": 2}, dict(ZERO1, overlap=True)),
        "zero1 dp2, weights gathered in the next forward": _plan({"dp": 2}, dict(ZERO1, overlap_param_gather=True)),
        "fsdp dp2": _plan({"dp": 2}, FSDP),
        "fsdp dp2, kept unsharded after forward": _plan({"dp": 2}, dict(FSDP, reshard_after_forward=False)),
        "zero1 dp2, fused AdamW": _plan({"dp": 2}, ZERO1, adamw="fused"),
        "fsdp dp2, fused AdamW": _plan({"dp": 2}, FSDP, adamw="fused"),
    },
    4: {
        "zero2 dp4, hsdp shard_group 2, buckets after the backward": _plan(
            {"dp": 4}, {"grad_sync": "bucketed", "bucket_size": "8KiB", "zero": 2, "shard_group": 2,
                        "overlap": False}),
        "zero2 dp2 x pp2, 1f1b, overlapped buckets": _plan({"dp": 2, "pp": 2}, dict(ZERO1, zero=2, overlap=True)),
        "fsdp dp4, hsdp shard_group 2": _plan({"dp": 4}, dict(FSDP, shard_group=2)),
        "fsdp dp2 x tp2 (2-D)": _plan({"dp": 2, "tp": 2}, FSDP),
        "fsdp dp2 x pp2, 1f1b": _plan({"dp": 2, "pp": 2}, FSDP),
        "fsdp dp2 x pp2, 1f1b, kept unsharded after forward": _plan(
            {"dp": 2, "pp": 2}, dict(FSDP, reshard_after_forward=False)),
    },
}
CASES = [(world, name) for world, plans in PLANS.items() for name in plans]


@pytest.fixture(scope="module")
def results() -> dict[int, list[list[dict]]]:
    return {world: verify_plans(plans, world, timeout_s=150) for world, plans in PLANS.items()}


def _result(results, world: int, name: str, rank: int) -> dict:
    return results[world][rank][list(PLANS[world]).index(name)]


@pytest.mark.multiproc
@pytest.mark.parametrize("world,name", CASES)
def test_sharded_step_equals_single_process(results, world, name):
    plan = PLANS[world][name]
    losses = 0
    for rank in range(world):
        r = _result(results, world, name, rank)
        if r["loss"] is not None:
            losses += 1
            assert r["loss"] == pytest.approx(r["reference_loss"], rel=1e-5), f"rank {rank}"
        assert r["max_grad_error"] < 1e-5, f"rank {rank}: {r['worst_grad']}"
        assert r["max_param_error"] < 1e-4, f"rank {rank}"
    assert losses == plan.dp * plan.tp  # every last-stage rank reports its replica's loss


def _fsdp2_gathers(plan, pp_rank: int) -> list[str]:
    """The all-gathers FSDP2 issues on ``pp_rank`` with ``reshard_after_forward`` off.

    A unit stays unsharded from its forward until the end of the next backward
    through it (FSDP2 reshards after every backward). Without pipelining
    (F, B, F, B) that is the lowering's "a gather before every forward, none
    before a backward"; under 1F1B the warm-up's later forwards find the units
    still gathered, and the backward after the first one has to gather again.
    """
    sharded = {s: True for s in plan.pipeline.stages_of(pp_rank)}
    names = []
    for action in plan.pipeline.actions[pp_rank]:
        s, mb = action.stage, action.microbatch
        if sharded[s]:
            order = [c.name for c in plan.stage_costs(s)]
            direction = "fwd" if action.kind == "F" else "bwd"
            names += [f"all_gather fsdp layer={layer} stage={s} mb={mb} dir={direction}"
                      for layer in (order if action.kind == "F" else reversed(order))]
        sharded[s] = action.kind == "B"
    return names


def _predicted(plan, rank: int) -> list[str]:
    """The lowered op names of ``rank``; with ``reshard_after_forward`` off, FSDP2's gathers in place of the
    lowering's (which gathers before every forward, pipelined or not)."""
    names = [op.name for op in lower(plan).rank_ops(rank)]
    if plan.reshard_after_forward:
        return names
    return [n for n in names if not n.startswith("all_gather fsdp")] + _fsdp2_gathers(plan, plan.coords(rank).pp)


@pytest.mark.multiproc
@pytest.mark.parametrize("world,name", CASES)
def test_events_match_the_simulated_program(results, world, name):
    """Same names, and the same number of each communication event, on every simulated rank."""
    plan = PLANS[world][name]
    for rank in lower(plan).ranks:
        predicted = _predicted(plan, rank)
        measured = _result(results, world, name, rank)["events"]
        assert set(measured) == set(predicted), f"rank {rank}"
        comm = Counter(n for n in predicted if not n.startswith(("F ", "B ", "optimizer")))
        assert Counter(n for n in measured if n in comm) == comm, f"rank {rank}"


def test_without_pipelining_fsdp2_gathers_as_the_lowering_does_when_kept_unsharded():
    """The one difference :func:`_predicted` allows appears only under pipelining."""
    plan = PLANS[2]["fsdp dp2, kept unsharded after forward"]
    lowered = [op.name for op in lower(plan).rank_ops(0) if op.name.startswith("all_gather fsdp")]
    assert lowered == _fsdp2_gathers(plan, 0)
    pipelined = PLANS[4]["fsdp dp2 x pp2, 1f1b, kept unsharded after forward"]
    lowered = [op.name for op in lower(pipelined).rank_ops(0) if op.name.startswith("all_gather fsdp")]
    assert sorted(lowered) != sorted(_fsdp2_gathers(pipelined, 0))


def test_fsdp_with_a_split_backward_or_tied_embeddings_is_refused_in_one_line():
    from executor.train.runner import check_plan

    zero_bubble = _plan({"dp": 2, "pp": 2}, FSDP, schedule="zero-bubble")
    with pytest.raises(ParsimError, match="FSDP with a split-backward"):
        check_plan(zero_bubble)
    tied = load_plan({"model": dict(GPT, tied_embeddings=True), "parallel": {"dp": 2}, "batch": BATCH,
                      "data_parallel": FSDP})
    with pytest.raises(ParsimError, match="tied embeddings under FSDP"):
        check_plan(tied)


@pytest.mark.multiproc
def test_weights_gathered_in_the_next_forward_train_like_weights_gathered_after_the_step():
    """Three steps of ZeRO-1 with and without Megatron's overlap_param_gather: the same losses and weights
    (the second and third steps' forwards wait for the first buckets in their pre-hooks)."""
    from executor.launch import launch
    from executor.train.verify import steps_rank

    after, during = (_plan({"dp": 2}, dict(ZERO1, overlap_param_gather=o)) for o in (False, True))
    runs = launch(steps_rank, 2, ([after.to_dict(), during.to_dict()], 3), backend="gloo", timeout_s=120)
    for rank, (a, d) in enumerate(runs):
        assert d["losses"] == pytest.approx(a["losses"], rel=1e-6), f"rank {rank}"
        assert len({loss for loss in a["losses"]}) == 3  # the weights did change between steps
        for name, weights in a["params"].items():
            assert abs(d["params"][name] - weights).max() <= 1e-6 * abs(weights).max(), name
