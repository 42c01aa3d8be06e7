"""Parallelisms compose on 4 gloo ranks: DP x PP, DP x TP and TP x PP train exactly like one process.

Each plan of the tiny transformer (and the lecture's TP on 4 ranks) takes one
step, AdamW included, and every rank's loss, gradients and weights must equal
the single-process reference. Tied embeddings are covered on one rank (one
shared table) and across pipeline ranks (two copies whose gradients are
summed). Every plan must record exactly the events the simulator predicts
for the ranks it simulates.
"""

from __future__ import annotations

import importlib.util

import pytest
from reference_runs import assert_events_as_simulated, assert_step_equals_reference, verify_plans

from parsim.workload.plan import load_plan

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
pytestmark = needs_torch

WORLD = 4
GPT = {"kind": "transformer", "name": "gpt", "num_layers": 4, "hidden": 32, "num_heads": 4, "num_kv_heads": 2,
       "ffn_hidden": 64, "seq_len": 16, "vocab_size": 64}
TIED = dict(GPT, tied_embeddings=True)
BATCH = {"microbatch_size": 2, "num_microbatches": 2}

PLANS = {
    "dp2 x pp2, 1f1b, buckets": load_plan({
        "model": GPT, "parallel": {"dp": 2, "pp": 2}, "batch": BATCH, "schedule": "1f1b",
        "data_parallel": {"grad_sync": "bucketed", "bucket_size": "8KiB", "overlap": True}}),
    "dp2 x tp2, per-parameter sync": load_plan({
        "model": GPT, "parallel": {"dp": 2, "tp": 2}, "batch": BATCH, "data_parallel": {"grad_sync": "per_param"}}),
    "tp2 x pp2, zero-bubble": load_plan({
        "model": GPT, "parallel": {"tp": 2, "pp": 2}, "batch": BATCH, "schedule": "zero-bubble"}),
    "tp2 x pp2, zero-bubble, tied across stages": load_plan({
        "model": TIED, "parallel": {"tp": 2, "pp": 2}, "batch": BATCH, "schedule": "zero-bubble"}),
    "dp2 x tp2, tied on one rank": load_plan({
        "model": dict(TIED, ffn_type="gelu", position_embedding="learned"), "parallel": {"dp": 2, "tp": 2},
        "batch": {"microbatch_size": 2, "num_microbatches": 1}}),
    "course tp on 4 ranks": load_plan({
        "model": {"kind": "mlp", "name": "mlp", "num_layers": 4, "width": 64, "batch_size": 16},
        "parallel": {"tp": WORLD}, "tensor_parallel": "allgather"}),
}


@pytest.fixture(scope="module")
def results() -> list[list[dict]]:
    return verify_plans(PLANS, WORLD, timeout_s=150)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", PLANS)
def test_composed_step_equals_single_process(results, name):
    index = list(PLANS).index(name)
    assert_step_equals_reference(PLANS[name], [results[rank][index] for rank in range(WORLD)])


@pytest.mark.multiproc
@pytest.mark.parametrize("name", PLANS)
def test_events_match_the_simulated_program(results, name):
    """Same names, and the same number of each communication event, on every simulated rank."""
    index = list(PLANS).index(name)
    assert_events_as_simulated(PLANS[name], [results[rank][index] for rank in range(WORLD)])
