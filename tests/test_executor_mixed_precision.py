"""bf16 plans train as Megatron-LM and FSDP2 train them: bf16 weights and activations, gradients accumulated and
reduced in the plan's reduce_dtype (fp32 by default), AdamW on fp32 master weights.

Each plan takes one step, AdamW included, on 2 or 4 gloo ranks. Its losses,
gradients and updated weights must equal the single-process reference in bf16
(to bf16's rounding: the reference sums microbatches and replicas in bf16, the
ranks in the reduce dtype), and every communication event must move the bytes
the simulator prices for it: gradients in the reduce dtype, weights in bf16.
"""

from __future__ import annotations

import importlib.util

import pytest
from reference_runs import BF16_EPS, FIRST_STEP_SIGN_FLIP, assert_events_as_simulated, plan_runs, verify_plans

from parsim.lowering.lower import lower
from parsim.workload.plan import load_plan

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
pytestmark = needs_torch

GPT = {"kind": "transformer", "name": "gpt", "num_layers": 4, "hidden": 32, "num_heads": 4, "num_kv_heads": 2,
       "ffn_hidden": 64, "seq_len": 16, "vocab_size": 64}
TIED = dict(GPT, tied_embeddings=True)
BATCH = {"microbatch_size": 2, "num_microbatches": 2}
BUCKETS = {"grad_sync": "bucketed", "bucket_size": "8KiB", "overlap": True}


def _plan(parallel: dict, data_parallel: dict, model: dict = GPT, dtype: str = "bf16", **settings) -> object:
    return load_plan({"model": model, "parallel": parallel, "batch": BATCH, "schedule": "1f1b", "dtype": dtype,
                      "data_parallel": data_parallel, **settings})


PLANS = {
    2: {
        "ddp dp2, overlapped buckets": _plan({"dp": 2}, BUCKETS),
        "ddp dp2, reduced in bf16": _plan({"dp": 2}, dict(BUCKETS, reduce_dtype="bf16")),
        "ddp dp2, one all-reduce per parameter": _plan({"dp": 2}, {"grad_sync": "per_param"}),
        "fp32 weights, reduced in bf16": _plan({"dp": 2}, dict(BUCKETS, reduce_dtype="bf16"), dtype="fp32"),
        "zero1 dp2": _plan({"dp": 2}, dict(BUCKETS, zero=1)),
        "fsdp dp2": _plan({"dp": 2}, {"grad_sync": "fsdp"}),
    },
    4: {
        "zero2 dp2 x pp2": _plan({"dp": 2, "pp": 2}, dict(BUCKETS, zero=2)),
        "ddp dp2 x pp2, tied embeddings across stages": _plan({"dp": 2, "pp": 2}, BUCKETS, TIED),
        "ddp dp2 x tp2, sequence parallel": _plan({"dp": 2, "tp": 2}, BUCKETS, sequence_parallel=True),
        "fsdp dp2 x pp2": _plan({"dp": 2, "pp": 2}, {"grad_sync": "fsdp"}),
    },
}
CASES = [(world, name) for world, plans in PLANS.items() for name in plans]


@pytest.fixture(scope="module")
def results() -> dict[int, list[list[dict]]]:
    return {world: verify_plans(plans, world, timeout_s=150) for world, plans in PLANS.items()}


def _runs(results, world: int, name: str) -> list[dict]:
    return plan_runs(results[world], PLANS[world], name)


@pytest.mark.multiproc
@pytest.mark.parametrize("world,name", CASES)
def test_a_bf16_step_equals_the_single_process_step(results, world, name):
    plan = PLANS[world][name]
    runs = _runs(results, world, name)
    losses = 0
    for rank, r in enumerate(runs):
        if r["loss"] is not None:
            losses += 1
            assert r["loss"] == pytest.approx(r["reference_loss"], rel=4 * BF16_EPS), f"rank {rank}"
        assert r["max_grad_error"] < 4 * BF16_EPS, f"rank {rank}: {r['worst_grad']}"
        assert r["max_param_error"] < FIRST_STEP_SIGN_FLIP, f"rank {rank}"
    assert losses == plan.dp * plan.tp
    assert_events_as_simulated(plan, runs)


@pytest.mark.multiproc
@pytest.mark.parametrize("world,name", CASES)
def test_every_collective_moves_the_bytes_the_simulator_prices(results, world, name):
    """Gradient all-reduces and reduce-scatters in the reduce dtype, weight all-gathers in the weights' dtype,
    activations in bf16: what each rank measured, name by name, against the lowered program (padding to a
    multiple of the group's size aside)."""
    plan = PLANS[world][name]
    program = lower(plan)
    for rank in program.ranks:
        measured = _runs(results, world, name)[rank]["comm_bytes"]
        predicted = {op.name: op.nbytes for op in program.rank_ops(rank) if op.kind in ("collective", "send", "recv")}
        for op_name, nbytes in predicted.items():
            if op_name in measured and nbytes:
                assert measured[op_name] == pytest.approx(nbytes, rel=0.05), f"rank {rank}: {op_name}"
