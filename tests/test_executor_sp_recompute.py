"""Sequence parallelism (its collectives in line or beside the GEMMs) and full activation recomputation
on 4 gloo ranks train exactly like one process, with replicated or sharded (ZeRO-1/2, FSDP) data parallelism.

Megatron-style TP with sequence parallelism (all-gather into each block,
reduce-scatter out of it, norm gradients summed over the tp group) and
torch.utils.checkpoint recomputation (the whole layer re-run, collectives
included) change where activations live and what runs twice, never the
numbers: loss, gradients and weights after AdamW must equal the reference.
The collectives each rank records must be exactly those the simulator
lowers, by name and count: the recomputed forward's as ``dir=rec<i>``, the
norm-gradient sum as ``all_reduce tp params=norms``.
"""

from __future__ import annotations

import importlib.util
from collections import Counter

import pytest
from reference_runs import assert_step_equals_reference, verify_plans

from parsim.lowering.lower import lower
from parsim.workload.plan import load_plan

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")

WORLD = 4
GPT = {"kind": "transformer", "name": "gpt", "num_layers": 4, "hidden": 32, "num_heads": 4, "num_kv_heads": 2,
       "ffn_hidden": 64, "seq_len": 16, "vocab_size": 64}
BATCH = {"microbatch_size": 2, "num_microbatches": 2}


def plan(parallel: dict, **extra):
    return load_plan({"model": extra.pop("model", GPT), "parallel": parallel, "batch": BATCH, **extra})


PLANS = {
    "dp2 x tp2, sequence parallel": plan({"dp": 2, "tp": 2}, sequence_parallel=True),
    "tp4, sequence parallel, gelu, tied": plan({"tp": 4}, sequence_parallel=True,
                                               model=dict(GPT, num_kv_heads=4, ffn_type="gelu",
                                                          tied_embeddings=True)),
    "tp2 x pp2, full recompute": plan({"tp": 2, "pp": 2}, activation_recompute="full"),
    "dp2 x pp2, recompute 1 layer per stage, gpipe": plan(
        {"dp": 2, "pp": 2}, activation_recompute={"granularity": "full", "layers": 1}, schedule="gpipe"),
    "tp2 x pp2, sequence parallel + full recompute": plan({"tp": 2, "pp": 2}, sequence_parallel=True,
                                                          activation_recompute="full"),
    # tp_comm_overlap: the same collectives beside the GEMMs (executor.train.tp_overlap), the same numbers.
    "dp2 x tp2, TP overlap": plan({"dp": 2, "tp": 2}, sequence_parallel=True, tp_comm_overlap=True),
    "tp4, TP overlap, gelu": plan({"tp": 4}, sequence_parallel=True, tp_comm_overlap=True,
                                  model=dict(GPT, num_kv_heads=4, ffn_type="gelu")),
    "tp2 x pp2, TP overlap + full recompute": plan({"tp": 2, "pp": 2}, sequence_parallel=True,
                                                   tp_comm_overlap=True, activation_recompute="full"),
    # sharded data parallelism with them: the norm gradients' sum over tp runs on what each rank holds after
    # the data-parallel sync (its ZeRO slices, its FSDP shard)
    "dp2 x tp2, sequence parallel, FSDP (torchtitan's 2-D)": plan({"dp": 2, "tp": 2}, sequence_parallel=True,
                                                                  data_parallel={"grad_sync": "fsdp"}),
    "dp2 x tp2, sequence parallel, ZeRO-1": plan({"dp": 2, "tp": 2}, sequence_parallel=True, data_parallel={
        "grad_sync": "bucketed", "bucket_size": "8KiB", "zero": 1}),
    "dp2 x tp2, TP overlap, ZeRO-2": plan({"dp": 2, "tp": 2}, sequence_parallel=True, tp_comm_overlap=True,
                                          data_parallel={"grad_sync": "bucketed", "zero": 2}),
    "tp2 x pp2, sequence parallel, FSDP": plan({"tp": 2, "pp": 2}, sequence_parallel=True,
                                               data_parallel={"grad_sync": "fsdp"}),
    # Megatron-LM's column-parallel backward with its collectives in line: the input still gathered again
    "dp2 x tp2, sequence parallel, backward collectives in line": plan({"dp": 2, "tp": 2}, sequence_parallel=True,
                                                                       tp_async_backward=False),
    "dp2 x tp2, backward collectives in line": plan({"dp": 2, "tp": 2}, tp_async_backward=False),
    # a split backward keeps the gathered input for its weight-gradient pass
    "tp2 x pp2, sequence parallel, zero-bubble": plan({"tp": 2, "pp": 2}, sequence_parallel=True,
                                                      schedule="zero-bubble"),
}


@pytest.fixture(scope="module")
def results() -> list[list[dict]]:
    return verify_plans(PLANS, WORLD, timeout_s=200)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", PLANS)
def test_step_equals_single_process(results, name):
    index = list(PLANS).index(name)
    assert_step_equals_reference(PLANS[name], [results[rank][index] for rank in range(WORLD)])


@pytest.mark.multiproc
@pytest.mark.parametrize("name", PLANS)
def test_collectives_are_the_simulated_ones(results, name):
    program = lower(PLANS[name])
    for rank in program.ranks:
        comm = Counter(op.name for op in program.rank_ops(rank) if op.kind in ("collective", "send", "recv"))
        measured = Counter(n for n in results[rank][list(PLANS).index(name)]["events"]
                           if " tp " in n or n.startswith(("all_reduce", "all_gather", "reduce_scatter", "send",
                                                           "recv")))
        assert measured == comm, f"rank {rank}"


@pytest.mark.multiproc
def test_every_layer_collective_runs_again_in_the_recomputation(results):
    """Full recomputation re-runs each layer's forward whole: as many ``rec`` collectives as ``fwd`` ones."""
    for rank in range(WORLD):
        events = results[rank][list(PLANS).index("tp2 x pp2, full recompute")]["events"]
        forward = [n for n in events if "layer=layer." in n and "dir=fwd" in n]
        assert forward and len([n for n in events if "dir=rec" in n]) == len(forward)


def test_tp_overlap_the_executor_cannot_split_is_refused_in_one_line():
    from executor.train.runner import check_plan
    from parsim.errors import ParsimError

    with pytest.raises(ParsimError, match="with a split backward"):
        check_plan(plan({"tp": 2, "pp": 2}, sequence_parallel=True, tp_comm_overlap=True, schedule="zero-bubble"))
    with pytest.raises(ParsimError, match="splits into 4 equal parts"):
        check_plan(plan({"tp": 2}, sequence_parallel=True, tp_comm_overlap=True, model=dict(GPT, seq_len=12)))


def test_a_compute_span_keeps_the_waits_for_collectives_beside_it_as_gaps():
    """The executor's measured spans read like the simulator's merged ones: the compute stream's waits for
    an overlapped collective are gaps of the action's span (counted towards tp, not compute)."""
    from executor.train.trace_recorder import Recorder

    recorder = Recorder(0)
    with recorder.span("F stage=0 mb=0", "compute", "compute"):
        recorder.waited(1.0, 1.5)
        with recorder.span("reduce_scatter tp layer=layer.0 mb=0 dir=fwd1", "collective", "compute", phase="tp"):
            recorder.waited(2.0, 2.0)  # no wait at all: no gap
        recorder.waited(3.0, 3.25)
    collective, compute = recorder.events
    assert compute.args["gaps"] == [(1.0, 1.5), (3.0, 3.25)] and "gaps" not in collective.args
