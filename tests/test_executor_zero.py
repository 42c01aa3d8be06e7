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
        "fsdp dp2 x pp2, 1f1b, resharded after forward": _plan(
            {"dp": 2, "pp": 2}, dict(FSDP, reshard_after_forward=True)),
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


@pytest.mark.multiproc
@pytest.mark.parametrize("world,name", CASES)
def test_events_match_the_simulated_program(results, world, name):
    """Same names, and the same number of each communication event, on every simulated rank."""
    plan = PLANS[world][name]
    for rank in lower(plan).ranks:
        predicted = [op.name for op in lower(plan).rank_ops(rank)]
        measured = _result(results, world, name, rank)["events"]
        assert set(measured) == set(predicted), f"rank {rank}"
        comm = Counter(n for n in predicted if not n.startswith(("F ", "B ", "optimizer")))
        assert Counter(n for n in measured if n in comm) == comm, f"rank {rank}"


def _fsdp2_gathers(plan, pp_rank: int) -> list[str]:
    """The all-gathers FSDP2 issues on ``pp_rank`` under ``torch.distributed.pipelining``'s rules, from its
    state: a stage's units gather when sharded, reshard after a forward with ``reshard_after_forward``, and
    stay gathered after every backward but the last."""
    sharded = {s: True for s in plan.pipeline.stages_of(pp_rank)}
    names = []
    for action in plan.pipeline.actions[pp_rank]:
        s, mb = action.stage, action.microbatch
        if sharded[s]:
            order = [c.name for c in plan.stage_costs(s)]
            direction = "fwd" if action.kind == "F" else "bwd"
            names += [f"all_gather fsdp layer={layer} stage={s} mb={mb} dir={direction}"
                      for layer in (order if action.kind == "F" else reversed(order))]
        last = mb == plan.num_microbatches - 1
        sharded[s] = plan.reshard_after_forward if action.kind == "F" else last
    return names


@pytest.mark.parametrize("reshard_after_forward, passes", [(False, 1), (True, 5)])
def test_under_a_pipeline_fsdp_gathers_as_torch_pipelining_drives_fsdp2(reshard_after_forward, passes):
    """Stage 0 of 1F1B over 4 microbatches runs F0 F1 B0 F2 B1 F3 B2 B3. Without resharding after forward
    (torchtitan's default under a pipeline) its 3 units (embedding, 2 layers) are gathered once, in F0.
    Resharding after each forward, F0, F1 and the backwards that follow a forward (B0, B1, B2) gather: B3
    finds B2's weights still gathered. Gradients are reduce-scattered once, after B3."""
    plan = _plan({"dp": 2, "pp": 2}, dict(FSDP, reshard_after_forward=reshard_after_forward),
                 batch={"microbatch_size": 1, "num_microbatches": 4})
    ops = lower(plan).rank_ops(0)
    lowered = [op.name for op in ops if op.name.startswith("all_gather fsdp")]
    assert lowered == _fsdp2_gathers(plan, 0)
    assert len(lowered) == 3 * passes
    scatters = [op.name for op in ops if op.name.startswith("reduce_scatter fsdp")]
    assert scatters == [f"reduce_scatter fsdp layer={c.name} stage=0 mb=3" for c in plan.stage_costs(0)[::-1]]
    assert load_plan(plan.to_dict()).reshard_after_forward is reshard_after_forward


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


def test_fsdp_s_collectives_are_recorded_on_the_stream_they_hold():
    """On a CPU, gloo's collective holds the thread that computes until it ends (the simulator lowers FSDP in
    line there too, ``fsdp_in_line``); on a GPU FSDP2 runs it on streams of its own."""
    import torch

    from executor.train.fsdp import _stream

    assert _stream(torch.zeros(1)) == "compute" and _stream(torch.zeros(1, device="meta")) == "comm"
